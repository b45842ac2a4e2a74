"""The thread governor: the intra-op team's size from injected scheduler waits, clocks and quotas."""

from __future__ import annotations

import itertools
import logging
import threading
from pathlib import Path

import pytest

from neuron_worker.thread_governor import (
    TEAM_NAME,
    GovernorConfig,
    ThreadGovernor,
    name_this_thread,
    team_run_delay_ns,
)

MS = 1_000_000


class Host:
    """A scripted machine: a device call's wall time and the team's wait for CPUs in it (all
    threads together) depend on the team's size, as `cost[threads] = (call_ms, wait_ms)`; the
    group is throttled `throttled_ms` per call; `spare` CPUs sit idle while calls run (by default
    0.3: neither all in use nor a core free, so idle time neither starts nor skips a probe), and
    all `full` CPUs between calls."""

    def __init__(self, full: int = 2) -> None:
        self.full = full
        self.now = 0
        self.delay = 0
        self.throttled = 0
        self.idle_ns = 0
        self.spare = 0.3
        self.threads = full
        self.cost: dict[int, tuple[float, float]] = {n: (10.0 * full / n, 0.0) for n in range(1, 9)}
        self.throttled_ms = 0.0
        self.sizes: list[int] = []

    def governor(self, full: int = 2, **kw: float) -> ThreadGovernor:
        def resize(n: int) -> None:
            self.threads = n
            self.sizes.append(n)

        return ThreadGovernor(
            GovernorConfig(full=full, **kw),
            resize,
            clock=lambda: self.now,
            run_delay=lambda: self.delay,
            throttled=lambda: self.throttled,
            idle=lambda: self.idle_ns,
        )

    def neighbour(self, full: int = 2, free: int = 1) -> None:
        """Another process takes `full - free` cores: a team larger than `free` stalls every
        region on a descheduled thread (ten times slower), a team within `free` runs at its size."""
        for n in range(1, 9):
            self.cost[n] = (10.0 * full / n, 0.0) if n <= free else (100.0, 100.0 * (n - free))

    def call(
        self, gov: ThreadGovernor, n: int = 1, key: str = "decode", scale: float = 1.0
    ) -> None:
        for _ in range(n):
            call_ms, wait_ms = self.cost[self.threads]
            token = gov.before(key)
            self.now += int(call_ms * scale * MS)
            self.idle_ns += int(self.spare * call_ms * scale * MS)
            self.delay += int(wait_ms * scale * MS)
            self.throttled += int(self.throttled_ms * MS)
            gov.after(token)

    def idle(self, seconds: float) -> None:
        self.now += int(seconds * 1e9)
        self.idle_ns += int(self.full * seconds * 1e9)


def test_a_quiet_machine_keeps_the_full_team() -> None:
    host = Host()
    host.cost[2] = (10.0, 1.0)  # 10% of the time: the stack's own threads now and then
    gov = host.governor()
    host.call(gov, 200)
    assert gov.threads == 2 and host.sizes == [] and gov.trials == 0


def test_a_neighbour_on_a_core_shrinks_the_team_once_the_smaller_one_measures_faster() -> None:
    host = Host()
    gov = host.governor(window_s=0.2)
    host.neighbour()
    host.call(gov, 1)
    assert gov.threads == 2  # 100 ms: the window is not full yet
    host.call(gov, 1)
    assert gov.threads == 1 and gov.trials == 1 and gov.shrinks == 0  # trying one thread
    host.call(gov, 10)  # 20 ms calls against 100 ms: kept
    assert gov.threads == 1 and host.sizes == [1] and gov.shrinks == 1


