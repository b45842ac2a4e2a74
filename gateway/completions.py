"""POST /v1/completions: a raw prompt (text or token ids), optional constraint, SSE chunks."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from typing import Any

from starlette.requests import Request
from starlette.responses import Response

from gateway import constraints, errors, schemas, sse
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
from gateway.limits import DEFAULT_MAX_JSON_DEPTH, DEFAULT_MAX_PROMPT_BYTES
from maskwire.text import truncate_echo
from maskwire.v1 import worker_pb2

ENDPOINT = "/v1/completions"


def plan_completion(
    req: schemas.CompletionRequest,
    info: worker_pb2.ModelInfo,
    *,
    max_prompt_bytes: int = DEFAULT_MAX_PROMPT_BYTES,
    max_json_depth: int = DEFAULT_MAX_JSON_DEPTH,
) -> tuple[worker_pb2.GenerateRequest, str | None]:
    check_common(req)
    if req.suffix:
        raise errors.unsupported("suffix")
    if req.best_of not in (None, 1):
        raise errors.unsupported("best_of", "only 1")
    gen = worker_pb2.GenerateRequest(
        sampling=sampling(req, req.max_tokens),
        model=req.model,
        disable_speculation=req.speculative is False,
    )
    prompt = req.prompt
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
        if len(prompt) != 1:
            raise errors.unsupported("prompt", "one prompt per request (send a list of one)")
        prompt = prompt[0]
    if isinstance(prompt, str):
        check_prompt_bytes(prompt, max_prompt_bytes, "prompt")
        gen.text = prompt
    else:
        assert isinstance(prompt, list)
        if not prompt:
            raise errors.bad_request("the prompt is empty", "prompt")
        if req.echo:
            raise errors.unsupported("echo", "only with a text prompt")
        gen.token_ids.ids.extend(_token_ids(prompt, info))
    spec = constraints.from_request(req, max_json_depth)
    if spec is not None:
        gen.constraint.CopyFrom(spec.constraint)
        constraints.with_schema_mode(gen.constraint, req.schema_mode)
    return gen, spec.param if spec else None


def _token_ids(prompt: list[Any], info: worker_pb2.ModelInfo) -> list[int]:
    """Token ids checked against the model before they meet the proto's int32 field."""
    if info.max_context and len(prompt) >= info.max_context:
        raise errors.bad_request(
            f"the prompt is {len(prompt)} tokens; the context is {info.max_context}", "prompt"
        )
    vocab = info.vocab_size
    for i, t in enumerate(prompt):
        if not 0 <= t < vocab:
            raise errors.bad_request(
                f"prompt[{i}] is {truncate_echo(str(t))}: token ids must be in [0, {vocab})",
                "prompt",
            )
    return [int(t) for t in prompt]


async def handle(ctx: Context, request: Request, req: schemas.CompletionRequest) -> Response:
    info = await check_model(ctx, req.model)
    gen, param = plan_completion(
        req, info, max_prompt_bytes=ctx.max_prompt_bytes, max_json_depth=ctx.max_json_depth
    )
    rid = new_id("cmpl")
    gen.request_id = rid
    created = int(time.time())
    echo = gen.text if req.echo else ""
    include_usage = bool(req.stream_options and req.stream_options.include_usage)
    return await respond(
        ctx,
        request,
        ENDPOINT,
        gen,
        param,
        stream=(lambda s: _stream(s, rid, created, req.model, echo, include_usage))
        if req.stream
        else None,
        collect=lambda s: _collect(s, rid, created, req.model, echo),
    )


async def _collect(
    stream: WorkerStream, rid: str, created: int, model: str, echo: str
) -> dict[str, Any]:
    parts = [echo]
    try:
        async for msg in stream:
            parts.append(msg.text)
    finally:
        await stream.aclose()
    result = schemas.Completion(
        id=rid,
        created=created,
        model=model,
        choices=[
            schemas.CompletionChoice(
                index=0, text="".join(parts), finish_reason=finish_reason(stream.final)
            )
        ],
        usage=stream.usage(),
    )
    return result.model_dump(mode="json")


async def _stream(
    stream: WorkerStream,
    rid: str,
    created: int,
    model: str,
    echo: str,
    include_usage: bool,
) -> AsyncIterator[bytes]:
    out = sse.Chunks(rid, "text_completion", created, model, include_usage)

    def chunk(text: str, finish: str | None = None) -> bytes:
        return out.choice({"text": text}, finish)

    try:
        if echo:
            yield chunk(echo)
        async for msg in stream:
            if msg.text:
                yield chunk(msg.text)
        yield chunk("", finish_reason(stream.final))
        if include_usage:
            yield out.usage(stream.usage().model_dump())
        yield sse.DONE
        stream.done = True
    except errors.APIError as e:
        stream.done = True
        yield sse.event(e.body())
