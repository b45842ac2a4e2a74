"""maskwire.cpus: thread pools follow a container's CPU limit, not the node's CPU count; the
allowed CPUs' idle time."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from maskwire.cpus import (
    available_cpus,
    cgroup_cpu_quota,
    cgroup_throttled_ns,
    cpu_model_and_flags,
    idle_cpu_ns,
)

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


def test_the_quota_of_the_process_own_group_is_found(tmp_path: Path) -> None:
    # A process moved into a group on a host (no cgroup namespace): its limit is in that group,
    # not at the hierarchy's root.
    proc = tmp_path / "cgroup"
    proc.write_text("4:memory:/x\n1:cpu,cpuacct:/bench/group\n0::/\n")
    root = mk(tmp_path / "fs")
    v1(root, "-1", "100000")
    group = root / "cpu" / "bench" / "group"
    group.mkdir(parents=True)
    (group / "cpu.cfs_quota_us").write_text("150000")
    (group / "cpu.cfs_period_us").write_text("100000")
    assert cgroup_cpu_quota(root, proc) == 1.5
    assert available_cpus(root, proc) == min(AFFINITY, 2)
    assert cgroup_cpu_quota(root, tmp_path / "missing") is None  # the root's: no limit


def test_cgroup_v2_group_of_the_process(tmp_path: Path) -> None:
    proc = tmp_path / "cgroup"
    proc.write_text("0::/pods/worker\n")
    group = tmp_path / "pods" / "worker"
    group.mkdir(parents=True)
    (group / "cpu.max").write_text("50000 100000\n")
    (group / "cpu.stat").write_text("usage_usec 9\nnr_throttled 3\nthrottled_usec 1234\n")
    assert cgroup_cpu_quota(tmp_path, proc) == 0.5
    assert cgroup_throttled_ns(tmp_path, proc) == 1_234_000


def test_cgroup_v1_throttled_time(tmp_path: Path) -> None:
    v1(tmp_path, "50000", "100000")
    (tmp_path / "cpu" / "cpu.stat").write_text("nr_periods 5\nnr_throttled 2\nthrottled_time 77\n")
    assert cgroup_throttled_ns(tmp_path, tmp_path / "none") == 77
    assert cgroup_throttled_ns(tmp_path / "missing", tmp_path / "none") is None


def test_the_first_processors_model_and_flags_are_read(tmp_path: Path) -> None:
    info = tmp_path / "cpuinfo"
    info.write_text(
        "processor\t: 0\nmodel name\t: Some CPU\nflags\t\t: fma avx2 avx512f\n\n"
        "processor\t: 1\nmodel name\t: Other CPU\nflags\t\t: sse2\n"
    )
    assert cpu_model_and_flags(info) == ("Some CPU", frozenset({"fma", "avx2", "avx512f"}))
    assert cpu_model_and_flags(tmp_path / "missing") == ("", frozenset())


def test_idle_time_sums_the_allowed_cpus_idle_and_iowait(tmp_path: Path) -> None:
    stat = tmp_path / "stat"
    stat.write_text(
        "cpu  900 0 100 7000 30 0 0 0 0 0\n"
        "cpu0 300 0 50 1000 10 0 0 0 0 0\n"
        "cpu1 300 0 25 2000 20 0 0 0 0 0\n"
        "cpu2 300 0 25 4000 0 0 0 0 0 0\n"
        "intr 1 2 3\n"
    )
    tick_ns = 1_000_000_000 // os.sysconf("SC_CLK_TCK")
    assert idle_cpu_ns(stat, cpus={0, 2}) == (1000 + 10 + 4000) * tick_ns
    assert idle_cpu_ns(stat, cpus={1}) == 2020 * tick_ns
    assert idle_cpu_ns(tmp_path / "missing", cpus={0}) is None
    assert idle_cpu_ns() is not None  # this machine's own
