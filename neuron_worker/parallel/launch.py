"""Start a tensor-parallel group of local processes: one spawned process per rank, joined over
``torch.distributed`` on loopback (gloo on CPU). Used by the tests and the benchmark."""

from __future__ import annotations

import socket
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from neuron_worker.parallel.group import init_group

__all__ = ["free_port", "run_ranks"]

RankFn = Callable[..., Any]


def free_port() -> int:
    """A TCP port free on loopback right now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _rank_main(
    rank: int,
    world: int,
    init_method: str,
    out: str,
    threads: int,
    fn: RankFn,
    args: tuple[Any, ...],
) -> None:
    torch.set_num_threads(threads)
    group = init_group(rank, world, init_method, timeout_s=120)
    try:
        torch.save(fn(group, *args), Path(out) / f"rank{rank}.pt")
    finally:
        dist.destroy_process_group()


def run_ranks(fn: RankFn, world: int, out_dir: Path, *args: Any, threads: int = 1) -> list[Any]:
    """Run ``fn(group, *args)`` on ``world`` spawned ranks (``group``: their
    :class:`~neuron_worker.parallel.group.ProcessGroup`); return their results in rank order.
    ``fn`` and ``args`` are pickled into the processes (``fn`` must be a module-level function);
    results travel back through ``torch.save`` files in ``out_dir``. ``threads``: torch threads
    per rank. A rank that raises fails the call with its traceback."""
    init = f"tcp://127.0.0.1:{free_port()}"
    mp.spawn(
        _rank_main, args=(world, init, str(out_dir), threads, fn, args), nprocs=world, join=True
    )
    return [torch.load(out_dir / f"rank{r}.pt", weights_only=False) for r in range(world)]
