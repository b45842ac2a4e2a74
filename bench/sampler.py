"""Masked vs plain sampling over the same logits, per batch bucket, eager vs compiled.

    .venv/bin/python bench/sampler.py [--device cpu|cuda] [--vocab 131072] [--buckets 1,8,64]
        [--modes greedy,sample] [--rounds 40] [--out bench/results/sampler]

For each bucket and mode it times, interleaved round by round so machine noise hits every variant
alike:
* plain: the same sampler graph without a mask input (``structured_outputs=False``); for greedy
  also a bare ``logits.argmax(-1)``, the floor any sampler is compared with;
* masked: the sampler with a random packed mask (the unpack, ``-inf`` fill and sampling);
each eager (the pure function) and compiled (``Sampler(compile=True)``, the worker's graphs).
Writes ``<out>.json`` (medians, minimums, compile seconds, ratios) and ``<out>.png``.
"""

from __future__ import annotations

import argparse
import functools
import json
import platform
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from neuron_worker.sampler import Sampler, SamplingTensors, sample_tokens

Fn = Callable[[], torch.Tensor]


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--device", default="cpu")
    p.add_argument("--vocab", type=int, default=131_072)
    p.add_argument("--buckets", default="1,8,64")
    p.add_argument("--modes", default="greedy,sample", help="greedy,sample,filter")
    p.add_argument("--rounds", type=int, default=40, help="timed rounds per bucket and mode")
    p.add_argument("--out", default="bench/results/sampler")
    return p.parse_args()


def params_for(mode: str, n: int, device: torch.device) -> SamplingTensors:
    return SamplingTensors.build(
        temperature=[0.0 if mode == "greedy" else 0.8] * n,
        top_p=[0.9 if mode == "filter" else 1.0] * n,
        top_k=[0] * n,
        seed=list(range(n)),
        offset=[7] * n,
        n_rows=n,
        device=device,
    )


def main() -> int:
    args = parse_args()
    device = torch.device(args.device)
    vocab = args.vocab
    buckets = [int(b) for b in args.buckets.split(",")]
    modes = args.modes.split(",")

    def sync() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize()

    samplers = {
        (masked, compiled): Sampler(
            vocab_size=vocab,
            logits_size=vocab,
            max_rows=max(buckets),
            device=device,
            structured_outputs=masked,
            compile=compiled,
        )
        for masked in (False, True)
        for compiled in (False, True)
    }
    argmax_compiled = torch.compile(lambda x: x.argmax(-1), fullgraph=True)
    results: list[dict[str, object]] = []
    for mode in modes:
        for n in buckets:
            g = torch.Generator().manual_seed(n)
            logits = torch.randn(n, vocab, generator=g).to(device)
            packed = torch.randint(-(2**31), 2**31, (n, (vocab + 31) // 32), generator=g)
            mask = packed.to(torch.int32).to(device)
            params = params_for(mode, n, device)
            variants: dict[str, Fn] = {}
            for (masked, compiled), s in samplers.items():
                name = f"{'masked' if masked else 'plain'}_{'compiled' if compiled else 'eager'}"
                if compiled:
                    variants[name] = functools.partial(s, logits, mask if masked else None, params)
                else:  # the pure function itself, as the eager path runs it
                    variants[name] = functools.partial(
                        sample_tokens,
                        logits,
                        mask if masked else None,
                        params.temperature,
                        params.top_p,
                        params.top_k,
                        params.seed,
                        params.offset,
                        vocab_size=vocab,
                        mode=params.mode,
                    )
            if mode == "greedy":
                variants["argmax_eager"] = functools.partial(torch.argmax, logits, -1)
                variants["argmax_compiled"] = functools.partial(argmax_compiled, logits)
            compile_s: dict[str, float] = {}
            for name, fn in variants.items():
                t = time.perf_counter()
                fn()
                sync()
                compile_s[name] = time.perf_counter() - t
                fn()  # second call: allocator and caches warm
            times: dict[str, list[float]] = {name: [] for name in variants}
            names = list(variants)
            # The sorting graph is ~10x slower per call: fewer rounds keep the run short.
            rounds = args.rounds if mode != "filter" else max(5, args.rounds // 4)
            for r in range(rounds):
                for name in names[r % len(names) :] + names[: r % len(names)]:
                    sync()
                    t = time.perf_counter()
                    variants[name]()
                    sync()
                    times[name].append((time.perf_counter() - t) * 1e3)
            row: dict[str, object] = {
                "mode": mode,
                "bucket": n,
                "median_ms": {k: statistics.median(v) for k, v in times.items()},
                "min_ms": {k: min(v) for k, v in times.items()},
                "first_call_s": compile_s,
            }
            med = row["median_ms"]
            assert isinstance(med, dict)
            best_plain = min(med["plain_eager"], med["plain_compiled"])
            if mode == "greedy":
                best_plain = min(best_plain, med["argmax_eager"], med["argmax_compiled"])
            row["ratio"] = {
                "eager": med["masked_eager"] / med["plain_eager"],
                "compiled": med["masked_compiled"] / med["plain_compiled"],
                "best_masked_vs_best_plain": min(med["masked_eager"], med["masked_compiled"])
                / best_plain,
            }
            results.append(row)
            print(json.dumps(row), flush=True)

    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    meta = {
        "device": str(device),
        "vocab": vocab,
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "machine": platform.processor() or platform.machine(),
        "rounds": args.rounds,
    }
    out.with_suffix(".json").write_text(json.dumps({"meta": meta, "results": results}, indent=1))
    plot(results, out.with_suffix(".png"), meta)
    return 0


def plot(results: list[dict[str, object]], path: Path, meta: dict[str, object]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    modes = sorted({str(r["mode"]) for r in results}, key=["greedy", "sample", "filter"].index)
    fig, axes = plt.subplots(1, len(modes), figsize=(6 * len(modes), 4), squeeze=False)
    for ax, mode in zip(axes[0], modes, strict=True):
        rows = [r for r in results if r["mode"] == mode]
        names = list(rows[0]["median_ms"])  # type: ignore[call-overload]
        width = 0.8 / len(names)
        for i, name in enumerate(names):
            xs = [j + i * width for j in range(len(rows))]
            ax.bar(xs, [r["median_ms"][name] for r in rows], width, label=name)  # type: ignore[index]
        ax.set_xticks([j + 0.4 - width / 2 for j in range(len(rows))])
        ax.set_xticklabels([f"B={r['bucket']}" for r in rows])
        ax.set_yscale("log")
        ax.set_ylabel("median ms per call")
        ax.set_title(f"{mode}, vocab {meta['vocab']}, {meta['device']}")
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    raise SystemExit(main())
