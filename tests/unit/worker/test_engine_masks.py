"""Each mask row reaches the sampling position it was computed for.

`PositionalGrammar` allows exactly one token at most positions of an output (which one depends
on the position and on the request) and any token at every fourth; at every second run of
single-token positions it forces the run (`ff_tokens`), and in a speculative step it drafts what
it forces (after its forced tokens, or after the row's own drafts, as a forced jump). Its
answers are packed rows like the service's, one per position: the main row, then a row after
each accepted draft. Whatever the model prefers, the sampler can only draw the one token a
single-token row allows, and the grammar refuses any other token it is sent, so a row applied
one draft position off, the main row and a draft row swapped, two requests' rows swapped in the
reorder, or the row after a forced jump taken from the wrong index changes the output (or
fails the request), which is compared with a reference computed here without the engine.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence

import numpy as np
import pytest
import torch

from maskwire.v1 import common_pb2, worker_pb2
from neuron_worker.detokenize import Detokenizer
from neuron_worker.engine import Engine
from neuron_worker.grammar_client import GrammarRequest, RowOutcome
from neuron_worker.request import Request, Sampling
from neuron_worker.step_rows import Draw, ForwardBatch
from tests.unit.worker.test_engine import TOK, V, before_each_pass, collect, make_engine
from tests.unit.worker.test_speculative import CYCLE, periodic, token_drafts

RUN = 3  # single-token positions between two free ones
FREE = np.full(TOK.words_per_row, -1, dtype=np.int32)


def salt(request_id: str) -> int:
    """Shifts a request's pattern, so that two requests' rows differ at the same position."""
    return int(request_id.lstrip("r"))


def allowed(p: int, s: int) -> int | None:
    """The one token allowed at output position `p` (None: any token)."""
    if (p + s) % (RUN + 1) == RUN:
        return None
    return CYCLE[(p + s) % len(CYCLE)]


def pattern(p: int, s: int) -> int:
    """The token the grammar drafts at `p` (at a free position: what the model writes there
    unless its sequence is irregular, see `periodic`)."""
    return CYCLE[(p + s) % len(CYCLE)]


def forced_run(p: int, s: int, jump_forward: bool) -> list[int]:
    """The tokens forced at `p`: every second run of single-token positions, from its start."""
    if not jump_forward or (p + s) % (2 * (RUN + 1)) != 0:
        return []
    return [pattern(p + k, s) for k in range(RUN)]


def row(p: int, s: int) -> np.ndarray:
    t = allowed(p, s)
    if t is None:
        return FREE
    words = np.zeros(TOK.words_per_row, dtype=np.uint32)
    words[t >> 5] = np.uint32(1 << (t & 31))
    return words.view(np.int32)


class PositionalGrammar:
    """The grammar described above; the engine's `GrammarClient` in its place."""

    def __init__(self) -> None:
        self.live: set[str] = set()
        self.refused: list[tuple[str, int, int]] = []  # (request, position, token) sent wrongly
        self.forced_after_ff = 0  # steps that drafted what follows forced tokens
        self.jumps = 0  # steps that drafted a forced jump after the row's own drafts

    async def open(self, req: GrammarRequest) -> list[str]:
        self.live.add(req.request_id)
        return []

    async def step(
        self,
        entries: Sequence[tuple[GrammarRequest, Sequence[int]]],
        drafts: Sequence[Sequence[int]] | None = None,
        forced_draft_room: Sequence[int] | None = None,
    ) -> list[RowOutcome]:
        await asyncio.sleep(0.001)
        return [
            self._row(
                req,
                new,
                list(drafts[i]) if drafts is not None else [],
                forced_draft_room[i] if forced_draft_room is not None else 0,
            )
            for i, (req, new) in enumerate(entries)
        ]

    def _row(self, req: GrammarRequest, new: Sequence[int], d: list[int], room: int) -> RowOutcome:
        s = salt(req.request_id)
        jf = req.options.jump_forward
        for t in new:
            p = len(req.consumed)
            want = allowed(p, s)
            if want is not None and t != want:
                self.refused.append((req.request_id, p, t))
                return RowOutcome(ok=False, error=f"token {t} refused at position {p}")
            req.consumed.append(t)
        p = len(req.consumed)
        ff = forced_run(p, s, jf)
        req.consumed.extend(ff)
        p += len(ff)
        forced: list[int] = []
        jump = (0, 0)
        if ff and room:
            # Drafts of what the grammar forces after its forced tokens, in place of the row's own.
            forced = d = [pattern(p + k, s) for k in range(room)]
            self.forced_after_ff += 1
        a = 0
        while a < len(d) and allowed(p + a, s) in (None, d[a]):
            a += 1
        if d and not ff and room and a == len(d):
            run = forced_run(p + a, s, jf)
            if run and len(run) <= room:
                # The row's own drafts, the tokens forced after them, one draft beyond.
                beyond = [pattern(p + a + len(run), s)][: room - len(run)]
                forced = d = [*d, *run, *beyond]
                jump = (a, len(run))
                a = len(d)
                self.jumps += 1
        mask = np.stack([row(p + j, s) for j in range(1 + a)])
        return RowOutcome(
            ok=True,
            mask=mask,
            ff_tokens=ff,
            accepted_drafts=a,
            forced_drafts=forced[:a],
            forced_jump=jump,
        )

    def close(self, req: GrammarRequest) -> None:
        self.live.discard(req.request_id)

    async def aclose(self) -> None:
        pass


