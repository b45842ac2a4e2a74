"""POST /v1/responses: OpenAI's Responses API on top of the chat path.

A request becomes a chat request (input items -> messages, `instructions` -> a system message
first, `text.format` -> `response_format`, flat function tools -> chat tools) and is planned by
`gateway.chat`, so prompts, constraints, tool formats and reasoning are the same. The output is
read by the same `Output` and turned into Responses output items (reasoning, message,
function_call) by `OutputItems`, which also writes the stream's events; the non-streamed response
is built by the same code, so both carry the same items.

Errors name the Responses field (`input[2].content[0]`, `text.format.schema`), not the chat field
the request was translated to.
"""

from __future__ import annotations

import re
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import pydantic
from starlette.requests import Request
from starlette.responses import Response

from gateway import errors, schemas, sse
from gateway import response_schemas as rs
from gateway.chat import ChatPlan, plan_chat
from gateway.generation import Context, WorkerStream, check_model, new_id, respond
from gateway.output import Output
from gateway.tool_parser import CallDelta, ContentDelta, Delta, ReasoningDelta
from maskwire.v1 import worker_pb2

ENDPOINT = "/v1/responses"

# ---------------------------------------------------------------------------------------------
# Request -> chat request


@dataclass
class _Params:
    """Where each chat message (and each of its tool calls) came from in the Responses request."""

    messages: list[str] = field(default_factory=list)
    calls: dict[int, list[str]] = field(default_factory=dict)

    def translate(self, param: str | None) -> str | None:
        """The Responses field for a chat request's field."""
        if param is None:
            return None
        m = re.fullmatch(r"messages\[(\d+)\](?:\.tool_calls\[(\d+)\](?:\.function)?)?(.*)", param)
        if m is not None:
            j, k, rest = int(m[1]), m[2], m[3]
            if j >= len(self.messages):
                return "input"
            if k is not None:
                return self.calls[j][int(k)] + rest
            return self.messages[j] + rest.replace(".tool_call_id", ".call_id")
        m = re.fullmatch(r"(tools\[\d+\])\.function(\..*)", param)
        if m is not None:  # Responses tools are flat: `tools[0].parameters`
            return m[1] + m[2]
        for chat, responses in _RENAMED:
            if param == chat or param.startswith(chat + "."):
                return responses + param[len(chat) :]
        return param


_RENAMED = (
    ("messages", "input"),
    ("response_format.json_schema.schema", "text.format.schema"),
    ("response_format", "text.format"),
    ("max_completion_tokens", "max_output_tokens"),
)


def _texts(parts: str | list[rs.InputContentPart] | None, where: str) -> str:
    if parts is None or isinstance(parts, str):
        return parts or ""
    out = []
    for i, p in enumerate(parts):
        if p.text is None or p.type not in ("input_text", "output_text", "text", "reasoning_text"):
            raise errors.unsupported(f"{where}[{i}]", f"content type {p.type!r}")
        out.append(p.text)
    return "".join(out)


def _refuse_unsupported(req: rs.ResponseCreateRequest) -> None:
    if req.previous_response_id is not None:
        raise errors.unsupported(
            "previous_response_id", "this server stores no responses; send the conversation"
        )
    for name in ("conversation", "prompt", "top_logprobs", "max_tool_calls"):
        if getattr(req, name) is not None:
            raise errors.unsupported(name)
    if req.background:
        raise errors.unsupported("background")
    if "message.output_text.logprobs" in (req.include or ()):
        raise errors.unsupported("include", "message.output_text.logprobs")


def _tools(req: rs.ResponseCreateRequest) -> list[dict[str, Any]] | None:
    if req.tools is None:
        return None
    out = []
    for i, t in enumerate(req.tools):
        if t.type != "function":
            raise errors.unsupported(f"tools[{i}].type", f"tool type {t.type!r}")
        if t.name is None:
            raise errors.bad_request("function tools need a `name`", f"tools[{i}].name")
        fn = {"name": t.name, "description": t.description, "parameters": t.parameters}
        out.append({"type": "function", "function": {**fn, "strict": t.strict is not False}})
    return out


