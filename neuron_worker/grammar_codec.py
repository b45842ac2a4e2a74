"""The worker's Session messages, encoded and decoded: no streams, no state.

`open_request`, `close_request` and `step_request` (of `step_row`s) build what the worker sends;
`read_step` checks a `StepResult` against the rows sent and turns it into one `RowOutcome` per
row. An answer that does not match what was sent (row count, mask rows, row width) is `BadStep`:
the caller drops that replica, and such masks never reach the sampler.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import grpc
import numpy as np

from maskwire.bitmask import step_masks
from maskwire.rpc import RpcError
from maskwire.v1 import common_pb2, grammar_pb2

_LOST = (grammar_pb2.ROW_STATUS_DESYNC, grammar_pb2.ROW_STATUS_UNKNOWN_REQUEST)


@dataclass
class RowOutcome:
    """The grammar's answer for one request in one step."""

    ok: bool
    mask: np.ndarray | None = None  # int32 [mask_rows, W]; None: unconstrained at this position
    ff_tokens: list[int] = field(default_factory=list)
    accepting: bool = False
    finished: bool = False
    accepted_drafts: int = (
        0  # leading drafts the grammar accepts (one mask row each after the first)
    )
    # Drafts of the bytes the grammar forces after `ff_tokens`, checked in place of the row's
    # own drafts (`GrammarClient.step`'s `forced_draft_room`).
    forced_drafts: list[int] = field(default_factory=list)
    # (start, count): forced_drafts[start : start + count] are tokens the grammar forces after
    # the drafts before them, kept without comparing them with a draw.
    forced_jump: tuple[int, int] = (0, 0)
    error: str = ""
    code: grpc.StatusCode = grpc.StatusCode.OK
    reason: str = ""  # google.rpc.ErrorInfo reason of the error

    @classmethod
    def failed(cls, err: RpcError) -> RowOutcome:
        return cls(ok=False, error=err.message, code=err.code, reason=err.reason)

    def status(self) -> RpcError:
        """The error as a gRPC status (for a request that has not streamed anything yet)."""
        return RpcError(self.code, self.error, reason=self.reason)


class BadStep(ValueError):
    """A `StepResult` that does not answer the rows sent."""


@dataclass
class StepAnswer:
    """A replica's answer to one `Step`: an outcome per row sent, in order, and which rows' state
    the service lost or holds out of step (DESYNC, UNKNOWN_REQUEST: a replay repairs them; their
    outcome is the failure to report when it cannot)."""

    outcomes: list[RowOutcome]
    lost: list[int]


def open_request(
    request_id: str,
    grammar_id: str,
    tokenizer: common_pb2.TokenizerFingerprint,
    options: grammar_pb2.RequestOptions,
    replay_tokens: Sequence[int],
) -> grammar_pb2.SessionRequest:
    return grammar_pb2.SessionRequest(
        open=grammar_pb2.Open(
            request_id=request_id,
            grammar_id=grammar_id,
            tokenizer=tokenizer,
            options=options,
            replay_tokens=replay_tokens,
        )
    )


def close_request(request_id: str) -> grammar_pb2.SessionRequest:
    return grammar_pb2.SessionRequest(close=grammar_pb2.Close(request_id=request_id))


def step_row(
    request_id: str,
    consumed: int,
    new_tokens: Sequence[int],
    drafts: Sequence[int] = (),
    forced_room: int = 0,
) -> grammar_pb2.StepRow:
    """One request's row: `consumed` is how many tokens the service has consumed for it so far,
    so the row's position (the service checks it) counts `new_tokens` on top."""
    return grammar_pb2.StepRow(
        request_id=request_id,
        new_tokens=new_tokens,
        position=consumed + len(new_tokens),
        draft_tokens=drafts,
        forced_draft_room=forced_room,
    )


def step_request(
    step_no: int, rows: Sequence[grammar_pb2.StepRow], compact_masks: bool
) -> grammar_pb2.SessionRequest:
    return grammar_pb2.SessionRequest(
        step=grammar_pb2.Step(step=step_no, rows=rows, compact_masks=compact_masks)
    )


def read_step(
    sent: Sequence[grammar_pb2.StepRow], result: grammar_pb2.StepResult, words_per_row: int
) -> StepAnswer:
    """Check `result` against the rows `sent` and decode it. Masks of a dense answer are views
    of the message's bytes (no copy). Raises BadStep."""
    if len(result.rows) != len(sent):
        raise BadStep(f"{len(result.rows)} rows for {len(sent)}")
    try:
        masks = step_masks(result)
        if result.words_per_row != words_per_row:
            raise ValueError(f"{result.words_per_row} words per mask row, expected {words_per_row}")
        if sum(r.mask_rows for r in result.rows) != len(masks):
            raise ValueError(f"rows claim more or fewer than the {len(masks)} mask rows sent")
    except ValueError as e:
        raise BadStep(f"bad masks: {e}") from None
    outcomes: list[RowOutcome] = []
    lost: list[int] = []
    offset = 0
    for j, (pb, row) in enumerate(zip(sent, result.rows, strict=True)):
        if row.status != grammar_pb2.ROW_STATUS_OK:
            outcomes.append(_row_failure(row, pb))
            if row.status in _LOST:
                lost.append(j)
            continue
        n = row.mask_rows
        outcomes.append(
            RowOutcome(
                ok=True,
                mask=masks[offset : offset + n] if n else None,
                ff_tokens=list(row.ff_tokens),
                accepting=row.accepting,
                finished=row.finished,
                accepted_drafts=row.accepted_drafts,
                forced_drafts=list(row.forced_drafts),
                forced_jump=(row.forced_jump_start, row.forced_jump_count),
            )
        )
        offset += n
    return StepAnswer(outcomes, lost)


def _row_failure(row: grammar_pb2.RowResult, sent: grammar_pb2.StepRow) -> RowOutcome:
    """The outcome of a row the service answered with an error: its own status (a grammar that
    rejects a token or passes the parser's limits is INVALID_ARGUMENT, not a server fault)."""
    if row.status == grammar_pb2.ROW_STATUS_DESYNC:
        return RowOutcome(
            ok=False,
            error=f"grammar desync: sent position {sent.position}, service "
            f"expected {row.expected_position}",
            code=grpc.StatusCode.INTERNAL,
        )
    if row.HasField("error"):
        return RowOutcome.failed(RpcError.from_status(row.error))
    return RowOutcome(
        ok=False, error=grammar_pb2.RowStatus.Name(row.status), code=grpc.StatusCode.INTERNAL
    )
