"""maskwire.rpc: undecodable requests are INVALID_ARGUMENT on every kind of method (reflection
included), and long error statuses reach a client intact."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import grpc
import pytest
from grpc_health.v1 import health_pb2
from grpc_reflection.v1alpha import reflection_pb2

from maskwire.rpc import RpcError, Server, channel_options, client_channel_options

Msg = health_pb2.HealthCheckRequest  # any message with a string field will do
INVALID_UTF8 = b"\x0a\x03a\xff\xfe"  # field 1 (service, a string) holding invalid UTF-8
GARBAGE = b"\xff\xff\xff"

pytestmark = pytest.mark.asyncio(loop_scope="session")  # the loop the server fixture runs on


async def _bidi_generator(requests: AsyncIterator[Msg], context: Any) -> AsyncIterator[Msg]:
    async for r in requests:
        yield r


async def _bidi_writer(requests: AsyncIterator[Msg], context: grpc.aio.ServicerContext) -> None:
    async for r in requests:
        await context.write(r)


async def _client_stream(requests: AsyncIterator[Msg], context: Any) -> Msg:
    return Msg(service=",".join([r.service async for r in requests]))


async def _server_stream(request: Msg, context: Any) -> AsyncIterator[Msg]:
    yield request


async def _unary(request: Msg, context: Any) -> Msg:
    return request


async def _long_error(request: Msg, context: grpc.aio.ServicerContext) -> Msg:
    # A plain status (a server that does not bound its errors as `RpcError` does).
    await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "x" * 100_000)
    raise AssertionError("unreachable")


def _register(server: grpc.aio.Server) -> None:
    ser, de = Msg.SerializeToString, Msg.FromString
    handlers = {
        "BidiGen": grpc.stream_stream_rpc_method_handler(_bidi_generator, de, ser),
        "BidiWriter": grpc.stream_stream_rpc_method_handler(_bidi_writer, de, ser),
        "ClientStream": grpc.stream_unary_rpc_method_handler(_client_stream, de, ser),
        "ServerStream": grpc.unary_stream_rpc_method_handler(_server_stream, de, ser),
        "Unary": grpc.unary_unary_rpc_method_handler(_unary, de, ser),
        "LongError": grpc.unary_unary_rpc_method_handler(_long_error, de, ser),
    }
    server.add_generic_rpc_handlers([grpc.method_handlers_generic_handler("t.T", handlers)])


@pytest.fixture
async def address() -> AsyncIterator[str]:
    server = Server(host="127.0.0.1", port=0, service_names=["t.T"], register=_register)
    await server.start()
    try:
        yield f"127.0.0.1:{server.port}"
    finally:
        await server.server.stop(None)


def _raw(x: bytes) -> bytes:
    return x


async def _call(ch: grpc.aio.Channel, method: str, payloads: list[bytes]) -> list[Msg]:
    kw: dict[str, Any] = {"request_serializer": _raw, "response_deserializer": Msg.FromString}
    if method.startswith("Bidi"):
        return [m async for m in ch.stream_stream(f"/t.T/{method}", **kw)(iter(payloads))]
    if method == "ClientStream":
        return [await ch.stream_unary(f"/t.T/{method}", **kw)(iter(payloads))]
    if method == "ServerStream":
        return [m async for m in ch.unary_stream(f"/t.T/{method}", **kw)(payloads[0])]
    return [await ch.unary_unary(f"/t.T/{method}", **kw)(payloads[0])]


METHODS = ["Unary", "ServerStream", "ClientStream", "BidiGen", "BidiWriter"]


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("bad", [GARBAGE, INVALID_UTF8], ids=["garbage", "invalid-utf8"])
async def test_undecodable_request_is_invalid_argument(
    address: str, method: str, bad: bytes
) -> None:
    good = Msg(service="ok").SerializeToString()
    async with grpc.aio.insecure_channel(address) as ch:
        payloads = [good, bad, good] if method.startswith(("Bidi", "Client")) else [bad]
        with pytest.raises(grpc.aio.AioRpcError) as e:
            await _call(ch, method, payloads)
        err = RpcError.from_call_error(e.value)
        assert err.code is grpc.StatusCode.INVALID_ARGUMENT, err.message
        assert err.reason == "UNDECODABLE_REQUEST"
        # Decodable requests still work through the same wrapper.
        answers = await _call(ch, method, [good, good] if method != "Unary" else [good])
        assert answers and all(a.service.startswith("ok") for a in answers)


async def test_reflection_garbage_is_invalid_argument(address: str) -> None:
    method = "/grpc.reflection.v1alpha.ServerReflection/ServerReflectionInfo"
    async with grpc.aio.insecure_channel(address) as ch:
        call = ch.stream_stream(
            method,
            request_serializer=_raw,
            response_deserializer=reflection_pb2.ServerReflectionResponse.FromString,
        )
        with pytest.raises(grpc.aio.AioRpcError) as e:
            _ = [m async for m in call(iter([GARBAGE]))]
        assert e.value.code() is grpc.StatusCode.INVALID_ARGUMENT
        ok = reflection_pb2.ServerReflectionRequest(list_services="").SerializeToString()
        answers = [m async for m in call(iter([ok]))]
        assert "t.T" in [s.name for s in answers[0].list_services_response.service]


async def test_long_error_reaches_a_client_with_its_status(address: str) -> None:
    """gRPC's default metadata limit turns a huge status from some other server into
    RESOURCE_EXHAUSTED; `client_channel_options` receives it intact."""
    for options, code in (
        (channel_options(), grpc.StatusCode.RESOURCE_EXHAUSTED),
        (client_channel_options(), grpc.StatusCode.INVALID_ARGUMENT),
    ):
        async with grpc.aio.insecure_channel(address, options=options) as ch:
            with pytest.raises(grpc.aio.AioRpcError) as e:
                await ch.unary_unary("/t.T/LongError", request_serializer=_raw)(b"")
            err = RpcError.from_call_error(e.value)  # never raises on a replaced status
            assert err.code is code, err.message[:200]