def _tool_choice(choice: str | dict[str, Any] | None) -> Any:
    if choice is None or isinstance(choice, str):
        return choice
    if choice.get("type") == "function" and isinstance(choice.get("name"), str):
        return {"type": "function", "function": {"name": choice["name"]}}
    raise errors.unsupported("tool_choice", f"tool_choice type {choice.get('type')!r}")


def _response_format(text: rs.TextConfig | None) -> dict[str, Any] | None:
    fmt = text.format if text is not None else None
    if fmt is None or fmt.type != "json_schema":
        return None if fmt is None else {"type": fmt.type}
    if fmt.name is None:
        raise errors.bad_request("`text.format` of type json_schema needs a `name`", "text.format")
    spec = {"name": fmt.name, "schema": fmt.schema_, "strict": fmt.strict}
    return {"type": "json_schema", "json_schema": spec}


def _messages(req: rs.ResponseCreateRequest, params: _Params) -> list[dict[str, Any]]:
    messages: list[dict[str, Any]] = []

    def add(msg: dict[str, Any], where: str) -> None:
        messages.append(msg)
        params.messages.append(where)

    if req.instructions:
        add({"role": "system", "content": req.instructions}, "instructions")
    if isinstance(req.input, str):
        add({"role": "user", "content": req.input}, "input")
        return messages
    reasoning: str | None = None  # from a reasoning item, for the assistant turn that follows
    for i, item in enumerate(req.input):
        where = f"input[{i}]"
        kind = item.type or "message"
        if kind == "message":
            if item.role is None:
                raise errors.bad_request("a message item needs a `role`", f"{where}.role")
            msg: dict[str, Any] = {
                "role": item.role,
                "content": _texts(item.content, f"{where}.content"),
            }
            if item.role == "assistant" and reasoning is not None:
                msg["reasoning_content"], reasoning = reasoning, None
            add(msg, where)
        elif kind == "function_call":
            if item.call_id is None or item.name is None:
                raise errors.bad_request("a function_call item needs `call_id` and `name`", where)
            call = {
                "id": item.call_id,
                "type": "function",
                "function": {"name": item.name, "arguments": item.arguments or "{}"},
            }
            last = messages[-1] if messages else None
            if last is not None and last["role"] == "assistant" and "tool_calls" in last:
                last["tool_calls"].append(call)  # one assistant turn holds consecutive calls
            else:
                msg = {"role": "assistant", "content": None, "tool_calls": [call]}
                if reasoning is not None:
                    msg["reasoning_content"], reasoning = reasoning, None
                add(msg, where)
                params.calls[len(messages) - 1] = []
            params.calls[len(messages) - 1].append(where)
        elif kind == "function_call_output":
            if item.call_id is None:
                raise errors.bad_request(
                    "a function_call_output item needs `call_id`", f"{where}.call_id"
                )
            text = _texts(item.output, f"{where}.output")
            add({"role": "tool", "tool_call_id": item.call_id, "content": text}, where)
        elif kind == "reasoning":
            reasoning = _texts(item.content, f"{where}.content") or _texts(
                item.summary, f"{where}.summary"
            )
        else:
            raise errors.unsupported(f"{where}.type", f"input item type {kind!r}")
    return messages


