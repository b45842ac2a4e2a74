"""The robustness suites share one real stack (grammar service + worker + gateway)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.robustness import hostile_grammars as hostile
from tests.robustness.stack import Stack, start_stack


@pytest.fixture(scope="package")
def stack() -> Iterator[Stack]:
    # The grammar service's compile workers abort or hang on the hostile cases' markers.
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("MASKWIRE_TESTING_FAULT", hostile.FAULTS)
        grammar_args = ("--testing-faults", "--compile-timeout-s", str(hostile.COMPILE_TIMEOUT_S))
        with start_stack(grammar_args=grammar_args) as s:
            s.assert_still_serving()  # warm every path once
            yield s
