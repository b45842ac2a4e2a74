"""Query of death: a constraint that crashes every grammar replica it reaches.

Three real replicas run with the test-only fault hook (`--testing-faults` and
`MASKWIRE_TESTING_FAULT=service:abort:MARKER`: the service process aborts while building a
matcher for a grammar that contains MARKER, as a native crash the sandbox did not foresee would).
The worker must stop the crash at the second replica, fail that request with
`CONSTRAINT_CRASHED`, finish everyone else's requests, keep serving, and never send the
constraint again; a restarted replica (without the hook) refuses it by itself.
"""

from __future__ import annotations

import asyncio
import json
import uuid
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

from maskwire.rpc import RpcError
from maskwire.v1 import common_pb2, grammar_pb2, grammar_pb2_grpc, worker_pb2_grpc
from tests.integration.faults.support import assert_valid, first_tokens, start_constrained
from tests.integration.worker.conftest import SCHEMAS, channel, chat, generate
from tests.support.processes import ServiceProcess, free_port, running

MARKER = f"query-of-death-{uuid.uuid4().hex[:8]}"
POISON = common_pb2.Constraint(
    json_schema=json.dumps({"type": "object", "description": MARKER, "properties": {}})
)


@pytest.fixture(scope="module")
def state_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("grammar-state")


@pytest.fixture(scope="module")
def replicas(state_root: Path) -> Iterator[list[ServiceProcess]]:
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("MASKWIRE_TESTING_FAULT", f"service:abort:{MARKER}")
        procs = []
        try:
            for i in range(3):
                args = [
                    *("--tokenizer", "default", "--testing-faults"),
                    *("--state-dir", str(state_root / f"r{i}")),
                ]
                p = ServiceProcess("grammar-service", args, free_port())
                procs.append(p)
            for p in procs:
                p.wait_ready()
            yield procs
        finally:
            for p in procs:
                p.stop()


@pytest.fixture(scope="module")
def worker(replicas: list[ServiceProcess]) -> Iterator[ServiceProcess]:
    addresses = ",".join(r.address for r in replicas)
    args = ["--model", "default", "--grammar-service", addresses, "--max-seq-len", "512"]
    with running("worker", args) as w:
        yield w


def alive(replicas: list[ServiceProcess]) -> list[ServiceProcess]:
    return [r for r in replicas if r.proc.poll() is None]


async def test_poison_constraint_kills_at_most_two_replicas(
    worker: ServiceProcess, replicas: list[ServiceProcess], state_root: Path
) -> None:
    async with channel(worker.address) as ch:
        stub = worker_pb2_grpc.WorkerStub(ch)
        others = start_constrained(stub, 4)
        await first_tokens(others)

        with pytest.raises(grpc.aio.AioRpcError) as info:
            await generate(stub, chat("Anything."), POISON)
        err = RpcError.from_call_error(info.value)
        assert err.code == grpc.StatusCode.INVALID_ARGUMENT
        assert err.reason == "CONSTRAINT_CRASHED"
        assert "constraint crashed the grammar service" in err.message

        await asyncio.sleep(0.5)
        survivors = alive(replicas)
        assert len(survivors) == 1, "the crash went past the second replica"
        for r in await asyncio.gather(*others):
            assert_valid(r)  # the requests of the dead replicas were replayed

        # The tier still serves new constrained requests.
        person = common_pb2.Constraint(json_schema=json.dumps(SCHEMAS["person"]))
        ok = await generate(stub, chat("A person as JSON."), person)
        assert json.loads(ok.text)["age"] >= 0

        # Sent again: refused by the worker at once, nothing else dies.
        with pytest.raises(grpc.aio.AioRpcError) as again:
            await generate(stub, chat("Anything."), POISON)
        assert RpcError.from_call_error(again.value).reason == "CONSTRAINT_CRASHED"
        assert alive(replicas) == survivors
    log = worker.log_text()
    assert "died holding request" in log

    # A dead replica restarted on its state directory refuses the constraint by itself.
    dead = next(r for r in replicas if r not in survivors)
    state = next(a for a in dead.proc.args if str(state_root) in str(a))  # type: ignore[union-attr]
    restarted = ServiceProcess(
        "grammar-service", ["--tokenizer", "default", "--state-dir", str(state)], free_port()
    )
    try:
        restarted.wait_ready()
        with grpc.insecure_channel(restarted.address) as ch2:
            compile_ = grammar_pb2_grpc.GrammarServiceStub(ch2).Compile
            with pytest.raises(grpc.RpcError) as refused:
                compile_(grammar_pb2.CompileRequest(constraint=POISON), timeout=30)
            assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert "crashed" in (refused.value.details() or "")
        assert restarted.proc.poll() is None
    finally:
        restarted.stop()
