"""Gateway API keys (401 matrix) and per-key concurrency (429), with the `openai` client against
the in-process fake worker."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pytest
from fastapi.testclient import TestClient

from gateway.app import GatewayConfig, create_app
from gateway.auth import ENV_VAR, KeyConfigError, load_keys
from maskwire.v1 import worker_pb2
from tests.unit.gateway.fake_worker import MODEL, FakeWorkerServer, Reply

USER: Any = [{"role": "user", "content": "hi"}]
KEY_A = "sk-maskwire-a-0123456789"
KEY_B = "sk-maskwire-b-9876543210"


@pytest.fixture(scope="module")
def fake() -> Iterator[FakeWorkerServer]:
    with FakeWorkerServer() as fw:
        yield fw


@pytest.fixture(autouse=True)
def _reset(fake: FakeWorkerServer) -> None:
    fake.worker.reply = lambda _: Reply()


def gateway(fake: FakeWorkerServer, **kw: Any) -> TestClient:
    config = GatewayConfig(workers=[fake.address], health_interval_s=0.5, **kw)
    return TestClient(create_app(config), raise_server_exceptions=False)


def sdk(tc: TestClient, key: str) -> openai.OpenAI:
    return openai.OpenAI(
        base_url="http://testserver/v1", api_key=key, http_client=tc, max_retries=0
    )


@pytest.fixture(scope="module")
def secured(fake: FakeWorkerServer) -> Iterator[TestClient]:
    with gateway(fake, api_keys=(KEY_A, KEY_B)) as tc:
        yield tc


def _assert_invalid_key(body: Any) -> None:
    err = body["error"]
    assert err["type"] == "invalid_request_error"
    assert err["code"] == "invalid_api_key"
    assert err["param"] is None and "API key" in err["message"]


def test_without_keys_the_api_is_open(fake: FakeWorkerServer) -> None:
    with gateway(fake) as tc:
        assert tc.post("/v1/chat/completions", json={"model": MODEL, "messages": USER}).is_success
        assert sdk(tc, "anything").models.list().data[0].id == MODEL


def test_valid_keys_are_accepted(secured: TestClient) -> None:
    for key in (KEY_A, KEY_B):
        r = sdk(secured, key).chat.completions.create(model=MODEL, messages=USER)
        assert r.choices[0].message.content == "Hello world"
        assert sdk(secured, key).models.retrieve(MODEL).id == MODEL


def test_wrong_key_is_401_in_openai_shape(secured: TestClient, fake: FakeWorkerServer) -> None:
    before = len(fake.worker.requests)
    for key in ("sk-wrong", KEY_A + "x", KEY_A[:-1], f"{KEY_A} {KEY_B}"):
        with pytest.raises(openai.AuthenticationError) as e:
            sdk(secured, key).chat.completions.create(model=MODEL, messages=USER)
        assert e.value.status_code == 401
        _assert_invalid_key(e.value.response.json())
    assert len(fake.worker.requests) == before, "a refused request must not reach a worker"


@pytest.mark.parametrize(
    "headers",
    [
        {},
        {"Authorization": KEY_A},  # no scheme
        {"Authorization": f"Basic {KEY_A}"},
        {"Authorization": "Bearer"},
        {"Authorization": "Bearer \u00e9t\u00e9".encode()},  # non-ASCII must not crash the compare
    ],
)
def test_missing_or_malformed_authorization_is_401(
    secured: TestClient, headers: dict[str, Any]
) -> None:
    for method, path in (
        ("POST", "/v1/chat/completions"),
        ("POST", "/v1/completions"),
        ("GET", "/v1/models"),
        ("GET", f"/v1/models/{MODEL}"),
        ("GET", "/v1/no-such-route"),  # no route enumeration without a key
    ):
        r = secured.request(
            method, path, headers=headers, json={"model": MODEL, "messages": USER, "prompt": "x"}
        )
        assert r.status_code == 401, (path, headers)
        assert r.headers["www-authenticate"] == "Bearer"
        _assert_invalid_key(r.json())


def test_scheme_is_case_insensitive(secured: TestClient) -> None:
    r = secured.get("/v1/models", headers={"Authorization": f"bearer {KEY_B}"})
    assert r.status_code == 200


def test_operations_routes_stay_open(secured: TestClient) -> None:
    assert secured.get("/health").status_code == 200
    # Open, not merely "not 401": the worker is up, so readiness is 200 without a key.
    ready = secured.get("/ready")
    assert ready.status_code == 200 and ready.json()["status"] == "ok", ready.text
    assert secured.get("/v1/models").status_code == 401
    metrics = secured.get("/metrics")
    assert metrics.status_code == 200
    assert 'maskwire_gateway_rejected_total{reason="unauthenticated"}' in metrics.text


def test_unauthenticated_oversized_body_is_401_not_413(fake: FakeWorkerServer) -> None:
    with gateway(fake, api_keys=(KEY_A,), max_body_bytes=200) as tc:
        big = {"model": MODEL, "messages": USER * 50}
        assert tc.post("/v1/chat/completions", json=big).status_code == 401
        r = tc.post("/v1/chat/completions", json=big, headers={"Authorization": f"Bearer {KEY_A}"})
        assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large"
        # By Content-Length and while reading a body sent without one (chunked).
        chunks = iter([b'{"model": "x", "messages": [' + b" " * 300, b"]}"])
        r = tc.post("/v1/completions", content=chunks, headers={"Authorization": f"Bearer {KEY_A}"})
        assert r.status_code == 413


def _hold(fake: FakeWorkerServer) -> threading.Event:
    """Make the fake worker block every Generate until the returned event is set."""
    gate = threading.Event()

    def slow(_: worker_pb2.GenerateRequest) -> Reply:
        gate.wait(10)
        return Reply()

    fake.worker.reply = slow
    return gate


def _wait_for(predicate: Any) -> None:
    deadline = time.monotonic() + 10
    while not predicate():
        assert time.monotonic() < deadline, "timed out waiting for the held request"
        time.sleep(0.02)


def test_per_key_concurrency_is_429(fake: FakeWorkerServer) -> None:
    with gateway(fake, api_keys=(KEY_A, KEY_B), max_concurrency_per_key=1) as tc:
        gate = _hold(fake)
        before = len(fake.worker.requests)
        first = threading.Thread(
            target=lambda: sdk(tc, KEY_A).chat.completions.create(model=MODEL, messages=USER)
        )
        first.start()
        try:
            _wait_for(lambda: len(fake.worker.requests) > before)
            with pytest.raises(openai.RateLimitError) as e:
                sdk(tc, KEY_A).completions.create(model=MODEL, prompt="x")
            err = e.value.response.json()["error"]
            assert err["code"] == "rate_limit_exceeded" and "API key" in err["message"]
            # Another key is not held back, and reads are not counted.
            assert sdk(tc, KEY_A).models.list().data
            fake.worker.reply = lambda _: Reply()
            other = sdk(tc, KEY_B).chat.completions.create(model=MODEL, messages=USER)
            assert other.choices[0].message.content == "Hello world"
        finally:
            gate.set()
            first.join()
        assert sdk(tc, KEY_A).chat.completions.create(model=MODEL, messages=USER).choices
        assert 'reason="key_concurrency"' in tc.get("/metrics").text


def test_a_stream_holds_its_key_slot_until_it_ends(fake: FakeWorkerServer) -> None:
    fake.worker.reply = lambda _: Reply(chunks=["a", "b", "c"])
    with gateway(fake, api_keys=(KEY_A,), max_concurrency_per_key=1) as tc:
        stream = sdk(tc, KEY_A).chat.completions.create(
            model=MODEL,
            messages=USER,
            stream=True,
        )
        first = next(iter(stream))
        assert first.choices[0].delta.role == "assistant"
        with pytest.raises(openai.RateLimitError):
            sdk(tc, KEY_A).chat.completions.create(model=MODEL, messages=USER)
        rest = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
        assert rest == "abc"
        stream.close()
        assert sdk(tc, KEY_A).chat.completions.create(model=MODEL, messages=USER).choices


def test_each_choice_counts_against_the_key(fake: FakeWorkerServer) -> None:
    """`n` choices hold `n` worker batch slots, so they take `n` of the key's places: one key
    cannot take a worker's slots with few requests of many choices."""
    with gateway(fake, api_keys=(KEY_A, KEY_B), max_concurrency_per_key=4) as tc:
        gate = _hold(fake)
        before = len(fake.worker.requests)
        held = threading.Thread(
            target=lambda: sdk(tc, KEY_A).chat.completions.create(model=MODEL, messages=USER, n=3)
        )
        held.start()
        try:
            _wait_for(lambda: len(fake.worker.requests) > before)
            asked = len(fake.worker.requests)
            with pytest.raises(openai.RateLimitError) as e:  # 3 held + 2 > 4
                sdk(tc, KEY_A).chat.completions.create(model=MODEL, messages=USER, n=2)
            assert "counts `n`" in e.value.response.json()["error"]["message"]
            assert len(fake.worker.requests) == asked  # refused before reaching a worker
            fake.worker.reply = lambda _: Reply()
            assert sdk(tc, KEY_A).chat.completions.create(model=MODEL, messages=USER).choices
            other = sdk(tc, KEY_B).chat.completions.create(model=MODEL, messages=USER, n=4)
            assert len(other.choices) == 4
        finally:
            gate.set()
            held.join()
        # Every place was given back: the key can hold its whole share again.
        assert (
            len(sdk(tc, KEY_A).chat.completions.create(model=MODEL, messages=USER, n=4).choices)
            == 4
        )