def reference(prompt: list[int], max_tokens: int, s: int | None, jump_forward: bool) -> list[int]:
    """Greedy output without the engine: the model's token where any is allowed (`s` None: an
    unconstrained request), the grammar's where it allows one, its forced runs as they come."""
    out: list[int] = []
    while len(out) < max_tokens:
        if s is not None:
            out += forced_run(len(out), s, jump_forward)
            if len(out) >= max_tokens:
                break
        t = allowed(len(out), s) if s is not None else None
        out.append(periodic(prompt + out) if t is None else t)
    return out[:max_tokens]


def request(
    i: int, *, constrained: bool, max_tokens: int = 40, temperature: float = 0.0
) -> Request:
    return Request(
        request_id=f"r{i}",
        prompt=[CYCLE[(i + k) % len(CYCLE)] for k in range(4 + i % 3)],
        sampling=Sampling(max_tokens=max_tokens, temperature=temperature, seed=500 + i),
        detok=Detokenizer(TOK.token_bytes, ()),
        constraint=common_pb2.Constraint(regex="x") if constrained else None,
    )


def workload(temperature: float = 0.0) -> list[Request]:
    """Three constrained requests with different patterns around an unconstrained one (its
    rows take no mask), then two more that join the running batch."""
    kinds = [True, False, True, True, True, False]
    lengths = [40, 30, 37, 40, 23, 30]
    return [
        request(i, constrained=c, max_tokens=n, temperature=temperature)
        for i, (c, n) in enumerate(zip(kinds, lengths, strict=True))
    ]


async def run(engine: Engine, reqs: list[Request]) -> list[list[int]]:
    await engine.start()
    try:
        tasks = []
        for i, r in enumerate(reqs):
            await engine.submit(r)
            tasks.append(asyncio.create_task(collect(r)))
            if i == 3:
                await asyncio.sleep(0.05)
        results = await asyncio.gather(*tasks)
    finally:
        await engine.stop()
    for r, (_, _, final) in zip(reqs, results, strict=True):
        assert final.finish_reason == worker_pb2.FINISH_REASON_LENGTH, (r.request_id, final.error)
    return [ids for ids, _, _ in results]


def positional_engine(
    *, overlap: bool, jump_forward: bool = True, speculative: bool = False
) -> tuple[Engine, PositionalGrammar]:
    engine, model = make_engine(
        overlap=overlap,
        jump_forward=jump_forward,
        speculative=token_drafts(4) if speculative else None,
    )
    model.rule = periodic
    grammar = PositionalGrammar()
    engine.grammar = grammar  # type: ignore[assignment]
    return engine, grammar


def expected(reqs: list[Request], jump_forward: bool) -> list[list[int]]:
    return [
        reference(
            r.prompt,
            r.sampling.max_tokens,
            salt(r.request_id) if r.constrained else None,
            jump_forward,
        )
        for r in reqs
    ]


@pytest.mark.parametrize("jump_forward", [True, False], ids=["jump-forward", "no-jump"])
@pytest.mark.parametrize("overlap", [True, False], ids=["overlap", "serial"])
async def test_each_request_gets_its_own_mask_row(overlap: bool, jump_forward: bool) -> None:
    """Without drafts: one row per request and step, in a batch of several constrained
    requests (each its own pattern) and unconstrained ones."""
    engine, grammar = positional_engine(overlap=overlap, jump_forward=jump_forward)
    reqs = workload()
    got = await run(engine, reqs)
    assert not grammar.refused
    assert got == expected(reqs, jump_forward)


