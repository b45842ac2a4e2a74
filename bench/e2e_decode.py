"""End-to-end decode throughput of the worker engine with a real grammar service.

The engine runs in this process (so its totals can be read directly and its forward swapped);
the grammar service runs as a real process on loopback. Same prompts for every variant:

* `unconstrained`: chat prompts, `ignore_eos`, `--max-tokens` new tokens each.
* `constrained`: the same prompts under a JSON schema whose valid outputs are about as long
  (an array of three small objects); overlap and jump-forward on (the defaults).
* `constrained_no_overlap`: grammar round trip before the forward pass (serial).
* `constrained_no_jf`: overlap on, jump-forward off (forced tokens sampled one per step).

Each variant runs with the real embedded model (SmolLM2-135M, fp32, eager) and with a stand-in
forward that sleeps 5 ms and returns fixed logits (what a fast accelerator would look like: the
grammar round trip then has to hide behind 5 ms). Variants are interleaved over `--repeats`
rounds so machine load drifts affect them alike; the median round is reported.

Reported per variant: aggregate completion tokens/s (sampled + forced), forward passes per output
token (summed `usage.forward_passes` over requests / completion tokens), the share of decode step
time spent waiting for masks after the forward pass, how long per step the event loop's thread and
the device thread were runnable but had no CPU (Linux schedstat: on a small machine they compete
with each other and with the grammar service), the CPU time per step of those two threads and
of the whole process (the host's work, whatever the contention: with the 0 ms stand-in, all of it
except the eager sampler's is what an accelerator would leave to the host), and schema validity
of every constrained output that ended with STOP (the others stopped at `--max-tokens`, inside
the structure).
Writes bench/results/e2e_decode.json and .png.

Usage: python bench/e2e_decode.py [--concurrency 1,8] [--max-tokens 64] [--repeats 3]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import jsonschema
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from maskwire.tokenizer import Tokenizer, load_tokenizer  # noqa: E402
from maskwire.v1 import common_pb2, worker_pb2  # noqa: E402
from neuron_worker import device_thread  # noqa: E402
from neuron_worker.backends import create_backend  # noqa: E402
from neuron_worker.detokenize import Detokenizer  # noqa: E402
from neuron_worker.engine import Engine, EngineConfig  # noqa: E402
from neuron_worker.grammar_client import GrammarClient  # noqa: E402
from neuron_worker.graphs import StepModel  # noqa: E402
from neuron_worker.metrics import Metrics  # noqa: E402
from neuron_worker.request import Request, Sampling  # noqa: E402
from neuron_worker.sampler import Sampler  # noqa: E402
from neuron_worker.servicer import response  # noqa: E402
from neuron_worker.step_device import StepDevice  # noqa: E402
from tests.support.processes import running  # noqa: E402

RESULTS = ROOT / "bench" / "results"
SCHEMA = {
    "type": "array",
    "items": {
        "type": "object",
        "properties": {
            "name": {"type": "string", "maxLength": 16},
            "age": {"type": "integer", "minimum": 0, "maximum": 120},
            "city": {"type": "string", "maxLength": 16},
        },
        "required": ["name", "age", "city"],
        "additionalProperties": False,
    },
    "minItems": 3,
    "maxItems": 3,
}
TOPICS = ["friends", "doctors", "painters", "pilots", "chefs", "teachers", "singers", "runners"]
VARIANTS = {
    "unconstrained": dict(constrained=False, overlap=True, jump_forward=True),
    "constrained": dict(constrained=True, overlap=True, jump_forward=True),
    "constrained_no_overlap": dict(constrained=True, overlap=False, jump_forward=True),
    "constrained_no_jf": dict(constrained=True, overlap=True, jump_forward=False),
}


def prompt(tok: Tokenizer, i: int) -> list[int]:
    topic = TOPICS[i % len(TOPICS)]
    text = (
        f"<|im_start|>user\nList three {topic} as JSON: name, age, city.<|im_end|>\n"
        "<|im_start|>assistant\n"
    )
    return tok.encode(text)


class StandInForward:
    """Bench-only model stand-in: sleeps `delay_s` per forward and returns fixed logits."""

    def __init__(self, vocab: int, delay_s: float) -> None:
        self.config = type("Cfg", (), {"vocab_size": vocab, "max_seq_len": 4096, "name": "standin"})
        self.delay_s = delay_s
        g = torch.Generator().manual_seed(0)
        self._table = torch.randn(64, vocab, generator=g)

    def setup_caches(self, max_batch: int, max_seq: int) -> None:
        pass

    def copy_slot(self, src: int, dst: int, length: int) -> None:
        pass

    def step_logits(
        self,
        tokens: torch.Tensor,
        input_pos: torch.Tensor,
        slots: torch.Tensor,
        kv_positions: torch.Tensor,
        last: torch.Tensor,
    ) -> torch.Tensor:
        if self.delay_s:
            time.sleep(self.delay_s)
        # Logits vary with each row's last real token, from a fixed table (no per-step work
        # that scales with the vocabulary: the stand-in must cost nothing itself).
        flat = tokens.reshape(-1)[last]
        rows = flat % self._table.shape[0]
        return self._table[rows]


@dataclass
class RunResult:
    wall_s: float
    tokens: int
    forced: int
    requests: int  # constrained outputs that ended with STOP (the rest hit max_tokens)
    valid: int  # ... of which valid against the schema
    passes: int  # forward passes summed over requests (usage.forward_passes)
    finish: dict[str, int]
    stats: dict[str, float]
    # Seconds each thread was runnable but had no CPU (another thread or process held it).
    run_queue_s: dict[str, float | None]
    # CPU seconds each thread used, and the whole process (the gRPC threads too).
    cpu_s: dict[str, float | None]


def _schedstat(tid: int, field: int) -> float | None:
    try:
        with open(f"/proc/self/task/{tid}/schedstat") as f:
            return int(f.read().split()[field]) / 1e9
    except (OSError, IndexError, ValueError):
        return None


def run_queue_s(tid: int) -> float | None:
    """Total time thread `tid` of this process has waited for a CPU while runnable (Linux
    schedstat; None elsewhere): on a small machine the device thread can be ready to start a
    pass while the event loop and the grammar service hold both cores."""
    return _schedstat(tid, 1)


def cpu_s(tid: int) -> float | None:
    """CPU time thread `tid` has used (Linux schedstat; None elsewhere): what the host's work
    costs whatever the contention (waiting for a core or for the grammar is not in it)."""
    return _schedstat(tid, 0)


def _elapsed(before: float | None, after: float | None) -> float | None:
    return None if before is None or after is None else after - before


async def thread_ids() -> dict[str, int]:
    """The native ids of the event loop's thread and the device thread."""
    return {
        "loop": threading.get_native_id(),
        "device": await device_thread.run(threading.get_native_id),
    }


