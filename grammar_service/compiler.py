"""Constraint -> llguidance grammar, in stages: translate, bound, verify, build.

* `translate` turns a `Constraint` into an llguidance grammar string and checks its shape against
  `ConstraintBounds` (cheap, in-process, no native recursion).
* `verify` runs the grammar compiler on it: validation, a matcher, its first mask. This is where
  hostile grammars crash or run away, so the service runs it in the compile sandbox
  (`grammar_service.sandbox`: child processes with a deadline and a memory limit).
* `build_template` makes the service's own template matcher from a verified grammar.

Every error a client can cause becomes an `RpcError(INVALID_ARGUMENT)` whose `google.rpc.BadRequest`
field violations name the constraint field and say what is wrong (llguidance's message, which
carries the line/column or JSON pointer). Nothing here raises anything else for bad input.
"""

from __future__ import annotations

import copy
import hashlib
import json
import math
import os
import sys
import time
from dataclasses import dataclass
from typing import Any

import grpc
import llguidance
from google.protobuf.message import Message

from grammar_service import bounds as shape
from grammar_service.config import ConstraintBounds, ParserLimits
from grammar_service.json_options import (
    DEFAULT_ITEM_SEPARATOR,
    DEFAULT_KEY_SEPARATOR,
    strict_contradiction,
)
from grammar_service.json_options import forbid_additional_properties as _forbid
from grammar_service.schema import formats, metaschema
from grammar_service.schema.checks import OutputChecks
from grammar_service.schema.fallbacks import next_fallback
from grammar_service.schema.layer import grammar_keywords, prepare
from grammar_service.schema.report import Refused, Report
from maskwire.rpc import RpcError
from maskwire.tokenizer import Tokenizer
from maskwire.v1 import common_pb2

KINDS = ("json_schema", "regex", "lark", "gbnf", "choice", "json_object", "structural_tags")
STRICT = common_pb2.SCHEMA_MODE_STRICT
COMPLETE = common_pb2.SCHEMA_MODE_COMPLETE


def ll_limits(limits: ParserLimits) -> llguidance.LLParserLimits:
    """`limits` as llguidance takes them."""
    # verbose_errors=False: errors name the problem without dumping parser state and grammar.
    return llguidance.LLParserLimits(
        max_items_in_row=limits.max_items_in_row,
        initial_lexer_fuel=limits.initial_lexer_fuel,
        step_lexer_fuel=limits.step_lexer_fuel,
        step_max_items=limits.step_max_items,
        max_lexer_states=limits.max_lexer_states,
        max_grammar_size=limits.max_grammar_size,
        verbose_errors=False,
    )


@dataclass(frozen=True)
class CompiledGrammar:
    """A validated grammar for one tokenizer; `template` is a fresh matcher that requests copy."""

    grammar_id: str
    grammar: str
    tokenizer: Tokenizer
    warnings: tuple[str, ...]
    template: llguidance.LLMatcher
    compile_ms: float
    # JSON schemas: how each keyword is enforced, and the output check (complete mode).
    report: common_pb2.SchemaReport | None = None
    checks: OutputChecks | None = None

    def new_matcher(self) -> llguidance.LLMatcher:
        # deep_copy of a fresh matcher is ~1 µs; building one from the grammar string is ~50 µs+.
        return self.template.deep_copy()


def clean_error(message: str) -> str:
    """llguidance error text without its non-verbose marker and trailing blank lines."""
    return message.replace("<non-verbose/>", "").strip()


def constraint_kind(constraint: common_pb2.Constraint) -> str:
    kind = constraint.WhichOneof("kind")
    if kind is None:
        raise RpcError(
            grpc.StatusCode.INVALID_ARGUMENT,
            "constraint has no kind set",
            [("constraint", f"set exactly one of {', '.join(KINDS)}")],
        )
    return kind


def input_bytes(constraint: common_pb2.Constraint) -> dict[str, int]:
    """UTF-8 bytes of every string a constraint carries, by field path: its text and every
    option (separators included), which --max-schema-bytes limits together. Repeated strings
    add up under their field (`constraint.choice.choices`); repeated messages are indexed."""
    out: dict[str, int] = {}
    _add_input_bytes(constraint, "constraint", out)
    return out


