"""A Llama-family decoder in plain torch with a static, slot-addressed KV cache.

One `forward` serves prefill, decode and mixed batches: every row names its cache slot and every
token its position (`-1` = padding). Shapes depend only on (B, T, kv_len), never on values, so each
bucket compiles to one graph under `torch.compile(fullgraph=True)` and traces once under torch_xla.
Checkpoint quirks (permuted Q/K, unfused q/k/v, tied heads) are resolved by the loaders and by
`load_weights`, never in the forward.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from neuron_worker import kernels
from neuron_worker.model.config import ModelConfig
from neuron_worker.model.linear import (
    ExactWeight,
    Int4Weight,
    Int8Weight,
    ServingLinear,
    kernel_for,
    project,
)

# The projections by kind: fused q/k/v, attention output, fused gate/up, down, LM head.
PROJECTION_KINDS = ("wqkv", "wo", "w13", "w2", "head")


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: Tensor) -> Tensor:
        # Normalise in fp32 whatever the weights' dtype, as the reference implementation does.
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.to(x.dtype)


class KVCache(nn.Module):
    """K/V for `max_batch` slots x `max_seq` positions, plus one scratch position per slot.

    Padding tokens are written to the scratch position (index `max_seq`), which attention never
    reads because `kv_len <= max_seq`: this keeps the write a single static-shape `index_put_`.
    Layout [slot, kv_head, position, head_dim] so a slot's prefix is a strided view for SDPA.
    """

    k_cache: Tensor
    v_cache: Tensor

    def __init__(
        self,
        max_batch: int,
        max_seq: int,
        n_kv_heads: int,
        head_dim: int,
        *,
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        super().__init__()
        shape = (max_batch, n_kv_heads, max_seq + 1, head_dim)
        # Zeroed, and so in memory, at start: written first while serving, pages the kernel maps
        # on demand cost ~70 us each in a VM (~0.4 s for a 500-token prompt's slot, measured).
        zeros = torch.zeros(shape, dtype=dtype, device=device)
        self.register_buffer("k_cache", zeros, persistent=False)
        self.register_buffer("v_cache", torch.zeros_like(zeros), persistent=False)

    def update(self, slots: Tensor, pos: Tensor, k: Tensor, v: Tensor) -> None:
        """slots, pos: int64 [B, T]; k, v: [B, T, n_kv_heads, head_dim]."""
        self.k_cache[slots, :, pos] = k
        self.v_cache[slots, :, pos] = v

    def copy_prefix(self, src: int | Tensor, dst: int | Tensor, length: int) -> None:
        """Positions [0, length) of slot `src` into slot `dst` (a shared prompt): slot numbers,
        or one-element int64 tensors on the cache's device (a graph then serves any slots)."""
        self.k_cache[dst, :, :length] = self.k_cache[src, :, :length]
        self.v_cache[dst, :, :length] = self.v_cache[src, :, :length]


def _identity(x: Tensor) -> Tensor:
    return x


def apply_rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Rotate-half RoPE (Hugging Face layout). x: [B, T, H, D]; cos, sin: [B, T, 1, D]."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


