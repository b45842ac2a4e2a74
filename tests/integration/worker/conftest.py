"""Shared helpers for the worker's end-to-end tests (real grammar service + worker processes)."""

from __future__ import annotations

import asyncio
import json
import re
from dataclasses import dataclass, field
from typing import Any

import grpc
import jsonschema
import llguidance

from maskwire.tokenizer import load_tokenizer
from maskwire.v1 import common_pb2, worker_pb2, worker_pb2_grpc
from tests.support.schemas import PERSON

SCHEMAS: dict[str, dict[str, Any]] = {
    "person": PERSON,
    "enum_bool": {
        "type": "object",
        "properties": {
            "color": {"enum": ["red", "green", "blue"]},
            "ok": {"type": "boolean"},
        },
        "required": ["color", "ok"],
        "additionalProperties": False,
    },
    "int_array": {
        "type": "array",
        "items": {"type": "integer", "minimum": 1, "maximum": 9},
        "minItems": 2,
        "maxItems": 3,
    },
    "date": {
        "type": "object",
        "properties": {"date": {"type": "string", "format": "date"}},
        "required": ["date"],
        "additionalProperties": False,
    },
}
REGEX = r"[0-9]{3}-[0-9]{4}"
LARK = 'start: greeting " " name\ngreeting: "Hello" | "Hi"\nname: /[A-Z][a-z]{1,8}/\n'
CHOICES = ["Paris", "London", "Berlin"]


def chat(question: str) -> str:
    return f"<|im_start|>user\n{question}<|im_end|>\n<|im_start|>assistant\n"


@dataclass
class Case:
    """One constrained request and how to check its output."""

    name: str
    constraint: common_pb2.Constraint
    prompt: str
    check: Any = field(repr=False)


def _check_schema(schema: dict[str, Any]) -> Any:
    def check(text: str, ids: list[int]) -> None:
        jsonschema.validate(
            json.loads(text), schema, format_checker=jsonschema.Draft202012Validator.FORMAT_CHECKER
        )

    return check


def _check_regex(text: str, ids: list[int]) -> None:
    assert re.fullmatch(REGEX, text), text


def _check_lark(text: str, ids: list[int]) -> None:
    tok = load_tokenizer("default")
    m = llguidance.LLMatcher(tok.ll, llguidance.LLMatcher.grammar_from_lark(LARK), log_level=0)
    assert m.consume_tokens(ids), m.get_error()
    assert m.is_accepting() and not m.is_error(), text


def _check_choice(text: str, ids: list[int]) -> None:
    assert text in CHOICES, text


def cases() -> list[Case]:
    out = [
        Case(
            f"schema-{name}",
            common_pb2.Constraint(json_schema=json.dumps(schema)),
            chat(f"Reply with JSON for: {name.replace('_', ' ')}."),
            _check_schema(schema),
        )
        for name, schema in SCHEMAS.items()
    ]
    out.append(
        Case("regex", common_pb2.Constraint(regex=REGEX), chat("A phone number?"), _check_regex)
    )
    out.append(Case("lark", common_pb2.Constraint(lark=LARK), chat("Greet someone."), _check_lark))
    out.append(
        Case(
            "choice",
            common_pb2.Constraint(choice=common_pb2.ChoiceList(choices=CHOICES)),
            chat("What is the capital of France?"),
            _check_choice,
        )
    )
    return out


@dataclass
class Result:
    text: str
    ids: list[int]
    final: worker_pb2.GenerateResponse
    chunks: int
    messages: list[worker_pb2.GenerateResponse] = field(default_factory=list, repr=False)


async def generate(
    stub: worker_pb2_grpc.WorkerStub,
    prompt: str,
    constraint: common_pb2.Constraint | None = None,
    *,
    disable_speculation: bool = False,
    started: asyncio.Event | None = None,
    cache_salt: str = "",
    **sampling: Any,
) -> Result:
    """Run one request to its end; `started` is set when its first tokens arrive."""
    sampling.setdefault("max_tokens", 48)
    req = worker_pb2.GenerateRequest(
        text=prompt,
        sampling=worker_pb2.SamplingParams(**sampling),
        disable_speculation=disable_speculation,
        cache_salt=cache_salt,
    )
    if constraint is not None:
        req.constraint.CopyFrom(constraint)
    text, ids = "", []
    messages = []
    async for msg in stub.Generate(req):
        messages.append(msg)
        if started is not None and msg.token_ids:
            started.set()
    for msg in messages:
        text += msg.text
        ids += list(msg.token_ids)
    last = messages[-1] if messages else None
    assert last is not None and last.finish_reason != worker_pb2.FINISH_REASON_UNSPECIFIED
    return Result(text, ids, last, len(messages), messages)


def channel(address: str) -> grpc.aio.Channel:
    return grpc.aio.insecure_channel(address)
