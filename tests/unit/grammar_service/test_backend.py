"""LlgBackend: every fill strategy writes exactly llguidance's own mask rows."""

from __future__ import annotations

import llguidance
import numpy as np
import pytest

from grammar_service.backend import LlgBackend, LlgRequest
from maskwire.cpus import available_cpus
from maskwire.tokenizer import Tokenizer, load_tokenizer

SCHEMA = '{"type":"object","properties":{"a":{"type":"string"},"b":{"type":"integer"}}}'
TEXT = '{"a": "hello world", "b": 12345}'


@pytest.fixture(scope="module")
def tok() -> Tokenizer:
    return load_tokenizer("default")


def states(tok: Tokenizer, n: int) -> list[LlgRequest]:
    """`n` requests at different points of one JSON document (strings, keys, numbers)."""
    grammar = llguidance.LLMatcher.grammar_from_json_schema(
        SCHEMA,
        defaults={"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "},
    )
    tokens = tok.ll.tokenize_str(TEXT)
    out = []
    for i in range(n):
        m = llguidance.LLMatcher(tok.ll, grammar, log_level=0)
        assert m.consume_tokens(tokens[: i % len(tokens)])
        out.append(LlgRequest(m))
    return out


def reference(req: LlgRequest, words: int) -> np.ndarray:
    return np.frombuffer(req.matcher.compute_bitmask(), dtype=np.int32)[:words]


# Below PAR_FILL_MIN rows the backend fills on the calling thread; from it, through the executor.
@pytest.mark.parametrize("n", [1, LlgBackend.PAR_FILL_MIN - 1, LlgBackend.PAR_FILL_MIN, 40])
def test_fill_writes_llguidance_rows_at_their_slots(tok: Tokenizer, n: int) -> None:
    backend = LlgBackend(2)
    words = tok.words_per_row
    reqs = states(tok, n)
    capacity = 2 * n + 1
    buf = np.full((capacity, words), 0x5A5A5A5A, dtype=np.int32)
    slots = [2 * i + 1 for i in range(n)]  # every other row, in a larger buffer
    backend.fill(list(zip(reqs, slots, strict=True)), [], buf.ctypes.data, words * 4, capacity)
    for req, slot in zip(reqs, slots, strict=True):
        assert np.array_equal(buf[slot], reference(req, words))
    untouched = [r for r in range(capacity) if r not in set(slots)]
    assert (buf[untouched] == 0x5A5A5A5A).all()  # nothing written outside the given slots


def test_default_threads_are_every_available_cpu() -> None:
    assert LlgBackend().threads == available_cpus() >= 1
    assert LlgBackend(3).threads == 3
