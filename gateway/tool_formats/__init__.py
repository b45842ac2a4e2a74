"""Tool-call formats, one module each, chosen by the model's chat template or by the gateway's
`--tool-call-parser hermes|llama3_json|mistral`.

A template that renders `[TOOL_CALLS]` is Mistral's; one that asks for `"parameters"` (or knows
`<|python_tag|>`) is Llama 3's JSON calling; anything else, including templates without tool
support, gets Hermes.
"""

from __future__ import annotations

from gateway.tool_formats.base import PastCall, ToolFormat, ToolOutput
from gateway.tool_formats.hermes import Hermes
from gateway.tool_formats.llama3_json import Llama3Json
from gateway.tool_formats.mistral import TOOL_CALLS, Mistral

FORMATS: dict[str, ToolFormat] = {f.name: f for f in (Hermes(), Llama3Json(), Mistral())}

__all__ = ["FORMATS", "PastCall", "ToolFormat", "ToolOutput", "by_name", "detect"]


def by_name(name: str) -> ToolFormat:
    try:
        return FORMATS[name]
    except KeyError:
        raise ValueError(
            f"unknown tool-call parser {name!r} (one of {', '.join(FORMATS)})"
        ) from None


def detect(template: str) -> ToolFormat:
    """The format a chat template's own tool prompt asks for."""
    if TOOL_CALLS in template:
        return FORMATS["mistral"]
    if "<|python_tag|>" in template or '"parameters"' in template:
        return FORMATS["llama3_json"]
    return FORMATS["hermes"]
