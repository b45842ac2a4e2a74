"""The `maskwire up --demo` request: one JSON-schema-constrained chat completion through the gateway."""

from __future__ import annotations

import json
import sys
import threading
import time
from typing import Any

import httpx

from maskwire.signal_flag import SignalFlag, StopFlag

PROMPT = "Describe France: its name, its capital and its population."
SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 40},
        "capital": {"type": "string", "maxLength": 40},
        "population": {"type": "integer", "minimum": 0, "maximum": 2_000_000_000},
    },
    "required": ["name", "capital", "population"],
    "additionalProperties": False,
}
MAX_TOKENS = 120
REQUEST_TIMEOUT_S = 600.0


def model_id(gateway_url: str, timeout_s: float = 10.0) -> str:
    """The first model the gateway lists (`default` if it lists none)."""
    r = httpx.get(f"{gateway_url}/v1/models", timeout=timeout_s)
    r.raise_for_status()
    data = r.json().get("data") or [{}]
    return str(data[0].get("id") or "default")


def schema_errors(value: Any, schema: dict[str, Any]) -> list[str]:
    """Validate with `jsonschema` (dev extra) when installed, else check this demo's flat schema."""
    try:
        import jsonschema
    except ImportError:
        return _flat_object_errors(value, schema)
    validator = jsonschema.Draft202012Validator(schema)
    return [
        f"{'/'.join(map(str, e.path)) or '(root)'}: {e.message}"
        for e in validator.iter_errors(value)
    ]


def _flat_object_errors(value: Any, schema: dict[str, Any]) -> list[str]:
    # Enough for SCHEMA: an object of strings and non-negative integers, nothing extra.
    if not isinstance(value, dict):
        return ["(root): not an object"]
    props: dict[str, dict[str, Any]] = schema["properties"]
    errors = [f"{k}: missing" for k in schema.get("required", []) if k not in value]
    errors += [f"{k}: not allowed" for k in value if k not in props]
    for k, sub in props.items():
        if k not in value:
            continue
        v = value[k]
        if sub["type"] == "string" and not isinstance(v, str):
            errors.append(f"{k}: not a string")
        elif sub["type"] == "string" and len(v) > sub.get("maxLength", len(v)):
            errors.append(f"{k}: longer than {sub['maxLength']}")
        elif sub["type"] == "integer" and (isinstance(v, bool) or not isinstance(v, int)):
            errors.append(f"{k}: not an integer")
        elif sub["type"] == "integer" and v < sub.get("minimum", v):
            errors.append(f"{k}: below {sub['minimum']}")
    return errors


def _post(url: str, body: dict[str, Any], out: dict[str, Any]) -> None:
    try:
        out["response"] = httpx.post(url, json=body, timeout=REQUEST_TIMEOUT_S)
    except httpx.HTTPError as e:
        out["error"] = e


def run_demo(gateway_url: str, stop: StopFlag | None = None) -> int:
    """Send the demo request, print prompt, schema and the validated answer; 0 when valid."""
    stop = stop or SignalFlag()
    model = model_id(gateway_url)
    body = {
        "model": model,
        "messages": [{"role": "user", "content": PROMPT}],
        "temperature": 0,
        "max_tokens": MAX_TOKENS,
        "response_format": {
            "type": "json_schema",
            "json_schema": {"name": "country", "schema": SCHEMA, "strict": True},
        },
    }
    print("Demo: one chat request through the gateway, constrained by a JSON schema.")
    print(f"  model   {model}")
    print(f"  prompt  {PROMPT}")
    print(f"  schema  {json.dumps(SCHEMA)}")
    print("  sending POST /v1/chat/completions ...", flush=True)
    out: dict[str, Any] = {}
    t0 = time.monotonic()
    sender = threading.Thread(target=_post, args=(f"{gateway_url}/v1/chat/completions", body, out))
    sender.daemon = True
    sender.start()
    while sender.is_alive():
        if stop.wait(0.2):
            print("demo interrupted", file=sys.stderr)
            return 130
    elapsed = time.monotonic() - t0
    if "error" in out:
        print(f"demo failed: no answer from the gateway: {out['error']}", file=sys.stderr)
        return 1
    response: httpx.Response = out["response"]
    if response.status_code != 200:
        print(
            f"demo failed: gateway answered HTTP {response.status_code}: {_error_text(response)}",
            file=sys.stderr,
        )
        return 1
    payload = response.json()
    choice = payload["choices"][0]
    text = choice["message"].get("content") or ""
    usage = payload.get("usage") or {}
    print(f"  answer  {text}")
    print(
        f"          ({usage.get('completion_tokens', '?')} tokens in {elapsed:.1f}s, "
        f"finish_reason={choice.get('finish_reason')})"
    )
    if choice.get("finish_reason") == "length":
        print(
            f"demo failed: the model used all {MAX_TOKENS} tokens before closing the JSON",
            file=sys.stderr,
        )
        return 1
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        print(f"demo failed: the answer is not JSON ({e})", file=sys.stderr)
        return 1
    errors = schema_errors(value, SCHEMA)
    if errors:
        print(f"demo failed: the answer breaks the schema: {'; '.join(errors)}", file=sys.stderr)
        return 1
    print("  valid   yes: the answer matches the schema")
    print("\nRun `maskwire up` to keep the services running and send your own requests.")
    return 0


def _error_text(response: httpx.Response) -> str:
    try:
        err = response.json().get("error", {})
        return str(err.get("message") or response.text)
    except (ValueError, AttributeError):
        return response.text[:500]
