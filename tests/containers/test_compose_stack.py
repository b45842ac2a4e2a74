"""deploy/docker/compose.yaml as an operator runs it: the three images, two grammar replicas, one
worker and the gateway, each hardened (read-only root, tmpfs /tmp, no capabilities, uid 10001).
Requests go through the gateway's published port; a grammar replica is killed under load, the
grammar tier scaled to three, the worker restarted on its volume-backed compile cache and the
stack stopped with every service draining. The tests run in file order on one stack."""

from __future__ import annotations

import json
import re
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import jsonschema
import openai
import pytest
import yaml

from tests.containers.compose import COMPOSE_FILE, SERVICES, ComposeStack, podman
from tests.containers.conftest import TIMINGS
from tests.support.schemas import PERSON

pytestmark = [pytest.mark.containers, pytest.mark.timeout(1800)]

MODEL = "SmolLM2-135M-Instruct"
WEATHER = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 20},
        "unit": {"enum": ["celsius", "fahrenheit"]},
    },
    "required": ["city", "unit"],
    "additionalProperties": False,
}
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Weather in a city",
            "parameters": WEATHER,
        },
    }
]


def compose_config() -> dict[str, Any]:
    return dict(yaml.safe_load(COMPOSE_FILE.read_text()))


def seconds(duration: str) -> float:
    """A compose duration of whole seconds ("300s")."""
    match = re.fullmatch(r"(\d+)s", duration)
    assert match, duration
    return float(match.group(1))


def client(stack: ComposeStack) -> openai.OpenAI:
    return openai.OpenAI(
        base_url=f"http://127.0.0.1:{stack.gateway_port}/v1",
        api_key="x",
        max_retries=0,
        timeout=300,
    )


def person_request(c: openai.OpenAI, prompt: str, **kw: Any) -> Any:
    kw.setdefault("temperature", 0)
    kw.setdefault("max_tokens", 60)
    return c.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": prompt}],
        response_format={
            "type": "json_schema",
            "json_schema": {"name": "person", "schema": PERSON, "strict": True},
        },
        **kw,
    )


def streamed_person(c: openai.OpenAI, prompt: str, started: threading.Event) -> tuple[str, str]:
    """A streamed constrained request: (content, finish reason); `started` is set at its first
    content."""
    parts, finish = [], ""
    stream = person_request(c, prompt, stream=True, temperature=0.8, max_tokens=80)
    for chunk in stream:
        for choice in chunk.choices:
            if choice.delta.content:
                parts.append(choice.delta.content)
                started.set()
            finish = choice.finish_reason or finish
    return "".join(parts), finish


def assert_person(content: str, finish: str) -> None:
    assert finish == "stop", (finish, content)
    jsonschema.validate(json.loads(content), PERSON)


def under_load(
    stack: ComposeStack, count: int, during: Callable[[], None]
) -> list[tuple[str, str]]:
    """`count` concurrent streamed constrained requests; `during` runs once every one of them
    has produced its first content. Their (content, finish reason)."""
    c = client(stack)
    started = [threading.Event() for _ in range(count)]
    with ThreadPoolExecutor(count) as pool:
        futures = [
            pool.submit(streamed_person, c, f"Invent person number {i}.", started[i])
            for i in range(count)
        ]
        for event, future in zip(started, futures, strict=True):
            while not event.wait(1):
                if future.done():
                    future.result()  # raises what the request ran into
                    break
        during()
        return [f.result(timeout=600) for f in futures]


def gateway_of(stack: ComposeStack) -> str:
    [gateway] = stack.containers("gateway")
    return gateway


def cache_use(log: str) -> tuple[int, int]:
    """(graphs loaded from the compile cache, graphs compiled into it) at the worker's last start."""
    found = re.findall(
        r"compile cache \S+: (\d+) graphs loaded from it, (\d+) compiled into it", log
    )
    assert found, "the worker logged no compile-cache use"
    return int(found[-1][0]), int(found[-1][1])


def test_every_service_healthy_and_hardened(stack: ComposeStack) -> None:
    config = compose_config()["services"]
    assert len(stack.containers("grammar")) == 2
    for service in SERVICES:
        for name in stack.containers(service):
            assert stack.healthy(name), stack.tail(name)
            info = stack.inspect(name)
            host = info["HostConfig"]
            assert host["ReadonlyRootfs"] is True
            assert "/tmp" in host["Tmpfs"]
            assert not info["EffectiveCaps"], info["EffectiveCaps"]
            assert "no-new-privileges" in " ".join(host["SecurityOpt"])
            assert info["Config"]["User"] == "10001"
            # The root filesystem refuses writes.
            denied = podman("exec", name, "touch", "/opt/maskwire/x", check=False)
            assert denied.returncode != 0 and "Read-only file system" in denied.stderr
    # A cold worker (a new, empty compile-cache volume) is healthy within its start period.
    start_period = seconds(config["worker"]["healthcheck"]["start_period"])
    assert TIMINGS["worker start, cold compile cache (up -> healthy)"] < start_period


