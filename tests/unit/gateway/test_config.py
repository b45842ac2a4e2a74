"""Gateway flags -> `GatewayConfig`: defaults defined once, every bad flag refused by name."""

from __future__ import annotations

import argparse
from dataclasses import replace
from pathlib import Path

import pytest

from gateway.cli import add_arguments
from gateway.config import GatewayConfig, gateway_config
from maskwire.config import ConfigError

WORKER = ("--worker", "127.0.0.1:50051")  # never dialled: only the flags are built


def parse(*argv: str) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    add_arguments(p)
    return p.parse_args(list(argv))


def test_every_flag_default_is_the_configurations_default(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv("MASKWIRE_API_KEYS", raising=False)
    config = gateway_config(parse(*WORKER))
    assert config == GatewayConfig(workers=(WORKER[1],))


def test_flags_are_read_into_the_configuration(tmp_path: Path) -> None:
    template = tmp_path / "t.jinja"
    template.write_text("{% for m in messages %}{{ m.content }}{% endfor %}")
    config = gateway_config(
        parse(
            "--worker", "127.0.0.1:1,127.0.0.1:2", "--worker", "127.0.0.1:1",
            "--chat-template", str(template), "--max-n", "2", "--api-key", "k1",
        )
    )  # fmt: skip
    assert config.workers == ("127.0.0.1:1", "127.0.0.1:2")
    assert config.chat_template == template.read_text()
    assert config.max_n == 2 and "k1" in config.api_keys
    assert replace(config, max_n=3).max_n == 3  # frozen: changed only by a copy


@pytest.mark.parametrize(
    ("argv", "flag"),
    [
        (("--max-body-bytes", "0"), "--max-body-bytes"),
        (("--max-concurrency", "0"), "--max-concurrency"),
        (("--max-prompt-bytes", "0"), "--max-prompt-bytes"),
        (("--max-json-depth", "0"), "--max-json-depth"),
        (("--max-n", "0"), "--max-n"),
        (("--request-timeout-s", "0"), "--request-timeout-s"),
        (("--health-interval-s", "-1"), "--health-interval-s"),
        (("--health-timeout-s", "0"), "--health-timeout-s"),
        (("--worker-dns-refresh-s", "0"), "--worker-dns-refresh-s"),
        (("--max-concurrency-per-key", "-1"), "--max-concurrency-per-key"),
        (("--port", "70000"), "--port"),
        (("--chat-template", "/nonexistent/t.jinja"), "--chat-template"),
        (("--api-key", "has space"), "--api-key"),
        (("--api-key-file", "/nonexistent/keys"), "--api-key-file"),
        (("--worker-tls-ca", "/nonexistent/ca.pem"), "--worker-tls-ca"),
    ],
)
def test_each_bad_flag_is_refused_by_name(argv: tuple[str, ...], flag: str) -> None:
    with pytest.raises(ConfigError, match=flag):
        gateway_config(parse(*WORKER, *argv))


def test_a_bad_worker_target_is_refused_by_name() -> None:
    with pytest.raises(ConfigError, match="--worker"):
        gateway_config(parse("--worker", "no-port"))


def test_a_template_that_does_not_render_is_refused(tmp_path: Path) -> None:
    bad = tmp_path / "bad.jinja"
    bad.write_text("{% for m in messages %}")
    with pytest.raises(ConfigError, match="--chat-template"):
        gateway_config(parse(*WORKER, "--chat-template", str(bad)))
