"""A decode pass on this CPU: the compiled forward graph against the fused decode step.

The embedded SmolLM2-135M as the worker serves it (the checkpoint's Q4_1 layers and Q8_0 head
through the worker's kernels; bf16 as on an AVX512-BF16 host, or `--dtype float32` as on an
AVX2-only one, through its fp32 kernels), one token per row through `graphs.ForwardRunner`: `graph` is
the compiled dynamic graph (saved and loaded as the worker does, in a temporary directory),
`fused` is `neuron_worker.model.fused_decode` (one C++ call per pass). Rows 1 (a decode padded to
two rows, as the engine sends it), 4 and 8, every row at the same context. The variants run on
the same model and caches, interleaved per repeat; each figure is the median of `--repeats`
timings of `--calls` passes, and each ratio the median of the per-repeat ratios.

Writes bench/results/decode_step.json (float32: decode_step_f32.json) and .png. bf16 needs the
AVX512-BF16 kernels. Usage: python bench/decode_step.py [--dtype float32] [--context 100]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.forward import cpu_info  # noqa: E402
from neuron_worker import kernels  # noqa: E402
from neuron_worker.backends import create_backend  # noqa: E402
from neuron_worker.graphs import KV_ALIGN, ForwardRunner, Pass  # noqa: E402
from neuron_worker.model import Transformer, load_model  # noqa: E402

RESULTS = ROOT / "bench" / "results"
ROWS = (1, 4, 8)
MAX_ROWS, MAX_SEQ = 8, 2048


def decode_pass(rows: int, context: int) -> Pass:
    """`rows` rows at position `context` in slots 0.., as the engine packs them (1 row: plus a
    padding row on the pad slot)."""
    n = max(rows, 2)
    positions = np.full((n, 1), context, dtype=np.int64)
    slots = np.arange(n, dtype=np.int64)
    positions[rows:] = -1
    slots[rows:] = MAX_ROWS
    return Pass(
        tokens=np.full((n, 1), 100, dtype=np.int64),
        positions=positions,
        slots=slots,
        last=np.arange(n, dtype=np.int64),
        kv_len=-(-(context + 1) // KV_ALIGN) * KV_ALIGN,
    )


def timed(runner: ForwardRunner, p: Pass, calls: int) -> float:
    start = time.perf_counter()
    for _ in range(calls):
        runner.run(p)
    return (time.perf_counter() - start) / calls


def fused_runner(model: Transformer) -> ForwardRunner:
    """`model` with caches for the comparisons' passes, through the fused decode step."""
    model.setup_caches(MAX_ROWS + 1, MAX_SEQ)
    backend = create_backend("cpu", compile=True)
    return ForwardRunner(
        model, backend, max_rows=MAX_ROWS, max_seq=MAX_SEQ, pad_slot=MAX_ROWS, fused_decode=True
    )


def comparison_args(parser: argparse.ArgumentParser, out: Path) -> argparse.Namespace:
    """`compare`'s command line (context, repeats, calls, the results file); refuses to run
    without the AVX512-BF16 kernels."""
    parser.add_argument("--context", type=int, default=100, help="each row's position")
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--calls", type=int, default=100, help="passes per timing")
    parser.add_argument("--out", type=Path, default=out)
    args = parser.parse_args()
    if not kernels.bf16_available():
        raise SystemExit("no AVX512-BF16 kernels on this CPU")
    return args


def compare(
    variants: dict[str, tuple[ForwardRunner, Callable[[], object]]],
    *,
    context: int,
    repeats: int,
    calls: int,
    rows: tuple[int, ...] = (1, 2, 4, 8),
) -> list[dict[str, Any]]:
    """Two variants of the same passes, each a runner and what to call before its turn (a
    kernel setting): per row count, their logits must be equal bit for bit, then `repeats`
    turns that swap which goes first, `calls` passes each. A case holds each variant's median
    ms, its samples, and the second variant's time over the first's (median of the per-repeat
    ratios) as `speedup` of the first."""
    first, second = variants
    cases = []
    for n in rows:
        p = decode_pass(n, context)
        out = {}
        for name, (runner, setup) in variants.items():
            setup()
            out[name] = runner.run(p)[:n].clone()
        if not torch.equal(out[first], out[second]):
            raise SystemExit(f"{n} rows: the logits differ")
        samples: dict[str, list[float]] = {name: [] for name in variants}
        for repeat in range(repeats):
            for name in (first, second) if repeat % 2 == 0 else (second, first):
                runner, setup = variants[name]
                setup()
                samples[name].append(timed(runner, p, calls) * 1e3)
        ratios = [b / a for a, b in zip(samples[first], samples[second], strict=True)]
        case = {
            "rows": n,
            "ms": {name: statistics.median(s) for name, s in samples.items()},
            "samples_ms": samples,
            "speedup": statistics.median(ratios),
            "logits_equal": True,
        }
        cases.append(case)
        print(
            f"rows {n}: {second} {case['ms'][second]:.2f} ms, {first} {case['ms'][first]:.2f} ms"
            f" ({case['speedup']:.3f}x, per repeat {min(ratios):.2f}-{max(ratios):.2f})",
            flush=True,
        )
    return cases


