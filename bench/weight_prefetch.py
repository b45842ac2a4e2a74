"""The bf16 matmuls' software prefetch of their weights against none, in the fused decode pass of
the embedded SmolLM2-135M.

One model as the worker serves it on an AVX512-BF16 host (Q4_1 layers, Q8_0 head, the fused
decode step); the passes (rows 1, 2, 4 and 8 at one context) alternate between the default
prefetch distance and none (`kernels.set_weight_prefetch`), in turns that swap which goes first;
each figure is the median of `--repeats` timings of `--calls` passes, each ratio the median of
the per-repeat ratios. The logits must be equal bit for bit.

Writes bench/results/weight_prefetch.json and .png. Usage: python bench/weight_prefetch.py
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.decode_step import compare, comparison_args, fused_runner, save  # noqa: E402
from bench.forward import cpu_info  # noqa: E402
from neuron_worker import kernels  # noqa: E402
from neuron_worker.model import load_model  # noqa: E402

RESULTS = ROOT / "bench" / "results"
VARIANTS = ("prefetch", "none")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    args = comparison_args(parser, RESULTS / "weight_prefetch.json")
    runner = fused_runner(
        load_model("default", dtype=torch.bfloat16, serving=True, quantize="int4").eval()
    )
    default = kernels.set_weight_prefetch(-1)
    results: dict[str, Any] = {
        "cpu": cpu_info(),
        "torch": torch.__version__,
        "context": args.context,
        "prefetch_groups": default,
        "load_average": {"before": os.getloadavg()[0]},
        "cases": [],
    }
    try:
        with torch.inference_mode():
            results["cases"] = compare(
                {
                    "prefetch": (runner, lambda: kernels.set_weight_prefetch(default)),
                    "none": (runner, lambda: kernels.set_weight_prefetch(0)),
                },
                context=args.context,
                repeats=args.repeats,
                calls=args.calls,
            )
    finally:
        kernels.set_weight_prefetch(default)
    title = (
        f"SmolLM2 bf16 decode pass, weights prefetched {default} groups ahead against none, "
        f"context {args.context}"
    )
    save(results, args.out, VARIANTS, title)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
