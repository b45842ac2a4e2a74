"""How far a worker configuration's outputs are from the reference's, on the real model.

A configuration is a list of worker flags, turned into the model, kernels and compiled graphs
through the functions `maskwire worker` uses (`neuron_worker.app`), so "the defaults" are the
settings the CLI picks with no flag given. Its forward passes run through the worker's
`ForwardRunner` as the engine issues them for a request served alone: the prompt in one prefill
pass, then one token per pass.

The reference (`REFERENCE`: the flags integration tests give their workers, eager float32
without quantization) decodes each prompt greedily and keeps its logits. Each configuration
then decodes the same prompts: teacher-forced on the reference's tokens (its logits at every
position against the reference's: top-1 agreement, max and mean absolute error) and greedily
from its own first disagreement (identical continuations, common prefix).

Each configuration runs in a process of its own: the worker compiles without guards on module
attributes, so in one process a second model would run the first one's graphs. `measure` starts
them (`python -m tests.support.quality`), the reference first, and collects their figures.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch
from torch import Tensor

from maskwire.tokenizer import load_tokenizer
from neuron_worker import app, cli, compile_cache, kernels
from neuron_worker.backends import create_backend
from neuron_worker.config import fit_context, worker_config
from neuron_worker.graphs import Pass
from tests.integration.worker.conftest import chat
from tests.support.processes import worker_args

ROOT = Path(__file__).resolve().parents[2]

# The settings integration tests give their workers, on the CPU.
REFERENCE = tuple(worker_args(["--device", "cpu"]))
# The context every configuration runs with (the KV cache is sized by it; a request's numerics
# are not).
LIMITS = ("--max-seq-len", "512")

# Prompts of the kinds users send: questions, instructions, code, JSON, lists, translation.
QUESTIONS = (
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Explain photosynthesis in two sentences.",
    "List three colors as a JSON array.",
    "Write a Python function that reverses a string.",
    "What is 17 times 23?",
    "Give me a short story opening about a lighthouse keeper.",
    "Translate 'good morning' into Spanish, French and German.",
    "Describe a cat to someone who has never seen one.",
    "What are the three states of matter?",
    "Write a SQL query that counts the rows of a table named users.",
    "Summarize the plot of Romeo and Juliet.",
    "Give three tips for learning a new language.",
    "Return a JSON object with a name and an age for a fictional person.",
    "Why is the sky blue?",
    "Write a limerick about a programmer.",
    "What does HTTP stand for?",
    "Name five fruits that are red.",
    "How do I make a cup of tea?",
    "Write a bash command that lists the largest files in a directory.",
    "What is the boiling point of water in Fahrenheit?",
    "Suggest a name for a bakery.",
    "Explain recursion to a child.",
    "What is the difference between a list and a tuple in Python?",
    "Write an email asking a colleague to reschedule a meeting.",
    "Who wrote Pride and Prejudice?",
    "Give a recipe for pancakes.",
    "What is machine learning?",
    "Convert 5 kilometers to miles.",
    "Write a regular expression that matches an email address.",
    "Describe the water cycle.",
    "What are the planets of the solar system?",
    "Write a short poem about autumn leaves.",
    "Explain what a black hole is.",
    "Give me a packing list for a weekend camping trip.",
    "What is the Pythagorean theorem?",
    "Write a JavaScript function that adds two numbers.",
    "Why do we have seasons?",
    "Tell me a fun fact about octopuses.",
    "What is the tallest mountain in the world?",
)


def prompts(n: int) -> list[str]:
    if not 1 <= n <= len(QUESTIONS):
        raise ValueError(f"1 to {len(QUESTIONS)} prompts, not {n}")
    return [chat(q) for q in QUESTIONS[:n]]


@dataclass
class Figures:
    """One configuration against the reference, over every prompt."""

    settings: str  # `Tuning.describe()`: what the flags resolved to
    kernels: str  # the worker's own kernel set in use (`neuron_worker.kernels`), or "none"
    prompts: int
    identical: int  # greedy continuations equal to the reference's (to EOS or the token limit)
    mean_prefix: float  # mean tokens a greedy continuation shares with the reference's
    positions: int  # teacher-forced positions compared
    top1: float  # share of positions whose argmax is the reference's
    max_error: float  # largest |logit - reference logit| over every position and token
    mean_error: float  # mean |logit - reference logit| over every position and token


@dataclass(frozen=True)
class Row:
    """A row of a pass: `tokens` at positions `start`... of cache slot `slot`; logits wanted
    for its last `outputs` tokens."""

    slot: int
    tokens: Sequence[int]
    start: int
    outputs: int = 1


class Decoder:
    """A worker configuration's model, KV cache and forward graphs, driven pass by pass."""

    def __init__(self, argv: Sequence[str]) -> None:
        parser = argparse.ArgumentParser()
        cli.add_arguments(parser)
        # The grammar service named is never dialled: the decoder runs forward passes only.
        config = worker_config(parser.parse_args(["--grammar-service", "127.0.0.1:50061", *argv]))
        tp = config.model.tensor_parallel_size
        torch.set_num_threads(config.model.threads or app.rank_threads(tp))
        self.settings = config.tuning
        cache = app.use_compile_cache(config)
        backend = create_backend(
            config.model.device,
            compile=self.settings.compile,
            cuda_graphs=self.settings.cuda_graphs,
        )
        model = app.load_worker_model(config, backend)
        engine = fit_context(config.engine, int(model.config.max_seq_len))
        self.tokenizer = load_tokenizer(config.model.spec)
        self.eos = set(self.tokenizer.eos_token_ids)
        self.vocab = self.tokenizer.vocab_size
        self.device = app.build_step_device(
            model,
            backend,
            engine,
            vocab_size=self.vocab,
            eos_ids=tuple(self.eos),
            graph_dir=compile_cache.graph_directory(cache, backend.name),
        )
        self.device.setup()
        chosen = kernels.cpu_kernel_set()
        self.kernels = chosen.name if chosen is not None and kernels.available() else "none"

    def run(
        self, tokens: Sequence[int], start: int, *, prefill: bool = False, outputs: int = 1
    ) -> Tensor:
        """One pass of one row in slot 0: `tokens` at positions `start`...; the float32 logits
        [outputs, vocab] of its last `outputs` tokens, on the host."""
        return self.run_rows([Row(0, tokens, start, outputs)], prefill=prefill)

    def run_rows(self, rows: Sequence[Row], *, prefill: bool = False) -> Tensor:
        """One pass over `rows`, built as the engine builds it (`ForwardBatch.pack`): the float32
        logits of each row's last `outputs` tokens, row after row, on the host."""
        runner = self.device.runner
        end = max(r.start + len(r.tokens) for r in rows)
        n, t, kv_len = runner.shape(len(rows), max(len(r.tokens) for r in rows), end)
        wanted = sum(r.outputs for r in rows)
        count = runner.logits_count(n, wanted, max(r.outputs for r in rows))
        toks = np.zeros((n, t), dtype=np.int64)
        pos = np.full((n, t), -1, dtype=np.int64)
        slots = np.full(n, self.device.pad_slot, dtype=np.int64)
        last = np.zeros(count, dtype=np.int64)
        o = 0
        for i, r in enumerate(rows):
            k = len(r.tokens)
            toks[i, :k] = r.tokens
            pos[i, :k] = np.arange(r.start, r.start + k)
            slots[i] = r.slot
            last[o : o + r.outputs] = i * t + np.arange(k - r.outputs, k)
            o += r.outputs
        logits = runner.run(Pass(toks, pos, slots, last, kv_len, prefill=prefill))
        return logits[:wanted, : self.vocab].float().cpu()

    def encode(self, text: str) -> list[int]:
        return list(self.tokenizer.encode(text))

    def greedy(self, prompt: Sequence[int], max_tokens: int) -> tuple[list[int], Tensor]:
        """The greedy continuation (to EOS, included, or `max_tokens`) and the logits that
        chose each of its tokens [len, vocab]."""
        logits = [self.run(prompt, 0, prefill=True)[0]]
        out = [int(logits[0].argmax())]
        while out[-1] not in self.eos and len(out) < max_tokens:
            logits.append(self.run([out[-1]], len(prompt) + len(out) - 1)[0])
            out.append(int(logits[-1].argmax()))
        return out, torch.stack(logits)

    def forced(
        self, prompt: Sequence[int], tokens: Sequence[int], max_tokens: int
    ) -> tuple[Tensor, list[int]]:
        """Teacher-forced on `tokens`: the logits at each of their positions [len, vocab]; and
        this configuration's own greedy continuation, which is `tokens` up to its first argmax
        that differs, and from there its own tokens (to EOS or `max_tokens`)."""
        logits = [self.run(prompt, 0, prefill=True)[0]]
        for i, tok in enumerate(tokens[:-1]):
            logits.append(self.run([tok], len(prompt) + i)[0])
        forced = torch.stack(logits)
        choice = forced.argmax(-1).tolist()
        split = next(
            (i for i, (a, b) in enumerate(zip(choice, tokens, strict=True)) if a != b), None
        )
        if split is None:
            return forced, list(tokens)
        # The cache holds `tokens` up to `split`: the same context as the greedy run's there.
        out = [*tokens[:split], choice[split]]
        while out[-1] not in self.eos and len(out) < max_tokens:
            out.append(int(self.run([out[-1]], len(prompt) + len(out) - 1)[0].argmax()))
        return forced, out


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    return next(
        (i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b))
    )


