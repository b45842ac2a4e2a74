"""The worker's masked sampler: packed grammar masks + logits -> token ids, on the device.

:func:`sample_tokens` is one pure function over static-shape tensors (no ``.item()``, no branching
on tensor values, no data-dependent shapes): unpack the packed int32 mask rows, drop logits
columns past the tokenizer vocabulary, mask disallowed tokens with ``-inf``, then greedy or
temperature / top-k / top-p sampling with per-row parameters. :class:`Sampler` compiles it once per
(graph kind, batch bucket) with ``torch.compile(fullgraph=True)``; the XLA backend traces the same
function.

Randomness is counter-based: every random number is a hash of the row's ``(seed, offset)``, a
stream and a column or block id (:func:`keyed_uniform`), so a request's tokens depend only on its
own logits, mask, parameters, seed and offset, never on the other rows of the batch, and no
``torch.Generator`` lives inside the graph. The draw is the one the tensor-parallel sampler
(:mod:`neuron_worker.parallel.sampling`) makes over a vocabulary split across ranks, so the
same seed picks the same token at any TP size whenever the logits are the same: Gumbel-max over
blocks of :data:`WORD` columns (the unit the vocabulary is split on) and inverse CDF inside the
winning block (:func:`block_draw`); with top-k / top-p, Gumbel-max with per-column noise over
the tokens kept.

A row whose mask allows no token (or whose allowed logits are all NaN / ``-inf``) yields
:data:`NO_TOKEN` (``-1``) instead of a disallowed id; the engine must treat it as a grammar error
for that request.
"""

from __future__ import annotations

import contextlib
import functools
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Literal

import torch
from torch import Tensor

from neuron_worker.backends import serving_guards
from neuron_worker.compile_fallback import compile_or_eager
from neuron_worker.logprobs import TOP_WIDTH, token_logprobs
from neuron_worker.masks import (
    mask_dest_index,
    scatter_mask_rows,
    unpack_mask,
    words_per_row,
)
from neuron_worker.penalties import PenaltyTensors, apply_penalties

__all__ = [
    "COLUMN_STREAM",
    "NO_TOKEN",
    "TOP_WIDTH",
    "WORD",
    "Logprobs",
    "Mode",
    "Sampler",
    "SamplingTensors",
    "block_draw",
    "gumbel",
    "keyed_uniform",
    "mask_dest_index",
    "sample_tokens",
    "scatter_mask_rows",
    "unpack_mask",
    "words_per_row",
]

log = logging.getLogger(__name__)

NO_TOKEN = -1
"""Token id returned for a row with no allowed token (empty grammar mask)."""

Mode = Literal["greedy", "sample", "filter"]
"""Graph kinds: every row greedy; random sampling without top-k/top-p (no sort); general (one
sort per row for top-k/top-p). Chosen per step on the host from :class:`SamplingTensors` flags."""

MODES: tuple[Mode, ...] = ("greedy", "sample", "filter")

_M32 = 0xFFFFFFFF

WORD = 32
"""Columns per block of :func:`block_draw`: one packed-mask word, the unit tensor-parallel
vocabulary slices are cut on, so a block never straddles two ranks."""

# Independent random streams of one (seed, offset): the race between blocks, the draw inside the
# winning block, the per-column race of top-k / top-p.
BLOCK_STREAM, INNER_STREAM, COLUMN_STREAM = 1, 2, 3


