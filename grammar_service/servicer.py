"""gRPC `maskwire.v1.GrammarService`: unary `Compile` and the bidirectional `Session` stream."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator

import grpc

from grammar_service import metrics
from grammar_service.runtime import Runtime
from grammar_service.session import Session
from maskwire.rpc import ACCEPTED_METADATA, RpcError
from maskwire.v1 import grammar_pb2, grammar_pb2_grpc

log = logging.getLogger(__name__)

_DRAINING = RpcError(
    grpc.StatusCode.UNAVAILABLE,
    "grammar service is draining: re-open the requests elsewhere with replay_tokens",
    reason="DRAINING",
)
_INTERNAL = RpcError(
    grpc.StatusCode.INTERNAL, "grammar service internal error", reason="INTERNAL_ERROR"
)


class _Stream:
    """Bookkeeping for one live Session call (for drain)."""

    __slots__ = ("busy", "task")

    def __init__(self, task: asyncio.Task[object] | None) -> None:
        self.task = task
        self.busy = False


class GrammarServicer(grammar_pb2_grpc.GrammarServiceServicer):
    def __init__(self, runtime: Runtime) -> None:
        self.runtime = runtime
        self.draining = False
        self._streams: set[_Stream] = set()

    async def Compile(
        self, request: grammar_pb2.CompileRequest, context: grpc.aio.ServicerContext
    ) -> grammar_pb2.CompileResponse:
        await context.send_initial_metadata(ACCEPTED_METADATA)
        try:
            tok = self.runtime.tokenizer_for(request.tokenizer, field="tokenizer", required=False)
            if not request.HasField("constraint"):
                raise RpcError(
                    grpc.StatusCode.INVALID_ARGUMENT,
                    "constraint is required",
                    [("constraint", "set exactly one kind")],
                )
            item, cached = await self.runtime.compile(request.constraint, tok, _client(context))
        except RpcError as e:
            await e.abort(context)
            raise AssertionError("unreachable") from None
        return grammar_pb2.CompileResponse(
            grammar_id=item.grammar_id,
            warnings=item.warnings,
            cached=cached,
            compile_ms=0.0 if cached else item.compile_ms,
            schema_report=item.report,
        )

    async def Session(
        self,
        request_iterator: AsyncIterator[grammar_pb2.SessionRequest],
        context: grpc.aio.ServicerContext,
    ) -> None:
        await context.send_initial_metadata(ACCEPTED_METADATA)
        session = Session(self.runtime, _client(context))
        stream = _Stream(asyncio.current_task())
        self._streams.add(stream)
        metrics.LIVE_SESSIONS.inc()
        try:
            async for msg in request_iterator:
                stream.busy = True
                try:
                    resp = await session.handle(msg)
                except RpcError as e:
                    await e.abort(context)
                    return
                except Exception:
                    # A bug, not bad input: log it here, end this stream (its requests' state is
                    # unknown now), never send a stack trace.
                    log.exception("session failed")
                    await _INTERNAL.abort(context)
                    return
                await context.write(resp)
                stream.busy = False
                if self.draining:
                    await _DRAINING.abort(context)
                    return
        except asyncio.CancelledError:
            if not self.draining:
                raise
            # `drain` cancelled this idle stream: tell the client, which would otherwise wait for
            # answers until the grace period ends, so it re-opens its requests elsewhere now.
            await _DRAINING.abort(context)
        finally:
            freed = session.close_all()
            self._streams.discard(stream)
            metrics.LIVE_SESSIONS.dec()
            if freed:
                log.debug("stream ended: freed %d requests", freed)

    def drain(self) -> None:
        """Stop taking messages: idle streams end now, busy ones after their current answer."""
        self.draining = True
        for s in list(self._streams):
            if not s.busy and s.task is not None:
                s.task.cancel()


def _client(context: grpc.aio.ServicerContext) -> str:
    """Who is calling, for fair shares of compile capacity: the connection (peer address)."""
    return str(context.peer() or "")
