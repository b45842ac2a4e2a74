"""Tool calling: which mode a request is in, the constraint for that mode, the Hermes prompt.

* `required`: the output is a JSON array of `{"name", "arguments"}` (one `anyOf` branch per tool;
  at most one item without `parallel_tool_calls`).
* named tool: the output is that tool's arguments object.
* `auto`: free text, but after the `<tool_call>` trigger a structural tag per tool forces
  `{"name": "NAME", "arguments": <its schema>}</tool_call>`.
* `none`: no tools in the prompt, no constraint, no parsing.
"""

from __future__ import annotations

import copy
import enum
import json
from dataclasses import dataclass
from typing import Any

from gateway import schemas
from gateway.constraints import json_options
from gateway.errors import bad_request
from gateway.input_check import parse_json_text
from gateway.limits import DEFAULT_MAX_JSON_DEPTH
from maskwire.text import truncate_echo
from maskwire.v1 import common_pb2

TOOL_CALL_OPEN = "<tool_call>"
TOOL_CALL_CLOSE = "</tool_call>"
EMPTY_PARAMETERS: dict[str, Any] = {"type": "object", "properties": {}}


class ToolMode(enum.Enum):
    NONE = "none"
    AUTO = "auto"
    REQUIRED = "required"
    NAMED = "named"


@dataclass(frozen=True)
class ToolPlan:
    """How one request uses its tools."""

    mode: ToolMode
    tools: tuple[schemas.Tool, ...]
    parallel: bool
    named: str | None = None

    @property
    def in_prompt(self) -> bool:
        return self.mode is not ToolMode.NONE


def plan(req: schemas.ChatCompletionRequest) -> ToolPlan:
    """Resolve `tools` + `tool_choice` + `parallel_tool_calls` (400 on contradictions)."""
    tools = tuple(req.tools or ())
    parallel = req.parallel_tool_calls is not False
    names = [t.function.name for t in tools]
    if len(set(names)) != len(names):
        raise bad_request("tool names must be unique", "tools")
    choice = req.tool_choice
    if isinstance(choice, schemas.NamedToolChoice):
        if choice.function.name not in names:
            raise bad_request(
                f"tool_choice names `{truncate_echo(choice.function.name)}`, which is not in "
                "`tools`",
                "tool_choice",
            )
        return ToolPlan(ToolMode.NAMED, tools, parallel, choice.function.name)
    if choice is None:
        choice = "auto" if tools else "none"
    if choice != "none" and not tools:
        raise bad_request(f'tool_choice "{choice}" needs `tools`', "tool_choice")
    return ToolPlan(ToolMode(choice), tools, parallel)


def parameters(tool: schemas.Tool) -> dict[str, Any]:
    """The tool's arguments schema; strict tools get `additionalProperties: false` throughout."""
    params = copy.deepcopy(tool.function.parameters) if tool.function.parameters else {}
    if not params:
        params = dict(EMPTY_PARAMETERS)
    if tool.function.strict:
        forbid_additional(params)
    return params


_SUBSCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")
_SUBSCHEMA_LISTS = ("anyOf", "oneOf", "allOf", "prefixItems")
_SUBSCHEMA_ONE = ("items", "additionalItems", "contains", "not", "if", "then", "else")


def forbid_additional(schema: Any) -> None:
    """In place: every object schema without `additionalProperties` gets `false` (OpenAI strict)."""
    if not isinstance(schema, dict):
        return
    if (schema.get("type") == "object" or "properties" in schema) and (
        "additionalProperties" not in schema
    ):
        schema["additionalProperties"] = False
    for key in _SUBSCHEMA_MAPS:
        sub = schema.get(key)
        if isinstance(sub, dict):
            for v in sub.values():
                forbid_additional(v)
    for key in _SUBSCHEMA_LISTS:
        sub = schema.get(key)
        if isinstance(sub, list):
            for v in sub:
                forbid_additional(v)
    for key in (*_SUBSCHEMA_ONE, "additionalProperties"):
        forbid_additional(schema.get(key))