@dataclass
class SamplingTensors:
    """Per-row sampling parameters, all ``[N]`` on the sampler's device.

    ``all_greedy`` / ``any_filter`` are host-side facts about the values (the sampler picks its
    graph from them without reading the device); :meth:`build` sets them. Left at their defaults
    the sampler uses the general graph, which is correct for any values.
    """

    temperature: Tensor  # float32 [N]; 0 = greedy
    top_p: Tensor  # float32 [N]; 1 = off
    top_k: Tensor  # int64 [N]; 0 = off
    seed: Tensor  # int64 [N]; per-request seed
    offset: Tensor  # int64 [N]; tokens sampled so far by the request (its random counter)
    all_greedy: bool = False
    any_filter: bool = True

    @classmethod
    def build(
        cls,
        *,
        temperature: Sequence[float],
        top_p: Sequence[float],
        top_k: Sequence[int],
        seed: Sequence[int],
        offset: Sequence[int],
        n_rows: int,
        device: torch.device | str = "cpu",
    ) -> SamplingTensors:
        """From per-row Python values, padded to ``n_rows`` with greedy rows; sets the flags."""
        n = len(temperature)
        if not (len(top_p) == len(top_k) == len(seed) == len(offset) == n) or n > n_rows:
            raise ValueError("sampling parameter lists differ in length or exceed n_rows")
        pad = n_rows - n
        temps = [max(0.0, float(t)) for t in temperature]
        tps = [float(p) if 0.0 < p < 1.0 else 1.0 for p in top_p]
        tks = [max(0, int(k)) for k in top_k]
        sampled = [i for i, t in enumerate(temps) if t > 0.0]
        return cls(
            temperature=torch.tensor(temps + [0.0] * pad, dtype=torch.float32, device=device),
            top_p=torch.tensor(tps + [1.0] * pad, dtype=torch.float32, device=device),
            top_k=torch.tensor(tks + [0] * pad, dtype=torch.int64, device=device),
            # Seeds are reduced to 64 bits two's complement so any Python int is accepted.
            seed=torch.tensor(
                [_to_int64(int(s)) for s in seed] + [0] * pad, dtype=torch.int64, device=device
            ),
            offset=torch.tensor(
                [int(o) for o in offset] + [0] * pad, dtype=torch.int64, device=device
            ),
            all_greedy=not sampled,
            any_filter=any(tps[i] < 1.0 or tks[i] > 0 for i in sampled),
        )

    @property
    def mode(self) -> Mode:
        if self.all_greedy:
            return "greedy"
        return "filter" if self.any_filter else "sample"


def _to_int64(value: int) -> int:
    value &= (1 << 64) - 1
    return value - (1 << 64) if value >= 1 << 63 else value


def _mix32(x: Tensor) -> Tensor:
    """32-bit integer finaliser on int64 tensors holding values in [0, 2^32). The multipliers are
    below 2^31 so no product overflows int64 (well defined on every backend)."""
    x = x ^ (x >> 16)
    x = (x * 0x7FEB352D) & _M32
    x = x ^ (x >> 15)
    x = (x * 0x5BD1E995) & _M32
    return x ^ (x >> 16)


def _row_key(seed: Tensor, offset: Tensor) -> Tensor:
    """A 32-bit hash (in int64) of int64 ``(seed, offset)``, per element."""
    x = _mix32((offset & _M32) ^ 0x9E3779B9)
    x = _mix32(x ^ ((offset >> 32) & _M32))
    # seed may be negative: `>>` is wrong for negative ints on torch_xla 2.9 (see unpack_mask).
    x = _mix32(x ^ (torch.bitwise_right_shift(seed, 32) & _M32))
    return _mix32(x ^ (seed & _M32))


def keyed_uniform(seed: Tensor, offset: Tensor, ids: Tensor, stream: int) -> Tensor:
    """Uniforms in (0, 1), float32 ``[N, L]``: a hash of each row's int64 ``(seed, offset)``
    (``[N]``), the ``stream`` and the ids (``[L]``, the same for every row, or ``[N, L]``; below
    2^32). A pure function of its arguments, so any subset of the ids can be drawn on its own (a
    tensor-parallel rank draws its slice's) and a request's draws never depend on other rows."""
    k1 = _mix32(_row_key(seed, offset) ^ stream).unsqueeze(1)
    k2 = _mix32(k1 ^ 0x85EBCA6B)
    ids = ids.to(torch.int64)
    if ids.dim() == 1:
        ids = ids.unsqueeze(0)
    # Two rounds, each keyed: rows whose first keys differ by d do not share noise at ids c, c^d.
    x = _mix32(_mix32((ids & _M32) ^ k1) ^ k2)
    # 23 bits + 0.5 is exact in float32 and never 0 or 1.
    return ((x >> 9).to(torch.float32) + 0.5) * (1.0 / (1 << 23))


def gumbel(seed: Tensor, offset: Tensor, ids: Tensor, stream: int) -> Tensor:
    """Gumbel noise ``-log(-log(u))`` for :func:`keyed_uniform`'s ``u``, float32 ``[N, L]``."""
    return -torch.log(-torch.log(keyed_uniform(seed, offset, ids, stream)))


