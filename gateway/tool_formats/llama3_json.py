"""Llama 3.x JSON calls: the whole reply is `{"name": ..., "parameters": {...}}` or text.

Llama's tool prompt asks for a bare JSON call, so a reply is a call exactly when it starts with
`{`. A structural tag (free text, then a triggered call) cannot say that, so every mode is one
Lark grammar whose calls are inline JSON Schemas:

* `auto`: `TEXT | calls`, where `TEXT` is any text that does not start with `{`.
* `required`: `calls`; named: one call to that tool.

`calls` is one call, or with `parallel_tool_calls` several separated by `; ` (vLLM's reading of
Llama's format; Meta's templates render one call per turn).
"""

from __future__ import annotations

import json
from typing import Any

from gateway import schemas
from gateway.tool_formats.base import PastCall, ToolFormat, ToolOutput, tool_lines
from gateway.tool_parser import LeadingCallsParser
from gateway.tools import ToolPlan, call_schema
from maskwire.v1 import common_pb2

ARGS_KEY = "parameters"
SEPARATOR = "; "
# A reply that is text: anything that does not open a JSON object.
_TEXT = "TEXT: /[^{](.|\\n)*/"


def _inline_json(schema: dict[str, Any]) -> str:
    """A Lark `%json` of `schema`, laid out like the gateway's other JSON (compact separators;
    the grammar service's JSON options do not reach inside a Lark grammar)."""
    layout = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
    return "%json " + json.dumps({**schema, "x-guidance": layout}, ensure_ascii=False)


def _calls_rules(tools: tuple[schemas.Tool, ...], parallel: bool) -> str:
    rules = f"call: {_inline_json(call_schema(tools, ARGS_KEY))}\n"
    if parallel:
        return f"calls: call ({json.dumps(SEPARATOR)} call)*\n" + rules
    return "calls: call\n" + rules


def _lark(start: str, rules: str) -> common_pb2.Constraint:
    return common_pb2.Constraint(lark=f"start: {start}\n{rules}")


class Llama3Json(ToolFormat):
    name = "llama3_json"

    def auto(self, tp: ToolPlan) -> ToolOutput:
        constraint = _lark("TEXT | calls", _calls_rules(tp.tools, tp.parallel) + _TEXT + "\n")
        return ToolOutput(constraint, LeadingCallsParser)

    def required(self, tp: ToolPlan) -> ToolOutput:
        return ToolOutput(_lark("calls", _calls_rules(tp.tools, tp.parallel)), LeadingCallsParser)

    def named(self, tp: ToolPlan, tool: schemas.Tool) -> ToolOutput:
        return ToolOutput(_lark("calls", _calls_rules((tool,), False)), LeadingCallsParser)

    def instructions(self, tools: tuple[schemas.Tool, ...]) -> str:
        return (
            "Given the following functions, please respond with a JSON for a function call with "
            "its proper arguments that best answers the given prompt.\n\n"
            'Respond in the format {"name": function name, "parameters": dictionary of argument '
            "name and its value}. Do not use variables.\n\n"
            f"{tool_lines(tools)}"
        )

    def calls_text(self, calls: list[PastCall]) -> str:
        return SEPARATOR.join(
            f'{{"name": {json.dumps(c.name, ensure_ascii=False)}, "{ARGS_KEY}": {c.arguments}}}'
            for c in calls
        )
