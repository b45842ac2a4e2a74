"""Several clients of one grammar-service process compiling the same constraint (tests only)."""

from __future__ import annotations

import queue
import random
import threading
import time

import grpc

from maskwire.rpc import channel_options
from maskwire.tokenizer import Tokenizer
from maskwire.v1 import common_pb2, grammar_pb2, grammar_pb2_grpc


def connect(address: str) -> grpc.Channel:
    """A channel on a connection of its own (channels of one process share one by default)."""
    return grpc.insecure_channel(
        address, options=[*channel_options(), ("grpc.use_local_subchannel_pool", 1)]
    )


def choices(seed: int, n: int) -> common_pb2.Constraint:
    """About `n` distinct random words (4 to 10 letters, ~9 bytes each) as a choice list: slow
    to compile (a second or more for 30,000 on a loaded machine), and ~13 MB once compiled."""
    rng = random.Random(seed)
    letters = "abcdefghijklmnopqrstuvwxyz"
    words = {"".join(rng.choice(letters) for _ in range(rng.randint(4, 10))) for _ in range(n)}
    return common_pb2.Constraint(choice=common_pb2.ChoiceList(choices=sorted(words)))


def compile_request(
    tok: Tokenizer, constraint: common_pb2.Constraint
) -> grammar_pb2.CompileRequest:
    return grammar_pb2.CompileRequest(constraint=constraint, tokenizer=tok.fingerprint.to_proto())


def open_msg(
    tok: Tokenizer, rid: str, constraint: common_pb2.Constraint
) -> grammar_pb2.SessionRequest:
    return grammar_pb2.SessionRequest(
        open=grammar_pb2.Open(
            request_id=rid, constraint=constraint, tokenizer=tok.fingerprint.to_proto()
        )
    )


class Stream:
    """A Session stream with a deadline, answering one message at a time."""

    def __init__(self, ch: grpc.Channel, timeout_s: float) -> None:
        self._q: queue.Queue[grammar_pb2.SessionRequest | None] = queue.Queue()
        self.call = grammar_pb2_grpc.GrammarServiceStub(ch).Session(
            iter(self._q.get, None), timeout=timeout_s
        )

    def send(self, msg: grammar_pb2.SessionRequest) -> grammar_pb2.SessionResponse:
        self._q.put(msg)
        return next(self.call)

    def end(self) -> None:
        self._q.put(None)


def cancel_one_caller_of_a_shared_compile(
    address: str, tok: Tokenizer, slow: common_pb2.Constraint
) -> None:
    """Client 1 compiles `slow` (not yet compiled there, seconds to compile); client 2 compiles
    it too and opens a request with it on its Session stream; client 1 cancels. Client 2 gets
    its compile and its Open answered, and its stream goes on serving."""
    with connect(address) as first_ch, connect(address) as second_ch:
        first = grammar_pb2_grpc.GrammarServiceStub(first_ch).Compile.future(
            compile_request(tok, slow), timeout=60
        )
        time.sleep(0.05)  # the first caller's compile is running
        second = grammar_pb2_grpc.GrammarServiceStub(second_ch).Compile.future(
            compile_request(tok, slow), timeout=30
        )
        stream = Stream(second_ch, timeout_s=30)
        opened: list[grammar_pb2.SessionResponse] = []
        opener = threading.Thread(
            target=lambda: opened.append(stream.send(open_msg(tok, "same", slow)))
        )
        opener.start()
        time.sleep(0.1)  # both wait for the same compile
        assert first.cancel(), "the compile ended before the first caller could cancel"
        answer = second.result()
        opener.join(30)
        assert answer.grammar_id and answer.cached  # it joined the compile the first one started
        assert opened and not opened[0].opened.HasField("error"), opened
        # An unrelated request on the second client's stream proceeds.
        other = stream.send(open_msg(tok, "other", common_pb2.Constraint(regex="[0-9]+")))
        assert not other.opened.HasField("error"), other
        close = grammar_pb2.SessionRequest(close=grammar_pb2.Close(request_id="same"))
        assert stream.send(close).closed.found
        close = grammar_pb2.SessionRequest(close=grammar_pb2.Close(request_id="other"))
        assert stream.send(close).closed.found
        stream.end()
        try:
            first.result()
        except grpc.FutureCancelledError:
            pass
        else:
            raise AssertionError("the cancelled call got an answer")