async def run_variant(
    model: StepModel,
    tok: Tokenizer,
    sampler: Sampler,
    grammar_addr: str,
    variant: dict[str, bool],
    *,
    concurrency: int,
    max_tokens: int,
    n_requests: int,
) -> RunResult:
    config = EngineConfig(
        max_batch=concurrency,
        max_seq_len=512,
        batch_buckets=(*(b for b in (1, 2, 4, 8, 16, 32) if b < concurrency), concurrency),
        seq_buckets=(128, 256, 512),
        structured_outputs=True,
        overlap=variant["overlap"],
        jump_forward=variant["jump_forward"],
    )
    grammar = GrammarClient(
        [grammar_addr], tok.fingerprint.to_proto(), words_per_row=tok.words_per_row
    )
    metrics = Metrics()
    engine = Engine(
        device=StepDevice(
            model=model,
            backend=create_backend("cpu", compile=False),
            sampler=sampler,
            config=config,
            eos_ids=tuple(tok.eos_token_ids),
            words=tok.words_per_row,
        ),
        tokenizer=tok,
        grammar=grammar,
        config=config,
        metrics=metrics,
    )
    await engine.start()
    constraint = common_pb2.Constraint(json_schema=json.dumps(SCHEMA))
    reqs = []
    for i in range(n_requests):
        reqs.append(
            Request(
                request_id=f"b{i}",
                prompt=prompt(tok, i),
                sampling=Sampling(max_tokens=max_tokens, ignore_eos=not variant["constrained"]),
                detok=Detokenizer(tok.token_bytes),
                constraint=constraint if variant["constrained"] else None,
            )
        )

    async def one(req: Request) -> tuple[str, list[int], str]:
        await engine.submit(req)
        text, ids = [], []
        while True:
            item = await req.outputs.get()
            assert not isinstance(item, Exception), item
            msg = response(item)
            text.append(msg.text)
            ids.extend(msg.token_ids)
            if msg.finish_reason:
                return "".join(text), ids, worker_pb2.FinishReason.Name(msg.finish_reason)

    tids = await thread_ids()
    queued = {name: run_queue_s(tid) for name, tid in tids.items()}
    used = {name: cpu_s(tid) for name, tid in tids.items()}
    process_cpu = time.process_time()
    began = time.perf_counter()
    outs = await asyncio.gather(*(one(r) for r in reqs))
    wall = time.perf_counter() - began
    after = {name: run_queue_s(tid) for name, tid in tids.items()}
    used_after = {name: cpu_s(tid) for name, tid in tids.items()}
    process_cpu = time.process_time() - process_cpu
    await engine.stop()
    valid = 0
    finish: dict[str, int] = {}
    stopped = 0
    for text, _, reason in outs:
        finish[reason] = finish.get(reason, 0) + 1
        if variant["constrained"] and reason == "FINISH_REASON_STOP":
            stopped += 1
            try:
                jsonschema.validate(json.loads(text), SCHEMA)
                valid += 1
            except (ValueError, jsonschema.ValidationError):
                pass
    return RunResult(
        wall_s=wall,
        tokens=sum(len(ids) for _, ids, _ in outs),
        forced=sum(r.forced_tokens for r in reqs),
        requests=stopped,
        valid=valid,
        passes=sum(r.forward_passes for r in reqs),
        finish=finish,
        stats=metrics.stats.snapshot(),
        run_queue_s={name: _elapsed(queued[name], after[name]) for name in tids},
        cpu_s={
            **{name: _elapsed(used[name], used_after[name]) for name in tids},
            "process": process_cpu,
        },
    )


