"""What a tool-call format decides: the constraint, prompt suffix and parser of each tool mode,
and how calls are written into a prompt whose template has no tool support."""

from __future__ import annotations

import abc
import json
from collections.abc import Callable
from dataclasses import dataclass
from typing import ClassVar

from gateway import schemas
from gateway.tool_parser import OutputParser, PlainText, new_call_id
from gateway.tools import ToolMode, ToolPlan, openai_tools
from maskwire.v1 import common_pb2


@dataclass(frozen=True)
class ToolOutput:
    """How one request's output is constrained and read."""

    constraint: common_pb2.Constraint | None
    parser: Callable[[], OutputParser]
    # Appended to the rendered prompt: the format's call marker, when the output must be calls
    # (the prompt is tokenized by the worker, so a special-token marker becomes that token).
    prompt_suffix: str = ""
    stop: tuple[str, ...] = ()


@dataclass(frozen=True)
class PastCall:
    """An earlier assistant call, as a template without tool support gets it in text."""

    name: str
    arguments: str  # JSON text (re-serialized when it parses)


class ToolFormat(abc.ABC):
    """One model family's way of calling tools."""

    name: ClassVar[str]

    def output(self, tp: ToolPlan) -> ToolOutput:
        if tp.mode is ToolMode.NONE:
            return ToolOutput(None, PlainText)
        if tp.mode is ToolMode.AUTO:
            return self.auto(tp)
        if tp.mode is ToolMode.REQUIRED:
            return self.required(tp)
        return self.named(tp, tp.named_tool)

    @abc.abstractmethod
    def auto(self, tp: ToolPlan) -> ToolOutput:
        """Text or calls, the model's choice; calls are constrained once their marker appears."""

    @abc.abstractmethod
    def required(self, tp: ToolPlan) -> ToolOutput:
        """One call or more (one without `parallel_tool_calls`), nothing else."""

    @abc.abstractmethod
    def named(self, tp: ToolPlan, tool: schemas.Tool) -> ToolOutput:
        """Exactly one call, to `tool`."""

    def new_call_id(self) -> str:
        return new_call_id()

    def template_call_id(self, call_id: str) -> str:
        """A call id as this family's template accepts it."""
        return call_id

    @abc.abstractmethod
    def instructions(self, tools: tuple[schemas.Tool, ...]) -> str:
        """A system prompt that describes the tools and this call format."""

    @abc.abstractmethod
    def calls_text(self, calls: list[PastCall]) -> str:
        """Earlier calls of one assistant turn, written the way the model emits them."""


def tool_lines(tools: tuple[schemas.Tool, ...]) -> str:
    """One JSON line per tool, in OpenAI's shape."""
    return "\n".join(json.dumps(t, ensure_ascii=False) for t in openai_tools(tools))