# ------------------------------------------------------------------------------ key loading
def test_each_key_has_its_own_prefix_cache(secured: TestClient, fake: FakeWorkerServer) -> None:
    """The worker sees a cache salt per API key, ahead of the request's own: one tenant's
    requests never reuse (or time) another's cached prompts."""
    salts = []
    for key, extra in ((KEY_A, {}), (KEY_B, {}), (KEY_A, {"cache_salt": "team-1"})):
        sdk(secured, key).chat.completions.create(model=MODEL, messages=USER, extra_body=extra)
        salts.append(fake.worker.requests[-1].cache_salt)
    sdk(secured, KEY_B).completions.create(model=MODEL, prompt="hi")
    salts.append(fake.worker.requests[-1].cache_salt)
    assert salts == ["key0:", "key1:", "key0:team-1", "key1:"]


def test_without_keys_the_request_salt_is_passed_as_is(fake: FakeWorkerServer) -> None:
    with gateway(fake) as tc:
        body = {"model": MODEL, "messages": USER}
        assert tc.post("/v1/chat/completions", json=body).is_success
        assert fake.worker.requests[-1].cache_salt == ""
        assert tc.post("/v1/chat/completions", json={**body, "cache_salt": "t"}).is_success
        assert fake.worker.requests[-1].cache_salt == "t"
        r = tc.post("/v1/chat/completions", json={**body, "cache_salt": "x" * 201})
        assert r.status_code == 422 and "cache_salt" in r.text


def test_load_keys_from_flags_files_and_env(tmp_path: Path) -> None:
    f = tmp_path / "keys"
    f.write_text(f"# gateway keys\n{KEY_A}\n\n  {KEY_B}  \n")
    assert load_keys(["k1", KEY_A], [str(f)], env="e1, e2 k1") == ["k1", KEY_A, KEY_B, "e1", "e2"]
    assert load_keys([], [], env="") == []


def test_load_keys_reads_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(ENV_VAR, f"{KEY_A},{KEY_B}")
    assert load_keys([], []) == [KEY_A, KEY_B]


def test_load_keys_errors(tmp_path: Path) -> None:
    with pytest.raises(KeyConfigError, match=r"--api-key-file .*nope"):
        load_keys([], [str(tmp_path / "nope")], env="")
    bad = tmp_path / "bad"
    bad.write_text("ok\nwith space\n")
    with pytest.raises(KeyConfigError, match=r"bad:2: an API key must be printable ASCII"):
        load_keys([], [str(bad)], env="")
    with pytest.raises(KeyConfigError, match="--api-key"):
        load_keys(["caf\u00e9"], [], env="")
