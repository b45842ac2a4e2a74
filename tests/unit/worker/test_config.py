"""Worker flags -> `WorkerConfig`: defaults defined once, every bad flag refused by name."""

from __future__ import annotations

import argparse
import logging
from dataclasses import replace

import pytest

from maskwire.config import ConfigError
from neuron_worker.cli import add_arguments
from neuron_worker.config import (
    GrammarSettings,
    ModelSettings,
    PromptLimits,
    WorkerConfig,
    fit_context,
    worker_config,
)
from neuron_worker.drafter import DraftConfig
from neuron_worker.engine_config import EngineConfig

GRAMMAR = ("--grammar-service", "127.0.0.1:50061")  # never dialled: only the flags are built


def parse(*argv: str) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    add_arguments(p)
    return p.parse_args(list(argv))


def build(*argv: str) -> WorkerConfig:
    return worker_config(parse(*GRAMMAR, *argv))


def test_every_flag_default_is_the_configurations_default() -> None:
    """No flag restates a default: each reads it from the configuration's field."""
    config = build()
    # --device cpu resolves these three: dynamic shapes, no overlap of the grammar round trip,
    # and n-gram speculation with passes budgeted to the batch size
    assert config.engine == replace(
        EngineConfig(),
        bucketed=False,
        overlap=False,
        speculative=replace(DraftConfig(), pass_tokens=EngineConfig().max_batch),
    )
    assert config.engine.admit_window_s == 0.020  # the flag's 20 ms, not "admit at once"
    assert config.model == ModelSettings()
    assert config.prompts == PromptLimits()
    assert config.grammar == replace(GrammarSettings(), targets=GRAMMAR[1])
    spec = build("--speculative", "ngram").engine.speculative
    # --verify-pass-tokens resolves to the batch size on a CPU
    assert spec == replace(DraftConfig(), pass_tokens=EngineConfig().max_batch)
    assert config.server.port == 50051 and config.server.tls_mode == "plaintext"


def test_the_fused_decode_step_is_on_by_default_and_can_be_turned_off() -> None:
    assert build().engine.fused_decode
    assert not build("--no-fused-decode").engine.fused_decode


def test_the_prefix_cache_keeps_slots_beyond_the_batch() -> None:
    assert build().engine.kv_slots == 16  # 8 running + 8 that only keep prompts
    assert build("--max-batch-size", "3", "--prefix-cache-slots", "5").engine.kv_slots == 8
    assert build("--prefix-cache-slots", "0").engine.kv_slots == 8
    assert build("--no-prefix-cache").engine.kv_slots == 8  # nothing to keep


def test_structured_outputs_off_needs_no_grammar_service() -> None:
    config = worker_config(parse("--disable-structured-outputs"))
    assert config.grammar is None and not config.engine.structured_outputs


def test_speculation_is_ngram_on_cpu_by_default_and_configurable() -> None:
    assert build().engine.speculative is not None
    assert build("--speculative", "none").engine.speculative is None
    assert build("--device", "cuda").engine.speculative is None
    assert build("--device", "xla", "--no-compile").engine.speculative is None
    assert build("--device", "cuda", "--speculative", "ngram").engine.speculative is not None
    spec = build("--speculative", "ngram", "--num-draft-tokens", "3").engine.speculative
    assert spec is not None and (spec.num_draft_tokens, spec.match) == (3, "text")
    assert (spec.min_n, spec.max_n) == (2, 64)  # bytes of text
    spec = build(
        "--speculative", "ngram", "--draft-match", "tokens", "--ngram-max", "2"
    ).engine.speculative
    assert spec is not None and (spec.match, spec.min_n, spec.max_n) == ("tokens", 1, 2)


def test_verification_passes_are_budgeted_on_cpu_only() -> None:
    """A CPU's 4-bit decode kernels cost per 4 rows: more drafts than the batch size lose."""

    def pass_tokens(*argv: str) -> int:
        spec = build("--speculative", "ngram", *argv).engine.speculative
        assert spec is not None
        return spec.pass_tokens

    assert pass_tokens("--max-batch-size", "6") == 6
    assert pass_tokens("--device", "cuda") == 0
    assert pass_tokens("--verify-pass-tokens", "20") == 20


def test_the_drafting_pause_is_a_flag() -> None:
    for argv, pause in (((), 4), (("--draft-pause-declines", "0"), 0)):
        spec = build("--speculative", "ngram", *argv).engine.speculative
        assert spec is not None and spec.pause_declines == pause