def summarize(runs: list[RunResult]) -> dict[str, Any]:
    tps = [r.tokens / r.wall_s for r in runs]
    med = sorted(range(len(runs)), key=lambda i: tps[i])[len(runs) // 2]
    r = runs[med]
    s = r.stats
    return {
        "tokens_per_s": round(tps[med], 2),
        "tokens_per_s_all": [round(x, 2) for x in tps],
        "completion_tokens": r.tokens,
        "forced_tokens": r.forced,
        "forward_passes_per_token": round(r.passes / max(r.tokens, 1), 3),
        "batch_forward_passes": int(s["forward_passes"]),
        "mask_wait_share": round(s["mask_wait_s"] / max(s["step_s"], 1e-9), 4),
        "mask_wait_ms_per_step": round(1e3 * s["mask_wait_s"] / max(s["steps"], 1), 3),
        "step_ms": round(1e3 * s["step_s"] / max(s["steps"], 1), 2),
        "forward_ms_per_step": round(1e3 * s["forward_s"] / max(s["steps"], 1), 2),
        "sample_ms_per_step": round(1e3 * s["sample_s"] / max(s["steps"], 1), 2),
        "steps": int(s["steps"]),
        **{
            f"{name}_thread_run_queue_ms_per_step": (
                None if q is None else round(1e3 * q / max(s["steps"], 1), 3)
            )
            for name, q in r.run_queue_s.items()
        },
        **{
            f"{name}{'' if name == 'process' else '_thread'}_cpu_ms_per_step": (
                None if c is None else round(1e3 * c / max(s["steps"], 1), 3)
            )
            for name, c in r.cpu_s.items()
        },
        "valid_of_stopped": f"{r.valid}/{r.requests}",
        "finish": r.finish,
        "wall_s": round(r.wall_s, 2),
    }


async def bench(args: argparse.Namespace) -> dict[str, Any]:
    torch.set_num_threads(args.threads)
    tok = load_tokenizer("default")
    from neuron_worker.model import load_model

    # On the engine's device thread, as the worker does (`neuron_worker.device_thread`).
    real = await device_thread.run(lambda: load_model("default").eval())
    vocab = int(real.config.vocab_size)
    models: dict[str, StepModel] = {}
    for name in args.models.split(","):
        if name == "smollm2":
            models[name] = real
        elif name.startswith("standin_") and name.endswith("ms"):
            # standin_0ms: the host's own time per step (no forward at all)
            delay_ms = float(name.removeprefix("standin_").removesuffix("ms"))
            models[name] = StandInForward(vocab, delay_ms / 1e3)
        else:
            raise SystemExit(f"unknown model {name!r} (smollm2, standin_<N>ms)")
    out: dict[str, Any] = {}
    levels = [int(c) for c in args.concurrency.split(",")]
    with running("grammar-service", ["--tokenizer", "default"]) as gs:
        for model_name, model in models.items():
            out[model_name] = {}
            for conc in levels:
                out[model_name][f"c{conc}"] = await bench_level(
                    model_name, model, tok, gs.address, conc, args
                )
    return out


async def bench_level(
    model_name: str,
    model: StepModel,
    tok: Tokenizer,
    grammar_addr: str,
    conc: int,
    args: argparse.Namespace,
) -> dict[str, Any]:
    """Every variant at one concurrency, interleaved over the rounds."""
    sampler = await device_thread.run(
        lambda: Sampler(
            vocab_size=tok.vocab_size,
            logits_size=int(model.config.vocab_size),
            max_rows=conc,
            device=torch.device("cpu"),
            structured_outputs=True,
            compile=False,
        )
    )
    # c1: two requests one after the other; cN: N requests together.
    kw = dict(concurrency=conc, max_tokens=args.max_tokens, n_requests=max(conc, 2))
    await run_variant(model, tok, sampler, grammar_addr, VARIANTS["constrained"], **kw)  # warm-up
    runs: dict[str, list[RunResult]] = {v: [] for v in VARIANTS}
    for rnd in range(args.repeats):
        for name, variant in VARIANTS.items():
            res = await run_variant(model, tok, sampler, grammar_addr, variant, **kw)
            runs[name].append(res)
            print(
                f"{model_name} c{conc} round {rnd} {name}: {res.tokens / res.wall_s:.1f} tok/s "
                f"valid {res.valid}/{res.requests} {res.finish}",
                flush=True,
            )
    summary = {name: summarize(rs) for name, rs in runs.items()}
    summary["unconstrained"].pop("valid_of_stopped")
    base = summary["unconstrained"]["tokens_per_s"]
    summary["ratios"] = {
        f"{name}_vs_unconstrained": round(summary[name]["tokens_per_s"] / base, 3)
        for name in VARIANTS
        if name != "unconstrained"
    }
    return summary


def plot(results: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(16, 4.8))
    names = list(VARIANTS)
    labels = ["unconstrained", "constrained", "constr. no overlap", "constr. no JF"]
    groups = [(m, c) for m in results["models"] for c in results["models"][m]]
    width = 0.8 / len(names)
    for j, name in enumerate(names):
        xs = [i + j * width for i in range(len(groups))]
        ratio = [
            results["models"][m][c][name]["tokens_per_s"]
            / results["models"][m][c]["unconstrained"]["tokens_per_s"]
            for m, c in groups
        ]
        wait = [100 * results["models"][m][c][name]["mask_wait_share"] for m, c in groups]
        fpt = [results["models"][m][c][name]["forward_passes_per_token"] for m, c in groups]
        axes[0].bar(xs, ratio, width=width, label=labels[j])
        axes[1].bar(xs, wait, width=width, label=labels[j])
        axes[2].bar(xs, fpt, width=width, label=labels[j])
    ticks = [i + 0.4 - width / 2 for i in range(len(groups))]
    for ax in axes:
        ax.set_xticks(ticks, [f"{m}\n{c}" for m, c in groups])
        ax.legend(fontsize=8)
    axes[0].axhline(0.97, color="k", lw=0.8, ls="--")
    axes[0].set_ylabel("tokens/s relative to unconstrained")
    axes[0].set_title("decode throughput (target >= 0.97)")
    axes[1].axhline(2.0, color="k", lw=0.8, ls="--")
    axes[1].set_ylabel("% of decode step time waiting for masks")
    axes[1].set_title("mask wait share (target < 2% with overlap)")
    axes[2].set_ylabel("forward passes per output token")
    axes[2].set_title("forward passes per token (per request)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--concurrency", default="1,8", help="comma-separated levels")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument(
        "--models",
        default="smollm2,standin_5ms",
        help="comma-separated: smollm2, standin_<N>ms (standin_0ms measures host time per step)",
    )
    p.add_argument("--out", default="e2e_decode", help="results file name (JSON and PNG)")
    args = p.parse_args()
    began = time.time()
    models = asyncio.run(bench(args))
    results = {
        "benchmark": "e2e_decode",
        "concurrency": args.concurrency,
        "max_tokens": args.max_tokens,
        "repeats": args.repeats,
        "machine": {
            "cpus": os.cpu_count(),
            "platform": platform.platform(),
            "torch": torch.__version__,
            "load_avg_at_start": os.getloadavg(),
        },
        "duration_s": round(time.time() - began, 1),
        "models": models,
    }
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / f"{args.out}.json").write_text(json.dumps(results, indent=2) + "\n")
    plot(results, RESULTS / f"{args.out}.png")
    print(json.dumps(models, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
