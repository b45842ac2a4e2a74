"""Hermes / Qwen calls: `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`.

* `auto`: a structural tag per tool after the `<tool_call>` trigger; without
  `parallel_tool_calls`, generation stops at the first `</tool_call>`.
* `required`: a JSON array of `{"name", "arguments"}` (no free text to place tags in).
* named: the tool's arguments object.

Also the gateway's fallback: templates without tool support get these instructions.
"""

from __future__ import annotations

import json

from gateway import schemas
from gateway.constraints import json_options
from gateway.tool_formats.base import PastCall, ToolFormat, ToolOutput, tool_lines
from gateway.tool_parser import JsonArrayCallParser, NamedCallParser, ObjectBody, TaggedCallParser
from gateway.tools import ToolPlan, calls_schema, dumps, json_constraint, parameters
from maskwire.v1 import common_pb2

OPEN = "<tool_call>"
CLOSE = "</tool_call>"
TAG_END = "}" + CLOSE


def tag_begin(name: str) -> str:
    return f'{OPEN}{{"name": {json.dumps(name, ensure_ascii=False)}, "arguments": '


def parser() -> TaggedCallParser:
    return TaggedCallParser(OPEN, ObjectBody, CLOSE)


class Hermes(ToolFormat):
    name = "hermes"

    def auto(self, tp: ToolPlan) -> ToolOutput:
        tags = [
            common_pb2.StructuralTag(
                begin=tag_begin(t.function.name), json_schema=dumps(parameters(t)), end=TAG_END
            )
            for t in tp.tools
        ]
        constraint = common_pb2.Constraint(
            structural_tags=common_pb2.StructuralTags(tags=tags, triggers=[OPEN]),
            json_options=json_options(),
        )
        # One call at most: stop right after the first call's closing tag.
        return ToolOutput(constraint, parser, stop=() if tp.parallel else (CLOSE,))

    def required(self, tp: ToolPlan) -> ToolOutput:
        return ToolOutput(json_constraint(calls_schema(tp.tools, tp.parallel)), JsonArrayCallParser)

    def named(self, tp: ToolPlan, tool: schemas.Tool) -> ToolOutput:
        name = tool.function.name
        return ToolOutput(json_constraint(parameters(tool)), lambda: NamedCallParser(name))

    def instructions(self, tools: tuple[schemas.Tool, ...]) -> str:
        return (
            "# Tools\n\n"
            "You may call one or more functions to assist with the user query.\n\n"
            "You are provided with function signatures within <tools></tools> XML tags:\n"
            f"<tools>\n{tool_lines(tools)}\n</tools>\n\n"
            "For each function call, return a json object with function name and arguments "
            "within <tool_call></tool_call> XML tags:\n"
            '<tool_call>{"name": <function-name>, "arguments": <args-json-object>}</tool_call>'
        )

    def calls_text(self, calls: list[PastCall]) -> str:
        return "".join(f"{tag_begin(c.name)}{c.arguments}{TAG_END}" for c in calls)