class Attention(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.n_heads = config.n_heads
        self.n_kv_heads = config.n_kv_heads
        self.head_dim = config.head_dim
        # nn.Linear, or a ServingLinear after `Transformer.use_serving_linears`.
        self.wqkv: nn.Module = nn.Linear(
            config.dim, config.q_size + 2 * config.kv_size, bias=config.qkv_bias
        )
        self.wo: nn.Module = nn.Linear(config.q_size, config.dim, bias=False)
        self.kv_cache: KVCache | None = None
        # Passes of one token per row attend through `neuron_worker.kernels.decode_attention`
        # (each row's slot read in place) when `Transformer.use_serving_linears` turns it on.
        self.decode_kernel = False
        # Sums the partial outputs of a row-parallel `wo` across a tensor-parallel group
        # (`neuron_worker.parallel`); the identity on one device.
        self.reduce: Callable[[Tensor], Tensor] = _identity

    def forward(
        self,
        x: Tensor,
        cos: Tensor,
        sin: Tensor,
        mask: Tensor,
        write_slots: Tensor,
        write_pos: Tensor,
        cache_slots: Tensor | None,
        kv_len: int,
        quantized: bool = False,
    ) -> Tensor:
        assert self.kv_cache is not None, "call setup_caches() first"
        b, t, _ = x.shape
        kvh, hd = self.n_kv_heads, self.head_dim
        group = self.n_heads // kvh
        q, k, v = project(self.wqkv, x, quantized).split(
            [self.n_heads * hd, kvh * hd, kvh * hd], dim=-1
        )
        q = apply_rope(q.view(b, t, self.n_heads, hd), cos, sin)
        k = apply_rope(k.view(b, t, kvh, hd), cos, sin)
        self.kv_cache.update(write_slots, write_pos, k, v.view(b, t, kvh, hd))
        # GQA without repeating K/V: the `group` query heads sharing a KV head become extra query
        # rows of that head ([B, kvh, group*T, hd]); the mask is expanded to match.
        q = q.view(b, t, kvh, group, hd).permute(0, 2, 3, 1, 4).reshape(b, kvh, group * t, hd)
        if self.decode_kernel and t == 1:
            # write_pos is each token's position (padding: the scratch position past the end,
            # which the kernel treats as padding: position 0 only, as the mask does below).
            y = kernels.decode_attention(
                q,
                self.kv_cache.k_cache[:, :, :kv_len],
                self.kv_cache.v_cache[:, :, :kv_len],
                write_slots[:, 0],
                write_pos,
            )
        else:
            y = self._sdpa(q, mask, cache_slots, b, kv_len)
        y = y.view(b, kvh, group, t, hd).permute(0, 3, 1, 2, 4).reshape(b, t, self.n_heads * hd)
        return self.reduce(project(self.wo, y, quantized))

    def _sdpa(
        self, q: Tensor, mask: Tensor, cache_slots: Tensor | None, b: int, kv_len: int
    ) -> Tensor:
        assert self.kv_cache is not None
        if cache_slots is None:  # rows are slots 0..B-1: a view, no copy
            keys = self.kv_cache.k_cache[:b, :, :kv_len]
            values = self.kv_cache.v_cache[:b, :, :kv_len]
        else:  # slice before gathering: only [0, kv_len) of each row's slot is copied
            keys = self.kv_cache.k_cache[:, :, :kv_len][cache_slots]
            values = self.kv_cache.v_cache[:, :, :kv_len][cache_slots]
        return F.scaled_dot_product_attention(q, keys, values, attn_mask=mask)


class FeedForward(nn.Module):
    """SwiGLU with gate and up projections fused into one matmul (`w13`)."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.ffn_dim = config.ffn_dim
        self.w13: nn.Module = nn.Linear(config.dim, 2 * config.ffn_dim, bias=False)
        self.w2: nn.Module = nn.Linear(config.ffn_dim, config.dim, bias=False)
        self.reduce: Callable[[Tensor], Tensor] = _identity  # as `Attention.reduce`, for `w2`

    def forward(self, x: Tensor, quantized: bool = False) -> Tensor:
        gate, up = project(self.w13, x, quantized).split(self.ffn_dim, dim=-1)
        return self.reduce(project(self.w2, F.silu(gate) * up, quantized))


class TransformerBlock(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.attention_norm = RMSNorm(config.dim, config.norm_eps)
        self.attention = Attention(config)
        self.ffn_norm = RMSNorm(config.dim, config.norm_eps)
        self.feed_forward = FeedForward(config)

    def forward(
        self,
        x: Tensor,
        cos: Tensor,
        sin: Tensor,
        mask: Tensor,
        write_slots: Tensor,
        write_pos: Tensor,
        cache_slots: Tensor | None,
        kv_len: int,
        quantized: bool = False,
    ) -> Tensor:
        """`quantized`: the projections' weight-only quantized form (`linear.project`)."""
        h = x + self.attention(
            self.attention_norm(x),
            cos,
            sin,
            mask,
            write_slots,
            write_pos,
            cache_slots,
            kv_len,
            quantized,
        )
        return h + self.feed_forward(self.ffn_norm(h), quantized)


def _run_block(layer: nn.Module, *args: Any) -> Tensor:
    out: Tensor = layer(*args)
    return out


# Under torch.compile, every layer runs one graph traced and compiled once (a nested compile
# region), not 30 unrolled copies: a forward graph compiles in 8-17 s instead of 38-65 s on 2
# cores, at the same step time (measured). Eager calls go straight through.
_shared_block = torch.compiler.nested_compile_region(_run_block)


def rope_table(config: ModelConfig, max_seq: int) -> tuple[Tensor, Tensor]:
    """fp32 cos/sin tables [max_seq, head_dim] in the rotate-half layout."""
    hd = config.head_dim
    inv_freq = 1.0 / (config.rope_theta ** (torch.arange(0, hd, 2, dtype=torch.float64) / hd))
    if config.rope_freq_factors is not None:
        inv_freq = inv_freq / torch.tensor(config.rope_freq_factors, dtype=torch.float64)
    angles = torch.outer(torch.arange(max_seq, dtype=torch.float64), inv_freq)
    angles = torch.cat((angles, angles), dim=-1)
    return angles.cos().float(), angles.sin().float()


class Transformer(nn.Module):
    """The decoder. Call `setup_caches` once, then `forward` for every step; `logits` on demand."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        # Uninitialized: the weights come from `load_weights` (the loader builds the model on the
        # meta device), and initializing an embedding there imports dynamo (about a second).
        embeddings = torch.empty(config.vocab_size, config.dim)
        self.tok_embeddings = nn.Embedding(config.vocab_size, config.dim, _weight=embeddings)
        self.layers = nn.ModuleList(TransformerBlock(config) for _ in range(config.n_layers))
        self.norm = RMSNorm(config.dim, config.norm_eps)
        self.output: nn.Module = nn.Linear(config.dim, config.vocab_size, bias=False)
        if config.tie_embeddings:
            self.output.weight = self.tok_embeddings.weight
        self.max_batch = 0
        self.max_seq = 0
        self.register_buffer("rope_cos", torch.empty(0), persistent=False)
        self.register_buffer("rope_sin", torch.empty(0), persistent=False)
        self._run_block: Callable[..., Tensor] = _shared_block

    def compile_blocks(self, **compile_kwargs: Any) -> None:
        """Compile one transformer block and reuse the graph for every layer (CPU/CUDA).

        An alternative to compiling the whole step (which already compiles the block once, as
        a nested compile region): here only the blocks are compiled, one graph per (B, T,
        kv_len) shared by all layers; embedding, mask and final norm stay eager
        (`bench/forward.py` compares the two).
        """
        options: dict[str, Any] = {"fullgraph": True, "dynamic": False, **compile_kwargs}
        self._run_block = torch.compile(_run_block, **options)

    def setup_caches(self, max_batch: int, max_seq: int) -> None:
        """Allocate the static KV cache on the model's device/dtype: max_batch slots x max_seq positions."""
        if max_batch < 1 or max_seq < 1:
            raise ValueError("max_batch and max_seq must be >= 1")
        weight = self.tok_embeddings.weight
        c = self.config
        for layer in self.layers:
            attn = layer.attention
            assert isinstance(attn, Attention)
            attn.kv_cache = KVCache(
                max_batch,
                max_seq,
                c.n_kv_heads,
                c.head_dim,
                dtype=weight.dtype,
                device=weight.device,
            )
        cos, sin = rope_table(c, max_seq)
        self.rope_cos = cos.to(weight.device, weight.dtype)
        self.rope_sin = sin.to(weight.device, weight.dtype)
        self.max_batch, self.max_seq = max_batch, max_seq

    def use_serving_linears(
        self,
        quantize: str | Mapping[str, str] = "none",
        sources: Mapping[str, ExactWeight] | None = None,
    ) -> None:
        """Swap every projection and the LM head for `ServingLinear`s
        (`neuron_worker.model.linear`): oneDNN-prepacked weights on CPU, and with
        `quantize` a weight-only form that `step_logits` uses; and passes of one token per row
        attend through `neuron_worker.kernels.decode_attention` where it runs the cache's dtype.
        `quantize`: one scheme for every layer (the head then takes `head_scheme`'s where the
        scheme is not "none"), or one per kind of `PROJECTION_KINDS` (`neuron_worker.
        kernel_choice`; the head's "none" or `head_scheme`'s). Only the chosen forms are built.
        `sources`: canonical per-tensor quantized weights to use as they are (a GGUF's own Q4_1
        and Q8_0 tensors) where their scheme is the layer's, else each is quantized from its
        floats."""
        src = sources or {}
        weight = self.tok_embeddings.weight
        decode_kernel = (
            weight.device.type == "cpu"
            and self.config.head_dim in (32, 64, 128)
            and kernels.attention_available(weight.dtype)
        )
        head = self.head_scheme(src)
        if isinstance(quantize, str):
            scheme = quantize
            choice = dict.fromkeys(PROJECTION_KINDS, scheme)
            choice["head"] = head if scheme != "none" and head is not None else "none"
        else:
            choice = dict(quantize)
            if choice["head"] not in ("none", head):
                raise ValueError(f"the LM head takes 'none' or {head!r}, not {choice['head']!r}")

        def fused(prefix: str, names: tuple[str, ...]) -> ExactWeight | None:
            found = [src.get(f"{prefix}{n}.weight") for n in names]
            if all(isinstance(f, Int4Weight) for f in found):
                return Int4Weight.cat([f for f in found if isinstance(f, Int4Weight)])
            if all(isinstance(f, Int8Weight) for f in found):
                return Int8Weight.cat([f for f in found if isinstance(f, Int8Weight)])
            return None

        def serving(lin: nn.Module, exact: ExactWeight | None, q: str) -> ServingLinear:
            assert isinstance(lin, nn.Linear | ServingLinear)
            return ServingLinear(lin.weight.detach(), lin.bias, quantize=q, exact=exact)

        for i, layer in enumerate(self.layers):
            assert isinstance(layer, TransformerBlock)
            p = f"layers.{i}."
            attn, ffn = layer.attention, layer.feed_forward
            attn.wqkv = serving(
                attn.wqkv, fused(p + "attention.", ("wq", "wk", "wv")), choice["wqkv"]
            )
            attn.wo = serving(attn.wo, src.get(f"{p}attention.wo.weight"), choice["wo"])
            ffn.w13 = serving(ffn.w13, fused(p + "feed_forward.", ("w1", "w3")), choice["w13"])
            ffn.w2 = serving(ffn.w2, src.get(f"{p}feed_forward.w2.weight"), choice["w2"])
            attn.decode_kernel = decode_kernel
        self.output = serving(self.output, src.get(self._head_name), choice["head"])

    @property
    def _head_name(self) -> str:
        return "tok_embeddings.weight" if self.config.tie_embeddings else "output.weight"

    def head_scheme(self, sources: Mapping[str, ExactWeight]) -> str | None:
        """The LM head's one quantized scheme, or None: the checkpoint's own (no new rounding of
        the logits; tied, it is the embedding's, Q8_0 in the embedded model), where `sources`
        holds it and one of the worker's own kernels runs it."""
        head = sources.get(self._head_name)
        if head is None:
            return None
        scheme = "int4" if isinstance(head, Int4Weight) else "int8"
        assert isinstance(self.output, nn.Linear | ServingLinear)
        return scheme if kernel_for(self.output.weight, scheme).startswith("own") else None

    def projection_weights(self) -> dict[str, Tensor]:
        """Each kind's (dense) weight [out, in] (`PROJECTION_KINDS`): the first layer's, every
        layer's being alike in shape and dtype, and the LM head's."""
        layer = self.layers[0]
        assert isinstance(layer, TransformerBlock)
        attn, ffn = layer.attention, layer.feed_forward
        mods = {"wqkv": attn.wqkv, "wo": attn.wo, "w13": ffn.w13, "w2": ffn.w2, "head": self.output}
        weights = {}
        for kind, mod in mods.items():
            assert isinstance(mod, nn.Linear | ServingLinear)
            weights[kind] = mod.weight
        return weights

    @property
    def attends_in_place(self) -> bool:
        """Whether passes of one token per row read each row's cache slot in place (the decode
        attention kernel), so that a flat pass of many tokens copies no keys per token."""
        return any(
            isinstance(layer, TransformerBlock) and layer.attention.decode_kernel
            for layer in self.layers
        )

    @property
    def on_one_device(self) -> bool:
        """Whether no layer sums partial outputs across a tensor-parallel group
        (`neuron_worker.parallel` sets the layers' `reduce`)."""
        return all(
            isinstance(layer, TransformerBlock)
            and layer.attention.reduce is _identity
            and layer.feed_forward.reduce is _identity
            for layer in self.layers
        )

    def kv_caches(self) -> list[KVCache]:
        """Each layer's cache (empty before `setup_caches`)."""
        caches = []
        for layer in self.layers:
            assert isinstance(layer, TransformerBlock)
            if layer.attention.kv_cache is not None:
                caches.append(layer.attention.kv_cache)
        return caches

    def forward(
        self, tokens: Tensor, input_pos: Tensor, cache_slots: Tensor | None, kv_len: int
    ) -> Tensor:
        """tokens, input_pos: int64 [B, T]; cache_slots: int64 [B]; kv_len: static bucket.

        `cache_slots=None` means row b uses slot b: attention then reads a view of the cache
        instead of gathering each row's slot (cheaper; a separate compiled graph).

        Writes K/V of every (b, t) with input_pos >= 0 into slot cache_slots[b] at that position;
        a query at position p attends its slot's positions <= p (within [0, kv_len)). input_pos
        -1 is padding: not written, not attended, its (finite) output is garbage. Returns the
        final-normed hidden states [B, T, dim].
        """
        if not 0 < kv_len <= self.max_seq:
            raise ValueError(f"kv_len={kv_len} outside (0, max_seq={self.max_seq}]")
        return self.hidden(tokens, input_pos, cache_slots, self.kv_positions(kv_len))

    def kv_positions(self, kv_len: int) -> Tensor:
        """The KV positions a pass attends, [kv_len]: `hidden` takes the KV length as this
        tensor's size so that a compiled graph can leave it symbolic (one graph for every
        length)."""
        return torch.arange(kv_len, device=self.tok_embeddings.weight.device)

    def hidden(
        self,
        tokens: Tensor,
        input_pos: Tensor,
        cache_slots: Tensor | None,
        kv_positions: Tensor,
        quantized: bool = False,
    ) -> Tensor:
        """`forward` with the KV length given as `kv_positions` (see `kv_positions`);
        `quantized`: the projections' weight-only quantized form where they have one."""
        b, t = tokens.shape
        kv_len = kv_positions.shape[0]
        if cache_slots is None and b > self.max_batch:
            raise ValueError(f"cache_slots=None needs B={b} <= max_batch={self.max_batch}")
        group = self.config.n_heads // self.config.n_kv_heads
        pos = input_pos.clamp(min=0)
        cos = self.rope_cos[pos].unsqueeze(2)
        sin = self.rope_sin[pos].unsqueeze(2)
        # Padding rows see position 0 only (never an all-masked row, so never NaN).
        mask = kv_positions <= pos.unsqueeze(-1)  # [B, T, kv_len]
        mask = mask.unsqueeze(1).expand(b, group, t, kv_len).reshape(b, 1, group * t, kv_len)
        rows = torch.arange(b, device=tokens.device) if cache_slots is None else cache_slots
        # A copy: a nested compile region refuses two inputs that alias (this and cache_slots).
        write_slots = rows.unsqueeze(1).expand(b, t).clone()
        write_pos = torch.where(input_pos >= 0, input_pos, self.max_seq)

        x = self.tok_embeddings(tokens)
        for layer in self.layers:
            x = self._run_block(
                layer, x, cos, sin, mask, write_slots, write_pos, cache_slots, kv_len, quantized
            )
        return self.norm(x)

    def copy_slot(self, src: int | Tensor, dst: int | Tensor, length: int) -> None:
        """Copy the K/V of positions [0, length) of cache slot `src` into slot `dst` (slot
        numbers, or one-element int64 tensors: `KVCache.copy_prefix`): a prompt prefilled once
        serves several requests (n > 1, the prefix cache). `length` is best a sequence bucket,
        so a static-shape backend sees few copy shapes."""
        for cache in self.kv_caches():
            cache.copy_prefix(src, dst, length)

    def step_logits(
        self,
        tokens: Tensor,
        input_pos: Tensor,
        cache_slots: Tensor,
        kv_positions: Tensor,
        last: Tensor,
    ) -> Tensor:
        """One pass over tokens the requests generated (decode, jump-forward, draft
        verification), through the weight-only quantized projections where the model has them,
        and float32 logits [N, vocab_size] for the tokens `last` [N] names: the graph the
        engine runs (and compiles) for those passes. With one token per row, `last` holds rows
        (a decode pass names each row; a flat pass of many tokens, the few whose logits are
        wanted, so the LM head runs for those only); with several, flat indices `row * T +
        column` (a row's last token, or the draft positions of a speculative verification)."""
        return self._logits_of(tokens, input_pos, cache_slots, kv_positions, last, True)

    def prefill_logits(
        self,
        tokens: Tensor,
        input_pos: Tensor,
        cache_slots: Tensor,
        kv_positions: Tensor,
        last: Tensor,
    ) -> Tensor:
        """`step_logits` for a pass over prompts: the dense projections (a prompt's hundreds of
        tokens per weight read are compute-bound, where the matrix engines win). A pass's role,
        not its size, picks the weights, so each token's logits are the same whatever shares
        its pass (`neuron_worker.model.linear`)."""
        return self._logits_of(tokens, input_pos, cache_slots, kv_positions, last, False)

    # `step_logits` and `prefill_logits` are two methods, not one with a flag: torch.compile keeps
    # its graphs per code object, and the worker compiles without guards on the model, so one
    # method would let a graph of one role serve passes of the other.
    def _logits_of(
        self,
        tokens: Tensor,
        input_pos: Tensor,
        cache_slots: Tensor,
        kv_positions: Tensor,
        last: Tensor,
        quantized: bool,
    ) -> Tensor:
        h = self.hidden(tokens, input_pos, cache_slots, kv_positions, quantized)
        wanted = h.reshape(tokens.shape[0] * tokens.shape[1], h.shape[-1])[last]
        return project(self.output, wanted, quantized).float()

    @property
    def quantized(self) -> bool:
        """Whether any projection has a weight-only quantized form: then `step_logits` and
        `prefill_logits` differ (else they are the same function)."""
        return any(
            isinstance(mod, ServingLinear) and mod.quantize != "none" for mod in self.modules()
        )

    def logits(self, hidden: Tensor) -> Tensor:
        """[N, dim] -> [N, vocab_size] float32 (LM head)."""
        return self.output(hidden).float()

    def load_weights(self, weights: Mapping[str, Tensor]) -> None:
        """Assign canonical (unfused) weights, fusing q/k/v and gate/up once.

        Canonical names: `tok_embeddings.weight`, `norm.weight`, optional `output.weight`, and per
        layer `layers.{i}.` + `attention_norm.weight`, `attention.w{q,k,v}.weight` (+ `.bias`
        when qkv_bias), `attention.wo.weight`, `ffn_norm.weight`, `feed_forward.w1.weight` (gate),
        `feed_forward.w3.weight` (up), `feed_forward.w2.weight` (down). Q/K in rotate-half layout.
        """
        src = dict(weights)
        state: dict[str, Tensor] = {}

        def take(name: str) -> Tensor:
            try:
                return src.pop(name)
            except KeyError:
                raise KeyError(f"missing weight {name!r}") from None

        state["tok_embeddings.weight"] = take("tok_embeddings.weight")
        state["norm.weight"] = take("norm.weight")
        for i in range(self.config.n_layers):
            p = f"layers.{i}."
            for name in (
                "attention_norm.weight",
                "ffn_norm.weight",
                "attention.wo.weight",
                "feed_forward.w2.weight",
            ):
                state[p + name] = take(p + name)
            state[p + "attention.wqkv.weight"] = torch.cat(
                [take(p + f"attention.w{x}.weight") for x in "qkv"]
            )
            if self.config.qkv_bias:
                state[p + "attention.wqkv.bias"] = torch.cat(
                    [take(p + f"attention.w{x}.bias") for x in "qkv"]
                )
            state[p + "feed_forward.w13.weight"] = torch.cat(
                [take(p + "feed_forward.w1.weight"), take(p + "feed_forward.w3.weight")]
            )
        head = src.pop("output.weight", None)
        if src:
            raise KeyError(f"unexpected weights: {sorted(src)[:5]}")
        if not self.config.tie_embeddings:
            if head is None:
                raise KeyError("missing weight 'output.weight' (embeddings are not tied)")
            state["output.weight"] = head
        self.load_state_dict(state, strict=False, assign=True)
        if self.config.tie_embeddings:
            self.output.weight = self.tok_embeddings.weight
        missing = [n for n, prm in self.named_parameters() if prm.is_meta]
        if missing:
            raise KeyError(f"weights not loaded: {missing[:5]}")
