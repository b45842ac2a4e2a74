"""The FastAPI application: routes, OpenAI-shaped errors, body limit, metrics, worker pool."""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import AsyncIterator
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.responses import JSONResponse, Response
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from gateway import chat, completions, errors, responses, schemas
from gateway import response_schemas as rs
from gateway.auth import ApiKeys
from gateway.config import GatewayConfig
from gateway.generation import ClientDisconnected, Context, Limiter
from gateway.input_check import checked_route
from gateway.metrics import GatewayMetrics
from gateway.workers import WorkerPool
from maskwire.heap import freeze_startup_heap
from maskwire.logs import debug_payloads
from maskwire.text import truncate_echo

log = logging.getLogger(__name__)

STATUS_CLIENT_CLOSED = 499


_ERROR_RESPONSES: dict[int | str, dict[str, Any]] = {
    code: {"model": schemas.ErrorResponse, "description": text}
    for code, text in {
        400: "Invalid request (bad schema, unsupported parameter)",
        401: "Invalid or missing API key (when the gateway has keys)",
        404: "Unknown model",
        413: "Request body too large",
        422: "Malformed body",
        429: "Overloaded",
        503: "No worker available",
        504: "Deadline exceeded",
    }.items()
}

_STREAM_DOC = {
    "description": "The completion; with `stream: true`, server-sent events (`data: {chunk}` "
    "lines ending with `data: [DONE]`)",
    "content": {"text/event-stream": {"schema": {"type": "string"}}},
}


_RESPONSES_STREAM_DOC = {
    "description": "The response; with `stream: true`, server-sent events (`event: TYPE` and "
    "`data: {event}` lines, from `response.created` to `response.completed`)",
    "content": {"text/event-stream": {"schema": {"type": "string"}}},
}


def _error_response(err: errors.APIError) -> JSONResponse:
    return JSONResponse(err.body(), status_code=err.status)


_VALIDATION_ERRORS_SHOWN = 10


def _validation_message(exc: RequestValidationError) -> tuple[str, str | None]:
    """One line per pydantic error, each bounded: locations can hold the client's object keys
    and messages can quote its values (e.g. an unknown union tag)."""
    parts = []
    first: str | None = None
    found = exc.errors()
    for e in found[:_VALIDATION_ERRORS_SHOWN]:
        loc = [str(x) for x in e.get("loc", ()) if x != "body"]
        where = truncate_echo(".".join(loc))
        if first is None and where:
            first = where
        msg = truncate_echo(str(e.get("msg")), 512)
        parts.append(f"{where}: {msg}" if where else msg)
    if len(found) > _VALIDATION_ERRORS_SHOWN:
        parts.append(f"and {len(found) - _VALIDATION_ERRORS_SHOWN} more errors")
    return "; ".join(parts) or "invalid request body", first


class BodyLimit:
    """Refuse request bodies over `max_bytes` with 413 (by Content-Length, or while reading)."""

    def __init__(self, app: ASGIApp, max_bytes: int) -> None:
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        too_big = errors.APIError(
            413, f"the request body exceeds {self.max_bytes} bytes", code="request_too_large"
        )
        for name, value in scope.get("headers", ()):
            if name == b"content-length" and value.isdigit() and int(value) > self.max_bytes:
                await _error_response(too_big)(scope, receive, send)
                return
        seen = 0
        exceeded = started = False

        async def limited() -> Message:
            nonlocal seen, exceeded
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > self.max_bytes:
                    exceeded = True
                    raise _BodyTooLarge
            return message

        async def guarded(message: Message) -> None:
            nonlocal started
            if exceeded:  # FastAPI answers a failed body read with its own 400: drop it
                return
            started = started or message["type"] == "http.response.start"
            await send(message)

        with contextlib.suppress(_BodyTooLarge):
            await self.app(scope, limited, guarded)
        if exceeded and not started:
            await _error_response(too_big)(scope, receive, send)


class _BodyTooLarge(Exception):
    pass


class RequestMetrics:
    """Count responses by route template and status (pure ASGI: streaming stays streaming)."""

    def __init__(self, app: ASGIApp, metrics: GatewayMetrics) -> None:
        self.app = app
        self.metrics = metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        status = 500

        async def send_status(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, send_status)
        finally:
            route = scope.get("route")
            path = getattr(route, "path", "other")
            self.metrics.requests.labels(path, str(status)).inc()


