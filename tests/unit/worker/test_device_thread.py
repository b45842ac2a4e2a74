"""The device thread: one thread for all of a process's torch work."""

from __future__ import annotations

import threading

from neuron_worker import device_thread


def _name() -> str:
    return threading.current_thread().name


async def test_every_run_uses_the_same_thread_off_the_event_loop() -> None:
    first = await device_thread.run(_name)
    second = await device_thread.run(_name)
    assert first == second != threading.current_thread().name
    assert first.startswith("maskwire-device")
    assert device_thread.executor().submit(_name).result() == first
