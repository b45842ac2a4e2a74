"""maskwire.cpus: thread pools follow a container's CPU limit, not the node's CPU count."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from maskwire.cpus import available_cpus, cgroup_cpu_quota

AFFINITY = len(os.sched_getaffinity(0))


def mk(path: Path) -> Path:
    path.mkdir()
    return path


def v2(root: Path, text: str) -> Path:
    (root / "cpu.max").write_text(text)
    return root


def v1(root: Path, quota: str, period: str) -> Path:
    (root / "cpu").mkdir()
    (root / "cpu" / "cpu.cfs_quota_us").write_text(quota)
    (root / "cpu" / "cpu.cfs_period_us").write_text(period)
    return root


def test_cgroup_v2_quota(tmp_path: Path) -> None:
    assert cgroup_cpu_quota(v2(tmp_path, "150000 100000\n")) == 1.5
    assert available_cpus(tmp_path) == min(AFFINITY, 2)  # rounded up


def test_cgroup_v2_without_limit(tmp_path: Path) -> None:
    assert cgroup_cpu_quota(v2(tmp_path, "max 100000\n")) is None
    assert available_cpus(tmp_path) == AFFINITY


def test_cgroup_v1_quota_and_no_quota(tmp_path: Path) -> None:
    assert cgroup_cpu_quota(v1(mk(tmp_path / "a"), "50000", "100000")) == 0.5
    assert available_cpus(tmp_path / "a") == 1
    assert cgroup_cpu_quota(v1(mk(tmp_path / "b"), "-1", "100000")) is None


@pytest.mark.parametrize("text", ["", "garbage", "100000"])
def test_unreadable_limits_are_ignored(tmp_path: Path, text: str) -> None:
    assert cgroup_cpu_quota(v2(tmp_path, text)) is None
    assert cgroup_cpu_quota(tmp_path / "missing") is None
    assert available_cpus(tmp_path) == AFFINITY
