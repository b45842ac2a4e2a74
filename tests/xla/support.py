"""Helpers for the XLA worker tests: requests, Prometheus scrapes, output checks."""

from __future__ import annotations

import asyncio
import json
import re
import urllib.request
from dataclasses import dataclass, field
from typing import Any

import grpc
import jsonschema

from maskwire.v1 import common_pb2, worker_pb2, worker_pb2_grpc
from tests.support.schemas import PERSON

COLORS = {
    "type": "object",
    "properties": {"color": {"enum": ["red", "green", "blue"]}, "ok": {"type": "boolean"}},
    "required": ["color", "ok"],
    "additionalProperties": False,
}
PHONE = r"[0-9]{3}-[0-9]{4}"
CITIES = ["Paris", "London", "Berlin"]


def chat(question: str) -> str:
    return f"<|im_start|>user\n{question}<|im_end|>\n<|im_start|>assistant\n"


@dataclass(frozen=True)
class Case:
    """One request of the mixed workload."""

    name: str
    prompt: str
    constraint: common_pb2.Constraint | None = None
    sampling: dict[str, Any] = field(default_factory=dict)

    @property
    def greedy(self) -> bool:
        return not self.sampling.get("temperature")


def mixed_cases() -> list[Case]:
    """Constrained (schema, regex, choice) and unconstrained (greedy, ignore_eos, sampled)."""
    return [
        Case(
            "schema-person", chat("Give me a person as JSON."), _c(json_schema=json.dumps(PERSON))
        ),
        Case("plain-raw", "The capital of France is"),
        Case("regex-phone", chat("A phone number?"), _c(regex=PHONE)),
        Case("plain-chat", chat("What is the capital of France?")),
        Case(
            "choice-city",
            chat("What is the capital of Germany?"),
            _c(choice=common_pb2.ChoiceList(choices=CITIES)),
        ),
        Case("schema-colors", chat("Pick a color, as JSON."), _c(json_schema=json.dumps(COLORS))),
        Case("plain-ignore-eos", chat("Say OK."), sampling={"ignore_eos": True, "max_tokens": 12}),
        Case(
            "plain-sampled",
            chat("Name a fruit."),
            sampling={"temperature": 0.8, "top_p": 0.9, "seed": 7, "max_tokens": 12},
        ),
        Case(
            "plain-top-k",
            chat("Name a color."),
            sampling={"temperature": 1.0, "top_k": 5, "seed": 11, "max_tokens": 12},
        ),
    ]


def _c(**kw: Any) -> common_pb2.Constraint:
    return common_pb2.Constraint(**kw)


@dataclass
class Output:
    ids: list[int]
    text: str
    finish_reason: int
    cached_prompt_tokens: int = 0  # prompt tokens the prefix cache held


async def generate(address: str, case: Case, max_tokens: int = 24) -> Output:
    sampling = {"max_tokens": max_tokens, **case.sampling}
    req = worker_pb2.GenerateRequest(
        text=case.prompt, sampling=worker_pb2.SamplingParams(**sampling)
    )
    if case.constraint is not None:
        req.constraint.CopyFrom(case.constraint)
    ids: list[int] = []
    text = ""
    reason = worker_pb2.FINISH_REASON_UNSPECIFIED
    cached = 0
    async with grpc.aio.insecure_channel(address) as ch:
        async for msg in worker_pb2_grpc.WorkerStub(ch).Generate(req):
            ids += list(msg.token_ids)
            text += msg.text
            reason = msg.finish_reason
            cached = msg.usage.cached_prompt_tokens or cached
    return Output(ids, text, reason, cached)


async def generate_all(address: str, cases: list[Case]) -> dict[str, Output]:
    """All cases concurrently (they share decode steps and batch buckets)."""
    outs = await asyncio.gather(*(generate(address, c) for c in cases))
    return {c.name: o for c, o in zip(cases, outs, strict=True)}


def check_constrained(case: Case, out: Output) -> None:
    """A constrained output satisfies its constraint and ends because the grammar ended."""
    assert case.constraint is not None
    assert out.finish_reason == worker_pb2.FINISH_REASON_STOP, (case.name, out.text)
    kind = case.constraint.WhichOneof("kind")
    if kind == "json_schema":
        jsonschema.validate(json.loads(out.text), json.loads(case.constraint.json_schema))
    elif kind == "regex":
        assert re.fullmatch(case.constraint.regex, out.text), out.text
    elif kind == "choice":
        assert out.text in case.constraint.choice.choices, out.text
    else:
        raise AssertionError(f"unchecked constraint kind {kind}")


def scrape(metrics_port: int) -> dict[str, float]:
    """The worker's Prometheus series without labels, by name."""
    with urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=10) as r:
        text = r.read().decode()
    out: dict[str, float] = {}
    for line in text.splitlines():
        if line and not line.startswith("#") and "{" not in line:
            name, value = line.rsplit(" ", 1)
            out[name] = float(value)
    return out
