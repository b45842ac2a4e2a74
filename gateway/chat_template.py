"""Chat prompts for the gateway: OpenAI messages and tools -> the model's own Jinja template.

Rendering itself is `maskwire.chat_template` (Hugging Face's environment). Templates that do not
mention `tools` get the tools as a system prompt in the request's tool-call format (Hermes unless
`--tool-call-parser` says otherwise), earlier calls as that format's text and tool results as
`<tool_response>` user turns, so any ChatML-like template can carry a tool conversation.
"""

from __future__ import annotations

import json
from typing import Any

from gateway import schemas, tools
from gateway.errors import bad_request, unsupported
from gateway.input_check import parse_json_text
from gateway.limits import DEFAULT_MAX_JSON_DEPTH
from gateway.tool_formats import PastCall, ToolFormat
from maskwire.chat_template import ChatTemplateError, check_template, render_chat
from maskwire.text import truncate_echo


class TemplateError(Exception):
    """The template does not compile or failed to render."""


class ChatTemplate:
    """A chat template plus the special tokens it may reference."""

    def __init__(self, source: str, *, bos_token: str = "", eos_token: str = "") -> None:
        try:
            check_template(source)
        except ChatTemplateError as e:
            raise TemplateError(str(e)) from e
        self.source = source
        self.bos_token = bos_token
        self.eos_token = eos_token
        # Hugging Face's own heuristic: a template that never says `tools` cannot render them.
        self.supports_tools = "tools" in source

    def render(
        self,
        messages: list[dict[str, Any]],
        *,
        tools: list[dict[str, Any]] | None = None,
        add_generation_prompt: bool = True,
        extra: dict[str, Any] | None = None,
    ) -> str:
        variables: dict[str, Any] = {**(extra or {}), "tools": tools}
        for reserved in ("messages", "bos_token", "eos_token", "add_generation_prompt"):
            variables.pop(reserved, None)
        try:
            return render_chat(
                self.source,
                messages,
                bos_token=self.bos_token,
                eos_token=self.eos_token,
                add_generation_prompt=add_generation_prompt,
                **variables,
            )
        except ChatTemplateError as e:
            raise TemplateError(str(e)) from e
        except (TypeError, ValueError, KeyError, IndexError, AttributeError) as e:
            raise TemplateError(f"{type(e).__name__}: {e}") from e


def _text(content: str | list[schemas.ContentPart] | None, where: str) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    parts = []
    for i, part in enumerate(content):
        if not isinstance(part, schemas.TextContentPart):
            raise unsupported(f"{where}.content[{i}]", f"content type {part.type!r}")
        parts.append(part.text)
    return "".join(parts)


def _arguments_value(arguments: str, where: str, max_depth: int) -> Any:
    """Templates with tool support expect arguments as a mapping (Hugging Face convention).
    Text that is not JSON is passed on as it is; JSON that is not an object is a 400."""
    try:
        value = parse_json_text(arguments, where, max_depth)
    except json.JSONDecodeError:
        return arguments
    if not isinstance(value, dict):
        raise bad_request(
            f"`{where}` must be a JSON object (the call's arguments by name), got "
            f"{truncate_echo(arguments)!r}",
            where,
        )
    return value


def _arguments_text(arguments: str, where: str, max_depth: int) -> str:
    """Arguments as JSON text the way a model writes them (the client's text if not JSON)."""
    value = _arguments_value(arguments, where, max_depth)
    return arguments if value is arguments else json.dumps(value, ensure_ascii=False)


def build_prompt(
    template: ChatTemplate,
    req: schemas.ChatCompletionRequest,
    plan: tools.ToolPlan,
    fmt: ToolFormat,
    max_depth: int = DEFAULT_MAX_JSON_DEPTH,
) -> str:
    """The prompt text for a chat request (400 when the template refuses the conversation).
    `fmt` writes tools and earlier calls for templates without tool support, and shapes call ids
    for those with it. `max_depth` bounds the nesting of tool-call arguments (JSON text) parsed."""
    native = template.supports_tools
    messages: list[dict[str, Any]] = []
    for i, m in enumerate(req.messages):
        where = f"messages[{i}]"
        role = "system" if m.role == "developer" else m.role
        content = _text(m.content, where)
        msg: dict[str, Any] = {"role": role, "content": content}
        if m.name is not None:
            msg["name"] = m.name
        if m.reasoning_content is not None:
            msg["reasoning_content"] = m.reasoning_content
        if m.role == "assistant" and m.tool_calls:
            args_where = [
                f"{where}.tool_calls[{j}].function.arguments" for j in range(len(m.tool_calls))
            ]
            if native:
                msg["tool_calls"] = [
                    {
                        "id": fmt.template_call_id(c.id),
                        "type": "function",
                        "function": {
                            "name": c.function.name,
                            "arguments": _arguments_value(c.function.arguments, w, max_depth),
                        },
                    }
                    for c, w in zip(m.tool_calls, args_where, strict=True)
                ]
            else:
                calls = fmt.calls_text(
                    [
                        PastCall(
                            c.function.name, _arguments_text(c.function.arguments, w, max_depth)
                        )
                        for c, w in zip(m.tool_calls, args_where, strict=True)
                    ]
                )
                msg["content"] = f"{content}\n{calls}" if content else calls
        elif m.role == "tool":
            if m.tool_call_id is None:
                raise bad_request("tool messages need `tool_call_id`", f"{where}.tool_call_id")
            if native:
                msg["tool_call_id"] = fmt.template_call_id(m.tool_call_id)
            else:
                msg = {"role": "user", "content": f"<tool_response>\n{content}\n</tool_response>"}
        messages.append(msg)

    tool_dicts = tools.openai_tools(plan.tools) if plan.in_prompt else None
    if tool_dicts and not native:
        prompt = fmt.instructions(plan.tools)
        if messages[0]["role"] == "system":
            messages[0] = {**messages[0], "content": f"{messages[0]['content']}\n\n{prompt}"}
        else:
            messages.insert(0, {"role": "system", "content": prompt})
        tool_dicts = None
    try:
        return template.render(
            messages,
            tools=tool_dicts,
            add_generation_prompt=True,
            extra=req.chat_template_kwargs,
        )
    except TemplateError as e:
        raise bad_request(f"the chat template rejected the conversation: {e}", "messages") from e
