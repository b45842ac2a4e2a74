"""The two collectives tensor parallelism needs, behind one small interface.

:class:`Collectives` is what the sharded model and the sharded sampler call: ``all_reduce``
(sum, after each row-parallel projection and the vocab-parallel embedding) and ``all_gather`` (the
sampler's per-rank candidates). :class:`SingleRank` is the identity for one device, so the same
code runs at TP = 1; :class:`ProcessGroup` wraps ``torch.distributed``: gloo for CPU tensors, nccl
for CUDA (picked from the device by :func:`init_group`). On XLA the same calls are
``xm.all_reduce`` / ``xm.all_gather`` over the Neuron TP group (docs/neuron.md).
"""

from __future__ import annotations

from datetime import timedelta
from typing import Protocol

import torch
import torch.distributed as dist
from torch import Tensor

__all__ = ["Collectives", "ProcessGroup", "SingleRank", "backend_for", "init_group"]


class Collectives(Protocol):
    """A tensor-parallel group as seen by one rank."""

    @property
    def rank(self) -> int: ...

    @property
    def world(self) -> int: ...

    def all_reduce(self, x: Tensor) -> Tensor:
        """Element-wise sum over the ranks (may reuse ``x``'s storage)."""
        ...

    def all_gather(self, x: Tensor) -> Tensor:
        """``[*S]`` on every rank -> ``[world, *S]``, in rank order, on every rank."""
        ...


class SingleRank:
    """A group of one: both collectives are the identity (TP = 1 through the same code)."""

    rank = 0
    world = 1

    def all_reduce(self, x: Tensor) -> Tensor:
        return x

    def all_gather(self, x: Tensor) -> Tensor:
        return x.unsqueeze(0)


class ProcessGroup:
    """Collectives over an initialised ``torch.distributed`` group (default: the world).

    Counts the bytes each rank contributes to the collectives (``sent_bytes``), which the
    benchmark reports per step.
    """

    def __init__(self, group: dist.ProcessGroup | None = None) -> None:
        self.group = group
        self.rank = dist.get_rank(group)
        self.world = dist.get_world_size(group)
        self.sent_bytes = 0

    def all_reduce(self, x: Tensor) -> Tensor:
        self.sent_bytes += x.numel() * x.element_size()
        dist.all_reduce(x, group=self.group)
        return x

    def all_gather(self, x: Tensor) -> Tensor:
        self.sent_bytes += x.numel() * x.element_size()
        x = x.contiguous()
        parts = [torch.empty_like(x) for _ in range(self.world)]
        dist.all_gather(parts, x, group=self.group)
        return torch.stack(parts)


def backend_for(device: torch.device | str) -> str:
    """``nccl`` for CUDA devices, ``gloo`` otherwise (CPU)."""
    return "nccl" if torch.device(device).type == "cuda" else "gloo"


def init_group(
    rank: int,
    world: int,
    init_method: str,
    *,
    device: torch.device | str = "cpu",
    timeout_s: float = 60.0,
) -> ProcessGroup:
    """Join the default process group (``init_method`` e.g. ``tcp://127.0.0.1:29500``) with the
    backend for ``device`` and return its collectives. ``timeout_s`` bounds every collective, so
    a dead peer fails the survivors instead of hanging them."""
    dist.init_process_group(
        backend_for(device),
        init_method=init_method,
        rank=rank,
        world_size=world,
        timeout=timedelta(seconds=timeout_s),
    )
    return ProcessGroup()
