"""Catalogue cases for hostile constraints, grammar side: chains deep enough
to overflow the grammar compiler's native stack, a constraint that crashes the compiler (the
test-only fault hook the catalogue's grammar service runs with), ambiguous grammars whose parser
work explodes, errors that quote a huge input, and compiles that try to starve the others.

After each case the catalogue checks that every service is the *same* process, healthy, and
still answers known-good requests.
"""

from __future__ import annotations

import json
from typing import Any

import grpc

from maskwire.tokenizer import Tokenizer
from maskwire.v1 import common_pb2, grammar_pb2
from tests.robustness.catalogue import (
    IA,
    SCHEMA_PARAM,
    ActionCase,
    GrammarCase,
    HttpCase,
    WorkerCase,
    _compile,
    _open,
    _row,
    _step,
    chat,
    gen,
    schema_body,
)

# The catalogue's grammar service runs with --testing-faults and MASKWIRE_TESTING_FAULT set to these.
CRASH_MARKER = "catalogue-compile-worker-abort"
HANG_MARKER = "catalogue-compile-worker-hang"
FAULTS = f"sandbox:abort:{CRASH_MARKER};sandbox:hang:{HANG_MARKER}"
COMPILE_TIMEOUT_S = 4.0  # the catalogue grammar service's --compile-timeout-s

C = common_pb2.Constraint
AMBIGUOUS = 'start: s\ns: s s s | s s | "a" | ""'


def ref_chain(n: int) -> dict[str, Any]:
    defs: dict[str, Any] = {
        f"d{i}": {"type": "array", "items": {"$ref": f"#/$defs/d{i + 1}"}} for i in range(n)
    }
    defs[f"d{n}"] = {"type": "integer"}
    return {"$ref": "#/$defs/d0", "$defs": defs}


def properties_chain(n: int) -> str:
    """`{"type":"object","properties":{"a": ...}}` nested `n` deep, as JSON text."""
    return '{"type":"object","properties":{"a":' * n + '{"type":"integer"}' + "}}" * n


def lark_chain(n: int) -> str:
    return "start: r0\n" + "".join(f"r{i}: r{i + 1}\n" for i in range(n)) + f'r{n}: "a"\n'


def crash_schema() -> dict[str, Any]:
    return {"type": "object", "description": CRASH_MARKER}


def _choice_check(choices: list[str]) -> Any:
    def check(body: dict[str, Any]) -> None:
        choice = body["choices"][0]
        assert choice["finish_reason"] == "stop", choice
        assert choice["message"]["content"] in choices, choice

    return check


CHOICES_3000 = [f"option {i}" for i in range(3000)]
LONG_BAD_REGEX = "(" + "é" * 100_000 + "["

HTTP_CASES: list[HttpCase] = [
    HttpCase(
        "schema-ref-chain-3000",
        schema_body(ref_chain(3000)),
        400,
        "constraint_too_complex",
        SCHEMA_PARAM,
        message="--max-schema-depth",
    ),
    HttpCase(
        "lark-rule-chain-3000",
        chat(structured_outputs={"grammar": lark_chain(3000)}),
        400,
        "constraint_too_complex",
        "structured_outputs.grammar",
        message="--max-grammar-depth",
    ),
    HttpCase(
        "schema-crashes-the-compiler",
        schema_body(crash_schema()),
        400,
        "constraint_crashed",
        SCHEMA_PARAM,
        message="crashed a compile worker",
    ),
    HttpCase(
        "choice-3000-items",
        chat(structured_outputs={"choice": CHOICES_3000}, max_tokens=8),
        200,
        check=_choice_check(CHOICES_3000),
    ),
    HttpCase(
        "regex-100k-invalid",
        chat(structured_outputs={"regex": LONG_BAD_REGEX}),
        400,
        "invalid_constraint",
        "structured_outputs.regex",
        message="chars in all",
    ),
]

WORKER_CASES: list[WorkerCase] = [
    WorkerCase(
        "schema-ref-chain-3000",
        gen(constraint=C(json_schema=json.dumps(ref_chain(3000)))),
        IA,
        "CONSTRAINT_TOO_COMPLEX",
        "constraint.json_schema",
    ),
    WorkerCase(
        "schema-crashes-the-compiler",
        gen(constraint=C(json_schema=json.dumps(crash_schema()))),
        IA,
        "CONSTRAINT_CRASHED",
        "constraint.json_schema",
    ),
    WorkerCase(
        "regex-100k-invalid",
        gen(constraint=C(regex=LONG_BAD_REGEX)),
        IA,
        "INVALID_CONSTRAINT",
        "constraint.regex",
    ),
]


def _ambiguous_open(t: Tokenizer, replay: list[int] | None = None) -> grammar_pb2.SessionRequest:
    return _open(t, rid="amb", constraint=C(lark=AMBIGUOUS), replay_tokens=replay or [])


GRAMMAR_CASES: list[GrammarCase] = [
    GrammarCase(
        "compile-ref-chain-3000",
        "compile",
        lambda t: _compile(t, constraint=C(json_schema=json.dumps(ref_chain(3000)))),
        IA,
        field="constraint.json_schema",
    ),
    GrammarCase(
        "compile-properties-chain-3000",
        "compile",
        lambda t: _compile(t, constraint=C(json_schema=properties_chain(3000))),
        IA,
        field="constraint.json_schema",
    ),
    GrammarCase(
        "compile-lark-chain-3000",
        "compile",
        lambda t: _compile(t, constraint=C(lark=lark_chain(3000))),
        IA,
        field="constraint.lark",
    ),
    GrammarCase(
        "compile-gbnf-chain-3000",
        "compile",
        lambda t: _compile(
            t,
            constraint=C(
                gbnf="root ::= r0\n"
                + "".join(f"r{i} ::= r{i + 1}\n" for i in range(3000))
                + 'r3000 ::= "a"\n'
            ),
        ),
        IA,
        field="constraint.gbnf",
    ),
    GrammarCase(
        "compile-crashes-the-compiler",
        "compile",
        lambda t: _compile(t, constraint=C(regex=CRASH_MARKER + "[a-z]+")),
        IA,
        field="constraint.regex",
    ),
    GrammarCase(
        "compile-huge-invalid-regex",
        "compile",
        lambda t: _compile(t, constraint=C(regex=LONG_BAD_REGEX)),
        IA,
        field="constraint.regex",
    ),
    GrammarCase(
        "open-crashes-the-compiler",
        "session",
        lambda t: [_open(t, rid="crash", constraint=C(regex=CRASH_MARKER + "x"))],
        opened=(IA, "CONSTRAINT_CRASHED"),
    ),
    GrammarCase(
        "step-ambiguous-grammar-past-budget",
        "session",
        lambda t: [_ambiguous_open(t), _step(_row("amb", 400, t.encode("a") * 400))],
        row=(grammar_pb2.ROW_STATUS_ERROR, "GRAMMAR_TOO_EXPENSIVE"),
    ),
    GrammarCase(
        "open-replay-past-budget",
        "session",
        lambda t: [_ambiguous_open(t, t.encode("a") * 2000)],
        opened=(IA, "GRAMMAR_TOO_EXPENSIVE"),
    ),
]

ACTION_CASES: list[ActionCase] = [
    ActionCase("grammar-hanging-compiles-do-not-starve-others", "grammar", "compile_starvation"),
]


def hang_constraint(i: int) -> common_pb2.Constraint:
    return C(regex=f"{HANG_MARKER}{i}[a-z]")


EXPECT_HANG = grpc.StatusCode.DEADLINE_EXCEEDED
