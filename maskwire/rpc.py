"""gRPC plumbing shared by the services: servers with health and reflection, rich errors, drain."""

from __future__ import annotations

import asyncio
import inspect
import logging
import signal
from collections.abc import Awaitable, Callable, Iterable, Sequence
from typing import Any

import grpc
from google.protobuf import any_pb2
from google.rpc import code_pb2, error_details_pb2, status_pb2
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection
from grpc_status import rpc_status

from maskwire.text import truncate_utf8

log = logging.getLogger(__name__)

DEFAULT_MAX_MESSAGE_BYTES = 64 * 1024 * 1024

FieldViolation = tuple[str, str]
"""(field path, description) for `google.rpc.BadRequest`."""

ACCEPTED_METADATA = (("maskwire-accepted", "1"),)
"""Initial metadata a maskwire service sends as soon as it takes a call, so that a client can
tell a peer that died mid-call (headers seen, then the connection broke) from one it never
reached."""

_STATUS_DETAILS_KEY = "grpc-status-details-bin"


def has_status_details(metadata: object) -> bool:
    """Whether a call's trailing metadata carries a `google.rpc.Status`: the status came from
    the service's own code (maskwire services always attach one), not from a broken transport."""
    if not metadata:
        return False
    return any(k == _STATUS_DETAILS_KEY for k, _ in metadata)  # type: ignore[attr-defined]


def status_proto(
    code: grpc.StatusCode, message: str, violations: Sequence[FieldViolation] = (), reason: str = ""
) -> status_pb2.Status:
    """A `google.rpc.Status` with `BadRequest` / `ErrorInfo` details, for in-band errors."""
    details: list[any_pb2.Any] = []
    if violations:
        bad = error_details_pb2.BadRequest(
            field_violations=[
                error_details_pb2.BadRequest.FieldViolation(field=f, description=d)
                for f, d in violations
            ]
        )
        packed = any_pb2.Any()
        packed.Pack(bad)
        details.append(packed)
    if reason:
        info = any_pb2.Any()
        info.Pack(error_details_pb2.ErrorInfo(reason=reason, domain="maskwire"))
        details.append(info)
    return status_pb2.Status(code=code.value[0], message=message, details=details)


# An error's status travels in HTTP/2 headers: the message (percent-encoded) and the details
# (base64, repeating the message). A client's default limit for all headers is 8 KiB; over it, the
# real status is replaced by RESOURCE_EXHAUSTED. These bounds keep the worst case near 6.5 KiB.
_MESSAGE_BYTES = 1024
_MAX_VIOLATIONS = 4
_FIELD_BYTES = 128
_DESCRIPTION_BYTES = 256


class RpcError(Exception):
    """An error that maps to a gRPC status with rich details; raise it from service code.

    The message and details are bounded (`maskwire.text.truncate_utf8`) whatever they quote, so
    the status always fits a client's default header limit and stays valid UTF-8."""

    def __init__(
        self,
        code: grpc.StatusCode,
        message: str,
        violations: Sequence[FieldViolation] = (),
        reason: str = "",
    ) -> None:
        message = truncate_utf8(message, _MESSAGE_BYTES)
        super().__init__(message)
        self.code = code
        self.message = message
        self.violations = tuple(
            (truncate_utf8(f, _FIELD_BYTES), truncate_utf8(d, _DESCRIPTION_BYTES))
            for f, d in violations[:_MAX_VIOLATIONS]
        )
        self.reason = truncate_utf8(reason, _FIELD_BYTES)

    def to_status(self) -> status_pb2.Status:
        return status_proto(self.code, self.message, self.violations, self.reason)

    async def abort(self, context: grpc.aio.ServicerContext) -> None:
        await context.abort_with_status(rpc_status.to_status(self.to_status()))

    @classmethod
    def from_status(cls, status: status_pb2.Status) -> RpcError:
        code = _CODE_BY_VALUE.get(status.code, grpc.StatusCode.UNKNOWN)
        violations: list[FieldViolation] = []
        reason = ""
        for d in status.details:
            if d.Is(error_details_pb2.BadRequest.DESCRIPTOR):
                bad = error_details_pb2.BadRequest()
                d.Unpack(bad)
                violations += [(v.field, v.description) for v in bad.field_violations]
            elif d.Is(error_details_pb2.ErrorInfo.DESCRIPTOR):
                info = error_details_pb2.ErrorInfo()
                d.Unpack(info)
                reason = info.reason
        return cls(code, status.message, violations, reason)

    @classmethod
    def from_call_error(cls, err: grpc.aio.AioRpcError) -> RpcError:
        """Recover rich details from a failed call (falls back to code + message)."""
        try:
            status = rpc_status.from_call(err)
        except ValueError:  # details disagree with the code: gRPC replaced the status (limits)
            status = None
        if status is not None:
            return cls.from_status(status)
        return cls(err.code(), err.details() or "")


