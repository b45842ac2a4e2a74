"""How long a neighbour that has left is still paid for: throughput over time across a busy spell.

One `maskwire up` stack serves a steady load (8 clients, each streaming one unconstrained request
after another), quiet for `--quiet-s`, beside one process spinning on a core for `--busy-s`, then
quiet again for `--after-s`. Every token's arrival time is recorded, in 0.5 s bins. The figures:
the quiet rate (median of the first quiet spell's bins, its first 2 s left out); the rate beside
the neighbour and in the first 10 s after it; the seconds beside it at under a tenth of the quiet
rate (the full team stalled on the neighbour's core); and from the worker's thread-governor log
(its lines come along, timed from the neighbour's start and end), the seconds until the team
shrank after the neighbour came and until it was whole again after it left. `--versus-root DIR` runs the same on a second checkout (another
revision, e.g. a `git worktree`) right after, for a before/after in one sitting.

Usage: python bench/neighbour_leaves.py [--rounds 2] [--versus-root /tmp/old] [--name N]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from neighbour import (
    PROMPTS,
    RESULTS,
    Server,
    busy_neighbours,
    cpu_model,
    free_port,
    one_request,
)

BIN_S = 0.5
GOVERNOR_LINE = re.compile(r"^(\S+ \S+) INFO neuron_worker\.thread_governor: (.*)$")


def start_stack(root: Path, log_dir: Path) -> Server:
    """`maskwire up` from `root`'s sources: started in `root`, whose packages `python -m` then
    finds first (before an editable install's), as do the services it starts."""
    port = free_port()
    argv = [sys.executable, "-m", "maskwire.cli", "up", "--port", str(port), "--worker-port", "0"]
    argv += ["--grammar-port", "0", "--no-show-logs", "--log-dir", str(log_dir)]
    url = f"http://127.0.0.1:{port}"
    here = Path.cwd()
    os.chdir(root)
    try:
        return Server("maskwire", argv, f"{url}/v1", f"{url}/ready", None)
    finally:
        os.chdir(here)


def one_run(root: Path, args: argparse.Namespace) -> dict[str, Any]:
    log_dir = Path(tempfile.mkdtemp(prefix="maskwire-leaves-"))
    server = start_stack(root, log_dir)
    arrivals: list[float] = []
    stop = threading.Event()

    def client(i: int) -> None:
        while not stop.is_set():
            one_request(server, PROMPTS[i % len(PROMPTS)], False, args.max_tokens, arrivals)

    try:
        one_request(server, PROMPTS[0], False, 8)  # warm-up
        clients = [threading.Thread(target=client, args=(i,)) for i in range(8)]
        began = time.monotonic()
        for c in clients:
            c.start()
        time.sleep(args.quiet_s)
        with busy_neighbours(1):  # sleeps 1 s after starting it
            busy_from = time.monotonic() - 1.0
            time.sleep(args.busy_s - 1.0)
        busy_to = time.monotonic()
        time.sleep(args.after_s)
        stop.set()
        for c in clients:
            c.join()
    finally:
        server.stop()
    wall = {"busy_from": busy_from - began, "busy_to": busy_to - began}
    events = governor_events(log_dir / "worker.log", began)
    return (
        summarise(arrivals, began, wall, args)
        | team_changes(events, wall)
        | {"governor": [timed(e, wall) for e in events]}
    )


def summarise(
    arrivals: list[float], began: float, wall: dict[str, float], args: argparse.Namespace
) -> dict[str, Any]:
    end = args.quiet_s + args.busy_s + args.after_s
    bins = [0] * int(end / BIN_S + 1)
    for t in arrivals:
        i = int((t - began) / BIN_S)
        if 0 <= i < len(bins):
            bins[i] += 1
    rate = [n / BIN_S for n in bins]
    quiet = statistics.median(rate[int(2 / BIN_S) : int(wall["busy_from"] / BIN_S)])
    busy = statistics.median(
        rate[int((wall["busy_from"] + 2) / BIN_S) : int(wall["busy_to"] / BIN_S)]
    )
    beside = rate[int(wall["busy_from"] / BIN_S) : int(wall["busy_to"] / BIN_S)]
    after = rate[int(wall["busy_to"] / BIN_S) : int((wall["busy_to"] + 10) / BIN_S)]
    return {
        "tok_s_bins": rate,
        "quiet_tok_s": quiet,
        "busy_tok_s": busy,
        "after_10s_tok_s": sum(after) / len(after),
        "stalled_s": BIN_S * sum(r < 0.1 * quiet for r in beside),
        **wall,
    }


def team_changes(events: list[tuple[float, str]], wall: dict[str, float]) -> dict[str, Any]:
    """Seconds from the neighbour's start to the first shrink, and from its end to the team's
    return (None: it did not happen within the run)."""
    shrank = [at for at, text in events if " -> " in text and at >= wall["busy_from"]]
    back = [at for at, text in events if "back to" in text and at >= wall["busy_to"]]
    return {
        "shrank_after_s": shrank[0] - wall["busy_from"] if shrank else None,
        "whole_again_after_s": back[0] - wall["busy_to"] if back else None,
    }


def governor_events(log: Path, began: float) -> list[tuple[float, str]]:
    """The governor's log lines, each with its time in seconds since `began`."""
    events = []
    # The log's wall-clock stamps against this process's monotonic clock.
    offset = time.time() - time.monotonic()
    for line in log.read_text().splitlines() if log.exists() else []:
        m = GOVERNOR_LINE.match(line)
        if m is None:
            continue
        stamp = time.mktime(time.strptime(m[1].split(",")[0], "%Y-%m-%d %H:%M:%S"))
        stamp += int(m[1].split(",")[1]) / 1000
        events.append((stamp - offset - began, m[2]))
    return events


def timed(event: tuple[float, str], wall: dict[str, float]) -> str:
    at, text = event
    if at < wall["busy_from"]:
        return f"quiet +{at:.1f} s: {text}"
    if at < wall["busy_to"]:
        return f"neighbour +{at - wall['busy_from']:.1f} s: {text}"
    return f"after +{at - wall['busy_to']:.1f} s: {text}"


def plot(data: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(9, 3.6))
    for label, runs in data["runs"].items():
        for i, run in enumerate(runs):
            xs = [k * BIN_S for k in range(len(run["tok_s_bins"]))]
            ax.plot(xs, run["tok_s_bins"], lw=0.8, label=f"{label} {i + 1}")
    first = next(iter(data["runs"].values()))[0]
    ax.axvspan(first["busy_from"], first["busy_to"], color="grey", alpha=0.2, label="neighbour")
    ax.set_xlabel("s")
    ax.set_ylabel("tok/s (8 streams)")
    ax.legend(fontsize=7)
    ax.set_title(f"a neighbour that leaves ({data['cpu']})", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quiet-s", type=float, default=12.0)
    parser.add_argument("--busy-s", type=float, default=25.0)
    parser.add_argument("--after-s", type=float, default=30.0)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--versus-root", type=Path, help="a second checkout, run alternately")
    parser.add_argument("--name", default="neighbour_leaves")
    args = parser.parse_args()

    roots = {"this": Path(__file__).resolve().parents[1]}
    if args.versus_root is not None:
        roots["versus"] = args.versus_root.resolve()
    data: dict[str, Any] = {
        "cpu": cpu_model(),
        "cores": os.cpu_count(),
        "loadavg_start": os.getloadavg(),
        "date": time.strftime("%Y-%m-%d"),
        "roots": {k: str(v) for k, v in roots.items()},
        "runs": {k: [] for k in roots},
    }
    for r in range(args.rounds):
        for label, root in roots.items():
            run = one_run(root, args)
            data["runs"][label].append(run)
            print(
                f"round {r + 1} {label}: quiet {run['quiet_tok_s']:.0f} tok/s, beside the "
                f"neighbour {run['busy_tok_s']:.0f} ({run['stalled_s']:.1f} s under a tenth), "
                f"first 10 s after {run['after_10s_tok_s']:.0f}; shrank "
                f"{run['shrank_after_s']} s after it came, whole "
                f"{run['whole_again_after_s']} s after it left",
                flush=True,
            )
            for event in run["governor"]:
                print("   ", event, flush=True)
    data["loadavg_end"] = os.getloadavg()
    for figure in ("stalled_s", "shrank_after_s", "whole_again_after_s", "after_10s_tok_s"):
        data[figure] = {k: [run[figure] for run in v] for k, v in data["runs"].items()}
    RESULTS.mkdir(parents=True, exist_ok=True)
    out = RESULTS / f"{args.name}.json"
    out.write_text(json.dumps(data, indent=2) + "\n")
    plot(data, out.with_suffix(".png"))
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
