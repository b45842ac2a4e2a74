"""The step loop against a fake model whose next token depends on every K/V it was given.

If a token were written at the wrong position or slot, or a forced token skipped, the fake's
outputs would diverge from the reference computed here. The grammar is a scripted in-process
fake (forced tokens after every sampled token, then an end), so overlap, serial mode and
jump-forward can all be checked against the same reference.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Awaitable, Callable, Sequence
from types import SimpleNamespace
from typing import Any, TypeVar

import grpc
import numpy as np
import pytest
import torch

from maskwire.rpc import RpcError
from maskwire.tokenizer import load_tokenizer
from maskwire.v1 import common_pb2, worker_pb2
from neuron_worker import device_thread
from neuron_worker.backends import create_backend
from neuron_worker.detokenize import Detokenizer
from neuron_worker.drafter import DraftConfig
from neuron_worker.engine import Engine, EngineConfig
from neuron_worker.events import EngineError, Output
from neuron_worker.grammar_client import GrammarRequest, RowOutcome
from neuron_worker.request import Request, Sampling
from neuron_worker.sampler import Sampler
from neuron_worker.servicer import response, status
from neuron_worker.step_device import Logits, Sampled, StepDevice
from neuron_worker.step_rows import Answers, Draw, ForwardBatch

T = TypeVar("T")

TOK = load_tokenizer("default")
V = TOK.vocab_size
# Plain ASCII word tokens, so text is predictable and never an EOS.
NORMAL = [i for i in range(300, 3000) if TOK.token_bytes(i).isalpha()][:97]
FF = NORMAL[:2]
REJECTED = NORMAL[5]  # FakeGrammar never accepts this token as a draft
FORCED_DRAFT = NORMAL[6]  # FakeGrammar's draft of what it forces after FF
P = 1_000_003


def next_token(seq: Sequence[int]) -> int:
    h = sum((i + 1) * t for i, t in enumerate(seq)) % P
    return NORMAL[h % len(NORMAL)]


class FakeModel:
    """Keeps a token cache per slot; the output at position p hashes the slot's tokens [0, p]."""

    def __init__(self) -> None:
        self.config = SimpleNamespace(vocab_size=V + 64, max_seq_len=256, name="fake")
        self.live_slots: set[int] = set()
        self.pad_writes = 0
        self.rule = next_token  # the next token after a sequence
        self.threads: set[str] = set()  # the threads that called the model
        self.gate: threading.Event | None = None  # set: a forward pass waits until it opens
        self.rows_per_pass: list[int] = []  # rows with a real token, per forward pass

    def setup_caches(self, max_batch: int, max_seq: int) -> None:
        self.threads.add(threading.current_thread().name)
        self.cache = np.full((max_batch, max_seq), -1, dtype=np.int64)
        self.copies: list[tuple[int, int, int]] = []

    def copy_slot(self, src: int | torch.Tensor, dst: int | torch.Tensor, length: int) -> None:
        src, dst = int(src), int(dst)  # bucketed: one-element tensors
        self.cache[dst, :length] = self.cache[src, :length]
        self.copies.append((src, dst, length))

    def step_logits(
        self,
        tokens: torch.Tensor,
        pos: torch.Tensor,
        slots: torch.Tensor,
        kv_positions: torch.Tensor,
        last: torch.Tensor,
    ) -> torch.Tensor:
        self.threads.add(threading.current_thread().name)
        if self.gate is not None:
            assert self.gate.wait(30), "the test never opened the gate"
        b, t = tokens.shape
        kv_len = kv_positions.shape[0]
        self.rows_per_pass.append(int((pos >= 0).any(dim=1).sum()))
        for i in range(b):  # every write of the pass first, as the model's layers do
            for j in range(t):
                p = int(pos[i, j])
                if p >= 0:
                    assert p < kv_len
                    self.cache[int(slots[i]), p] = int(tokens[i, j])
        # One logits row per flat index in `last` (with one token per row: a row).
        picks = [divmod(int(x), t) for x in last]
        out = torch.zeros(len(picks), dtype=torch.long)
        for k, (i, j) in enumerate(picks):
            p = int(pos[i, j])
            if p >= 0:
                out[k] = self.rule(self.cache[int(slots[i]), : p + 1].tolist())
        lg = torch.zeros(len(picks), self.config.vocab_size)
        lg[torch.arange(len(picks)), out] = 10.0
        return lg


