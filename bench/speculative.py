"""Speculative decoding on a real stack: tokens/s and forward passes per token, on and off.

Starts a grammar service and a worker with `--speculative ngram` (embedded SmolLM2; its default
text drafter, and the grammar's forced drafts), then runs two
workloads, each request twice on the same worker, interleaved (speculation on, then opted out
with `GenerateRequest.disable_speculation`), at each concurrency:

* extraction: prompts that hold a passage and ask for a JSON record of facts from it (a schema
  with several string fields), greedy: the record copies names and places from the passage;
* free text: greedy continuations of short prompts with little to copy.

After one unmeasured batch (the first of a workload finds none of its prompts in the prefix
cache), each batch runs twice per side, in the order on, off, off, on, `--rounds` times (a c8 batch
takes ~2 s: on 2 shared cores one round's ratio moves by 10%; `round_speedups` lists each
round's, the totals pool them). Reports per workload and
concurrency: tokens/s (completion tokens over the batch's wall time), decode tokens/s (the same
tokens over the wall time minus the worker's time in prompt passes, from its /metrics: the part
that speculation can shorten; the prompts cost the same on both sides), forward passes per token
(the worker's usage),
draft acceptance rate, the speedup, and whether every output is identical with and without
speculation. Jump-forward is on in both. Writes bench/results/speculative.json (and .png when
matplotlib is installed). `--reference` runs the worker eager fp32 (fast to start; the default
is the fast serving configuration, compiled, which warms up for minutes on a small host).

Example: `python bench/speculative.py --prompts 16 --concurrency 1,8`.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import platform
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any, NamedTuple

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import grpc  # noqa: E402
from prometheus_client.parser import text_string_to_metric_families  # noqa: E402

from maskwire.v1 import common_pb2, worker_pb2, worker_pb2_grpc  # noqa: E402
from tests.support.processes import free_port, running  # noqa: E402

NAMES = ["Maria Gonzalez", "Tomasz Nowak", "Aiko Tanaka", "Samuel Okafor", "Ingrid Larsen",
         "Rahul Mehta", "Chloe Dubois", "Mateo Rossi"]  # fmt: skip
CITIES = ["Valencia", "Krakow", "Osaka", "Lagos", "Bergen", "Pune", "Lyon", "Turin"]
JOBS = ["architect", "baker", "surgeon", "engineer", "teacher", "chemist", "pilot", "curator"]
PLACES = ["Riverside Public Library", "Old Mill Bakery", "Sakura General Hospital",
          "Harbour Bridge Office", "Northern Lights School", "Green Valley Laboratory",
          "Skyline Airport Tower", "Museum of Modern Glass"]  # fmt: skip
SCHEMA = {
    "type": "object",
    "properties": {k: {"type": "string"} for k in ("name", "city", "job", "workplace", "year")},
    "required": ["name", "city", "job", "workplace", "year"],
    "additionalProperties": False,
}
FREE = ["Once upon a time", "The weather today", "My favourite food is", "In the year 3000",
        "A good way to learn", "The ocean is", "When I was young", "Music makes people",
        "The best advice I got", "Cities at night", "A quiet morning", "The old castle",
        "Robots in the kitchen", "The first snow", "A letter to my friend", "The mountain path"]  # fmt: skip


def chat(question: str) -> str:
    return f"<|im_start|>user\n{question}<|im_end|>\n<|im_start|>assistant\n"


def extraction_prompts(n: int) -> list[str]:
    out = []
    for i in range(n):
        name, city = NAMES[i % 8], CITIES[(i * 3) % 8]
        job, place = JOBS[(i * 5) % 8], PLACES[(i * 7) % 8]
        year = 1990 + (i * 11) % 30
        passage = (
            f"{name} is a {job} from {city}. Since {year}, {name.split()[0]} has worked at the "
            f"{place}, where colleagues praise the {job}'s patience."
        )
        out.append(
            chat(
                f"Passage: {passage}\nExtract a JSON record with name, city, job, workplace and "
                "year, copying the words from the passage."
            )
        )
    return out


async def one(
    stub: worker_pb2_grpc.WorkerStub,
    prompt: str,
    constraint: common_pb2.Constraint | None,
    max_tokens: int,
    speculate: bool,
) -> dict[str, Any]:
    req = worker_pb2.GenerateRequest(
        text=prompt,
        sampling=worker_pb2.SamplingParams(max_tokens=max_tokens),
        disable_speculation=not speculate,
    )
    if constraint is not None:
        req.constraint.CopyFrom(constraint)
    ids: list[int] = []
    last = None
    async for msg in stub.Generate(req):
        ids += list(msg.token_ids)
        last = msg
    assert last is not None
    u = last.usage
    return {
        "ids": ids,
        "tokens": u.completion_tokens,
        "passes": u.forward_passes,
        "drafts": u.draft_tokens,
        "accepted": u.accepted_draft_tokens,
    }


TIMERS = ("step", "forward", "mask_wait", "sample")


def worker_timers(metrics_url: str) -> dict[str, dict[str, float]]:
    """The worker's timer totals so far from its /metrics: for each of its per-step timers
    (and each `kind` label), the seconds summed and the number of observations."""
    with urllib.request.urlopen(metrics_url, timeout=10) as r:
        text = r.read().decode()
    names = {f"maskwire_worker_{t}_seconds": t for t in TIMERS}
    totals: dict[str, dict[str, float]] = {}
    for family in text_string_to_metric_families(text):
        timer = names.get(family.name)
        if timer is None:
            continue
        for sample in family.samples:
            field = {"_sum": "seconds", "_count": "count"}.get(sample.name[len(family.name) :])
            if field:
                key = "/".join([timer, *sample.labels.values()])
                totals.setdefault(key, {})[field] = float(sample.value)
    return totals


def prefill_seconds(metrics_url: str) -> float:
    """The worker's total time in prompt (prefill) passes so far."""
    return worker_timers(metrics_url).get("forward/prefill", {}).get("seconds", 0.0)


