"""Whether inductor builds every graph of the worker's warm-up on this device, and under which
settings: the worker's own `StepDevice` (forward passes, jump-forward rows, sampler kinds with and
without penalties and logprobs) around a SmolLM2-shaped decoder (its real sizes, `--layers`
layers, random weights, bf16 on CUDA), each setting after a dynamo reset. A graph the compiler
fails on is served eager (`neuron_worker.compile_fallback`); this reports which functions fell
back. Needs no model file, so it fits one short call on a GPU machine (bench/cuda_check.sh).

Usage: python bench/cuda_compile_check.py [--device cuda] [--layers 2] [--variants default,...]
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import time
from pathlib import Path

import torch
import torch._dynamo
import torch._inductor.config as inductor

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from neuron_worker import cli  # noqa: E402
from neuron_worker.app import build_step_device  # noqa: E402
from neuron_worker.backends import create_backend  # noqa: E402
from neuron_worker.compile_fallback import fallback_counts, retry_counts  # noqa: E402
from neuron_worker.config import fit_context, worker_config  # noqa: E402
from neuron_worker.model import ModelConfig, Transformer, build_model  # noqa: E402
from tests.unit.model.tiny import random_weights  # noqa: E402

SMOLLM2 = ModelConfig(
    name="smollm2-shaped",
    vocab_size=49152,
    dim=576,
    n_layers=30,
    n_heads=9,
    n_kv_heads=3,
    head_dim=64,
    ffn_dim=1536,
    rope_theta=100000.0,
    norm_eps=1e-5,
    max_seq_len=8192,
    tie_embeddings=True,
)

# name -> inductor config changes (dotted names)
VARIANTS: dict[str, dict[str, object]] = {
    "default": {},
    "no_mix_order": {"triton.mix_order_reduction": False},
    "no_persistent": {"triton.persistent_reductions": False},
    "one_tile": {"triton.max_tiles": 1},
}


def apply(changes: dict[str, object]) -> dict[str, object]:
    """Set inductor options; returns the old values."""
    old = {}
    for name, value in changes.items():
        *path, leaf = name.split(".")
        obj = inductor
        for p in path:
            obj = getattr(obj, p)
        if not hasattr(obj, leaf):
            print(f"   (inductor has no {name} here)")
            continue
        old[name] = getattr(obj, leaf)
        setattr(obj, leaf, value)
    return old


def warm_up(model: Transformer, worker_flags: list[str], device: str) -> int:
    """The worker's warm-up on `model`: every graph a request can hit."""
    p = argparse.ArgumentParser()
    cli.add_arguments(p)
    # The engine's settings only: the grammar service named is never dialled.
    flags = worker_config(p.parse_args(["--grammar-service", "127.0.0.1:50061", *worker_flags]))
    config = fit_context(dataclasses.replace(flags.engine, bucketed=False), SMOLLM2.max_seq_len)
    backend = create_backend(device, compile=True)
    step = build_step_device(model, backend, config, vocab_size=SMOLLM2.vocab_size, eos_ids=(2,))
    step.setup()
    began = time.perf_counter()

    def done(label: str) -> None:
        nonlocal began
        print(f"   {label} in {time.perf_counter() - began:.1f}s", flush=True)
        began = time.perf_counter()

    return step.warmup(done)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cuda")
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--variants", default=",".join(VARIANTS))
    p.add_argument(
        "--worker-flags",
        default="--max-batch-size 4 --max-seq-len 512",
        help="worker flags that shape the graphs (the compiled test's)",
    )
    args = p.parse_args()
    config = dataclasses.replace(SMOLLM2, n_layers=args.layers)
    dtype = torch.bfloat16 if args.device == "cuda" else torch.float32
    model = build_model(config, random_weights(config), device=args.device, dtype=dtype)
    model.use_serving_linears("none")
    print(torch.__version__, args.device, flush=True)
    for name in args.variants.split(","):
        torch._dynamo.reset()
        old = apply(VARIANTS[name])
        began = time.perf_counter()
        before = fallback_counts()
        retried_before = retry_counts()
        print(f"== {name}", flush=True)
        graphs = warm_up(model, args.worker_flags.split(), args.device)
        fell = [k for k, v in fallback_counts().items() if v > before.get(k, 0)]
        verdict = f"eager fallbacks: {sorted(fell)}" if fell else "every graph compiled"
        retried = [k for k, v in retry_counts().items() if v > retried_before.get(k, 0)]
        if retried:
            verdict += f"; compiled again with safer settings: {sorted(retried)}"
        print(f"== {name}: {graphs} graphs, {verdict} ({time.perf_counter() - began:.0f}s)")
        apply(old)
    return 0


if __name__ == "__main__":
    sys.exit(main())