def to_chat(req: rs.ResponseCreateRequest) -> tuple[schemas.ChatCompletionRequest, _Params]:
    """The chat request this Responses request means (400s name the Responses fields)."""
    _refuse_unsupported(req)
    params = _Params()
    body: dict[str, Any] = {
        "model": req.model,
        "messages": _messages(req, params),
        "max_completion_tokens": req.max_output_tokens,
        "temperature": req.temperature,
        "top_p": req.top_p,
        "seed": req.seed,
        "top_k": req.top_k,
        "tools": _tools(req),
        "tool_choice": _tool_choice(req.tool_choice),
        "parallel_tool_calls": req.parallel_tool_calls,
        "response_format": _response_format(req.text),
        "structured_outputs": req.structured_outputs,
        "chat_template_kwargs": req.chat_template_kwargs,
        "cache_salt": req.cache_salt,
    }
    if not body["messages"]:
        raise errors.bad_request("`input` holds no message", "input")
    try:
        return schemas.ChatCompletionRequest.model_validate(body), params
    except pydantic.ValidationError as e:  # a value the chat request cannot hold (400, not 422)
        first = e.errors()[0]
        where = ""
        for x in first["loc"]:
            if not isinstance(x, int) and not x.isidentifier():
                break  # a union member's tag (`literal[...]`), not a field
            where += f"[{x}]" if isinstance(x, int) else f".{x}"
        where = where.lstrip(".")
        raise _translated(errors.bad_request(f"{where}: {first['msg']}", where), params) from e


def _translated(err: errors.APIError, params: _Params) -> errors.APIError:
    param = params.translate(err.param)
    message = err.message
    if err.param and param and param != err.param:
        message = message.replace(err.param, param)
    return errors.APIError(err.status, message, type=err.type, param=param, code=err.code)


# ---------------------------------------------------------------------------------------------
# Output items and stream events


