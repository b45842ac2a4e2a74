"""Rank 0 leads, the other ranks follow: every forward pass and sampling step is broadcast from
rank 0 and replayed by each follower on its own shard.

:class:`Leader` (rank 0) sends each operation as a fixed-size int64 header plus its tensors with
``broadcast``, then runs it locally: :meth:`Leader.forward` (the model's ``step_logits``; each rank
keeps its own logits slice) and :meth:`Leader.sample` (the full packed mask rows and the sampling
parameters; each rank applies its mask words and the sharded sampler's all-gather makes every rank
agree). :func:`follow` is a follower's loop. A follower that dies makes the next collective on
rank 0 raise (gloo reports the closed connection, or the group's timeout expires): never a hang.
:class:`RankMonitor` watches the follower processes so the server can go NOT_SERVING at once.

The worker itself uses :mod:`neuron_worker.parallel.serving`, which replays the engine's device
calls the same way and reuses :class:`RankMonitor`.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from enum import IntEnum
from typing import Protocol

import torch
import torch.distributed as dist
from torch import Tensor

from neuron_worker.parallel.runner import RankRunner
from neuron_worker.sampler import SamplingTensors

__all__ = ["Leader", "Op", "RankMonitor", "follow"]

_HEADER = 8


class Op(IntEnum):
    """Header word 0: what the followers do next."""

    FORWARD = 1
    SAMPLE = 2
    STOP = 3


class _Alive(Protocol):
    def is_alive(self) -> bool: ...


def _broadcast(x: Tensor) -> Tensor:
    dist.broadcast(x, src=0)
    return x


def _header(*values: int) -> Tensor:
    h = torch.zeros(_HEADER, dtype=torch.int64)
    h[: len(values)] = torch.tensor(values, dtype=torch.int64)
    return h


class Leader(RankRunner):
    """Rank 0's :class:`RankRunner`: broadcasts each operation to the followers, then runs it
    (headers and arguments travel as CPU tensors: gloo; the model may live on any device)."""

    @torch.inference_mode()
    def forward(
        self, tokens: Tensor, input_pos: Tensor, cache_slots: Tensor, last: Tensor, kv_len: int
    ) -> Tensor:
        b, t = tokens.shape
        _broadcast(_header(Op.FORWARD, b, t, kv_len))
        _broadcast(torch.stack([tokens, input_pos]).cpu().contiguous())
        _broadcast(torch.stack([cache_slots, last]).cpu().contiguous())
        return super().forward(tokens, input_pos, cache_slots, last, kv_len)

    @torch.inference_mode()
    def sample(self, logits: Tensor, packed_mask: Tensor | None, params: SamplingTensors) -> Tensor:
        b = logits.shape[0]
        words = 0 if packed_mask is None else packed_mask.shape[1]
        flags = int(params.all_greedy) | int(params.any_filter) << 1
        _broadcast(_header(Op.SAMPLE, b, words, flags))
        floats, ints = _pack_params(params)
        _broadcast(floats)
        _broadcast(ints)
        if packed_mask is not None:
            packed_mask = _broadcast(packed_mask.cpu().contiguous())
        return super().sample(logits, packed_mask, params)

    def stop(self) -> None:
        """Tell the followers to leave their loop."""
        _broadcast(_header(Op.STOP))


def _pack_params(p: SamplingTensors) -> tuple[Tensor, Tensor]:
    floats = torch.stack([p.temperature.double(), p.top_p.double()]).cpu()
    ints = torch.stack([p.top_k, p.seed, p.offset]).cpu()
    return floats.contiguous(), ints.contiguous()


def _unpack_params(
    floats: Tensor, ints: Tensor, flags: int, device: torch.device
) -> SamplingTensors:
    return SamplingTensors(
        temperature=floats[0].float().to(device),
        top_p=floats[1].float().to(device),
        top_k=ints[0].to(device),
        seed=ints[1].to(device),
        offset=ints[2].to(device),
        all_greedy=bool(flags & 1),
        any_filter=bool(flags & 2),
    )


@torch.inference_mode()
def follow(runner: RankRunner) -> int:
    """A follower's loop: replay rank 0's operations on ``runner`` until STOP; returns the number
    of operations run. Raises when the group breaks (rank 0 died, or a collective timed out)."""
    logits: Tensor | None = None
    count = 0
    while True:
        h = _broadcast(_header()).tolist()
        op = Op(h[0])
        if op == Op.STOP:
            return count
        if op == Op.FORWARD:
            b, t, kv_len = h[1], h[2], h[3]
            args = _broadcast(torch.empty(2, b, t, dtype=torch.int64))
            extra = _broadcast(torch.empty(2, b, dtype=torch.int64))
            logits = runner.forward(args[0], args[1], extra[0], extra[1], kv_len)
        else:
            b, words, flags = h[1], h[2], h[3]
            floats = _broadcast(torch.empty(2, b, dtype=torch.float64))
            ints = _broadcast(torch.empty(3, b, dtype=torch.int64))
            mask = _broadcast(torch.empty(b, words, dtype=torch.int32)) if words else None
            if logits is None:
                raise RuntimeError("SAMPLE before any FORWARD")
            runner.sample(logits, mask, _unpack_params(floats, ints, flags, runner.device))
        count += 1


class RankMonitor:
    """Polls the follower processes every ``interval_s``; calls ``on_dead(rank)`` once, from its
    own thread, for the first rank found dead (ranks are numbered from 1)."""

    def __init__(
        self,
        processes: Sequence[_Alive],
        on_dead: Callable[[int], object],
        *,
        interval_s: float = 0.5,
    ) -> None:
        self._processes = list(processes)
        self._on_dead = on_dead
        self._interval = interval_s
        self._stop = threading.Event()
        self.dead: int | None = None
        self._thread = threading.Thread(target=self._run, name="maskwire-ranks", daemon=True)

    def start(self) -> RankMonitor:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()

    def _run(self) -> None:
        while not self._stop.wait(self._interval):
            for rank, proc in enumerate(self._processes, start=1):
                if not proc.is_alive():
                    self.dead = rank
                    self._on_dead(rank)
                    return
