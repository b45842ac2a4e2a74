"""maskwire.text.truncate_echo: bounded, encodable echoes of client input."""

from __future__ import annotations

from maskwire.text import truncate_echo


def test_short_text_is_unchanged() -> None:
    assert truncate_echo("gpt-4o", 256) == "gpt-4o"
    assert truncate_echo("x" * 256, 256) == "x" * 256


def test_long_text_is_cut_to_the_limit_with_its_length() -> None:
    out = truncate_echo("a" * 5_000_000, 100)
    assert len(out) == 100
    assert out.startswith("aaaa")
    assert out.endswith("…[5000000 chars in all]")


def test_lone_surrogates_become_escapes() -> None:
    out = truncate_echo("a\ud800b", 256)
    assert out == "a\\ud800b"
    out.encode("utf-8")  # must not raise
    cut = truncate_echo("\udfff" * 1000, 50)
    assert len(cut) == 50
    cut.encode("utf-8")


def test_tiny_limits() -> None:
    assert truncate_echo("abcdef", 0) == ""
    assert len(truncate_echo("abcdef" * 10, 5)) == 5