def test_a_stall_that_costs_less_than_a_thread_keeps_the_team() -> None:
    """The stack's own grammar service takes a core now and then: the team stalls, but one
    thread alone is slower still, so the team stays whole and is tried again only later."""
    host = Host()
    host.cost[2], host.cost[1] = (14.0, 6.0), (20.0, 0.0)
    gov = host.governor(first_probe_s=2.0, max_probe_interval_s=8.0)
    host.call(gov, 15)  # one window with the stall, then a trial of one thread
    assert gov.trials == 1
    host.call(gov, 10)
    assert gov.threads == 2 and host.sizes == [1, 2] and gov.shrinks == 0
    host.call(gov, 100)  # 1.4 s: no second trial before the wait (4 s after a failed one)
    assert gov.trials == 1 and gov.threads == 2
    host.call(gov, 400)
    assert gov.threads == 2 and gov.shrinks == 0
    assert 2 <= gov.trials <= 3  # a few short trials a minute, backing off


def test_a_neighbour_arriving_during_the_back_off_is_tried_at_once() -> None:
    """A declined trial (the stack's own stall) makes the next one wait; a neighbour that takes a
    core meanwhile stalls the team by a whole thread, which is a new condition: the smaller team
    is tried and kept within a few windows, not after the wait."""
    host = Host()
    host.cost[2], host.cost[1] = (14.0, 6.0), (20.0, 0.0)
    gov = host.governor(first_probe_s=30.0, max_probe_interval_s=60.0)
    host.call(gov, 25)  # a window with the stall, a declined trial of one thread
    assert gov.trials == 1 and gov.threads == 2 and gov.shrinks == 0
    host.call(gov, 40)  # the same stall: no trial during the 60 s wait
    assert gov.trials == 1
    host.neighbour()
    host.call(gov, 20)  # well under a second, far within the wait
    assert gov.threads == 1 and gov.shrinks == 1 and gov.trials == 2


def test_a_whole_core_taken_after_a_partial_stall_is_tried_at_once() -> None:
    """The window a neighbour arrives in reads a partial stall (0.67 threads' worth) and its
    trial is declined; the next windows read a whole thread's worth: a new condition, tried at
    once rather than after the declined trial's wait."""
    host = Host()
    gov = host.governor(first_probe_s=4.0)
    host.cost[2], host.cost[1] = (15.0, 10.0), (20.0, 0.0)  # 0.67 threads' worth, not kept
    host.call(gov, 30)
    assert gov.trials == 1 and gov.threads == 2 and gov.shrinks == 0
    began = host.now
    host.neighbour()  # a whole thread's worth now
    host.call(gov, 12)
    assert gov.threads == 1 and gov.shrinks == 1
    assert (host.now - began) / 1e9 < 1.0


def test_a_smaller_team_only_somewhat_faster_is_not_kept() -> None:
    """Two windows of a busy stack differ by tens of percent: a smaller team is kept only when it
    runs the same calls in under half the time (a core lost to a neighbour)."""
    host = Host()
    host.cost[2], host.cost[1] = (25.0, 10.0), (20.0, 0.0)  # 0.8x the time at one thread
    gov = host.governor(keep_smaller_below=0.5)
    host.call(gov, 40)
    assert gov.trials == 1 and gov.threads == 2 and gov.shrinks == 0


def test_a_whole_core_taken_keeps_a_smaller_team_that_is_faster_at_all() -> None:
    """A whole thread's worth of stall is a core taken: a smaller team that runs the same calls
    in 0.65x the time is kept (not only one under half), as the first trial beside a neighbour
    that is still settling in often reads."""
    host = Host()
    host.cost[2], host.cost[1] = (100.0, 100.0), (65.0, 0.0)
    gov = host.governor(window_s=0.2)
    host.call(gov, 2)
    assert gov.trials == 1 and gov.threads == 1
    host.call(gov, 4)
    assert gov.threads == 1 and gov.shrinks == 1


