"""Errors that quote huge or odd client input still arrive as their own status."""

from __future__ import annotations

import grpc
import pytest

from maskwire.rpc import RpcError
from maskwire.v1 import grammar_pb2, grammar_pb2_grpc

HUGE = "(" + "é" * 50_000 + "\ud800["  # non-ASCII (percent-encoded x3 in headers), a lone surrogate


def huge_error() -> RpcError:
    return RpcError(
        grpc.StatusCode.INVALID_ARGUMENT,
        f"invalid constraint.regex: {HUGE}",
        [(f"constraint.regex[{i}]", HUGE) for i in range(50)],
        reason="INVALID_CONSTRAINT",
    )


def test_message_and_details_are_bounded_and_encodable() -> None:
    err = huge_error()
    assert len(err.message.encode("utf-8")) <= 1024
    assert err.message.startswith("invalid constraint.regex: (éé")
    assert len(err.violations) == 4
    assert all(len(d.encode("utf-8")) <= 256 for _, d in err.violations)
    assert len(err.to_status().SerializeToString()) < 3000


class Refuses(grammar_pb2_grpc.GrammarServiceServicer):
    async def Compile(
        self, request: grammar_pb2.CompileRequest, context: grpc.aio.ServicerContext
    ) -> grammar_pb2.CompileResponse:
        await huge_error().abort(context)
        raise AssertionError("unreachable")


@pytest.mark.asyncio(loop_scope="session")
async def test_a_client_with_default_limits_gets_the_real_status() -> None:
    server = grpc.aio.server()
    grammar_pb2_grpc.add_GrammarServiceServicer_to_server(Refuses(), server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as ch:
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await grammar_pb2_grpc.GrammarServiceStub(ch).Compile(
                    grammar_pb2.CompileRequest(), timeout=10
                )
        err = RpcError.from_call_error(info.value)
        assert err.code == grpc.StatusCode.INVALID_ARGUMENT, info.value
        assert err.reason == "INVALID_CONSTRAINT"
        assert err.violations[0][0] == "constraint.regex[0]"
    finally:
        await server.stop(None)
