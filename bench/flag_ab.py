"""Two `maskwire up` settings side by side on the peers' workload (`../shared/peers`).

Runs the harness's `bench_maskwire.py` (8 chat prompts with their JSON schemas, greedy, 64 new
tokens; c1 and c8, unconstrained and constrained) once per variant per round, in the order
A B, B A, A B, ... so that drifts in the machine's load fall on both alike, and reports per
figure each round's B / A ratio and their median. Every constrained answer is validated by the
harness. Writes bench/results/<name>.json.

Usage: python bench/flag_ab.py --b-args="--worker-arg=--no-greedy-kernel" [--a-args=""]
       [--rounds 3] [--name N]
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

from vs_vllm import FIGURES, cpu_features, figures, run

ROOT = Path(__file__).resolve().parents[1]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--a-args", default="", help="variant A's extra `maskwire up` arguments")
    ap.add_argument("--b-args", required=True, help="variant B's extra `maskwire up` arguments")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--peers", type=Path, default=ROOT.parent / "shared" / "peers")
    ap.add_argument("--work", default=os.environ.get("PEERS_WORK", "/tmp/maskwire-peers"))
    ap.add_argument("--name", default="flag_ab", help="result file name (without extension)")
    a = ap.parse_args()

    env = {**os.environ, "PEERS_WORK": a.work}
    env["MASKWIRE"] = str(ROOT / ".venv" / "bin" / "maskwire")
    log = Path(a.work) / "flag_ab.log"
    log.parent.mkdir(parents=True, exist_ok=True)
    variants = {"A": a.a_args, "B": a.b_args}
    rounds: list[dict[str, Any]] = []
    for i in range(a.rounds):
        order = ("A", "B") if i % 2 == 0 else ("B", "A")
        results: dict[str, Any] = {}
        for v in order:
            tag = f"_ab{v}{i}_{int(time.time())}"
            bench = [sys.executable, str(a.peers / "bench_maskwire.py"), "--tag", tag]
            run([*bench, f"--up-args={variants[v]}"], env, log)
            summary = json.loads((Path(a.work) / "results" / f"maskwire{tag}.json").read_text())
            results[v] = {
                **figures(summary["summary"]),
                "valid": [summary["summary"][k] for k in ("c1_valid", "c8_valid")],
            }
        ratios = {k: results["B"][k] / results["A"][k] for k in FIGURES}
        rounds.append({"round": i + 1, "order": "".join(order), **results, "b_over_a": ratios})
        print(f"round {i + 1}: " + ", ".join(f"{k} {r:.3f}" for k, r in ratios.items()))

    out = {
        "what": "the peers harness's maskwire workload (../shared/peers/bench_maskwire.py), "
        f"variant B ({a.b_args!r}) over variant A ({a.a_args!r}), alternated A B, B A, ...",
        "date": datetime.date.today().isoformat(),
        "cpu": cpu_features(),
        "load_before": os.getloadavg()[0],
        "rounds": rounds,
        "median_b_over_a": {
            k: round(statistics.median(r["b_over_a"][k] for r in rounds), 3) for k in FIGURES
        },
    }
    path = ROOT / "bench" / "results" / f"{a.name}.json"
    path.write_text(json.dumps(out, indent=2) + "\n")
    print(json.dumps(out["median_b_over_a"], indent=2))
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
