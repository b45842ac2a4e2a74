"""maskwire.chat_template renders real chat templates like transformers does."""

from __future__ import annotations

import pytest

from maskwire.chat_template import ChatTemplateError, render_chat
from maskwire.tokenizer import load_tokenizer


def test_embedded_model_chatml() -> None:
    tok = load_tokenizer("default")
    text = render_chat(
        tok.chat_template,
        [{"role": "user", "content": "What is the capital of France?"}],
        bos_token=tok.bos_token,
        eos_token="<|im_end|>",
    )
    assert text.endswith(
        "<|im_start|>user\nWhat is the capital of France?<|im_end|>\n<|im_start|>assistant\n"
    )


def test_missing_and_raising_templates() -> None:
    with pytest.raises(ChatTemplateError, match="no chat template"):
        render_chat("", [{"role": "user", "content": "x"}])
    with pytest.raises(ChatTemplateError, match="only user"):
        render_chat("{{ raise_exception('only user') }}", [{"role": "user", "content": "x"}])
    with pytest.raises(ChatTemplateError, match="chat template failed"):
        render_chat("{% for %}", [])
