"""The worker's weight-only quantization options on this CPU: decode step time and greedy drift.

The embedded SmolLM2-135M as the worker serves it (`load_model(serving=True)`, bf16 activations):
`--quantize none` (oneDNN-prepacked bf16 weights), `int8` (per-channel int8 weights), `int4-aten`
(the GGUF's own Q4_1 weights through aten's int4 kernel, and SDPA: `MASKWIRE_KERNELS=0`) and `int4`
(the same weights through the worker's own kernels, `neuron_worker.kernels`), each through the
worker's `ForwardRunner` with its compiled decode graph. Decode step = B rows x 1 token at a
256-position KV length, B in 1, 4, 5, 8, and 16, 32 (a flat jump-forward or verification pass of
that many tokens, which takes the same weights as decoding); the median of `--repeats` timings of
`--steps` steps, the variants interleaved so that load drifts hit them alike. Each variant runs
in a process of its own (`--variant`): the worker compiles `step_logits` without guards on module
attributes, so in one process every model after the first would run the first one's graph.

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
from neuron_worker.compile_cache import default_root, use_directory  # noqa: E402
from neuron_worker.graphs import ForwardRunner, Pass  # noqa: E402
from neuron_worker.model import Transformer, load_model  # noqa: E402

RESULTS = ROOT / "bench" / "results"
# variant -> (--quantize scheme, environment)
VARIANTS: dict[str, tuple[str, dict[str, str]]] = {
    "none": ("none", {}),
    "int8": ("int8", {}),
    "int4-aten": ("int4", {"MASKWIRE_KERNELS": "0"}),
    "int4": ("int4", {}),
}
# Rows of a one-token-per-row pass: decode steps, and past the batch (8) the flat jump-forward and
# verification passes, which take the same weights.
ROWS = (1, 4, 5, 8, 16, 32)
PROMPTS = (
    "The capital of France is",
    "List three colors as JSON:",
    "def fibonacci(n):",
)
KV = 256
MAX_ROWS = 8


def serving_model(scheme: str, dtype: torch.dtype = torch.bfloat16) -> Transformer:
    model = load_model("default", dtype=dtype, serving=True, quantize=scheme)
    model.setup_caches(MAX_ROWS + 1, KV)
    return model


def decode_pass(rows: int) -> Pass:
    """B rows of one token each at position KV - 1 (the cache beyond the prompt is padding)."""
    return Pass(
        np.full((rows, 1), 7, np.int64),
        np.full((rows, 1), KV - 1, np.int64),
        np.arange(rows, dtype=np.int64) % MAX_ROWS,  # a flat pass: several tokens per slot
        np.arange(min(rows, MAX_ROWS), dtype=np.int64),  # a flat pass: a logits row per slot
        KV,
    )


def time_decode(runner: ForwardRunner, rows: int, steps: int) -> float:
    p = decode_pass(max(rows, 2))
    began = time.perf_counter()
    for _ in range(steps):
        runner.run(p)
    return (time.perf_counter() - began) / steps


def time_variant(variant: str, steps: int) -> dict[int, float]:
    """Seconds per compiled decode step at each of ROWS (graphs from the compile cache)."""
    use_directory(default_root() / f"bench-quantize-{variant}")
    runner = ForwardRunner(
        serving_model(VARIANTS[variant][0]),
        create_backend("cpu", compile=True),
        max_rows=MAX_ROWS,
        max_seq=KV,
        pad_slot=MAX_ROWS,
    )
    with torch.inference_mode():
        time_decode(runner, 2, 1)  # compile (or load) both ends of the row range
        time_decode(runner, MAX_ROWS, 1)
        return {rows: time_decode(runner, rows, steps) for rows in ROWS}


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
        logits = runner.run(Pass(tok, pos, slots, last, kv, prefill=start == 0))
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
    p.add_argument("--variant", choices=VARIANTS, help="time this variant alone (internal)")
    p.add_argument("--greedy", action="store_true", help="with --variant: its greedy tokens")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    prompts = [load_tokenizer("default").encode(text) for text in PROMPTS]
    if args.variant and args.greedy:
        with torch.inference_mode():
            model = serving_model(VARIANTS[args.variant][0])
            print(json.dumps([greedy(model, pr, args.tokens) for pr in prompts]))
        return 0
    if args.variant:
        print(json.dumps(time_variant(args.variant, args.steps)))
        return 0

    def run_variant(name: str, *extra: str) -> Any:
        out = subprocess.run(
            [
                sys.executable,
                __file__,
                *("--variant", name),
                *("--steps", str(args.steps)),
                *("--threads", str(args.threads)),
                *("--tokens", str(args.tokens)),
                *extra,
            ],
            check=True,
            capture_output=True,
            text=True,
            env={**os.environ, **VARIANTS[name][1]},
        ).stdout
        return json.loads(out.splitlines()[-1])

    with torch.inference_mode():
        reference = serving_model("none", torch.float32)
        ref_tokens = [greedy(reference, pr, args.tokens) for pr in prompts]
        del reference
    drift = {
        name: [
            agreeing_prefix(got, want)
            for got, want in zip(run_variant(name, "--greedy"), ref_tokens, strict=True)
        ]
        for name in VARIANTS
    }
    times: dict[str, dict[int, list[float]]] = {name: {r: [] for r in ROWS} for name in VARIANTS}
    for _ in range(args.repeats):
        for name in VARIANTS:
            for rows, seconds in run_variant(name).items():
                times[name][int(rows)].append(seconds)

    result: dict[str, Any] = {
        "benchmark": "quantize",
        "threads": args.threads,
        "load_avg_at_end": os.getloadavg(),
        "tokens_compared": args.tokens,
        "variants": {
            name: {
                **{
                    f"decode_b{r}_ms": round(1e3 * statistics.median(times[name][r]), 2)
                    for r in ROWS
                },
                **{
                    f"decode_b{r}_tok_s": round(r / statistics.median(times[name][r]), 1)
                    for r in ROWS
                },
                "greedy_tokens_equal_to_fp32": drift[name],
            }
            for name in VARIANTS
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
    fig, axes = plt.subplots(1, len(ROWS), figsize=(3.4 * len(ROWS), 3.2))
    for ax, rows in zip(axes, ROWS, strict=True):
        key, title = f"decode_b{rows}_tok_s", f"decode B={rows} (tok/s)"
        values = [variants[n][key] for n in names]
        ax.bar(names, values, color=["#999999", "#5b9bd5", "#9dc3e6", "#2b7bba"])
        for i, v in enumerate(values):
            ax.text(i, v, f"{v:.0f}", ha="center", va="bottom", fontsize=8)
        ax.set_title(title, fontsize=9)
    fig.suptitle("--quantize on this CPU (bf16 activations, compiled decode graph)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    sys.exit(main())
