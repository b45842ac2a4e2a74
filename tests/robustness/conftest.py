"""The robustness suites share one real stack (grammar service + worker + gateway)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.robustness.stack import Stack, start_stack


@pytest.fixture(scope="package")
def stack() -> Iterator[Stack]:
    with start_stack() as s:
        s.assert_still_serving()  # warm every path once
        yield s
