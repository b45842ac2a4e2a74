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
more than its share). That stall is only the cue: a stall can also come from the stack's own
grammar service or gateway, whose bursts cost the team less than a thread would. When it passes
`shrink_at` of the calls' wall time, the governor tries a team smaller by the threads' worth of
time it lost and keeps it only if the same calls (equal keys: the same pass shape) ran faster
than at the full size since the stall began (times from before it would set a neighbour's
calls against quiet ones); otherwise it goes back and waits before trying again. A stall of a
whole thread's worth (a core taken) is judged more readily: a smaller team faster at all, or
with nothing to compare, is kept, and one declined is tried again after the first wait, not a
doubled one, since beside a neighbour the full team runs tens of times slower. While shrunk, it tries
the full team now and then and keeps it when that is faster, or when the smaller team has not
run the same calls lately (nothing to compare: the stall decides again). Each failed try doubles
the wait before the next (up to `max_probe_interval_s`), so a lasting condition costs a few slow
calls a minute; a stall half a thread or more above the one a failed try started on is a new
condition (a neighbour arrived) and is tried at once. The same holds the other way: while shrunk,
a window in which the CPUs the process may use sat idle for half the threads the team lacks (the
neighbour left) tries the full team at once instead of waiting out the back-off, which after a
long busy spell reaches `max_probe_interval_s`. While those CPUs had no idle time at all in the
last window (the neighbour is still there), a due try is skipped as if it had failed, until the
wait reaches its cap: a try of the full team beside a neighbour costs a pass tens of times slower.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import os
import time
from collections.abc import Callable, Hashable
from dataclasses import dataclass
from pathlib import Path

from maskwire.cpus import (
    ThrottleSource,
    cgroup_cpu_quota,
    idle_cpu_ns,
    read_throttled_ns,
    throttle_source,
)

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


# The governor reads the team's wait around every device call, so what is costly to find (every
# thread's `comm`, this process's cgroup) is looked up once a second, not per call.
_RESCAN_S = 1.0
_teams: dict[tuple[str, Path], tuple[float, list[int]]] = {}  # -> (when scanned, schedstat fds)
_throttle: tuple[float, ThrottleSource | None] = (-_RESCAN_S, None)  # (when looked up, source)


def team_run_delay_ns(name: str = TEAM_NAME, tasks: Path = Path("/proc/self/task")) -> int:
    """Nanoseconds the threads named `name` have spent runnable but waiting for a CPU."""
    now = time.monotonic()
    scanned, fds = _teams.get((name, tasks), (-_RESCAN_S, []))
    if now - scanned >= _RESCAN_S:
        for fd in fds:
            os.close(fd)
        fds = _team_stat_fds(name, tasks)
        _teams[(name, tasks)] = (now, fds)
    total = 0
    for fd in fds:
        try:  # kept open: a pread is ~1 us where opening the file again is ~15
            total += int(os.pread(fd, 128, 0).split()[1])
        except (OSError, ValueError, IndexError):  # the thread ended meanwhile
            continue
    return total


def quota_throttled_ns() -> int | None:
    """Nanoseconds this process's cgroup has been throttled by a CPU quota; None without a quota
    (then nothing throttles it) or when it cannot be read."""
    global _throttle
    now = time.monotonic()
    looked_up, source = _throttle
    if now - looked_up >= _RESCAN_S:
        source = throttle_source() if cgroup_cpu_quota() is not None else None
        _throttle = (now, source)
    return None if source is None else read_throttled_ns(source)


def _team_stat_fds(name: str, tasks: Path) -> list[int]:
    try:
        entries = list(tasks.iterdir())
    except OSError:
        return []
    found = []
    for task in entries:
        try:
            if (task / "comm").read_text().strip() == name:
                found.append(os.open(task / "schedstat", os.O_RDONLY | os.O_CLOEXEC))
        except OSError:  # the thread ended meanwhile
            continue
    return found


