"""The worker's weight-only quantization options on this CPU: decode step time and greedy drift.

The embedded SmolLM2-135M as the worker serves it (`load_model(serving=True)`, bf16 activations):
`--quantize none` (oneDNN-prepacked bf16 weights), `int8` (per-channel int8 weights) and `int4`
(the GGUF's own Q4_1 weights), each through the worker's `ForwardRunner` with its compiled decode
graph. Decode step = B rows x 1 token at a 256-position KV length; the median of `--repeats`
timings of `--steps` steps, the variants interleaved so that load drifts hit them alike. Each
timing runs in a process of its own (`--variant`): the worker compiles `step_logits` without
guards on module attributes, so in one process every model after the first would run the first
one's graph (which is what an earlier version of this benchmark measured: three equal times).

Greedy drift: the first `--tokens` greedy tokens of each variant (eager, same kernels) on three
known prompts, against the fp32 reference model (`--quantize none --dtype float32`): the number
of tokens until the first difference.

Writes bench/results/quantize.json and quantize.png.
Usage: python bench/quantize.py [--threads 2] [--steps 32] [--repeats 5] [--tokens 32]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from maskwire.tokenizer import load_tokenizer  # noqa: E402
from neuron_worker.backends import create_backend  # noqa: E402
from neuron_worker.graphs import ForwardRunner, Pass  # noqa: E402
from neuron_worker.model import Transformer, load_model  # noqa: E402
from neuron_worker.tuning import default_compile_cache, use_compile_cache  # noqa: E402

RESULTS = ROOT / "bench" / "results"
SCHEMES = ("none", "int8", "int4")
PROMPTS = (
    "The capital of France is",
    "List three colors as JSON:",
    "def fibonacci(n):",
)
KV = 256
MAX_ROWS = 8


def serving_model(scheme: str, dtype: torch.dtype = torch.bfloat16) -> Transformer:
    model = load_model(
        "default", dtype=dtype, serving=True, quantize=scheme, quantize_rows=MAX_ROWS
    )
    model.setup_caches(MAX_ROWS + 1, KV)
    return model


def decode_pass(rows: int) -> Pass:
    """B rows of one token each at position KV - 1 (the cache beyond the prompt is padding)."""
    return Pass(
        np.full((rows, 1), 7, np.int64),
        np.full((rows, 1), KV - 1, np.int64),
        np.arange(rows, dtype=np.int64),
        np.zeros(rows, np.int64),
        KV,
    )


def time_decode(runner: ForwardRunner, rows: int, steps: int) -> float:
    p = decode_pass(max(rows, 2))
    began = time.perf_counter()
    for _ in range(steps):
        runner.run(p)
    return (time.perf_counter() - began) / steps


def time_variant(scheme: str, steps: int) -> dict[int, float]:
    """Seconds per compiled decode step at B = 1 and B = 8 (graphs from the compile cache)."""
    use_compile_cache(default_compile_cache() / "bench-quantize")
    runner = ForwardRunner(
        serving_model(scheme),
        create_backend("cpu", compile=True),
        max_rows=MAX_ROWS,
        max_seq=KV,
        pad_slot=MAX_ROWS,
    )
    with torch.inference_mode():
        time_decode(runner, 2, 1)  # compile (or load) both ends of the row range
        time_decode(runner, MAX_ROWS, 1)
        return {rows: time_decode(runner, rows, steps) for rows in (1, 8)}


def greedy(model: Transformer, prompt: list[int], n: int) -> list[int]:
    runner = ForwardRunner(
        model, create_backend("cpu"), max_rows=MAX_ROWS, max_seq=KV, pad_slot=MAX_ROWS
    )
    out: list[int] = []
    tokens = list(prompt)
    start = 0
    for _ in range(n):
        fresh = tokens[start:]
        rows, t, kv = runner.shape(1, len(fresh), len(tokens))
        tok = np.zeros((rows, t), np.int64)
        pos = np.full((rows, t), -1, np.int64)
        tok[0, : len(fresh)] = fresh
        pos[0, : len(fresh)] = np.arange(start, len(tokens))
        slots = np.full(rows, MAX_ROWS, np.int64)
        slots[0] = 0
        last = np.zeros(max(rows, 2), np.int64)
        last[0] = len(fresh) - 1
        logits = runner.run(Pass(tok, pos, slots, last, kv))
        nxt = int(logits[0].argmax())
        out.append(nxt)
        start = len(tokens)
        tokens.append(nxt)
    return out


def agreeing_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--steps", type=int, default=32)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--tokens", type=int, default=32)
    p.add_argument("--variant", choices=SCHEMES, help="time this scheme alone (internal)")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    if args.variant:
        print(json.dumps(time_variant(args.variant, args.steps)))
        return 0
    tok = load_tokenizer("default")
    prompts = [tok.encode(text) for text in PROMPTS]

    with torch.inference_mode():
        reference = serving_model("none", torch.float32)
        ref_tokens = [greedy(reference, pr, args.tokens) for pr in prompts]
        del reference
        drift = {}
        for s in SCHEMES:
            model = serving_model(s)
            drift[s] = [
                agreeing_prefix(greedy(model, pr, args.tokens), want)
                for pr, want in zip(prompts, ref_tokens, strict=True)
            ]
            del model
    times: dict[str, dict[int, list[float]]] = {s: {1: [], 8: []} for s in SCHEMES}
    for _ in range(args.repeats):
        for s in SCHEMES:
            out = subprocess.run(
                [
                    sys.executable,
                    __file__,
                    "--variant",
                    s,
                    *("--steps", str(args.steps)),
                    *("--threads", str(args.threads)),
                ],
                check=True,
                capture_output=True,
                text=True,
            ).stdout
            for rows, seconds in json.loads(out.splitlines()[-1]).items():
                times[s][int(rows)].append(seconds)

    result: dict[str, Any] = {
        "benchmark": "quantize",
        "threads": args.threads,
        "load_avg_at_end": os.getloadavg(),
        "tokens_compared": args.tokens,
        "variants": {
            s: {
                "decode_b1_ms": round(1e3 * statistics.median(times[s][1]), 2),
                "decode_b8_ms": round(1e3 * statistics.median(times[s][8]), 2),
                "decode_b1_tok_s": round(1 / statistics.median(times[s][1]), 1),
                "decode_b8_tok_s": round(8 / statistics.median(times[s][8]), 1),
                "greedy_tokens_equal_to_fp32": drift[s],
            }
            for s in SCHEMES
        },
    }
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "quantize.json").write_text(json.dumps(result, indent=2) + "\n")
    plot(result, RESULTS / "quantize.png")
    print(json.dumps(result, indent=2))
    return 0


def plot(result: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    variants = result["variants"]
    names = list(variants)
    fig, axes = plt.subplots(1, 2, figsize=(9, 3.2))
    for ax, key, title in (
        (axes[0], "decode_b1_tok_s", "decode B=1 (tok/s)"),
        (axes[1], "decode_b8_tok_s", "decode B=8 (tok/s)"),
    ):
        values = [variants[n][key] for n in names]
        ax.bar(names, values, color=["#999999", "#5b9bd5", "#2b7bba"])
        for i, v in enumerate(values):
            ax.text(i, v, f"{v:.0f}", ha="center", va="bottom", fontsize=8)
        ax.set_title(title, fontsize=9)
    fig.suptitle("--quantize on this CPU (bf16 activations, compiled decode graph)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    sys.exit(main())