def test_a_declined_trial_on_a_whole_core_is_tried_again_soon() -> None:
    """A core is taken but the trial's calls misled (one thread read 1.6x slower): the full
    team beside a neighbour costs far more than a trial, so the next trial comes after the first
    wait (2 s), not after a wait doubled by this decline and an earlier one."""
    host = Host()
    gov = host.governor(first_probe_s=2.0, max_probe_interval_s=32.0)
    host.cost[2], host.cost[1] = (14.0, 6.0), (20.0, 0.0)  # the stack's own stall: declined
    host.call(gov, 25)
    assert gov.trials == 1 and gov.threads == 2
    host.cost[2], host.cost[1] = (100.0, 100.0), (160.0, 0.0)  # a neighbour; a misleading trial
    host.call(gov, 4)
    assert gov.trials == 2 and gov.threads == 2 and gov.shrinks == 0
    declined = host.now
    host.cost[1] = (20.0, 0.0)
    while gov.shrinks == 0 and host.now - declined < 10e9:
        host.call(gov)
    assert gov.shrinks == 1 and gov.trials == 3
    assert (host.now - declined) / 1e9 < 2.5


def test_the_same_calls_are_compared_not_a_different_mix() -> None:
    """A trial window holding more of the expensive calls is not mistaken for a slower team."""
    host = Host()
    host.neighbour()
    gov = host.governor(window_s=0.2)
    host.call(gov, 2, key="decode")
    assert gov.trials == 1
    for _ in range(4):  # while trying one thread, prefill passes (10x the work) come in
        host.call(gov, 1, key="prefill", scale=10.0)
        host.call(gov, 1, key="decode")
    assert gov.threads == 1 and gov.shrinks == 1


def test_the_team_loses_the_threads_worth_of_time_it_waited() -> None:
    host = Host(full=8)
    host.neighbour(full=8, free=5)  # three cores taken
    gov = host.governor(full=8)
    host.call(gov, 2)  # three threads' worth of waiting: try 5
    assert gov.threads == 5
    host.call(gov, 20)
    assert gov.threads == 5 and host.sizes == [5] and gov.shrinks == 1


def test_a_probe_restores_the_full_team_when_the_neighbour_left() -> None:
    host = Host()
    gov = host.governor(first_probe_s=2.0)
    host.neighbour()
    host.call(gov, 2)
    host.call(gov, 10)
    assert gov.threads == 1 and gov.shrinks == 1
    host.neighbour(free=2)  # the neighbour ends
    host.call(gov, 10)  # within the probe interval: stays shrunk
    assert gov.threads == 1
    host.idle(2.0)
    host.call(gov, 20)  # the probe window at the full size runs the calls in half the time
    assert gov.threads == 2 and host.sizes == [1, 2] and gov.probes == 1
    host.call(gov, 50)
    assert gov.threads == 2


def test_idle_cpus_while_shrunk_try_the_full_team_at_once(caplog: pytest.LogCaptureFixture) -> None:
    """After a long busy spell the back-off waits up to its cap; a neighbour that leaves frees
    its core, which then sits idle while the one-thread team runs: the full team is tried within
    the next windows and kept, not after the wait."""
    host = Host()
    gov = host.governor(first_probe_s=30.0, max_probe_interval_s=60.0)
    host.neighbour()
    host.call(gov, 12)
    assert gov.threads == 1 and gov.shrinks == 1
    host.call(gov, 100)  # 2 s with the neighbour, within the wait: no probe
    assert gov.threads == 1 and gov.probes == 0
    host.neighbour(free=2)  # it leaves; its core now idles beside the team
    host.spare = 0.9
    with caplog.at_level(logging.INFO, logger="neuron_worker.thread_governor"):
        host.call(gov, 30)  # 0.6 s, far within the 30 s wait
    assert gov.threads == 2 and gov.probes == 1 and host.sizes == [1, 2]
    assert "sat idle 0.90 CPUs' worth of the last window; trying 2 now" in caplog.text