class FakeGrammar:
    """Scripted grammar: forces FF after every sampled token; finished after `limit` tokens."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.live: dict[str, int] = {}
        self.open_s: dict[str, float] = {}  # request id -> how long its open takes

    async def open(self, req: GrammarRequest) -> list[str]:
        await asyncio.sleep(self.open_s.get(req.request_id, 0.0))
        if req.constraint.regex == "bad":
            raise RpcError(grpc.StatusCode.INVALID_ARGUMENT, "bad", [("constraint.regex", "bad")])
        self.live[req.request_id] = 0
        return []

    async def step(
        self,
        entries: Sequence[tuple[GrammarRequest, Sequence[int]]],
        drafts: Sequence[Sequence[int]] | None = None,
        forced_draft_room: Sequence[int] | None = None,
    ) -> list[RowOutcome]:
        """Drafts are accepted up to the first `REJECTED` one. With room for forced drafts, a
        row that gets FF gets `FORCED_DRAFT` as its draft instead."""
        await asyncio.sleep(0.001)
        out = []
        for i, (req, new) in enumerate(entries):
            req.consumed.extend(new)
            done = len(req.consumed) >= self.limit
            ff = [] if done else list(FF)
            req.consumed.extend(ff)
            d = list(drafts[i]) if drafts is not None else []
            forced = bool(ff and forced_draft_room and forced_draft_room[i])
            if forced:
                d = [FORCED_DRAFT]
            a = d.index(REJECTED) if REJECTED in d else len(d)
            mask = np.full((1 + a, TOK.words_per_row), -1, dtype=np.int32)
            out.append(
                RowOutcome(
                    ok=True,
                    mask=mask,
                    ff_tokens=ff,
                    accepting=done,
                    finished=done,
                    accepted_drafts=a,
                    forced_drafts=d if forced else [],
                )
            )
        return out

    def close(self, req: GrammarRequest) -> None:
        self.live.pop(req.request_id, None)

    async def aclose(self) -> None:
        pass


def reference(prompt: list[int], max_tokens: int, constrained: bool, limit: int) -> list[int]:
    out: list[int] = list(FF) if constrained else []
    while len(out) < max_tokens:
        tok = next_token(prompt + out)
        out.append(tok)
        if constrained:
            if len(out) >= limit:
                break
            out.extend(FF)
    return out[:max_tokens]


def make_engine(
    *,
    overlap: bool,
    jump_forward: bool = True,
    limit: int = 9,
    bucketed: bool = True,
    speculative: DraftConfig | None = None,
    admit_window_s: float = 0.0,
    admit_quiet_s: float = 0.004,
    stream_interval_s: float = 0.0,
    prefix_cache: bool = True,
    prefix_cache_slots: int = 8,
    prefix_refresh_tokens: int = 32,
    prefix_refresh_idle_s: float = 0.05,
) -> tuple[Engine, FakeModel]:
    model = FakeModel()
    config = EngineConfig(
        admit_window_s=admit_window_s,
        admit_quiet_s=admit_quiet_s,
        stream_interval_s=stream_interval_s,
        max_batch=4,
        max_seq_len=256,
        max_queue=8,
        batch_buckets=(1, 2, 4),
        seq_buckets=(64, 128, 256),
        bucketed=bucketed,
        overlap=overlap,
        jump_forward=jump_forward,
        speculative=speculative,
        prefix_cache=prefix_cache,
        prefix_cache_slots=prefix_cache_slots,
        prefix_refresh_tokens=prefix_refresh_tokens,
        prefix_refresh_idle_s=prefix_refresh_idle_s,
    )
    sampler = Sampler(
        vocab_size=V,
        logits_size=V + 64,
        max_rows=4 * config.verify_width,
        device="cpu",
        structured_outputs=True,
        compile=False,
    )
    engine = Engine(
        device=StepDevice(
            model=model,
            backend=create_backend("cpu"),
            sampler=sampler,
            config=config,
            eos_ids=tuple(TOK.eos_token_ids),
            words=TOK.words_per_row,
        ),
        tokenizer=TOK,
        grammar=FakeGrammar(limit),  # type: ignore[arg-type]
        config=config,
    )
    return engine, model


def request(
    i: int, *, constrained: bool, max_tokens: int = 12, stop: tuple[str, ...] = ()
) -> Request:
    return Request(
        request_id=f"r{i}",
        prompt=[NORMAL[(7 * i + k) % len(NORMAL)] for k in range(3 + i % 4)],
        sampling=Sampling(max_tokens=max_tokens, stop=stop),
        detok=Detokenizer(TOK.token_bytes, stop),
        constraint=common_pb2.Constraint(regex="x") if constrained else None,
    )


def wire(item: Output) -> worker_pb2.GenerateResponse | RpcError:
    """An output event as the servicer streams it (an error: its status)."""
    return status(item) if isinstance(item, Exception) else response(item)


async def rpc(call: Awaitable[T]) -> T:
    """`call`, with the engine's own errors as the statuses the servicer answers with."""
    try:
        return await call
    except EngineError as e:
        raise status(e) from e


async def collect(req: Request) -> tuple[list[int], str, worker_pb2.GenerateResponse]:
    ids: list[int] = []
    text = ""
    while True:
        msg = wire(await req.outputs.get())
        assert not isinstance(msg, RpcError), msg
        ids += list(msg.token_ids)
        text += msg.text
        if msg.finish_reason:
            return ids, text, msg


def before_each_pass(engine: Engine, hook: Callable[[ForwardBatch], Awaitable[None]]) -> None:
    """Await `hook(batch)` before each forward pass the engine's device stage runs, sampled in
    the same device call or not."""
    stage = engine.stage
    forward, forward_and_sample = stage.forward, stage.forward_and_sample

    async def spied_forward(batch: ForwardBatch) -> Logits:
        await hook(batch)
        return await forward(batch)

    async def spied_forward_and_sample(
        batch: ForwardBatch, draws: Sequence[Draw | None], answers: Answers
    ) -> Sampled:
        await hook(batch)
        return await forward_and_sample(batch, draws, answers)

    stage.forward = spied_forward  # type: ignore[method-assign]
    stage.forward_and_sample = spied_forward_and_sample  # type: ignore[method-assign]


