from __future__ import annotations

from maskwire.tokenizer import Fingerprint, load_tokenizer, tekken_path


def test_embedded_tokenizer_matches_known_ids() -> None:
    tok = load_tokenizer("default")
    assert tok.vocab_size == 49152
    assert tok.eos_token_ids == (2,)
    assert tok.encode("The capital of France is") == [504, 3575, 282, 4649, 314]
    # Digits split individually (SmolLM's pre-tokenizer) and specials parse to their ids.
    assert tok.encode("<|im_start|>12") == [1, 33, 34]
    assert tok.decode_bytes([504, 3575]) == b"The capital"
    assert "<|im_start|>" in tok.chat_template


def test_fingerprint_roundtrip_and_difference() -> None:
    small = load_tokenizer("default").fingerprint
    big = load_tokenizer(str(tekken_path())).fingerprint
    assert Fingerprint.from_proto(small.to_proto()) == small
    assert big.vocab_size == 131072
    assert big != small
    assert len(small.tokens_sha256) == 32