def test_probes_wait_while_the_cpus_have_no_idle_time(caplog: pytest.LogCaptureFixture) -> None:
    """A neighbour that stays keeps every CPU busy: each due try of the full team is skipped as
    if it had failed (a try would run a pass tens of times slower) until the wait reaches its
    cap, where tries resume; the neighbour's departure is seen by the idle time instead."""
    host = Host()
    gov = host.governor(first_probe_s=2.0, max_probe_interval_s=16.0)
    host.neighbour()
    host.spare = 0.0
    host.call(gov, 12)
    assert gov.threads == 1 and gov.shrinks == 1
    with caplog.at_level(logging.INFO, logger="neuron_worker.thread_governor"):
        host.call(gov, 1400)  # 28 s: due at 2, 6, 14 s (skipped), 30 s: the cap
    assert gov.probes == 0 and gov.skipped_probes == 3 and gov.threads == 1
    assert "the allowed CPUs had no idle time; trying 2 in 16 s" in caplog.text
    host.call(gov, 200)  # past 30 s: at the cap the try runs (and fails)
    assert gov.probes == 1 and gov.skipped_probes == 3 and gov.threads == 1


def test_gaps_between_calls_are_not_idle_cpus() -> None:
    """A bursty load leaves every CPU idle between its calls: that is the worker's own pause,
    not a core the neighbour gave back, and tries nothing."""
    host = Host()
    gov = host.governor(first_probe_s=30.0, max_probe_interval_s=60.0)
    host.neighbour()
    host.call(gov, 12)
    assert gov.threads == 1
    for _ in range(40):  # 22 s, within the 30 s wait
        host.call(gov, 3)
        host.idle(0.5)
    assert gov.threads == 1 and gov.probes == 0


def test_idle_cpus_that_do_not_help_are_tried_once_per_busy_spell() -> None:
    """CPUs can sit idle while more threads still do not help (a quota elsewhere, say): one try
    of the full team fails, and the cue waits for a busy window before it counts again."""
    host = Host()
    gov = host.governor(first_probe_s=30.0, max_probe_interval_s=60.0)
    host.neighbour()
    host.call(gov, 12)
    assert gov.threads == 1
    host.spare = 1.0  # idle, yet the full team stays ten times slower
    host.call(gov, 200)
    assert gov.threads == 1 and gov.probes == 1
    host.spare = 0.0  # a busy window re-arms the cue
    host.call(gov, 20)
    host.spare = 1.0
    host.call(gov, 40)
    assert gov.threads == 1 and gov.probes == 2


def test_failed_probes_back_off_exponentially_up_to_the_cap(
    caplog: pytest.LogCaptureFixture,
) -> None:
    host = Host()
    gov = host.governor(first_probe_s=2.0, max_probe_interval_s=8.0)
    host.neighbour()  # a neighbour that stays
    host.call(gov, 12)
    assert gov.threads == 1
    probe_times = []
    with caplog.at_level(logging.INFO, logger="neuron_worker.thread_governor"):
        for _ in range(300):
            before = gov.probes
            host.call(gov)
            if gov.probes > before:
                probe_times.append(host.now / 1e9)
            host.idle(0.1)
    # each failed probe says so, and when the next one comes
    assert "intra-op threads stay 1: 2 threads: the same calls in" in caplog.text
    assert "trying again in 8 s" in caplog.text
    gaps = [b - a for a, b in itertools.pairwise(probe_times)]
    # Each failed probe doubles the wait, capped at 8 s (plus the probe's own window and the
    # rest of the window running when it is due: probes start between windows).
    assert len(gaps) >= 3
    assert all(want <= gap <= want + 1.5 for gap, want in zip(gaps, [4, 8, 8], strict=False))
    assert gov.threads == 1 and len(probe_times) >= 4


def test_a_quota_throttling_the_whole_group_is_not_a_neighbour() -> None:
    host = Host()
    gov = host.governor()
    # 1.5 CPUs for 2 threads: a quarter of each period throttled, both threads waiting meanwhile.
    host.cost[2], host.throttled_ms = (10.0, 5.0), 2.5
    host.call(gov, 200)
    assert gov.threads == 2 and host.sizes == [] and gov.trials == 0
    # A neighbour on top of the quota still shows.
    host.neighbour()
    host.call(gov, 40)
    assert gov.threads == 1


