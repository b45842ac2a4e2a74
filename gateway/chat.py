"""POST /v1/chat/completions: prompt from the chat template, tools, constraints, SSE chunks."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

from starlette.requests import Request
from starlette.responses import Response

from gateway import constraints, errors, reasoning, schemas, sse, tools
from gateway import logprobs as lp
from gateway.chat_template import ChatTemplate, TemplateError, build_prompt
from gateway.config import GatewayConfig
from gateway.generation import (
    Context,
    WorkerStream,
    check_common,
    check_model,
    check_prompt_bytes,
    finish_reason,
    new_id,
    respond,
    sampling,
)
from gateway.output import Output
from gateway.tool_formats import ToolFormat, by_name, detect
from gateway.tool_parser import ContentDelta, Delta, OutputParser, ReasoningDelta
from gateway.tools import ToolMode
from maskwire.v1 import worker_pb2

ENDPOINT = "/v1/chat/completions"


@dataclass
class ChatPlan:
    generate: worker_pb2.GenerateRequest
    constraint_param: str | None
    parser: Callable[[], OutputParser]
    mode: ToolMode
    reasoning: bool  # the output starts with the model's thinking (`gateway.reasoning`)

    @property
    def n(self) -> int:
        return max(1, self.generate.n)

    def output(self) -> Output:
        return Output(self.parser, self.reasoning)

    def outputs(self) -> list[Output]:
        """One per choice."""
        return [self.output() for _ in range(self.n)]

    def usage(self, stream: WorkerStream, *outputs: Output) -> schemas.Usage:
        usage = stream.usage()
        if self.reasoning:
            usage.completion_tokens_details = schemas.CompletionTokensDetails(
                reasoning_tokens=sum(o.reasoning_tokens for o in outputs)
            )
        return usage


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


def tool_format(template: ChatTemplate, name: str | None) -> ToolFormat:
    """`--tool-call-parser` when given, else what the template's tool prompt asks for."""
    return by_name(name) if name else detect(template.source)


def plan_chat(
    req: schemas.ChatCompletionRequest, info: worker_pb2.ModelInfo, config: GatewayConfig
) -> ChatPlan:
    """Everything decided before the worker is called (400s are raised here)."""
    n = check_common(req, info, config.max_n)
    logprobs = lp.chat_request(req)
    tp = tools.plan(req, config.max_json_depth)
    template = template_for(info, config.chat_template)
    fmt = tool_format(template, config.tool_call_parser)
    spec = constraints.from_request(req, config.max_json_depth)
    out = fmt.output(tp)
    constraint = spec.constraint if spec else None
    param = spec.param if spec else None
    if tp.mode is not ToolMode.NONE:
        if spec is not None:
            raise errors.bad_request(
                f'{spec.param} cannot be combined with tools unless tool_choice is "none"',
                spec.param,
            )
        constraint, param = out.constraint, "tools"
    prompt = build_prompt(template, req, tp, fmt, config.max_json_depth)
    marker = reasoning.end_marker(template.source, prompt)
    if not marker:
        # A call marker would land before the thinking: with reasoning the output starts bare.
        prompt += out.prompt_suffix
    check_prompt_bytes(prompt, config.max_prompt_bytes, "messages")
    max_tokens = req.max_completion_tokens or req.max_tokens
    generate = worker_pb2.GenerateRequest(
        text=prompt,
        sampling=sampling(req, max_tokens, out.stop, vocab=info.vocab_size, logprobs=logprobs),
        model=req.model,
        reasoning_end_marker=marker,
        n=n if n > 1 else 0,
        disable_speculation=req.speculative is False,
        cache_salt=req.cache_salt or "",
    )
    if constraint is not None:
        generate.constraint.CopyFrom(constraint)
        constraints.with_schema_mode(generate.constraint, req.schema_mode)
    return ChatPlan(generate, param, out.parser, tp.mode, bool(marker))


async def handle(ctx: Context, request: Request, req: schemas.ChatCompletionRequest) -> Response:
    info = await check_model(ctx, req.model)
    plan = plan_chat(req, info, ctx.config)
    rid = new_id("chatcmpl")
    plan.generate.request_id = rid
    created = int(time.time())
    include_usage = bool(req.stream_options and req.stream_options.include_usage)
    return await respond(
        ctx,
        request,
        ENDPOINT,
        plan.generate,
        plan.constraint_param,
        stream=(lambda s: _stream(s, plan, rid, created, req.model, include_usage))
        if req.stream
        else None,
        collect=lambda s: _collect(s, plan, rid, created, req.model),
    )