def plot(results: dict[str, Any], path: Path, variants: tuple[str, str], title: str) -> None:
    """Bars of each case's median ms per pass for the two `variants`, labelled with the case's
    `speedup`."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cases = results["cases"]
    fig, ax = plt.subplots(figsize=(7, 4))
    width = 0.4
    for i, name in enumerate(variants):
        xs = [x + (i - 0.5) * width for x in range(len(cases))]
        bars = ax.bar(xs, [c["ms"][name] for c in cases], width, label=name)
        ax.bar_label(bars, fmt="%.2f", fontsize=7)
    labels = [f"{c['rows']} row(s)\n{c['speedup']:.2f}x" for c in cases]
    ax.set_xticks(range(len(cases)), labels, fontsize=8)
    ax.set_ylabel("ms per decode pass (median)")
    load = results["load_average"]
    ax.set_title(
        f"{title}, {results['cpu']['model']}, {results['cpu']['torch_threads']} threads, "
        f"load {load['before']:.1f} -> {load['after']:.1f}",
        fontsize=8,
    )
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def save(results: dict[str, Any], path: Path, variants: tuple[str, str], title: str) -> None:
    """Write `results` (with the load average now) to `path` and its plot beside it."""
    results["load_average"]["after"] = os.getloadavg()[0]
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(results, indent=2) + "\n")
    plot(results, path.with_suffix(".png"), variants, title)
    print(f"wrote {path} and {path.with_suffix('.png')}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--context", type=int, default=100, help="each row's position")
    parser.add_argument("--repeats", type=int, default=9)
    parser.add_argument("--calls", type=int, default=40, help="passes per timing")
    parser.add_argument("--dtype", choices=("bfloat16", "float32"), default="bfloat16")
    parser.add_argument("--out", type=Path, help="default bench/results/decode_step[_f32].json")
    args = parser.parse_args()
    dtype = getattr(torch, args.dtype)
    if not (kernels.bf16_available() if dtype == torch.bfloat16 else kernels.available()):
        raise SystemExit(f"no {args.dtype} kernels on this CPU")
    suffix = "_f32" if dtype == torch.float32 else ""
    out_path: Path = args.out or RESULTS / f"decode_step{suffix}.json"
    results: dict[str, Any] = {
        "cpu": cpu_info(),
        "torch": torch.__version__,
        "context": args.context,
        "dtype": args.dtype,
        "load_average": {"before": os.getloadavg()[0]},
        "cases": [],
    }
    model = load_model("default", dtype=dtype, serving=True, quantize="int4").eval()
    model.setup_caches(MAX_ROWS + 1, MAX_SEQ)
    backend = create_backend("cpu", compile=True)
    with tempfile.TemporaryDirectory(prefix="maskwire-graphs-") as graphs:
        runners = {
            name: ForwardRunner(
                model,
                backend,
                max_rows=MAX_ROWS,
                max_seq=MAX_SEQ,
                pad_slot=MAX_ROWS,
                graph_dir=Path(graphs) if name == "graph" else None,
                fused_decode=name == "fused",
            )
            for name in ("graph", "fused")
        }
        for rows in ROWS:
            p = decode_pass(rows, args.context)
            out = {name: r.run(p)[:rows] for name, r in runners.items()}
            for r in runners.values():  # warm: the graph compiles at its first pass
                timed(r, p, 5)
            diff = float((out["fused"] - out["graph"]).abs().max())
            samples: dict[str, list[float]] = {name: [] for name in runners}
            for _ in range(args.repeats):
                for name, r in runners.items():
                    samples[name].append(timed(r, p, args.calls) * 1e3)
            ratios = [g / f for g, f in zip(samples["graph"], samples["fused"], strict=True)]
            case: dict[str, Any] = {
                "rows": rows,
                "ms": {name: statistics.median(s) for name, s in samples.items()},
                "samples_ms": samples,
                "speedup": statistics.median(ratios),
                "max_abs_logit_diff": diff,
                "same_argmax": bool(torch.equal(out["fused"].argmax(-1), out["graph"].argmax(-1))),
            }
            results["cases"].append(case)
            print(
                f"rows {rows}: graph {case['ms']['graph']:.2f} ms, fused {case['ms']['fused']:.2f}"
                f" ms ({case['speedup']:.2f}x, per repeat {min(ratios):.2f}-{max(ratios):.2f}),"
                f" logits max diff {diff:.2f}",
                flush=True,
            )
    title = f"SmolLM2 {args.dtype} decode pass at context {args.context}"
    save(results, out_path, ("graph", "fused"), title)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