@pytest.mark.parametrize("overlap", [True, False], ids=["overlap", "serial"])
async def test_draft_positions_get_their_own_mask_rows(overlap: bool) -> None:
    """With drafts: the main row, a row per accepted draft, the rows of forced drafts and of a
    forced jump each at their position; the output is the reference's, as without drafts."""
    engine, grammar = positional_engine(overlap=overlap, speculative=True)
    verified: list[tuple[int, int, tuple[int, int]]] = []  # (drafts, own drafts, jump)

    async def spy(batch: ForwardBatch) -> None:
        rows, kind = batch.rows, batch.kind
        if kind == "verify":
            verified.extend(
                (r.outputs - 1, r.own_drafts, r.jump) for r in rows if r.req.constrained
            )

    before_each_pass(engine, spy)
    reqs = workload()
    got = await run(engine, reqs)
    assert not grammar.refused
    assert got == expected(reqs, True)
    # What the test is about happened: rows with several own drafts, forced jumps among the
    # drafts (the row after one is not the next logits row), and (serial) forced drafts.
    assert any(own >= 2 for _, own, _ in verified), verified
    assert grammar.jumps and any(count for _, _, (_, count) in verified), verified
    if not overlap:
        assert grammar.forced_after_ff and any(n and not own for n, own, _ in verified)
    assert engine.metrics.stats.draft_accepted > 0


async def seeded_outputs(jump_forward: bool) -> tuple[list[list[int]], list[list[int]]]:
    """The workload at temperature 1 without drafts and with them (serial: forced drafts too)."""
    plain, _ = positional_engine(overlap=False, jump_forward=jump_forward)
    want = await run(plain, workload(temperature=1.0))
    spec, grammar = positional_engine(overlap=False, jump_forward=jump_forward, speculative=True)
    got = await run(spec, workload(temperature=1.0))
    assert not grammar.refused
    assert spec.metrics.stats.draft_accepted > 0
    return got, want


async def test_seeded_sampling_with_drafts_matches_sampling_without() -> None:
    """Temperature 1: a free position's draw is random, a single-token one is not; with drafts
    each position still gets its own row and its own random counter."""
    got, want = await seeded_outputs(jump_forward=False)
    assert got == want


@pytest.mark.xfail(
    strict=True,
    reason="a draft the grammar accepts where jump-forward would force its token is drawn (and "
    "takes a random counter); without drafts that token is forced and takes none, so later "
    "draws use other counters",
)
async def test_seeded_sampling_with_drafts_through_forced_tokens_matches_sampling_without() -> None:
    got, want = await seeded_outputs(jump_forward=True)
    assert got == want


async def test_sample_takes_each_positions_row() -> None:
    """One step of two requests, three positions and two: every logits row is drawn under the
    mask row named by its position, not its neighbour's or the other request's."""
    engine, _ = make_engine(overlap=False, speculative=token_drafts(4))
    await engine.start()
    try:
        a, b = request(0, constrained=True), request(1, constrained=True)
        tokens = {a: [CYCLE[0], CYCLE[1], CYCLE[3]], b: [CYCLE[4], CYCLE[5]]}
        outcomes = {}
        for r, ts in tokens.items():
            words = np.zeros((len(ts), TOK.words_per_row), dtype=np.uint32)
            for j, t in enumerate(ts):
                words[j, t >> 5] |= np.uint32(1 << (t & 31))
            outcomes[r] = RowOutcome(
                ok=True, mask=words.view(np.int32), accepted_drafts=len(ts) - 1
            )
        # The model prefers a token no row allows, at every position.
        logits = torch.zeros(8, V + 64)
        logits[:, CYCLE[2]] = 10.0
        positions = [Draw(a, 0, 0), Draw(a, 1, 1), Draw(a, 2, 2), Draw(b, 0, 0), Draw(b, 1, 1)]
        held = engine.device._hold(logits)  # type: ignore[attr-defined]
        out = await engine.stage.sample(positions, held, outcomes)
    finally:
        await engine.stop()
    assert out.tokens[:5] == [*tokens[a], *tokens[b]]
