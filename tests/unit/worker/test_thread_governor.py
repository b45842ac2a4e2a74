"""The thread governor: the intra-op team's size from injected scheduler waits, clocks and quotas."""

from __future__ import annotations

import itertools
import threading
from pathlib import Path

from neuron_worker.thread_governor import (
    TEAM_NAME,
    GovernorConfig,
    ThreadGovernor,
    name_this_thread,
    team_run_delay_ns,
)

MS = 1_000_000


class Host:
    """A scripted machine: each device call takes `call_ms` and the team waits `wait_ms` of it for
    CPUs (per call, all threads together); the group is throttled `throttled_ms` per call."""

    def __init__(self) -> None:
        self.now = 0
        self.delay = 0
        self.throttled = 0
        self.call_ms = 10.0
        self.wait_ms = 0.0
        self.throttled_ms = 0.0
        self.sizes: list[int] = []

    def governor(self, full: int = 2, **kw: float) -> ThreadGovernor:
        return ThreadGovernor(
            GovernorConfig(full=full, **kw),
            self.sizes.append,
            clock=lambda: self.now,
            run_delay=lambda: self.delay,
            throttled=lambda: self.throttled,
        )

    def call(self, gov: ThreadGovernor, n: int = 1) -> None:
        for _ in range(n):
            token = gov.before()
            self.now += int(self.call_ms * MS)
            self.delay += int(self.wait_ms * MS)
            self.throttled += int(self.throttled_ms * MS)
            gov.after(token)

    def idle(self, seconds: float) -> None:
        self.now += int(seconds * 1e9)


def test_a_quiet_machine_keeps_the_full_team() -> None:
    host = Host()
    host.wait_ms = 1.0  # 10% of the time: the stack's own threads now and then
    gov = host.governor()
    host.call(gov, 200)
    assert gov.threads == 2 and host.sizes == [] and gov.shrinks == 0


def test_a_neighbour_on_a_core_shrinks_the_team_after_one_window() -> None:
    host = Host()
    gov = host.governor(window_s=0.2)
    host.call_ms, host.wait_ms = 100.0, 60.0  # each region waits for a descheduled thread
    host.call(gov, 1)
    assert gov.threads == 2  # 100 ms: the window is not full yet
    host.call(gov, 1)
    assert gov.threads == 1 and host.sizes == [1] and gov.shrinks == 1


def test_the_team_loses_the_threads_worth_of_time_it_waited() -> None:
    host = Host()
    gov = host.governor(full=8)
    host.call_ms, host.wait_ms = 50.0, 150.0  # three threads' worth of waiting
    host.call(gov, 4)
    assert gov.threads == 5
    host.call(gov, 4)  # still waiting: shrinks again, never below one
    assert gov.threads == 2
    host.call(gov, 8)
    assert gov.threads == 1 and host.sizes == [5, 2, 1]


def test_a_probe_restores_the_full_team_when_the_neighbour_left() -> None:
    host = Host()
    gov = host.governor(first_probe_s=2.0)
    host.call_ms, host.wait_ms = 100.0, 60.0
    host.call(gov, 2)
    assert gov.threads == 1
    host.wait_ms = 0.0  # the neighbour ends
    host.call(gov, 10)  # within the probe interval: stays shrunk
    assert gov.threads == 1
    host.idle(2.0)
    host.call(gov, 3)  # the probe window at the full size finds no stall
    assert gov.threads == 2 and host.sizes == [1, 2] and gov.probes == 1
    host.call(gov, 50)
    assert gov.threads == 2


def test_failed_probes_back_off_exponentially_up_to_the_cap() -> None:
    host = Host()
    gov = host.governor(first_probe_s=2.0, max_probe_interval_s=8.0)
    host.call_ms, host.wait_ms = 100.0, 60.0  # a neighbour that stays
    host.call(gov, 2)
    probe_times = []
    for _ in range(300):
        before = gov.probes
        host.call(gov)
        if gov.probes > before:
            probe_times.append(host.now / 1e9)
        host.idle(0.1)
    gaps = [round(b - a) for a, b in itertools.pairwise(probe_times)]
    # Each failed probe doubles the wait (plus the probe's own window), capped at 8 s.
    assert gaps[:3] == [4, 8, 8]
    assert gov.threads == 1 and len(probe_times) >= 4


def test_a_quota_throttling_the_whole_group_is_not_a_neighbour() -> None:
    host = Host()
    gov = host.governor()
    # 1.5 CPUs for 2 threads: a quarter of each period throttled, both threads waiting meanwhile.
    host.call_ms, host.wait_ms, host.throttled_ms = 10.0, 5.0, 2.5
    host.call(gov, 200)
    assert gov.threads == 2 and host.sizes == []
    # A neighbour on top of the quota still shows.
    host.wait_ms = 12.0
    host.call(gov, 40)
    assert gov.threads == 1


def test_one_thread_has_nothing_to_shrink() -> None:
    host = Host()
    gov = host.governor(full=1)
    host.call_ms, host.wait_ms = 100.0, 90.0
    host.call(gov, 20)
    assert gov.threads == 1 and host.sizes == [] and gov.probes == 0


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