def test_buckets_and_limits_are_resolved() -> None:
    config = build(
        "--max-batch-size", "6", "--batch-buckets", "2,4,16", "--token-buckets", "8,3",
        "--admit-window-ms", "5", "--flat-pass-tokens", "0", "--max-seq-len", "1000",
    )  # fmt: skip
    engine = config.engine
    assert engine.batch_buckets == (2, 4, 6)  # capped at the batch size, which is one
    assert engine.seq_buckets == (128, 256, 512, 1000)
    assert engine.token_buckets == (1, 3, 8, 1000)  # 1 always: a decode step
    assert (engine.admit_window_s, engine.flat_tokens) == (0.005, 0)
    assert config.prompts.prompt_tokens(engine) == 999
    assert build("--max-prompt-tokens", "10").prompts.prompt_tokens(engine) == 10
    assert build("--device", "xla", "--no-compile").engine.bucketed


def test_the_context_is_fitted_to_the_models(caplog: pytest.LogCaptureFixture) -> None:
    engine = build("--token-buckets", "4,600").engine
    with caplog.at_level(logging.WARNING, logger="neuron_worker.config"):
        fitted = fit_context(engine, 512)
    assert "--max-seq-len 2048 exceeds the model's 512; using 512" in caplog.text
    assert fitted.max_seq_len == 512
    assert fitted.seq_buckets == (128, 256, 512)
    assert fitted.token_buckets == (1, 4, 512)
    assert fit_context(engine, 8192) is engine
    assert fit_context(build().engine, 512).token_buckets == ()  # still "powers of two"


@pytest.mark.parametrize(
    ("argv", "flag"),
    [
        (("--max-batch-size", "0"), "--max-batch-size"),
        (("--max-seq-len", "1"), "--max-seq-len"),
        (("--max-queue", "-1"), "--max-queue"),
        (("--max-prefill-tokens", "-1"), "--max-prefill-tokens"),
        (("--max-prompt-tokens", "-1"), "--max-prompt-tokens"),
        (("--max-prompt-bytes", "0"), "--max-prompt-bytes"),
        (("--tokenizer-threads", "0"), "--tokenizer-threads"),
        (("--flat-pass-tokens", "100000"), "--flat-pass-tokens"),
        (("--flat-pass-tokens", "-2"), "--flat-pass-tokens"),
        (("--verify-pass-tokens", "-5"), "--verify-pass-tokens"),
        (("--admit-window-ms", "-1"), "--admit-window-ms"),
        (("--admit-quiet-ms", "-0.5"), "--admit-quiet-ms"),
        (("--prefix-cache-slots", "-1"), "--prefix-cache-slots"),
        (("--prefix-refresh-tokens", "-1"), "--prefix-refresh-tokens"),
        (("--prefix-refresh-idle-ms", "-1"), "--prefix-refresh-idle-ms"),
        (("--batch-buckets", "0,4"), "--batch-buckets"),
        (("--seq-buckets", "128,x"), "--seq-buckets"),
        (("--token-buckets", "-3"), "--token-buckets"),
        (("--speculative", "ngram", "--num-draft-tokens", "0"), "--num-draft-tokens"),
        (("--speculative", "ngram", "--forced-draft-tokens", "-1"), "--forced-draft-tokens"),
        (("--speculative", "ngram", "--draft-pause-declines", "-1"), "--draft-pause-declines"),
        (("--speculative", "ngram", "--ngram-min", "3", "--ngram-max", "2"), "--ngram-min"),
        (("--speculative", "ngram", "--ngram-min", "0"), "--ngram-min"),
        (("--tensor-parallel-size", "0"), "--tensor-parallel-size"),
        (("--tensor-parallel-timeout-s", "0"), "--tensor-parallel-timeout-s"),
        (("--threads", "-1"), "--threads"),
        (("--grammar-timeout-s", "0"), "--grammar-timeout-s"),
        (("--grammar-open-timeout-s", "-1"), "--grammar-open-timeout-s"),
        (("--grammar-dns-refresh-s", "0"), "--grammar-dns-refresh-s"),
        (("--grammar-poison-after", "0"), "--grammar-poison-after"),
        (("--grammar-tls-ca", "/nonexistent/ca.pem"), "--grammar-tls-ca"),
        (("--tls-cert", "/nonexistent/cert.pem"), "--tls-cert"),
        (("--port", "70000"), "--port"),
        (("--metrics-port", "-1"), "--metrics-port"),
        (("--drain-grace-s", "-1"), "--drain-grace-s"),
        (("--quantize", "int8", "--device", "cuda"), "--quantize"),
        (("--cuda-graphs",), "--cuda-graphs"),
        (("--tensor-parallel-size", "2", "--compile"), "--compile"),
    ],
)
def test_each_bad_flag_is_refused_by_name(argv: tuple[str, ...], flag: str) -> None:
    with pytest.raises(ConfigError, match=flag):
        build(*argv)


@pytest.mark.parametrize("targets", ["", "no-port", "127.0.0.1:99999"])
def test_structured_outputs_need_a_grammar_service(targets: str) -> None:
    with pytest.raises(ConfigError, match="--grammar-service"):
        worker_config(parse("--grammar-service", targets))
