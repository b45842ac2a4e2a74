"""maskwire.event_loop: the services run on uvloop when it is installed, asyncio on request."""

from __future__ import annotations

import argparse
import asyncio
import gc
import inspect
import sys
import warnings

import pytest

from maskwire import event_loop

uvloop = pytest.importorskip("uvloop")


async def loop_type() -> type:
    return type(asyncio.get_running_loop())


def test_auto_and_uvloop_run_on_uvloop() -> None:
    assert event_loop.run(loop_type()) is uvloop.Loop
    assert event_loop.run(loop_type(), "uvloop") is uvloop.Loop


def test_asyncio_runs_on_the_standard_loop() -> None:
    got = event_loop.run(loop_type(), "asyncio")
    assert got is not uvloop.Loop and issubclass(got, asyncio.BaseEventLoop)


def test_unknown_loop_is_refused_without_leaking_the_coroutine(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # A coroutine dropped without being awaited or closed warns "never awaited" from its
    # finaliser, which goes to sys.unraisablehook (never to this test's frame): collect those.
    unraisable: list[str] = []
    monkeypatch.setattr(
        sys, "unraisablehook", lambda u: unraisable.append(f"{u.exc_value!r} in {u.object!r}")
    )
    coro = loop_type()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with pytest.raises(ValueError, match="event loop must be one of"):
            event_loop.run(coro, "trio")
        # run() closed it: a closed coroutine has no frame and cannot warn any more.
        assert inspect.getcoroutinestate(coro) == inspect.CORO_CLOSED
        del coro
        gc.collect()
    assert not [w for w in caught if "never awaited" in str(w.message)]
    assert unraisable == []


def test_flag_parses() -> None:
    p = argparse.ArgumentParser()
    event_loop.add_event_loop_argument(p)
    assert p.parse_args([]).event_loop == "auto"
    assert p.parse_args(["--event-loop", "asyncio"]).event_loop == "asyncio"
    with pytest.raises(SystemExit):
        p.parse_args(["--event-loop", "nope"])
