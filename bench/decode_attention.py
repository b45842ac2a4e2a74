"""Decode attention on this CPU: the worker's in-place kernel against gathering the slots + SDPA.

One layer of SmolLM2-135M's attention (3 KV heads of 64, 3 query heads each) for a pass of one
token per row: `kernel` is `neuron_worker.kernels.decode_attention` (each row's cache slot read
where it is), `gather+sdpa` is what the model runs without it (copy rows' slots out of the cache,
then `scaled_dot_product_attention` with a mask). Batches 1 and 8, contexts of 64 to 1024
positions, in the dtypes whose kernel this CPU has (fp32 on AVX2, bf16 on AVX512-BF16 too).
Variants are interleaved per repeat; each number is the median of `--repeats`.

Writes bench/results/decode_attention.json and .png. Usage: python bench/decode_attention.py
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.forward import cpu_info  # noqa: E402
from neuron_worker import kernels  # noqa: E402

RESULTS = ROOT / "bench" / "results"
KV_HEADS, GROUP, HEAD_DIM, SLOTS, CACHE_LEN = 3, 3, 64, 16, 2048
BATCHES = (1, 8)
CONTEXTS = (64, 256, 1024)


def variants(dtype: torch.dtype, batch: int, context: int) -> dict[str, Callable[[], torch.Tensor]]:
    g = torch.Generator().manual_seed(batch * context)
    cache = torch.randn(2, SLOTS, KV_HEADS, CACHE_LEN, HEAD_DIM, generator=g).to(dtype)
    kv_len = (context + 63) // 64 * 64  # the worker's KV length alignment
    k, v = cache[0, :, :, :kv_len], cache[1, :, :, :kv_len]
    slots = torch.arange(0, 2 * batch, 2)  # every other slot: not a contiguous block
    pos = torch.full((batch, 1), context - 1)
    q = torch.randn(batch, KV_HEADS, GROUP, HEAD_DIM, generator=g).to(dtype)
    mask = (torch.arange(kv_len) < context).expand(batch, 1, GROUP, kv_len)
    return {
        "kernel": lambda: kernels.decode_attention(q, k, v, slots, pos),
        "gather+sdpa": lambda: F.scaled_dot_product_attention(
            q, k[slots], v[slots], attn_mask=mask
        ),
    }


def timed(fn: Callable[[], Any], calls: int) -> float:
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    return (time.perf_counter() - start) / calls


def plot(results: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cases = results["cases"]
    fig, ax = plt.subplots(figsize=(9, 4))
    labels = [f"{c['dtype']} B={c['batch']} ctx={c['context']}" for c in cases]
    width = 0.4
    for i, name in enumerate(("kernel", "gather+sdpa")):
        xs = [x + (i - 0.5) * width for x in range(len(cases))]
        bars = ax.bar(xs, [c["us"][name] for c in cases], width, label=name)
        ax.bar_label(bars, fmt="%.0f", fontsize=7)
    ax.set_xticks(range(len(cases)), labels, fontsize=7, rotation=30, ha="right")
    ax.set_ylabel("µs per layer (median)")
    ax.set_yscale("log")
    load = results["load_average"]
    ax.set_title(
        f"Decode attention, one SmolLM2 layer, {results['cpu']['model']}, "
        f"{results['cpu']['torch_threads']} threads, load {load['before']:.1f} -> {load['after']:.1f}",
        fontsize=8,
    )
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--calls", type=int, default=50, help="calls per timing")
    parser.add_argument("--out", type=Path, default=RESULTS / "decode_attention.json")
    args = parser.parse_args()
    dtypes = [d for d in (torch.float32, torch.bfloat16) if kernels.attention_available(d)]
    if not dtypes:
        raise SystemExit("no decode attention kernel on this CPU")
    results: dict[str, Any] = {
        "cpu": cpu_info(),
        "torch": torch.__version__,
        "load_average": {"before": os.getloadavg()[0]},
        "cases": [],
    }
    for dtype in dtypes:
        for batch in BATCHES:
            for context in CONTEXTS:
                fns = variants(dtype, batch, context)
                out = {name: fn() for name, fn in fns.items()}
                err = float((out["kernel"].float() - out["gather+sdpa"].float()).abs().max())
                samples: dict[str, list[float]] = {name: [] for name in fns}
                for _ in range(args.repeats):  # interleaved
                    for name, fn in fns.items():
                        samples[name].append(timed(fn, args.calls) * 1e6)
                us = {name: statistics.median(s) for name, s in samples.items()}
                case = {
                    "dtype": str(dtype).removeprefix("torch."),
                    "batch": batch,
                    "context": context,
                    "us": us,
                    "speedup": us["gather+sdpa"] / us["kernel"],
                    "max_abs_diff": err,
                }
                results["cases"].append(case)
                print(
                    f"{case['dtype']:8s} B={batch} ctx={context:5d}: kernel {us['kernel']:7.1f} us,"
                    f" gather+sdpa {us['gather+sdpa']:7.1f} us ({case['speedup']:.1f}x),"
                    f" max diff {err:.1e}",
                    flush=True,
                )
    results["load_average"]["after"] = os.getloadavg()[0]
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(results, indent=2) + "\n")
    plot(results, args.out.with_suffix(".png"))
    print(f"wrote {args.out} and {args.out.with_suffix('.png')}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