class OutputItems:
    """Builds a response's output items from output deltas, and the events that stream them.

    Deltas of one kind extend the open item; another kind closes it and opens the next. Content
    that is only whitespace waits until real text follows (it then opens a message) or is dropped
    when a call comes next, so whitespace between calls opens no message.
    """

    def __init__(self) -> None:
        self.items: list[rs.OutputItem] = []
        self.open: rs.OutputItem | None = None
        self.held = ""  # whitespace-only content not yet placed
        self.calls = 0

    def add(self, d: Delta) -> list[dict[str, Any]]:
        if isinstance(d, ReasoningDelta):
            ev = [] if isinstance(self.open, rs.ReasoningItem) else self._start_reasoning()
            item = self._current(rs.ReasoningItem)
            item.content[0].text += d.text
            return [*ev, self._delta("response.reasoning_text.delta", d.text, content_index=0)]
        if isinstance(d, ContentDelta):
            if not isinstance(self.open, rs.OutputMessage):
                if not (self.held + d.text).strip():
                    self.held += d.text
                    return []
                text, self.held = self.held + d.text, ""
                ev = self._start_message()
            else:
                text, ev = d.text, []
            msg = self._current(rs.OutputMessage)
            msg.content[0].text += text
            return [*ev, {**self._delta("response.output_text.delta", text, 0), "logprobs": []}]
        assert isinstance(d, CallDelta)
        ev = []
        if d.id is not None:
            self.held = ""
            ev = self._start_call(d.id, d.name or "")
        call = self._current(rs.FunctionCallItem)
        call.arguments += d.arguments
        if d.arguments:
            ev.append(self._delta("response.function_call_arguments.delta", d.arguments))
        return ev

    def finish(self, status: rs.ItemStatus) -> list[dict[str, Any]]:
        """Close the open item with `status`; a response with no item gets an empty message."""
        ev = []
        if not self.items:
            ev += self._start_message()
            self._current(rs.OutputMessage).content[0].text = self.held
        return ev + self._close(status)

    def _current(self, kind: type[Any]) -> Any:
        assert isinstance(self.open, kind)
        return self.open

    def _delta(self, kind: str, delta: str, content_index: int | None = None) -> dict[str, Any]:
        assert self.open is not None
        ev: dict[str, Any] = {
            "type": kind,
            "item_id": self.open.id,
            "output_index": len(self.items) - 1,
            "delta": delta,
        }
        if content_index is not None:
            ev["content_index"] = content_index
        return ev

    def _start(self, item: rs.OutputItem) -> list[dict[str, Any]]:
        ev = self._close("completed")
        self.items.append(item)
        self.open = item
        added = {
            "type": "response.output_item.added",
            "output_index": len(self.items) - 1,
            "item": item.model_dump(mode="json"),
        }
        return [*ev, added]

    def _part(self, part: rs.OutputText | rs.ReasoningText, kind: str) -> dict[str, Any]:
        assert self.open is not None
        return {
            "type": kind,
            "item_id": self.open.id,
            "output_index": len(self.items) - 1,
            "content_index": 0,
            "part": part.model_dump(mode="json"),
        }

    def _start_reasoning(self) -> list[dict[str, Any]]:
        item = rs.ReasoningItem(
            id=new_id("rs"), status="in_progress", content=[rs.ReasoningText(text="")]
        )
        ev = self._start(item)
        return [*ev, self._part(rs.ReasoningText(text=""), "response.content_part.added")]

    def _start_message(self) -> list[dict[str, Any]]:
        item = rs.OutputMessage(
            id=new_id("msg"), status="in_progress", content=[rs.OutputText(text="")]
        )
        ev = self._start(item)
        return [*ev, self._part(rs.OutputText(text=""), "response.content_part.added")]

    def _start_call(self, call_id: str, name: str) -> list[dict[str, Any]]:
        self.calls += 1
        item = rs.FunctionCallItem(
            id=new_id("fc"), status="in_progress", call_id=call_id, name=name, arguments=""
        )
        return self._start(item)

    def _close(self, status: rs.ItemStatus) -> list[dict[str, Any]]:
        item = self.open
        if item is None:
            return []
        self.open = None
        where = {"item_id": item.id, "output_index": len(self.items) - 1}
        ev: list[dict[str, Any]] = []
        if isinstance(item, rs.FunctionCallItem):
            ev.append(
                {
                    "type": "response.function_call_arguments.done",
                    **where,
                    "name": item.name,
                    "arguments": item.arguments,
                }
            )
        else:
            part = item.content[0]
            kind = "reasoning_text" if isinstance(item, rs.ReasoningItem) else "output_text"
            done: dict[str, Any] = {
                "type": f"response.{kind}.done",
                **where,
                "content_index": 0,
                "text": part.text,
            }
            if isinstance(item, rs.OutputMessage):
                done["logprobs"] = []
            ev += [
                done,
                {
                    "type": "response.content_part.done",
                    **where,
                    "content_index": 0,
                    "part": part.model_dump(mode="json"),
                },
            ]
        item.status = status
        done_item = {
            "type": "response.output_item.done",
            "output_index": where["output_index"],
            "item": item.model_dump(mode="json"),
        }
        return [*ev, done_item]


# ---------------------------------------------------------------------------------------------
# The response