def test_worker_compiled_its_graphs_and_kernels(stack: ComposeStack) -> None:
    """The read-only root leaves the worker what it writes: graphs compiled into the volume,
    its kernels built with the image's compiler, nothing served eager."""
    [worker] = stack.containers("worker")
    log = stack.log(worker)
    loaded, compiled = cache_use(log)
    assert loaded == 0 and compiled > 0
    assert "built the maskwire kernels" in log, log[-3000:]
    assert stack.metric(worker, "maskwire_worker_eager_fallbacks_total", unset=0) == 0


def test_constrained_chat_request(stack: ComposeStack) -> None:
    r = person_request(client(stack), "Describe a fictional person.")
    assert_person(r.choices[0].message.content or "", r.choices[0].finish_reason)


def test_tool_call(stack: ComposeStack) -> None:
    r = client(stack).chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "What is the weather in Paris?"}],
        tools=TOOLS,  # type: ignore[arg-type]
        tool_choice="required",
        temperature=0,
        max_tokens=60,
    )
    calls = r.choices[0].message.tool_calls or []
    assert calls and r.choices[0].finish_reason == "tool_calls"
    for call in calls:
        assert call.function.name == "get_weather"
        jsonschema.validate(json.loads(call.function.arguments), WEATHER)


def test_grammar_replica_killed_under_load(stack: ComposeStack) -> None:
    replicas = stack.containers("grammar")
    killed: list[str] = []

    def kill_the_busiest() -> None:
        busiest = max(replicas, key=lambda n: stack.metric(n, "maskwire_grammar_live_requests"))
        stack.crash(busiest)
        killed.append(busiest)

    for content, finish in under_load(stack, 6, kill_the_busiest):
        assert_person(content, finish)
    [worker] = stack.containers("worker")
    assert "died" in stack.log(worker)
    # `restart: unless-stopped` brings the replica back.
    stack.wait_healthy(killed[0], timeout_s=180)
    r = person_request(client(stack), "Describe a fictional person.")
    assert_person(r.choices[0].message.content or "", r.choices[0].finish_reason)


def test_scaled_grammar_tier_takes_sessions(stack: ComposeStack) -> None:
    stack.scale("grammar", 3)
    replicas = stack.containers("grammar")
    assert len(replicas) == 3
    new = replicas[-1]
    stack.wait_healthy(new, timeout_s=180)
    # The worker resolves the service name every 5 s and places new requests on the
    # least-loaded replica.
    [worker] = stack.containers("worker")
    deadline = time.monotonic() + 60
    while "(now 3)" not in stack.log(worker):
        assert time.monotonic() < deadline, "the worker did not find the third replica"
        time.sleep(1)
    results = under_load(stack, 6, lambda: None)
    for content, finish in results:
        assert_person(content, finish)
    assert stack.metric(new, "maskwire_grammar_cache_lookups_total") > 0


def test_worker_restarts_from_the_volume_cache(stack: ComposeStack) -> None:
    [worker] = stack.containers("worker")
    config = compose_config()["services"]["worker"]
    grace = seconds(config["stop_grace_period"])
    podman("stop", "-t", str(int(grace)), worker, timeout_s=grace + 30)
    assert stack.inspect(worker)["State"]["ExitCode"] == 0
    began = time.monotonic()
    podman("start", worker)
    stack.wait_healthy(
        worker, timeout_s=seconds(config["healthcheck"]["start_period"]), ready=stack.worker_ready
    )
    TIMINGS["worker restart, volume-backed compile cache (start -> healthy)"] = (
        time.monotonic() - began
    )
    stack.wait_healthy(gateway_of(stack), timeout_s=60, ready=stack.gateway_ready)
    # /tmp is a new tmpfs: every graph came from the volume.
    loaded, compiled = cache_use(stack.log(worker))
    assert loaded > 0 and compiled == 0
    r = person_request(client(stack), "Describe a fictional person.")
    assert_person(r.choices[0].message.content or "", r.choices[0].finish_reason)


def test_stack_stops_cleanly(stack: ComposeStack) -> None:
    """A stop sends SIGTERM gateway first, then worker, then grammar replicas: a request in
    flight finishes, and every service exits 0 after its drain (no SIGKILL at the grace)."""
    longest = max(seconds(s["stop_grace_period"]) for s in compose_config()["services"].values())
    stopping: list[float] = []

    def stop() -> None:
        began = time.monotonic()
        stack.compose("stop", "-t", str(int(longest)), timeout_s=5 * longest)
        stopping.append(time.monotonic() - began)

    stopper = threading.Thread(target=stop)
    for content, finish in under_load(stack, 2, stopper.start):
        assert_person(content, finish)
    stopper.join()
    for service in SERVICES:
        for name in stack.containers(service):
            state = stack.inspect(name)["State"]
            assert not state["Running"] and state["ExitCode"] == 0, (name, stack.tail(name))
    TIMINGS["stack stop (drain)"] = stopping[0]
