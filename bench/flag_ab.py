"""Two `maskwire up` settings side by side on the peers' workload (`../shared/peers`).

Runs the harness's `bench_maskwire.py` (8 chat prompts with their JSON schemas, greedy, 64 new
tokens; c1 and c8, unconstrained and constrained) once per variant per round, in the order
A B, B A, A B, ... so that drifts in the machine's load fall on both alike, and reports per
figure each round's B / A ratio and their median. Every constrained answer is validated by the
harness. Writes bench/results/<name>.json and, where matplotlib is installed, <name>.png.

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
    try:
        plot(out, path.with_suffix(".png"))
    except ImportError:
        print("matplotlib not installed: no plot")


def plot(out: dict[str, Any], path: Path) -> None:
    """Each figure's B / A ratio by round (dots) and their median (bar)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    keys = list(FIGURES)
    fig, ax = plt.subplots(figsize=(1.1 * len(keys) + 2, 4.5))
    medians = [out["median_b_over_a"][k] for k in keys]
    ax.bar(range(len(keys)), medians, color="#2a7fbf", alpha=0.6, label="median")
    for r in out["rounds"]:
        ax.plot(range(len(keys)), [r["b_over_a"][k] for k in keys], "o", color="#333333", ms=3)
    ax.axhline(1.0, color="#999999", lw=0.8)
    ax.set_xticks(
        range(len(keys)), [FIGURES[k][0] for k in keys], rotation=35, ha="right", fontsize=7
    )
    ax.set_ylabel("B / A")
    fig.suptitle(
        f"{out['what']}\n{out['cpu'].get('model', '?')}, {len(out['rounds'])} rounds", fontsize=7
    )
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    main()
