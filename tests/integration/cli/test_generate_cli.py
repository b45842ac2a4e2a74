"""`maskwire generate` as a user runs it, against a real worker and grammar service."""

from __future__ import annotations

import json
import subprocess
import sys

from tests.support.processes import ROOT, ServiceProcess


def generate(worker: ServiceProcess, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "maskwire.cli", "generate", "--worker", worker.address, *args],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=300,
    )


def test_choice_with_chat_template(worker: ServiceProcess) -> None:
    r = generate(worker, "--chat", "--choice", "yes", "--choice", "no", "Is Paris in France?")
    assert r.returncode == 0, r.stderr
    assert r.stdout in ("yes\n", "no\n")
    assert "finish: stop" in r.stderr


def test_json_schema_stream_is_valid_json(worker: ServiceProcess) -> None:
    schema = {
        "type": "object",
        "properties": {
            "name": {"type": "string", "maxLength": 30},
            "age": {"type": "integer", "minimum": 0, "maximum": 150},
        },
        "required": ["name", "age"],
        "additionalProperties": False,
    }
    r = generate(
        worker,
        "--chat",
        "--stream",
        "--json-schema",
        json.dumps(schema),
        "--max-tokens",
        "64",
        "Invent a person with a name and an age.",
    )
    assert r.returncode == 0, r.stderr
    value = json.loads(r.stdout)
    assert set(value) == {"name", "age"}
    assert isinstance(value["name"], str) and len(value["name"]) <= 30
    assert isinstance(value["age"], int) and 0 <= value["age"] <= 150


def test_regex_and_seeded_sampling(worker: ServiceProcess) -> None:
    args = ["--regex", "[0-9]{3}-[0-9]{4}", "--temperature", "1.0", "--seed", "11", "Phone: "]
    first = generate(worker, *args)
    second = generate(worker, *args)
    assert first.returncode == 0, first.stderr
    assert len(first.stdout.strip()) == 8 and first.stdout[3] == "-"
    assert first.stdout == second.stdout  # same seed, same output


def test_bad_schema_is_one_clear_line(worker: ServiceProcess) -> None:
    r = generate(
        worker, "--json-schema", '{"type": "object", "properties": {"a": {"type": 5}}}', "x"
    )
    assert r.returncode == 1
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1, r.stderr
    assert lines[0].startswith("maskwire generate: INVALID_ARGUMENT: ")
    assert r.stdout == ""
