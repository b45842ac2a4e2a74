"""One grammar service process (SmolLM2 + Tekken tokenizers) shared by this package's tests."""

from __future__ import annotations

from collections.abc import Iterator

import grpc
import pytest

from maskwire.tokenizer import Tokenizer, load_tokenizer, tekken_path
from tests.integration.grammar_service.client import channel
from tests.support.processes import ServiceProcess, running


@pytest.fixture(scope="session")
def smollm() -> Tokenizer:
    return load_tokenizer("default")


@pytest.fixture(scope="session")
def tekken() -> Tokenizer:
    return load_tokenizer(str(tekken_path()))


@pytest.fixture(scope="session")
def grammar_service() -> Iterator[ServiceProcess]:
    with running(
        "grammar-service",
        # Compact answers from the first row, so small test steps exercise them.
        ["--tokenizer", "default", "--tokenizer", str(tekken_path()), "--compact-min-rows", "1"],
    ) as svc:
        yield svc


@pytest.fixture(scope="session")
def gs_channel(grammar_service: ServiceProcess) -> Iterator[grpc.Channel]:
    ch = channel(grammar_service.address)
    yield ch
    ch.close()
