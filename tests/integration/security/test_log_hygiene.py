"""At the default log level no service logs prompts, schemas, grammars or generated text, not even
on error paths (a bad schema's compiler error is the usual leak); external `$ref`s in schemas are
never fetched."""

from __future__ import annotations

import json
import socket
import threading
import time
from collections.abc import Iterator
from typing import Any

import grpc
import openai
import pytest

from maskwire.tls import make_sync_channel
from maskwire.v1 import common_pb2, worker_pb2, worker_pb2_grpc

from .conftest import MODEL, Stack

SECRET = "quokka7731"  # in every prompt, schema and grammar below, nowhere else
PROMPT = f"Tell me about the {SECRET}-zebra expedition."
SCHEMA = {
    "type": "object",
    "description": f"{SECRET}-schema-description",
    "properties": {f"{SECRET}Field": {"type": "string", "enum": [f"{SECRET}-value"]}},
    "required": [f"{SECRET}Field"],
}
BAD_SCHEMA = {"type": f"{SECRET}-not-a-type", "properties": {"x": {"minimum": "zero"}}}


def _chat(stack: Stack, schema: Any, **kw: Any) -> Any:
    return stack.client().chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": PROMPT}],
        response_format={"type": "json_schema", "json_schema": {"name": "s", "schema": schema}},
        temperature=0,
        max_tokens=30,
        **kw,
    )


def _worker_generate(stack: Stack, constraint: common_pb2.Constraint) -> grpc.StatusCode:
    req = worker_pb2.GenerateRequest(
        text=PROMPT,
        sampling=worker_pb2.SamplingParams(temperature=0, max_tokens=8),
        constraint=constraint,
    )
    with make_sync_channel(stack.worker.address, stack.tls_as("gateway", "maskwire-worker")) as ch:
        try:
            for _ in worker_pb2_grpc.WorkerStub(ch).Generate(req, timeout=120):
                pass
        except grpc.RpcError as e:
            return e.code()
    return grpc.StatusCode.OK


def test_no_payload_in_logs_at_info(stack: Stack) -> None:
    ok = _chat(stack, SCHEMA)
    answer = ok.choices[0].message.content
    assert SECRET in answer  # the enum value: generated text carries the secret too
    stream = _chat(stack, SCHEMA, stream=True)
    assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    with pytest.raises(openai.BadRequestError):
        _chat(stack, BAD_SCHEMA)
    # Bad constraints straight to the worker: schema, regex and Lark grammar compile errors.
    bad = [
        common_pb2.Constraint(json_schema=json.dumps(BAD_SCHEMA)),
        common_pb2.Constraint(regex=f"({SECRET}[unclosed"),
        common_pb2.Constraint(lark=f"start: {SECRET}_undefined_rule"),
        common_pb2.Constraint(json_schema=f'{{"type": "{SECRET}'),  # not even JSON
    ]
    for c in bad:
        assert _worker_generate(stack, c) == grpc.StatusCode.INVALID_ARGUMENT, c
    for svc in stack.services():
        log = svc.log_text()
        assert log.strip(), f"{svc.command} wrote no log at all: the check would prove nothing"
        assert SECRET not in log, f"{svc.command} logged request content:\n{log[-3000:]}"


@pytest.fixture
def listener() -> Iterator[tuple[int, list[bytes]]]:
    """A TCP listener on loopback that records every connection it gets."""
    srv = socket.create_server(("127.0.0.1", 0))
    srv.settimeout(0.2)
    seen: list[bytes] = []
    stop = threading.Event()

    def accept() -> None:
        while not stop.is_set():
            try:
                conn, _ = srv.accept()
            except TimeoutError:
                continue
            with conn:
                conn.settimeout(1)
                try:
                    seen.append(conn.recv(4096) or b"(connected)")
                except OSError:
                    seen.append(b"(connected)")

    thread = threading.Thread(target=accept, daemon=True)
    thread.start()
    try:
        yield srv.getsockname()[1], seen
    finally:
        stop.set()
        thread.join()
        srv.close()


def test_external_refs_are_never_fetched(stack: Stack, listener: tuple[int, list[bytes]]) -> None:
    port, seen = listener
    url = f"http://127.0.0.1:{port}/x.json"
    schemas = [
        {"$ref": url},
        {"type": "object", "properties": {"a": {"$ref": f"{url}#/$defs/a"}}, "required": ["a"]},
    ]
    for schema in schemas:
        with pytest.raises(openai.BadRequestError) as e:
            _chat(stack, schema)
        message = e.value.response.json()["error"]["message"]
        assert "x.json" in message and "fetch" in message, message
    code = _worker_generate(stack, common_pb2.Constraint(json_schema=json.dumps({"$ref": url})))
    assert code == grpc.StatusCode.INVALID_ARGUMENT
    assert seen == [], "a schema $ref made a service open a connection"
    # The listener does record connections (so the check above can fail).
    with socket.create_connection(("127.0.0.1", port)) as c:
        c.sendall(b"GET /x.json HTTP/1.0\r\n\r\n")
    deadline = time.monotonic() + 10
    while not seen and time.monotonic() < deadline:
        time.sleep(0.05)
    assert seen and seen[0].startswith(b"GET /x.json")