def _add_input_bytes(msg: Message, path: str, out: dict[str, int]) -> None:
    for fd, value in msg.ListFields():
        where = f"{path}.{fd.name}"
        if isinstance(value, Message):
            _add_input_bytes(value, where, out)
        elif fd.type == fd.TYPE_MESSAGE:  # repeated
            for i, sub in enumerate(value):
                _add_input_bytes(sub, f"{where}[{i}]", out)
        elif fd.type in (fd.TYPE_STRING, fd.TYPE_BYTES):
            values = (value,) if isinstance(value, (str, bytes)) else value
            out[where] = out.get(where, 0) + sum(
                len(v.encode()) if isinstance(v, str) else len(v) for v in values
            )


def grammar_key(constraint: common_pb2.Constraint, tokenizer: Tokenizer) -> str:
    """Stable id of (constraint + options, tokenizer): the compile cache key and `grammar_id`."""
    h = hashlib.sha256()
    h.update(tokenizer.fingerprint.tokens_sha256)
    h.update(constraint.SerializeToString(deterministic=True))
    return h.hexdigest()[:32]


def _bad(field: str, description: str, message: str = "") -> RpcError:
    return RpcError(
        grpc.StatusCode.INVALID_ARGUMENT,
        message or f"invalid {field}: {description}",
        [(field, description)],
        reason="INVALID_CONSTRAINT",
    )


def _json_options(opts: common_pb2.JsonOptions) -> dict[str, Any]:
    """Our JsonOptions as llguidance's `x-guidance` options."""
    flexible = bool(opts.whitespace_flexible)
    # Flexible whitespace already allows spaces around separators: default to the bare ones then.
    item = opts.item_separator if opts.HasField("item_separator") else None
    key = opts.key_separator if opts.HasField("key_separator") else None
    if item is None:
        item = "," if flexible else DEFAULT_ITEM_SEPARATOR
    if key is None:
        key = ":" if flexible else DEFAULT_KEY_SEPARATOR
    return {
        "whitespace_flexible": flexible,
        "item_separator": item,
        "key_separator": key,
        "coerce_one_of": bool(opts.coerce_one_of),
        "lenient": bool(opts.lenient),
    }


def _parse_json(text: str, field: str) -> Any:
    try:
        return json.loads(text, parse_constant=_no_number, parse_float=_float, parse_int=_int)
    except json.JSONDecodeError as e:
        raise _bad(field, f"not valid JSON: {e.msg} at line {e.lineno} column {e.colno}") from None
    except RecursionError:
        raise _bad(field, "not valid JSON: nested too deeply") from None
    except ValueError as e:  # a number the grammar compiler cannot read (below)
        raise _bad(field, f"not valid JSON: {e}") from None


# Numbers as llguidance reads them: NaN and Infinity are no JSON, and a number past a double's
# range (1e999, a 400-digit integer) is refused by its parser; Python takes all three.
def _no_number(name: str) -> Any:
    raise ValueError(f"{name} is not a JSON number")


def _float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise _out_of_range(text)
    return value


def _int(text: str) -> int:
    if len(text.lstrip("-").lstrip("0")) > 309:  # past 1e309 (and int() refuses 4300 digits)
        raise _out_of_range(text)
    value = int(text)
    if abs(value) > sys.float_info.max:
        raise _out_of_range(text)
    return value


def _out_of_range(text: str) -> ValueError:
    shown = text if len(text) <= 40 else f"{text[:40]}... ({len(text)} characters)"
    return ValueError(f"the number {shown} is out of range (beyond a double's, about 1.8e308)")


