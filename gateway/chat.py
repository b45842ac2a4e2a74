"""POST /v1/chat/completions: prompt from the chat template, tools, constraints, SSE chunks."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from gateway import constraints, errors, schemas, sse, tools
from gateway.chat_template import ChatTemplate, TemplateError, build_prompt
from gateway.generation import (
    Context,
    WorkerStream,
    check_common,
    check_model,
    check_prompt_bytes,
    event_stream,
    finish_reason,
    new_id,
    sampling,
    unless_disconnected,
)
from gateway.limits import DEFAULT_MAX_JSON_DEPTH, DEFAULT_MAX_PROMPT_BYTES
from gateway.tool_parser import (
    CallDelta,
    ContentDelta,
    Delta,
    HermesToolParser,
    JsonArrayCallParser,
    Merged,
    NamedCallParser,
    OutputParser,
    PlainText,
)
from gateway.tools import ToolMode
from maskwire.v1 import worker_pb2

ENDPOINT = "/v1/chat/completions"


@dataclass
class ChatPlan:
    generate: worker_pb2.GenerateRequest
    constraint_param: str | None
    parser: Callable[[], OutputParser]
    mode: ToolMode


def template_for(info: worker_pb2.ModelInfo, override: str | None) -> ChatTemplate:
    source = override or info.chat_template
    if not source:
        raise errors.bad_request(
            f"model {info.model!r} has no chat template; start the gateway with --chat-template "
            "or use /v1/completions",
            "messages",
        )
    try:
        return ChatTemplate(source, bos_token=info.bos_token, eos_token=info.eos_token)
    except TemplateError as e:
        raise errors.internal(str(e)) from e


def plan_chat(
    req: schemas.ChatCompletionRequest,
    info: worker_pb2.ModelInfo,
    template_override: str | None,
    *,
    max_prompt_bytes: int = DEFAULT_MAX_PROMPT_BYTES,
    max_json_depth: int = DEFAULT_MAX_JSON_DEPTH,
) -> ChatPlan:
    """Everything decided before the worker is called (400s are raised here)."""
    check_common(req)
    if req.top_logprobs is not None:
        raise errors.unsupported("top_logprobs")
    tp = tools.plan(req)
    spec = constraints.from_request(req, max_json_depth)
    extra_stop: list[str] = []
    parser: Callable[[], OutputParser] = PlainText
    constraint = spec.constraint if spec else None
    param = spec.param if spec else None
    if tp.mode is not ToolMode.NONE:
        if spec is not None:
            raise errors.bad_request(
                f'{spec.param} cannot be combined with tools unless tool_choice is "none"',
                spec.param,
            )
        constraint = tools.constraint(tp)
        param = "tools"
        if tp.mode is ToolMode.AUTO:
            parser = HermesToolParser
            if not tp.parallel:
                # One call at most: stop right after the first call's closing tag.
                extra_stop.append(tools.TOOL_CALL_CLOSE)
        elif tp.mode is ToolMode.REQUIRED:
            parser = JsonArrayCallParser
        else:
            name = tp.named or ""
            parser = lambda: NamedCallParser(name)  # noqa: E731
    prompt = build_prompt(template_for(info, template_override), req, tp, max_json_depth)
    check_prompt_bytes(prompt, max_prompt_bytes, "messages")
    max_tokens = req.max_completion_tokens or req.max_tokens
    generate = worker_pb2.GenerateRequest(
        text=prompt, sampling=sampling(req, max_tokens, extra_stop), model=req.model
    )
    if constraint is not None:
        generate.constraint.CopyFrom(constraint)
        constraints.with_schema_mode(generate.constraint, req.schema_mode)
    return ChatPlan(generate, param, parser, tp.mode)


async def handle(
    ctx: Context, request: Request, req: schemas.ChatCompletionRequest, template: str | None
) -> Response:
    info = await check_model(ctx, req.model)
    plan = plan_chat(
        req,
        info,
        template,
        max_prompt_bytes=ctx.max_prompt_bytes,
        max_json_depth=ctx.max_json_depth,
    )
    rid = new_id("chatcmpl")
    plan.generate.request_id = rid
    created = int(time.time())
    ctx.limiter.acquire()
    released = False
    try:
        stream = await WorkerStream.open(
            ctx, request, ENDPOINT, plan.generate, plan.constraint_param
        )
        if req.stream:
            include_usage = bool(req.stream_options and req.stream_options.include_usage)
            released = True  # the response's cleanup releases the slot
            return event_stream(
                ctx, stream, _stream(ctx, stream, plan, rid, created, req.model, include_usage)
            )
        body = await unless_disconnected(request, _collect(stream, plan, rid, created, req.model))
        return JSONResponse(body, headers=stream.headers)
    finally:
        if not released:
            ctx.limiter.release()


async def _collect(
    stream: WorkerStream, plan: ChatPlan, rid: str, created: int, model: str
) -> dict[str, Any]:
    parser = plan.parser()
    merged = Merged()
    try:
        async for msg in stream:
            merged.add(parser.feed(msg.text))
    finally:
        await stream.aclose()
    merged.add(parser.finish())
    calls = [
        schemas.ToolCall(id=c.id, function=schemas.FunctionCall(name=c.name, arguments=c.arguments))
        for c in merged.calls
    ]
    content: str | None = merged.content
    if calls and not (content or "").strip():
        content = None
    if calls:
        stream.ctx.metrics.tool_calls.labels(plan.mode.value).inc(len(calls))
    result = schemas.ChatCompletion(
        id=rid,
        created=created,
        model=model,
        choices=[
            schemas.ChatCompletionChoice(
                index=0,
                message=schemas.ChatCompletionMessage(content=content, tool_calls=calls or None),
                finish_reason=finish_reason(stream.final, len(calls)),
            )
        ],
        usage=stream.usage(),
    )
    return result.model_dump(mode="json")


def _delta_chunk(d: Delta) -> dict[str, Any]:
    if isinstance(d, ContentDelta):
        return {"content": d.text}
    assert isinstance(d, CallDelta)
    call: dict[str, Any] = {"index": d.index}
    fn: dict[str, Any] = {"arguments": d.arguments}
    if d.id is not None:
        call["id"] = d.id
        call["type"] = "function"
        fn = {"name": d.name, "arguments": d.arguments}
    call["function"] = fn
    return {"tool_calls": [call]}


async def _stream(
    ctx: Context,
    stream: WorkerStream,
    plan: ChatPlan,
    rid: str,
    created: int,
    model: str,
    include_usage: bool,
) -> AsyncIterator[bytes]:
    out = sse.Chunks(rid, "chat.completion.chunk", created, model, include_usage)

    def chunk(delta: dict[str, Any], finish: str | None = None) -> bytes:
        return out.choice({"delta": delta}, finish)

    parser = plan.parser()
    calls = 0
    try:
        yield chunk({"role": "assistant", "content": ""})
        async for msg in stream:
            deltas = parser.feed(msg.text)
            if stream.final is not None:
                deltas += parser.finish()
            for d in deltas:
                if isinstance(d, CallDelta) and d.id is not None:
                    calls += 1
                yield chunk(_delta_chunk(d))
        yield chunk({}, finish_reason(stream.final, calls))
        if include_usage:
            yield out.usage(stream.usage().model_dump())
        yield sse.DONE
        stream.done = True
        if calls:
            ctx.metrics.tool_calls.labels(plan.mode.value).inc(calls)
    except errors.APIError as e:
        stream.done = True
        yield sse.event(e.body())
