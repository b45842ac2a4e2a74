"""Shared pytest fixtures: paths to the third-party test data; no compiled graph silently served
eager."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from neuron_worker.compile_fallback import fallback_counts

TESTDATA = Path(__file__).resolve().parent / "fixtures" / "third_party"
TESTDATA_SETS = ("json-schema-test-suite", "maskbench")


@pytest.fixture(scope="session")
def testdata() -> Path:
    """The third-party test data the repository carries (only the files the tests read)."""
    missing = [name for name in TESTDATA_SETS if not (TESTDATA / name).is_dir()]
    if missing:
        pytest.fail(f"third-party test data missing: {', '.join(missing)} under {TESTDATA}")
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
