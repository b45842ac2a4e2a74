"""Forward/cache semantics of `Transformer` on a tiny random model (see INTERFACES.md)."""

from __future__ import annotations

import pytest
import torch
from torch import Tensor

from .tiny import TINY, random_weights, tiny_config, tiny_model

ATOL = 1e-5


def full_forward(ids: list[int], kv_len: int = 64, slot: int = 0) -> Tensor:
    """Logits of one sequence processed in a single call on a fresh model."""
    model = tiny_model()
    with torch.inference_mode():
        hidden = model(
            torch.tensor([ids]), torch.arange(len(ids))[None], torch.tensor([slot]), kv_len
        )
        return model.logits(hidden[0])


def padded_batch(seqs: list[list[int]], starts: list[int]) -> tuple[Tensor, Tensor]:
    """Right-padded tokens and positions (-1 = padding) for chunks starting at `starts`."""
    t = max(len(s) for s in seqs)
    tokens = torch.zeros(len(seqs), t, dtype=torch.long)
    pos = torch.full((len(seqs), t), -1, dtype=torch.long)
    for i, (s, start) in enumerate(zip(seqs, starts, strict=True)):
        tokens[i, : len(s)] = torch.tensor(s)
        pos[i, : len(s)] = torch.arange(start, start + len(s))
    return tokens, pos


SEQ_A = [5, 17, 3, 88, 42, 9, 61, 7, 30, 2]
SEQ_B = [11, 70, 4, 4, 19]


@torch.inference_mode()
def test_prefill_then_decode_equals_full_forward() -> None:
    expected = full_forward(SEQ_A)
    model = tiny_model()
    slots = torch.tensor([0])
    hidden = model(torch.tensor([SEQ_A[:6]]), torch.arange(6)[None], slots, 64)
    got = [model.logits(hidden[0])]
    for p in range(6, len(SEQ_A)):
        hidden = model(torch.tensor([[SEQ_A[p]]]), torch.tensor([[p]]), slots, 64)
        got.append(model.logits(hidden[0]))
    torch.testing.assert_close(torch.cat(got), expected, atol=ATOL, rtol=0)


@torch.inference_mode()
def test_batched_equals_unbatched_with_padding_and_any_slots() -> None:
    exp_a, exp_b = full_forward(SEQ_A), full_forward(SEQ_B)
    model = tiny_model()
    slots = torch.tensor([2, 0])  # rows need not use slots 0..B-1
    tokens, pos = padded_batch([SEQ_A[:4], SEQ_B[:2]], [0, 0])
    hidden = model(tokens, pos, slots, 16)
    torch.testing.assert_close(model.logits(hidden[0, :4]), exp_a[:4], atol=ATOL, rtol=0)
    torch.testing.assert_close(model.logits(hidden[1, :2]), exp_b[:2], atol=ATOL, rtol=0)
    # Mixed step: row 0 continues with a 3-token chunk, row 1 decodes one token.
    tokens, pos = padded_batch([SEQ_A[4:7], SEQ_B[2:3]], [4, 2])
    hidden = model(tokens, pos, slots, 16)
    torch.testing.assert_close(model.logits(hidden[0, :3]), exp_a[4:7], atol=ATOL, rtol=0)
    torch.testing.assert_close(model.logits(hidden[1, :1]), exp_b[2:3], atol=ATOL, rtol=0)


@torch.inference_mode()
def test_padding_is_not_written_and_outputs_stay_finite() -> None:
    model = tiny_model()
    tokens, pos = padded_batch([SEQ_A[:3], []], [0, 0])
    pos[1, 0] = -1
    hidden = model(tokens, pos, torch.tensor([1, 3]), 8)
    assert torch.isfinite(hidden).all()
    assert len(model.kv_caches()) == TINY.n_layers
    for cache in model.kv_caches():
        for buf in (cache.k_cache, cache.v_cache):
            visible = buf[:, :, : model.max_seq]
            assert visible[1, :, :3].abs().sum() > 0  # written
            assert visible[1, :, 3:].abs().sum() == 0  # beyond the chunk: untouched
            assert visible[[0, 2, 3]].abs().sum() == 0  # other slots untouched (row 1 was padding)


@torch.inference_mode()
def test_slots_are_isolated() -> None:
    """Overwriting another slot with a different sequence never changes this slot's results."""
    expected = full_forward(SEQ_A)
    model = tiny_model()
    model(torch.tensor([SEQ_A[:5]]), torch.arange(5)[None], torch.tensor([1]), 16)
    other = list(reversed(SEQ_A))
    model(torch.tensor([other]), torch.arange(len(other))[None], torch.tensor([0]), 16)
    hidden = model(
        torch.tensor([SEQ_A[5:]]), torch.arange(5, len(SEQ_A))[None], torch.tensor([1]), 16
    )
    torch.testing.assert_close(model.logits(hidden[0]), expected[5:], atol=ATOL, rtol=0)


