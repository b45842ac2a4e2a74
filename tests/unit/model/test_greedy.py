"""Greedy decoding of the embedded SmolLM2 gives the known answers (raw and chat prompts)."""

from __future__ import annotations

import jinja2.sandbox
import pytest

from maskwire.tokenizer import Tokenizer, load_tokenizer
from neuron_worker.model import Transformer
from neuron_worker.model.greedy import greedy_generate


@pytest.fixture(scope="module")
def model(smollm: Transformer) -> Transformer:
    m = smollm
    m.setup_caches(max_batch=1, max_seq=128)
    return m


@pytest.fixture(scope="module")
def tok() -> Tokenizer:
    return load_tokenizer("default")


def render_chat(tok: Tokenizer, user: str) -> str:
    env = jinja2.sandbox.ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    template = env.from_string(tok.chat_template)
    return template.render(
        messages=[{"role": "user", "content": user}],
        add_generation_prompt=True,
        bos_token=tok.bos_token,
        eos_token=tok.eos_token,
    )


def test_raw_prompt(model: Transformer, tok: Tokenizer) -> None:
    out = greedy_generate(model, tok.encode("The capital of France is"), 2)
    assert tok.decode_bytes(out) == b" Paris."


def test_chat_prompt(model: Transformer, tok: Tokenizer) -> None:
    prompt = render_chat(tok, "What is the capital of France?")
    assert prompt.endswith("<|im_start|>assistant\n")
    out = greedy_generate(model, tok.encode(prompt), 24, stop_ids=tok.eos_token_ids)
    assert out[-1] in tok.eos_token_ids
    assert tok.decode_bytes(out[:-1]) == b"The capital of France is Paris."
