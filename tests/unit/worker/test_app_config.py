"""Worker flags -> settings: speculation and the compile cache's per-ranges subdirectory."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from neuron_worker.app import draft_config, engine_config, ranges_dir
from neuron_worker.cli import add_arguments
from neuron_worker.graphs import GRAPH_LAYOUT


def parse(*argv: str) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    add_arguments(p)
    return p.parse_args(["--model", "default", *argv])


def test_speculation_is_off_by_default_and_configurable() -> None:
    assert draft_config(parse()) is None
    assert engine_config(parse(), 2048).speculative is None
    spec = draft_config(parse("--speculative", "ngram", "--num-draft-tokens", "3"))
    assert spec is not None and (spec.num_draft_tokens, spec.match) == (3, "text")
    assert (spec.min_n, spec.max_n) == (2, 64)  # bytes of text
    spec = draft_config(
        parse("--speculative", "ngram", "--draft-match", "tokens", "--ngram-max", "2")
    )
    assert spec is not None and (spec.match, spec.min_n, spec.max_n) == ("tokens", 1, 2)
    with pytest.raises(SystemExit, match="n-gram sizes"):
        draft_config(parse("--speculative", "ngram", "--ngram-min", "3", "--ngram-max", "2"))


def test_verification_passes_are_budgeted_on_cpu_only() -> None:
    """A CPU's 4-bit decode kernels cost per 4 rows: more drafts than the batch size lose."""
    spec = draft_config(parse("--speculative", "ngram", "--max-batch-size", "6"))
    assert spec is not None and spec.pass_tokens == 6
    spec = draft_config(parse("--speculative", "ngram", "--device", "cuda"))
    assert spec is not None and spec.pass_tokens == 0
    spec = draft_config(parse("--speculative", "ngram", "--verify-pass-tokens", "20"))
    assert spec is not None and spec.pass_tokens == 20


@pytest.mark.parametrize(
    "argv",
    [
        ("--flat-pass-tokens", "100000"),
        ("--flat-pass-tokens", "-2"),
        ("--verify-pass-tokens", "-5"),
        ("--admit-window-ms", "-1"),
        ("--admit-quiet-ms", "-0.5"),
    ],
)
def test_pass_and_admission_limits_are_checked(argv: tuple[str, str]) -> None:
    with pytest.raises(SystemExit, match=argv[0]):
        engine_config(parse(*argv), 2048)


def test_compile_cache_is_split_by_symbolic_ranges(tmp_path: Path) -> None:
    """Graphs compiled for other size ranges carry guards this worker would refuse."""
    plain = ranges_dir(tmp_path, parse())
    spec = ranges_dir(tmp_path, parse("--speculative", "ngram"))
    wider = ranges_dir(tmp_path, parse("--max-batch-size", "16"))
    flat = ranges_dir(tmp_path, parse("--flat-pass-tokens", "64"))
    assert plain is not None and plain.parent == tmp_path
    assert len({plain, spec, wider, flat}) == 4
    # and by the graphs' layout: the same flags compile other ranges after an upgrade
    assert plain.name.endswith(f"-layout{GRAPH_LAYOUT}")
    assert ranges_dir(None, parse()) is None