@pytest.mark.parametrize("bucketed", [True, False], ids=["buckets", "dynamic"])
@pytest.mark.parametrize("overlap", [True, False], ids=["overlap", "serial"])
async def test_continuous_batching_matches_reference(overlap: bool, bucketed: bool) -> None:
    """Both shape policies: with dynamic shapes a lone decode row gets a padding row and a lone
    multi-token row is split in two half-rows on its own slot; outputs must not change."""
    engine, model = make_engine(overlap=overlap, bucketed=bucketed)
    await engine.start()
    try:
        reqs = [request(i, constrained=i % 2 == 0) for i in range(7)]  # more than 4 slots
        tasks = []
        for i, r in enumerate(reqs):
            await engine.submit(r)
            tasks.append(asyncio.create_task(collect(r)))
            if i == 2:
                await asyncio.sleep(0.05)  # later requests join a running batch
        results = await asyncio.gather(*tasks)
    finally:
        await engine.stop()
    for r, (ids, text, final) in zip(reqs, results, strict=True):
        want = reference(r.prompt, 12, r.constrained, 9)
        assert ids == want, r.request_id
        assert text == TOK.decode_bytes(want).decode()
        if r.constrained:
            assert final.finish_reason == worker_pb2.FINISH_REASON_STOP
            sampled = sum(1 for k in range(len(want)) if k % 3 == 2)  # FF FF t FF t ...
            assert final.usage.forced_tokens == len(want) - sampled
            # Jump-forward: fewer passes than tokens.
            assert final.usage.forward_passes < len(want)
        else:
            assert final.finish_reason == worker_pb2.FINISH_REASON_LENGTH
            assert final.usage.forward_passes == len(want)
    assert not engine.requests and not engine.scheduler.running
    # Every model call ran on the process's one device thread (`neuron_worker.device_thread`).
    device = device_thread.executor().submit(lambda: threading.current_thread().name).result()
    assert model.threads == {device}


@pytest.mark.parametrize("window_s", [0.0, 5.0], ids=["at-once", "window"])
async def test_requests_sent_together_share_one_prefill(window_s: float) -> None:
    """From idle, the first request waits while others keep arriving less than the quiet gap
    apart (up to the admission window): one prefill pass takes them all. Without a window the
    first is prefilled alone. Outputs are the same either way."""
    engine, model = make_engine(overlap=False, admit_window_s=window_s, admit_quiet_s=0.2)
    await engine.start()
    try:
        reqs = [request(i, constrained=i == 1) for i in range(3)]
        tasks = []
        for r in reqs:
            await engine.submit(r)
            tasks.append(asyncio.create_task(collect(r)))
            await asyncio.sleep(0.05)
        results = await asyncio.gather(*tasks)
    finally:
        await engine.stop()
    assert model.rows_per_pass[0] == (3 if window_s else 1)
    for r, (ids, _, _) in zip(reqs, results, strict=True):
        assert ids == reference(r.prompt, 12, r.constrained, 9), r.request_id


async def test_the_admission_wait_holds_on_for_grammars_still_opening() -> None:
    """Requests sent together whose grammars take longer to open than the quiet gap (one after
    another on a busy host) still share one prefill: the wait holds on while a submit is
    opening its grammar, failed opens included."""
    engine, model = make_engine(overlap=False, admit_window_s=5.0, admit_quiet_s=0.05)
    assert isinstance(engine.grammar, FakeGrammar)
    reqs = [request(i, constrained=True) for i in range(3)]
    for i, r in enumerate(reqs):
        engine.grammar.open_s[r.request_id] = 0.15 * i  # 3x the quiet gap apart
    bad = request(3, constrained=True)
    bad.constraint = common_pb2.Constraint(regex="bad")
    engine.grammar.open_s[bad.request_id] = 0.4
    await engine.start()
    try:

        async def submit(r: Request) -> tuple[list[int], str, worker_pb2.GenerateResponse]:
            await engine.submit(r)
            return await collect(r)

        tasks = [asyncio.create_task(submit(r)) for r in reqs]
        with pytest.raises(RpcError):
            await engine.submit(bad)
        results = await asyncio.gather(*tasks)
    finally:
        await engine.stop()
    assert model.rows_per_pass[0] == 3
    for r, (ids, _, _) in zip(reqs, results, strict=True):
        assert ids == reference(r.prompt, 12, True, 9), r.request_id


async def test_the_admission_wait_ends_when_arrivals_stop() -> None:
    """A lone request waits one quiet gap, not the whole window."""
    engine, _ = make_engine(overlap=False, admit_window_s=30.0, admit_quiet_s=0.05)
    await engine.start()
    try:
        r = request(0, constrained=False)
        await engine.submit(r)
        ids, _, _ = await asyncio.wait_for(collect(r), 10)
    finally:
        await engine.stop()
    assert ids == reference(r.prompt, 12, False, 9)


async def test_the_forced_prefix_streams_before_the_prefill_pass_ends() -> None:
    engine, model = make_engine(overlap=False)
    model.gate = threading.Event()  # every forward pass waits for it
    await engine.start()
    try:
        r = request(0, constrained=True)
        await engine.submit(r)
        first = wire(await asyncio.wait_for(r.outputs.get(), 10))
        assert not isinstance(first, RpcError)
        # The prefill is still blocked: these tokens came from the grammar's first step alone.
        assert list(first.token_ids) == FF and first.text == TOK.decode_bytes(FF).decode()
        model.gate.set()
        ids, _, final = await collect(r)
    finally:
        model.gate.set()
        await engine.stop()
    assert [*first.token_ids, *ids] == reference(r.prompt, 12, True, 9)
    assert final.finish_reason == worker_pb2.FINISH_REASON_STOP


