"""Shared pytest fixtures: paths to the third-party test data; no compiled graph silently served
eager."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from neuron_worker.compile_fallback import fallback_counts

ROOT = Path(__file__).resolve().parent.parent
TESTDATA = ROOT.parent / "shared" / "testdata"


@pytest.fixture(scope="session")
def testdata() -> Path:
    if not TESTDATA.is_dir():
        pytest.fail(f"third-party test data missing at {TESTDATA}")
    return TESTDATA


@pytest.fixture(autouse=True)
def _no_silent_eager_fallback(request: pytest.FixtureRequest) -> Iterator[None]:
    """A compiler failure makes the worker serve that function eager (`compile_fallback`), which
    would let a test of compiled graphs pass on eager ones: in-process, only tests marked
    `eager_fallback` may cause one."""
    before = fallback_counts()
    yield
    if request.node.get_closest_marker("eager_fallback") is None:
        assert fallback_counts() == before, "a compiled function fell back to eager (see log)"
