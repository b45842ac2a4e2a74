"""What both completion endpoints share: sampling params, admission, the worker stream, finish."""

from __future__ import annotations

import asyncio
import contextlib
import re
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from gateway import errors, schemas, sse
from gateway.auth import KEY_INDEX, KEY_PLACES
from gateway.config import GatewayConfig
from gateway.metrics import GatewayMetrics
from gateway.workers import WorkerPool
from maskwire.text import truncate_echo, utf8_len
from maskwire.v1 import common_pb2, worker_pb2

T = TypeVar("T")

MAX_STOP_STRINGS = 4
MAX_LOGIT_BIAS = 300  # OpenAI's limit, and the worker's fixed per-row bias buffer
# SamplingParams' uint32 fields: larger values mean "no limit" here, so they are clamped (the
# worker caps max_tokens to the context room anyway) instead of overflowing the proto.
_UINT32_MAX = 2**32 - 1
_FINISH_OK = (
    worker_pb2.FINISH_REASON_STOP,
    worker_pb2.FINISH_REASON_STOP_STRING,
    worker_pb2.FINISH_REASON_LENGTH,
)


# The response header that reports how a JSON schema is enforced (docs/api.md).
SCHEMA_HEADER = "X-Maskwire-Schema-Enforcement"
_HEADER_LIMIT = 1024
_KEYWORD = re.compile(r"^[A-Za-z$_-]{1,64}$")
# The grammar service's message when no continuation of an output validates.
UNSATISFIED = "constraint could not be satisfied"


def schema_header(report: common_pb2.SchemaReport) -> str:
    """`mode=complete; validated; rewritten=a,b; runtime=c; annotation=d`: the keywords of each
    kind, by name (locations and details are in the Compile RPC's report)."""
    parts = [f"mode={common_pb2.SchemaMode.Name(report.mode).removeprefix('SCHEMA_MODE_').lower()}"]
    if report.validated:
        parts.append("validated")
    for how, label in (
        (common_pb2.ENFORCEMENT_REWRITTEN, "rewritten"),
        (common_pb2.ENFORCEMENT_RUNTIME, "runtime"),
        (common_pb2.ENFORCEMENT_ANNOTATION, "annotation"),
    ):
        names = sorted(
            {
                k.keyword
                for k in report.keywords
                if k.enforcement == how and _KEYWORD.match(k.keyword)
            }
        )
        if names:
            parts.append(f"{label}={','.join(names)}")
    return "; ".join(parts)[:_HEADER_LIMIT]


class ClientDisconnected(Exception):
    """The HTTP client went away; the worker call has been cancelled."""


class Limiter:
    """Admission control: at most `limit` generation requests at once; the rest get 429."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.active = 0

    def acquire(self) -> None:
        if self.active >= self.limit:
            raise errors.overloaded(
                f"the gateway is at its limit of {self.limit} concurrent requests; retry later"
            )
        self.active += 1

    def release(self) -> None:
        self.active -= 1


@dataclass
class Context:
    """Per-app services a request handler needs, and the gateway's configuration."""

    config: GatewayConfig
    pool: WorkerPool
    limiter: Limiter
    metrics: GatewayMetrics


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def check_common(req: schemas._SamplingFields, info: worker_pb2.ModelInfo, max_n: int) -> int:
    """Refuse, with a 400 naming the field, what this server cannot honour; returns `n`."""
    n = req.n or 1
    if n > max_n:
        raise errors.bad_request(
            f"`n` is {n}; this server allows at most {max_n} (the gateway's --max-n)", "n"
        )
    if info.max_batch_size and n > info.max_batch_size:
        raise errors.bad_request(
            f"`n` is {n}; the worker decodes at most {info.max_batch_size} sequences at once",
            "n",
        )
    return n


def logit_bias(bias: dict[str, float] | None, vocab: int) -> dict[int, float]:
    """`logit_bias` as token ids: at most 300 entries, ids in the vocabulary, biases in
    [-100, 100] (OpenAI's limits); 400 naming the field otherwise."""
    if not bias:
        return {}
    if len(bias) > MAX_LOGIT_BIAS:
        raise errors.bad_request(
            f"`logit_bias` has {len(bias)} entries; at most {MAX_LOGIT_BIAS}", "logit_bias"
        )
    out: dict[int, float] = {}
    for key, value in bias.items():
        try:
            token = int(key)
        except ValueError:
            token = -1
        if not 0 <= token < vocab:
            raise errors.bad_request(
                f"`logit_bias` key {truncate_echo(repr(key))} is not a token id in [0, {vocab})",
                "logit_bias",
            )
        if not -100 <= value <= 100:
            raise errors.bad_request(
                f"`logit_bias` value for token {token} must be in [-100, 100]", "logit_bias"
            )
        out[token] = out.get(token, 0.0) + value
    return out


