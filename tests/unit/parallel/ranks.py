"""Run a function on every rank of a gloo group on loopback (one spawned process per rank)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from neuron_worker.parallel import ProcessGroup, init_group
from tests.support.processes import free_port

RankFn = Callable[..., Any]


def _rank_main(
    rank: int, world: int, init_method: str, out: str, fn: RankFn, args: tuple[Any, ...]
) -> None:
    torch.set_num_threads(1)
    group = init_group(rank, world, init_method, timeout_s=60)
    try:
        result = fn(group, *args)
        torch.save(result, Path(out) / f"{rank}.pt")
    finally:
        dist.destroy_process_group()


def run_ranks(fn: RankFn, world: int, tmp_path: Path, *args: Any) -> list[Any]:
    """``fn(group: ProcessGroup, *args)`` on ``world`` ranks; their results in rank order.
    ``fn`` must be a module-level function (it is pickled into the spawned processes)."""
    init = f"tcp://127.0.0.1:{free_port()}"
    mp.spawn(_rank_main, args=(world, init, str(tmp_path), fn, args), nprocs=world, join=True)
    return [torch.load(tmp_path / f"{r}.pt", weights_only=False) for r in range(world)]


__all__ = ["ProcessGroup", "run_ranks"]
