"""One embedded SmolLM2 per test session (each module sizes its own caches)."""

from __future__ import annotations

import pytest

from neuron_worker.model import Transformer, load_model


@pytest.fixture(scope="session")
def smollm() -> Transformer:
    return load_model("default")
