"""How many CPUs this process can really use: its affinity mask, capped by a container CPU limit.

In a Kubernetes pod `os.cpu_count()` and the affinity mask report the node's CPUs (64 on a large
node) while the CPU limit is enforced as a cgroup quota (say 2 CPUs' worth of time per period).
Thread pools sized to the node then spend most of their time throttled, so pools default to this.
"""

from __future__ import annotations

import math
import os
from pathlib import Path

CGROUP_ROOT = Path("/sys/fs/cgroup")


def available_cpus(cgroup_root: Path = CGROUP_ROOT) -> int:
    """CPUs in this process's affinity mask, capped by its cgroup CPU quota (rounded up)."""
    try:
        n = len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        n = os.cpu_count() or 1
    quota = cgroup_cpu_quota(cgroup_root)
    if quota is not None:
        n = min(n, max(1, math.ceil(quota)))
    return max(1, n)


def cgroup_cpu_quota(root: Path = CGROUP_ROOT) -> float | None:
    """The CPU limit as a number of CPUs (cgroup v2 `cpu.max`, else v1 `cpu.cfs_quota_us` /
    `cpu.cfs_period_us`), or None when there is none or it cannot be read."""
    try:
        quota, period = (root / "cpu.max").read_text().split()[:2]
        return None if quota == "max" else int(quota) / int(period)
    except (OSError, ValueError):
        pass
    try:
        quota_us = int((root / "cpu" / "cpu.cfs_quota_us").read_text())
        period_us = int((root / "cpu" / "cpu.cfs_period_us").read_text())
    except (OSError, ValueError):
        return None
    return quota_us / period_us if quota_us > 0 and period_us > 0 else None
