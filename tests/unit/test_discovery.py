"""maskwire.discovery: target parsing, replica-set tracking and the failure policy."""

from __future__ import annotations

import asyncio
import socket
from collections.abc import Collection

import pytest

from maskwire.discovery import (
    Change,
    Resolver,
    Target,
    TargetError,
    parse_target,
    parse_targets,
)


class FakeDns:
    """Answers from a dict; a value that is an exception is raised instead."""

    def __init__(self, answers: dict[str, list[str] | Exception]) -> None:
        self.answers = answers
        self.calls: list[tuple[str, int]] = []

    async def __call__(self, host: str, port: int) -> Collection[str]:
        self.calls.append((host, port))
        answer = self.answers[host]
        if isinstance(answer, Exception):
            raise answer
        return answer


@pytest.mark.parametrize(
    ("spec", "target"),
    [
        ("grammar:50051", Target("grammar", 50051, False)),
        ("127.0.0.1:1", Target("127.0.0.1", 1, False)),
        ("[::1]:50051", Target("::1", 50051, False)),
        (
            "dns:///maskwire-grammar.ns.svc.cluster.local:50051",
            Target("maskwire-grammar.ns.svc.cluster.local", 50051, True),
        ),
        ("dns:grammar:7", Target("grammar", 7, True)),
        (" dns:///[::1]:9 ", Target("::1", 9, True)),
    ],
)
def test_parse_target(spec: str, target: Target) -> None:
    assert parse_target(spec) == target


@pytest.mark.parametrize(
    ("spec", "needle"),
    [
        ("grammar", "HOST:PORT"),
        ("grammar:http", "not a number"),
        ("grammar:0", "out of range"),
        ("grammar:70000", "out of range"),
        (":50051", "empty host"),
        ("::1:50051", "HOST:PORT"),
        ("dns://8.8.8.8/grammar:1", "authority"),
        ("http://grammar:1", "only dns:///"),
        ("[::1]50051", "[IPv6]:PORT"),
    ],
)
def test_parse_target_rejects(spec: str, needle: str) -> None:
    with pytest.raises(TargetError, match=needle.replace("[", r"\[").replace("]", r"\]")):
        parse_target(spec)


def test_parse_targets_comma_list_and_empty() -> None:
    assert [str(t) for t in parse_targets("a:1, dns:///b:2,")] == ["a:1", "dns:///b:2"]
    assert [str(t) for t in parse_targets(["a:1", "c:3"])] == ["a:1", "c:3"]
    with pytest.raises(TargetError):
        parse_targets(" , ")


async def test_static_targets_are_not_resolved() -> None:
    dns = FakeDns({})
    async with Resolver("localhost:50051,[::1]:7", resolve=dns) as r:
        assert r.addresses == {"localhost:50051", "[::1]:7"}
        assert not r.dynamic
    assert dns.calls == []


async def test_additions_and_removals_reach_callback_and_iterators() -> None:
    dns = FakeDns({"g": ["10.0.0.1", "10.0.0.2"]})
    seen: list[Change] = []
    r = Resolver("dns:///g:50051", resolve=dns, on_change=seen.append, refresh_s=3600)
    first = await r.start()
    assert first.added == {"10.0.0.1:50051", "10.0.0.2:50051"} and not first.removed

    it = r.changes()
    initial = await anext(it)
    assert initial.added == r.addresses and not initial.removed

    dns.answers["g"] = ["10.0.0.2", "10.0.0.3", "10.0.0.3"]
    change = await r.refresh()
    assert change.added == {"10.0.0.3:50051"}
    assert change.removed == {"10.0.0.1:50051"}
    assert change.current == {"10.0.0.2:50051", "10.0.0.3:50051"}
    assert await anext(it) == change

    # No change: nothing reported.
    assert not await r.refresh()
    assert seen == [first, change]

    await r.stop()
    with pytest.raises(StopAsyncIteration):
        await anext(it)


async def test_async_callback_awaited_and_failing_callback_isolated() -> None:
    dns = FakeDns({"g": ["10.0.0.1"]})
    got: list[Change] = []

    async def cb(change: Change) -> None:
        await asyncio.sleep(0)
        got.append(change)

    async with Resolver("dns:///g:1", resolve=dns, on_change=cb):
        pass
    assert len(got) == 1

    def boom(change: Change) -> None:
        raise RuntimeError("consumer bug")

    async with Resolver("dns:///g:1", resolve=dns, on_change=boom) as r:
        assert r.addresses == {"10.0.0.1:1"}


async def test_temporary_dns_failure_keeps_known_replicas() -> None:
    dns = FakeDns({"g": ["10.0.0.1"]})
    async with Resolver("dns:///g:1", resolve=dns, refresh_s=3600) as r:
        dns.answers["g"] = socket.gaierror(socket.EAI_AGAIN, "Temporary failure in name resolution")
        assert not await r.refresh()
        assert r.addresses == {"10.0.0.1:1"}
        dns.answers["g"] = TimeoutError("dns timeout")
        assert not await r.refresh()
        assert r.addresses == {"10.0.0.1:1"}


async def test_name_without_addresses_drops_all_replicas() -> None:
    dns = FakeDns({"g": ["10.0.0.1"]})
    async with Resolver("dns:///g:1", resolve=dns, refresh_s=3600) as r:
        dns.answers["g"] = socket.gaierror(socket.EAI_NONAME, "Name or service not known")
        change = await r.refresh()
        assert change.removed == {"10.0.0.1:1"} and not r.addresses
        dns.answers["g"] = ["10.0.0.9"]
        assert (await r.refresh()).added == {"10.0.0.9:1"}


async def test_union_of_targets_and_ipv6_formatting() -> None:
    dns = FakeDns({"a": ["10.0.0.1", "fe80::1%eth0"], "b": ["10.0.0.1", "2001:db8::1"]})
    async with Resolver(["dns:///a:5", "dns:///b:5", "static:6"], resolve=dns) as r:
        assert r.addresses == {"10.0.0.1:5", "[fe80::1]:5", "[2001:db8::1]:5", "static:6"}


async def test_background_refresh_follows_dns() -> None:
    dns = FakeDns({"g": ["10.0.0.1"]})
    changed = asyncio.Event()

    def cb(change: Change) -> None:
        if change.added == {"10.0.0.2:1"}:
            changed.set()

    async with Resolver("dns:///g:1", resolve=dns, refresh_s=0.01, on_change=cb) as r:
        dns.answers["g"] = ["10.0.0.2"]
        await asyncio.wait_for(changed.wait(), 10)
        assert r.addresses == {"10.0.0.2:1"}


async def test_start_with_nothing_resolvable_still_starts() -> None:
    dns = FakeDns({"g": socket.gaierror(socket.EAI_NONAME, "no such name")})
    async with Resolver("dns:///g:1", resolve=dns, refresh_s=3600) as r:
        assert r.addresses == frozenset()


def test_refresh_period_must_be_positive() -> None:
    with pytest.raises(ValueError, match="refresh_s"):
        Resolver("dns:///g:1", refresh_s=0)


async def test_real_dns_localhost_resolves_to_loopback() -> None:
    async with Resolver("dns:///localhost:50051") as r:
        assert r.addresses, "localhost did not resolve"
        assert "127.0.0.1:50051" in r.addresses or "[::1]:50051" in r.addresses
        for addr in r.addresses:
            assert addr in {"127.0.0.1:50051", "[::1]:50051"}, addr