@pytest.mark.parametrize(
    ("interval_s", "reasons"),
    [(0.0, False), (60.0, False), (60.0, True)],
    ids=["every-step", "held", "reasoning-never-held"],
)
async def test_tokens_stream_at_most_once_per_interval(interval_s: float, reasons: bool) -> None:
    engine, _ = make_engine(overlap=True, stream_interval_s=interval_s)
    await engine.start()
    try:
        r = request(0, constrained=False, max_tokens=12)
        r.reasoning_end_marker = "</think>" if reasons else ""
        await engine.submit(r)
        sizes: list[int] = []
        ids: list[int] = []
        while True:
            msg = wire(await asyncio.wait_for(r.outputs.get(), 10))
            assert not isinstance(msg, RpcError), msg
            sizes.append(len(msg.token_ids))
            ids += msg.token_ids
            if msg.finish_reason:
                break
    finally:
        await engine.stop()
    assert ids == reference(r.prompt, 12, False, 9)
    # The first token at once either way; held, the rest comes with the final message (the
    # gateway counts a reasoning request's reasoning tokens by message: never held).
    assert sizes == ([1] * 12 if interval_s == 0 or reasons else [1, 11])


async def test_without_jump_forward_grammar_gets_no_ff_option() -> None:
    engine, _ = make_engine(overlap=True, jump_forward=False)
    await engine.start()
    try:
        r = request(1, constrained=True)
        await engine.submit(r)
        assert r.grammar is not None and not r.grammar.options.jump_forward
        await collect(r)
    finally:
        await engine.stop()


async def test_stop_string_abort_and_errors() -> None:
    engine, _ = make_engine(overlap=True)
    await engine.start()
    try:
        want = reference(request(0, constrained=False).prompt, 12, False, 9)
        full = TOK.decode_bytes(want).decode()
        # The first output token (from the third on) whose text first occurs where it is
        # generated: the answer is then exactly the text of the tokens before it, not empty.
        k = next(
            k
            for k in range(2, len(want))
            if full.index(TOK.token_bytes(want[k]).decode()) == len(TOK.decode_bytes(want[:k]))
        )
        stop_text = TOK.token_bytes(want[k]).decode()
        r = request(0, constrained=False, stop=(stop_text,))
        await engine.submit(r)
        _ids, text, final = await collect(r)
        assert final.finish_reason == worker_pb2.FINISH_REASON_STOP_STRING
        assert final.stop_string == stop_text
        assert text == TOK.decode_bytes(want[:k]).decode() and text

        long = request(1, constrained=False, max_tokens=200)
        await engine.submit(long)
        await long.outputs.get()
        assert engine.abort("r1")
        *_, final = await collect(long)
        assert final.finish_reason == worker_pb2.FINISH_REASON_ABORT
        assert not engine.abort("r1")

        with pytest.raises(RpcError) as e:
            bad = request(2, constrained=True)
            bad.constraint = common_pb2.Constraint(regex="bad")
            await engine.submit(bad)
        assert e.value.code is grpc.StatusCode.INVALID_ARGUMENT
        assert "r2" not in engine.requests
    finally:
        await engine.stop()


async def test_disabled_structured_outputs_rejects_constraints() -> None:
    engine, _ = make_engine(overlap=True)
    engine.config = EngineConfig(structured_outputs=False)
    with pytest.raises(RpcError) as e:
        await rpc(engine.submit(request(0, constrained=True)))
    assert e.value.code is grpc.StatusCode.FAILED_PRECONDITION
    assert "--enable-structured-outputs" in e.value.message


async def test_aborting_constrained_requests_frees_grammar_and_slots() -> None:
    """Abort a constrained request while it runs and another while it waits for a slot: the
    grammar state of both is closed and every KV slot is free again."""
    engine, _ = make_engine(overlap=True, limit=10_000)
    grammar = engine.grammar
    assert isinstance(grammar, FakeGrammar)
    await engine.start()
    try:
        reqs = [request(i, constrained=True, max_tokens=200) for i in range(5)]  # 4 slots
        for r in reqs:
            await engine.submit(r)
        await reqs[0].outputs.get()  # running now
        assert set(grammar.live) == {r.request_id for r in reqs}
        assert reqs[4].slot == -1  # the fifth waits for a slot
        for r in (reqs[0], reqs[4]):
            assert engine.abort(r.request_id)
            *_, final = await collect(r)
            assert final.finish_reason == worker_pb2.FINISH_REASON_ABORT
        assert set(grammar.live) == {r.request_id for r in reqs[1:4]}
        for r in reqs[1:4]:
            assert engine.abort(r.request_id)
            await collect(r)
        assert grammar.live == {}
        assert not engine.requests and not engine.scheduler.running
        assert sorted(engine.scheduler._free_slots) == list(range(engine.config.kv_slots))
    finally:
        await engine.stop()


async def collect_logprobs(req: Request) -> tuple[list[int], list[worker_pb2.TokenLogprob]]:
    ids: list[int] = []
    entries: list[worker_pb2.TokenLogprob] = []
    while True:
        msg = wire(await req.outputs.get())
        assert not isinstance(msg, RpcError), msg
        ids += list(msg.token_ids)
        entries += list(msg.logprobs)
        if msg.finish_reason:
            return ids, entries


