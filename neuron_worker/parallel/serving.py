"""Tensor parallelism inside ``maskwire worker --tensor-parallel-size N``.

The worker process is rank 0: it runs the gRPC server, the engine and its own shard. It starts
ranks 1..N-1 as child processes (:func:`start_followers`); every rank builds the same
:class:`ShardedStepDevice` (:func:`build_rank_device`: the model loaded and sharded Megatron-style,
a vocab-parallel LM head, the sharded sampler). The engine drives rank 0's :class:`LeaderDevice`,
which sends each device call (forward, row shuffles, sample, warm-up) to the followers before
running it on its own shard; the followers replay the calls in order (:func:`follow_calls`), and
the collectives inside the model and the sampler keep the ranks in step. Nothing changes for the
grammar tier or the wire: the mask rows stay full-vocabulary packed int32, and each rank applies
the words of its vocabulary slice.

A follower that exits is seen by :class:`~neuron_worker.parallel.followers.RankMonitor` within
half a second, and by rank 0's next collective (gloo reports the closed connection); the worker
then reports NOT_SERVING and fails its requests with UNAVAILABLE (``Engine.device_lost``).
"""

from __future__ import annotations

import dataclasses
import logging
import multiprocessing as mp
import time
from collections.abc import Callable
from dataclasses import dataclass
from multiprocessing.process import BaseProcess
from typing import Any, TypeVar

import torch
import torch.distributed as dist
from torch import Tensor

from neuron_worker.backends import Backend, create_backend
from neuron_worker.engine_config import EngineConfig
from neuron_worker.graphs import Pass
from neuron_worker.logprobs import TOP_WIDTH
from neuron_worker.parallel.followers import RankMonitor
from neuron_worker.parallel.group import Collectives, init_group
from neuron_worker.parallel.launch import free_port
from neuron_worker.parallel.logprobs import combine_logprobs, local_logprob_parts
from neuron_worker.parallel.model import shard_transformer
from neuron_worker.parallel.sampling import ShardedSampler
from neuron_worker.parallel.vocab import VocabShard, shard_mask_words
from neuron_worker.penalties import OccurrenceTable, PenaltyTensors, apply_penalties
from neuron_worker.sampler import Logprobs
from neuron_worker.sampling_rows import SamplingRow, SamplingRows
from neuron_worker.step_device import (
    DeviceLostError,
    Logits,
    SampleBatch,
    Sampled,
    StepDevice,
)

__all__ = [
    "LeaderDevice",
    "RankGroup",
    "RankSpec",
    "ShardedStepDevice",
    "follow_calls",
    "localize_rows",
    "shard_device",
    "start_followers",
    "stop_followers",
]

log = logging.getLogger(__name__)

T = TypeVar("T")


class _RankSampler:
    """The sampler calls of :class:`StepDevice` on one rank's slice: the sharded sampler, the
    penalties (column-wise, so the slice's columns are enough; eager) and sharded logprobs."""

    def __init__(self, sampler: ShardedSampler) -> None:
        self.sharded = sampler

    def __call__(self, logits: Tensor, packed_mask: Tensor | None, params: Any) -> Tensor:
        """``packed_mask``: this rank's words of the rows (``shard_mask_words``)."""
        return self.sharded(logits, packed_mask, params)

    def penalize(
        self, logits: Tensor, counts: Tensor, prompt_seen: Tensor, params: PenaltyTensors
    ) -> Tensor:
        return apply_penalties(
            logits.float(),
            counts,
            prompt_seen,
            params.presence,
            params.frequency,
            params.repetition,
            params.bias_ids,
            params.bias_values,
        )

    def logprobs(
        self,
        raw: Tensor,
        processed: Tensor,
        mask_words: Tensor | None,
        temperature: Tensor,
        tokens: Tensor,
        raw_mode: Tensor,
    ) -> Logprobs:
        """``mask_words``: this rank's words; one all-gather of O(rows) values."""
        s = self.sharded
        mine = local_logprob_parts(
            raw,
            processed,
            mask_words,
            temperature,
            tokens,
            raw_mode,
            shard=s.shard,
            vocab_size=s.vocab_size,
        )
        k = min(TOP_WIDTH, s.vocab_size)
        return Logprobs(*combine_logprobs(s.group.all_gather(mine), k=k))


