"""One live stack on the embedded SmolLM2 (grammar service + worker + gateway) for every module of
this package: starting one costs a model load."""

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


@pytest.fixture(scope="package")
def worker_metrics_port() -> int:
    return free_port()


@pytest.fixture(scope="package")
def worker(worker_metrics_port: int) -> Iterator[ServiceProcess]:
    with grammar_and_worker(["--metrics-port", str(worker_metrics_port)]) as (_, w):
        yield w


@pytest.fixture(scope="package")
def gw(worker: ServiceProcess) -> Iterator[ServiceProcess]:
    with running("gateway", ["--worker", worker.address], http=True) as g:
        yield g


@pytest.fixture(scope="package")
def client(gw: ServiceProcess) -> openai.OpenAI:
    return openai_client(gw)
