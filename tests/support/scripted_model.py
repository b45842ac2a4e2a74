"""Tiny checkpoints whose greedy output is a fixed script, for real-stack tests of output formats.

The weights make a bigram table: the block adds nothing to the residual stream (zero output
projections), so the logits depend on the current token alone. A token of the script gets its own
one-hot embedding slot, and the LM head maps that slot to the script's next token; every other
token shares one slot that maps to end-of-sequence. Greedy decoding thus writes the script after
the prompt's last token and then stops. Where a grammar mask forbids the preferred token, the
allowed tokens all score 0 and the lowest id wins, so the grammar alone decides there, and the
model ends as soon as the grammar lets it. A test can make a model write a `<think>` block or a
`[TOOL_CALLS]` marker on cue, and watch the constraint take over from there.

Tokenizers: the embedded SmolLM2 tokenizer with extra special tokens (think tags, Llama 3 headers)
or Mistral's Tekken from `mistral-common`; nothing is downloaded.
"""

from __future__ import annotations

import itertools
import json
import shutil
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from maskwire.tokenizer import Tokenizer, load_tokenizer, tekken_path
from neuron_worker.model import ModelConfig
from neuron_worker.model.hf_loader import save_hf

_LOGIT = 20.0  # weight from a script token's slot to its successor (x sqrt(dim) after the norm)


def smollm_with_specials(specials: Sequence[str]) -> str:
    """The embedded SmolLM2 tokenizer.json with `specials` added as special tokens."""
    hf = load_tokenizer("default").hf
    assert hf is not None
    data = json.loads(hf.to_str())
    next_id = max(t["id"] for t in data["added_tokens"]) + 1
    next_id = max(next_id, len(data["model"]["vocab"]))
    for text in specials:
        data["added_tokens"].append(
            {
                "id": next_id,
                "content": text,
                "single_word": False,
                "lstrip": False,
                "rstrip": False,
                "normalized": False,
                "special": True,
            }
        )
        next_id += 1
    return json.dumps(data)


def write_tokenizer_dir(
    out_dir: Path,
    *,
    chat_template: str,
    tokenizer_json: str | None = None,
    eos_token: str,
    bos_token: str | None = None,
    tekken: bool = False,
) -> Tokenizer:
    """A checkpoint directory's tokenizer files; returns the tokenizer as the services load it."""
    out_dir.mkdir(parents=True, exist_ok=True)
    if tekken:
        shutil.copyfile(tekken_path(), out_dir / "tekken.json")
    else:
        assert tokenizer_json is not None
        (out_dir / "tokenizer.json").write_text(tokenizer_json)
    config: dict[str, Any] = {"eos_token": eos_token, "chat_template": chat_template}
    if bos_token is not None:
        config["bos_token"] = bos_token
    (out_dir / "tokenizer_config.json").write_text(json.dumps(config, indent=2))
    return load_tokenizer(str(out_dir))


def write_scripted_weights(
    out_dir: Path,
    vocab_size: int,
    script: Sequence[int],
    eos: int,
    *,
    dim: int = 64,
    max_seq_len: int = 2048,
) -> None:
    """`config.json` + `model.safetensors` for a model whose greedy continuation of `script[0]`
    is `script[1:]`, then `eos`. A token may recur in the script only with the same successor."""
    successor: dict[int, int] = {}
    for a, b in itertools.pairwise(script):
        if successor.setdefault(a, b) != b:
            raise ValueError(f"token {a} has two successors in the script")
    if len(successor) >= dim:
        raise ValueError(f"the script needs {len(successor) + 1} slots; dim is {dim}")
    config = ModelConfig(
        name=out_dir.name,
        vocab_size=vocab_size,
        dim=dim,
        n_layers=1,
        n_heads=4,
        n_kv_heads=4,
        head_dim=dim // 4,
        ffn_dim=dim,
        rope_theta=10000.0,
        norm_eps=1e-5,
        max_seq_len=max_seq_len,
        tie_embeddings=False,
    )
    # fp16 keeps a 131k-token vocabulary at a few MB per matrix; the worker casts on load.
    embed = torch.zeros(vocab_size, dim, dtype=torch.float16)
    head = torch.zeros(vocab_size, dim, dtype=torch.float16)
    default = len(successor)  # the slot of every token outside the script: it leads to EOS
    embed[:, default] = 1.0
    head[eos, default] = _LOGIT
    for slot, (a, b) in enumerate(successor.items()):
        embed[a, default] = 0.0
        embed[a, slot] = 1.0
        head[b, slot] = _LOGIT
    zeros = {
        "attention.wq.weight": (config.q_size, dim),
        "attention.wk.weight": (config.kv_size, dim),
        "attention.wv.weight": (config.kv_size, dim),
        "attention.wo.weight": (dim, config.q_size),
        "feed_forward.w1.weight": (config.ffn_dim, dim),
        "feed_forward.w3.weight": (config.ffn_dim, dim),
        "feed_forward.w2.weight": (dim, config.ffn_dim),
    }
    weights = {
        "tok_embeddings.weight": embed,
        "output.weight": head,
        "norm.weight": torch.ones(dim, dtype=torch.float16),
        "layers.0.attention_norm.weight": torch.ones(dim, dtype=torch.float16),
        "layers.0.ffn_norm.weight": torch.ones(dim, dtype=torch.float16),
        **{f"layers.0.{k}": torch.zeros(*shape, dtype=torch.float16) for k, shape in zeros.items()},
    }
    save_hf(out_dir, config, weights)


def script_after(tok: Tokenizer, prompt: str, text: str) -> list[int]:
    """The script that continues a prompt ending with `prompt` by `text`."""
    body = tok.encode(text)
    if tok.add_bos and body[:1] == [tok.bos_token_id]:
        body = body[1:]
    return tok.encode(prompt)[-1:] + body


def scripted_checkpoint(
    out_dir: Path,
    *,
    chat_template: str,
    prompt_end: str,
    text: str,
    tokenizer_json: str | None = None,
    eos_token: str,
    bos_token: str | None = None,
    tekken: bool = False,
) -> Path:
    """A checkpoint directory (tokenizer, template, weights) whose model answers any prompt
    ending with `prompt_end` with `text`, then ends."""
    tok = write_tokenizer_dir(
        out_dir,
        chat_template=chat_template,
        tokenizer_json=tokenizer_json,
        eos_token=eos_token,
        bos_token=bos_token,
        tekken=tekken,
    )
    script = script_after(tok, prompt_end, text)
    write_scripted_weights(out_dir, tok.vocab_size, script, tok.eos_token_ids[0])
    return out_dir