@dataclass(frozen=True)
class GovernorConfig:
    full: int  # the team's size with the CPUs to itself
    shrink_at: float = 0.3  # stall, as a share of the calls' wall time, that starts a trial
    window_s: float = 0.2  # device-call time a measurement is based on
    first_probe_s: float = 2.0  # wait before trying the full team again (or a smaller one)
    max_probe_interval_s: float = 32.0
    # A smaller team is kept only when the same calls take less than this share of the time:
    # a core lost to a neighbour makes them several times faster at the smaller size, while the
    # noise between two windows of a busy stack reaches +-30%, and a wrong shrink costs half
    # the throughput until the next probe.
    keep_smaller_below: float = 0.5
    # A stall of at least this many threads' worth is a core taken (the stack's own bursts read
    # less): the full team then runs tens of times slower, so its trial of a smaller team keeps
    # one faster at all (`keep_smaller_below_on_core_taken`) or with nothing to compare, is tried
    # again after `first_probe_s` when declined, and counts as a new condition after a decline
    # on less. If the core was free after all, the idle-CPU cue restores the team in a window.
    core_taken_stall: float = 0.8
    keep_smaller_below_on_core_taken: float = 0.8
    trial_windows: int = 3  # windows a trial may take to run calls it can compare
    # A stall this many threads' worth above the one a declined trial started on is a new
    # condition (a neighbour arrived), tried at once rather than after the back-off wait.
    fresh_stall: float = 0.5
    memory_s: float = 30.0  # how long a size's measured call times count as current
    # While shrunk, idle CPUs worth this share of the threads the team lacks, over a window,
    # try the full team at once (the neighbour left). A busy window (under half of it) re-arms
    # the cue after a try it started failed, so idle CPUs that do not help (a quota's limit)
    # cost one try per busy spell, not one per window.
    spare_probe_at: float = 0.5


Key = Hashable  # calls with equal keys do the same work (the pass's shape)


