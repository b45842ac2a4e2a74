from __future__ import annotations

import json
import shutil
from pathlib import Path

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


def test_tekken_parses_its_special_tokens_out_of_text(tmp_path: Path) -> None:
    tok = load_tokenizer(str(tekken_path()))
    hi = tok.encode("hi")[1:]  # after the BOS that Tekken adds
    assert tok.encode("<s>[INST]hi[/INST][TOOL_CALLS]") == [1, 3, *hi, 4, 9]
    assert tok.special_token("[TOOL_CALLS]") == 9
    assert tok.special_token("hi") is None
    assert tok.decode_bytes([9]) == b"[TOOL_CALLS]"
    # A checkpoint directory with Mistral's `tekken.json` and a chat template beside it.
    shutil.copyfile(tekken_path(), tmp_path / "tekken.json")
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"chat_template": "T"}))
    in_dir = load_tokenizer(str(tmp_path))
    assert in_dir.fingerprint == tok.fingerprint
    assert in_dir.chat_template == "T" and in_dir.name == tmp_path.name
    assert in_dir.encode("[INST]") == [1, 3]
