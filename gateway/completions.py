"""POST /v1/completions: a raw prompt (text or token ids), optional constraint, SSE chunks."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from typing import Any

from starlette.requests import Request
from starlette.responses import Response

from gateway import constraints, errors, schemas, sse
from gateway import logprobs as lp
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
from maskwire.text import truncate_echo
from maskwire.v1 import worker_pb2

ENDPOINT = "/v1/completions"


def plan_completion(
    req: schemas.CompletionRequest,
    info: worker_pb2.ModelInfo,
    config: GatewayConfig,
) -> tuple[worker_pb2.GenerateRequest, str | None]:
    n = check_common(req, info, config.max_n)
    if req.suffix:
        raise errors.unsupported("suffix")
    if req.best_of not in (None, 1):
        raise errors.unsupported("best_of", "only 1")
    params = sampling(
        req, req.max_tokens, vocab=info.vocab_size, logprobs=lp.completion_request(req)
    )
    if params.logprobs and req.echo:
        raise errors.unsupported(
            "echo", "together with logprobs (prompt logprobs are not computed)"
        )
    gen = worker_pb2.GenerateRequest(
        sampling=params,
        model=req.model,
        n=n if n > 1 else 0,
        disable_speculation=req.speculative is False,
        cache_salt=req.cache_salt or "",
    )
    prompt = req.prompt
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
        if len(prompt) != 1:
            raise errors.unsupported("prompt", "one prompt per request (send a list of one)")
        prompt = prompt[0]
    if isinstance(prompt, str):
        check_prompt_bytes(prompt, config.max_prompt_bytes, "prompt")
        gen.text = prompt
    else:
        assert isinstance(prompt, list)
        if not prompt:
            raise errors.bad_request("the prompt is empty", "prompt")
        if req.echo:
            raise errors.unsupported("echo", "only with a text prompt")
        gen.token_ids.ids.extend(_token_ids(prompt, info))
    spec = constraints.from_request(req, config.max_json_depth)
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
    gen, param = plan_completion(req, info, ctx.config)
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
        stream=(lambda s: _stream(s, gen, rid, created, req.model, echo, include_usage))
        if req.stream
        else None,
        collect=lambda s: _collect(s, gen, rid, created, req.model, echo),
    )


class _Choice:
    """One choice's text and logprobs as its messages arrive."""

    def __init__(self, echo: str) -> None:
        self.parts = [echo]
        self.offsets = lp.CompletionLogprobs(len(echo))
        self.logprobs: list[dict[str, Any]] = []

    def add(self, msg: worker_pb2.GenerateResponse, logprobs: bool) -> dict[str, Any] | None:
        """The message's logprobs part (None without logprobs)."""
        self.parts.append(msg.text)
        if not logprobs:
            return None
        part = self.offsets.add(msg.logprobs)
        self.logprobs.append(part)
        return part


def _n(gen: worker_pb2.GenerateRequest) -> int:
    return max(1, gen.n)


async def _collect(
    stream: WorkerStream,
    gen: worker_pb2.GenerateRequest,
    rid: str,
    created: int,
    model: str,
    echo: str,
) -> dict[str, Any]:
    logprobs = gen.sampling.logprobs
    choices = [_Choice(echo) for _ in range(_n(gen))]
    try:
        async for msg in stream:
            choices[msg.index].add(msg, logprobs)
    finally:
        await stream.aclose()
    result = schemas.Completion(
        id=rid,
        created=created,
        model=model,
        choices=[
            schemas.CompletionChoice(
                index=i,
                text="".join(c.parts),
                finish_reason=finish_reason(stream.finals.get(i)),
                logprobs=schemas.CompletionLogprobs.model_validate(
                    lp.CompletionLogprobs.merge(c.logprobs)
                )
                if logprobs
                else None,
            )
            for i, c in enumerate(choices)
        ],
        usage=stream.usage(),
    )
    return result.model_dump(mode="json")


async def _stream(
    stream: WorkerStream,
    gen: worker_pb2.GenerateRequest,
    rid: str,
    created: int,
    model: str,
    echo: str,
    include_usage: bool,
) -> AsyncIterator[bytes]:
    out = sse.Chunks(rid, "text_completion", created, model, include_usage)
    logprobs = gen.sampling.logprobs
    choices = [_Choice(echo) for _ in range(_n(gen))]

    def chunk(
        index: int, text: str, finish: str | None = None, logprobs: dict[str, Any] | None = None
    ) -> bytes:
        return out.choice({"text": text}, finish, logprobs, index)

    try:
        if echo:
            for i in range(len(choices)):
                yield chunk(i, echo)
        async for msg in stream:
            i = msg.index
            part = choices[i].add(msg, logprobs)
            if msg.text or (part is not None and msg.logprobs):
                yield chunk(i, msg.text, logprobs=part)
            if msg.finish_reason != worker_pb2.FINISH_REASON_UNSPECIFIED:
                yield chunk(i, "", finish_reason(msg))
        for i in range(len(choices)):
            if i not in stream.finals:
                yield chunk(i, "", finish_reason(None))
        if include_usage:
            yield out.usage(stream.usage().model_dump())
        yield sse.DONE
        stream.done = True
    except errors.APIError as e:
        stream.done = True
        yield sse.event(e.body())
