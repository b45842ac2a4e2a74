"""The device side of a step: everything the engine runs on its device thread, called with host
data only.

The engine plans each step on the host (numpy arrays, Python lists) and hands the device work to a
:class:`StepDevice`: a forward pass (:meth:`~StepDevice.forward`), the row shuffles of n > 1
prefill sharing and jump-forward (:meth:`~StepDevice.share`, :meth:`~StepDevice.replace`), and
the sampler with its optional penalty and logprob graphs (:meth:`~StepDevice.sample`). Logits
stay on the device: these calls return and take :class:`Logits` handles.

Because every argument is host data and every device result is named by a handle, the same
sequence of calls can run on several processes at once: with tensor parallelism rank 0's engine
drives a :class:`~neuron_worker.parallel.serving.LeaderDevice`, which sends each call to the
follower ranks, whose sharded device (:class:`~neuron_worker.parallel.serving.ShardedStepDevice`)
runs it on their slice of the model and the vocabulary.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import numpy as np
import torch
from torch import Tensor

from neuron_worker.backends import Backend
from neuron_worker.engine_config import EngineConfig
from neuron_worker.graphs import ForwardRunner, Pass, StepModel
from neuron_worker.greedy_kernel import GreedyKernel
from neuron_worker.masks import scatter_mask_rows
from neuron_worker.penalties import OccurrenceTable, PenaltyTensors
from neuron_worker.request import TokenLogprob
from neuron_worker.sampler import SamplingTensors
from neuron_worker.sampling_rows import PAD_ROW, SamplingRow, SamplingRows
from neuron_worker.scheduler import pow2_buckets

__all__ = [
    "DeviceLostError",
    "Logits",
    "SampleBatch",
    "Sampled",
    "StepDevice",
    "StepDeviceLike",
]

log = logging.getLogger(__name__)

# Logits handles kept at most; a step holds 3 (decode, jump-forward, merged) until it samples.
_MAX_HELD = 16


class DeviceLostError(RuntimeError):
    """The device can no longer serve any request (a tensor-parallel rank died, or the ranks'
    calls diverged): the engine stops stepping and the worker reports NOT_SERVING."""


class SamplerLike(Protocol):
    """What the device needs of :class:`neuron_worker.sampler.Sampler`."""

    def __call__(self, logits: Tensor, packed_mask: Tensor | None, params: Any) -> Tensor: ...

    def penalize(
        self, logits: Tensor, counts: Tensor, prompt_seen: Tensor, params: PenaltyTensors
    ) -> Tensor: ...

    def logprobs(
        self,
        raw: Tensor,
        processed: Tensor,
        packed_mask: Tensor | None,
        temperature: Tensor,
        tokens: Tensor,
        raw_mode: Tensor,
    ) -> Any: ...


@dataclass(frozen=True)
class Logits:
    """A handle to logits on the device: ``rows`` rows (the pass's, padding included)."""

    handle: int
    rows: int


@dataclass
class SampleBatch:
    """The host side of one sampling step, for ``rows`` logits rows: the grammar's packed mask
    rows (``compact[k]`` goes to logits row ``dest[k]``; ``dest == rows`` drops it), the rows
    whose EOS is banned, and the rows' sampling parameters (fewer than ``rows``: the rest are
    padding rows)."""

    compact: np.ndarray
    dest: np.ndarray
    ban_eos: np.ndarray
    rows: SamplingRows


@dataclass
class Sampled:
    """One sampling step's tokens (batch order) and, when a row asked, their logprobs."""

    tokens: list[int]
    logprobs: list[TokenLogprob]


class StepDeviceLike(Protocol):
    """What the engine calls: :class:`StepDevice`, or rank 0's ``LeaderDevice``."""

    runner: ForwardRunner
    pad_slot: int
    logits_size: int

    @property
    def occurrences(self) -> OccurrenceTable | None: ...

    def setup(self) -> None: ...

    def forward(self, p: Pass) -> Logits: ...

    def share(
        self, logits: Logits, copies: list[tuple[int, int, int]], index: list[int]
    ) -> Logits: ...

    def replace(self, logits: Logits, ff: Logits, dst: list[int]) -> Logits: ...

    def sample(self, logits: Logits, batch: SampleBatch) -> Sampled: ...

    def warmup(self, on_graph: Callable[[str], None]) -> int: ...

    def close(self) -> None: ...


class StepDevice:
    """One process's model, sampler and KV cache, driven by host-side calls (module docstring).
    Not thread-safe: the engine calls it from its single device thread."""

    def __init__(
        self,
        *,
        model: StepModel,
        backend: Backend,
        sampler: SamplerLike,
        config: EngineConfig,
        eos_ids: tuple[int, ...],
        words: int,
        graph_dir: Path | None = None,
        greedy: GreedyKernel | None = None,
    ) -> None:
        """``eos_ids``: the tokenizer's EOS tokens (banned for ``ignore_eos`` rows); ``words``:
        packed mask words per row (the tokenizer's vocabulary); ``graph_dir``: where compiled
        forward graphs are saved and loaded (:class:`ForwardRunner`); ``greedy``: samples the
        all-greedy steps in one call instead of the sampler's graphs (None: the graphs)."""
        self.model = model
        self.backend = backend
        self.sampler = sampler
        self.config = config
        self.eos_ids = eos_ids
        self.words = words
        self.greedy = greedy
        # One extra cache slot that padding rows point at, so they can never touch a live slot.
        self.pad_slot = config.kv_slots
        token_buckets = list(config.token_buckets) or pow2_buckets(1, config.max_seq_len)
        self.runner = ForwardRunner(
            model,
            backend,
            max_rows=config.max_batch,
            max_seq=config.max_seq_len,
            pad_slot=self.pad_slot,
            batch_buckets=config.batch_buckets if config.bucketed else (),
            token_buckets=token_buckets if config.bucketed else (),
            seq_buckets=config.seq_buckets if config.bucketed else (),
            verify_width=config.verify_width,
            flat_tokens=config.flat_tokens,
            graph_dir=graph_dir,
            fused_decode=config.fused_decode,
        )
        self.logits_size = int(model.config.vocab_size)
        self.occurrences: OccurrenceTable | None = None  # allocated with the KV cache
        self._eos_index: Tensor | None = None
        self._held: dict[int, Tensor] = {}
        self._next_handle = 0

    @property
    def width(self) -> int:
        """Logits columns this device computes (the whole row; a rank's slice when sharded)."""
        return self.logits_size

    # ------------------------------------------------------------------ handles
    def _hold(self, logits: Tensor) -> Logits:
        handle = self._next_handle
        self._next_handle += 1
        self._held[handle] = logits
        while len(self._held) > _MAX_HELD:  # a step that never sampled (every row left)
            del self._held[min(self._held)]
        return Logits(handle, int(logits.shape[0]))

    def _get(self, ref: Logits) -> Tensor:
        return self._held[ref.handle]

    def _release_through(self, ref: Logits) -> None:
        """Sampling ends a step: its logits and every earlier handle are dropped."""
        for h in [h for h in self._held if h <= ref.handle]:
            del self._held[h]

    # ------------------------------------------------------------------ calls
    def setup(self) -> None:
        """Allocate the KV cache (`EngineConfig.kv_slots` + the padding slot) and the penalty
        table."""
        slots = self.config.kv_slots + 1
        self.model.setup_caches(slots, self.config.max_seq_len)
        self.occurrences = OccurrenceTable(
            slots=slots, logits_size=self.width, device=self.backend.device
        )
        # Materialise weights and caches (XLA: pending loader ops would otherwise become part of
        # the first forward graph, which then never matches a later step's graph).
        self.backend.mark_step()
        self.backend.sync()

    def forward(self, p: Pass) -> Logits:
        """One forward pass (:meth:`ForwardRunner.run`), after its prefix copies."""
        self.runner.copy_prefixes(p.copies)
        return self._hold(self.runner.run(p))

    def share(self, logits: Logits, copies: list[tuple[int, int, int]], index: list[int]) -> Logits:
        """n > 1 prefill sharing: copy K/V ``(src slot, dst slot, length)`` for each copy, then
        the logits rows ``index`` (one per sampling row)."""
        self.runner.copy_prefixes(copies)
        with self.backend.inference_mode():
            idx = self.backend.to_device(torch.tensor(index, dtype=torch.int64))
            out = self._get(logits).index_select(0, idx)
            self.backend.mark_step()
        return self._hold(out)

    def replace(self, logits: Logits, ff: Logits, dst: list[int]) -> Logits:
        """Jump-forward: batch rows ``dst`` take the logits of jump-forward rows 0..len(dst)-1."""
        return self._hold(self._replace(self._get(logits), self._get(ff), dst))

    def _replace(self, logits: Tensor, ff_logits: Tensor, dst: list[int]) -> Tensor:
        """One graph per (batch bucket, jump-forward bucket)."""
        n, m = int(logits.shape[0]), int(ff_logits.shape[0])
        index = np.full(m, n, dtype=np.int64)  # padding rows land in a spare row, sliced off
        index[: len(dst)] = dst
        with self.backend.inference_mode():
            spare = torch.cat([logits, logits[:1]])
            out = spare.index_copy(0, self.backend.to_device(torch.from_numpy(index)), ff_logits)
            out = out[:n]
            self.backend.mark_step()
        return out

    def sample(self, logits: Logits, batch: SampleBatch) -> Sampled:
        """Mask and sample every row of ``logits``; drops the step's logits handles."""
        if self.greedy is not None and self.greedy.takes(batch.rows):
            out = self._sample_greedy(self.greedy, self._get(logits), batch)
        else:
            out = self._sample(self._get(logits), batch)
        self._release_through(logits)
        return out

    def close(self) -> None:
        """Nothing to stop for a single device (a leader stops its followers)."""

    # ------------------------------------------------------------------ sampling stages
    def _sample_greedy(self, greedy: GreedyKernel, logits: Tensor, batch: SampleBatch) -> Sampled:
        """An all-greedy step without penalties or logprobs: one kernel call, the tokens the
        sampler's greedy graph would pick (:mod:`neuron_worker.greedy_kernel`)."""
        compact, dest = batch.compact, batch.dest
        if not self.config.structured_outputs:  # no mask rows at all: every row unconstrained
            dest = np.full_like(dest, logits.shape[0])
        tokens = greedy(logits, compact, dest, batch.ban_eos, len(batch.rows.rows))
        return Sampled(tokens, [])

    def _sample(self, logits: Tensor, batch: SampleBatch) -> Sampled:
        """One sampler graph for a batch bucket (plus the penalty and logprob graphs on steps
        where a row asks for them). The packed mask rows travel as int32 and are reordered and
        unpacked on the device; every input has the same shape every step (no mask tensor at all
        when structured outputs are disabled)."""
        n = int(logits.shape[0])
        rows = batch.rows.padded(n)
        penalty, logprobs_on = batch.rows.any_penalty, batch.rows.any_logprobs
        backend = self.backend
        if backend.traces_ops and (penalty or logprobs_on):
            # One graph kind with both (static graphs: no penalties x logprobs combinations).
            penalty = logprobs_on = True
        with backend.inference_mode():
            lg = self._ban_eos(logits, batch.ban_eos)
            mask: Tensor | None = None
            if self.config.structured_outputs:
                mask = scatter_mask_rows(
                    backend.to_device(torch.from_numpy(batch.compact)),
                    backend.to_device(torch.from_numpy(batch.dest)),
                    n,
                )
            tensors = SamplingTensors.build(
                temperature=[r.temperature for r in rows],
                top_p=[r.top_p for r in rows],
                top_k=[r.top_k for r in rows],
                seed=[r.seed for r in rows],
                offset=[r.offset for r in rows],
                n_rows=n,
                device=backend.device,
            )
            if penalty:
                lg = self._penalize(lg, batch.rows, rows)
            mask = self._sampler_mask(mask)
            out = self.sampler(lg, mask, tensors)
            logprobs: list[TokenLogprob] = []
            if logprobs_on:
                raw_mode = torch.tensor([r.raw_logprobs for r in rows], dtype=torch.bool)
                # Two distinct tensors always: the graph is guarded on its inputs not aliasing.
                processed = lg.clone() if lg is logits else lg
                lp = self.sampler.logprobs(
                    logits, processed, mask, tensors.temperature, out, backend.to_device(raw_mode)
                )
                backend.mark_step()
                logprobs = _token_logprobs(lp.chosen, lp.top_ids, lp.top_logprobs)
            backend.mark_step()
            return Sampled([int(x) for x in out.tolist()], logprobs)

    def _ban_eos(self, logits: Tensor, ban_eos: np.ndarray) -> Tensor:
        """``ignore_eos`` rows: EOS columns to -inf. Skipped on a step where no row bans (three
        ops and a copy of the logits, ~75 us per step at 8 rows on a CPU), except where eager
        ops are traced (XLA: a fixed-shape op on every step, so one graph)."""
        backend = self.backend
        if not self.eos_ids or not (backend.traces_ops or ban_eos.any()):
            return logits
        if self._eos_index is None:
            self._eos_index = backend.to_device(torch.tensor(self.eos_ids))
        ban = backend.to_device(torch.from_numpy(ban_eos)).unsqueeze(1)
        eos_cols = logits.index_select(1, self._eos_index).masked_fill(ban, float("-inf"))
        return logits.index_copy(1, self._eos_index, eos_cols)

    def _sampler_mask(self, mask: Tensor | None) -> Tensor | None:
        """The packed rows the sampler and the logprobs apply (a sharded device keeps its
        slice's words)."""
        return mask

    def _penalize(self, logits: Tensor, step: SamplingRows, rows: list[SamplingRow]) -> Tensor:
        """Update the occurrence table with ``step``'s counts and resets, then penalise and bias
        the logits by ``rows`` (the step's rows, padded)."""
        table = self.occurrences
        assert table is not None
        for slot, prompt in step.reset:
            table.reset(slot, prompt)
        table.add(step.count)
        # The updates' sizes vary (padded to powers of two): their own small graphs on XLA,
        # never part of the sampler's.
        self.backend.mark_step()
        pad = self.pad_slot
        slots = torch.tensor([pad if r.slot is None else r.slot for r in rows], dtype=torch.int64)
        counts, seen = table.rows(self.backend.to_device(slots))
        params = PenaltyTensors.build(
            presence=[r.presence for r in rows],
            frequency=[r.frequency for r in rows],
            repetition=[r.repetition for r in rows],
            logit_bias=[r.logit_bias for r in rows],
            n_rows=int(logits.shape[0]),
            device=self.backend.device,
        )
        return self.sampler.penalize(logits, counts, seen, params)

    # ------------------------------------------------------------------ warm-up
    def warmup(self, on_graph: Callable[[str], None]) -> int:
        """Run every graph shape the step loop can produce once, on padding inputs (the pad
        slot's scratch position); ``on_graph(label)`` after each. Returns the number of graphs."""
        count = self.runner.warmup(on_graph)
        plain = self.runner.logits_rows(verify=False)
        dev = self.backend.to_device
        for n in self.runner.logits_rows():
            with self.backend.inference_mode():  # see `_warmup_logits`
                logits = torch.zeros(n, self.width)
            for m in (m for m in plain if m <= n and n in plain):
                self._replace(dev(logits), dev(logits[:m].clone()), [])
                on_graph(f"jump-forward rows batch={n} rows={m}")
                count += 1
            compact = np.full((n, self.words), -1, dtype=np.int32)
            dest = np.full(n, n, dtype=np.int64)
            ban = np.zeros(n, dtype=bool)
            # Greedy, plain sampling, top-k/top-p: the sampler's graph kinds.
            for kind, temp, top_p, top_k in (
                ("greedy", 0.0, 1.0, 0),
                ("sample", 1.0, 1.0, 0),
                ("filter", 1.0, 0.5, 5),
            ):
                greedy = [SamplingRow(temperature=temp, top_p=top_p, top_k=top_k)] * n
                batch = SampleBatch(compact, dest, ban, SamplingRows(greedy))
                self._sample(self._warmup_logits(logits), batch)
                on_graph(f"sampler batch={n} {kind}")
                count += 1
                # With penalties and logprobs: their graphs (CPU/CUDA: once per bucket), or on
                # XLA one sampler graph per kind that includes them.
                extras = self._warmup_rows(n)
                extras.rows = greedy
                self._sample(self._warmup_logits(logits), SampleBatch(compact, dest, ban, extras))
                on_graph(f"sampler batch={n} {kind} with penalties and logprobs")
                count += 1
        return count

    def _warmup_logits(self, host: Tensor) -> Tensor:
        """A fresh device copy of padding logits, made in inference mode as a forward's logits
        are: the sampler's graphs are guarded on it (outside it, even a copy of an inference
        tensor is an ordinary one)."""
        with self.backend.inference_mode():
            return self.backend.to_device(host)

    def _warmup_rows(self, n: int) -> SamplingRows:
        """``n`` padding rows (the pad slot, nothing penalised) that ask for penalties and
        logprobs."""
        return SamplingRows(
            [PAD_ROW] * n, count=[(self.pad_slot, 0)], any_penalty=True, any_logprobs=True
        )


def _token_logprobs(chosen: Tensor, top_ids: Tensor, top_lp: Tensor) -> list[TokenLogprob]:
    """Device tensors to per-row host values (one transfer each)."""
    ids = top_ids.tolist()
    lps = top_lp.tolist()
    return [
        TokenLogprob(float(c), tuple(zip(i, lp, strict=True)))
        for c, i, lp in zip(chosen.tolist(), ids, lps, strict=True)
    ]