class ShardedStepDevice(StepDevice):
    """A :class:`StepDevice` over one rank's shard: logits are the rank's vocabulary slice, so
    the stages that name columns (EOS ban, mask words, penalty tokens, logit bias) use the
    slice's columns. Every rank of the group must make the same calls in the same order."""

    def __init__(
        self,
        *,
        model: Any,
        backend: Backend,
        sampler: ShardedSampler,
        config: EngineConfig,
        eos_ids: tuple[int, ...],
        words: int,
        logits_size: int,
    ) -> None:
        """``logits_size``: the model's full logits row (the slice is ``sampler.shard``)."""
        super().__init__(
            model=model,
            backend=backend,
            sampler=_RankSampler(sampler),
            config=config,
            eos_ids=eos_ids,
            words=words,
        )
        self.shard = sampler.shard
        self.logits_size = logits_size
        s = self.shard
        # EOS ids in this slice, as local columns (often none: the ban is then a no-op).
        self.eos_ids = tuple(e - s.start for e in eos_ids if s.start <= e < s.stop)

    @property
    def width(self) -> int:
        return self.shard.width

    def _sampler_mask(self, mask: Tensor | None) -> Tensor | None:
        return None if mask is None else shard_mask_words(mask, self.shard)

    def _penalize(self, logits: Tensor, step: SamplingRows, rows: list[SamplingRow]) -> Tensor:
        local = localize_rows(dataclasses.replace(step, rows=rows), self.shard)
        return super()._penalize(logits, local, local.rows)


def localize_rows(rows: SamplingRows, shard: VocabShard) -> SamplingRows:
    """The penalty inputs with token ids as columns of ``shard`` (ids of other slices dropped):
    penalties act column by column, so each rank needs only its own."""
    lo, hi = shard.start, shard.stop
    return dataclasses.replace(
        rows,
        rows=[
            dataclasses.replace(
                r, logit_bias={t - lo: v for t, v in r.logit_bias.items() if lo <= t < hi}
            )
            for r in rows.rows
        ],
        count=[(slot, t - lo) for slot, t in rows.count if lo <= t < hi],
        reset=[(slot, [t - lo for t in p if lo <= t < hi]) for slot, p in rows.reset],
    )


@dataclass(frozen=True)
class RankSpec:
    """What every rank needs to build its device (picklable: sent to the follower processes)."""

    model: str
    device: str
    dtype: torch.dtype
    threads: int
    config: EngineConfig
    eos_ids: tuple[int, ...]
    words: int
    vocab_size: int  # the tokenizer's: columns past it are never sampled
    timeout_s: float


def shard_device(
    model: Any, spec: RankSpec, group: Collectives, backend: Backend
) -> ShardedStepDevice:
    """Keep this rank's shard of a loaded model (plain linears) and wrap it with the sharded
    sampler."""
    logits_size = int(model.config.vocab_size)
    shard = shard_transformer(model, group)
    # Weight-only int4/int8 kernels quantize whole tensors; per shard they are not exact yet.
    model.use_serving_linears("none")
    sampler = ShardedSampler(shard=shard, vocab_size=spec.vocab_size, group=group)
    return ShardedStepDevice(
        model=model,
        backend=backend,
        sampler=sampler,
        config=spec.config,
        eos_ids=spec.eos_ids,
        words=spec.words,
        logits_size=logits_size,
    )


# ---------------------------------------------------------------------- rank 0 and followers
_CALLS = ("setup", "forward", "share", "replace", "sample", "warmup", "stop")


def _broadcast_call(name: str, *args: Any) -> tuple[str, tuple[Any, ...]]:
    box: list[Any] = [(name, args)]
    dist.broadcast_object_list(box, src=0)
    return box[0]


class LeaderDevice:
    """Rank 0's device for the engine: each call goes to the followers first (one broadcast of
    its host arguments), then runs on rank 0's shard. A call that fails leaves the ranks out of
    step (some ran their collectives, some did not), so any failure is fatal:
    :class:`~neuron_worker.step_device.DeviceLostError`, with ``explain(error)``'s reason."""

    def __init__(
        self, local: ShardedStepDevice, explain: Callable[[BaseException], str] = str
    ) -> None:
        self.local = local
        self.runner = local.runner
        self.pad_slot = local.pad_slot
        self.logits_size = local.logits_size
        self._explain = explain

    @property
    def shard(self) -> VocabShard:
        return self.local.shard

    @property
    def occurrences(self) -> OccurrenceTable | None:
        return self.local.occurrences

    def _call(self, name: str, args: tuple[Any, ...], run: Callable[[], T]) -> T:
        """Send ``name(*args)`` to the followers, then ``run`` it here."""
        try:
            _broadcast_call(name, *args)
            return run()
        except Exception as e:
            raise DeviceLostError(self._explain(e)) from e

    def setup(self) -> None:
        self._call("setup", (), self.local.setup)

    def forward(self, p: Pass) -> Logits:
        return self._call("forward", (p,), lambda: self.local.forward(p))

    def share(self, logits: Logits, copies: list[tuple[int, int, int]], index: list[int]) -> Logits:
        args = (logits, copies, index)
        return self._call("share", args, lambda: self.local.share(*args))

    def replace(self, logits: Logits, ff: Logits, dst: list[int]) -> Logits:
        return self._call("replace", (logits, ff, dst), lambda: self.local.replace(logits, ff, dst))

    def sample(self, logits: Logits, batch: SampleBatch) -> Sampled:
        return self._call("sample", (logits, batch), lambda: self.local.sample(logits, batch))

    def warmup(self, on_graph: Callable[[str], None]) -> int:
        # The followers warm up with a no-op callback.
        return self._call("warmup", (), lambda: self.local.warmup(on_graph))

    def close(self) -> None:
        """Tell the followers to leave their loop (they then exit)."""
        self._call("stop", (), lambda: None)


