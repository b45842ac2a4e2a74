"""Run JSON text through a compiled schema the way a session does: grammar plus output check, one
token at a time, each checked against the (filtered) mask row before it is consumed."""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from typing import Any

import numpy as np

from grammar_service.compiler import COMPLETE, CompiledGrammar, compile_constraint
from grammar_service.config import ParserLimits
from grammar_service.schema.checks import new_validator
from grammar_service.schema.monitor import Monitor, token_classes
from maskwire.tokenizer import Tokenizer
from maskwire.v1 import common_pb2


def compile_schema(
    schema: Any, tok: Tokenizer, mode: int = COMPLETE, **options: Any
) -> CompiledGrammar:
    opts = common_pb2.JsonOptions(schema_mode=mode, **options)
    constraint = common_pb2.Constraint(json_schema=json.dumps(schema), json_options=opts)
    return compile_constraint(constraint, tok, ParserLimits())


def valid(schema: Any, value: Any) -> bool:
    """The rule's validator: jsonschema for the schema's draft, format checking on."""
    return bool(new_validator(schema).is_valid(value))


class Follower:
    """One request's grammar and output check."""

    def __init__(self, compiled: CompiledGrammar, tok: Tokenizer) -> None:
        self.tok = tok
        self.matcher = compiled.new_matcher()
        self.monitor = Monitor(compiled.checks, token_classes(tok)) if compiled.checks else None

    def row(self) -> np.ndarray:
        """The next mask row (uint32 words) with the output check applied."""
        row = np.zeros(self.tok.words_per_row, dtype=np.uint32)
        self.matcher.unsafe_compute_mask_ptr(row.ctypes.data, row.nbytes)
        if self.monitor is not None:
            self.monitor.filter(row)
        return row

    def consume(self, token: int) -> bool:
        if not self.matcher.consume_token(token):
            return False
        return self.monitor is None or self.monitor.feed([token]) is None

    def accepting(self) -> bool:
        return any(allowed(self.row(), e) for e in self.tok.eos_token_ids)


def allowed(row: np.ndarray, token: int) -> bool:
    return bool((int(row[token >> 5]) >> (token & 31)) & 1)


@dataclass
class Walked:
    accepted: bool  # every token consumed and the output may end there
    masked_off: int | None  # index of the first token its mask row did not allow


def walk(compiled: CompiledGrammar, tok: Tokenizer, text: str) -> Walked:
    f = Follower(compiled, tok)
    masked_off = None
    for i, t in enumerate(tok.ll.tokenize_str(text)):
        if masked_off is None and not allowed(f.row(), t):
            masked_off = i
        if not f.consume(t):
            return Walked(False, masked_off)
    return Walked(f.accepting(), masked_off)


@dataclass
class Sampled:
    text: str  # the tokens' text
    end: str  # "eos": EOS allowed and taken; "dead_end": the mask allowed nothing; "limit"


def sample(
    compiled: CompiledGrammar, tok: Tokenizer, rng: random.Random, limit: int = 48
) -> Sampled:
    """A random walk through what the mask allows, ending at EOS when allowed (with some
    probability), where the mask allows no token at all, or after `limit` tokens. Short and
    structural tokens are preferred, so that outputs end within the limit."""
    classes = token_classes(tok)
    short, structural = _token_kinds(tok)
    f = Follower(compiled, tok)
    eos = set(tok.eos_token_ids)
    out: list[int] = []

    def text(errors: str = "replace") -> str:
        return b"".join(classes.token_bytes[t] for t in out).decode(errors=errors)

    for _ in range(limit):
        row = f.row()
        bits = np.unpackbits(row.view(np.uint8), bitorder="little")[: tok.vocab_size].astype(bool)
        if not bits.any():
            return Sampled(text(), "dead_end")
        if any(bits[e] for e in eos) and (rng.random() < 0.4 or bits.sum() == len(eos)):
            return Sampled(text("strict"), "eos")
        bits[list(eos)] = False
        # Past half the limit, mostly short structural tokens: the output closes what it opened.
        if len(out) >= limit // 2 and rng.random() < 0.8:
            kinds = [structural & short, structural]
        else:
            kinds = [structural if rng.random() < 0.3 else short]
        pool = next(
            (p for p in (np.flatnonzero(bits & k) for k in kinds) if len(p)), np.flatnonzero(bits)
        )
        token = int(pool[rng.randrange(len(pool))])
        assert f.consume(token), "a token its mask allowed was refused"
        out.append(token)
    return Sampled(text(), "limit")


_KINDS: dict[bytes, tuple[np.ndarray, np.ndarray]] = {}


def _token_kinds(tok: Tokenizer) -> tuple[np.ndarray, np.ndarray]:
    """Per token: at most 2 bytes long; holds a JSON structural character."""
    key = tok.fingerprint.tokens_sha256
    if key not in _KINDS:
        data = token_classes(tok).token_bytes
        short = np.array([len(b) <= 2 for b in data], dtype=bool)
        structural = np.array([any(c in b for c in b'"]},:') for b in data], dtype=bool)
        _KINDS[key] = (short, structural)
    return _KINDS[key]
