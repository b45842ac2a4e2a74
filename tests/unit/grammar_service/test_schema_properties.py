"""Property tests of the schema layer: for generated schemas using each keyword it rewrites or
checks at run time,

* everything the mask lets a generation produce (random walks ending where EOS is allowed)
  validates against the original schema, and
* every valid instance (generated candidates that jsonschema accepts) is accepted, with each of
  its tokens allowed by its mask row: the layer never cuts a valid path.

A schema the service refuses as unsatisfiable must have no valid candidate.
"""

from __future__ import annotations

import json
import random
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from maskwire.rpc import RpcError
from maskwire.tokenizer import Tokenizer, load_tokenizer
from tests.unit.grammar_service.schema_support import compile_schema, sample, valid, walk

TOK: Tokenizer = load_tokenizer("default")
NAMES = ["p0", "p1", "p2", "p3"]
SMALL = st.integers(min_value=0, max_value=3)
SCALARS = [0, 1, 2, "a", "b", True, False, None]
PROPERTIES = {n: {"type": "integer", "minimum": 0, "maximum": 3} for n in NAMES}


def check(schema: dict[str, Any], candidates: list[Any], seed: int) -> None:
    try:
        compiled = compile_schema(schema, TOK)
    except RpcError as e:
        assert e.reason in ("EMPTY_LANGUAGE", "INVALID_CONSTRAINT"), e.message
        assert "nsatisfiable" in e.message or e.reason == "EMPTY_LANGUAGE", e.message
        assert not any(valid(schema, c) for c in candidates), (schema, e.message)
        return
    rng = random.Random(seed)
    for _ in range(4):
        text = sample(compiled, TOK, rng)
        if text:
            assert valid(schema, json.loads(text)), (schema, text)
    for value in candidates:
        if valid(schema, value):
            walked = walk(compiled, TOK, json.dumps(value))
            assert walked.accepted and walked.masked_off is None, (schema, value)


def subsets(names: list[str]) -> st.SearchStrategy[list[str]]:
    return st.lists(st.sampled_from(names), unique=True).map(
        lambda xs: [n for n in names if n in xs]
    )


# Objects over p0..p3 in their listed order (llguidance writes listed properties in order).
OBJECTS = st.lists(
    st.dictionaries(st.sampled_from(NAMES), SMALL, max_size=4).map(
        lambda d: {n: d[n] for n in NAMES if n in d}
    ),
    min_size=6,
    max_size=10,
)
SETTINGS = settings(
    max_examples=12,
    deadline=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.too_slow],
)


@SETTINGS
@given(
    deps=st.dictionaries(st.sampled_from(NAMES), subsets(NAMES), min_size=1, max_size=3),
    values=OBJECTS,
    seed=st.integers(0, 2**16),
)
def test_dependent_required(deps: dict[str, list[str]], values: list[Any], seed: int) -> None:
    schema = {"type": "object", "properties": PROPERTIES, "dependentRequired": deps}
    check(schema, values, seed)


@SETTINGS
@given(
    deps=st.dictionaries(
        st.sampled_from(NAMES),
        st.one_of(
            subsets(NAMES).map(lambda r: {"required": r}),
            st.tuples(st.sampled_from(NAMES), SMALL).map(
                lambda t: {"properties": {t[0]: {"minimum": t[1]}}}
            ),
        ),
        min_size=1,
        max_size=2,
    ),
    values=OBJECTS,
    seed=st.integers(0, 2**16),
)
def test_dependent_schemas(deps: dict[str, Any], values: list[Any], seed: int) -> None:
    schema = {"type": "object", "properties": PROPERTIES, "dependentSchemas": deps}
    check(schema, values, seed)


@SETTINGS
@given(
    form=st.one_of(
        subsets(NAMES).map(lambda r: ("object", {"required": r})),
        st.lists(
            st.sampled_from(["string", "integer", "number", "boolean", "null", "array"]),
            min_size=1,
            max_size=3,
            unique=True,
        ).map(lambda t: ("any", {"type": t})),
        st.lists(st.sampled_from(SCALARS), min_size=1, max_size=3).map(
            lambda v: ("enum", {"enum": v})
        ),
    ),
    values=OBJECTS,
    seed=st.integers(0, 2**16),
)
def test_not(form: tuple[str, dict[str, Any]], values: list[Any], seed: int) -> None:
    kind, negated = form
    if kind == "object":
        schema: dict[str, Any] = {"type": "object", "properties": PROPERTIES, "not": negated}
        candidates: list[Any] = values
    elif kind == "any":
        schema, candidates = {"not": negated}, [*SCALARS, [1], 2.5]
    else:
        schema, candidates = {"enum": SCALARS, "not": negated}, SCALARS
    check(schema, candidates, seed)


