"""Incremental detokenization: UTF-8 held until complete, stop strings across chunks."""

from __future__ import annotations

from neuron_worker.detokenize import Detokenizer

# A toy vocabulary of raw byte strings, so chunk boundaries can be placed anywhere.
VOCAB = {
    0: b"he",
    1: b"llo",
    2: b" w",
    3: b"\xc3",  # first byte of "é"
    4: b"\xa9",  # second byte of "é"
    5: b"\xe6\x97",  # 2 of the 3 bytes of "日"
    6: b"\xa5",
    7: b"ST",
    8: b"OP",
    9: b"S",
    10: b"x",
}


def detok(stop: tuple[str, ...] = ()) -> Detokenizer:
    return Detokenizer(VOCAB.__getitem__, stop)


def test_incomplete_utf8_is_held_until_complete() -> None:
    d = detok()
    assert d.feed([0, 3]).text == "he"
    assert d.feed([4]).text == "é"
    assert d.feed([5]).text == ""
    assert d.feed([6]).text == "日"


def test_flush_releases_incomplete_bytes_as_replacement() -> None:
    d = detok()
    assert d.feed([1, 5]).text == "llo"
    assert d.flush().text == "\ufffd"


def test_stop_string_spanning_chunks_is_held_back_then_matched() -> None:
    d = detok(("STOP",))
    assert d.feed([0, 1]).text == "hello"
    delta = d.feed([7])  # "ST" could start "STOP": held
    assert delta.text == "" and delta.stop is None
    delta = d.feed([8])
    assert delta.text == "" and delta.stop == "STOP"
    assert d.stopped == "STOP"
    assert d.feed([0]).text == ""


def test_held_prefix_released_when_it_stops_being_a_prefix() -> None:
    d = detok(("STOP",))
    assert d.feed([9]).text == ""  # "S"
    assert d.feed([10]).text == "Sx"
    assert d.flush().text == ""


def test_text_before_stop_in_same_chunk_is_released() -> None:
    d = detok(("lo w",))
    delta = d.feed([0, 1, 2, 10])
    assert delta.text == "hel" and delta.stop == "lo w"


def test_earliest_stop_wins() -> None:
    d = detok(("w", "llo"))
    delta = d.feed([0, 1, 2])
    assert delta.text == "he" and delta.stop == "llo"


def test_held_text_is_flushed_at_the_end() -> None:
    d = detok(("STOP",))
    assert d.feed([0, 7]).text == "he"
    assert d.flush().text == "ST"