def _prepare_schema(
    value: Any, opts: common_pb2.JsonOptions, field: str, bounds: ConstraintBounds
) -> dict[str, Any]:
    # Boolean schemas: `true` is `{}` (which can carry the layout options); `false` admits nothing.
    if value is True:
        return {}
    if value is False:
        raise _bad(field, "Unsatisfiable schema: the schema is `false`, no value satisfies it")
    if not isinstance(value, dict):
        raise _bad(
            field, f"a JSON Schema must be an object or a boolean, got {type(value).__name__}"
        )
    shape.check_schema(value, field, bounds)
    invalid = metaschema.problem(value)  # bounded above: linear in the schema
    if invalid is not None:
        raise _bad(field, str(invalid))
    if opts.additional_properties == common_pb2.ADDITIONAL_PROPERTIES_FORBID:
        closed: list[str] = []
        value = _forbid(copy.deepcopy(value), closed)
        found = strict_contradiction(value, closed)
        if found is not None:
            where, name = found
            raise _bad(
                field,
                f"required property {name!r} at {where} is not listed in 'properties', and strict "
                "mode allows no other properties: list it in 'properties' or drop 'strict'",
            )
    return value


@dataclass(frozen=True)
class Translation:
    """A constraint as an llguidance grammar, with what the schema layer says about it."""

    grammar: str
    report: common_pb2.SchemaReport | None = None
    checks: OutputChecks | None = None


def schema_mode(opts: common_pb2.JsonOptions, default: int) -> int:
    """The request's schema mode, else the service's."""
    return opts.schema_mode or default


def _layer(
    schema: dict[str, Any],
    mode: int,
    field: str,
    bounds: ConstraintBounds,
    *,
    runtime: bool,
    relax: frozenset[str],
    lenient: bool = False,
) -> tuple[dict[str, Any], Report, dict[str, frozenset[str]]]:
    """The schema as llguidance gets it, the report, and the keywords to check on the output by
    location; `runtime`: the output check exists; `lenient`: llguidance's option (strict mode)."""
    try:
        if mode == STRICT:
            formats.check_strict(schema, lenient)
            return schema, Report(mode=STRICT, grammar=grammar_keywords(schema)), {}
        prepared = prepare(schema, COMPLETE, runtime=runtime, relax=relax)
    except Refused as e:
        raise RpcError(
            grpc.StatusCode.INVALID_ARGUMENT,
            f"invalid {field}: {e}",
            [(field, str(e))],
            reason="UNSUPPORTED_CONSTRAINT",
        ) from None
    shape.check_schema(prepared.schema, field, bounds)  # rewrites nest a few levels deeper
    return prepared.schema, prepared.report, prepared.runtime


def _json_grammar(schema: dict[str, Any], opts: common_pb2.JsonOptions) -> str:
    # Our options are llguidance's *defaults*: a schema's own `x-guidance` keyword refines them.
    return str(
        llguidance.LLMatcher.grammar_from_json_schema(
            json.dumps(schema),
            defaults=_json_options(opts),  # type: ignore[arg-type]
        )
    )


def _lark_string(text: str) -> str:
    return json.dumps(text)


def _choice_grammar(choices: list[str]) -> str:
    # One terminal whose alternatives are the choices: the lexer matches them with one automaton
    # (a trie), so 100,000 choices compile in about a second. As parser alternatives
    # (`start: "a" | "b" | ...`) each choice would be an Earley item in the first row, past the
    # parser's `max_items_in_row` at a few thousand and minutes to compile at 100,000.
    return "start: CHOICE\nCHOICE: " + " | ".join(_lark_string(c) for c in choices)


def _is_special_single_token(trigger: str, tokenizer: Tokenizer) -> bool:
    ids = tokenizer.ll.tokenize_str(trigger, parse_special=True)
    return len(ids) == 1 and bool(tokenizer.ll.is_special_token(ids[0]))


