"""Start-up objects are kept out of the garbage collector's scans."""

from __future__ import annotations

import gc
from collections.abc import Iterator

import pytest

from maskwire.heap import freeze_startup_heap


class _Node:
    def __init__(self) -> None:
        self.peer: _Node | None = None


@pytest.fixture
def unfrozen() -> Iterator[None]:
    gc.unfreeze()
    yield
    gc.unfreeze()


def test_objects_alive_at_start_up_leave_the_collected_generations(unfrozen: None) -> None:
    built = _Node()
    freeze_startup_heap("test")
    assert gc.get_freeze_count() > 0
    assert not any(o is built for g in range(3) for o in gc.get_objects(generation=g))


def test_what_serving_allocates_later_is_still_collected(unfrozen: None) -> None:
    freeze_startup_heap("test")
    a, b = _Node(), _Node()
    a.peer, b.peer = b, a  # a cycle: only the collector frees it
    del a, b
    assert gc.collect() >= 2
