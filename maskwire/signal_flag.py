"""A stop flag that a signal handler may set.

`threading.Event.set` takes the event's lock, and a Python signal handler runs on the main thread
between two bytecodes, possibly while that thread holds the same lock: inside `Event.wait`, or
inside an earlier handler's `set`. Linux sends the parent-death signal once for each thread of
the dying parent that is reparented, so a child of `maskwire up` gets several SIGTERMs at once
when `up` is killed, and a handler calling `Event.set` deadlocked there (one child in five
stayed up in a test). Setting a `SignalFlag` is one assignment; waiting on it polls.
"""

from __future__ import annotations

import time
from typing import Protocol

# How often `SignalFlag.wait` looks at the flag: the delay between a signal and the waiter.
POLL_S = 0.05


class StopFlag(Protocol):
    """What a loop that stops on request needs: `threading.Event` or `SignalFlag`."""

    def is_set(self) -> bool: ...

    def wait(self, timeout: float) -> bool: ...


class SignalFlag:
    """`is_set` / `set` / `wait(timeout)` like `threading.Event`, safe in a signal handler."""

    def __init__(self) -> None:
        self._set = False

    def set(self) -> None:
        self._set = True

    def is_set(self) -> bool:
        return self._set

    def wait(self, timeout: float) -> bool:
        """True once set; False after `timeout` seconds without."""
        deadline = time.monotonic() + timeout
        while not self._set:
            left = deadline - time.monotonic()
            if left <= 0:
                return False
            time.sleep(min(POLL_S, left))
        return True
