"""One real grammar service + worker (embedded SmolLM2) shared by the CLI and Node client tests."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.support.processes import ServiceProcess, running


@pytest.fixture(scope="package")
def grammar() -> Iterator[ServiceProcess]:
    with running("grammar-service", ["--tokenizer", "default"]) as svc:
        yield svc


@pytest.fixture(scope="package")
def worker(grammar: ServiceProcess) -> Iterator[ServiceProcess]:
    with running(
        "worker", ["--model", "default", "--device", "cpu", "--grammar-service", grammar.address]
    ) as svc:
        yield svc
