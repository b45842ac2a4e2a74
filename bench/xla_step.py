"""The worker's decode step on the XLA CPU device: compile counts per bucket, and step time with
and without the always-passed mask.

Runs in the torch_xla environment (`PJRT_DEVICE=CPU .venv-xla/bin/python bench/xla_step.py`).
Two engines share one embedded SmolLM2 (fp32): structured outputs on (the sampler graph always
takes a packed int32 mask, all ones here) and off (no mask input). For each, `Engine.warmup`
runs every bucketed graph once; the compilations and compile seconds each graph cost are read
from torch_xla's metrics. The second engine's forward graphs are the first one's (same HLO), so
they come from the graph cache: only its sampler graphs compile.

A decode step is what the step loop runs per token: the forward graph (B rows x 1 token at
kv_len) then the sampler graph (reorder + unpack + mask + greedy), each cut by `torch_xla.sync()`.
Timed per batch bucket: the median of `--steps` steps after warm-up, for both engines and for
the same engine code on the CPU backend (eager torch, as a reference), taking turns step by step;
plus the sampler graph alone. Compilations during the timed steps are counted too (must be 0).

Writes bench/results/xla_step.json and xla_step.png. On a shared 2-core machine other jobs
slow everything: compare ratios within one run (the load average is recorded).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("PJRT_DEVICE", "CPU")

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from maskwire.tokenizer import load_tokenizer  # noqa: E402
from neuron_worker.backends import create_backend  # noqa: E402
from neuron_worker.engine import Engine, EngineConfig  # noqa: E402
from neuron_worker.graphs import Pass  # noqa: E402
from neuron_worker.model import load_model  # noqa: E402
from neuron_worker.sampler import Sampler  # noqa: E402
from neuron_worker.sampling_rows import PAD_ROW, SamplingRows  # noqa: E402
from neuron_worker.step_device import SampleBatch, StepDevice  # noqa: E402
from neuron_worker.xla import compile_stats  # noqa: E402

RESULTS = ROOT / "bench" / "results"


def build_engine(model: Any, tokenizer: Any, backend: Any, cfg: EngineConfig) -> Engine:
    sampler = Sampler(
        vocab_size=tokenizer.vocab_size,
        logits_size=int(model.config.vocab_size),
        max_rows=cfg.batch_buckets[-1],
        device=backend.device,
        structured_outputs=cfg.structured_outputs,
        compile=False,
    )
    return Engine(
        device=StepDevice(
            model=model,
            backend=backend,
            sampler=sampler,
            config=cfg,
            eos_ids=tuple(tokenizer.eos_token_ids),
            words=tokenizer.words_per_row,
        ),
        tokenizer=tokenizer,
        grammar=None,
        config=cfg,
    )


async def warm(engine: Engine) -> list[dict[str, Any]]:
    """Warm-up with the compile cost of each graph."""
    rows: list[dict[str, Any]] = []
    last_stats, last_t = compile_stats(), time.perf_counter()

    def on_graph(label: str) -> None:
        nonlocal last_stats, last_t
        now, t = compile_stats(), time.perf_counter()
        d = now - last_stats
        rows.append(
            {
                "graph": label,
                "compilations": d.compilations,
                "compile_s": round(d.compile_s, 3),
                "wall_s": round(t - last_t, 3),
            }
        )
        last_stats, last_t = now, t

    await engine.warmup(on_graph)
    return rows


def step_inputs(engine: Engine, n: int, kv: int) -> tuple[Any, ...]:
    """Decode inputs for B = n rows at position kv / 2; half the rows constrained."""
    words = engine.words
    tokens = np.full((n, 1), 504, dtype=np.int64)
    pos = np.full((n, 1), kv // 2, dtype=np.int64)
    slots = np.arange(n, dtype=np.int64)
    last = np.arange(n, dtype=np.int64)
    compact = np.full((n, words), -1, dtype=np.int32)
    compact[: n // 2, words // 2 :] = 0
    dest = np.full(n, n, dtype=np.int64)
    dest[: n // 2] = np.arange(n // 2) * 2
    rows = SamplingRows([PAD_ROW] * n)  # greedy
    return tokens, pos, slots, last, compact, dest, np.zeros(n, dtype=bool), rows


def time_steps(engines: dict[str, Engine], n: int, kv: int, steps: int) -> dict[str, Any]:
    """Median decode step (forward + sampler) and sampler alone per engine, B = n rows at
    kv_len = kv. The engines take turns step by step, so load changes hit them alike."""
    step_s: dict[str, list[float]] = {k: [] for k in engines}
    sample_s: dict[str, list[float]] = {k: [] for k in engines}
    inputs = {k: step_inputs(e, n, kv) for k, e in engines.items()}
    for i in range(steps + 2):
        for name, engine in engines.items():
            tokens, pos, slots, last, compact, dest, ban, rows = inputs[name]
            t0 = time.perf_counter()
            logits = engine.device.forward(Pass(tokens, pos, slots, last, kv))
            t1 = time.perf_counter()
            engine.device.sample(logits, SampleBatch(compact, dest, ban, rows))
            t2 = time.perf_counter()
            if i >= 2:  # the first steps of a shape warm caches
                step_s[name].append(t2 - t0)
                sample_s[name].append(t2 - t1)
    return {
        name: {
            "step_ms": round(1e3 * statistics.median(step_s[name]), 2),
            "sample_ms": round(1e3 * statistics.median(sample_s[name]), 3),
        }
        for name in engines
    }


async def run(args: argparse.Namespace) -> dict[str, Any]:
    backend = create_backend("xla")
    tokenizer = load_tokenizer("default")
    t0 = time.perf_counter()
    model = load_model("default", device=backend.device)
    base = EngineConfig(
        max_batch=args.batch_buckets[-1],
        max_seq_len=args.seq_buckets[-1],
        batch_buckets=tuple(args.batch_buckets),
        seq_buckets=tuple(args.seq_buckets),
        token_buckets=tuple(args.token_buckets),
    )
    engines = {
        "mask": build_engine(model, tokenizer, backend, base),
        "no_mask": build_engine(
            model,
            tokenizer,
            backend,
            EngineConfig(**{**base.__dict__, "structured_outputs": False}),
        ),
    }
    await engines["mask"].start()
    load_s = time.perf_counter() - t0
    # Reference: the same engine code on the CPU backend (eager torch, fp32), mask passed.
    cpu = create_backend("cpu")
    cpu_model = load_model("default", device=cpu.device)
    engines["cpu_eager_mask"] = build_engine(cpu_model, tokenizer, cpu, base)
    await engines["cpu_eager_mask"].start()
    out: dict[str, Any] = {
        "device": backend.describe(),
        "torch": torch.__version__,
        "load_average": os.getloadavg(),
        "cores": os.cpu_count(),
        "buckets": {
            "batch": args.batch_buckets,
            "tokens": args.token_buckets,
            "kv_len": args.seq_buckets,
        },
        "model_load_and_cache_s": round(load_s, 1),
        "warmup": {},
        "steps": {},
    }
    for name, engine in engines.items():
        if name.startswith("cpu"):
            continue
        began = time.perf_counter()
        rows = await warm(engine)
        out["warmup"][name] = {
            "graphs": rows,
            "compilations": sum(r["compilations"] for r in rows),
            "compile_s": round(sum(r["compile_s"] for r in rows), 1),
            "wall_s": round(time.perf_counter() - began, 1),
        }
        print(
            f"{name}: warm-up {len(rows)} graphs, {out['warmup'][name]['compilations']} compiled "
            f"in {out['warmup'][name]['wall_s']} s",
            flush=True,
        )
    kv = args.seq_buckets[0]
    before = compile_stats()
    for n in args.batch_buckets:
        out["steps"][str(n)] = time_steps(engines, n, kv, args.steps)
        print(n, out["steps"][str(n)], flush=True)
    out["steps_kv_len"] = kv
    out["compilations_while_stepping"] = (compile_stats() - before).compilations
    for engine in engines.values():
        await engine.stop()
    return out


def plot(result: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 4.5))
    buckets = list(result["steps"])
    x = np.arange(len(buckets))
    labels = {
        "mask": "XLA, structured outputs on (mask always passed)",
        "no_mask": "XLA, off (no mask input)",
        "cpu_eager_mask": "CPU eager torch, mask passed (reference)",
    }
    for i, name in enumerate(labels):
        ax1.bar(
            x + (i - 1) * 0.27,
            [result["steps"][b][name]["step_ms"] for b in buckets],
            0.27,
            label=labels[name],
        )
    ax1.set_xticks(x, buckets)
    ax1.set_xlabel("batch bucket")
    ax1.set_ylabel("decode step (ms, median)")
    ax1.set_title(f"XLA CPU decode step, kv_len {result['steps_kv_len']}")
    ax1.legend(fontsize=8)
    graphs = result["warmup"]["mask"]["graphs"]
    ax2.barh(np.arange(len(graphs)), [g["compile_s"] for g in graphs])
    ax2.set_yticks(np.arange(len(graphs)), [g["graph"] for g in graphs], fontsize=6)
    ax2.invert_yaxis()
    ax2.set_xlabel("compile seconds (1 compilation each)")
    ax2.set_title("warm-up, structured outputs on")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])

    def ints(s: str) -> list[int]:
        return sorted(int(v) for v in s.split(","))

    p.add_argument("--batch-buckets", type=ints, default=[1, 2, 4, 8])
    p.add_argument("--token-buckets", type=ints, default=[1, 16])
    p.add_argument("--seq-buckets", type=ints, default=[128, 256])
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--out", type=Path, default=RESULTS / "xla_step.json")
    args = p.parse_args()
    result = asyncio.run(run(args))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    plot(result, args.out.with_suffix(".png"))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
