"""Two API keys on one gateway: nothing one key sends reaches the other key's requests. The
gateway names every worker call itself (a fresh random id per request; an id in the body is
ignored), and a client that goes away cancels only its own worker call."""

from __future__ import annotations

import re
from typing import Any

from .conftest import API_KEY, MODEL, OTHER_API_KEY, Stack

MESSAGES: Any = [{"role": "user", "content": "Count from one to one hundred."}]
LONG = 60


def test_one_key_cannot_abort_or_disturb_another_keys_request(stack: Stack) -> None:
    a, b = stack.client(API_KEY), stack.client(OTHER_API_KEY)
    stream_a = a.chat.completions.create(
        model=MODEL,
        messages=MESSAGES,
        n=2,
        max_tokens=LONG,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
        extra_body={"ignore_eos": True},
    )
    chunks = iter(stream_a)
    first = next(chunks)
    assert re.fullmatch(r"chatcmpl-[0-9a-f]{32}", first.id), first.id

    # Key B: the same request, abandoned after its first chunk (the gateway cancels B's worker
    # call), twice; then a request naming A's id wherever a client can put one.
    for _ in range(2):
        stream_b = b.chat.completions.create(
            model=MODEL,
            messages=MESSAGES,
            n=2,
            max_tokens=LONG,
            temperature=0,
            stream=True,
            extra_body={"ignore_eos": True},
        )
        assert next(iter(stream_b)).id != first.id
        stream_b.close()
    named = b.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": first.id}],
        max_tokens=2,
        user=first.id,
        extra_body={"request_id": first.id, "id": first.id},
    )
    assert named.id != first.id and named.choices[0].finish_reason == "length"

    # A's call was not touched: both choices run to max_tokens.
    rest = list(chunks)
    finishes = {c.index: c.finish_reason for ch in rest for c in ch.choices if c.finish_reason}
    assert finishes == {0: "length", 1: "length"}, finishes
    usage = rest[-1].usage
    assert usage is not None and usage.completion_tokens == 2 * LONG
    assert {ch.id for ch in rest} == {first.id}
