"""A real grammar-service process under hostile compile traffic: a cancelled caller of a shared
compile leaves the others their answer, oversized option strings are refused by byte count, and
many large distinct grammars keep the process's memory under the ceiling its flags give
(docs/operations.md, "Memory of a grammar replica")."""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator

import grpc
import pytest

from maskwire.rpc import RpcError
from maskwire.tokenizer import Tokenizer
from maskwire.v1 import common_pb2, grammar_pb2_grpc
from tests.support.metrics import metric
from tests.support.processes import ServiceProcess, free_port, running
from tests.support.shared_compile import (
    Stream,
    cancel_one_caller_of_a_shared_compile,
    choices,
    compile_request,
    connect,
    open_msg,
)

MIB = 1 << 20
MAX_SCHEMA_BYTES = 300_000
CACHE_BYTES = 80 * MIB  # one list at a time (each is charged ~72 MB)
WORDS = 30_000  # ~270 KB of choices: a second or more to compile here
LISTS = 24
COMPILE_THREADS = 1
# docs/operations.md: one compile in flight peaks at up to this many bytes per input byte.
COMPILE_PEAK_PER_BYTE = 300


@pytest.fixture(scope="module")
def service() -> Iterator[tuple[ServiceProcess, int]]:
    metrics_port = free_port()
    with running(
        "grammar-service",
        [
            "--tokenizer",
            "default",
            "--compile-threads",
            str(COMPILE_THREADS),
            "--max-schema-bytes",
            str(MAX_SCHEMA_BYTES),
            "--compile-cache-bytes",
            str(CACHE_BYTES),
            "--compile-timeout-s",
            "60",
            "--metrics-port",
            str(metrics_port),
        ],
    ) as svc:
        yield svc, metrics_port


def rss_mb(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    raise AssertionError("no VmRSS")


def test_cancelling_one_caller_of_a_shared_compile_answers_the_others(
    service: tuple[ServiceProcess, int], smollm: Tokenizer
) -> None:
    cancel_one_caller_of_a_shared_compile(service[0].address, smollm, choices(1, WORDS))


def expect_too_large(call: Callable[[], object], field: str) -> None:
    try:
        call()
    except grpc.RpcError as e:
        err = RpcError.from_call_error(e)
    else:
        raise AssertionError("an oversized constraint was compiled")
    assert err.code is grpc.StatusCode.INVALID_ARGUMENT and err.reason == "CONSTRAINT_TOO_LARGE"
    assert err.violations[0][0] == field
    assert f"at most {MAX_SCHEMA_BYTES}" in err.message and "--max-schema-bytes" in err.message


def test_memory_stays_under_the_ceiling_of_the_flags(
    service: tuple[ServiceProcess, int], smollm: Tokenizer
) -> None:
    """Oversized separators are refused by byte count (Compile and Open); then 24 distinct large
    choice lists (each ~13 MB once compiled) leave the process within its documented ceiling:
    at rest + --compile-cache-bytes + --compile-threads x the peak of one compile."""
    svc, metrics_port = service
    pid = svc.proc.pid
    rest = rss_mb(pid)
    with connect(svc.address) as ch:
        stub = grammar_pb2_grpc.GrammarServiceStub(ch)
        big = "," * (10 * MIB)
        expect_too_large(
            lambda: stub.Compile(
                compile_request(
                    smollm,
                    common_pb2.Constraint(
                        json_object=True, json_options=common_pb2.JsonOptions(item_separator=big)
                    ),
                ),
                timeout=60,
            ),
            "constraint.json_options.item_separator",
        )
        # Text and option under the limit each, over it together: the larger one is named.
        schema = '{"description": "' + "x" * (MAX_SCHEMA_BYTES // 2 - 19) + '"}'
        separator = ":" * (MAX_SCHEMA_BYTES // 2 + 1)
        assert len(schema) == MAX_SCHEMA_BYTES // 2
        stream = Stream(ch, timeout_s=60)
        opened = stream.send(
            open_msg(
                smollm,
                "sep",
                common_pb2.Constraint(
                    json_schema=schema,
                    json_options=common_pb2.JsonOptions(key_separator=separator),
                ),
            )
        ).opened
        stream.end()
        err = RpcError.from_status(opened.error)
        assert err.code is grpc.StatusCode.INVALID_ARGUMENT and err.reason == "CONSTRAINT_TOO_LARGE"
        assert err.violations[0][0] == "constraint.json_options.key_separator"

        peak = [rss_mb(pid)]
        done = threading.Event()

        def watch() -> None:
            while not done.wait(0.05):
                peak.append(rss_mb(pid))

        watcher = threading.Thread(target=watch)
        watcher.start()
        try:
            for seed in range(100, 100 + LISTS):
                stub.Compile(compile_request(smollm, choices(seed, WORDS)), timeout=120)
        finally:
            done.set()
            watcher.join()
    compile_peak_mb = COMPILE_PEAK_PER_BYTE * MAX_SCHEMA_BYTES / MIB
    ceiling = rest + CACHE_BYTES / MIB + COMPILE_THREADS * compile_peak_mb
    assert max(peak) < ceiling, f"RSS {rest:.0f} -> {max(peak):.0f} MB, over {ceiling:.0f} MB"
    assert 0 < metric(metrics_port, "maskwire_grammar_cache_bytes") <= CACHE_BYTES
    assert metric(metrics_port, "maskwire_grammar_cache_entries") >= 1
