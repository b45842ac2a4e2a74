"""A small synchronous client for the Session stream (tests only)."""

from __future__ import annotations

import queue
from collections.abc import Iterator, Sequence

import grpc
import numpy as np

from maskwire.bitmask import step_masks
from maskwire.rpc import channel_options
from maskwire.tokenizer import Tokenizer
from maskwire.v1 import common_pb2, grammar_pb2, grammar_pb2_grpc


def text_tokens(tok: Tokenizer, text: str) -> list[int]:
    """Token ids of generated text (no BOS)."""
    if tok.hf is not None:
        return list(tok.hf.encode(text, add_special_tokens=False).ids)
    return list(tok.ll.tokenize_str(text))


def allowed(mask_row: np.ndarray, token: int) -> bool:
    return bool((int(mask_row[token >> 5]) >> (token & 31)) & 1)


class SessionClient:
    """One Session stream; `send` writes a message and returns its answer."""

    def __init__(self, channel: grpc.Channel) -> None:
        self.stub = grammar_pb2_grpc.GrammarServiceStub(channel)
        self._q: queue.Queue[grammar_pb2.SessionRequest | None] = queue.Queue()
        self._responses: Iterator[grammar_pb2.SessionResponse] = self.stub.Session(
            iter(self._q.get, None)
        )
        self.step_no = 0

    def send(self, msg: grammar_pb2.SessionRequest) -> grammar_pb2.SessionResponse:
        self._q.put(msg)
        return next(self._responses)

    def open(
        self,
        request_id: str,
        tok: Tokenizer,
        constraint: common_pb2.Constraint | None = None,
        *,
        grammar_id: str = "",
        jump_forward: bool = False,
        reasoning_end_marker: str = "",
        replay_tokens: Sequence[int] = (),
    ) -> grammar_pb2.Opened:
        msg = grammar_pb2.Open(
            request_id=request_id,
            tokenizer=tok.fingerprint.to_proto(),
            options=grammar_pb2.RequestOptions(
                jump_forward=jump_forward, reasoning_end_marker=reasoning_end_marker
            ),
            replay_tokens=list(replay_tokens),
        )
        if constraint is not None:
            msg.constraint.CopyFrom(constraint)
        else:
            msg.grammar_id = grammar_id
        return self.send(grammar_pb2.SessionRequest(open=msg)).opened

    def step(
        self, rows: Sequence[grammar_pb2.StepRow], *, compact: bool = False
    ) -> grammar_pb2.StepResult:
        self.step_no += 1
        res = self.send(
            grammar_pb2.SessionRequest(
                step=grammar_pb2.Step(step=self.step_no, rows=rows, compact_masks=compact)
            )
        ).step_result
        assert res.step == self.step_no
        return res

    def close(self, request_id: str) -> grammar_pb2.Closed:
        return self.send(
            grammar_pb2.SessionRequest(close=grammar_pb2.Close(request_id=request_id))
        ).closed

    def end(self) -> None:
        self._q.put(None)


def row(
    request_id: str, position: int, new_tokens: Sequence[int] = (), drafts: Sequence[int] = ()
) -> grammar_pb2.StepRow:
    return grammar_pb2.StepRow(
        request_id=request_id,
        position=position,
        new_tokens=list(new_tokens),
        draft_tokens=list(drafts),
    )


def masks(res: grammar_pb2.StepResult) -> np.ndarray:
    """The step's mask rows as an int32 [rows, W] array (dense or compact answer)."""
    if not res.mask_row_encodings:
        assert len(res.bitmask) % (res.words_per_row * 4) == 0
    return step_masks(res)


def channel(address: str) -> grpc.Channel:
    return grpc.insecure_channel(address, options=channel_options())