class Batch(NamedTuple):
    results: list[dict[str, Any]]
    seconds: float  # wall time
    prefill_s: float  # of which the worker spent in prompt passes (the same on both sides)


async def batch(
    stub: worker_pb2_grpc.WorkerStub,
    metrics_url: str,
    prompts: list[str],
    constraint: common_pb2.Constraint | None,
    max_tokens: int,
    concurrency: int,
    speculate: bool,
) -> Batch:
    """Run `prompts` with at most `concurrency` in flight."""
    sem = asyncio.Semaphore(concurrency)

    async def limited(p: str) -> dict[str, Any]:
        async with sem:
            return await one(stub, p, constraint, max_tokens, speculate)

    prefill = prefill_seconds(metrics_url)
    began = time.perf_counter()
    results = await asyncio.gather(*(limited(p) for p in prompts))
    seconds = time.perf_counter() - began
    return Batch(list(results), seconds, prefill_seconds(metrics_url) - prefill)


def summary(batches: list[Batch]) -> dict[str, float]:
    results = [r for b in batches for r in b.results]
    seconds = sum(b.seconds for b in batches)
    prefill_s = sum(b.prefill_s for b in batches)
    tokens = sum(r["tokens"] for r in results)
    passes = sum(r["passes"] for r in results)
    drafts = sum(r["drafts"] for r in results)
    return {
        "tokens": tokens,
        "seconds": round(seconds, 3),
        "tokens_per_s": round(tokens / seconds, 2),
        "prefill_share": round(prefill_s / seconds, 4),
        # What speculation acts on: the tokens over the time outside prompt passes.
        "decode_tokens_per_s": round(tokens / max(seconds - prefill_s, 1e-9), 2),
        "forward_passes_per_token": round(passes / max(tokens, 1), 4),
        "tokens_per_forward_pass": round(tokens / max(passes, 1), 4),
        "draft_tokens": drafts,
        "acceptance_rate": round(sum(r["accepted"] for r in results) / drafts, 4) if drafts else 0,
    }