def create_app(config: GatewayConfig, pool: WorkerPool | None = None) -> FastAPI:
    """The gateway app; it owns (starts and closes) `pool` unless one is passed in."""
    metrics = GatewayMetrics()
    own_pool = pool is None
    the_pool = pool or WorkerPool(config, on_health=metrics.set_worker_health)
    ctx = Context(
        config=config,
        pool=the_pool,
        limiter=Limiter(config.max_concurrency),
        metrics=metrics,
    )
    # Streams outlive their handler: count admitted requests, not running handlers.
    metrics.in_flight.set_function(lambda: ctx.limiter.active)

    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        if own_pool:
            await the_pool.start()
        freeze_startup_heap("gateway")
        try:
            yield
        finally:
            if own_pool:
                await the_pool.close()

    app = FastAPI(
        title="maskwire gateway",
        version="0.1.0",
        summary="OpenAI-compatible REST API with grammar-constrained decoding.",
        lifespan=lifespan,
    )
    app.state.ctx = ctx
    # Every route checks its JSON body's nesting and text before FastAPI validates it.
    app.router.route_class = checked_route(config.max_json_depth)
    _add_error_handlers(app, metrics)
    _add_generation_routes(app, ctx)
    _add_model_routes(app, the_pool, started=int(time.time()))
    _add_operation_routes(app, the_pool, metrics)
    _add_middleware(app, config, metrics)
    return app