async def test_logprobs_of_sampled_and_forced_tokens() -> None:
    """One entry per token: forced tokens say so with logprob 0; a sampled token's logprob is
    its share of the fake model's one-hot logits (greedy: temperature 1), and it leads its
    alternatives."""
    engine, _ = make_engine(overlap=True)
    await engine.start()
    try:
        r = request(0, constrained=True)
        r.sampling = Sampling(max_tokens=12, logprobs=True, top_logprobs=3)
        plain = request(1, constrained=False)  # no logprobs: its messages carry none
        for q in (r, plain):
            await engine.submit(q)
        (ids, entries), (_, none) = await asyncio.gather(
            collect_logprobs(r), collect_logprobs(plain)
        )
    finally:
        await engine.stop()
    assert ids == reference(r.prompt, 12, True, 9)
    assert not none
    assert [e.token_id for e in entries] == ids
    want = 10.0 - float(torch.logsumexp(torch.tensor([10.0] + [0.0] * (V - 1)), 0))
    for k, e in enumerate(entries):
        assert e.token == TOK.token_bytes(e.token_id)
        if k % 3 < 2:  # FF FF t FF t ...
            assert e.forced and e.logprob == 0.0
            assert [(t.token_id, t.logprob) for t in e.top_logprobs] == [(e.token_id, 0.0)]
        else:
            assert not e.forced and e.logprob == pytest.approx(want, abs=1e-4)
            assert len(e.top_logprobs) == 3 and e.top_logprobs[0].token_id == e.token_id


async def test_logit_bias_changes_the_tokens() -> None:
    """A -100 bias on the model's choice moves the first token."""
    engine, _ = make_engine(overlap=True)
    await engine.start()
    try:
        base = request(0, constrained=False, max_tokens=4)
        want = reference(base.prompt, 4, False, 9)
        biased = request(0, constrained=False, max_tokens=4)
        biased.sampling = Sampling(max_tokens=4, logit_bias={want[0]: -100.0})
        await engine.submit(biased)
        ids, _, _ = await collect(biased)
    finally:
        await engine.stop()
    assert ids[0] != want[0]


RUNNER_UP, THIRD = NORMAL[30], NORMAL[31]
PENALTIES = Sampling(
    max_tokens=7,
    presence_penalty=0.5,
    frequency_penalty=2.0,
    repetition_penalty=1.5,
    logit_bias={RUNNER_UP: 4.0, THIRD: 3.0},
)


def penalised_reference(prompt: list[int], constrained: bool) -> list[int]:
    """Greedy output of the fake model that always prefers the prompt's first token, under
    `PENALTIES` as documented (`neuron_worker.penalties`), in float64: the repetition penalty on
    prompt and output tokens, then frequency and presence on output tokens (forced ones
    included), then the bias."""
    s = PENALTIES
    out: list[int] = list(FF) if constrained else []
    while len(out) < s.max_tokens:
        x = np.zeros(V + 64)
        x[prompt[0]] = 10.0
        counts = np.bincount(out, minlength=V + 64).astype(np.float64)
        seen = np.zeros(V + 64, dtype=bool)
        seen[prompt] = True
        rep = s.repetition_penalty
        x = np.where((counts > 0) | seen, np.where(x > 0, x / rep, x * rep), x)
        x -= s.frequency_penalty * counts + s.presence_penalty * (counts > 0)
        for t, b in s.logit_bias.items():
            x[t] += b
        best = np.sort(x)[-2:]
        assert best[1] > max(best[0], 0.0), "a tie: the test would depend on tie-breaking"
        out.append(int(np.argmax(x)))
        if constrained:
            out.extend(FF)
    return out[: s.max_tokens]


@pytest.mark.parametrize("constrained", [False, True])
async def test_penalties_move_the_tokens_by_their_exact_amounts(constrained: bool) -> None:
    """The model's choice (logit 10, in the prompt: 10 / 1.5) loses to the biased runner-up
    once its output count has cost it enough, and the runner-up in turn; the reference applies
    the documented formula to every logit. Constrained, the forced tokens (the model's choice
    is the first of them) count too. The request's slot in the occurrence table holds its
    prompt and counts its output up to its last sample."""
    engine, model = make_engine(overlap=True, limit=100)
    model.rule = lambda seq: seq[0]
    first = FF[0] if constrained else NORMAL[20]
    r = request(2, constrained=constrained)
    r.prompt = [first, NORMAL[21], NORMAL[22]]
    r.sampling = PENALTIES
    await engine.start()
    try:
        await engine.submit(r)
        out, _, _ = await collect(r)
    finally:
        await engine.stop()
    want = penalised_reference(r.prompt, constrained)
    assert out == want
    assert RUNNER_UP in out  # without the penalties every sampled token would be `first`
    table = engine.occurrences
    assert table is not None
    # Sampled positions: all, or FF FF t FF FF t ... constrained.
    last = max(k for k in range(len(out)) if not constrained or k % 3 == 2)
    counted = out[:last]
    rows = [s for s in range(table.counts.shape[0]) if table.prompt_seen[s, r.prompt].all()]
    assert len(rows) == 1
    for t in set(out):
        assert int(table.counts[rows[0], t]) == counted.count(t), t


