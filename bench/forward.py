"""Model forward speed on this CPU: decode tokens/s at batch 1 and 8, and prefill time.

The embedded SmolLM2-135M through `neuron_worker.model`, in fp32 and bf16, measured in one run:
`eager`; `compiled` = `torch.compile(fullgraph=True, dynamic=False)` of the whole forward; `blocks`
= `Transformer.compile_blocks()` (one compiled graph shared by all 30 layers). A decode step is what the worker runs per token: `forward` of B rows x 1 token at a static
`kv_len` bucket plus the LM head (`logits`) for those rows. Every slot holds a 128-token context.
Prefill: one row of 128 or 512 tokens, forward + LM head of the last token.

Each number is the median of `--repeats` timings of `--steps` steps after warm-up. The machine's
load average is recorded: on a shared 2-core box other jobs slow everything, compare ratios
within one run.

Writes bench/results/forward.json and forward.png. Usage: python bench/forward.py [--quick]
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from maskwire.tokenizer import load_tokenizer  # noqa: E402
from neuron_worker.model import Transformer, load_model  # noqa: E402

RESULTS = ROOT / "bench" / "results"
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
CONTEXT = 128
KV_LEN = 256
PREFILL_LENGTHS = (128, 512)
MAX_SEQ = 1024
PROMPT = "The capital of France is"


def cpu_info() -> dict[str, Any]:
    flags: set[str] = set()
    model = platform.processor()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags") and not flags:
                flags = set(line.split(":", 1)[1].split())
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
    except OSError:
        pass
    return {
        "model": model,
        "cores": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "avx512_bf16": "avx512_bf16" in flags,
        "amx_bf16": "amx_bf16" in flags,
    }


def timed(fn: Callable[[], Any], steps: int, repeats: int) -> float:
    """Median seconds per call."""
    samples = []
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(steps):
            fn()
        samples.append((time.perf_counter() - start) / steps)
    return statistics.median(samples)


@torch.inference_mode()
def measure(model: Transformer, mode: str, steps: int, repeats: int) -> dict[str, Any]:
    forward: Callable[..., torch.Tensor] = model
    compile_s = 0.0
    if mode == "compiled":
        forward = torch.compile(model, fullgraph=True, dynamic=False)
    elif mode == "blocks":
        model.compile_blocks()

    def run(
        tokens: torch.Tensor, pos: torch.Tensor, slots: torch.Tensor, kv_len: int
    ) -> torch.Tensor:
        hidden = forward(tokens, pos, slots, kv_len)
        return model.logits(hidden[:, -1])

    out: dict[str, Any] = {"decode": {}, "prefill_ms": {}}
    # Fill every slot with a 128-token context (eager: one graph fewer to compile).
    gen = torch.Generator().manual_seed(0)
    context = torch.randint(100, 40000, (8, CONTEXT), generator=gen)
    model(context, torch.arange(CONTEXT).expand(8, CONTEXT), torch.arange(8), KV_LEN)
    for batch in (1, 8):
        tokens = torch.full((batch, 1), 42)
        pos = torch.full((batch, 1), CONTEXT)
        slots = torch.arange(batch)
        start = time.perf_counter()
        for _ in range(3):
            run(tokens, pos, slots, KV_LEN)
        compile_s += time.perf_counter() - start
        sec = timed(functools.partial(run, tokens, pos, slots, KV_LEN), steps, repeats)
        out["decode"][str(batch)] = {"ms_per_step": sec * 1e3, "tokens_per_s": batch / sec}
    for length in PREFILL_LENGTHS:
        tokens = torch.randint(100, 40000, (1, length), generator=gen)
        pos = torch.arange(length)[None]
        slots = torch.tensor([0])
        kv_len = max(KV_LEN, length)
        start = time.perf_counter()
        run(tokens, pos, slots, kv_len)
        compile_s += time.perf_counter() - start
        sec = timed(functools.partial(run, tokens, pos, slots, kv_len), 1, max(3, repeats))
        out["prefill_ms"][str(length)] = sec * 1e3
    out["warmup_and_compile_s"] = compile_s
    return out


@torch.inference_mode()
def greedy_text(model: Transformer, n: int = 12) -> str:
    from neuron_worker.model.greedy import greedy_generate

    tok = load_tokenizer("default")
    model.setup_caches(1, 64)
    ids = greedy_generate(model, tok.encode(PROMPT), n)
    return tok.decode_bytes(ids).decode(errors="replace")


def plot(results: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    variants = list(results["variants"])
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
    width = 0.38
    for i, batch in enumerate(("1", "8")):
        values = [results["variants"][v]["decode"][batch]["tokens_per_s"] for v in variants]
        xs = [x + (i - 0.5) * width for x in range(len(variants))]
        bars = ax1.bar(xs, values, width, label=f"batch {batch}")
        ax1.bar_label(bars, fmt="%.0f", fontsize=8)
    ax1.set_xticks(range(len(variants)), variants, fontsize=8, rotation=20)
    ax1.set_ylabel("decode tokens/s (forward + LM head)")
    ax1.set_title(f"Decode, kv_len {KV_LEN}, {CONTEXT}-token context")
    ax1.legend()
    for i, length in enumerate(PREFILL_LENGTHS):
        values = [results["variants"][v]["prefill_ms"][str(length)] for v in variants]
        xs = [x + (i - 0.5) * width for x in range(len(variants))]
        bars = ax2.bar(xs, values, width, label=f"{length} tokens")
        ax2.bar_label(bars, fmt="%.0f", fontsize=8)
    ax2.set_xticks(range(len(variants)), variants, fontsize=8, rotation=20)
    ax2.set_ylabel("prefill ms (one row)")
    ax2.set_title("Prefill")
    ax2.legend()
    load = results["load_average"]
    fig.suptitle(
        f"SmolLM2-135M forward, {results['cpu']['model']}, {results['cpu']['torch_threads']} threads, "
        f"load avg {load['before']:.1f} -> {load['after']:.1f}",
        fontsize=9,
    )
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=16, help="decode steps per timing")
    parser.add_argument("--repeats", type=int, default=5, help="timings per number (median)")
    parser.add_argument(
        "--variants",
        default="eager-fp32,eager-bf16,blocks-fp32,blocks-bf16,compiled-fp32,compiled-bf16",
        help="comma-separated MODE-DTYPE, MODE in eager|blocks|compiled, DTYPE in fp32|bf16",
    )
    parser.add_argument(
        "--threads", type=int, default=0, help="torch threads (0 = torch's default)"
    )
    parser.add_argument("--quick", action="store_true", help="few steps (smoke run)")
    parser.add_argument("--out", type=Path, default=RESULTS / "forward.json")
    parser.add_argument("--plot-only", action="store_true", help="redraw the PNG from --out")
    args = parser.parse_args()
    if args.plot_only:
        plot(json.loads(args.out.read_text()), args.out.with_suffix(".png"))
        return 0
    if args.quick:
        args.steps, args.repeats = 2, 1
    if args.threads:
        torch.set_num_threads(args.threads)

    results: dict[str, Any] = {
        "model": "SmolLM2-135M-Instruct (embedded GGUF, dequantized)",
        "cpu": cpu_info(),
        "torch": torch.__version__,
        "context_tokens": CONTEXT,
        "kv_len": KV_LEN,
        "steps": args.steps,
        "repeats": args.repeats,
        "load_average": {"before": os.getloadavg()[0]},
        "variants": {},
    }
    for variant in args.variants.split(","):
        mode, dtype_name = variant.split("-")
        torch._dynamo.reset()
        model = load_model("default", dtype=DTYPES[dtype_name])
        model.setup_caches(8, MAX_SEQ)
        res = measure(model, mode, args.steps, args.repeats)
        res["greedy"] = greedy_text(model)
        results["variants"][variant] = res
        d = res["decode"]
        print(
            f"{variant:14s} decode b1 {d['1']['tokens_per_s']:6.1f} tok/s  b8 {d['8']['tokens_per_s']:6.1f} tok/s"
            f"  prefill 128: {res['prefill_ms']['128']:6.0f} ms  512: {res['prefill_ms']['512']:6.0f} ms"
            f"  (warm-up {res['warmup_and_compile_s']:.0f} s)  {res['greedy']!r}",
            flush=True,
        )
        del model
        # Written after every variant, so a long run interrupted still leaves results.
        results["load_average"]["after"] = os.getloadavg()[0]
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(results, indent=2) + "\n")
        plot(results, args.out.with_suffix(".png"))
    print(f"wrote {args.out} and {args.out.with_suffix('.png')}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
