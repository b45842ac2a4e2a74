"""The worker's weight-only kernels by row count: what a pass of N tokens costs in the matmuls.

SmolLM2-135M's shapes with random weights in the worker's layouts (`neuron_worker.kernels`):
its 120 projections (Q4_1: fused q/k/v, o, fused gate/up, down, x 30 layers) and its Q8_0 LM
head (49,152 x 576), bf16 activations (AVX512-BF16), or with `--dtype float32` fp32 activations
through the AVX2 kernels (`matmul_f32.cpp`, what an AVX2-only host runs). Rows = tokens of one
pass over generated tokens: 1 (a c1 decode step), 2-8 (c2-c8), 9-16 (a c1 verification pass with
a forced tail), 24-40 (c8 verification passes). Each figure is the median of `--repeats`
timings; the machine's load average and the CPU are recorded (2 shared cores: compare rows
within one run).

Writes bench/results/kernel_rows.json (`--out`). Usage: python bench/kernel_rows.py
                                                           [--dtype float32] [--out PATH]
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

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from maskwire.cpus import cpu_model_and_flags  # noqa: E402
from neuron_worker import kernels  # noqa: E402

PROJECTIONS = ((1728, 576), (576, 576), (3072, 576), (576, 1536))  # (out, in), x 30 layers
LAYERS = 30
HEAD = (49152, 576)
ROWS = (1, 2, 3, 4, 5, 6, 7, 8, 9, 13, 16, 24, 40)


def median_ms(fn: Callable[[], object], repeats: int) -> float:
    fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return round(statistics.median(times) * 1e3, 3)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=9)
    ap.add_argument("--dtype", choices=("bfloat16", "float32"), default="bfloat16")
    ap.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "kernel_rows.json")
    args = ap.parse_args()
    fp32 = args.dtype == "float32"
    if not (kernels.available() if fp32 else kernels.bf16_available()):
        sys.exit(f"no {args.dtype} kernels here (AVX512-BF16 for bf16, AVX2 for fp32; a compiler)")
    pack4, pack8 = (
        (kernels.pack_int4_f32, kernels.pack_int8_f32)
        if fp32
        else (kernels.pack_int4, kernels.pack_int8)
    )
    ops = torch.ops.maskwire_kernels
    int4, int8 = (
        (ops.int4_matmul_f32, ops.int8_matmul_f32) if fp32 else (ops.int4_matmul, ops.int8_matmul)
    )
    dtype = torch.float32 if fp32 else torch.bfloat16
    torch.set_num_threads(args.threads)
    g = torch.Generator().manual_seed(0)
    layers = []
    for n, k in PROJECTIONS:
        q = torch.randint(0, 16, (n, k), dtype=torch.uint8, generator=g)
        scale = torch.rand(n, k // 32, generator=g) * 0.01
        low = -torch.rand(n, k // 32, generator=g) * 0.05
        layers.append((k, pack4(q, scale, low)))
    head_q = torch.randint(-128, 128, HEAD, dtype=torch.int8, generator=g)
    head = pack8(head_q, torch.rand(HEAD[0], HEAD[1] // 32, generator=g) * 0.01)

    rows_out = []
    for rows in ROWS:
        x = {k: torch.randn(rows, k, generator=g).to(dtype) for k in (576, 1536)}

        def projections(x: dict[int, torch.Tensor] = x) -> None:
            for _ in range(LAYERS):
                for k, packed in layers:
                    int4(x[k], *packed)

        def lm_head(x: dict[int, torch.Tensor] = x) -> None:
            int8(x[576], *head)

        row = {
            "rows": rows,
            "projections_ms": median_ms(projections, args.repeats),
            "lm_head_ms": median_ms(lm_head, args.repeats),
        }
        print(json.dumps(row), flush=True)
        rows_out.append(row)
    model, flags = cpu_model_and_flags()
    result = {
        "dtype": args.dtype,
        "kernel_set": getattr(kernels.cpu_kernel_set(), "name", None),
        "cpu": {"model": model, "flags": sorted(f for f in flags if f.startswith(("avx", "amx")))},
        "threads": args.threads,
        "load_average": os.getloadavg(),
        "rows": rows_out,
    }
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