async def collect_group(queue_owner: Request, n: int) -> dict[int, tuple[list[int], Any]]:
    """Messages of an n-choice call from their shared queue, by choice index."""
    got: dict[int, tuple[list[int], Any]] = {i: ([], None) for i in range(n)}
    left = n
    while left:
        msg = wire(await queue_owner.outputs.get())
        assert not isinstance(msg, RpcError), msg
        ids, _ = got[msg.index]
        ids += list(msg.token_ids)
        if msg.finish_reason:
            got[msg.index] = (ids, msg)
            left -= 1
    return got


@pytest.mark.parametrize("constrained", [False, True])
async def test_n_choices_prefill_the_prompt_once(constrained: bool) -> None:
    """Three choices: one prefill row, the others' slots get its K/V (the fake model would
    diverge from the reference if a slot lacked the prompt), each choice its own grammar."""
    from neuron_worker.servicer import _choices

    engine, model = make_engine(overlap=True)
    await engine.start()
    try:
        first = request(5, constrained=constrained)
        first.request_id = "call"
        choices = _choices(first, 3)
        assert [c.request_id for c in choices] == ["call/0", "call/1", "call/2"]
        assert len({c.sampling.seed for c in choices}) == 3
        await engine.submit_group(choices)
        if constrained:
            assert len({id(c.grammar) for c in choices}) == 3
        got = await collect_group(first, 3)
    finally:
        await engine.stop()
    want = reference(first.prompt, 12, constrained, 9)
    for i in range(3):
        ids, final = got[i]
        assert ids == want, i
        assert final.request_id == "call" and final.usage.prompt_tokens == len(first.prompt)
    slots = {src for src, _, _ in model.copies}
    assert len(model.copies) == 2 and len(slots) == 1
    assert all(length >= len(first.prompt) for _, _, length in model.copies)


def prompt_request(name: str, prompt: list[int], max_tokens: int = 12) -> Request:
    return Request(
        request_id=name,
        prompt=prompt,
        sampling=Sampling(max_tokens=max_tokens),
        detok=Detokenizer(TOK.token_bytes, ()),
    )


@pytest.mark.parametrize("bucketed", [True, False], ids=["buckets", "dynamic"])
@pytest.mark.parametrize("enabled", [True, False], ids=["prefix-cache", "no-prefix-cache"])
async def test_prompts_reuse_the_prefix_a_slot_holds(enabled: bool, bucketed: bool) -> None:
    """B shares 24 tokens with A, which still runs: its prefill copies them from A's slot. C
    repeats A after both ended: it runs only its last token, in A's slot. The fake model hashes
    each slot's tokens, so a wrong copy, slot or start would show in the outputs."""
    engine, model = make_engine(overlap=False, bucketed=bucketed, prefix_cache=enabled)
    starts: list[list[int]] = []

    async def record(batch: ForwardBatch) -> None:
        if batch.kind == "prefill":
            starts.append([row.start for row in batch.rows])

    before_each_pass(engine, record)
    shared = NORMAL[10:34]
    a = prompt_request("a", [*shared, NORMAL[50], NORMAL[51]], max_tokens=40)
    b = prompt_request("b", [*shared, NORMAL[60]])
    c = prompt_request("c", list(a.prompt))
    await engine.start()
    try:
        await engine.submit(a)
        running_a = asyncio.create_task(collect(a))
        while not a.output:
            await asyncio.sleep(0.001)
        await engine.submit(b)
        got_b = await collect(b)
        got_a = await running_a
        await engine.submit(c)
        got_c = await collect(c)
    finally:
        await engine.stop()
    for req, (ids, _, _) in zip((a, b, c), (got_a, got_b, got_c), strict=True):
        assert ids == reference(req.prompt, req.sampling.max_tokens, False, 9), req.request_id
    cached = [final.usage.cached_prompt_tokens for _, _, final in (got_a, got_b, got_c)]
    if not enabled:
        assert starts == [[0], [0], [0]] and cached == [0, 0, 0] and not model.copies
        return
    assert starts == [[0], [24], [len(a.prompt) - 1]]
    assert cached == [0, 24, len(a.prompt) - 1]
    assert len(model.copies) == 1
    src, dst, length = model.copies[0]
    assert src != dst and length >= 24
    stats = engine.metrics.stats
    assert stats.prompt_tokens_reused == sum(cached)
    assert stats.prompt_tokens_computed == 3 * len(a.prompt) - 1 - sum(cached)


@pytest.mark.parametrize("extra", [4, 0], ids=["prompt-slots", "batch-slots-only"])
async def test_slots_beyond_the_batch_keep_prompts_for_later_requests(extra: int) -> None:
    """Batch 4, plus 4 slots that only keep prompts: 8 distinct prompts, sent together, run 4
    at a time and all stay held, so each one sent again runs only its last token (on the
    batch's slots alone, the first four are gone by then)."""
    engine, model = make_engine(overlap=False, prefix_cache_slots=extra)
    prompts = [[NORMAL[i], *NORMAL[40 + i : 60 + i]] for i in range(8)]
    await engine.start()
    try:
        first = [prompt_request(f"a{i}", p) for i, p in enumerate(prompts)]
        for req in first:
            await engine.submit(req)
        for req in first:
            await collect(req)
        again = [prompt_request(f"b{i}", p) for i, p in enumerate(prompts[:4])]
        got = []
        for req in again:
            await engine.submit(req)
            got.append(await collect(req))
    finally:
        await engine.stop()
    assert max(model.rows_per_pass) == 4  # never more running than the batch
    assert model.cache.shape[0] == 4 + extra + 1  # and the padding slot
    for req, (ids, _, final) in zip(again, got, strict=True):
        assert ids == reference(req.prompt, req.sampling.max_tokens, False, 9), req.request_id
        assert final.usage.cached_prompt_tokens == (len(req.prompt) - 1 if extra else 0)