async def measure(address: str, metrics_url: str, args: argparse.Namespace) -> list[dict[str, Any]]:
    constraint = common_pb2.Constraint(json_schema=json.dumps(SCHEMA))
    workloads = [
        ("extraction", extraction_prompts(args.prompts), constraint, args.max_tokens),
        ("free_text", FREE[: args.prompts], None, args.max_tokens),
    ]
    rows = []
    async with grpc.aio.insecure_channel(address) as ch:
        stub = worker_pb2_grpc.WorkerStub(ch)
        await one(stub, FREE[0], None, 4, True)  # first-request costs out of the way
        for c in args.concurrency:
            for name, prompts, cons, max_tokens in workloads:
                # Rounds of A B B A (same worker, same minutes): a host whose load drifts
                # favours neither side. Totals over every round; each round's ratio too.
                # One batch unmeasured first: the first batch of a workload at a concurrency
                # finds its prompts in no cache slot (the prefix cache), the later ones do.
                await batch(stub, metrics_url, prompts, cons, max_tokens, c, False)
                runs: dict[bool, list[Batch]] = {True: [], False: []}
                for _ in range(args.rounds):
                    for speculate in (True, False, False, True):
                        runs[speculate].append(
                            await batch(stub, metrics_url, prompts, cons, max_tokens, c, speculate)
                        )
                on, off = (summary(runs[s]) for s in (True, False))
                rounds = [
                    summary(runs[True][2 * i : 2 * i + 2])["tokens_per_s"]
                    / summary(runs[False][2 * i : 2 * i + 2])["tokens_per_s"]
                    for i in range(args.rounds)
                ]
                identical = all(
                    a["ids"] == b["ids"]
                    for a, b in zip(runs[True][0].results, runs[False][0].results, strict=True)
                )
                row = {
                    "workload": name,
                    "concurrency": c,
                    "on": on,
                    "off": off,
                    "speedup": round(on["tokens_per_s"] / off["tokens_per_s"], 3),
                    "round_speedups": [round(x, 3) for x in rounds],
                    "decode_speedup": round(
                        on["decode_tokens_per_s"] / off["decode_tokens_per_s"], 3
                    ),
                    "identical": identical,
                }
                print(json.dumps(row), flush=True)
                rows.append(row)
    return rows


def plot(rows: list[dict[str, Any]], path: Path) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    labels = [f"{r['workload']}\nc{r['concurrency']}" for r in rows]
    fig, axes = plt.subplots(1, 3, figsize=(15, 4))
    x = range(len(rows))
    for ax, key, title in (
        (axes[0], "tokens_per_s", "tokens/s"),
        (axes[1], "decode_tokens_per_s", "decode tokens/s (outside prompt passes)"),
        (axes[2], "tokens_per_forward_pass", "tokens per forward pass"),
    ):
        ax.bar([i - 0.2 for i in x], [r["off"][key] for r in rows], 0.4, label="off")
        ax.bar([i + 0.2 for i in x], [r["on"][key] for r in rows], 0.4, label="ngram")
        ax.set_xticks(list(x), labels)
        ax.set_title(title)
        ax.legend()
    fig.tight_layout()
    fig.savefig(path)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--prompts", type=int, default=16)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--concurrency", default="1,8")
    p.add_argument("--num-draft-tokens", type=int, default=4)
    p.add_argument("--rounds", type=int, default=1, help="A B B A rounds per workload and c")
    p.add_argument("--reference", action="store_true", help="worker eager fp32 (fast start)")
    p.add_argument("--out", default=str(ROOT / "bench/results/speculative.json"))
    p.add_argument(
        "--worker-arg", action="append", default=[], help="extra worker flag (repeatable)"
    )
    args = p.parse_args()
    args.concurrency = [int(c) for c in args.concurrency.split(",")]
    worker = ["--model", "default", "--max-batch-size", "8", "--max-seq-len", "1024"]
    worker += ["--speculative", "ngram", "--num-draft-tokens", str(args.num_draft_tokens)]
    if not args.reference:  # the fast default (the test helper would pick the reference)
        worker += ["--compile", "--dtype", "auto", "--quantize", "auto"]
    worker += args.worker_arg
    metrics_port = free_port()
    with (
        running("grammar-service", ["--tokenizer", "default"]) as gs,
        running(
            "worker",
            [*worker, "--grammar-service", gs.address, "--metrics-port", str(metrics_port)],
            timeout_s=1800,
        ) as w,
    ):
        metrics_url = f"http://127.0.0.1:{metrics_port}/metrics"
        rows = asyncio.run(measure(w.address, metrics_url, args))
        timers = worker_timers(metrics_url)
    out = Path(args.out)
    result = {
        "machine": {"platform": platform.platform(), "python": platform.python_version()},
        "worker": worker,
        "prompts": args.prompts,
        "max_tokens": args.max_tokens,
        "rows": rows,
        # The worker's own per-step timers over the whole run (all rows, both sides).
        "worker_timers": timers,
    }
    out.write_text(json.dumps(result, indent=1) + "\n")
    plot(rows, out.with_suffix(".png"))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