class ThreadGovernor:
    """Sizes the intra-op team by measured progress, with the stall as the cue to measure.

    Call `before(key)` and `after(token)` around each device call, on the device thread (the team
    size is set there, between calls). Readers and the setter are injected for tests."""

    def __init__(
        self,
        config: GovernorConfig,
        set_threads: Callable[[int], None],
        *,
        clock: Callable[[], int] = time.monotonic_ns,
        run_delay: Callable[[], int] = team_run_delay_ns,
        throttled: Callable[[], int | None] = quota_throttled_ns,
        idle: Callable[[], int | None] = idle_cpu_ns,
    ) -> None:
        self.config = config
        self.threads = config.full
        self._set_threads = set_threads
        self._clock = clock
        self._run_delay = run_delay
        self._throttled = throttled
        self._idle = idle
        self._window = _Window()
        # While shrunk: (clock, idle ns) when the running window began, and the time between its
        # calls so far (the worker idles then, so the CPUs' idle time says nothing of others).
        self._idle_mark: tuple[int, int] | None = None
        self._gap_ns = 0
        self._last_after_ns: int | None = None
        self._spare_armed = True
        self._cpus_busy = False  # the last shrunk window's CPUs had no idle time
        # team size -> key -> (mean call ns, when measured): what each size did lately
        self._times: dict[int, dict[Key, tuple[float, int]]] = {}
        self._trial: _Trial | None = None
        self._next_trial_ns = 0  # no smaller team is tried before this (full team)
        self._next_probe_ns = 0  # the full team is tried again at this time (shrunk team)
        self._interval_ns = _ns(config.first_probe_s)
        self._declined_stall = 0.0  # the stall a declined trial started on (none: 0)
        self.shrinks = 0
        self.probes = 0
        self.skipped_probes = 0
        self.trials = 0

    def before(self, key: Key = None) -> tuple[Key, int, int, int]:
        shrunk = self.threads < self.config.full
        between_windows = self._window.wall == 0  # a window's calls all ran at one size
        now = self._clock()
        if shrunk and between_windows and self._trial is None and now >= self._next_probe_ns:
            if self._cpus_busy and self._interval_ns < _ns(self.config.max_probe_interval_s):
                self._skip_probe(now)
            else:
                self.probes += 1
                self._start_trial(self.config.full)
                shrunk = False
        if shrunk and self._trial is None:
            self._mark_idle(now, between_windows)
        return key, self._clock(), self._run_delay(), self._throttled() or 0

    def after(self, token: tuple[Key, int, int, int]) -> None:
        key, began, delay0, throttled0 = token
        wall = self._clock() - began
        delay = self._run_delay() - delay0
        throttled = (self._throttled() or 0) - throttled0
        self._window.add(key, began, wall, delay, throttled)
        self._last_after_ns = began + wall
        if self._window.wall >= _ns(self.config.window_s):
            window, self._window = self._window, _Window()
            self._remember(window)  # at the size it ran at, before any change
            if self._trial is not None:
                self._judge(self._trial, window)
            else:
                self._watch(window)

    def _skip_probe(self, now: int) -> None:
        """The CPUs are all in use (a neighbour still there): count the due try as failed."""
        self.skipped_probes += 1
        self._interval_ns = min(2 * self._interval_ns, _ns(self.config.max_probe_interval_s))
        self._next_probe_ns = now + self._interval_ns
        log.info(
            "intra-op threads stay %d: the allowed CPUs had no idle time; trying %d in %.0f s",
            self.threads,
            self.config.full,
            self._interval_ns / 1e9,
        )

    def _mark_idle(self, now: int, window_begins: bool) -> None:
        """Track the idle time of the allowed CPUs over a shrunk team's window, less its gaps."""
        if window_begins or self._idle_mark is None:
            idle = self._idle()
            self._idle_mark = None if idle is None else (now, idle)
            self._gap_ns = 0
        elif self._last_after_ns is not None:
            self._gap_ns += max(0, now - self._last_after_ns)

    def _spare_cpus(self) -> float | None:
        """CPUs' worth of idle time on the allowed CPUs while the closing window's calls ran (a
        gap between calls counts as all CPUs idle, which only ever lowers it); None unmeasured."""
        mark, self._idle_mark = self._idle_mark, None
        idle = self._idle()
        if mark is None or idle is None:
            return None
        busy_ns = self._clock() - mark[0] - self._gap_ns
        if busy_ns <= 0:
            return None
        gap_idle = self._gap_ns * self.config.full
        return max(0.0, (idle - mark[1] - gap_idle) / busy_ns)

    def _remember(self, window: _Window) -> None:
        times = self._times.setdefault(self.threads, {})
        now = self._clock()
        for key, (n, wall) in window.calls.items():
            if key is not None:  # a call of unknown work is no measure of its size
                times[key] = (wall / n, now)

    def _watch(self, window: _Window) -> None:
        """Between trials: a stall starts one with fewer threads (not sooner than allowed); while
        shrunk, CPUs left idle start a try of the full team."""
        if self.threads < self.config.full and self._spare_cue():
            return
        stall = window.stall(self.threads)
        if stall < self.config.shrink_at or self.threads == 1:
            return
        waiting = self._clock() < self._next_trial_ns
        if self.threads == self.config.full and waiting and not self._fresh(stall):
            return
        lost = max(1, round(stall))
        self.trials += 1
        self._start_trial(max(1, self.threads - lost), stall=stall, since=window.began)

    def _spare_cue(self) -> bool:
        """Whether idle CPUs make the full team worth trying now (the next window starts it)."""
        spare = self._spare_cpus()
        if spare is None:
            self._cpus_busy = False
            return False
        wanted = self.config.spare_probe_at * (self.config.full - self.threads)
        self._cpus_busy = spare < wanted / 2
        if self._cpus_busy:
            self._spare_armed = True  # busy again: the next idle spell is news
        if spare < wanted or not self._spare_armed or self._clock() >= self._next_probe_ns:
            return False
        log.info(
            "intra-op threads %d: the allowed CPUs sat idle %.2f CPUs' worth of the last window; "
            "trying %d now",
            self.threads,
            spare,
            self.config.full,
        )
        self._spare_armed = False
        self._next_probe_ns = 0
        return True

    def _fresh(self, stall: float) -> bool:
        """Whether `stall` is a new condition rather than the one a declined trial measured:
        the back-off only spares the team trials that would fail again. A whole thread's worth
        after a decline on less is new too: a trial in the window a neighbour arrived in reads a
        partial stall, and the neighbour's full one must not wait out that trial's back-off."""
        if stall >= self.config.core_taken_stall > self._declined_stall:
            return True
        return stall >= self._declined_stall + self.config.fresh_stall

    def _start_trial(self, size: int, stall: float | None = None, since: int = 0) -> None:
        self._trial = _Trial(self.threads, size, stall, since)
        self._resize(size)

    def _relative_cost(self, window: _Window, size: int, since: int = 0) -> float | None:
        """`window`'s calls' time over what the same calls took lately at `size` (keys in both,
        weighted by the window's counts; None when none was measured within `memory_s`, or
        after `since`)."""
        since = max(since, self._clock() - _ns(self.config.memory_s))
        times = self._times.get(size, {})
        mine = theirs = 0.0
        for key, (n, wall) in window.calls.items():
            seen = times.get(key)
            if seen is None or seen[1] <= since:  # measured before it
                continue
            mine += wall
            theirs += n * seen[0]
        return mine / theirs if theirs > 0 else None

    def _judge(self, trial: _Trial, window: _Window) -> None:
        """Keep the tried size if its calls ran faster than the same calls at the size before;
        with nothing to compare after `trial_windows` windows, keep a probe's full team or a
        smaller team on a core taken, and otherwise go back to the size before."""
        trial.windows += 1
        trial.window.merge(window)
        ratio = self._relative_cost(trial.window, trial.was, trial.since)
        if ratio is None and trial.windows < self.config.trial_windows:
            return  # keep measuring
        self._trial = None
        growing = trial.size > trial.was
        core_taken = (trial.stall or 0.0) >= self.config.core_taken_stall  # a probe: no stall
        if growing and ratio is None:
            self._keep_unmeasured_probe(trial)
            return
        if core_taken and ratio is None:
            self._keep_unmeasured_shrink(trial)
            return
        if growing:
            better = 1.0
        elif core_taken:
            better = self.config.keep_smaller_below_on_core_taken
        else:
            better = self.config.keep_smaller_below
        if ratio is not None and ratio < better:
            if growing:
                log.info("intra-op threads back to %d (%s)", trial.size, _compared(ratio))
                self._spare_armed = True
                self._interval_ns = _ns(self.config.first_probe_s)
                self._next_trial_ns = 0
                self._declined_stall = 0.0
            else:
                self.shrinks += 1
                log.info(
                    "intra-op threads %d -> %d: the team waited %.2f threads' worth of time for "
                    "CPUs (another process is using them), %d threads: %s; trying %d again in %.0f s",
                    trial.was,
                    trial.size,
                    trial.stall or 0.0,
                    trial.size,
                    _compared(ratio),
                    self.config.full,
                    self._interval_ns / 1e9,
                )
                self._next_probe_ns = self._clock() + self._interval_ns
            return
        self._resize(trial.was)  # the tried size was no better: back to the one before
        if not core_taken:
            self._interval_ns = min(2 * self._interval_ns, _ns(self.config.max_probe_interval_s))
        if growing:
            log.info(
                "intra-op threads stay %d: %d threads: %s; trying again in %.0f s",
                trial.was,
                trial.size,
                _compared(ratio),
                self._interval_ns / 1e9,
            )
            self._next_probe_ns = self._clock() + self._interval_ns
        else:
            # The stall costs less than a thread (the stack's own processes, say), or a core is
            # taken but the trial's calls misled (a prefill pass, long regions, loses little
            # beside a neighbour while decode passes lose tens of times): keep the team and look
            # again later, soon after a whole thread's worth, whose cost if real is the larger.
            log.info(
                "intra-op threads stay %d: the team waited %.2f threads' worth of time for CPUs, "
                "%d threads: %s",
                trial.was,
                trial.stall or 0.0,
                trial.size,
                _compared(ratio),
            )
            wait = _ns(self.config.first_probe_s) if core_taken else self._interval_ns
            self._next_trial_ns = self._clock() + wait
            self._declined_stall = 0.0 if core_taken else trial.stall or 0.0

    def _keep_unmeasured_shrink(self, trial: _Trial) -> None:
        """A whole thread's worth of stall and nothing to compare (the work changed shape when
        the neighbour came): keep the smaller team. A neighbour costs the full team tens of
        times its speed while one is there; a wrong shrink costs at most half, and only until
        the idle-CPU cue or the next probe."""
        self.shrinks += 1
        self._next_probe_ns = self._clock() + self._interval_ns
        log.info(
            "intra-op threads %d -> %d: the team waited %.2f threads' worth of time for CPUs "
            "(another process is using them), %s; trying %d again in %.0f s",
            trial.was,
            trial.size,
            trial.stall or 0.0,
            _compared(None),
            self.config.full,
            self._interval_ns / 1e9,
        )

    def _keep_unmeasured_probe(self, trial: _Trial) -> None:
        """A probe of the full team found none of its calls run lately by the smaller one (the
        work changed shape since: another batch size, speculation): keep the full team, the
        size without a neighbour, and let the stall decide. A neighbour still there stalls it
        at once and the trial that follows has fresh full-team times to compare with; kept
        shrunk on no evidence, the team would stay small for as long as the work kept
        changing, long after the neighbour left. The wait before the next probe still
        doubles, so a neighbour that stays costs at most a few slow windows a minute."""
        log.info("intra-op threads back to %d (%s at %d)", trial.size, _compared(None), trial.was)
        self._interval_ns = min(2 * self._interval_ns, _ns(self.config.max_probe_interval_s))
        self._next_trial_ns = 0
        self._declined_stall = 0.0

    def _resize(self, n: int) -> None:
        if n != self.threads:
            self.threads = n
            self._set_threads(n)


