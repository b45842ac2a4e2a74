"""Grammar service flags -> `ServiceConfig`: defaults defined once, bad flags refused by name."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from grammar_service.cli import add_arguments
from grammar_service.config import (
    CompileSettings,
    ConstraintBounds,
    Limits,
    ParserLimits,
    ProcessSettings,
    SandboxConfig,
    service_config,
)
from maskwire.config import ConfigError


def parse(*argv: str) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    add_arguments(p)
    return p.parse_args(list(argv))


def test_every_flag_default_is_the_configurations_default() -> None:
    """No flag restates a default: each reads it from the configuration's field."""
    config = service_config(parse("--port", "0"))  # a free port: no state directory
    assert config.tokenizers == ("default",)
    assert config.parser_limits == ParserLimits()
    assert config.bounds == ConstraintBounds()
    assert config.compile == CompileSettings()
    assert config.sandbox == SandboxConfig()
    assert config.limits == Limits()
    assert config.process == ProcessSettings()
    assert (config.server.port, config.server.drain_grace_s) == (0, 5.0)


def test_flags_are_read_into_the_configuration(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("XDG_STATE_HOME", str(tmp_path))
    config = service_config(
        parse(
            "--tokenizer", "a.json", "--tokenizer", "b.json", "--no-compile-sandbox",
            "--max-request-step-ms", "5", "--max-items-in-row", "7", "--schema-mode", "strict",
        )
    )  # fmt: skip
    assert config.tokenizers == ("a.json", "b.json")
    assert config.sandbox is None
    assert config.limits.max_request_step_s == 0.005
    assert config.parser_limits.max_items_in_row == 7
    assert config.compile.schema_mode == "strict"
    # the poison list survives restarts in a directory per port
    assert config.compile.state_dir == tmp_path / "maskwire" / "grammar-service-50061"
    assert service_config(parse("--state-dir", "/x")).compile.state_dir == Path("/x")


@pytest.mark.parametrize(
    ("argv", "flag"),
    [
        (("--max-requests", "0"), "--max-requests"),
        (("--max-requests-per-stream", "0"), "--max-requests-per-stream"),
        (("--max-rows-per-step", "0"), "--max-rows-per-step"),
        (("--max-drafts-per-row", "-1"), "--max-drafts-per-row"),
        (("--compact-min-rows", "-1"), "--compact-min-rows"),
        (("--max-request-step-ms", "0"), "--max-request-step-ms"),
        (("--max-replay-ms", "-1"), "--max-replay-ms"),
        (("--compile-threads", "0"), "--compile-threads"),
        (("--compile-timeout-s", "0"), "--compile-timeout-s"),
        (("--max-schema-bytes", "0"), "--max-schema-bytes"),
        (("--compile-cache-size", "-1"), "--compile-cache-size"),
        (("--compile-cache-bytes", "-1"), "--compile-cache-bytes"),
        (("--poison-ttl-s", "-1"), "--poison-ttl-s"),
        (("--compile-workers", "0"), "--compile-workers"),
        (("--compile-memory-mb", "-1"), "--compile-memory-mb"),
        (("--compile-stack-mb", "0"), "--compile-stack-mb"),
        (("--compile-large-bytes", "-1"), "--compile-large-bytes"),
        (("--mask-threads", "-1"), "--mask-threads"),
        (("--thread-stack-mb", "0"), "--thread-stack-mb"),
        (("--max-message-bytes", "0"), "--max-message-bytes"),
        (("--max-schema-depth", "0"), "--max-schema-depth"),
        (("--max-choices", "0"), "--max-choices"),
        (("--step-lexer-fuel", "0"), "--step-lexer-fuel"),
        (("--port", "-1"), "--port"),
        (("--health-port", "65536"), "--health-port"),
        (("--tls-key", "/nonexistent/key.pem"), "--tls-cert"),
    ],
)
def test_each_bad_flag_is_refused_by_name(argv: tuple[str, ...], flag: str) -> None:
    with pytest.raises(ConfigError, match=flag):
        service_config(parse(*argv))
