"""Mistral calls (tokenizer v3, e.g. Tekken): `[TOOL_CALLS][{"name": ..., "arguments": {...}}]`.

`[TOOL_CALLS]` is one special token. In `auto` mode it triggers a structural tag whose body is the
JSON array of calls; for `required` and named tools the prompt ends with it (the worker tokenizes
it as the special token) and the output is the array. Mistral's templates want call ids of nine
letters and digits: calls get such ids, and other ids are shortened for the template.
"""

from __future__ import annotations

import hashlib
import json
import re
import secrets
import string

from gateway import schemas
from gateway.constraints import json_options
from gateway.tool_formats.base import PastCall, ToolFormat, ToolOutput, tool_lines
from gateway.tool_parser import ArrayBody, JsonArrayCallParser, TaggedCallParser
from gateway.tools import ToolPlan, calls_schema, dumps, json_constraint
from maskwire.v1 import common_pb2

TOOL_CALLS = "[TOOL_CALLS]"
_ID_CHARS = string.ascii_letters + string.digits
_ID_LEN = 9


def new_mistral_id() -> str:
    return "".join(secrets.choice(_ID_CHARS) for _ in range(_ID_LEN))


class Mistral(ToolFormat):
    name = "mistral"

    def auto(self, tp: ToolPlan) -> ToolOutput:
        tag = common_pb2.StructuralTag(
            begin=TOOL_CALLS, json_schema=dumps(calls_schema(tp.tools, tp.parallel)), end=""
        )
        constraint = common_pb2.Constraint(
            structural_tags=common_pb2.StructuralTags(tags=[tag], triggers=[TOOL_CALLS]),
            json_options=json_options(),
        )
        return ToolOutput(
            constraint, lambda: TaggedCallParser(TOOL_CALLS, ArrayBody, new_id=new_mistral_id)
        )

    def required(self, tp: ToolPlan) -> ToolOutput:
        return self._calls(calls_schema(tp.tools, tp.parallel))

    def named(self, tp: ToolPlan, tool: schemas.Tool) -> ToolOutput:
        return self._calls(calls_schema((tool,), parallel=False))

    def _calls(self, schema: dict[str, object]) -> ToolOutput:
        return ToolOutput(
            json_constraint(schema),
            lambda: JsonArrayCallParser(new_mistral_id),
            prompt_suffix=TOOL_CALLS,
        )

    def new_call_id(self) -> str:
        return new_mistral_id()

    def template_call_id(self, call_id: str) -> str:
        if re.fullmatch(f"[{_ID_CHARS}]{{{_ID_LEN}}}", call_id):
            return call_id
        # Deterministic, so a call and the tool message answering it keep matching ids.
        digest = hashlib.sha256(call_id.encode()).digest()
        return "".join(_ID_CHARS[b % len(_ID_CHARS)] for b in digest[:_ID_LEN])

    def instructions(self, tools: tuple[schemas.Tool, ...]) -> str:
        return (
            "You can call these functions:\n"
            f"{tool_lines(tools)}\n\n"
            f"To call functions, reply with {TOOL_CALLS} followed by a JSON array of "
            '{"name": <function-name>, "arguments": <args-json-object>} objects.'
        )

    def calls_text(self, calls: list[PastCall]) -> str:
        items = ", ".join(
            f'{{"name": {json.dumps(c.name, ensure_ascii=False)}, "arguments": {c.arguments}}}'
            for c in calls
        )
        return f"{TOOL_CALLS}[{items}]"