def block_draw(
    scaled: Tensor, seed: Tensor, offset: Tensor, first_block: int
) -> tuple[Tensor, Tensor]:
    """A draw from ``softmax(scaled)`` per row, as ``(score, column)``, both ``[N]``.

    ``scaled``: float32 ``[N, L]`` (logits / temperature, ``-inf`` where a column may not be
    drawn) holding the blocks ``first_block, first_block + 1, ...`` of :data:`WORD` columns (the
    last may be short). The block wins a Gumbel-max race over the blocks' log masses, with noise
    keyed by the global block id; the column inside it is drawn by inverse CDF. So for a row cut
    into slices on block boundaries, the slice with the best score holds the draw over the whole
    row, whatever the cut: a tensor-parallel rank draws over its slice, and the best score
    across ranks wins. One pass over the row (block masses), then work on one block only.
    ``score`` is ``-inf`` when nothing can be drawn (``column`` is then meaningless).
    """
    n, width = scaled.shape
    blocks = -(-width // WORD)
    xb = torch.nn.functional.pad(scaled, (0, blocks * WORD - width), value=float("-inf"))
    xb = xb.view(n, blocks, WORD)
    top = xb.amax(dim=-1, keepdim=True)
    top = torch.where(top > float("-inf"), top, 0.0)  # an empty block has mass 0, not NaN
    mass = torch.exp(xb - top).sum(dim=-1)
    ids = torch.arange(blocks, device=scaled.device) + first_block
    race = top.squeeze(2) + torch.log(mass) + gumbel(seed, offset, ids, BLOCK_STREAM)
    block = race.argmax(dim=-1, keepdim=True)
    score = race.gather(1, block).squeeze(1)
    inner = xb.gather(1, block.unsqueeze(2).expand(n, 1, WORD)).squeeze(1)
    cdf = torch.exp(inner - top.squeeze(2).gather(1, block)).cumsum(dim=-1)
    u = keyed_uniform(seed, offset, block + first_block, INNER_STREAM)
    # Zero-weight (masked) columns are never drawn: their cdf equals their left neighbour's,
    # and 0 < u * total <= total.
    j = (cdf < u * cdf[:, -1:]).sum(dim=-1, keepdim=True).clamp(max=WORD - 1)
    return score, (block * WORD + j).squeeze(1)


def sample_tokens(
    logits: Tensor,
    packed_mask: Tensor | None,
    temperature: Tensor,
    top_p: Tensor,
    top_k: Tensor,
    seed: Tensor,
    offset: Tensor,
    *,
    vocab_size: int,
    mode: Mode = "filter",
) -> Tensor:
    """Masked sampling of one token per row; pure and static-shape.

    ``logits``: float ``[N, L]``; ``packed_mask``: int32 ``[N, ceil(vocab_size / 32)]`` or None
    (no masking); parameters ``[N]`` as in :class:`SamplingTensors`. Columns ``>= vocab_size`` are
    never sampled. ``mode`` must cover the rows: ``"greedy"`` ignores the random parameters,
    ``"sample"`` ignores top-k / top-p. Rows with ``temperature == 0`` are greedy in every mode.
    Returns int64 ``[N]``; :data:`NO_TOKEN` for a row with no allowed token.
    """
    width = min(vocab_size, logits.shape[1])
    x = logits[:, :width].float()
    allowed: Tensor | None = None
    if packed_mask is not None:
        allowed = unpack_mask(packed_mask, width)
        x = torch.where(allowed, x, float("-inf"))

    tokens = x.argmax(dim=-1)
    if mode != "greedy":
        tokens = torch.where(
            temperature > 0,
            _sample_random(x, temperature, top_p, top_k, seed, offset, mode),
            tokens,
        )
    if allowed is not None:
        # Covers empty masks and rows whose allowed logits are all -inf / NaN: never return a
        # disallowed id.
        ok = allowed.gather(1, tokens.unsqueeze(1)).squeeze(1)
        tokens = torch.where(ok, tokens, NO_TOKEN)
    return tokens


def _sample_random(
    x: Tensor,
    temperature: Tensor,
    top_p: Tensor,
    top_k: Tensor,
    seed: Tensor,
    offset: Tensor,
    mode: Mode,
) -> Tensor:
    """A draw from softmax(x / T) (after top-k / top-p in ``"filter"`` mode)."""
    t = torch.where(temperature > 0, temperature, 1.0).unsqueeze(1)
    _, plain = block_draw(x / t, seed, offset, 0)
    if mode == "sample":
        return plain

    # Rows without top-k / top-p keep the block draw, so a row's token never depends on
    # whether another row of the batch made this step take the sorting graph. Ties sort by
    # column id, as the tensor-parallel sampler's candidates do.
    sorted_x, order = x.sort(dim=-1, descending=True, stable=True)
    sorted_w = torch.exp((sorted_x - sorted_x[:, :1]) / t)  # unnormalised; masked columns: 0
    sorted_cdf = sorted_w.cumsum(dim=-1)
    total = sorted_cdf[:, -1:]
    pos = torch.arange(x.shape[1], device=x.device).unsqueeze(0)
    k = torch.where(top_k > 0, top_k, x.shape[1]).unsqueeze(1)
    # Top-p keeps the smallest prefix whose mass reaches p: a column stays while the mass before
    # it is below p. The best column always stays.
    keep = (pos < k) & ((sorted_cdf - sorted_w) < top_p.unsqueeze(1) * total) | (pos == 0)
    # Gumbel-max among the kept columns, with noise keyed by the column id: the tensor-parallel
    # sampler races the same columns with the same noise.
    z = sorted_x / t + gumbel(seed, offset, order, COLUMN_STREAM)
    j = torch.where(keep, z, float("-inf")).argmax(dim=-1, keepdim=True)
    filtered = order.gather(1, j).squeeze(1)
    return torch.where((top_k > 0) | (top_p < 1), filtered, plain)


# Inductor inlines a pointwise producer into each of its readers and stores it in a buffer only
# once its body exceeds this many ops (50 on CPU by default). Every xorshift in `_mix32` reads its
# input twice, so under the default cap the trace of the fused hash doubles with each one: 1, 2,
# 3 and 4 rounds of `_mix32` compiled in 1.1, 1.6, 5.8 and 18.8 s. At 16 the six sampling graphs
# compile in 26 s instead of 75 s (cold, 2-core host) and run as fast.
_REALIZE_OPCOUNT = 16


SampleFn = Callable[..., Tensor]


@dataclass
class Logprobs:
    """Log-probabilities of one sampling step, ``[N]`` and ``[N, TOP_WIDTH]`` (see
    :func:`neuron_worker.logprobs.token_logprobs`)."""

    chosen: Tensor
    top_ids: Tensor
    top_logprobs: Tensor


def _allow_graphs_per_function(count: int) -> None:
    """Dynamo keeps every graph of one code object in one cache whose size is capped (8 by
    default); past the cap a ``fullgraph`` function fails hard. Every sampler graph (mode x
    batch shape x mask/no mask x vocabulary, across Sampler instances) is a graph of the same
    ``functools.partial`` wrapper code, so raise the cap to cover them."""
    config = torch._dynamo.config
    for name in ("recompile_limit", "cache_size_limit"):  # renamed in torch 2.7
        if hasattr(config, name):
            setattr(config, name, max(getattr(config, name), count + 8))
            break
    config.accumulated_recompile_limit = max(config.accumulated_recompile_limit, 4 * count + 64)


class Sampler:
    """Owns the sampler graphs of one device: one per (mode, batch bucket), compiled or eager.

    With ``structured_outputs`` the graphs take a packed mask (all ones when nothing is
    constrained), so the first constrained request never changes the graph; without it they take
    none and ``packed_mask`` must be None.

    Compiled graphs per mode: a static one for N = 1 and one with a symbolic batch dimension for
    every N >= 2, so ``warmup`` compiles 6 graphs whatever the buckets (cold, 1.5-9 s each on a
    2-core CPU host; seconds with inductor's on-disk cache warm). The graph kind is picked
    on the host from :attr:`SamplingTensors.mode`: no tensor value is ever read.
    """

    def __init__(
        self,
        *,
        vocab_size: int,
        logits_size: int,
        max_rows: int,
        device: torch.device | str,
        structured_outputs: bool,
        compile: bool,
        cpu_threads: int | None = 1,
    ) -> None:
        if vocab_size <= 0 or logits_size <= 0 or max_rows <= 0:
            raise ValueError("vocab_size, logits_size and max_rows must be positive")
        self.vocab_size = vocab_size
        self.logits_size = logits_size
        self.words = words_per_row(vocab_size)
        self.max_rows = max_rows
        self.device = torch.device(device)
        self.structured_outputs = structured_outputs
        self.compile = compile
        self._fns: dict[Mode, SampleFn] = {}
        if compile:
            _allow_graphs_per_function(64)
        # Compiled CPU kernels run every reduction inside an OpenMP parallel region, even for
        # one 131k row; on a small host shared with the grammar service and the RPC threads,
        # one descheduled OpenMP thread stalls the whole region for a scheduler tick (measured
        # here: 12 ms medians for a 0.6 ms kernel at B=8). ATen's eager kernels only go
        # parallel above 32k elements per task. One thread per sampler kernel is the robust
        # choice on CPU (bench/sampler.py); None keeps torch's thread count.
        # The serving guards: no guard on the intra-op team size, which the thread governor
        # changes (these kernels use `cpu_threads` whatever the team).
        options: dict[str, str | int | bool | Callable[..., object]] = {
            "realize_opcount_threshold": _REALIZE_OPCOUNT,
            "guard_filter_fn": serving_guards,
        }
        if cpu_threads and self.device.type == "cpu":
            options["cpp.threads"] = cpu_threads

        def build(fn: Callable[..., object], name: str) -> Callable[..., object]:
            if not compile:
                return fn
            return compile_or_eager(fn, name=f"sampler {name}", fullgraph=True, options=options)

        for mode in MODES:
            self._fns[mode] = build(  # type: ignore[assignment]
                functools.partial(sample_tokens, vocab_size=vocab_size, mode=mode), mode
            )
        self._penalize = build(apply_penalties, "penalties")
        self._logprobs = build(functools.partial(token_logprobs, vocab_size=vocab_size), "logprobs")
        self._warm: set[tuple[Mode, int]] = set()

    def all_ones_mask(self, n_rows: int) -> Tensor:
        """An unconstrained packed mask for ``n_rows`` rows on the sampler's device."""
        return torch.full((n_rows, self.words), -1, dtype=torch.int32, device=self.device)

    def __call__(
        self, logits: Tensor, packed_mask: Tensor | None, params: SamplingTensors
    ) -> Tensor:
        """``logits`` float ``[N, logits_size]``; ``packed_mask`` int32 ``[N, W]`` in batch order,
        required iff structured outputs are enabled; ``params`` ``[N]``. Returns int64 ``[N]``
        (:data:`NO_TOKEN` for rows with no allowed token)."""
        n = logits.shape[0]
        if logits.dim() != 2 or logits.shape[1] != self.logits_size or n > self.max_rows:
            raise ValueError(
                f"logits must be [N <= {self.max_rows}, {self.logits_size}], got {tuple(logits.shape)}"
            )
        if self.structured_outputs:
            if packed_mask is None:
                raise ValueError("structured outputs are enabled: pass a mask (all ones if none)")
            if packed_mask.shape != (n, self.words) or packed_mask.dtype != torch.int32:
                raise ValueError(f"packed_mask must be int32 [{n}, {self.words}]")
            packed_mask = packed_mask.contiguous()
        elif packed_mask is not None:
            raise ValueError("structured outputs are disabled: this sampler takes no mask")
        # Normalise what the graph guards on (dtype, layout) so a caller's view never recompiles.
        args = [
            logits.to(torch.float32).contiguous(),
            packed_mask,
            params.temperature.to(torch.float32).contiguous(),
            params.top_p.to(torch.float32).contiguous(),
            params.top_k.to(torch.int64).contiguous(),
            params.seed.to(torch.int64).contiguous(),
            params.offset.to(torch.int64).contiguous(),
        ]
        self._mark_rows(n, args)
        with self._no_grad():
            return self._fns[params.mode](*args)

    def _mark_rows(self, n: int, args: Sequence[Tensor | None]) -> None:
        """One graph per function serves every bucket >= 2 (the batch dimension is symbolic;
        the generated kernels loop over rows, so nothing is lost), and N = 1 gets its own
        static graph: 2 compilations per function instead of one per bucket, which matters
        when a cold CPU compile of a sampling graph takes tens of seconds."""
        if self.compile and n >= 2 and self.max_rows > 2:
            for a in args:
                if a is not None:
                    torch._dynamo.mark_dynamic(a, 0, min=2, max=self.max_rows)

    def penalize(
        self, logits: Tensor, counts: Tensor, prompt_seen: Tensor, params: PenaltyTensors
    ) -> Tensor:
        """Repetition penalties and logit bias (:func:`apply_penalties`): float32 ``[N, L]``
        logits for :meth:`__call__`. Run only for steps where some row has penalties."""
        args = [
            logits.to(torch.float32).contiguous(),
            counts.to(torch.int32).contiguous(),
            prompt_seen.to(torch.bool).contiguous(),
            params.presence.contiguous(),
            params.frequency.contiguous(),
            params.repetition.contiguous(),
            params.bias_ids.contiguous(),
            params.bias_values.contiguous(),
        ]
        self._mark_rows(logits.shape[0], args)
        with self._no_grad():
            return self._penalize(*args)  # type: ignore[return-value]

    def logprobs(
        self,
        raw: Tensor,
        processed: Tensor,
        packed_mask: Tensor | None,
        temperature: Tensor,
        tokens: Tensor,
        raw_mode: Tensor,
    ) -> Logprobs:
        """Log-probabilities of the sampled ``tokens`` and the top :data:`TOP_WIDTH` tokens
        (:func:`token_logprobs`). Run only for steps where some row asked for logprobs."""
        args = [
            raw.to(torch.float32).contiguous(),
            processed.to(torch.float32).contiguous(),
            packed_mask.contiguous() if packed_mask is not None else None,
            temperature.to(torch.float32).contiguous(),
            tokens.to(torch.int64).contiguous(),
            raw_mode.to(torch.bool).contiguous(),
        ]
        self._mark_rows(raw.shape[0], args)
        with self._no_grad():
            out: tuple[Tensor, Tensor, Tensor] = self._logprobs(*args)  # type: ignore[assignment]
        return Logprobs(*out)

    def _no_grad(self) -> contextlib.AbstractContextManager[object]:
        """Grad mode and the inputs' dispatch keys (inference tensors or not) are part of every
        graph's guards, so the sampler fixes the mode and warms up with tensors made under it:
        inference mode, as the engine runs it (torch_xla rejects inference tensors: no_grad)."""
        return torch.no_grad() if self.device.type == "xla" else torch.inference_mode()

    def warmup(self, buckets: Sequence[int]) -> None:
        """Build every graph for each batch bucket (compiles when ``compile``). Later calls reuse
        them when their tensors, like the engine's, are made under ``torch.inference_mode()``
        (``no_grad`` on XLA); ordinary tensors would add one graph per mode and shape kind."""
        with self._no_grad():
            self._warmup(buckets)

    def _warmup(self, buckets: Sequence[int]) -> None:
        for n in buckets:
            if not 0 < n <= self.max_rows:
                raise ValueError(f"bucket {n} outside [1, {self.max_rows}]")
            logits = torch.zeros(n, self.logits_size, device=self.device)
            mask = self.all_ones_mask(n) if self.structured_outputs else None
            for mode in MODES:
                params = SamplingTensors.build(
                    temperature=[0.0 if mode == "greedy" else 1.0] * n,
                    top_p=[0.5 if mode == "filter" else 1.0] * n,
                    top_k=[0] * n,
                    seed=[0] * n,
                    offset=[0] * n,
                    n_rows=n,
                    device=self.device,
                )
                assert params.mode == mode
                tokens = self(logits, mask, params)
                self._warm.add((mode, n))
            self._warm_extras(logits, mask, tokens)

    def _warm_extras(self, logits: Tensor, mask: Tensor | None, tokens: Tensor) -> None:
        """The penalty and logprob graphs of one batch bucket."""
        n = logits.shape[0]
        counts = torch.zeros(n, self.logits_size, dtype=torch.int32, device=self.device)
        seen = torch.zeros(n, self.logits_size, dtype=torch.bool, device=self.device)
        pen = PenaltyTensors.build(
            presence=[0.0] * n,
            frequency=[0.0] * n,
            repetition=[1.0] * n,
            logit_bias=[{}] * n,
            n_rows=n,
            device=self.device,
        )
        processed = self.penalize(logits, counts, seen, pen)
        temperature = torch.ones(n, dtype=torch.float32, device=self.device)
        raw_mode = torch.zeros(n, dtype=torch.bool, device=self.device)
        self.logprobs(logits, processed, mask, temperature, tokens, raw_mode)
