"""Tensor parallelism on this machine: decode step time at TP = 1 and TP = 2, bytes exchanged per
step, and the sharded sampler's per-rank mask + candidate time.

    .venv/bin/python bench/tensor_parallel.py [--steps 32] [--repeats 2] [--vocab 131072] [--buckets 1,8]
        [--out bench/results/tensor_parallel]

* Decode (the embedded SmolLM2, eager fp32, one sequence): every configuration runs in spawned
  rank processes: TP = 1 with 2 threads and with 1 thread, TP = 2 with 1 thread per rank,
  alternating, ``--repeats`` times. Per step: forward (with its 2 all-reduces per layer and the embedding's), then the sharded
  sampler (greedy: one all-gather). Medians over ``--steps`` steps after a prefill; bytes each rank
  sends to the collectives, split between forward and sampling.
* Sampler (in process, no collectives): one rank's :func:`local_candidates` over its slice of a
  ``--vocab`` row with a random packed mask (unpack + mask + max / Gumbel / top candidates), for
  TP = 1 (the whole row) and TP = 2 (half), per batch bucket and mode; the all-gather's size per
  step from :meth:`ShardedSampler.bytes_per_step`.

Writes ``<out>.json`` and ``<out>.png``. On a 2-core CPU host expect no speed-up from TP = 2: the
ranks split the same two cores and add collectives; the point of TP is memory and devices.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from maskwire.bitmask import words_per_row
from maskwire.tokenizer import load_tokenizer
from neuron_worker.model import load_model
from neuron_worker.parallel import (
    Collectives,
    ProcessGroup,
    ShardedSampler,
    VocabShard,
    shard_mask_words,
    shard_transformer,
    vocab_shards,
)
from neuron_worker.parallel.launch import run_ranks
from neuron_worker.parallel.sampling import local_candidates
from neuron_worker.sampler import MODES, Mode, SamplingTensors

PROMPT = (
    "<|im_start|>user\nWrite a long story about a lighthouse.<|im_end|>\n<|im_start|>assistant\n"
)


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--steps", type=int, default=32, help="timed decode steps per TP size")
    p.add_argument("--vocab", type=int, default=131_072, help="sampler benchmark vocabulary")
    p.add_argument("--repeats", type=int, default=2, help="decode runs per configuration")
    p.add_argument("--buckets", default="1,8")
    p.add_argument("--rounds", type=int, default=10, help="timed sampler rounds per case")
    p.add_argument("--out", default="bench/results/tensor_parallel")
    return p.parse_args()


def _greedy(n: int) -> SamplingTensors:
    return SamplingTensors.build(
        temperature=[0.0] * n,
        top_p=[1.0] * n,
        top_k=[0] * n,
        seed=[0] * n,
        offset=[0] * n,
        n_rows=n,
    )


def _sent(group: Collectives) -> int:
    return group.sent_bytes if isinstance(group, ProcessGroup) else 0


@torch.inference_mode()
def decode_on_rank(group: ProcessGroup, steps: int) -> dict[str, Any]:
    """One rank of the decode benchmark: per-step forward / sample times and bytes sent."""
    tok = load_tokenizer("default")
    model = load_model("default")
    shard = shard_transformer(model, group)
    model.setup_caches(1, 512)
    sampler = ShardedSampler(shard=shard, vocab_size=tok.vocab_size, group=group)
    ids = tok.encode(PROMPT)
    slots = torch.zeros(1, dtype=torch.int64)
    hidden = model(torch.tensor([ids]), torch.arange(len(ids))[None], slots, model.max_seq)
    forward_s, sample_s, forward_b, sample_b = [], [], [], []
    params = _greedy(1)
    tokens: list[int] = []
    for step in range(steps + 2):  # the first two steps are warm-up
        b0, t0 = _sent(group), time.perf_counter()
        logits = model.logits(hidden[:, -1])
        b1, t1 = _sent(group), time.perf_counter()
        token = int(sampler(logits, None, params)[0])
        b2, t2 = _sent(group), time.perf_counter()
        tokens.append(token)
        pos = torch.tensor([[len(ids) + step]])
        hidden = model(torch.tensor([[token]]), pos, slots, model.max_seq)
        b3, t3 = _sent(group), time.perf_counter()
        if step >= 2:
            forward_s.append(t1 - t0 + t3 - t2)
            sample_s.append(t2 - t1)
            forward_b.append(b1 - b0 + b3 - b2)
            sample_b.append(b2 - b1)
    return {
        "rank": group.rank,
        "tokens": tokens,
        "forward_ms": 1e3 * statistics.median(forward_s),
        "sample_ms": 1e3 * statistics.median(sample_s),
        "step_ms": 1e3 * statistics.median(f + s for f, s in zip(forward_s, sample_s, strict=True)),
        "forward_bytes_per_step": statistics.median(forward_b),
        "sample_bytes_per_step": statistics.median(sample_b),
    }


DECODE_CONFIGS = (("tp1_2threads", 1, 2), ("tp1_1thread", 1, 1), ("tp2", 2, 1))
"""(name, TP size, torch threads per rank): TP = 2 on a 2-core host gives each rank one core, so
TP = 1 is measured with one thread too (the same per-process threading) and with both cores."""


def decode_bench(steps: int, repeats: int) -> dict[str, Any]:
    """Each configuration ``repeats`` times, configurations alternating so that the host's load
    (shared with other jobs) hits them alike; medians over the repeats."""
    runs: dict[str, list[dict[str, Any]]] = {name: [] for name, _, _ in DECODE_CONFIGS}
    for _ in range(repeats):
        for name, world, threads in DECODE_CONFIGS:
            with tempfile.TemporaryDirectory() as tmp:
                ranks = run_ranks(decode_on_rank, world, Path(tmp), steps, threads=threads)
            r0 = dict(ranks[0])
            r0["same_tokens_on_all_ranks"] = all(r["tokens"] == r0["tokens"] for r in ranks)
            runs[name].append(r0)
            print(f"decode {name}: step {r0['step_ms']:.1f} ms, sample {r0['sample_ms']:.2f} ms")
    out: dict[str, Any] = {}
    for name, world, threads in DECODE_CONFIGS:
        rs = runs[name]
        step = statistics.median(r["step_ms"] for r in rs)
        out[name] = {
            "tp": world,
            "threads_per_rank": threads,
            "step_ms": step,
            "step_ms_runs": [r["step_ms"] for r in rs],
            "tokens_per_s": 1e3 / step,
            "forward_ms": statistics.median(r["forward_ms"] for r in rs),
            "sample_ms": statistics.median(r["sample_ms"] for r in rs),
            "forward_bytes_per_step_per_rank": rs[0]["forward_bytes_per_step"],
            "sample_bytes_per_step_per_rank": rs[0]["sample_bytes_per_step"],
            "same_tokens_on_all_ranks": all(r["same_tokens_on_all_ranks"] for r in rs),
            "tokens": rs[0]["tokens"],
        }
    out["tp2_tokens_equal_tp1"] = out["tp2"]["tokens"] == out["tp1_1thread"]["tokens"]
    return out


def _params(mode: Mode, n: int) -> SamplingTensors:
    return SamplingTensors.build(
        temperature=[0.0 if mode == "greedy" else 0.8] * n,
        top_p=[0.9 if mode == "filter" else 1.0] * n,
        top_k=[0] * n,
        seed=list(range(n)),
        offset=[7] * n,
        n_rows=n,
    )


@torch.inference_mode()
def sampler_bench(vocab: int, buckets: list[int], rounds: int) -> list[dict[str, Any]]:
    g = torch.Generator().manual_seed(0)
    rows: list[dict[str, Any]] = []
    for n in buckets:
        logits = torch.randn(n, vocab, generator=g)
        packed = torch.randint(-(2**31), 2**31, (n, words_per_row(vocab)), generator=g).to(
            torch.int32
        )
        for mode in MODES:
            p = _params(mode, n)
            cases: list[tuple[int, VocabShard, torch.Tensor, torch.Tensor, list[float]]] = []
            for world in (1, 2):
                shard = vocab_shards(vocab, world)[0]
                lg = logits[:, shard.start : shard.stop].contiguous()
                words = shard_mask_words(packed, shard).contiguous()
                cases.append((world, shard, lg, words, []))
            for i in range(rounds + 2):  # interleaved round by round; 2 warm-up rounds
                for _, shard, lg, words, times in cases:
                    t0 = time.perf_counter()
                    local_candidates(
                        lg,
                        words,
                        p.temperature,
                        p.seed,
                        p.offset,
                        shard=shard,
                        vocab_size=vocab,
                        mode=mode,
                        candidates=64,
                    )
                    if i >= 2:
                        times.append(time.perf_counter() - t0)
            for world, shard, _, _, times in cases:
                sampler = ShardedSampler(shard=shard, vocab_size=vocab, group=_Unused(world))
                rows.append(
                    {
                        "batch": n,
                        "mode": mode,
                        "tp": world,
                        "columns_per_rank": shard.width,
                        "local_ms": 1e3 * statistics.median(times),
                        "gather_bytes_per_rank": sampler.bytes_per_step(n, mode),
                        "gather_bytes_total": world * sampler.bytes_per_step(n, mode),
                        "logits_bytes": 4 * n * vocab,
                    }
                )
                print(f"sampler {rows[-1]}")
    return rows


class _Unused:
    """A group the sampler benchmark never calls (only ``bytes_per_step`` is read)."""

    rank = 0

    def __init__(self, world: int) -> None:
        self.world = world

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def all_gather(self, x: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError


def plot(result: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4))
    dec = result["decode"]
    sizes = [name for name, _, _ in DECODE_CONFIGS]
    fwd = [dec[s]["forward_ms"] for s in sizes]
    smp = [dec[s]["sample_ms"] for s in sizes]
    a.bar(sizes, fwd, label="forward (+ all-reduces)")
    a.bar(sizes, smp, bottom=fwd, label="sharded sampler (+ all-gather)")
    a.set_ylabel("ms per decode step (median)")
    a.set_title("SmolLM2-135M fp32 eager, 1 sequence, 2 shared CPU cores")
    a.legend()
    for mode in MODES:
        for world in (1, 2):
            pts = [r for r in result["sampler"] if r["mode"] == mode and r["tp"] == world]
            b.plot(
                [r["batch"] for r in pts],
                [r["local_ms"] for r in pts],
                marker="o",
                linestyle="-" if world == 1 else "--",
                label=f"{mode} TP={world}",
            )
    b.set_xscale("log", base=2)
    b.set_xlabel("batch rows")
    b.set_ylabel("ms per rank (median)")
    b.set_title(f"per-rank mask + candidates, vocab {result['vocab']}")
    b.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> int:
    args = parse_args()
    buckets = [int(x) for x in args.buckets.split(",")]
    result: dict[str, Any] = {
        "machine": {
            "platform": platform.platform(),
            "torch": torch.__version__,
            "threads": torch.get_num_threads(),
        },
        "vocab": args.vocab,
        "decode": decode_bench(args.steps, args.repeats),
        "load_average": os.getloadavg(),
        "sampler": sampler_bench(args.vocab, buckets, args.rounds),
    }
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps(result, indent=2) + "\n")
    plot(result, out.with_suffix(".png"))
    print(f"wrote {out.with_suffix('.json')} and {out.with_suffix('.png')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