@dataclass
class _Run:
    """One request being answered: the planned chat request and the response's fixed fields."""

    req: rs.ResponseCreateRequest
    plan: ChatPlan
    params: _Params
    rid: str
    created_at: int

    def response(
        self,
        status: str,
        items: list[rs.OutputItem],
        usage: rs.ResponseUsage | None = None,
        error: errors.APIError | None = None,
    ) -> dict[str, Any]:
        req = self.req
        text = req.text.format if req.text is not None and req.text.format is not None else None
        obj = rs.ResponseObject(
            id=self.rid,
            created_at=self.created_at,
            status=status,  # type: ignore[arg-type]
            model=req.model,
            output=items,
            usage=usage,
            error=None
            if error is None
            else rs.ResponseError(code=error.code or "server_error", message=error.message),
            incomplete_details=rs.IncompleteDetails(reason="max_output_tokens")
            if status == "incomplete"
            else None,
            instructions=req.instructions,
            max_output_tokens=req.max_output_tokens,
            temperature=req.temperature,
            top_p=req.top_p,
            text={
                "format": text.model_dump(mode="json", by_alias=True, exclude_none=True)
                if text is not None
                else {"type": "text"}
            },
            tools=[t.model_dump(mode="json", exclude_none=True) for t in req.tools or ()],
            tool_choice=req.tool_choice or ("auto" if req.tools else "none"),
            parallel_tool_calls=req.parallel_tool_calls is not False,
            reasoning=req.reasoning,
            metadata=req.metadata or {},
            user=req.user,
        )
        return obj.model_dump(mode="json")

    def status(self, stream: WorkerStream) -> rs.ItemStatus:
        length = (
            stream.final is None or stream.final.finish_reason == worker_pb2.FINISH_REASON_LENGTH
        )
        return "incomplete" if length else "completed"

    def usage(self, stream: WorkerStream, output: Output) -> rs.ResponseUsage:
        u = stream.usage()
        return rs.ResponseUsage(
            input_tokens=u.prompt_tokens,
            input_tokens_details=rs.InputTokensDetails(
                cached_tokens=u.prompt_tokens_details.cached_tokens
            ),
            output_tokens=u.completion_tokens,
            total_tokens=u.total_tokens,
            output_tokens_details=rs.OutputTokensDetails(reasoning_tokens=output.reasoning_tokens),
        )


async def handle(ctx: Context, request: Request, req: rs.ResponseCreateRequest) -> Response:
    info = await check_model(ctx, req.model)
    params = _Params()
    try:
        chat_req, params = to_chat(req)
        plan = plan_chat(chat_req, info, ctx.config)
    except errors.APIError as e:
        raise _translated(e, params) from e
    run = _Run(req, plan, params, new_id("resp"), int(time.time()))
    plan.generate.request_id = run.rid
    try:
        return await respond(
            ctx,
            request,
            ENDPOINT,
            plan.generate,
            params.translate(plan.constraint_param),
            stream=(lambda s: _stream(s, run)) if req.stream else None,
            collect=lambda s: _collect(s, run),
        )
    except errors.APIError as e:
        raise _translated(e, params) from e


async def _collect(stream: WorkerStream, run: _Run) -> dict[str, Any]:
    output = run.plan.output()
    items = OutputItems()
    try:
        async for msg in stream:
            for d in output.feed(msg):
                items.add(d)
    finally:
        await stream.aclose()
    for d in output.finish():
        items.add(d)
    status = run.status(stream)
    items.finish(status)
    _count_calls(stream, run, items.calls)
    return run.response(status, items.items, run.usage(stream, output))


def _count_calls(stream: WorkerStream, run: _Run, calls: int) -> None:
    if calls:
        stream.ctx.metrics.tool_calls.labels(run.plan.mode.value).inc(calls)


async def _stream(stream: WorkerStream, run: _Run) -> AsyncIterator[bytes]:
    seq = 0

    def event(payload: dict[str, Any]) -> bytes:
        nonlocal seq
        payload = {**payload, "sequence_number": seq}
        seq += 1
        return sse.named_event(payload["type"], payload)

    output = run.plan.output()
    items = OutputItems()
    try:
        started = run.response("in_progress", [])
        yield event({"type": "response.created", "response": started})
        yield event({"type": "response.in_progress", "response": started})
        async for msg in stream:
            for d in output.feed(msg):
                for ev in items.add(d):
                    yield event(ev)
        for d in output.finish():
            for ev in items.add(d):
                yield event(ev)
        status = run.status(stream)
        for ev in items.finish(status):
            yield event(ev)
        body = run.response(status, items.items, run.usage(stream, output))
        yield event({"type": f"response.{status}", "response": body})
        stream.done = True
        _count_calls(stream, run, items.calls)
    except errors.APIError as e:
        stream.done = True
        err = _translated(e, run.params)
        yield event({"type": "error", "code": err.code, "message": err.message, "param": err.param})
        yield event(
            {"type": "response.failed", "response": run.response("failed", items.items, error=err)}
        )
