"""The device thread: one thread for all of a process's torch work, reached from async and
sync code alike."""

from __future__ import annotations

import threading

from neuron_worker import device_thread


def _name() -> str:
    return threading.current_thread().name


async def test_run_and_call_use_the_same_thread() -> None:
    from_async = await device_thread.run(_name)
    from_sync = device_thread.call(_name)
    assert from_async == from_sync != threading.current_thread().name
    assert from_async.startswith("maskwire-device")


def test_call_on_the_device_thread_runs_inline() -> None:
    # A nested call would wait for itself on a one-thread executor; it must run in place.
    assert device_thread.call(lambda: device_thread.call(_name)) == device_thread.call(_name)
