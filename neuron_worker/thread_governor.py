"""Intra-op threads that follow the CPU time the worker actually gets.

torch's CPU parallel regions are fork-join: each one ends when its slowest thread arrives. When
another process takes a core that one of the team's threads runs on, that thread runs only every
scheduler time slice (milliseconds), and each of the hundreds of regions in a forward pass waits
for it: on 2 cores one busy neighbour made decoding about 60x slower. A smaller team, sized to the
CPUs that are really free, has no such wait.

`ThreadGovernor` watches the team the device thread leads (the device thread names itself before
its first parallel region, and the OpenMP threads it starts inherit the name): per device call, the
time the team's threads were runnable but not running (Linux schedstat `run_delay`), less what a
cgroup CPU quota's throttling explains (a throttled group waits as a whole, which costs no region
more than its share). When that stall passes `shrink_at` of the calls' wall time, the team shrinks
by the threads' worth of time it lost (at least one). While shrunk, it tries the full team again
now and then and keeps it when the stall has gone; each failed try doubles the wait before the
next (up to `max_probe_interval_s`), so a lasting neighbour costs a few slow calls a minute.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from maskwire.cpus import cgroup_throttled_ns

log = logging.getLogger(__name__)

TEAM_NAME = "maskwire-device"  # Linux keeps 15 bytes of a thread's name: this is exactly 15
_PR_SET_NAME = 15


def name_this_thread(name: str = TEAM_NAME) -> None:
    """Give the calling OS thread `name` (threads it starts from now on inherit it)."""
    libc_name = ctypes.util.find_library("c")
    if libc_name is None:
        return
    libc = ctypes.CDLL(libc_name, use_errno=True)
    libc.prctl(_PR_SET_NAME, name.encode()[:15], 0, 0, 0)


# (name, tasks dir) -> (when scanned, the team's schedstat files): the governor reads the wait
# around every device call, so the thread list (every thread's `comm`) is scanned once a second,
# not per call.
_teams: dict[tuple[str, Path], tuple[float, list[Path]]] = {}
_RESCAN_S = 1.0


def team_run_delay_ns(name: str = TEAM_NAME, tasks: Path = Path("/proc/self/task")) -> int:
    """Nanoseconds the threads named `name` have spent runnable but waiting for a CPU."""
    now = time.monotonic()
    scanned, files = _teams.get((name, tasks), (-_RESCAN_S, []))
    if now - scanned >= _RESCAN_S:
        files = _team_files(name, tasks)
        _teams[(name, tasks)] = (now, files)
    total = 0
    for stat in files:
        try:
            total += int(stat.read_text().split()[1])
        except (OSError, ValueError, IndexError):  # the thread ended meanwhile
            continue
    return total


def _team_files(name: str, tasks: Path) -> list[Path]:
    try:
        entries = list(tasks.iterdir())
    except OSError:
        return []
    found = []
    for task in entries:
        try:
            if (task / "comm").read_text().strip() == name:
                found.append(task / "schedstat")
        except OSError:  # the thread ended meanwhile
            continue
    return found


@dataclass(frozen=True)
class GovernorConfig:
    full: int  # the team's size with the CPUs to itself
    shrink_at: float = 0.3  # stall, as a share of the calls' wall time, that shrinks the team
    window_s: float = 0.2  # device-call time a decision is based on
    first_probe_s: float = 2.0
    max_probe_interval_s: float = 32.0


class ThreadGovernor:
    """Sizes the intra-op team from the stall measured around device calls.

    Call `before()` and `after(token)` around each device call, on the device thread (the team
    size is set there, between calls). Readers and the setter are injected for tests."""

    def __init__(
        self,
        config: GovernorConfig,
        set_threads: Callable[[int], None],
        *,
        clock: Callable[[], int] = time.monotonic_ns,
        run_delay: Callable[[], int] = team_run_delay_ns,
        throttled: Callable[[], int | None] = cgroup_throttled_ns,
    ) -> None:
        self.config = config
        self.threads = config.full
        self._set_threads = set_threads
        self._clock = clock
        self._run_delay = run_delay
        self._throttled = throttled
        self._window = _Window()
        self._probing = False
        self._next_probe_ns = 0
        self._interval_ns = _ns(config.first_probe_s)
        self.shrinks = 0
        self.probes = 0

    def before(self) -> tuple[int, int, int]:
        due = self.threads < self.config.full and self._clock() >= self._next_probe_ns
        if due and not self._probing:
            self._probing = True
            self.probes += 1
            self._resize(self.config.full)
        return self._clock(), self._run_delay(), self._throttled() or 0

    def after(self, token: tuple[int, int, int]) -> None:
        began, delay0, throttled0 = token
        wall = self._clock() - began
        delay = self._run_delay() - delay0
        throttled = (self._throttled() or 0) - throttled0
        self._window.add(wall, delay, throttled)
        if self._window.wall >= _ns(self.config.window_s):
            self._decide(self._window.stall(self.threads))
            self._window = _Window()

    def _decide(self, stall: float) -> None:
        """`stall`: threads' worth of time the team spent waiting for CPUs in the window."""
        limit = self.config.shrink_at
        if self._probing:
            self._probing = False
            if stall < limit:  # the CPUs are back: keep the full team
                log.info("intra-op threads back to %d (stall %.2f)", self.threads, stall)
                self._interval_ns = _ns(self.config.first_probe_s)
                return
            self._interval_ns = min(2 * self._interval_ns, _ns(self.config.max_probe_interval_s))
            self._shrink(stall)
            return
        if stall >= limit and self.threads > 1:
            self._shrink(stall)

    def _shrink(self, stall: float) -> None:
        lost = max(1, round(stall))
        target = max(1, min(self.threads, self.config.full) - lost)
        if target != self.threads:
            log.info(
                "intra-op threads %d -> %d: the team waited %.2f threads' worth of time for CPUs "
                "(another process is using them); trying %d again in %.0f s",
                self.threads,
                target,
                stall,
                self.config.full,
                self._interval_ns / 1e9,
            )
            self.shrinks += 1
            self._resize(target)
        self._next_probe_ns = self._clock() + self._interval_ns

    def _resize(self, n: int) -> None:
        self.threads = n
        self._set_threads(n)


class _Window:
    __slots__ = ("delay", "throttled", "wall")

    def __init__(self) -> None:
        self.wall = 0
        self.delay = 0
        self.throttled = 0

    def add(self, wall: int, delay: int, throttled: int) -> None:
        self.wall += wall
        self.delay += delay
        self.throttled += throttled

    def stall(self, threads: int) -> float:
        if self.wall <= 0:
            return 0.0
        # A throttled group's threads all wait together: that wait is the quota's, not a
        # neighbour's, and costs no region more than its share.
        excess = max(0, self.delay - threads * self.throttled)
        return excess / self.wall


def _ns(seconds: float) -> int:
    return int(seconds * 1e9)