def _add_error_handlers(app: FastAPI, metrics: GatewayMetrics) -> None:
    """Every failure answered as an OpenAI-shaped error body (or 499 for a client gone)."""

    @app.exception_handler(errors.APIError)
    async def _api_error(_: Request, exc: errors.APIError) -> JSONResponse:
        if exc.status >= 500:
            # Worker messages can echo request content: the text only with debug logging.
            detail = exc.message if debug_payloads() else f"code {exc.code}"
            log.warning("request failed: %s %s", exc.status, detail)
        return _error_response(exc)

    @app.exception_handler(RequestValidationError)
    async def _validation(_: Request, exc: RequestValidationError) -> JSONResponse:
        message, param = _validation_message(exc)
        return _error_response(errors.APIError(422, message, param=param, code="invalid_body"))

    @app.exception_handler(StarletteHTTPException)
    async def _http(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        return _error_response(errors.APIError(exc.status_code, str(exc.detail), code=None))

    # Safety nets for what the input checks do not catch: both mean the request carried it (text
    # with a lone surrogate reached an encoder; a value nested deep enough to exhaust recursion).
    @app.exception_handler(UnicodeEncodeError)
    async def _unencodable(_: Request, exc: UnicodeEncodeError) -> JSONResponse:
        return _error_response(
            errors.bad_request(
                "the request holds text that is not valid Unicode (a lone UTF-16 surrogate, "
                "e.g. a `\\ud800` escape that is not half of a pair)",
                code="invalid_unicode",
            )
        )

    @app.exception_handler(RecursionError)
    async def _too_deep(_: Request, exc: RecursionError) -> JSONResponse:
        return _error_response(
            errors.bad_request("the request is nested too deeply", code="nesting_too_deep")
        )

    @app.exception_handler(ClientDisconnected)
    async def _gone(_: Request, exc: ClientDisconnected) -> Response:
        metrics.cancelled.inc()
        return Response(status_code=STATUS_CLIENT_CLOSED)


def _add_generation_routes(app: FastAPI, ctx: Context) -> None:
    """POST /v1/chat/completions, /v1/completions and /v1/responses; the latency of a
    non-streamed answer is observed here (a stream's by its own generator)."""
    latency = ctx.metrics.latency

    @app.post(
        "/v1/chat/completions",
        response_model=schemas.ChatCompletion,
        responses={200: _STREAM_DOC, **_ERROR_RESPONSES},
        tags=["openai"],
        summary="Create a chat completion",
    )
    async def create_chat_completion(
        body: schemas.ChatCompletionRequest, request: Request
    ) -> Response:
        t0 = time.monotonic()
        try:
            return await chat.handle(ctx, request, body)
        finally:
            if not body.stream:
                latency.labels(chat.ENDPOINT, "false").observe(time.monotonic() - t0)

    @app.post(
        "/v1/completions",
        response_model=schemas.Completion,
        responses={200: _STREAM_DOC, **_ERROR_RESPONSES},
        tags=["openai"],
        summary="Create a text completion",
    )
    async def create_completion(body: schemas.CompletionRequest, request: Request) -> Response:
        t0 = time.monotonic()
        try:
            return await completions.handle(ctx, request, body)
        finally:
            if not body.stream:
                latency.labels(completions.ENDPOINT, "false").observe(time.monotonic() - t0)

    @app.post(
        "/v1/responses",
        response_model=rs.ResponseObject,
        responses={200: _RESPONSES_STREAM_DOC, **_ERROR_RESPONSES},
        tags=["openai"],
        summary="Create a model response (Responses API)",
    )
    async def create_response(body: rs.ResponseCreateRequest, request: Request) -> Response:
        t0 = time.monotonic()
        try:
            return await responses.handle(ctx, request, body)
        finally:
            if not body.stream:
                latency.labels(responses.ENDPOINT, "false").observe(time.monotonic() - t0)


def _add_model_routes(app: FastAPI, pool: WorkerPool, *, started: int) -> None:
    """GET /v1/models and /v1/models/{model}: the models the workers serve (`started`: their
    `created` time, the gateway's start)."""

    async def _cards() -> list[schemas.ModelCard]:
        info = await pool.model_info()
        return [
            schemas.ModelCard(id=m, created=started, max_model_len=info.max_context or None)
            for m in pool.known_models()
        ]

    @app.get(
        "/v1/models",
        response_model=schemas.ModelList,
        responses={503: _ERROR_RESPONSES[503]},
        tags=["openai"],
        summary="List the served models",
    )
    async def list_models() -> schemas.ModelList:
        return schemas.ModelList(data=await _cards())

    @app.get(
        "/v1/models/{model}",
        response_model=schemas.ModelCard,
        responses={404: _ERROR_RESPONSES[404], 503: _ERROR_RESPONSES[503]},
        tags=["openai"],
        summary="Describe one model",
    )
    async def get_model(model: str) -> schemas.ModelCard:
        for card in await _cards():
            if card.id == model:
                return card
        raise errors.model_not_found(model, pool.known_models())


def _add_operation_routes(app: FastAPI, pool: WorkerPool, metrics: GatewayMetrics) -> None:
    """GET /health (liveness), /ready (readiness) and /metrics (Prometheus)."""

    @app.get("/health", response_model=schemas.Health, tags=["operations"])
    async def health() -> schemas.Health:
        """Liveness: 200 while the gateway runs; says which workers pass their health checks."""
        workers = [
            schemas.WorkerHealth(
                address=ep.address,
                healthy=ep.healthy,
                in_flight=ep.in_flight,
                model=ep.info.model if ep.info is not None else None,
            )
            for ep in pool.endpoints
        ]
        ok = any(w.healthy for w in workers)
        return schemas.Health(status="ok" if ok else "degraded", workers=workers)

    @app.get(
        "/ready",
        response_model=schemas.Health,
        responses={503: {"model": schemas.Health}},
        tags=["operations"],
    )
    async def ready() -> Response:
        """Readiness: 200 when at least one worker is healthy, else 503."""
        h = await health()
        return JSONResponse(h.model_dump(), status_code=200 if h.status == "ok" else 503)

    @app.get(
        "/metrics",
        tags=["operations"],
        response_class=Response,
        responses={200: {"content": {"text/plain": {}}, "description": "Prometheus metrics"}},
    )
    async def prometheus() -> Response:
        """Prometheus text format."""
        return Response(metrics.render(), media_type=metrics.content_type)


def _add_middleware(app: FastAPI, config: GatewayConfig, metrics: GatewayMetrics) -> None:
    """Request counting, the body limit and, outermost, the API keys."""
    app.add_middleware(RequestMetrics, metrics=metrics)
    app.add_middleware(BodyLimit, max_bytes=config.max_body_bytes)
    # Outermost: an unauthenticated request is refused before its body is read.
    app.add_middleware(
        ApiKeys,
        keys=config.api_keys,
        max_concurrency_per_key=config.max_concurrency_per_key,
        on_reject=lambda reason: metrics.rejected.labels(reason).inc(),
    )