def check_prompt_bytes(prompt: str, limit: int, param: str) -> None:
    """Refuse a prompt over `limit` UTF-8 bytes before a worker spends time tokenizing it."""
    size = utf8_len(prompt)
    if size > limit:
        raise errors.APIError(
            400,
            f"the prompt is {size} bytes; the limit is {limit} (the gateway's --max-prompt-bytes)",
            param=param,
            code="prompt_too_large",
        )


def stop_list(stop: str | list[str] | None) -> list[str]:
    if stop is None:
        return []
    stops = [stop] if isinstance(stop, str) else list(stop)
    if len(stops) > MAX_STOP_STRINGS:
        raise errors.bad_request(f"at most {MAX_STOP_STRINGS} stop strings", "stop")
    if any(s == "" for s in stops):
        raise errors.bad_request("stop strings must not be empty", "stop")
    return stops


def sampling(
    req: schemas._SamplingFields,
    max_tokens: int | None,
    extra_stop: Sequence[str] = (),
    *,
    vocab: int,
    logprobs: tuple[bool, int] = (False, 0),
) -> worker_pb2.SamplingParams:
    """The worker's sampling parameters; `logprobs` is (on, top_logprobs)."""
    params = worker_pb2.SamplingParams(
        temperature=1.0 if req.temperature is None else req.temperature,
        top_p=req.top_p or 0.0,
        top_k=min(req.top_k or 0, _UINT32_MAX),
        max_tokens=min(max_tokens or 0, _UINT32_MAX),
        stop=[*stop_list(req.stop), *extra_stop],
        ignore_eos=bool(req.ignore_eos),
        presence_penalty=req.presence_penalty or 0.0,
        frequency_penalty=req.frequency_penalty or 0.0,
        repetition_penalty=req.repetition_penalty or 0.0,
        logit_bias=logit_bias(req.logit_bias, vocab),
        logprobs=logprobs[0],
        top_logprobs=logprobs[1],
        logprobs_mode=worker_pb2.LOGPROBS_MODE_RAW
        if req.logprobs_mode == "raw"
        else worker_pb2.LOGPROBS_MODE_PROCESSED,
    )
    if req.seed is not None:
        params.seed = req.seed % 2**64
    return params


async def check_model(ctx: Context, model: str) -> worker_pb2.ModelInfo:
    info = await ctx.pool.model_info()
    served = ctx.pool.known_models()
    if model not in served:
        raise errors.model_not_found(model, served)
    return info


async def until_disconnected(request: Request) -> None:
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