def write_reference(texts: Sequence[str], max_tokens: int, out: Path) -> None:
    """The reference's greedy continuation of each prompt and its logits, one file each."""
    decoder = Decoder([*REFERENCE, *LIMITS])
    out.mkdir(parents=True, exist_ok=True)
    with torch.inference_mode():
        for i, text in enumerate(texts):
            prompt = decoder.encode(text)
            tokens, logits = decoder.greedy(prompt, max_tokens)
            torch.save({"prompt": prompt, "tokens": tokens, "logits": logits}, out / f"{i}.pt")


def compare(argv: Sequence[str], reference: Path, count: int, max_tokens: int) -> Figures:
    """`argv`'s configuration against the reference `write_reference` wrote for `count`
    prompts."""
    decoder = Decoder([*argv, *LIMITS])
    identical = prefix = positions = agree = 0
    max_error = total_error = 0.0
    with torch.inference_mode():
        for i in range(count):
            ref = torch.load(reference / f"{i}.pt")
            want: list[int] = ref["tokens"]
            logits, got = decoder.forced(ref["prompt"], want, max_tokens)
            identical += got == want
            prefix += common_prefix(got, want)
            error = (logits - ref["logits"]).abs()
            positions += len(want)
            agree += int((logits.argmax(-1) == torch.tensor(want)).sum())
            max_error = max(max_error, float(error.max()))
            total_error += float(error.double().sum())
    return Figures(
        settings=decoder.settings.describe(),
        kernels=decoder.kernels,
        prompts=count,
        identical=identical,
        mean_prefix=prefix / count,
        positions=positions,
        top1=agree / positions,
        max_error=max_error,
        mean_error=total_error / (positions * decoder.vocab),
    )