@torch.inference_mode()
def follow_calls(device: ShardedStepDevice) -> int:
    """A follower's loop: run rank 0's device calls on ``device`` until ``stop``; returns the
    number of calls run. Raises when the group breaks (rank 0 died, a collective timed out)."""
    count = 0
    while True:
        name, args = _broadcast_call("")
        if name not in _CALLS:
            raise RuntimeError(f"unknown device call {name!r} from rank 0")
        if name == "stop":
            return count
        if name == "warmup":
            device.warmup(lambda _: None)
        else:
            getattr(device, name)(*args)
        count += 1


def _follower_main(rank: int, world: int, init_method: str, spec: RankSpec) -> None:
    logging.basicConfig(
        level=logging.INFO, format=f"%(asctime)s rank{rank} %(levelname)s %(message)s"
    )
    torch.set_num_threads(spec.threads)
    if spec.device == "cuda":  # one GPU per rank; rank 0 (the server) keeps device 0
        torch.cuda.set_device(rank % torch.cuda.device_count())
    backend = create_backend(spec.device, compile=False)
    group = init_group(rank, world, init_method, device=backend.device, timeout_s=spec.timeout_s)
    try:
        from neuron_worker.model import load_model

        model = load_model(spec.model, device=backend.device, dtype=spec.dtype)
        device = shard_device(model.eval(), spec, group, backend)
        log.info("rank %d of %d ready: vocabulary %s", rank, world, device.shard)
        calls = follow_calls(device)
        log.info("rank %d stopped after %d device calls", rank, calls)
    finally:
        dist.destroy_process_group()


def start_followers(world: int, init_method: str, spec: RankSpec) -> list[BaseProcess]:
    """Start ranks 1..world-1 (spawned: a fresh interpreter each, no state inherited from the
    server); they join ``init_method`` and wait for rank 0."""
    ctx = mp.get_context("spawn")
    procs: list[BaseProcess] = []
    for rank in range(1, world):
        p = ctx.Process(
            target=_follower_main,
            args=(rank, world, init_method, spec),
            name=f"maskwire-rank{rank}",
            daemon=True,
        )
        p.start()
        procs.append(p)
    return procs


def stop_followers(procs: list[BaseProcess], timeout_s: float = 10.0) -> None:
    """Wait for the followers to leave (after ``LeaderDevice.close``); kill any that do not."""
    for p in procs:
        p.join(timeout_s)
        if p.is_alive():
            log.warning("rank process %s did not stop; killing it", p.name)
            p.kill()
            p.join(timeout_s)


class RankGroup:
    """A tensor-parallel worker's ranks as rank 0 sees them: the follower processes, the
    process group and rank 0's :class:`LeaderDevice`."""

    def __init__(self, procs: list[BaseProcess], local: ShardedStepDevice) -> None:
        self.procs = procs
        self.leader = LeaderDevice(local, explain=self.explain)
        self._monitor: RankMonitor | None = None

    @classmethod
    def start(cls, model: Any, spec: RankSpec, world: int, backend: Backend) -> RankGroup:
        """Start the followers, join them (blocks up to ``spec.timeout_s``) and shard rank 0's
        ``model`` (loaded with plain linears)."""
        init = f"tcp://127.0.0.1:{free_port()}"
        procs = start_followers(world, init, spec)
        try:
            group = init_group(0, world, init, device=backend.device, timeout_s=spec.timeout_s)
        except BaseException:
            stop_followers(procs, timeout_s=0)
            raise
        return cls(procs, shard_device(model, spec, group, backend))

    def dead(self) -> str | None:
        """ "rank N exited (code C)" for the first follower no longer running, else None."""
        for rank, p in enumerate(self.procs, start=1):
            if not p.is_alive():
                return f"tensor-parallel rank {rank} exited (exit code {p.exitcode})"
        return None

    def explain(self, error: BaseException, wait_s: float = 1.0) -> str:
        """Why a collective failed: a dead follower (a closed connection is usually noticed
        before the process is reaped, hence the short wait), else the error itself."""
        deadline = time.monotonic() + wait_s
        while True:
            reason = self.dead()
            if reason is not None or time.monotonic() >= deadline:
                break
            time.sleep(0.05)
        return reason or f"the tensor-parallel group failed: {error}"

    def watch(self, on_dead: Callable[[str], object]) -> None:
        """Call ``on_dead(reason)`` (from a monitor thread) when a follower process exits."""
        self._monitor = RankMonitor(self.procs, lambda _: on_dead(self.dead() or "")).start()

    def stop(self) -> None:
        """After the engine stopped (which tells the followers to leave): join or kill them."""
        if self._monitor is not None:
            self._monitor.stop()
        stop_followers(self.procs)
        if dist.is_initialized():
            dist.destroy_process_group()
