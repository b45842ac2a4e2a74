"""Shared pytest fixtures: paths to the third-party test data."""

from __future__ import annotations

from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
TESTDATA = ROOT.parent / "shared" / "testdata"


@pytest.fixture(scope="session")
def testdata() -> Path:
    if not TESTDATA.is_dir():
        pytest.fail(f"third-party test data missing at {TESTDATA}")
    return TESTDATA
