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

from bench.decode_step import MAX_ROWS, MAX_SEQ, compare, save  # noqa: E402
from bench.forward import cpu_info  # noqa: E402
from neuron_worker import kernels  # noqa: E402
from neuron_worker.backends import create_backend  # noqa: E402
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
    model.setup_caches(MAX_ROWS + 1, MAX_SEQ)
    backend = create_backend("cpu", compile=True)
    return ForwardRunner(
        model, backend, max_rows=MAX_ROWS, max_seq=MAX_SEQ, pad_slot=MAX_ROWS, fused_decode=True
    )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--context", type=int, default=100, help="each row's position")
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--calls", type=int, default=100, help="passes per timing")
    parser.add_argument("--out", type=Path, default=RESULTS / "kernel_params.json")
    args = parser.parse_args()
    if not kernels.bf16_available():
        raise SystemExit("no AVX512-BF16 kernels on this CPU")
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
