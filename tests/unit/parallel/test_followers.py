"""Rank 0 leads and a follower process replays its steps: the tokens equal TP = 1's, and a
killed follower makes rank 0 fail within seconds instead of hanging."""

from __future__ import annotations

import time
from collections.abc import Iterator
from multiprocessing.process import BaseProcess

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from neuron_worker.model import build_model
from neuron_worker.parallel import (
    Collectives,
    ShardedSampler,
    SingleRank,
    init_group,
    shard_transformer,
)
from neuron_worker.parallel.decode import sample_generate
from neuron_worker.parallel.followers import Leader, RankMonitor, follow
from neuron_worker.parallel.launch import free_port
from neuron_worker.parallel.runner import RankRunner
from tests.unit.model.tiny import random_weights
from tests.unit.parallel.test_model import ODD, PROMPTS, UNEVEN

TIMEOUT_S = 5.0


def _runner(group: Collectives) -> RankRunner:
    model = build_model(UNEVEN, random_weights(UNEVEN))
    shard = shard_transformer(model, group)
    model.setup_caches(1, 32)
    return RankRunner(model, ShardedSampler(shard=shard, vocab_size=UNEVEN.vocab_size, group=group))


def _follower(init_method: str) -> None:
    torch.set_num_threads(1)
    group = init_group(1, 2, init_method, timeout_s=TIMEOUT_S)
    try:
        follow(_runner(group))
    finally:
        dist.destroy_process_group()


def _decode(runner: RankRunner) -> list[list[int]]:
    prompt = PROMPTS[0].tolist()
    return [
        sample_generate(runner, prompt, 10),
        sample_generate(runner, prompt, 10, temperature=1.0, top_p=0.9, seed=8, mask=ODD),
    ]


@pytest.fixture
def follower() -> Iterator[tuple[Leader, BaseProcess]]:
    """Rank 0 in this process, rank 1 in a spawned one."""
    init = f"tcp://127.0.0.1:{free_port()}"
    proc = mp.get_context("spawn").Process(target=_follower, args=(init,), daemon=True)
    proc.start()
    group = init_group(0, 2, init, timeout_s=TIMEOUT_S)
    plain = _runner(group)
    try:
        yield Leader(plain.model, plain.sampler), proc
    finally:
        dist.destroy_process_group()
        proc.kill()
        proc.join()


def test_followers_replay_the_leaders_steps(follower: tuple[Leader, BaseProcess]) -> None:
    leader, proc = follower
    expected = _decode(_runner(SingleRank()))
    assert _decode(leader) == expected
    assert all(t % 2 for t in expected[1])  # the mask held
    leader.stop()
    proc.join(timeout=10)
    assert proc.exitcode == 0


def test_a_killed_follower_fails_the_leader_within_seconds(
    follower: tuple[Leader, BaseProcess],
) -> None:
    leader, proc = follower
    dead: list[int] = []
    monitor = RankMonitor([proc], dead.append, interval_s=0.1).start()
    sample_generate(leader, PROMPTS[0].tolist(), 2)
    proc.kill()
    began = time.monotonic()
    with pytest.raises(RuntimeError):
        sample_generate(leader, PROMPTS[0].tolist(), 2)
    assert time.monotonic() - began < 2 * TIMEOUT_S
    deadline = time.monotonic() + 2
    while not dead and time.monotonic() < deadline:
        time.sleep(0.05)
    monitor.stop()
    assert dead == [1]
