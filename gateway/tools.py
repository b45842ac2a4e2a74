"""Tool calling: which mode a request is in, and the JSON Schemas of calls every format uses.

How a model family writes its calls, and so the constraint and parser of each mode, is the job of
`gateway.tool_formats`; `none` means no tools in the prompt, no constraint, no parsing.
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
from gateway.input_check import check_numbers
from gateway.limits import DEFAULT_MAX_JSON_DEPTH
from maskwire.text import truncate_echo
from maskwire.v1 import common_pb2

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

    @property
    def named_tool(self) -> schemas.Tool:
        return next(t for t in self.tools if t.function.name == self.named)


def plan(req: schemas.ChatCompletionRequest, max_depth: int = DEFAULT_MAX_JSON_DEPTH) -> ToolPlan:
    """Resolve `tools` + `tool_choice` + `parallel_tool_calls` (400 on contradictions, and on
    numbers JSON cannot carry in a tool's `parameters`)."""
    tools = tuple(req.tools or ())
    parallel = req.parallel_tool_calls is not False
    names = [t.function.name for t in tools]
    if len(set(names)) != len(names):
        raise bad_request("tool names must be unique", "tools")
    for i, tool in enumerate(tools):
        if tool.function.parameters:
            check_numbers(tool.function.parameters, f"tools[{i}].function.parameters", max_depth)
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


def call_schema(tools: tuple[schemas.Tool, ...], args_key: str = "arguments") -> dict[str, Any]:
    """One call object `{"name": NAME, args_key: <NAME's parameters>}`, one `anyOf` branch per
    tool; tool `$defs` are hoisted to the root."""
    root_defs: dict[str, Any] = {}
    branches = []
    for i, tool in enumerate(tools):
        params = _hoist_defs(parameters(tool), f"tool{i}_", root_defs)
        branches.append(
            {
                "type": "object",
                "properties": {"name": {"const": tool.function.name}, args_key: params},
                "required": ["name", args_key],
                "additionalProperties": False,
            }
        )
    schema: dict[str, Any] = branches[0] if len(branches) == 1 else {"anyOf": branches}
    if root_defs:
        schema = {**schema, "$defs": root_defs}
    return schema


def calls_schema(
    tools: tuple[schemas.Tool, ...], parallel: bool, args_key: str = "arguments"
) -> dict[str, Any]:
    """A JSON array of calls: at least one, at most one without `parallel`."""
    item = call_schema(tools, args_key)
    defs = item.pop("$defs", None)
    schema: dict[str, Any] = {"type": "array", "items": item, "minItems": 1}
    if not parallel:
        schema["maxItems"] = 1
    if defs:
        schema["$defs"] = defs
    return schema


def json_constraint(schema: dict[str, Any]) -> common_pb2.Constraint:
    return common_pb2.Constraint(json_schema=dumps(schema), json_options=json_options())


def dumps(schema: dict[str, Any]) -> str:
    return json.dumps(schema, separators=(",", ":"), ensure_ascii=False)


def openai_tools(tools: tuple[schemas.Tool, ...]) -> list[dict[str, Any]]:
    """Tools as plain dicts in OpenAI's shape (what chat templates with tool support expect)."""
    return [t.model_dump(mode="json", exclude_none=True, by_alias=True) for t in tools]