class _Trial:
    __slots__ = ("since", "size", "stall", "was", "window", "windows")

    def __init__(self, was: int, size: int, stall: float | None, since: int) -> None:
        self.was = was  # team size before the trial
        self.size = size  # team size being tried
        self.stall = stall  # what started it (None: a probe of the full team)
        self.since = since  # only times measured after this compare (the stall's start)
        self.window = _Window()  # the calls run at `size` so far
        self.windows = 0


class _Window:
    __slots__ = ("began", "calls", "delay", "throttled", "wall")

    def __init__(self) -> None:
        self.began = 0  # when its first call began
        self.wall = 0
        self.delay = 0
        self.throttled = 0
        self.calls: dict[Key, list[int]] = {}  # key -> [calls, wall ns]

    def add(self, key: Key, began: int, wall: int, delay: int, throttled: int) -> None:
        if not self.calls:
            self.began = began
        self.wall += wall
        self.delay += delay
        self.throttled += throttled
        seen = self.calls.setdefault(key, [0, 0])
        seen[0] += 1
        seen[1] += wall

    def merge(self, other: _Window) -> None:
        self.wall += other.wall
        self.delay += other.delay
        self.throttled += other.throttled
        for key, (n, wall) in other.calls.items():
            seen = self.calls.setdefault(key, [0, 0])
            seen[0] += n
            seen[1] += wall

    def stall(self, threads: int) -> float:
        """Threads' worth of time the team spent waiting for CPUs, as a share of the wall time."""
        if self.wall <= 0:
            return 0.0
        # A throttled group's threads all wait together: that wait is the quota's, not a
        # neighbour's, and costs no region more than its share.
        excess = max(0, self.delay - threads * self.throttled)
        return excess / self.wall


def _compared(ratio: float | None) -> str:
    if ratio is None:
        return "no calls to compare"
    return f"the same calls in {ratio:.2f}x the time"


def _ns(seconds: float) -> int:
    return int(seconds * 1e9)
