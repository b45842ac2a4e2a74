"""Two `maskwire up` settings (arguments or environment) side by side on the peers' workload
(`../shared/peers`).

Runs the harness's `bench_maskwire.py` (8 chat prompts with their JSON schemas, greedy, 64 new
tokens; c1 and c8, unconstrained and constrained) once per variant per round, in the order
A B, B A, B A, A B (then again), so that over every 4 rounds each variant goes first as often
and a steady drift in the machine's load falls on both alike, and reports per figure each round's
B / A ratio and their median. Two fresh stacks of the same code read up to a third apart by round
on these hosts (c1 and c8 constrained), so give it 4 rounds or more (an odd count lets one
variant go first more often: it is refused) and read small differences as none; where the
setting can be chosen per request, `bench/neighbour.py --versus-body` compares on one stack,
which is steadier. To compare two versions of the code, give one `--b-env
PYTHONPATH=<other checkout>`. Every constrained answer is validated by the harness. Writes
bench/results/<name>.json and, where matplotlib is installed, <name>.png.

Usage: python bench/flag_ab.py --b-args="--worker-arg=--no-greedy-kernel" [--a-args=""]
       [--a-env NAME=VALUE] [--b-env NAME=VALUE] [--rounds 4] [--name N]
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

from vs_vllm import FIGURES, cpu_features, figures, run, with_latency

ROOT = Path(__file__).resolve().parents[1]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--a-args", default="", help="variant A's extra `maskwire up` arguments")
    ap.add_argument("--b-args", default="", help="variant B's extra `maskwire up` arguments")
    for v in "ab":
        ap.add_argument(
            f"--{v}-env",
            action="append",
            default=[],
            metavar="NAME=VALUE",
            help=f"an environment variable for variant {v.upper()}'s stack (repeatable)",
        )
    ap.add_argument("--rounds", type=int, default=4, help="an even number (module docstring)")
    ap.add_argument("--peers", type=Path, default=ROOT.parent / "shared" / "peers")
    ap.add_argument("--work", default=os.environ.get("PEERS_WORK", "/tmp/maskwire-peers"))
    ap.add_argument("--name", default="flag_ab", help="result file name (without extension)")
    a = ap.parse_args()
    if a.rounds < 2 or a.rounds % 2:
        ap.error("--rounds must be even (each variant goes first in half of them)")
    if (a.a_args, a.a_env) == (a.b_args, a.b_env):
        ap.error("the variants are the same: give --b-args or --b-env")
    extra_env: dict[str, dict[str, str]] = {}
    for v, pairs in (("A", a.a_env), ("B", a.b_env)):
        if not all("=" in p for p in pairs):
            ap.error("--a-env / --b-env take NAME=VALUE")
        extra_env[v] = {name: value for name, _, value in (p.partition("=") for p in pairs)}

    env = {**os.environ, "PEERS_WORK": a.work}
    env["MASKWIRE"] = str(ROOT / ".venv" / "bin" / "maskwire")
    log = Path(a.work) / "flag_ab.log"
    log.parent.mkdir(parents=True, exist_ok=True)
    variants = {"A": a.a_args, "B": a.b_args}
    rounds: list[dict[str, Any]] = []
    for i in range(a.rounds):
        order = first_second(i)
        results: dict[str, Any] = {}
        for v in order:
            tag = f"_ab{v}{i}_{int(time.time())}"
            bench = [sys.executable, str(a.peers / "bench_maskwire.py"), "--tag", tag]
            # Run from the scratch folder: the services start with `python -m`, which puts the
            # working directory first on the path, ahead of a `PYTHONPATH` variant's checkout.
            run([*bench, f"--up-args={variants[v]}"], {**env, **extra_env[v]}, log, Path(a.work))
            result = json.loads((Path(a.work) / "results" / f"maskwire{tag}.json").read_text())
            summary = with_latency(result)
            results[v] = {
                **figures(summary["summary"]),
                "valid": [summary["summary"][k] for k in ("c1_valid", "c8_valid")],
            }
        ratios = {k: results["B"][k] / results["A"][k] for k in FIGURES}
        rounds.append({"round": i + 1, "order": "".join(order), **results, "b_over_a": ratios})
        print(f"round {i + 1}: " + ", ".join(f"{k} {r:.3f}" for k, r in ratios.items()))

    out = {
        "what": "the peers harness's maskwire workload (../shared/peers/bench_maskwire.py), "
        f"variant B ({a.b_args!r}, env {extra_env['B']}) over variant A ({a.a_args!r}, env "
        f"{extra_env['A']}), alternated A B, B A, B A, A B",
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


def first_second(i: int) -> tuple[str, str]:
    """Round i's order (from 0): A B, B A, B A, A B, and again."""
    return ("A", "B") if i % 4 in (0, 3) else ("B", "A")


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