def _structural_tags_grammar(
    st: common_pb2.StructuralTags,
    opts: common_pb2.JsonOptions,
    tokenizer: Tokenizer,
    bounds: ConstraintBounds,
    mode: int,
    relax: frozenset[str],
) -> Translation:
    if not st.tags:
        raise _bad("constraint.structural_tags.tags", "at least one tag is required")
    triggers = list(st.triggers)
    for i, t in enumerate(triggers):
        if not t:
            raise _bad(f"constraint.structural_tags.triggers[{i}]", "a trigger must not be empty")
    tags: list[llguidance.StructTag] = []
    report = Report(mode=mode)
    for i, tag in enumerate(st.tags):
        field = f"constraint.structural_tags.tags[{i}]"
        if not tag.begin:
            raise _bad(f"{field}.begin", "must not be empty")
        if triggers:
            matching = [t for t in triggers if tag.begin.startswith(t)]
            if not matching:
                raise _bad(f"{field}.begin", f"{tag.begin!r} starts with none of the triggers")
            trigger = max(matching, key=len)
        else:
            trigger = tag.begin  # no triggers given: each tag triggers on its own `begin`
        if not tag.json_schema:
            raise _bad(f"{field}.json_schema", "must not be empty")
        schema = _prepare_schema(
            _parse_json(tag.json_schema, f"{field}.json_schema"),
            opts,
            f"{field}.json_schema",
            bounds,
        )
        # Tagged segments sit inside free text: no output check there, so no run-time keywords.
        schema, tag_report, _ = _layer(
            schema,
            mode,
            f"{field}.json_schema",
            bounds,
            runtime=False,
            relax=relax,
            lenient=opts.lenient,
        )
        report.grammar |= tag_report.grammar
        report.entries.extend((k, f"tags[{i}]{w}", h, d) for k, w, h, d in tag_report.entries)
        schema = {
            **schema,
            "x-guidance": {**_json_options(opts), **schema.get("x-guidance", {})},
        }
        begin = tag.begin
        ref = _special_token_ref(trigger, tokenizer)
        if ref is not None:
            trigger, begin = ref, ref + begin[len(trigger) :]
        tags.append(
            llguidance.StructTag(
                trigger=trigger, begin=begin, grammar=json.dumps(schema), end=tag.end
            )
        )
    # `assume_special` writes a `<...>` trigger as a special-token reference: only correct when the
    # trigger really is one special token of this tokenizer (SmolLM2's `<tool_call>` is not).
    special = all(
        t.trigger.startswith("<[")  # a `_special_token_ref`
        or _is_special_single_token(t.trigger, tokenizer)
        or not _looks_special(t.trigger)
        for t in tags
    )
    grammar = str(llguidance.StructTag.to_grammar(tags, assume_special=special))
    return Translation(grammar, report.to_proto())


def _special_token_ref(trigger: str, tokenizer: Tokenizer) -> str | None:
    """`<[id]>` for a trigger that is one special token whose text is not `<...>` (Mistral's
    `[TOOL_CALLS]`): Lark names such a token by id only, and as text it would never match it."""
    if _looks_special(trigger):
        return None
    token = tokenizer.special_token(trigger)
    return None if token is None else f"<[{token}]>"


def _looks_special(trigger: str) -> bool:
    return trigger.startswith("<") and trigger.endswith(">")


def translate(
    constraint: common_pb2.Constraint,
    tokenizer: Tokenizer,
    bounds: ConstraintBounds = ConstraintBounds(),  # noqa: B008 (frozen, immutable)
    default_mode: int = COMPLETE,
    relax: frozenset[str] = frozenset(),
) -> Translation:
    """Translate a constraint into an llguidance grammar string and check its shape (`bounds`);
    not yet validated by the grammar compiler. JSON schemas go through the schema layer in
    complete mode (`default_mode` unless the request says; `relax`: its fallbacks)."""
    kind = constraint_kind(constraint)
    opts = constraint.json_options
    mode = schema_mode(opts, default_mode)
    if kind == "json_schema":
        field = "constraint.json_schema"
        if not constraint.json_schema.strip():
            raise _bad(field, "must not be empty")
        original = _prepare_schema(_parse_json(constraint.json_schema, field), opts, field, bounds)
        schema, report, runtime = _layer(
            original, mode, field, bounds, runtime=True, relax=relax, lenient=opts.lenient
        )
        checks = OutputChecks(original, runtime) if mode == COMPLETE else None
        return Translation(_json_grammar(schema, opts), report.to_proto(), checks)
    if kind == "json_object":
        if not constraint.json_object:
            raise _bad("constraint.json_object", "must be true when set")
        return Translation(_json_grammar({"type": "object"}, opts))
    if kind == "structural_tags":
        return _structural_tags_grammar(
            constraint.structural_tags, opts, tokenizer, bounds, mode, relax
        )
    return Translation(_grammar(constraint, kind, bounds))