_CODE_BY_VALUE = {c.value[0]: c for c in grpc.StatusCode}
assert _CODE_BY_VALUE[code_pb2.INVALID_ARGUMENT] is grpc.StatusCode.INVALID_ARGUMENT


ERROR_METADATA_BYTES = 1024 * 1024
"""Response metadata a client accepts. A status's message and details travel in the trailers, and
gRPC's default limit (16 KiB) replaces a long error with RESOURCE_EXHAUSTED, hiding its status."""


def channel_options(max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES) -> list[tuple[str, int]]:
    return [
        ("grpc.max_send_message_length", max_message_bytes),
        ("grpc.max_receive_message_length", max_message_bytes),
        ("grpc.keepalive_time_ms", 20_000),
        ("grpc.keepalive_timeout_ms", 10_000),
        ("grpc.http2.max_pings_without_data", 0),
        ("grpc.keepalive_permit_without_calls", 1),
    ]


def client_channel_options(
    max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
) -> list[tuple[str, int]]:
    """`channel_options` for a client, which also receives long error statuses intact (servers
    keep gRPC's default metadata limit for what clients send them)."""
    return [
        *channel_options(max_message_bytes),
        ("grpc.max_metadata_size", ERROR_METADATA_BYTES),
        ("grpc.absolute_max_metadata_size", ERROR_METADATA_BYTES),
    ]


class _Undecodable:
    """Stands in for a request message whose bytes did not parse."""

    def __init__(self, error: Exception) -> None:
        self.error = error


async def _refuse(request: _Undecodable, context: grpc.aio.ServicerContext) -> None:
    await RpcError(
        grpc.StatusCode.INVALID_ARGUMENT,
        f"request message could not be decoded: {request.error}",
        reason="UNDECODABLE_REQUEST",
    ).abort(context)


async def _refusing(requests: Any, context: grpc.aio.ServicerContext) -> Any:
    """The request stream, aborted with INVALID_ARGUMENT at its first undecodable message."""
    async for request in requests:
        if isinstance(request, _Undecodable):
            await _refuse(request, context)
        yield request


async def _forward(result: Any) -> Any:
    """Serve a streaming handler's answer: an async generator, or a coroutine that writes with
    context.write()."""
    if inspect.isasyncgen(result):
        async for item in result:
            yield item
    else:
        await result


class UndecodableRequests(grpc.aio.ServerInterceptor):
    """Answer INVALID_ARGUMENT, not grpcio's UNKNOWN, when a request's bytes don't parse.

    grpcio deserializes before a unary handler runs, and while a streaming handler iterates its
    requests, and reports a parse failure as UNKNOWN; the deserializer is wrapped so the failure
    reaches the handler as data and is refused there. Streaming handlers must iterate
    `request_iterator` (not `context.read()`) for this to apply; every service here does,
    reflection included.
    """

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        handler = await continuation(handler_call_details)
        if handler is None or handler.request_deserializer is None:
            return handler
        parse = handler.request_deserializer

        def tolerant_parse(data: bytes) -> Any:
            try:
                return parse(data)
            except Exception as e:  # protobuf DecodeError, invalid UTF-8 in a string field
                return _Undecodable(e)

        serialize = handler.response_serializer
        if handler.request_streaming and handler.response_streaming:
            bidi = handler.stream_stream

            # An async generator function, as grpcio's dispatch requires of streaming handlers.
            async def stream_stream(requests: Any, context: grpc.aio.ServicerContext) -> Any:
                async for item in _forward(bidi(_refusing(requests, context), context)):
                    yield item

            return grpc.stream_stream_rpc_method_handler(stream_stream, tolerant_parse, serialize)

        if handler.request_streaming:
            client_stream = handler.stream_unary

            async def stream_unary(requests: Any, context: grpc.aio.ServicerContext) -> Any:
                return await client_stream(_refusing(requests, context), context)

            return grpc.stream_unary_rpc_method_handler(stream_unary, tolerant_parse, serialize)

        if handler.response_streaming:
            stream = handler.unary_stream

            async def unary_stream(request: Any, context: grpc.aio.ServicerContext) -> Any:
                if isinstance(request, _Undecodable):
                    await _refuse(request, context)
                async for item in _forward(stream(request, context)):
                    yield item

            return grpc.unary_stream_rpc_method_handler(unary_stream, tolerant_parse, serialize)

        unary = handler.unary_unary

        async def unary_unary(request: Any, context: grpc.aio.ServicerContext) -> Any:
            if isinstance(request, _Undecodable):
                await _refuse(request, context)
            return await unary(request, context)

        return grpc.unary_unary_rpc_method_handler(unary_unary, tolerant_parse, serialize)