@SETTINGS
@given(
    tested=subsets(["a", "b", "c"]).filter(bool),
    then=subsets(["x", "y"]),
    other=subsets(["x", "y"]),
    required_kind=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_if_then_else(
    tested: list[str], then: list[str], other: list[str], required_kind: bool, seed: int
) -> None:
    schema = {
        "type": "object",
        "properties": {"kind": {"enum": ["a", "b", "c"]}, "x": {"type": "integer"}, "y": {}},
        "if": {
            "properties": {"kind": {"enum": tested}},
            **({"required": ["kind"]} if required_kind else {}),
        },
        "then": {"required": then},
        "else": {"required": other},
    }
    candidates = [
        {k: v for k, v in (("kind", kind), ("x", 1), ("y", 2)) if k in keys}
        for kind in ("a", "b", "c")
        for keys in (["kind"], ["kind", "x"], ["kind", "y"], ["kind", "x", "y"], ["x"], [])
    ]
    check(schema, candidates, seed)


BRANCHES = [
    {"type": "string", "maxLength": 3},
    {"type": "integer", "minimum": 0},
    {"type": "boolean"},
    {"type": "null"},
    {"type": "array", "items": {"type": "integer"}, "maxItems": 2},
    {"type": "object", "properties": {"k": {"const": "p"}}, "required": ["k"]},
    {"type": "object", "properties": {"k": {"const": "q"}, "n": {}}, "required": ["k"]},
    {"type": "integer", "maximum": 5},  # overlaps the other integers: checked at run time
]


@SETTINGS
@given(
    branches=st.lists(st.sampled_from(BRANCHES), min_size=1, max_size=4, unique_by=json.dumps),
    seed=st.integers(0, 2**16),
)
def test_one_of(branches: list[dict[str, Any]], seed: int) -> None:
    candidates = ["ab", 0, 3, 9, -1, True, None, [1], [1, 2, 3], {"k": "p"}, {"k": "q", "n": 1}]
    check({"oneOf": branches}, candidates, seed)


@SETTINGS
@given(
    items=st.one_of(
        st.lists(st.sampled_from(SCALARS), min_size=1, max_size=3).map(lambda v: {"enum": v}),
        st.just({"type": "boolean"}),
        st.just({"type": "integer", "minimum": 0, "maximum": 3}),  # open: checked at run time
        st.just({"type": "string", "maxLength": 2}),
    ),
    bounds=st.tuples(st.integers(0, 2), st.integers(0, 4)),
    arrays=st.lists(st.lists(st.sampled_from(SCALARS), max_size=4), min_size=6, max_size=10),
    seed=st.integers(0, 2**16),
)
def test_unique_items(
    items: dict[str, Any], bounds: tuple[int, int], arrays: list[Any], seed: int
) -> None:
    lo, hi = bounds
    schema = {"type": "array", "items": items, "uniqueItems": True, "minItems": lo}
    if hi >= lo:
        schema["maxItems"] = hi
    check(schema, arrays, seed)


@SETTINGS
@given(
    names=st.one_of(
        st.lists(st.sampled_from(NAMES), min_size=1, max_size=3).map(lambda v: {"enum": v}),
        st.sampled_from(
            [{"pattern": "^p[01]$"}, {"maxLength": 2}, {"pattern": "0", "maxLength": 2}]
        ),
    ),
    extra=st.sampled_from([None, True, {"type": "integer"}]),
    values=OBJECTS,
    seed=st.integers(0, 2**16),
)
def test_property_names(names: dict[str, Any], extra: Any, values: list[Any], seed: int) -> None:
    schema: dict[str, Any] = {"type": "object", "properties": {"p1": {}}, "propertyNames": names}
    if extra is not None:
        schema["additionalProperties"] = extra
    # llguidance writes the listed property first, then the others.
    check(schema, [{k: v[k] for k in sorted(v, key=lambda k: k != "p1")} for v in values], seed)


@SETTINGS
@given(
    counts=st.tuples(st.integers(0, 3), st.integers(0, 3)),
    values=OBJECTS,
    seed=st.integers(0, 2**16),
)
def test_property_counts(counts: tuple[int, int], values: list[Any], seed: int) -> None:
    lo, hi = counts
    schema = {"type": "object", "properties": PROPERTIES, "minProperties": lo, "maxProperties": hi}
    check(schema, values, seed)


@pytest.mark.parametrize("seed", range(3))
def test_contains_and_complex_not(seed: int) -> None:
    check(
        {
            "type": "array",
            "items": {"type": "integer"},
            "contains": {"minimum": 2},
            "maxContains": 1,
        },
        [[2], [0, 2], [2, 3], [], [1]],
        seed,
    )
    check(
        {"type": "object", "properties": PROPERTIES, "not": {"properties": {"p0": {"const": 1}}}},
        [{"p0": 1}, {"p0": 2}, {}],
        seed,
    )
