"""The stop flag that signal handlers set: a burst of signals (what a killed supervisor's
children get) sets it without blocking, and a waiter sees it within a poll."""

from __future__ import annotations

import os
import signal
import threading
import time

from maskwire.signal_flag import POLL_S, SignalFlag


def test_a_burst_of_signals_sets_the_flag_and_wakes_the_waiter() -> None:
    flag = SignalFlag()
    handled: list[int] = []

    def handler(signum: int, frame: object) -> None:
        handled.append(signum)
        flag.set()

    previous = signal.signal(signal.SIGUSR1, handler)
    try:
        assert not flag.wait(0.1) and not flag.is_set()

        def burst() -> None:
            time.sleep(0.1)
            for _ in range(5):
                os.kill(os.getpid(), signal.SIGUSR1)

        threading.Thread(target=burst).start()
        began = time.monotonic()
        assert flag.wait(10)
        assert time.monotonic() - began < 0.1 + 2 + POLL_S
        assert flag.is_set() and handled
    finally:
        signal.signal(signal.SIGUSR1, previous)


def test_wait_times_out_unset() -> None:
    flag = SignalFlag()
    began = time.monotonic()
    assert flag.wait(0.12) is False
    assert 0.12 <= time.monotonic() - began < 1.0
