"""A real worker in its default, fast configuration (compiled graphs, bf16 where native, the
decode kernels timed fastest on this host from the Q4_1 checkpoint), with its own compile cache:
every graph is built before the worker reports ready, a mixed load compiles nothing more, and a
restart loads every graph (and the kernels' timings) from the cache instead of compiling it.

Slow: the cold start compiles the 30-layer model's two graphs and the sampler (minutes on a
2-core host).
"""

from __future__ import annotations

import asyncio
import json
import re
from collections.abc import Iterator
from contextlib import AbstractContextManager
from pathlib import Path

import jsonschema
import pytest

from maskwire.v1 import common_pb2, worker_pb2, worker_pb2_grpc
from neuron_worker.kernels import cpu_kernel_set
from neuron_worker.tuning import native_bf16
from tests.integration.worker.conftest import (
    CHOICES,
    REGEX,
    SCHEMAS,
    Result,
    channel,
    chat,
    generate,
)
from tests.support.metrics import metric
from tests.support.processes import TEST_WORKER_DEVICE, ServiceProcess, free_port, running

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1500)]

# The defaults, spelled out: test workers otherwise get the reference flags (eager fp32).
FAST = [*("--compile", "--dtype", "auto", "--quantize", "auto")]
LIMITS = [*("--max-batch-size", "4", "--max-seq-len", "512")]
COLD_START_S = 1200.0  # a cold compile on a loaded 2-core host
SETTINGS = re.compile(r"compile cache \S+: (\d+) graphs loaded from it, (\d+) compiled into it")


def expected_settings() -> str:
    if TEST_WORKER_DEVICE == "cuda":  # native bf16; the 4-bit kernels are CPU ones
        return "worker settings: dtype bfloat16, compiled, quantize none, CUDA graphs on"
    # auto: the decode kernels timed at load (`neuron_worker.kernel_choice`)
    if native_bf16("cpu"):
        return "worker settings: dtype bfloat16, compiled, quantize auto"
    if cpu_kernel_set() is not None:  # the AVX2 kernels: fp32 activations, 4- or 8-bit weights
        return "worker settings: dtype float32, compiled, quantize auto"
    return "worker settings: dtype float32, compiled, quantize none"


class Stack:
    def __init__(self, grammar: ServiceProcess, cache: Path) -> None:
        self.grammar = grammar
        self.cache = cache

    def worker(self, metrics_port: int, timeout_s: float) -> AbstractContextManager[ServiceProcess]:
        args = [
            *("--model", "default", "--grammar-service", self.grammar.address),
            *("--compile-cache", str(self.cache), "--metrics-port", str(metrics_port)),
            *FAST,
            *LIMITS,
        ]
        return running("worker", args, timeout_s=timeout_s)


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    with running("grammar-service", ["--tokenizer", "default"]) as gs:
        yield Stack(gs, tmp_path_factory.mktemp("compile-cache"))


@pytest.fixture(scope="module")
def cold(stack: Stack) -> Iterator[tuple[ServiceProcess, int]]:
    port = free_port()
    with stack.worker(port, COLD_START_S) as w:
        yield w, port


def cache_use(worker: ServiceProcess) -> tuple[int, int]:
    found = SETTINGS.search(worker.log_text())
    assert found, worker.log_text()[-3000:]
    return int(found.group(1)), int(found.group(2))


def test_the_default_configuration_compiles_everything_before_ready(
    cold: tuple[ServiceProcess, int],
) -> None:
    worker, _ = cold
    log = worker.log_text()
    assert expected_settings() in log
    loaded, compiled = cache_use(worker)
    assert loaded == 0 and compiled > 0
    # the decode kernels were timed (their table logged) and cached with the graphs
    timed = "quantize auto" in expected_settings()
    assert ("decode kernels timed in" in log) == timed, log[-3000:]
    # Each warm-up graph is logged with its time, so an operator sees where a cold start goes.
    total = re.search(r"warm-up ran (\d+) graphs", log)
    assert total, log[-3000:]
    timed = re.findall(r"warm-up: (forward|sampler|jump-forward|cuda graph) .* in \d+\.\ds", log)
    assert len(timed) == int(total.group(1)) and "forward" in timed, log[-3000:]
    # on CUDA the decode pass is captured too, once per (rows, KV length) bucket
    assert ("cuda graph" in timed) == (TEST_WORKER_DEVICE == "cuda"), log[-3000:]
    # greedy steps skip the sampler's graphs where the worker's kernels run
    greedy_kernel = TEST_WORKER_DEVICE == "cpu" and cpu_kernel_set() is not None
    assert ("greedy steps sample in one C++ call" in log) == greedy_kernel, log[-3000:]