async def _collect(
    stream: WorkerStream, plan: ChatPlan, rid: str, created: int, model: str
) -> dict[str, Any]:
    outputs = plan.outputs()
    entries: list[list[worker_pb2.TokenLogprob]] = [[] for _ in outputs]
    try:
        async for msg in stream:
            outputs[msg.index].feed(msg)
            entries[msg.index].extend(msg.logprobs)
    finally:
        await stream.aclose()
    result = schemas.ChatCompletion(
        id=rid,
        created=created,
        model=model,
        choices=[_choice(stream, plan, i, output, entries[i]) for i, output in enumerate(outputs)],
        usage=plan.usage(stream, *outputs),
    )
    return result.model_dump(mode="json")


def _choice(
    stream: WorkerStream,
    plan: ChatPlan,
    index: int,
    output: Output,
    entries: list[worker_pb2.TokenLogprob],
) -> schemas.ChatCompletionChoice:
    output.finish()
    merged = output.merged
    calls = [
        schemas.ToolCall(id=c.id, function=schemas.FunctionCall(name=c.name, arguments=c.arguments))
        for c in merged.calls
    ]
    content: str | None = merged.content
    if calls and not (content or "").strip():
        content = None
    if calls:
        stream.ctx.metrics.tool_calls.labels(plan.mode.value).inc(len(calls))
    message = schemas.ChatCompletionMessage(content=content, tool_calls=calls or None)
    if plan.reasoning:
        message.reasoning_content = merged.reasoning
    return schemas.ChatCompletionChoice(
        index=index,
        message=message,
        finish_reason=finish_reason(stream.finals.get(index), len(calls)),
        logprobs=schemas.ChoiceLogprobs.model_validate(lp.chat_logprobs(entries))
        if plan.generate.sampling.logprobs
        else None,
    )


def _delta_chunk(d: Delta) -> dict[str, Any]:
    if isinstance(d, ContentDelta):
        return {"content": d.text}
    if isinstance(d, ReasoningDelta):
        return {"reasoning_content": d.text}
    call: dict[str, Any] = {"index": d.index}
    fn: dict[str, Any] = {"arguments": d.arguments}
    if d.id is not None:
        call["id"] = d.id
        call["type"] = "function"
        fn = {"name": d.name, "arguments": d.arguments}
    call["function"] = fn
    return {"tool_calls": [call]}


async def _stream(
    stream: WorkerStream,
    plan: ChatPlan,
    rid: str,
    created: int,
    model: str,
    include_usage: bool,
) -> AsyncIterator[bytes]:
    out = sse.Chunks(rid, "chat.completion.chunk", created, model, include_usage)

    def chunk(
        index: int,
        delta: dict[str, Any],
        finish: str | None = None,
        logprobs: dict[str, Any] | None = None,
    ) -> bytes:
        return out.choice({"delta": delta}, finish, logprobs, index)

    outputs = plan.outputs()
    try:
        for i in range(len(outputs)):
            yield chunk(i, {"role": "assistant", "content": ""})
        async for msg in stream:
            i = msg.index
            # A message's logprobs ride on its first chunk (an empty delta if it adds none).
            logprobs = lp.chat_logprobs(msg.logprobs) if msg.logprobs else None
            for d in outputs[i].feed(msg):
                yield chunk(i, _delta_chunk(d), logprobs=logprobs)
                logprobs = None
            if logprobs is not None:
                yield chunk(i, {}, logprobs=logprobs)
            if msg.finish_reason != worker_pb2.FINISH_REASON_UNSPECIFIED:
                yield chunk(i, {}, finish_reason(msg, outputs[i].calls))
        for i, output in enumerate(outputs):
            if i not in stream.finals:  # the stream ended early: flush what was held back
                for d in output.finish():
                    yield chunk(i, _delta_chunk(d))
                yield chunk(i, {}, finish_reason(None, output.calls))
        if include_usage:
            yield out.usage(plan.usage(stream, *outputs).model_dump())
        yield sse.DONE
        stream.done = True
        calls = sum(o.calls for o in outputs)
        if calls:
            stream.ctx.metrics.tool_calls.labels(plan.mode.value).inc(calls)
    except errors.APIError as e:
        stream.done = True
        yield sse.event(e.body())
