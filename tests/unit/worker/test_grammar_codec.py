"""The grammar client's step codec on its own: rows to a `Step`, a `StepResult` to outcomes."""

from __future__ import annotations

import grpc
import numpy as np
import pytest

from maskwire.bitmask import encode_rows
from maskwire.rpc import RpcError
from maskwire.v1 import grammar_pb2
from neuron_worker.grammar_codec import BadStep, read_step, step_request, step_row

WORDS = 2
VOCAB = 64
OK = grammar_pb2.ROW_STATUS_OK


def words(*rows: list[int]) -> bytes:
    return np.array(rows, dtype="<i4").tobytes()


def test_a_row_carries_its_position_after_the_new_tokens() -> None:
    row = step_row("r", consumed=5, new_tokens=[7, 8], drafts=[9], forced_room=3)
    assert (row.request_id, list(row.new_tokens), row.position) == ("r", [7, 8], 7)
    assert list(row.draft_tokens) == [9] and row.forced_draft_room == 3
    msg = step_request(4, [row], compact_masks=True)
    assert msg.step.step == 4 and msg.step.compact_masks and msg.step.rows[0] == row


def test_masks_are_split_by_row_in_order_with_what_each_row_carries() -> None:
    sent = [step_row("a", 0, [1]), step_row("b", 2, [3], drafts=[4, 5]), step_row("c", 0, [])]
    result = grammar_pb2.StepResult(
        step=1,
        words_per_row=WORDS,
        bitmask=words([1, -1], [2, -1], [3, -1]),
        rows=[
            grammar_pb2.RowResult(request_id="a", status=OK, mask_rows=1, ff_tokens=[6]),
            grammar_pb2.RowResult(
                request_id="b",
                status=OK,
                mask_rows=2,
                accepted_drafts=1,
                accepting=True,
                forced_drafts=[4, 9],
                forced_jump_start=1,
                forced_jump_count=1,
            ),
            grammar_pb2.RowResult(request_id="c", status=OK, mask_rows=0, finished=True),
        ],
    )
    answer = read_step(sent, result, WORDS)
    assert answer.lost == []
    a, b, c = answer.outcomes
    assert a.ok and a.mask is not None and a.mask.tolist() == [[1, -1]] and a.ff_tokens == [6]
    assert b.mask is not None and b.mask.tolist() == [[2, -1], [3, -1]]
    assert (b.accepted_drafts, b.accepting, b.forced_drafts, b.forced_jump) == (
        1,
        True,
        [4, 9],
        (1, 1),
    )
    assert c.ok and c.mask is None and c.finished


def test_a_compact_answer_decodes_to_the_dense_rows() -> None:
    dense = np.array([[0, 5], [-1, -1], [0, 5]], dtype=np.int32)
    c = encode_rows(dense, VOCAB)
    result = grammar_pb2.StepResult(
        words_per_row=WORDS,
        vocab_size=VOCAB,
        bitmask=c.dense,
        mask_row_encodings=c.encodings.tolist(),
        mask_row_word_counts=c.counts.tolist(),
        mask_word_index=c.index,
        mask_word_values=c.values,
        mask_row_repeat_of=c.repeat_of.tolist(),
        rows=[
            grammar_pb2.RowResult(request_id="a", status=OK, mask_rows=2, accepted_drafts=1),
            grammar_pb2.RowResult(request_id="b", status=OK, mask_rows=1),
        ],
    )
    a, b = read_step([step_row("a", 0, [1]), step_row("b", 0, [1])], result, WORDS).outcomes
    assert a.mask is not None and a.mask.tolist() == dense[:2].tolist()
    assert b.mask is not None and b.mask.tolist() == dense[2:].tolist()


def test_failed_rows_keep_their_status_and_lost_state_is_marked_for_replay() -> None:
    refused = RpcError(
        grpc.StatusCode.INVALID_ARGUMENT, "token 3 rejected", reason="TOKEN_REJECTED"
    )
    sent = [step_row("a", 4, [1, 2]), step_row("b", 0, [1]), step_row("c", 0, [1])]
    result = grammar_pb2.StepResult(
        words_per_row=WORDS,
        rows=[
            grammar_pb2.RowResult(
                request_id="a", status=grammar_pb2.ROW_STATUS_DESYNC, expected_position=9
            ),
            grammar_pb2.RowResult(request_id="b", status=grammar_pb2.ROW_STATUS_UNKNOWN_REQUEST),
            grammar_pb2.RowResult(
                request_id="c", status=grammar_pb2.ROW_STATUS_ERROR, error=refused.to_status()
            ),
        ],
    )
    answer = read_step(sent, result, WORDS)
    assert answer.lost == [0, 1]
    desync, unknown, error = answer.outcomes
    assert not desync.ok and desync.code is grpc.StatusCode.INTERNAL
    assert desync.error == "grammar desync: sent position 6, service expected 9"
    assert not unknown.ok and unknown.error == "ROW_STATUS_UNKNOWN_REQUEST"
    assert (error.ok, error.code, error.error, error.reason) == (
        False,
        grpc.StatusCode.INVALID_ARGUMENT,
        "token 3 rejected",
        "TOKEN_REJECTED",
    )


@pytest.mark.parametrize(
    ("change", "why"),
    [
        ({"rows": 1}, "1 rows for 2"),
        ({"words_per_row": 4}, "4 words per mask row, expected 2"),
        ({"bitmask": words([1, -1])}, "rows claim more or fewer than the 1 mask rows sent"),
        ({"bitmask": words([1, -1], [2, -1])[:-4]}, "is not whole 2-word rows"),
    ],
)
def test_an_answer_that_does_not_match_what_was_sent_is_refused(
    change: dict[str, object], why: str
) -> None:
    n_rows = change.get("rows", 2)
    assert isinstance(n_rows, int)
    result = grammar_pb2.StepResult(
        words_per_row=change.get("words_per_row", WORDS),  # type: ignore[arg-type]
        bitmask=change.get("bitmask", words([1, -1], [2, -1])),  # type: ignore[arg-type]
        rows=[
            grammar_pb2.RowResult(request_id=f"r{i}", status=OK, mask_rows=1) for i in range(n_rows)
        ],
    )
    with pytest.raises(BadStep, match=why):
        read_step([step_row("r0", 0, [1]), step_row("r1", 0, [1])], result, WORDS)