def test_one_thread_has_nothing_to_shrink() -> None:
    host = Host(full=1)
    host.cost[1] = (100.0, 90.0)
    gov = host.governor(full=1)
    host.call(gov, 20)
    assert gov.threads == 1 and host.sizes == [] and gov.probes == 0 and gov.trials == 0


def test_the_team_run_delay_sums_the_named_threads(tmp_path: Path) -> None:
    for tid, (comm, stat) in enumerate(
        [(TEAM_NAME, "5 700 3"), ("python", "9 900000 1"), (TEAM_NAME, "1 300 1")]
    ):
        task = tmp_path / str(tid)
        task.mkdir()
        (task / "comm").write_text(comm + "\n")
        (task / "schedstat").write_text(stat + "\n")
    (tmp_path / "9").mkdir()  # a thread that ended while being read
    assert team_run_delay_ns(tasks=tmp_path) == 1000


def test_threads_started_by_a_named_thread_carry_its_name() -> None:
    seen: list[str] = []

    def named() -> None:
        name_this_thread("mw-test-team")
        child = threading.Thread(target=lambda: seen.append(_comm()))
        child.start()
        child.join()
        seen.append(_comm())

    thread = threading.Thread(target=named)
    thread.start()
    thread.join()
    assert seen == ["mw-test-team", "mw-test-team"]


def _comm() -> str:
    return Path(f"/proc/self/task/{threading.get_native_id()}/comm").read_text().strip()


def test_a_compiled_graph_serves_any_team_size_without_compiling_again() -> None:
    """With kernels that read the team size when they run, a new size is no reason to compile:
    the governor's changes never stall a step on a compile (which the global-state guard on the
    thread count would cause)."""
    import torch
    import torch._inductor.config
    from torch._dynamo.utils import counters

    from neuron_worker.backends import create_backend

    def f(x: torch.Tensor) -> torch.Tensor:
        return (x.sin() * 2).sum(-1)

    x = torch.randn(64, 4096)
    before = torch.get_num_threads()
    compiled_per_setting = []
    try:
        for dynamic in (True, False):
            torch._inductor.config.cpp.dynamic_threads = dynamic
            torch._dynamo.reset()
            counters.clear()
            g = create_backend("cpu", compile=True).compile(f, name=f"team_{dynamic}")
            outs = []
            for n in (2, 1, 2):
                torch.set_num_threads(n)
                outs.append(g(x))
            assert all(torch.allclose(o, f(x), rtol=1e-4, atol=1e-3) for o in outs)
            compiled_per_setting.append(counters["stats"]["unique_graphs"])
    finally:
        torch._inductor.config.cpp.dynamic_threads = False
        torch.set_num_threads(before)
        torch._dynamo.reset()
    assert compiled_per_setting == [1, 2]  # the fixed-size kernels need a graph per size


def test_graphs_compiled_with_one_shared_options_dict_all_serve_any_team_size() -> None:
    """The sampler compiles its graphs with one options dict, from which `torch.compile` pops
    the guard filter: every graph must still drop the guard on the thread count, or the
    governor's first smaller team compiles them again while requests wait."""
    import torch
    import torch._inductor.config
    from torch._dynamo.utils import counters

    from neuron_worker.backends import serving_guards
    from neuron_worker.compile_fallback import compile_or_eager

    def doubled(x: torch.Tensor) -> torch.Tensor:
        return (x * 2).sum(-1)

    def tripled(x: torch.Tensor) -> torch.Tensor:
        return (x * 3).sum(-1)

    x = torch.randn(8, 512)
    before = torch.get_num_threads()
    try:
        torch._inductor.config.cpp.dynamic_threads = True
        torch._dynamo.reset()
        counters.clear()
        options = {"guard_filter_fn": serving_guards}
        graphs = [
            compile_or_eager(f, name=f.__name__, fullgraph=True, options=options)
            for f in (doubled, tripled)
        ]
        for n in (2, 1, 2):
            torch.set_num_threads(n)
            for g, f in zip(graphs, (doubled, tripled), strict=True):
                assert torch.allclose(g(x), f(x))
        assert counters["stats"]["unique_graphs"] == 2  # one each, whatever the team size
        assert "guard_filter_fn" in options  # the caller's dict is left as it was
    finally:
        torch._inductor.config.cpp.dynamic_threads = False
        torch.set_num_threads(before)
        torch._dynamo.reset()


