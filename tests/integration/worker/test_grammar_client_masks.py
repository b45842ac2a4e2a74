"""The worker's grammar client against a real grammar service: masks equal llguidance's, bit for
bit, whether the service answers dense or compact (with REPEAT rows for requests in one state)."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator

import llguidance
import numpy as np
import pytest

from maskwire import bitmask
from maskwire.tokenizer import Tokenizer, load_tokenizer
from maskwire.v1 import common_pb2, grammar_pb2
from neuron_worker.config import GrammarSettings
from neuron_worker.grammar_client import GrammarClient, GrammarRequest
from tests.support.processes import ServiceProcess, running

SCHEMA = {
    "type": "object",
    "properties": {"name": {"type": "string"}, "n": {"type": "integer"}},
    "required": ["name", "n"],
}
TEXTS = ['{"name": "Ada Lovelace", "n": 1815}', '{"name": "x", "n": -7}']
ROWS = 24  # over the service's --compact-min-rows (16)


@pytest.fixture(scope="module")
def service() -> Iterator[ServiceProcess]:
    with running("grammar-service", ["--tokenizer", "default"]) as svc:
        yield svc


@pytest.fixture(scope="module")
def tok() -> Tokenizer:
    return load_tokenizer("default")


@pytest.mark.parametrize("compact", [True, False])
async def test_masks_match_llguidance(
    service: ServiceProcess, tok: Tokenizer, compact: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    seen: list[int] = []  # encodings of every compact answer the client decoded
    decode = bitmask.decode_rows

    def spy(encodings, *args, **kwargs):  # type: ignore[no-untyped-def]
        seen.extend(int(e) for e in encodings)
        return decode(encodings, *args, **kwargs)

    monkeypatch.setattr(bitmask, "decode_rows", spy)
    client = GrammarClient(
        [service.address],
        tok.fingerprint.to_proto(),
        words_per_row=tok.words_per_row,
        settings=GrammarSettings(compact_masks=compact),
    )
    grammar = llguidance.LLMatcher.grammar_from_json_schema(
        json.dumps(SCHEMA),
        defaults={"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "},
    )
    tokens = [tok.ll.tokenize_str(TEXTS[i % 2]) for i in range(ROWS)]
    local = [llguidance.LLMatcher(tok.ll, grammar, log_level=0) for _ in range(ROWS)]
    reqs = [
        GrammarRequest(
            request_id=f"r{i}",
            constraint=common_pb2.Constraint(json_schema=json.dumps(SCHEMA)),
            options=grammar_pb2.RequestOptions(),
        )
        for i in range(ROWS)
    ]
    try:
        await asyncio.gather(*(client.open(r) for r in reqs))
        steps = min(len(t) for t in tokens)
        for s in range(steps + 1):
            new = [t[s - 1 : s] if s else [] for t in tokens]
            outcomes = await client.step(list(zip(reqs, new, strict=True)))
            for i, out in enumerate(outcomes):
                assert out.ok, out.error
                if s:
                    assert local[i].consume_token(tokens[i][s - 1])
                want = np.frombuffer(local[i].compute_bitmask(), dtype="<i4")[: tok.words_per_row]
                assert out.mask is not None and np.array_equal(out.mask[0], want), (i, s)
    finally:
        await client.aclose()
    if compact:
        assert {bitmask.SPARSE_ZEROS, bitmask.SPARSE_ONES, bitmask.REPEAT} <= set(seen)
    else:
        assert not seen
