"""How many CPUs this process can really use: its affinity mask, capped by a container CPU limit.

In a Kubernetes pod `os.cpu_count()` and the affinity mask report the node's CPUs (64 on a large
node) while the CPU limit is enforced as a cgroup quota (say 2 CPUs' worth of time per period).
Thread pools sized to the node then spend most of their time throttled, so pools default to this.

The limit is read from this process's own cgroup (`/proc/self/cgroup`: in a container that is the
namespace's root; a process moved into a group on a host is found there too), v2 `cpu.max` or v1
`cpu.cfs_quota_us` / `cpu.cfs_period_us`.
"""

from __future__ import annotations

import math
import os
from pathlib import Path

CGROUP_ROOT = Path("/sys/fs/cgroup")
PROC_CGROUP = Path("/proc/self/cgroup")


def available_cpus(cgroup_root: Path = CGROUP_ROOT, proc_cgroup: Path = PROC_CGROUP) -> int:
    """CPUs in this process's affinity mask, capped by its cgroup CPU quota (rounded up)."""
    try:
        n = len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        n = os.cpu_count() or 1
    quota = cgroup_cpu_quota(cgroup_root, proc_cgroup)
    if quota is not None:
        n = min(n, max(1, math.ceil(quota)))
    return max(1, n)


def cgroup_cpu_quota(root: Path = CGROUP_ROOT, proc_cgroup: Path = PROC_CGROUP) -> float | None:
    """The CPU limit as a number of CPUs, or None when there is none or it cannot be read."""
    for group in _v2_groups(root, proc_cgroup):
        try:
            quota, period = (group / "cpu.max").read_text().split()[:2]
            return None if quota == "max" else int(quota) / int(period)
        except (OSError, ValueError):
            continue
    for group in _v1_groups(root, proc_cgroup):
        try:
            quota_us = int((group / "cpu.cfs_quota_us").read_text())
            period_us = int((group / "cpu.cfs_period_us").read_text())
        except (OSError, ValueError):
            continue
        return quota_us / period_us if quota_us > 0 and period_us > 0 else None
    return None


def cgroup_throttled_ns(root: Path = CGROUP_ROOT, proc_cgroup: Path = PROC_CGROUP) -> int | None:
    """Nanoseconds this process's cgroup has spent throttled by its CPU quota so far (v2
    `throttled_usec`, v1 `throttled_time`), or None when it cannot be read."""
    source = throttle_source(root, proc_cgroup)
    return None if source is None else read_throttled_ns(source)


ThrottleSource = tuple[Path, str, int]  # cpu.stat file, its throttled-time key, ns per unit


def throttle_source(
    root: Path = CGROUP_ROOT, proc_cgroup: Path = PROC_CGROUP
) -> ThrottleSource | None:
    """Where this process's cgroup counts its throttled time (resolving it reads
    `/proc/self/cgroup`: callers that read often keep the answer)."""
    candidates = [(g, "throttled_usec", 1000) for g in _v2_groups(root, proc_cgroup)]
    candidates += [(g, "throttled_time", 1) for g in _v1_groups(root, proc_cgroup)]
    for group, key, scale in candidates:
        source = (group / "cpu.stat", key, scale)
        if read_throttled_ns(source) is not None:
            return source
    return None


def read_throttled_ns(source: ThrottleSource) -> int | None:
    path, key, scale = source
    try:
        lines = path.read_text().splitlines()
    except OSError:
        return None
    for line in lines:
        name, _, value = line.partition(" ")
        if name == key and value.strip().isdigit():
            return int(value) * scale
    return None


def _own_paths(proc_cgroup: Path) -> dict[str, str]:
    """Controller -> this process's group path (`""` for v2's unified hierarchy)."""
    paths: dict[str, str] = {}
    try:
        lines = proc_cgroup.read_text().splitlines()
    except OSError:
        return paths
    for line in lines:
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        for controller in parts[1].split(","):
            paths[controller] = parts[2].lstrip("/")
    return paths


def _v2_groups(root: Path, proc_cgroup: Path) -> list[Path]:
    own = _own_paths(proc_cgroup).get("")
    groups = [root / own] if own else []
    return [*groups, root]


def _v1_groups(root: Path, proc_cgroup: Path) -> list[Path]:
    own = _own_paths(proc_cgroup).get("cpu")
    groups = [root / "cpu" / own] if own else []
    return [*groups, root / "cpu"]


def idle_cpu_ns(stat: Path = Path("/proc/stat"), cpus: set[int] | None = None) -> int | None:
    """Nanoseconds the CPUs in `cpus` (default: this process's affinity mask) have spent idle
    since boot (`idle` + `iowait` of their `/proc/stat` lines), or None where unreadable."""
    if cpus is None:
        try:
            cpus = os.sched_getaffinity(0)
        except AttributeError:  # not Linux
            return None
    try:
        text = stat.read_text()
    except OSError:
        return None
    ticks = 0
    for line in text.splitlines():
        if not line.startswith("cpu") or line.startswith("cpu "):
            continue
        name, *fields = line.split()
        try:
            if int(name[3:]) in cpus:
                ticks += int(fields[3]) + int(fields[4])
        except (ValueError, IndexError):
            return None
    return ticks * 1_000_000_000 // os.sysconf("SC_CLK_TCK")


def cpu_model_and_flags(cpuinfo: Path = Path("/proc/cpuinfo")) -> tuple[str, frozenset[str]]:
    """The first processor's model name and instruction-set flags (empty where unreadable)."""
    model, flags = "", frozenset[str]()
    try:
        text = cpuinfo.read_text()
    except OSError:
        return model, flags
    for line in text.splitlines():
        field, _, value = line.partition(":")
        field = field.strip()
        if field == "model name" and not model:
            model = value.strip()
        elif field == "flags" and not flags:
            flags = frozenset(value.split())
        if model and flags:
            break
    return model, flags
