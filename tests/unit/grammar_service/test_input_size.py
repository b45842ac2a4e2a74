"""--max-schema-bytes counts every string of a constraint, options included, in UTF-8 bytes."""

from __future__ import annotations

from collections.abc import Iterator

import grpc
import pytest

from grammar_service.compile_pool import Compiler
from grammar_service.compiler import input_bytes
from grammar_service.config import CompileSettings, ParserLimits
from maskwire.rpc import RpcError
from maskwire.v1 import common_pb2

C = common_pb2.Constraint
LIMIT = 1000


@pytest.fixture
def compiler() -> Iterator[Compiler]:
    c = Compiler(limits=ParserLimits(), settings=CompileSettings(max_schema_bytes=LIMIT))
    yield c
    c.shutdown()


def opts(**kw: str) -> common_pb2.JsonOptions:
    return common_pb2.JsonOptions(**kw)


def test_every_string_counts_by_field() -> None:
    tags = common_pb2.StructuralTags(
        tags=[
            common_pb2.StructuralTag(begin="<a>", json_schema="{}", end="</a>"),
            common_pb2.StructuralTag(begin="<é>", json_schema="{}", end="</é>"),
        ],
        triggers=["<"],
    )
    c = C(structural_tags=tags, json_options=opts(item_separator=",", key_separator=" : "))
    assert input_bytes(c) == {
        "constraint.structural_tags.tags[0].begin": 3,
        "constraint.structural_tags.tags[0].json_schema": 2,
        "constraint.structural_tags.tags[0].end": 4,
        "constraint.structural_tags.tags[1].begin": 4,  # é is two bytes
        "constraint.structural_tags.tags[1].json_schema": 2,
        "constraint.structural_tags.tags[1].end": 5,
        "constraint.structural_tags.triggers": 1,
        "constraint.json_options.item_separator": 1,
        "constraint.json_options.key_separator": 3,
    }
    choice = C(choice=common_pb2.ChoiceList(choices=["ab", "ü"]))
    assert input_bytes(choice) == {"constraint.choice.choices": 4}


@pytest.mark.parametrize(
    ("constraint", "field"),
    [
        (C(json_object=True, json_options=opts(item_separator="," * (LIMIT + 1))), "item"),
        (C(json_schema="{}", json_options=opts(key_separator=":" * (LIMIT - 1))), "key"),
        (C(regex="ü" * (LIMIT // 2 + 1)), "regex"),
    ],
)
def test_over_the_limit_names_the_largest_field(
    compiler: Compiler, constraint: common_pb2.Constraint, field: str
) -> None:
    with pytest.raises(RpcError) as e:
        compiler.check_size(constraint)
    err = e.value
    assert err.code is grpc.StatusCode.INVALID_ARGUMENT and err.reason == "CONSTRAINT_TOO_LARGE"
    expected = {
        "item": "constraint.json_options.item_separator",
        "key": "constraint.json_options.key_separator",
        "regex": "constraint.regex",
    }[field]
    assert err.violations[0][0] == expected
    assert f"at most {LIMIT}" in err.message and "--max-schema-bytes" in err.message


def test_text_and_options_add_up(compiler: Compiler) -> None:
    half = LIMIT // 2
    compiler.check_size(C(json_schema="x" * half, json_options=opts(item_separator="," * half)))
    with pytest.raises(RpcError):
        compiler.check_size(
            C(json_schema="x" * half, json_options=opts(item_separator="," * (half + 1)))
        )