def _hoist_defs(params: dict[str, Any], prefix: str, root_defs: dict[str, Any]) -> dict[str, Any]:
    """Move a tool schema's `$defs` to the combined root, renaming `$ref`s to match.

    A tool schema is embedded inside the `required` array schema, where its own `#/$defs/...`
    references would otherwise point at the wrong root.
    """
    params = copy.deepcopy(params)
    defs: dict[str, Any] = {}
    for key in ("$defs", "definitions"):
        for name, sub in (params.pop(key, None) or {}).items():
            defs[f"#/{key}/{name}"] = (f"{prefix}{name}", sub)

    def rewrite(node: Any) -> Any:
        if isinstance(node, dict):
            out = {}
            for k, v in node.items():
                if k == "$ref" and isinstance(v, str):
                    if v in defs:
                        v = f"#/$defs/{defs[v][0]}"
                    elif v.startswith("#"):
                        raise bad_request(
                            "tool schemas may only reference their own $defs (got "
                            f"{truncate_echo(repr(v))})",
                            "tools",
                        )
                out[k] = rewrite(v)
            return out
        if isinstance(node, list):
            return [rewrite(v) for v in node]
        return node

    for new_name, sub in defs.values():
        root_defs[new_name] = rewrite(sub)
    result: dict[str, Any] = rewrite(params)
    return result


def required_schema(tools: tuple[schemas.Tool, ...], parallel: bool) -> dict[str, Any]:
    """JSON array of calls, one `anyOf` branch per tool."""
    root_defs: dict[str, Any] = {}
    branches = []
    for i, tool in enumerate(tools):
        params = _hoist_defs(parameters(tool), f"tool{i}_", root_defs)
        branches.append(
            {
                "type": "object",
                "properties": {
                    "name": {"const": tool.function.name},
                    "arguments": params,
                },
                "required": ["name", "arguments"],
                "additionalProperties": False,
            }
        )
    schema: dict[str, Any] = {
        "type": "array",
        "items": branches[0] if len(branches) == 1 else {"anyOf": branches},
        "minItems": 1,
    }
    if not parallel:
        schema["maxItems"] = 1
    if root_defs:
        schema["$defs"] = root_defs
    return schema


def tag_begin(name: str) -> str:
    return f'{TOOL_CALL_OPEN}{{"name": {json.dumps(name, ensure_ascii=False)}, "arguments": '


TAG_END = "}" + TOOL_CALL_CLOSE


def constraint(tp: ToolPlan) -> common_pb2.Constraint | None:
    """The constraint for the plan's mode (None for `none`)."""
    if tp.mode is ToolMode.NONE:
        return None
    if tp.mode is ToolMode.NAMED:
        tool = next(t for t in tp.tools if t.function.name == tp.named)
        return common_pb2.Constraint(
            json_schema=_dumps(parameters(tool)), json_options=json_options()
        )
    if tp.mode is ToolMode.REQUIRED:
        return common_pb2.Constraint(
            json_schema=_dumps(required_schema(tp.tools, tp.parallel)),
            json_options=json_options(),
        )
    tags = [
        common_pb2.StructuralTag(
            begin=tag_begin(t.function.name), json_schema=_dumps(parameters(t)), end=TAG_END
        )
        for t in tp.tools
    ]
    return common_pb2.Constraint(
        structural_tags=common_pb2.StructuralTags(tags=tags, triggers=[TOOL_CALL_OPEN]),
        json_options=json_options(),
    )


def _dumps(schema: dict[str, Any]) -> str:
    return json.dumps(schema, separators=(",", ":"), ensure_ascii=False)


def openai_tools(tools: tuple[schemas.Tool, ...]) -> list[dict[str, Any]]:
    """Tools as plain dicts in OpenAI's shape (what chat templates with tool support expect)."""
    return [t.model_dump(mode="json", exclude_none=True, by_alias=True) for t in tools]


def hermes_system_prompt(tools: tuple[schemas.Tool, ...]) -> str:
    """Tool instructions for templates without tool support (Hermes / Qwen2.5 style)."""
    lines = "\n".join(json.dumps(t, ensure_ascii=False) for t in openai_tools(tools))
    return (
        "# Tools\n\n"
        "You may call one or more functions to assist with the user query.\n\n"
        "You are provided with function signatures within <tools></tools> XML tags:\n"
        f"<tools>\n{lines}\n</tools>\n\n"
        "For each function call, return a json object with function name and arguments within "
        "<tool_call></tool_call> XML tags:\n"
        '<tool_call>{"name": <function-name>, "arguments": <args-json-object>}</tool_call>'
    )


def hermes_call_text(
    name: str, arguments: str, where: str = "arguments", max_depth: int = DEFAULT_MAX_JSON_DEPTH
) -> str:
    """An earlier assistant call, written back into the prompt the way the model emits it."""
    try:
        args = json.dumps(parse_json_text(arguments, where, max_depth), ensure_ascii=False)
    except (json.JSONDecodeError, TypeError):
        args = arguments
    return f"{tag_begin(name)}{args}{TAG_END}"
