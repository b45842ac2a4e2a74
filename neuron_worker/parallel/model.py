"""Megatron-style sharding of a loaded :class:`~neuron_worker.model.llama.Transformer`.

:func:`shard_transformer` turns a full model into one rank's part, in place, keeping its code:

* attention: each rank holds a contiguous range of KV heads and the query heads that share them
  (the fused ``wqkv`` is split by output rows: column parallel), ``wo`` is split by input columns
  (row parallel) and its partial outputs are summed with one all-reduce;
* MLP: gate and up rows of the fused ``w13`` split column parallel, ``w2`` row parallel, one
  all-reduce;
* embedding: vocab parallel (a rank looks up only its token ids, zeros elsewhere, one all-reduce);
* LM head: vocab parallel, each rank computes the logits of its :class:`VocabShard` only; the
  full row is never gathered (the sharded sampler works on the slices).

Head and hidden ranges may be uneven (SmolLM2-135M has 3 KV heads: TP = 2 gives 2 + 1). The
model's ``config`` afterwards describes the rank's heads and MLP width (``vocab_size`` stays the
full vocabulary). Each rank loads the whole checkpoint and keeps its slices: fine for the models
tested here; a model that does not fit one host's memory needs slice-wise loading (not done).
"""

from __future__ import annotations

import dataclasses

import torch
from torch import Tensor, nn

from neuron_worker.model.llama import Attention, FeedForward, Transformer, TransformerBlock
from neuron_worker.parallel.group import Collectives
from neuron_worker.parallel.vocab import VocabShard, vocab_shards

__all__ = ["VocabParallelEmbedding", "shard_transformer", "split_range"]


def split_range(n: int, world: int, rank: int) -> tuple[int, int]:
    """``[lo, hi)`` of rank ``rank`` when ``n`` items are dealt contiguously to ``world`` ranks,
    the first ``n % world`` ranks taking one extra."""
    base, extra = divmod(n, world)
    lo = rank * base + min(rank, extra)
    return lo, lo + base + (1 if rank < extra else 0)


class VocabParallelEmbedding(nn.Module):
    """Rows ``[shard.start, shard.stop)`` of an embedding table; ids outside give zeros, and the
    group's all-reduce assembles every token's row."""

    def __init__(self, weight: Tensor, shard: VocabShard, group: Collectives) -> None:
        super().__init__()
        self.weight = nn.Parameter(weight, requires_grad=False)
        self.start = shard.start
        self.stop = shard.stop
        self.group = group

    def forward(self, tokens: Tensor) -> Tensor:
        inside = (tokens >= self.start) & (tokens < self.stop)
        local = torch.where(inside, tokens - self.start, 0)
        rows = torch.where(inside.unsqueeze(-1), self.weight[local], 0)
        return self.group.all_reduce(rows)


def _linear(weight: Tensor, bias: Tensor | None) -> nn.Linear:
    out, inp = weight.shape
    with torch.device("meta"):
        lin = nn.Linear(inp, out, bias=bias is not None)
    lin.weight = nn.Parameter(weight.contiguous(), requires_grad=False)
    if bias is not None:
        lin.bias = nn.Parameter(bias.contiguous(), requires_grad=False)
    return lin


def _plain(module: nn.Module) -> nn.Linear:
    if not isinstance(module, nn.Linear):
        raise TypeError("shard the model before use_serving_linears (plain nn.Linear expected)")
    return module


def _shard_attention(attn: Attention, kv_lo: int, kv_hi: int, group: Collectives) -> None:
    hd, kvh = attn.head_dim, attn.n_kv_heads
    per_kv = attn.n_heads // kvh
    q_size, kv_size = attn.n_heads * hd, kvh * hd
    rows = torch.cat(
        [
            torch.arange(kv_lo * per_kv * hd, kv_hi * per_kv * hd),
            q_size + torch.arange(kv_lo * hd, kv_hi * hd),
            q_size + kv_size + torch.arange(kv_lo * hd, kv_hi * hd),
        ]
    )
    wqkv, wo = _plain(attn.wqkv), _plain(attn.wo)
    rows = rows.to(wqkv.weight.device)
    bias = None if wqkv.bias is None else wqkv.bias[rows]
    attn.wqkv = _linear(wqkv.weight[rows], bias)
    attn.wo = _linear(wo.weight[:, kv_lo * per_kv * hd : kv_hi * per_kv * hd], None)
    attn.n_kv_heads = kv_hi - kv_lo
    attn.n_heads = attn.n_kv_heads * per_kv
    attn.reduce = group.all_reduce


def _shard_mlp(ffn: FeedForward, lo: int, hi: int, group: Collectives) -> None:
    w13, w2 = _plain(ffn.w13), _plain(ffn.w2)
    gate, up = w13.weight.split(ffn.ffn_dim)
    ffn.w13 = _linear(torch.cat([gate[lo:hi], up[lo:hi]]), None)
    ffn.w2 = _linear(w2.weight[:, lo:hi], None)
    ffn.ffn_dim = hi - lo
    ffn.reduce = group.all_reduce


def shard_transformer(model: Transformer, group: Collectives) -> VocabShard:
    """Keep rank ``group.rank``'s part of ``model`` (plain ``nn.Linear`` layers, before
    ``setup_caches`` and ``use_serving_linears``); returns the rank's vocabulary slice, the
    columns ``model.logits`` now produces. Needs ``world <= n_kv_heads`` and at least one mask
    word per rank."""
    c = model.config
    world, rank = group.world, group.rank
    if world > c.n_kv_heads:
        raise ValueError(f"tensor parallel size {world} > {c.n_kv_heads} KV heads of {c.name}")
    if world > c.ffn_dim:
        raise ValueError(f"tensor parallel size {world} > MLP width {c.ffn_dim}")
    shard = vocab_shards(c.vocab_size, world)[rank]
    kv_lo, kv_hi = split_range(c.n_kv_heads, world, rank)
    f_lo, f_hi = split_range(c.ffn_dim, world, rank)
    for layer in model.layers:
        assert isinstance(layer, TransformerBlock)
        _shard_attention(layer.attention, kv_lo, kv_hi, group)
        _shard_mlp(layer.feed_forward, f_lo, f_hi, group)

    head = _plain(model.output).weight[shard.start : shard.stop]
    emb = model.tok_embeddings.weight[shard.start : shard.stop]
    model.tok_embeddings = VocabParallelEmbedding(emb.contiguous(), shard, group)  # type: ignore[assignment]
    if c.tie_embeddings:
        model.output = _linear(model.tok_embeddings.weight, None)
        model.output.weight = model.tok_embeddings.weight
    else:
        model.output = _linear(head, None)
    per_kv = c.n_heads // c.n_kv_heads
    model.config = dataclasses.replace(
        c, n_heads=(kv_hi - kv_lo) * per_kv, n_kv_heads=kv_hi - kv_lo, ffn_dim=f_hi - f_lo
    )
    return shard