@pytest.mark.parametrize("kv_len", [10, 16, 32, 64])
@torch.inference_mode()
def test_kv_len_buckets_agree(kv_len: int) -> None:
    reference = full_forward(SEQ_A, kv_len=64)
    torch.testing.assert_close(full_forward(SEQ_A, kv_len=kv_len), reference, atol=ATOL, rtol=0)


def test_kv_len_is_checked() -> None:
    model = tiny_model(max_seq=16)
    with pytest.raises(ValueError, match="kv_len"):
        model(torch.tensor([[1]]), torch.tensor([[0]]), torch.tensor([0]), 17)


@torch.inference_mode()
def test_logits_are_float32_and_head_is_tied() -> None:
    config = tiny_config(tie_embeddings=True)
    model = tiny_model(config)
    assert model.output.weight is model.tok_embeddings.weight
    hidden = model(torch.tensor([[1, 2]]), torch.tensor([[0, 1]]), torch.tensor([0]), 8)
    logits = model.logits(hidden[0])
    assert logits.dtype == torch.float32 and logits.shape == (2, config.vocab_size)


@torch.inference_mode()
def test_bfloat16_model_tracks_fp32() -> None:
    from neuron_worker.model import build_model

    expected = full_forward(SEQ_A)
    model = build_model(TINY, random_weights(TINY), dtype=torch.bfloat16)
    model.setup_caches(1, 64)
    hidden = model(torch.tensor([SEQ_A]), torch.arange(len(SEQ_A))[None], torch.tensor([0]), 64)
    assert model.tok_embeddings.weight.dtype == torch.bfloat16
    got = model.logits(hidden[0])
    assert got.dtype == torch.float32
    assert (got - expected).abs().max() < 0.1 * expected.abs().max()
    assert (got.argmax(-1) == expected.argmax(-1)).float().mean() >= 0.8


def test_forward_is_one_graph() -> None:
    """No graph breaks (no data-dependent Python): dynamo traces the step with fullgraph=True."""
    torch._dynamo.reset()
    model = tiny_model()
    step = torch.compile(model, backend="eager", fullgraph=True)
    tokens, pos = padded_batch([SEQ_A[:3], SEQ_B[:1]], [0, 0])
    with torch.inference_mode():
        eager = model(tokens, pos, torch.tensor([0, 1]), 16)
        compiled = step(tokens, pos, torch.tensor([0, 1]), 16)
    torch.testing.assert_close(compiled, eager)


def test_compiled_blocks_share_one_graph() -> None:
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    model = tiny_model(tiny_config(n_layers=4))
    reference = tiny_model(tiny_config(n_layers=4))
    model.compile_blocks(backend="eager")
    tokens, pos = padded_batch([SEQ_A[:3], SEQ_B[:1]], [0, 0])
    with torch.inference_mode():
        for step in range(2):  # the second call reuses the graph (decode-like steady state)
            got = model(tokens, pos + 3 * step, torch.tensor([0, 1]), 16)
            expected = reference(tokens, pos + 3 * step, torch.tensor([0, 1]), 16)
            torch.testing.assert_close(got, expected)
    assert counters["stats"]["unique_graphs"] == 1


@torch.inference_mode()
def test_identity_slots_shortcut_equals_explicit_slots() -> None:
    explicit, identity = tiny_model(), tiny_model()
    tokens, pos = padded_batch([SEQ_A[:4], SEQ_B[:2]], [0, 0])
    expected = explicit(tokens, pos, torch.tensor([0, 1]), 16)
    torch.testing.assert_close(identity(tokens, pos, None, 16), expected, atol=0, rtol=0)
    tokens, pos = padded_batch([SEQ_A[4:5], SEQ_B[2:3]], [4, 2])
    expected = explicit(tokens, pos, torch.tensor([0, 1]), 16)
    torch.testing.assert_close(identity(tokens, pos, None, 16), expected, atol=0, rtol=0)
    for a, b in zip(explicit.kv_caches(), identity.kv_caches(), strict=True):
        assert torch.equal(a.k_cache, b.k_cache) and torch.equal(a.v_cache, b.v_cache)
    with pytest.raises(ValueError, match="max_batch"):
        tiny_model(max_batch=1)(tokens, pos, None, 16)
