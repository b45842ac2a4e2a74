"""The test-only compile fault hook is armed by `--testing-faults` alone: with only the environment
variable set (as it might be in a deployment), a request carrying a marker compiles normally."""

from __future__ import annotations

import json
import uuid
from collections.abc import Iterator

import grpc
import pytest

from maskwire.rpc import RpcError
from maskwire.v1 import common_pb2, grammar_pb2, grammar_pb2_grpc
from tests.support.processes import ServiceProcess, running

SANDBOX_MARKER = f"fault-hook-sandbox-{uuid.uuid4().hex[:8]}"
SERVICE_MARKER = f"fault-hook-service-{uuid.uuid4().hex[:8]}"
FAULTS = f"sandbox:abort:{SANDBOX_MARKER};service:abort:{SERVICE_MARKER}"


def schema(marker: str) -> common_pb2.Constraint:
    return common_pb2.Constraint(
        json_schema=json.dumps({"type": "object", "description": marker, "properties": {}})
    )


def compile_(svc: ServiceProcess, constraint: common_pb2.Constraint) -> str:
    with grpc.insecure_channel(svc.address) as ch:
        resp = grammar_pb2_grpc.GrammarServiceStub(ch).Compile(
            grammar_pb2.CompileRequest(constraint=constraint), timeout=60
        )
    return str(resp.grammar_id)


def service(*flags: str) -> Iterator[ServiceProcess]:
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("MASKWIRE_TESTING_FAULT", FAULTS)
        with running("grammar-service", ["--tokenizer", "default", *flags]) as svc:
            yield svc


@pytest.fixture
def without_flag() -> Iterator[ServiceProcess]:
    yield from service()


@pytest.fixture
def with_flag() -> Iterator[ServiceProcess]:
    yield from service("--testing-faults")


def test_the_variable_alone_arms_nothing(without_flag: ServiceProcess) -> None:
    assert compile_(without_flag, schema(SANDBOX_MARKER))
    assert compile_(without_flag, schema(SERVICE_MARKER))
    assert without_flag.proc.poll() is None
    log = without_flag.log_text()
    assert "MASKWIRE_TESTING_FAULT is set and ignored" in log
    assert "TEST-ONLY MODE" not in log


def test_the_flag_arms_the_hook_and_says_so(with_flag: ServiceProcess) -> None:
    log = with_flag.log_text()
    assert "WARNING" in log and "TEST-ONLY MODE (--testing-faults)" in log
    # A sandbox child aborts: the constraint is refused as a crash, the service lives.
    with pytest.raises(grpc.RpcError) as info:
        compile_(with_flag, schema(SANDBOX_MARKER))
    assert RpcError.from_call_error(info.value).reason == "CONSTRAINT_CRASHED"
    assert with_flag.proc.poll() is None
    # The service process itself aborts on its own marker.
    with pytest.raises(grpc.RpcError):
        compile_(with_flag, schema(SERVICE_MARKER))
    assert with_flag.proc.wait(30) != 0
