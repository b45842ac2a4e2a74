"""The engine's side of the grammar client: a request's grammar session (`grammar_request`), and
the step's grammar stage, one `GrammarClient.step` for the constrained requests of a batch, sent
before the device work it may overlap and awaited when its answers are needed."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

from maskwire.v1 import grammar_pb2
from neuron_worker.grammar_client import GrammarClient, GrammarRequest, RowOutcome
from neuron_worker.metrics import Metrics
from neuron_worker.request import Request

__all__ = ["GrammarCall", "first_step", "grammar_request", "send_step"]


def grammar_request(req: Request, *, jump_forward: bool) -> GrammarRequest:
    """The grammar session of a constrained request (`--jump-forward`: whether the grammar
    service computes forced tokens)."""
    assert req.constraint is not None
    return GrammarRequest(
        request_id=req.request_id,
        constraint=req.constraint,
        options=grammar_pb2.RequestOptions(
            reasoning_end_marker=req.reasoning_end_marker, jump_forward=jump_forward
        ),
    )


@dataclass
class GrammarCall:
    """A grammar Step in flight for the `constrained` requests of a decode step."""

    task: asyncio.Task[list[RowOutcome]]
    constrained: list[Request]
    metrics: Metrics

    async def answers(self) -> dict[Request, RowOutcome]:
        """Wait for the answers (the wait is the step's "mask wait")."""
        waited = time.perf_counter()
        res = await self.task
        self.metrics.mask_wait(time.perf_counter() - waited)
        return dict(zip(self.constrained, res, strict=True))


async def first_step(
    client: GrammarClient | None, reqs: Sequence[Request]
) -> dict[Request, RowOutcome]:
    """The grammar's answer to the first Step of each admitted constrained request (its
    initial forced tokens and first mask), before their prefill."""
    constrained = [r for r in reqs if r.grammar is not None]
    if not constrained:
        return {}
    assert client is not None
    res = await client.step([(r.grammar, []) for r in constrained])  # type: ignore[misc]
    return dict(zip(constrained, res, strict=True))


def send_step(
    client: GrammarClient | None,
    batch: Sequence[Request],
    metrics: Metrics,
    *,
    drafts: Mapping[Request, list[int]] | None = None,
    forced_room: Callable[[list[Request]], list[int]] | None = None,
) -> GrammarCall | None:
    """Send each constrained request's tokens the grammar has not seen (accepted drafts, then
    the pending token; the accepted drafts count as sent from now on); on a speculative step
    with the `drafts` to check and each request's room for forced drafts. None when no request
    is constrained."""
    constrained: list[Request] = []
    entries: list[tuple[GrammarRequest, list[int]]] = []
    for r in batch:
        if r.grammar is not None:
            assert r.pending is not None  # a decode step's requests all hold one
            constrained.append(r)
            entries.append((r.grammar, [*r.verified, r.pending]))
        r.verified = []
    if not entries:
        return None
    assert client is not None
    if drafts is None or forced_room is None:
        coro = client.step(entries)
    else:
        coro = client.step(
            entries,
            drafts=[drafts.get(r, []) for r in constrained],
            forced_draft_room=forced_room(constrained),
        )
    return GrammarCall(asyncio.create_task(coro), constrained, metrics)