def invariance(argv: Sequence[str], count: int, drafts: int) -> dict[str, float]:
    """The largest logit difference (0: bit-identical) between passes that the engine may run
    either way, for `count` prompts (at most the batch) in slots 0...: their prefill together
    and each alone; a decode step of every row together and each alone; a verification row
    (a pending token and `drafts` drafts, `--speculative ngram`'s shape) and its tokens decoded
    one by one; every row's verification together and each alone."""
    decoder = Decoder([*argv, *LIMITS])
    out: dict[str, float] = {}

    def diff(name: str, a: Tensor, b: Tensor) -> None:
        out[name] = max(out.get(name, 0.0), float((a - b).abs().max()))

    with torch.inference_mode():
        texts = [decoder.encode(t) for t in prompts(count)]
        rows = [Row(i, p, 0) for i, p in enumerate(texts)]
        alone = torch.cat([decoder.run_rows([r], prefill=True) for r in rows])
        diff("prefill", decoder.run_rows(rows, prefill=True), alone)
        first = alone.argmax(-1).tolist()
        rows = [Row(i, [first[i]], len(p)) for i, p in enumerate(texts)]
        alone = torch.cat([decoder.run_rows([r]) for r in rows])
        diff("decode", decoder.run_rows(rows), alone)
        # Drafts: any tokens will do (the prompt's own, after its chat header).
        rows = [
            Row(i, [first[i], *p[3 : 3 + drafts]], len(p), outputs=1 + drafts)
            for i, p in enumerate(texts)
        ]
        for r in rows:
            serial = [
                decoder.run_rows([Row(r.slot, [t], r.start + j)]) for j, t in enumerate(r.tokens)
            ]
            diff("verify", decoder.run_rows([r]), torch.cat(serial))
        alone = torch.cat([decoder.run_rows([r]) for r in rows])
        diff("verify_batch", decoder.run_rows(rows), alone)
    return out