@pytest.mark.parametrize("bucketed", [True, False], ids=["buckets", "dynamic"])
@pytest.mark.parametrize("enabled", [True, False], ids=["prefix-cache", "no-prefix-cache"])
async def test_requests_arriving_together_compute_a_shared_prefix_once(
    enabled: bool, bucketed: bool
) -> None:
    """A, B and C come in one admission window; B and C share 24 tokens with A: A's prompt pass
    runs alone, then B and C copy the prefix from A's slot and compute only their own tokens.
    Without the cache the three prompts run in one pass. The same outputs either way."""
    engine, model = make_engine(
        overlap=False, bucketed=bucketed, prefix_cache=enabled, admit_window_s=0.5
    )
    starts: list[list[int]] = []

    async def record(batch: ForwardBatch) -> None:
        if batch.kind == "prefill":
            starts.append([row.start for row in batch.rows])

    before_each_pass(engine, record)
    shared = NORMAL[10:34]
    reqs = [
        prompt_request(name, [*shared, NORMAL[50 + i], NORMAL[60 + i]])
        for i, name in enumerate("abc")
    ]
    await engine.start()
    try:
        for req in reqs:
            await engine.submit(req)
        got = [await collect(req) for req in reqs]
    finally:
        await engine.stop()
    for req, (ids, _, _) in zip(reqs, got, strict=True):
        assert ids == reference(req.prompt, req.sampling.max_tokens, False, 9), req.request_id
    cached = [final.usage.cached_prompt_tokens for _, _, final in got]
    if not enabled:
        assert starts == [[0, 0, 0]] and cached == [0, 0, 0] and not model.copies
        return
    assert starts == [[0], [24, 24]] and cached == [0, 24, 24]
    assert len(model.copies) == 2 and all(length >= 24 for _, _, length in model.copies)


@pytest.mark.parametrize("bucketed", [True, False], ids=["buckets", "dynamic"])
@pytest.mark.parametrize("refresh", [8, 0], ids=["refresh", "no-refresh"])
async def test_a_next_turn_reuses_the_answer_the_idle_worker_wrote_into_its_slot(
    refresh: int, bucketed: bool
) -> None:
    """A's 20-token answer is rewritten into its slot by idle prompt passes of at most 8 tokens
    (8, 8, 4, the slot's tokens through the last one); B, A's exchange plus a new message,
    then computes only that message. Without refresh passes B reuses A's prompt only."""
    engine, _ = make_engine(overlap=False, bucketed=bucketed, prefix_refresh_tokens=refresh)
    kinds: list[tuple[str, int, int]] = []

    async def record(batch: ForwardBatch) -> None:
        kinds.extend((batch.kind, row.start, len(row.tokens)) for row in batch.rows)

    before_each_pass(engine, record)
    a = prompt_request("a", list(NORMAL[10:30]), max_tokens=20)
    await engine.start()
    try:
        await engine.submit(a)
        got_a = await collect(a)
        for _ in range(200):  # the idle passes run after A's final message
            if engine.metrics.stats.refreshed_answer_tokens >= (20 if refresh else 0):
                break
            await asyncio.sleep(0.005)
        before_b = len(kinds)
        refreshed = engine.metrics.stats.refreshed_answer_tokens
        b = prompt_request("b", [*a.prompt, *got_a[0], NORMAL[70], NORMAL[71]])
        await engine.submit(b)
        got_b = await collect(b)
    finally:
        await engine.stop()
    assert got_a[0] == reference(a.prompt, 20, False, 9)
    assert got_b[0] == reference(b.prompt, b.sampling.max_tokens, False, 9)
    refreshes = [k for k in kinds[:before_b] if k[0] == "refresh"]
    if refresh:
        assert refreshes == [("refresh", 20, 8), ("refresh", 28, 8), ("refresh", 36, 4)]
        assert got_b[2].usage.cached_prompt_tokens == 40
    else:
        assert refreshes == [] and got_b[2].usage.cached_prompt_tokens == 20
    assert refreshed == (20 if refresh else 0)


async def test_a_request_sent_at_once_never_waits_for_a_refresh_pass() -> None:
    """Refresh passes start only after the worker has been idle `prefix_refresh_idle_s`: a
    request sent right after another ended is admitted first."""
    engine, _ = make_engine(overlap=False, prefix_refresh_idle_s=5.0)
    kinds: list[str] = []

    async def record(batch: ForwardBatch) -> None:
        kinds.append(batch.kind)

    before_each_pass(engine, record)
    a = prompt_request("a", list(NORMAL[10:30]), max_tokens=20)
    c = prompt_request("c", list(NORMAL[40:50]), max_tokens=4)
    await engine.start()
    try:
        await engine.submit(a)
        await collect(a)
        await engine.submit(c)
        await collect(c)
    finally:
        await engine.stop()
    assert kinds.count("prefill") == 2 and "refresh" not in kinds, kinds


