"""`maskwire generate` against an in-process fake Worker: requests built, output, errors, exit codes."""

from __future__ import annotations

import argparse
from collections.abc import Iterator
from concurrent import futures
from pathlib import Path

import grpc
import pytest
from grpc_status import rpc_status

from maskwire import generate
from maskwire.cli import main
from maskwire.rpc import status_proto
from maskwire.v1 import common_pb2, worker_pb2, worker_pb2_grpc

CHATML = (
    "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n' + message['content']"
    " + '<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}"
    "{{ '<|im_start|>assistant\n' }}{% endif %}"
)


class FakeWorker(worker_pb2_grpc.WorkerServicer):
    """Answers with scripted chunks; `mode` selects an error path."""

    def __init__(self) -> None:
        self.requests: list[worker_pb2.GenerateRequest] = []
        self.mode = "ok"

    def GetModelInfo(self, request, context):
        return worker_pb2.ModelInfo(model="fake", chat_template=CHATML, eos_token="<|im_end|>")

    def Generate(self, request, context) -> Iterator[worker_pb2.GenerateResponse]:
        self.requests.append(request)
        if self.mode == "bad_schema":
            status = status_proto(
                grpc.StatusCode.INVALID_ARGUMENT,
                "invalid JSON schema",
                [("constraint.json_schema.properties.age.minimum", "must be a number")],
            )
            context.abort_with_status(rpc_status.to_status(status))
        yield worker_pb2.GenerateResponse(token_ids=[1, 2], text='{"a": ')
        if self.mode == "error":
            yield worker_pb2.GenerateResponse(
                finish_reason=worker_pb2.FINISH_REASON_ERROR, error="grammar replica lost"
            )
            return
        yield worker_pb2.GenerateResponse(
            token_ids=[3],
            text="1}",
            finish_reason=worker_pb2.FINISH_REASON_STOP
            if self.mode == "ok"
            else worker_pb2.FINISH_REASON_LENGTH,
            usage=worker_pb2.Usage(prompt_tokens=4, completion_tokens=3, forced_tokens=1),
        )