def test_a_trial_with_no_calls_to_compare_goes_back_on_a_partial_stall(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Under half a thread's worth of stall (the stack's own bursts) and nothing to compare:
    no evidence that a core is gone, so the team goes back to its size."""
    host = Host()
    host.cost[2], host.cost[1] = (14.0, 6.0), (20.0, 0.0)
    gov = host.governor(window_s=0.2, trial_windows=3)
    with caplog.at_level(logging.INFO, logger="neuron_worker.thread_governor"):
        host.call(gov, 15, key="decode")
        assert gov.trials == 1 and gov.threads == 1
        host.call(gov, 20, key="verify")  # two windows of calls never measured at two threads
        assert gov.threads == 1  # still measuring
        host.call(gov, 10, key="verify")
    assert gov.threads == 2 and gov.shrinks == 0
    assert "intra-op threads stay 2: the team waited 0.43 threads' worth" in caplog.text
    assert "1 threads: no calls to compare" in caplog.text


def test_a_trial_with_no_calls_to_compare_keeps_the_smaller_team_on_a_whole_thread_stall(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A neighbour took a core (a whole thread's worth of stall) and the work changed shape in
    the trial: keeping the full team would cost tens of times its speed, so the smaller one
    stays, and a probe comes after the usual wait."""
    host = Host()
    host.neighbour()
    gov = host.governor(window_s=0.2, trial_windows=3, first_probe_s=2.0)
    with caplog.at_level(logging.INFO, logger="neuron_worker.thread_governor"):
        host.call(gov, 2, key="decode")
        assert gov.trials == 1 and gov.threads == 1
        host.call(gov, 30, key="verify")
    assert gov.threads == 1 and gov.shrinks == 1
    assert "2 -> 1: the team waited 1.00 threads' worth" in caplog.text
    assert "no calls to compare; trying 2 again in 2 s" in caplog.text


def test_times_from_before_the_stall_are_not_compared() -> None:
    """Prefill passes ran at two threads while the machine was quiet; a neighbour then stalls
    the decode passes. The trial's first window holds a prefill: set against its quiet time it
    would read twice as slow at one thread. Only calls measured since the stall began count,
    and the decode passes, ten times faster at one thread, decide."""
    host = Host()
    gov = host.governor(window_s=0.2, trial_windows=3)
    host.call(gov, 5, key="prefill", scale=20.0)  # quiet: 200 ms each at two threads
    host.neighbour()
    host.call(gov, 2, key="decode")  # the stall window: 100 ms decode passes
    assert gov.trials == 1 and gov.threads == 1
    host.call(gov, 1, key="prefill", scale=20.0)  # 400 ms at one thread, a window of its own
    assert gov.threads == 1 and gov.shrinks == 0  # still measuring
    host.call(gov, 10, key="decode")  # 20 ms against 100 ms
    assert gov.threads == 1 and gov.shrinks == 1


def test_a_probe_compares_with_every_call_the_smaller_team_ran_lately() -> None:
    """The shrunk team's last window held other calls than the probe's: the probe still finds
    the same calls measured earlier at that size, and wins."""
    host = Host()
    host.neighbour()
    gov = host.governor(first_probe_s=2.0)
    host.call(gov, 2, key="decode")
    host.call(gov, 20, key="decode")
    assert gov.threads == 1 and gov.shrinks == 1
    host.call(gov, 20, key="verify")  # the last windows at one thread: other calls
    host.neighbour(free=2)  # the neighbour leaves
    host.idle(2.0)
    host.call(gov, 30, key="decode")
    assert gov.threads == 2 and gov.probes == 1