def measure(
    configurations: Mapping[str, Sequence[str]],
    *,
    count: int,
    max_tokens: int,
    workdir: Path,
    compile_cache: Path | None = None,
) -> dict[str, Figures]:
    """Each configuration's `Figures` (by name) on the first `count` prompts, `max_tokens`
    tokens each; every run in a process of its own (module docstring). `compile_cache`: the
    `--compile-cache` of the compiled ones (default: the worker's)."""
    reference = workdir / "reference"
    common = ["--prompts", str(count), "--tokens", str(max_tokens)]
    _run(["reference", *common, "--out", str(reference)])
    cache = [] if compile_cache is None else ["--compile-cache", str(compile_cache)]
    out: dict[str, Figures] = {}
    for name, argv in configurations.items():
        result = workdir / f"{name}.json"
        step = ["compare", *common, "--reference", str(reference), "--json", str(result)]
        _run([*step, "--", *argv, *cache])
        out[name] = Figures(**json.loads(result.read_text()))
    return out


def measure_invariance(
    argv: Sequence[str], *, count: int, drafts: int, workdir: Path
) -> dict[str, float]:
    """`invariance` for the configuration `argv`, in a process of its own."""
    result = workdir / "invariance.json"
    _run(
        [
            "invariance",
            "--prompts",
            str(count),
            "--drafts",
            str(drafts),
            "--json",
            str(result),
            "--",
            *argv,
        ]
    )
    diffs: dict[str, float] = json.loads(result.read_text())
    return diffs


def _run(argv: list[str]) -> None:
    subprocess.run([sys.executable, "-m", "tests.support.quality", *argv], cwd=ROOT, check=True)


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        description="one step of `measure`: `reference`, or `compare`/`invariance` -- FLAGS"
    )
    p.add_argument("step", choices=("reference", "compare", "invariance"))
    p.add_argument("--prompts", type=int, required=True)
    p.add_argument("--tokens", type=int, default=0)
    p.add_argument("--out", type=Path, help="reference: its directory")
    p.add_argument("--reference", type=Path, help="compare: the reference's directory")
    p.add_argument("--json", type=Path, help="compare, invariance: where the figures go")
    p.add_argument("--drafts", type=int, default=4, help="invariance: drafts per row")
    # The configuration's worker flags follow `--` (not an argparse remainder: one would take
    # the options after the step).
    args = list(sys.argv[1:] if argv is None else argv)
    split = args.index("--") if "--" in args else len(args)
    a = p.parse_args(args[:split])
    flags = args[split + 1 :]
    if a.step == "reference":
        write_reference(prompts(a.prompts), a.tokens, a.out)
    elif a.step == "compare":
        figures = compare(flags, a.reference, a.prompts, a.tokens)
        a.json.write_text(json.dumps(asdict(figures), indent=1))
    else:
        diffs = invariance(flags, a.prompts, a.drafts)
        a.json.write_text(json.dumps(diffs, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