def _grammar(constraint: common_pb2.Constraint, kind: str, bounds: ConstraintBounds) -> str:
    """The grammar of a regex, Lark, GBNF or choice constraint."""
    if kind == "regex":
        return str(llguidance.LLMatcher.grammar_from_regex(constraint.regex))
    if kind == "lark":
        if not constraint.lark.strip():
            raise _bad("constraint.lark", "must not be empty")
        shape.check_grammar(constraint.lark, "constraint.lark", bounds)
        return str(llguidance.LLMatcher.grammar_from_lark(constraint.lark))
    if kind == "gbnf":
        if not constraint.gbnf.strip():
            raise _bad("constraint.gbnf", "must not be empty")
        from llguidance.gbnf_to_lark import any_to_lark

        try:
            lark = any_to_lark(constraint.gbnf)
        except RecursionError:
            raise _bad("constraint.gbnf", "cannot convert GBNF: nested too deeply") from None
        except Exception as e:  # the converter raises plain exceptions with a position in the text
            raise _bad("constraint.gbnf", f"cannot convert GBNF: {e}") from None
        shape.check_grammar(lark, "constraint.gbnf", bounds)
        return str(llguidance.LLMatcher.grammar_from_lark(lark))
    choices = list(constraint.choice.choices)
    if not choices:
        raise _bad("constraint.choice.choices", "at least one choice is required")
    shape.check_choices(len(choices), "constraint.choice.choices", bounds)
    for i, c in enumerate(choices):
        if not c:
            raise _bad(f"constraint.choice.choices[{i}]", "a choice must not be empty")
    return str(llguidance.LLMatcher.grammar_from_lark(_choice_grammar(choices)))


def error_field(kind: str) -> str:
    """The request field a problem with a constraint of this kind is reported against."""
    return {
        "choice": "constraint.choice.choices",
        "structural_tags": "constraint.structural_tags",
    }.get(kind, f"constraint.{kind}")


def _rejected(field: str, detail: str) -> RpcError:
    unsupported = "Unimplemented keys" in detail or "not supported" in detail
    return RpcError(
        grpc.StatusCode.INVALID_ARGUMENT,
        f"invalid {field}: {detail}",
        [(field, detail)],
        reason="UNSUPPORTED_CONSTRAINT" if unsupported else "INVALID_CONSTRAINT",
    )


# A test hook, armed only by the grammar service's test-only `--testing-faults` flag:
# `MASKWIRE_TESTING_FAULT=WHERE:ACTION:TEXT[;...]`, WHERE `sandbox` (a compile-sandbox child) or
# `service` (the service process), ACTION `abort` or `hang`: that process aborts or hangs while
# compiling a grammar that contains TEXT, so the crash and runaway defences can be tested without
# depending on whichever input breaks llguidance today. The variable alone does nothing: where it
# happens to be set, a request carrying TEXT still cannot crash a service started without the flag.
TESTING_FAULT_ENV = "MASKWIRE_TESTING_FAULT"
_armed_faults: list[str] = []  # the specs of this process, set by `arm_testing_faults`


def arm_testing_faults(spec: str) -> None:
    """Arm the hook in this process with `spec` (the service does at start with
    `--testing-faults`; a sandbox child with what its parent armed)."""
    _armed_faults[:] = [s for s in spec.split(";") if s]


def testing_fault_point(where: str, grammar: str) -> None:
    for spec in _armed_faults:
        at, action, text = [*spec.split(":", 2), "", ""][:3]
        if at == where and text and text in grammar:
            if action == "hang":
                time.sleep(3600)
            os.abort()