def test_call_times_older_than_the_memory_are_not_compared() -> None:
    """The shrunk team's decode times are a minute old when the probe runs: nothing current to
    compare, so the full team is kept (the size without a neighbour) and the stall decides; the
    neighbour has left, so it stays."""
    host = Host()
    host.neighbour()
    gov = host.governor(first_probe_s=2.0, memory_s=30.0, trial_windows=1)
    host.call(gov, 2, key="decode")
    host.call(gov, 20, key="decode")
    assert gov.threads == 1
    host.call(gov, 20, key="verify")
    host.neighbour(free=2)
    host.idle(60.0)  # the one-thread decode times are a minute old
    host.call(gov, 30, key="decode")
    assert gov.threads == 2 and gov.probes == 1
    host.call(gov, 200, key="decode")
    assert gov.threads == 2 and host.sizes == [1, 2] and gov.trials == 1


def test_a_probe_with_nothing_to_compare_beside_a_neighbour_shrinks_again_and_backs_off() -> None:
    """Work that changes shape between probes (a batch size, speculation) leaves a probe nothing
    to compare while the neighbour stays: the full team stalls at once, a measured trial shrinks
    it again, and the next probe waits twice as long."""
    host = Host()
    host.neighbour()
    gov = host.governor(first_probe_s=2.0, memory_s=30.0, trial_windows=1)
    host.call(gov, 2, key="c8")
    host.call(gov, 20, key="c8")
    assert gov.threads == 1 and gov.shrinks == 1
    host.idle(60.0)
    host.call(gov, 3, key="c1")  # the probe: c1 never ran at one thread lately
    assert gov.probes == 1 and gov.threads == 2
    began, probes = host.now, gov.probes
    host.call(gov, 20, key="c1")  # stalled at two threads: a trial compares c1 both ways
    assert gov.threads == 1 and gov.shrinks == 2 and host.sizes == [1, 2, 1]
    while gov.probes == probes:
        host.call(gov, key="c1")
    assert (host.now - began) / 1e9 >= 4.0  # the wait doubled (the first was 2 s)


def test_calls_of_unknown_work_are_never_compared(caplog: pytest.LogCaptureFixture) -> None:
    """Calls without a key (a logits copy, the warm-up) do different work each time: a trial
    with only those has nothing to compare (the stall alone decides)."""
    host = Host()
    host.neighbour()
    gov = host.governor(window_s=0.2, trial_windows=2)
    with caplog.at_level(logging.INFO, logger="neuron_worker.thread_governor"):
        host.call(gov, 2, key=None)  # type: ignore[arg-type]
        assert gov.trials == 1 and gov.threads == 1
        host.call(gov, 20, key=None)  # type: ignore[arg-type]
    assert "no calls to compare" in caplog.text and "the same calls in" not in caplog.text


def test_a_compiled_sampler_serves_any_team_size_without_compiling_again() -> None:
    import torch
    import torch._inductor.config
    from torch._dynamo.utils import counters

    from neuron_worker.sampler import Sampler, SamplingTensors

    vocab = 64
    greedy = SamplingTensors.build(
        temperature=[0.0, 0.0], top_p=[1.0, 1.0], top_k=[0, 0], seed=[1, 2], offset=[0, 0], n_rows=2
    )
    logits = torch.randn(2, vocab)
    before = torch.get_num_threads()
    try:
        torch._inductor.config.cpp.dynamic_threads = True
        sampler = Sampler(
            vocab_size=vocab,
            logits_size=vocab,
            max_rows=2,
            device="cpu",
            structured_outputs=True,
            compile=True,
        )
        torch.set_num_threads(2)
        want = sampler(logits, sampler.all_ones_mask(2), greedy)
        graphs = counters["stats"]["unique_graphs"]
        torch.set_num_threads(1)
        got = sampler(logits, sampler.all_ones_mask(2), greedy)
        assert counters["stats"]["unique_graphs"] == graphs
        assert torch.equal(got, want)
    finally:
        torch._inductor.config.cpp.dynamic_threads = False
        torch.set_num_threads(before)