async def unless_disconnected(request: Request, work: Awaitable[T]) -> T:
    """Await `work`, cancelling it (and raising ClientDisconnected) if the client goes away."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(until_disconnected(request))
    try:
        done, _ = await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    except asyncio.CancelledError:
        task.cancel()
        raise
    finally:
        watcher.cancel()
    if task in done:
        return task.result()
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError, Exception):
        await task
    raise ClientDisconnected


class WorkerStream:
    """One request's worker output, primed so errors before the first token become HTTP errors."""

    def __init__(
        self,
        ctx: Context,
        endpoint: str,
        gen: AsyncIterator[worker_pb2.GenerateResponse],
    ) -> None:
        self.ctx = ctx
        self.endpoint = endpoint
        self.gen = gen
        self.first: worker_pb2.GenerateResponse | None = None
        self.final: worker_pb2.GenerateResponse | None = None  # the last choice's last message
        self.finals: dict[int, worker_pb2.GenerateResponse] = {}  # by choice index
        self.headers: dict[str, str] = {}
        self.started = time.monotonic()
        self.done = False  # the HTTP response was written to the end (incl. an error event)

    @classmethod
    async def open(
        cls,
        ctx: Context,
        request: Request,
        endpoint: str,
        gen_request: worker_pb2.GenerateRequest,
        constraint_param: str | None,
    ) -> WorkerStream:
        gen = ctx.pool.generate(
            gen_request, timeout_s=ctx.config.request_timeout_s, constraint_param=constraint_param
        )
        self = cls(ctx, endpoint, gen)
        try:
            self.first = await unless_disconnected(request, anext(gen))
        except StopAsyncIteration:
            raise errors.internal("the worker ended the stream without output") from None
        except BaseException:
            await self.aclose()
            raise
        if self.first.HasField("schema_report"):
            self.headers[SCHEMA_HEADER] = schema_header(self.first.schema_report)
        ctx.metrics.first_token.labels(endpoint).observe(time.monotonic() - self.started)
        return self

    async def __aiter__(self) -> AsyncIterator[worker_pb2.GenerateResponse]:
        msgs: list[worker_pb2.GenerateResponse] = [self.first] if self.first is not None else []
        self.first = None
        for msg in msgs:
            yield self._check(msg)
        async for msg in self.gen:
            yield self._check(msg)

    def _check(self, msg: worker_pb2.GenerateResponse) -> worker_pb2.GenerateResponse:
        if msg.finish_reason != worker_pb2.FINISH_REASON_UNSPECIFIED:
            self.final = msg
            self.finals[msg.index] = msg
            if msg.finish_reason not in _FINISH_OK:
                if msg.finish_reason == worker_pb2.FINISH_REASON_ABORT:
                    raise errors.APIError(
                        500,
                        "the request was aborted on the worker",
                        type="server_error",
                        code="aborted",
                    )
                if UNSATISFIED in msg.error:
                    raise errors.APIError(
                        500,
                        f"generation failed: {msg.error}",
                        type="server_error",
                        code="constraint_unsatisfied",
                    )
                raise errors.internal(f"generation failed: {msg.error or 'unknown error'}")
            usage = msg.usage
            if len(self.finals) == 1:  # every choice's usage counts the one prompt
                self.ctx.metrics.tokens.labels("prompt").inc(usage.prompt_tokens)
            self.ctx.metrics.tokens.labels("completion").inc(usage.completion_tokens)
        return msg

    async def aclose(self) -> None:
        aclose = getattr(self.gen, "aclose", None)
        if aclose is not None:
            await aclose()

    def usage(self) -> schemas.Usage:
        """OpenAI's usage: the prompt once, the completion tokens of every choice summed."""
        finals = list(self.finals.values())
        prompt = finals[0].usage.prompt_tokens if finals else 0
        cached = finals[0].usage.cached_prompt_tokens if finals else 0
        completion = sum(f.usage.completion_tokens for f in finals)
        return schemas.Usage(
            prompt_tokens=prompt,
            completion_tokens=completion,
            total_tokens=prompt + completion,
            prompt_tokens_details=schemas.PromptTokensDetails(cached_tokens=cached),
        )


def event_stream(ctx: Context, stream: WorkerStream, body: AsyncIterator[bytes]) -> sse.EventStream:
    """The SSE response for `body`; it owns the admission slot and the worker call."""

    async def cleanup() -> None:
        await stream.aclose()  # cancels the gRPC call if it is still running
        ctx.limiter.release()
        if not stream.done:
            ctx.metrics.cancelled.inc()
        ctx.metrics.latency.labels(stream.endpoint, "true").observe(
            time.monotonic() - stream.started
        )

    return sse.EventStream(body, cleanup, stream.headers)


async def respond(
    ctx: Context,
    request: Request,
    endpoint: str,
    gen_request: worker_pb2.GenerateRequest,
    constraint_param: str | None,
    *,
    stream: Callable[[WorkerStream], AsyncIterator[bytes]] | None,
    collect: Callable[[WorkerStream], Awaitable[dict[str, Any]]],
) -> Response:
    """Admit the request, start it on a worker, and answer with `stream`'s SSE body when given,
    else with the JSON `collect` builds. Errors before the first token are HTTP errors."""
    places = request.scope.get(KEY_PLACES)
    if places is not None:
        places.hold(gen_request.n or 1)  # each choice holds a worker batch slot
    key = request.scope.get(KEY_INDEX)
    if key is not None:
        # One API key's requests never reuse another's cached prompts: whether a prompt was
        # cached shows in response times.
        gen_request.cache_salt = f"key{key}:{gen_request.cache_salt}"
    ctx.limiter.acquire()
    released = False
    try:
        ws = await WorkerStream.open(ctx, request, endpoint, gen_request, constraint_param)
        if stream is not None:
            released = True  # the response's cleanup releases the slot
            return event_stream(ctx, ws, stream(ws))
        return JSONResponse(await unless_disconnected(request, collect(ws)), headers=ws.headers)
    finally:
        if not released:
            ctx.limiter.release()


def finish_reason(msg: worker_pb2.GenerateResponse | None, tool_calls: int = 0) -> Any:
    """OpenAI's finish_reason for the worker's last message."""
    if msg is None or msg.finish_reason == worker_pb2.FINISH_REASON_LENGTH:
        return "length"
    return "tool_calls" if tool_calls else "stop"