class Server:
    """A grpc.aio server with health, reflection and a graceful drain on SIGTERM/SIGINT."""

    def __init__(
        self,
        *,
        host: str,
        port: int,
        service_names: Iterable[str],
        register: Callable[[grpc.aio.Server], None],
        max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
        credentials: grpc.ServerCredentials | None = None,
        health_port: int = 0,
    ) -> None:
        """`credentials` (see `maskwire.tls`) makes the port TLS; `health_port` adds a plaintext
        port that serves only grpc.health.v1 (Kubernetes gRPC probes cannot speak TLS)."""
        self.server = grpc.aio.server(
            options=channel_options(max_message_bytes), interceptors=[UndecodableRequests()]
        )
        register(self.server)
        self.health = health.aio.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.server)
        self.service_names = [*service_names, ""]
        reflection.enable_server_reflection(
            [*service_names, health.SERVICE_NAME, reflection.SERVICE_NAME], self.server
        )
        address = f"{host}:{port}"
        if credentials is None:
            self.port = self.server.add_insecure_port(address)
        else:
            self.port = self.server.add_secure_port(address, credentials)
        if self.port == 0:
            raise OSError(f"cannot bind {address}")
        self.health_server: grpc.aio.Server | None = None
        self.health_port = 0
        if health_port:
            self.health_server = grpc.aio.server()
            health_pb2_grpc.add_HealthServicer_to_server(self.health, self.health_server)
            self.health_port = self.health_server.add_insecure_port(f"{host}:{health_port}")
            if self.health_port == 0:
                raise OSError(f"cannot bind the health port {host}:{health_port}")

    async def start(self) -> None:
        await self.server.start()
        if self.health_server is not None:
            await self.health_server.start()
        for name in self.service_names:
            await self.health.set(name, health_pb2.HealthCheckResponse.SERVING)

    async def set_not_serving(self) -> None:
        """Health reports NOT_SERVING for every service (and the server as a whole)."""
        for name in self.service_names:
            await self.health.set(name, health_pb2.HealthCheckResponse.NOT_SERVING)

    async def drain(self, grace_s: float) -> None:
        """Report NOT_SERVING, refuse new calls, let in-flight calls finish for `grace_s`."""
        await self.set_not_serving()
        await self.server.stop(grace_s)
        if self.health_server is not None:
            await self.health_server.stop(None)

    async def serve_until_signal(
        self, grace_s: float, on_drain: Callable[[], object] | None = None
    ) -> None:
        """Run until SIGTERM/SIGINT, then drain."""
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        waiter = asyncio.create_task(self.server.wait_for_termination())
        stopper = asyncio.create_task(stop.wait())
        await asyncio.wait({waiter, stopper}, return_when=asyncio.FIRST_COMPLETED)
        if stop.is_set():
            log.info("signal received: draining for up to %.1fs", grace_s)
            if on_drain is not None:
                result = on_drain()
                if asyncio.iscoroutine(result):
                    await result
            await self.drain(grace_s)
        waiter.cancel()
        stopper.cancel()


def start_metrics_server(port: int, host: str = "127.0.0.1") -> None:
    """Serve Prometheus metrics on http://host:port/metrics (port 0 disables)."""
    if port:
        import prometheus_client

        prometheus_client.start_http_server(port, addr=host)