async def mixed_load(address: str) -> list[Result]:
    """More requests than batch rows: prompts of many lengths, one near the context limit,
    constrained and not, greedy and sampled, jump-forward (the choice and the schema's keys),
    logprobs with and without the EOS ban and a penalty."""
    schema = SCHEMAS["enum_bool"]
    long_prompt = "Count with me: " + " ".join(str(i) for i in range(120))
    async with channel(address) as ch:
        stub = worker_pb2_grpc.WorkerStub(ch)
        return list(
            await asyncio.gather(
                generate(stub, "The capital of France is", max_tokens=3),
                generate(stub, long_prompt, max_tokens=12),
                generate(
                    stub,
                    chat("Capital of France?"),
                    common_pb2.Constraint(choice=common_pb2.ChoiceList(choices=CHOICES)),
                    max_tokens=8,
                ),
                generate(
                    stub,
                    chat("A phone number?"),
                    common_pb2.Constraint(regex=REGEX),
                    temperature=1.0,
                    seed=7,
                ),
                generate(
                    stub,
                    chat("A color as JSON."),
                    common_pb2.Constraint(json_schema=json.dumps(schema)),
                    max_tokens=30,
                    temperature=0.8,
                    top_p=0.9,
                    top_k=20,
                    seed=7,
                ),
                generate(stub, chat("Say hello."), max_tokens=20, temperature=0.7, seed=3),
                # the logprob graph with and without the EOS ban and a penalty before it
                generate(stub, chat("Say hi."), max_tokens=6, logprobs=True, top_logprobs=2),
                generate(
                    stub,
                    chat("Say bye."),
                    max_tokens=6,
                    ignore_eos=True,
                    frequency_penalty=0.5,
                    logprobs=True,
                ),
            )
        )


def check(results: list[Result]) -> None:
    paris, long, choice, regex, js, _, hi, bye = results
    assert paris.text.startswith(" Paris"), paris.text
    assert len(long.ids) == 12
    for r in (choice, regex, js):
        assert r.final.finish_reason == worker_pb2.FINISH_REASON_STOP, (r.final, r.text)
    assert choice.text in CHOICES
    assert re.fullmatch(REGEX, regex.text), regex.text
    jsonschema.validate(json.loads(js.text), SCHEMAS["enum_bool"])
    for r in (hi, bye):
        assert len([lp for m in r.messages for lp in m.logprobs]) == len(r.ids), r.text
    assert len(bye.ids) == 6


async def test_a_mixed_load_is_served_without_compiling(
    cold: tuple[ServiceProcess, int],
) -> None:
    worker, port = cold
    for _ in range(2):
        check(await mixed_load(worker.address))
    assert metric(port, "maskwire_worker_compiles_while_serving_total") == 0
    assert "compiled while serving" not in worker.log_text()
    assert "serving it eager" not in worker.log_text()  # nothing fell back to eager
    assert "serving it compiled" not in worker.log_text()  # every CUDA graph was captured


async def test_a_restart_loads_every_graph_from_the_cache(
    stack: Stack, cold: tuple[ServiceProcess, int]
) -> None:
    first, _ = cold
    port = free_port()
    with stack.worker(port, COLD_START_S) as again:
        loaded, compiled = cache_use(again)
        assert compiled == 0 and loaded == sum(cache_use(first))
        timed = "quantize auto" in expected_settings()
        assert ("decode kernels read from" in again.log_text()) == timed
        results = await mixed_load(again.address)
        check(results)
        assert metric(port, "maskwire_worker_compiles_while_serving_total") == 0
    # the same kernels: the greedy answers are the cold worker's
    before = await mixed_load(first.address)
    assert [r.text for r in results[:3]] == [r.text for r in before[:3]]
