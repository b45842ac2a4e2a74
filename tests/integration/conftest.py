"""One live stack on the embedded SmolLM2 (grammar service + worker + gateway) for the integration
packages that need no flags of their own (cli, gateway): starting one costs a model load. Modules
that start their own services with other flags define their own `worker` fixture."""

from __future__ import annotations

from collections.abc import Iterator

import openai
import pytest

from tests.support.processes import (
    ServiceProcess,
    free_port,
    grammar_and_worker,
    openai_client,
    running,
)


@pytest.fixture(scope="session")
def worker_metrics_port() -> int:
    return free_port()


@pytest.fixture(scope="session")
def worker(worker_metrics_port: int) -> Iterator[ServiceProcess]:
    with grammar_and_worker(["--metrics-port", str(worker_metrics_port)]) as (_, w):
        yield w


@pytest.fixture(scope="session")
def gw(worker: ServiceProcess) -> Iterator[ServiceProcess]:
    with running("gateway", ["--worker", worker.address], http=True) as g:
        yield g


@pytest.fixture(scope="session")
def client(gw: ServiceProcess) -> openai.OpenAI:
    return openai_client(gw)