async def test_no_refresh_pass_starts_while_a_request_opens_its_grammar() -> None:
    """A constrained request whose grammar takes 0.3 s to open arrives while a long answer is
    being rewritten into its slot (passes of 4 tokens, 20 ms each): no further refresh pass
    starts while it opens (each would hold up its admission); the rest run after it."""
    engine, _ = make_engine(overlap=False, prefix_refresh_tokens=4, prefix_refresh_idle_s=0.0)
    kinds: list[str] = []

    async def record(batch: ForwardBatch) -> None:
        kinds.append(batch.kind)
        if batch.kind == "refresh":
            await asyncio.sleep(0.02)

    before_each_pass(engine, record)
    grammar = engine.grammar
    assert isinstance(grammar, FakeGrammar)
    a = prompt_request("a", list(NORMAL[10:30]), max_tokens=120)
    b = request(1, constrained=True, max_tokens=4)
    grammar.open_s[b.request_id] = 0.3
    await engine.start()
    try:
        await engine.submit(a)
        await collect(a)
        await asyncio.sleep(0.05)  # a's answer is being rewritten
        kinds.append("b arrives")
        await engine.submit(b)
        await collect(b)
        for _ in range(500):
            if engine.scheduler.refresh(4) is None:
                break
            await asyncio.sleep(0.01)
    finally:
        await engine.stop()
    arrived = kinds.index("b arrives")
    admitted = kinds.index("prefill", arrived)
    assert kinds[:arrived].count("refresh") > 0 and kinds[arrived:admitted].count("refresh") <= 1
    assert kinds[-1] == "refresh", kinds  # and the rest of the answer after b


async def test_abort_by_call_id_stops_every_choice() -> None:
    from neuron_worker.servicer import _choices

    engine, _ = make_engine(overlap=True)
    await engine.start()
    try:
        first = request(1, constrained=False, max_tokens=200)
        first.request_id = "long"
        await engine.submit_group(_choices(first, 2))
        await first.outputs.get()
        assert engine.abort("long")
        got = await collect_group(first, 2)
    finally:
        await engine.stop()
    # The first message may have been one choice's delta; both end with ABORT.
    assert {got[i][1].finish_reason for i in range(2)} == {worker_pb2.FINISH_REASON_ABORT}


async def test_call_and_choice_ids_are_one_namespace() -> None:
    """A call whose id, or one of whose choices' ids, is live is refused and admits nothing;
    Abort names a call (all its choices) and an empty id names none."""
    from neuron_worker.servicer import _choices

    engine, _ = make_engine(overlap=True)
    await engine.start()
    try:
        first = request(1, constrained=False, max_tokens=200)
        first.request_id = "x"
        await engine.submit_group(_choices(first, 2))  # x/0, x/1, call x
        other = request(2, constrained=False, max_tokens=200)
        await engine.submit(other)  # r2, a single call
        await other.outputs.get()
        clashes = [("x", 1), ("x", 3), ("x/0", 1), ("r2", 2), ("r2", 1)]
        for rid, n in clashes:
            r = request(3, constrained=True)
            r.request_id = rid
            with pytest.raises(RpcError) as e:
                await rpc(engine.submit_group(_choices(r, n)))
            assert e.value.code is grpc.StatusCode.ALREADY_EXISTS, (rid, n)
        assert set(engine.requests) == {"x/0", "x/1", "r2"}
        assert set(engine.calls) == {"x", "r2"}
        assert engine.scheduler.queue_depth + len(engine.scheduler.running) == 3
        assert not engine.abort("")
        assert not engine.abort("x/0")  # a choice's internal id is no call
        assert engine.abort("x")
        got = await collect_group(first, 2)
        assert {got[i][1].finish_reason for i in range(2)} == {worker_pb2.FINISH_REASON_ABORT}
        assert set(engine.calls) == {"r2"} and set(engine.requests) == {"r2"}
        assert other.abort_reason is None  # the other call was not touched
        assert engine.abort("r2")
        await collect(other)
        assert not engine.calls and not engine.requests
    finally:
        await engine.stop()


async def test_abort_while_the_grammar_opens_never_queues_the_call() -> None:
    """An Abort that arrives while a call's grammars are still opening ends the call once they
    are open (grammar state closed) instead of queueing it: no slot is taken, nothing leaks."""
    from neuron_worker.servicer import _choices

    engine, _ = make_engine(overlap=True)
    grammar = engine.grammar
    assert isinstance(grammar, FakeGrammar)
    await engine.start()
    try:
        first = request(1, constrained=True, max_tokens=200)
        first.request_id = "slow"
        grammar.open_s["slow/0"] = 0.3
        submit = asyncio.create_task(engine.submit_group(_choices(first, 2)))
        await asyncio.sleep(0.05)  # opening its first grammar now
        assert set(engine.calls) == {"slow"}  # the id is taken while it opens
        assert engine.abort("slow")
        await submit
        got = await collect_group(first, 2)
        assert {got[i][1].finish_reason for i in range(2)} == {worker_pb2.FINISH_REASON_ABORT}
        assert all(got[i][1].usage.completion_tokens == 0 for i in range(2))
        await asyncio.sleep(0.05)  # a queued zombie would be admitted by now
        assert not engine.scheduler.running and not engine.scheduler.waiting
        assert not engine.calls and not engine.requests and grammar.live == {}
    finally:
        await engine.stop()
