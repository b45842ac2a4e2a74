"""The bf16 kernels' quant parameters as fp16 (as packed from a GGUF checkpoint) against the same
values as fp32, in the fused decode pass of the embedded SmolLM2-135M.

Two copies of the model as the worker serves it on an AVX512-BF16 host (Q4_1 layers, Q8_0 head,
the fused decode step); in one the packed scales and minimums are widened to fp32. The same
passes (rows 1, 2, 4 and 8 at one context) alternate between them, in turns that swap which goes
first; each figure is the median of `--repeats` timings of `--calls` passes, each ratio the median
of the per-repeat ratios. The logits must be equal bit for bit.

Writes bench/results/kernel_params.json and .png. Usage: python bench/kernel_params.py
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
from neuron_worker.graphs import ForwardRunner  # noqa: E402
from neuron_worker.model import load_model  # noqa: E402

RESULTS = ROOT / "bench" / "results"
VARIANTS = ("fp16", "fp32")


def runner(params: str) -> ForwardRunner:
    model = load_model("default", dtype=torch.bfloat16, serving=True, quantize="int4").eval()
    for module in model.modules():
        scales = getattr(module, "q_scales", None)
        if params == "fp32" and scales is not None and scales.dtype == torch.float16:
            module.q_scales = scales.float()
    return fused_runner(model)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    args = comparison_args(parser, RESULTS / "kernel_params.json")
    results: dict[str, Any] = {
        "cpu": cpu_info(),
        "torch": torch.__version__,
        "context": args.context,
        "load_average": {"before": os.getloadavg()[0]},
        "cases": [],
    }
    with torch.inference_mode():
        results["cases"] = compare(
            {name: (runner(name), lambda: None) for name in VARIANTS},
            context=args.context,
            repeats=args.repeats,
            calls=args.calls,
        )
    title = f"SmolLM2 bf16 decode pass, fp16 against fp32 quant parameters, context {args.context}"
    save(results, args.out, VARIANTS, title)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
