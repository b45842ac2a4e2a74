"""The worker's grammar client follows DNS: replicas behind one `dns:///` name are added and removed
as the name re-resolves (`GrammarClient.update_replicas`, wired to `Resolver` as the worker wires
it), new requests go to an added replica, and a removed replica's requests move to the others by
replay while the removed one is drained.

Two real grammar services listen on the same port of two loopback addresses, like the pods of a
Kubernetes headless Service; a test resolver stands in for the cluster DNS. Every mask is checked
against a local llguidance matcher.
"""

from __future__ import annotations

import asyncio
import time
import urllib.request
from collections.abc import Iterator, Sequence
from contextlib import ExitStack

import llguidance
import numpy as np
import pytest
from prometheus_client.parser import text_string_to_metric_families

from maskwire.discovery import Resolver
from maskwire.tokenizer import Tokenizer, load_tokenizer
from maskwire.v1 import common_pb2, grammar_pb2
from neuron_worker.config import GrammarSettings
from neuron_worker.grammar_client import GrammarClient, GrammarRequest
from tests.support.processes import ServiceProcess, free_port, running

NAME = "grammar.maskwire.test"
IPS = ("127.0.0.2", "127.0.0.3")
REGEX = "[a-z]{1,60}"


@pytest.fixture(scope="module")
def tok() -> Tokenizer:
    return load_tokenizer("default")


@pytest.fixture(scope="module")
def replicas() -> Iterator[list[ServiceProcess]]:
    """One grammar service on each of IPS, all on the same gRPC port."""
    port = free_port()
    with ExitStack() as stack:
        out = []
        for ip in IPS:
            metrics_port = free_port()
            svc = stack.enter_context(
                running(
                    "grammar-service",
                    ["--tokenizer", "default", "--metrics-port", str(metrics_port)],
                    host=ip,
                    port=port,
                )
            )
            svc.metrics_port = metrics_port  # type: ignore[attr-defined]
            out.append(svc)
        yield out


def gauge(svc: ServiceProcess, name: str) -> float:
    host = svc.address.rsplit(":", 1)[0]
    url = f"http://{host}:{svc.metrics_port}/metrics"  # type: ignore[attr-defined]
    with urllib.request.urlopen(url, timeout=5) as r:
        for fam in text_string_to_metric_families(r.read().decode()):
            for s in fam.samples:
                if s.name == name:
                    return s.value
    raise AssertionError(f"no {name}")


async def wait_live(
    svc: ServiceProcess, requests: int, sessions: int, timeout_s: float = 10.0
) -> None:
    """Wait (on the event loop: the client's fire-and-forget Closes run meanwhile)."""
    deadline = time.monotonic() + timeout_s
    while True:
        got = (
            gauge(svc, "maskwire_grammar_live_requests"),
            gauge(svc, "maskwire_grammar_live_sessions"),
        )
        if got == (requests, sessions):
            return
        assert time.monotonic() < deadline, f"{svc.address}: (requests, sessions) {got}"
        await asyncio.sleep(0.05)


class Expected:
    """Local llguidance matchers fed the same tokens as the service's."""

    def __init__(self, tok: Tokenizer) -> None:
        self.tok = tok
        self.grammar = llguidance.LLMatcher.grammar_from_regex(REGEX)
        self.matchers: dict[str, llguidance.LLMatcher] = {}

    def mask(self, rid: str, new: Sequence[int]) -> np.ndarray:
        m = self.matchers.setdefault(rid, llguidance.LLMatcher(self.tok.ll, self.grammar))
        assert m.consume_tokens(list(new)), m.get_error()
        return np.frombuffer(m.compute_bitmask(), dtype="<i4")[: self.tok.words_per_row]


async def test_replicas_follow_dns(replicas: list[ServiceProcess], tok: Tokenizer) -> None:
    a, b = replicas
    port = a.port
    answers: dict[str, list[str]] = {NAME: [IPS[0]]}

    async def resolve(host: str, _port: int) -> list[str]:
        return list(answers[host])

    client = GrammarClient(
        [],
        tok.fingerprint.to_proto(),
        words_per_row=tok.words_per_row,
        settings=GrammarSettings(step_timeout_s=10),
    )
    resolver = Resolver(
        f"dns:///{NAME}:{port}",
        refresh_s=3600,  # re-resolved by the test, when it changes the answers
        resolve=resolve,
        on_change=lambda ch: client.update_replicas(sorted(ch.added), sorted(ch.removed)),
    )
    expected = Expected(tok)
    letters = tok.encode("abcdefghijklmnopqrstuvwxyz" * 3)
    reqs = [
        GrammarRequest(f"r{i}", common_pb2.Constraint(regex=REGEX), grammar_pb2.RequestOptions())
        for i in range(4)
    ]
    fed = {r.request_id: 0 for r in reqs}

    async def step(live: Sequence[GrammarRequest]) -> None:
        """One token more for each request; every mask must be the local matcher's."""
        outcomes = await client.step(
            [(r, letters[fed[r.request_id] : fed[r.request_id] + 1]) for r in live]
        )
        for r, out in zip(live, outcomes, strict=True):
            assert out.ok, (r.request_id, out.error)
            assert out.mask is not None and out.mask.shape == (1, tok.words_per_row)
            np.testing.assert_array_equal(
                out.mask[0],
                expected.mask(r.request_id, letters[fed[r.request_id] : fed[r.request_id] + 1]),
            )
            fed[r.request_id] += 1
            assert r.consumed == letters[: fed[r.request_id]]

    await resolver.start()
    try:
        assert [r.address for r in client.replicas] == [a.address]
        for r in reqs[:2]:
            await client.open(r)
            expected.mask(r.request_id, [])
        await step(reqs[:2])
        await wait_live(a, 2, 1)

        # A second address behind the name: new requests go to it (it is the least loaded).
        answers[NAME] = [IPS[0], IPS[1]]
        change = await resolver.refresh()
        assert change.added == {b.address} and not change.removed
        assert [r.address for r in client.replicas] == [a.address, b.address]
        for r in reqs[2:]:
            await client.open(r)
            assert r.replica is not None and r.replica.address == b.address
        await step(reqs)
        await wait_live(b, 2, 1)
        await wait_live(a, 2, 1)

        # The first address leaves: its stream is closed (the service frees its requests) and
        # those requests continue on the other replica, replayed, with the same masks.
        answers[NAME] = [IPS[1]]
        change = await resolver.refresh()
        assert change.removed == {a.address} and not change.added
        assert [r.address for r in client.replicas] == [b.address]
        await wait_live(a, 0, 0)
        replays = client.replays
        await step(reqs)
        await step(reqs)
        assert client.replays == replays + 2
        assert all(r.replica is not None and r.replica.address == b.address for r in reqs)
        await wait_live(b, 4, 1)
        for r in reqs:
            client.close(r)
        await wait_live(b, 0, 1)
    finally:
        await resolver.stop()
        await client.aclose()
    await wait_live(b, 0, 0)
