"""The worker SIGKILLed while the gateway streams: every open stream ends promptly with an SSE
error event (no hang, no fake `[DONE]`), and new requests get 503 instead of waiting."""

from __future__ import annotations

import json
import signal
import threading
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from tests.support.processes import ServiceProcess, grammar_and_worker, running

MODEL = "SmolLM2-135M-Instruct"
STREAMS = 3


@pytest.fixture(scope="module")
def stack() -> Iterator[tuple[ServiceProcess, ServiceProcess]]:
    with (
        grammar_and_worker() as (_, w),
        running("gateway", ["--worker", w.address, "--health-interval-s", "1"], http=True) as g,
    ):
        yield w, g


def _body(i: int) -> dict[str, Any]:
    body: dict[str, Any] = {
        "model": MODEL,
        "messages": [{"role": "user", "content": f"Tell me a long story number {i}."}],
        "max_tokens": 400,
        "temperature": 0,
        "stream": True,
    }
    if i % 2:  # half of them constrained
        body["structured_outputs"] = {"regex": "[a-z ]{1,2000}"}
    else:
        body["ignore_eos"] = True
    return body


def test_worker_killed_mid_stream(stack: tuple[ServiceProcess, ServiceProcess]) -> None:
    worker, gateway = stack
    url = f"http://{gateway.address}/v1/chat/completions"
    started = threading.Barrier(STREAMS + 1)
    results: list[list[str]] = [[] for _ in range(STREAMS)]
    errors: list[BaseException] = []

    def consume(i: int) -> None:
        try:
            # The read timeout bounds the test: a hung stream fails it instead of blocking.
            with (
                httpx.Client(timeout=httpx.Timeout(30.0)) as client,
                client.stream("POST", url, json=_body(i)) as r,
            ):
                assert r.status_code == 200
                seen = 0
                for line in r.iter_lines():
                    if not line:
                        continue
                    results[i].append(line)
                    seen += 1
                    if seen == 3:
                        started.wait(60)
        except BaseException as e:  # reported by the main thread
            errors.append(e)
            started.abort()

    threads = [threading.Thread(target=consume, args=(i,)) for i in range(STREAMS)]
    for t in threads:
        t.start()
    started.wait(120)  # every stream has produced tokens
    worker.kill(signal.SIGKILL)
    for t in threads:
        t.join(60)
        assert not t.is_alive(), "a stream hung after its worker died"
    assert not errors, errors
    for lines in results:
        assert lines[-1] != "data: [DONE]", "a stream cut short must not end like a success"
        last = json.loads(lines[-1].removeprefix("data: "))
        assert last["error"]["type"] in ("service_unavailable_error", "server_error"), last
        assert last["error"]["message"]
    # New requests: a clear 503 (the worker is gone), not a hang.
    r = httpx.post(url, json={**_body(0), "stream": False}, timeout=30)
    assert r.status_code == 503, r.text
    assert r.json()["error"]["code"] in ("no_worker", "unavailable")
    assert gateway.proc.poll() is None