@pytest.fixture(scope="module")
def worker() -> Iterator[tuple[str, FakeWorker]]:
    fake = FakeWorker()
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
    worker_pb2_grpc.add_WorkerServicer_to_server(fake, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    yield f"127.0.0.1:{port}", fake
    server.stop(None)


@pytest.fixture(autouse=True)
def reset(worker: tuple[str, FakeWorker]) -> None:
    worker[1].mode = "ok"
    worker[1].requests.clear()


def test_choice_request_and_output(worker, capsys) -> None:
    address, fake = worker
    rc = main(
        [
            "generate",
            "--worker",
            address,
            "--choice",
            "yes",
            "--choice",
            "no",
            "--seed",
            "7",
            "--max-tokens",
            "5",
            "--temperature",
            "0.5",
            "Is it?",
        ]
    )
    out, err = capsys.readouterr()
    assert rc == 0
    assert out == '{"a": 1}\n'
    assert "3 tokens (1 forced)" in err and "finish: stop" in err
    req = fake.requests[0]
    assert req.text == "Is it?"
    assert list(req.constraint.choice.choices) == ["yes", "no"]
    assert req.sampling.seed == 7 and req.sampling.max_tokens == 5
    assert req.sampling.temperature == pytest.approx(0.5)


def test_chat_wraps_prompt_in_model_template(worker, capsys) -> None:
    address, fake = worker
    rc = main(
        [
            "generate",
            "--worker",
            address,
            "--chat",
            "--system",
            "Be brief.",
            "--regex",
            "[0-9]+",
            "-q",
            "Count",
        ]
    )
    assert rc == 0
    req = fake.requests[0]
    assert req.text == (
        "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nCount<|im_end|>\n"
        "<|im_start|>assistant\n"
    )
    assert req.constraint.regex == "[0-9]+"
    assert capsys.readouterr().err == ""


def test_stream_prints_chunks(worker, capsys) -> None:
    address, _ = worker
    assert main(["generate", "--worker", address, "--stream", "-q", "hi"]) == 0
    assert capsys.readouterr().out == '{"a": 1}\n'


def test_json_schema_file_and_inline(worker, tmp_path: Path) -> None:
    address, fake = worker
    schema = tmp_path / "s.json"
    schema.write_text('{"type": "object"}')
    assert main(["generate", "--worker", address, "-q", "--json-schema", str(schema), "p"]) == 0
    assert (
        main(
            [
                "generate",
                "--worker",
                address,
                "-q",
                "--json-schema",
                '{"type":"integer"}',
                "--json-whitespace-flexible",
                "p",
            ]
        )
        == 0
    )
    assert fake.requests[0].constraint.json_schema == '{"type": "object"}'
    assert fake.requests[1].constraint.json_schema == '{"type":"integer"}'
    assert fake.requests[1].constraint.json_options.whitespace_flexible


def test_field_violations_in_one_line(worker, capsys) -> None:
    address, fake = worker
    fake.mode = "bad_schema"
    rc = main(["generate", "--worker", address, "--json-schema", "{}", "p"])
    err = capsys.readouterr().err.strip()
    assert rc == 1
    assert "\n" not in err
    assert err.startswith("maskwire generate: INVALID_ARGUMENT: invalid JSON schema")
    assert "constraint.json_schema.properties.age.minimum: must be a number" in err


def test_error_finish_exits_1_and_length_warns(worker, capsys) -> None:
    address, fake = worker
    fake.mode = "error"
    assert main(["generate", "--worker", address, "p"]) == 1
    assert "generation failed: grammar replica lost" in capsys.readouterr().err
    fake.mode = "length"
    assert main(["generate", "--worker", address, "--max-tokens", "3", "p"]) == 0
    assert "stopped at --max-tokens 3" in capsys.readouterr().err


def test_unreachable_worker_says_how_to_start_one(capsys) -> None:
    from tests.support.processes import free_port

    rc = main(["generate", "--worker", f"127.0.0.1:{free_port()}", "--timeout", "20", "p"])
    err = capsys.readouterr().err
    assert rc == 1
    assert "cannot reach a worker" in err and "maskwire up" in err


@pytest.mark.parametrize(
    ("argv", "needle"),
    [
        (["--json-schema", "/does/not/exist.json", "p"], "cannot read /does/not/exist.json"),
        (["--json-schema", "{nope", "p"], "not valid JSON"),
        (["--choice", "", "p"], "must not be empty"),
        (["--system", "x", "p"], "--system needs --chat"),
        (["--max-tokens", "-1", "p"], "--max-tokens must be >= 0"),
    ],
)
def test_usage_errors_exit_2(worker, capsys, argv: list[str], needle: str) -> None:
    address, fake = worker
    assert main(["generate", "--worker", address, *argv]) == 2
    assert needle in capsys.readouterr().err
    assert fake.requests == []


def _constraint(tmp_path: Path, name: str, text: str) -> common_pb2.Constraint:
    path = tmp_path / name
    path.write_text(text)
    parser = argparse.ArgumentParser()
    generate.add_arguments(parser)
    c = generate.build_constraint(parser.parse_args(["--grammar", str(path), "p"]))
    assert c is not None
    return c


def test_grammar_kind_detected(tmp_path: Path) -> None:
    assert _constraint(tmp_path, "g.gbnf", 'x ::= "a"').gbnf
    assert _constraint(tmp_path, "g.txt", 'root ::= "a" | "b"\n').gbnf
    assert _constraint(tmp_path, "g.lark", 'start: "a"\n').lark
    assert _constraint(tmp_path, "g", 'start: "a" | "b"\n').lark


def test_default_worker_matches_up() -> None:
    from maskwire import up

    assert f"127.0.0.1:{up.DEFAULT_WORKER_PORT}" == generate.DEFAULT_WORKER
