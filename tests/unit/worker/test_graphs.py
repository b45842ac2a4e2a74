"""The forward runner's shape policies: padding, flat passes, the split of a lone multi-token
row, buckets."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch

from neuron_worker.backends import create_backend
from neuron_worker.graphs import MAX_FLAT_TOKENS, CompileCounter, ForwardRunner, Pass
from neuron_worker.model import Transformer, build_model
from tests.unit.model.tiny import (
    SERVING,
    TINY,
    random_weights,
    serving_dtype,
    serving_tiny,
)


@pytest.fixture(scope="module")
def model() -> Transformer:
    m = build_model(TINY, random_weights(TINY))
    m.setup_caches(5, 64)
    return m


def runner(model: Transformer, bucketed: bool) -> ForwardRunner:
    kw = {}
    if bucketed:
        kw = {
            "batch_buckets": (1, 2, 4),
            "token_buckets": (1, 4, 8, 16, 32),
            "seq_buckets": (32, 64),
        }
    return ForwardRunner(model, create_backend("cpu"), max_rows=4, max_seq=64, pad_slot=4, **kw)


def one_row(r: ForwardRunner, tokens: list[int], start: int, slot: int, end: int) -> torch.Tensor:
    n, t, kv = r.shape(1, len(tokens), end)
    tok = np.zeros((n, t), np.int64)
    pos = np.full((n, t), -1, np.int64)
    slots = np.full(n, 4, np.int64)
    tok[0, : len(tokens)] = tokens
    pos[0, : len(tokens)] = np.arange(start, start + len(tokens))
    slots[0] = slot
    last = np.zeros(n, np.int64)
    last[0] = len(tokens) - 1
    return r.run(Pass(tok, pos, slots, last, kv))[0]


@pytest.mark.parametrize("length", [2, 5, 8, 23])
def test_a_lone_prompt_flat_or_split_in_two_rows_gives_the_same_logits(
    model: Transformer, length: int
) -> None:
    """Up to `flat_tokens` (16 here) tokens the prompt runs one token per row, beyond that as
    two half-rows; either way the logits are those of one padded row."""
    prompt = ([3, 17, 5, 9, 11, 2, 7, 13] * 3)[:length]
    dynamic = runner(model, bucketed=False)
    assert dynamic.flat_tokens == 16
    assert dynamic.shape(1, length, length) == (1, length, 64)
    with torch.inference_mode():
        split = one_row(dynamic, prompt, 0, slot=0, end=length)
        whole = one_row(runner(model, bucketed=True), prompt, 0, slot=1, end=length)
        # and the next token, decoded on top of each slot's cache
        nxt_split = one_row(dynamic, [4], length, slot=0, end=length + 1)
        nxt_whole = one_row(runner(model, bucketed=True), [4], length, slot=1, end=length + 1)
    torch.testing.assert_close(split, whole, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(nxt_split, nxt_whole, rtol=1e-5, atol=1e-5)


def test_a_flat_pass_gives_the_logits_of_the_padded_grid() -> None:
    """A jump-forward / verification pass (rows of 1, 4 and 2 tokens after their prompts, logits
    wanted at every position) run flat gives the logits of the same pass as a padded grid."""
    m = build_model(TINY, random_weights(TINY))
    m.setup_caches(8, 64)
    kw = {"max_rows": 4, "max_seq": 64, "pad_slot": 7, "verify_width": 4}
    flat = ForwardRunner(m, create_backend("cpu"), **kw)
    grid = ForwardRunner(m, create_backend("cpu"), flat_tokens=0, **kw)
    rng = np.random.default_rng(1)
    prompts = [rng.integers(0, TINY.vocab_size, n) for n in (5, 3, 9)]
    steps = [rng.integers(0, TINY.vocab_size, n) for n in (1, 4, 2)]

    def run(r: ForwardRunner, slots: list[int], tokens: list[np.ndarray], start: list[int]):
        n, t, kv = r.shape(
            3,
            max(len(x) for x in tokens),
            max(s + len(x) for s, x in zip(start, tokens, strict=True)),
        )
        tok = np.zeros((n, t), np.int64)
        pos = np.full((n, t), -1, np.int64)
        slot = np.full(n, 7, np.int64)
        last = []
        for i, (x, s0) in enumerate(zip(tokens, start, strict=True)):
            tok[i, : len(x)] = x
            pos[i, : len(x)] = np.arange(s0, s0 + len(x))
            slot[i] = slots[i]
            last += [i * t + j for j in range(len(x))]
        return r.run(Pass(tok, pos, slot, np.array(last, np.int64), kv))

    with torch.inference_mode():
        for r, slots in ((flat, [0, 1, 2]), (grid, [3, 4, 5])):
            run(r, slots, prompts, [0, 0, 0])
        got = run(flat, [0, 1, 2], steps, [len(x) for x in prompts])
        want = run(grid, [3, 4, 5], steps, [len(x) for x in prompts])
    assert got.shape == want.shape == (7, TINY.vocab_size)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_prefills_run_flat_where_attention_reads_the_cache_in_place() -> None:
    """With the decode attention kernel, a batch of prompts of different lengths runs as one
    token per row (its real tokens, the LM head for each row's last one only) and gives the
    logits of the padded grid; without it, only small passes run flat."""
    config = SERVING
    m = build_model(config, random_weights(config), dtype=serving_dtype())
    kw: dict[str, Any] = {"max_rows": 4, "max_seq": 64, "pad_slot": 7}
    assert ForwardRunner(m, create_backend("cpu"), **kw).flat_tokens == 16
    m.use_serving_linears("none")
    if not m.attends_in_place:
        pytest.skip("the decode attention kernel is not available on this CPU")
    m.setup_caches(8, 64)
    flat = ForwardRunner(m, create_backend("cpu"), **kw)
    grid = ForwardRunner(m, create_backend("cpu"), flat_tokens=0, **kw)
    assert flat.flat_tokens == MAX_FLAT_TOKENS
    rng = np.random.default_rng(2)
    prompts = [rng.integers(0, config.vocab_size, n) for n in (11, 3, 17, 6)]

    def prefill(r: ForwardRunner, slots: list[int]) -> torch.Tensor:
        n, t, kv = r.shape(4, 17, 17)
        tok = np.zeros((n, t), np.int64)
        pos = np.full((n, t), -1, np.int64)
        for i, x in enumerate(prompts):
            tok[i, : len(x)] = x
            pos[i, : len(x)] = np.arange(len(x))
        last = np.array([i * t + len(x) - 1 for i, x in enumerate(prompts)], np.int64)
        return r.run(Pass(tok, pos, np.array(slots, np.int64), last, kv))

    with torch.inference_mode():
        got = prefill(flat, [0, 1, 2, 3])
        want = prefill(grid, [4, 5, 6, 7])
    assert got.shape == want.shape == (4, config.vocab_size)
    # through different attention kernels (bf16: both are ~0.7 from fp32 here)
    torch.testing.assert_close(got, want, rtol=0, atol=0.03 * float(want.abs().max()))
    assert torch.equal(got.argmax(-1), want.argmax(-1))


def test_a_pass_over_the_flat_limit_runs_in_chunks_with_the_same_logits() -> None:
    """Where attention reads the cache in place, a pass of more real tokens than `flat_tokens`
    runs as consecutive flat chunks: a verification pass (every position's logits, rows split
    across chunk boundaries) returns what one flat pass returns, in the same order."""
    config = SERVING
    m = serving_tiny("none")
    m.setup_caches(8, 64)
    kw: dict[str, Any] = {"max_rows": 4, "max_seq": 64, "pad_slot": 7, "verify_width": 8}
    chunked = ForwardRunner(m, create_backend("cpu"), flat_tokens=4, **kw)
    whole = ForwardRunner(m, create_backend("cpu"), **kw)
    assert chunked.chunked and chunked.flat_tokens == 4
    rng = np.random.default_rng(4)
    rows = [rng.integers(0, config.vocab_size, n) for n in (3, 7, 1)]

    def run(r: ForwardRunner, slots: list[int]) -> torch.Tensor:
        n, t, kv = r.shape(3, 7, 7)
        tok = np.zeros((n, t), np.int64)
        pos = np.full((n, t), -1, np.int64)
        last = []
        for i, x in enumerate(rows):
            tok[i, : len(x)] = x
            pos[i, : len(x)] = np.arange(len(x))
            last += [i * t + j for j in range(len(x))]
        last.reverse()  # any order: the logits come back in `last`'s
        with torch.inference_mode():
            return r.run(Pass(tok, pos, np.array(slots, np.int64), np.array(last, np.int64), kv))

    got, want = run(chunked, [0, 1, 2]), run(whole, [3, 4, 5])
    assert got.shape == want.shape == (11, config.vocab_size)
    assert torch.equal(got, want)


@pytest.mark.parametrize("compile", [False, True], ids=["eager", "compiled"])
def test_a_tokens_logits_do_not_depend_on_what_shares_its_pass(compile: bool) -> None:
    """The serving configuration (bf16, int4 projections, attention in place), where greedy
    output must not depend on how requests happen to be batched: a prompt's logits are bitwise
    the same prefilled alone, with another prompt, or with three (in chunks); a generated
    token's, decoded alone or beside other rows' forced tokens (a pass of 2 to 27 tokens)."""
    config = SERVING
    m = serving_tiny("int4")
    assert m.quantized
    m.setup_caches(16, 64)
    torch._dynamo.reset()  # compiled graphs skip module guards: none of another model's
    backend = create_backend("cpu", compile=compile)
    r = ForwardRunner(m, backend, max_rows=4, max_seq=64, pad_slot=15, flat_tokens=16)
    assert r.chunked
    rng = np.random.default_rng(3)
    prompts = [rng.integers(0, config.vocab_size, n) for n in (11, 3, 17, 6)]
    forced = [rng.integers(0, config.vocab_size, n) for n in (1, 6, 20)]

    def run(rows: list[tuple[int, np.ndarray, int]], prefill: bool) -> torch.Tensor:
        """rows: (slot, tokens, first position); the logits of each row's last token."""
        n, t, kv = r.shape(len(rows), max(len(x) for _, x, _ in rows), 40)
        tok = np.zeros((n, t), np.int64)
        pos = np.full((n, t), -1, np.int64)
        slots = np.full(n, 15, np.int64)
        last = np.zeros(r.logits_count(n, len(rows), 1), np.int64)
        for i, (slot, x, start) in enumerate(rows):
            tok[i, : len(x)] = x
            pos[i, : len(x)] = np.arange(start, start + len(x))
            slots[i] = slot
            last[i] = i * t + len(x) - 1
        with torch.inference_mode():
            return r.run(Pass(tok, pos, slots, last, kv, prefill))[: len(rows)]

    a = prompts[0]
    alone = run([(0, a, 0)], prefill=True)[0]
    with_one = run([(1, a, 0), (2, prompts[1], 0)], prefill=True)[0]  # 14 tokens: one pass
    with_three = run([(3 + i, x, 0) for i, x in enumerate(prompts)], prefill=True)[0]  # 37
    assert torch.equal(with_one, alone) and torch.equal(with_three, alone)

    # The next token of `a` in slots 0, 1 and 3 (the same cache in each).
    nxt = np.array([int(alone.argmax())])
    decoded = run([(0, nxt, len(a))], prefill=False)[0]
    beside_forced = [
        run([(slot, nxt, len(a)), (6 + i, f, 0)], prefill=False)[0]
        for i, (slot, f) in enumerate(zip((1, 3, 1), forced, strict=True))
    ]
    for got in beside_forced:
        assert torch.equal(got, decoded)
    # and the prompts' dense weights are not the generated tokens' 4-bit ones
    run([(9, a, 0)], prefill=True)
    assert not torch.equal(run([(9, nxt, len(a))], prefill=True)[0], decoded)


def test_dynamic_shapes_pad_to_two_rows_and_align_kv(model: Transformer) -> None:
    r = runner(model, bucketed=False)
    assert r.shape(1, 1, 10) == (2, 1, 64)
    assert r.shape(3, 1, 65) == (3, 1, 64)  # capped at max_seq
    assert r.shape(3, 4, 30) == (3, 4, 64)
    assert r.logits_rows() == [2, 4]
    b = runner(model, bucketed=True)
    assert b.shape(3, 3, 33) == (4, 4, 64)
    assert b.logits_rows() == [1, 2, 4]


def serve_random_passes(eager: ForwardRunner, compiled: ForwardRunner) -> None:
    """Prefills of odd sizes, a lone prompt (split), decode at 1..4 rows, jump-forward bursts
    (flat, wide and as a grid): the compiled runner's logits are the eager runner's (fp32)."""
    rng = np.random.default_rng(0)
    lengths = [0, 0, 0, 0]  # tokens in each slot's cache so far
    for rows, tokens in [(1, 7), (3, 5), (2, 1), (4, 1), (1, 1), (3, 1), (2, 9), (4, 3), (1, 37)]:
        slots = rng.permutation(4)[:rows]
        end = max(lengths[s] for s in slots) + tokens
        n, t, kv = compiled.shape(rows, tokens, end)
        tok = np.zeros((n, t), np.int64)
        pos = np.full((n, t), -1, np.int64)
        slot = np.full(n, 4, np.int64)
        last = np.zeros(compiled.logits_count(n, rows, 1), np.int64)
        for r, s in enumerate(slots):
            tok[r, :tokens] = rng.integers(0, TINY.vocab_size, tokens)
            pos[r, :tokens] = np.arange(lengths[s], lengths[s] + tokens)
            slot[r] = s
            last[r] = r * t + tokens - 1  # flat index into the [rows x tokens] grid
            lengths[s] += tokens
        p = Pass(tok, pos, slot, last, kv)
        with torch.inference_mode():
            want, got = eager.run(p)[:rows], compiled.run(p)[:rows]
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


def tiny_runner(weights: dict[str, torch.Tensor], compile: bool, **kw: Any) -> ForwardRunner:
    m = build_model(TINY, weights)
    m.setup_caches(5, 256)
    backend = create_backend("cpu", compile=compile)
    return ForwardRunner(m, backend, max_rows=4, max_seq=256, pad_slot=4, **kw)


def test_compiled_graphs_match_eager_and_no_shape_compiles_after_warm_up() -> None:
    """The dynamic graphs, built at warm-up, serve every pass shape (rows, tokens per row, KV
    length) without compiling again, with the eager model's logits (fp32)."""
    torch._dynamo.reset()
    weights = random_weights(TINY)
    eager, compiled = tiny_runner(weights, False), tiny_runner(weights, True)
    counter = CompileCounter()
    compiled.warmup(lambda _: None)
    counter.ready()
    serve_random_passes(eager, compiled)
    counter.check()
    assert counter.after_ready == 0