@dataclass(frozen=True)
class Verified:
    """What `verify` learnt about a grammar: it compiles, and its warnings."""

    warnings: tuple[str, ...]
    matcher: llguidance.LLMatcher | None = None  # the matcher it built (only in-process)


def verify(grammar: str, tokenizer: Tokenizer, limits: ParserLimits, field: str) -> Verified:
    """Run the grammar compiler on `grammar` the way serving will: validate it, build a matcher
    and compute its first mask and forced tokens, so that a grammar past the parser's limits is
    refused now with INVALID_ARGUMENT instead of failing its first request step."""
    testing_fault_point("sandbox", grammar)
    parser_limits = ll_limits(limits)
    is_error, messages = llguidance.LLMatcher.validate_grammar_with_warnings(
        grammar, tokenizer.ll, limits=parser_limits
    )
    if is_error:
        raise _rejected(field, clean_error(messages[0] if messages else "invalid grammar"))
    matcher = llguidance.LLMatcher(tokenizer.ll, grammar, log_level=0, limits=parser_limits)
    probe = matcher.deep_copy()
    if not probe.is_error():
        probe.compute_bitmask()
        probe.compute_ff_tokens()
    if probe.is_error():
        detail = clean_error(probe.get_error())
        if detail.startswith("NoExtensionBias"):  # no token can start the output
            raise RpcError(
                grpc.StatusCode.INVALID_ARGUMENT,
                "the constraint matches no output at all (its language is empty)",
                [(field, "matches nothing")],
                reason="EMPTY_LANGUAGE",
            )
        raise _rejected(field, detail)
    return Verified(tuple(clean_error(w) for w in messages), matcher)


def build_template(grammar: str, tokenizer: Tokenizer, limits: ParserLimits, field: str) -> Any:
    """The service's template matcher for a grammar that `verify` accepted (in the sandbox)."""
    testing_fault_point("service", grammar)
    template = llguidance.LLMatcher(tokenizer.ll, grammar, log_level=0, limits=ll_limits(limits))
    if template.is_error():
        raise _rejected(field, clean_error(template.get_error()))
    return template


def retry_relaxed(
    err: RpcError, relax: frozenset[str], constraint: common_pb2.Constraint, default_mode: int
) -> frozenset[str]:
    """The schema layer's fallbacks to translate again with after the grammar compiler refused
    a prepared schema with `err` (`schema.fallbacks`); re-raises `err` when there is none left
    to try."""
    kind = constraint.WhichOneof("kind")
    if kind in ("json_schema", "structural_tags") and (
        schema_mode(constraint.json_options, default_mode) == COMPLETE
    ):
        name = next_fallback(err.message, relax)
        if name is not None:
            return relax | {name}
    raise err


def compile_constraint(
    constraint: common_pb2.Constraint,
    tokenizer: Tokenizer,
    limits: ParserLimits,
    grammar_id: str = "",
    bounds: ConstraintBounds = ConstraintBounds(),  # noqa: B008 (frozen, immutable)
    default_mode: int = COMPLETE,
) -> CompiledGrammar:
    """Translate, verify and build the template in this process (blocking): for tests, tools and
    `--no-compile-sandbox`. The service's `Compiler` runs the same stages with `verify` sandboxed."""
    t0 = time.perf_counter()
    field = error_field(constraint_kind(constraint))
    relax: frozenset[str] = frozenset()
    while True:
        translation = translate(constraint, tokenizer, bounds, default_mode, relax)
        try:
            checked = verify(translation.grammar, tokenizer, limits, field)
            break
        except RpcError as e:
            relax = retry_relaxed(e, relax, constraint, default_mode)
    assert checked.matcher is not None
    return CompiledGrammar(
        grammar_id=grammar_id or grammar_key(constraint, tokenizer),
        grammar=translation.grammar,
        tokenizer=tokenizer,
        warnings=checked.warnings,
        template=checked.matcher,
        compile_ms=(time.perf_counter() - t0) * 1000.0,
        report=translation.report,
        checks=translation.checks,
    )
