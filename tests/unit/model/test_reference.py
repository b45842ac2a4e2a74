"""The embedded SmolLM2 against Hugging Face transformers loading the same GGUF (fp32 logits)."""

from __future__ import annotations

import logging
from collections.abc import Callable

import pytest
import torch

from maskwire.tokenizer import embedded_model_path, load_tokenizer
from neuron_worker.model import Transformer

log = logging.getLogger(__name__)
RecordProperty = Callable[[str, object], None]

# A correct implementation matches within ~5e-5 on logits of magnitude ~40 (float reduction order).
TOLERANCE = 1e-3
PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):\n    if n < 2:\n        return n\n",
    "<|im_start|>user\nList three colours, then count 1234567.<|im_end|>\n<|im_start|>assistant\n",
]


@pytest.fixture(scope="module")
def reference() -> torch.nn.Module:
    transformers = pytest.importorskip("transformers")
    path = embedded_model_path()
    model = transformers.AutoModelForCausalLM.from_pretrained(
        str(path.parent), gguf_file=path.name, dtype=torch.float32
    )
    return model.eval()


@pytest.fixture(scope="module")
def model(smollm: Transformer) -> Transformer:
    m = smollm
    m.setup_caches(max_batch=4, max_seq=128)
    return m


@pytest.fixture(scope="module")
def prompt_ids() -> list[list[int]]:
    tok = load_tokenizer("default")
    return [tok.encode(p) for p in PROMPTS]


def ref_logits(reference: torch.nn.Module, ids: list[int]) -> torch.Tensor:
    with torch.inference_mode():
        return reference(torch.tensor([ids])).logits[0].float()


def report(record_property: RecordProperty, name: str, diff: float) -> None:
    record_property(name, diff)
    log.warning("%s: max |logits - transformers| = %.3g", name, diff)


@torch.inference_mode()
def test_prefill_logits_match(
    reference: torch.nn.Module,
    model: Transformer,
    prompt_ids: list[list[int]],
    record_property: RecordProperty,
) -> None:
    worst = 0.0
    for ids in prompt_ids:
        n = len(ids)
        hidden = model(torch.tensor([ids]), torch.arange(n)[None], torch.tensor([0]), 64)
        got = model.logits(hidden[0])
        worst = max(worst, float((got - ref_logits(reference, ids)).abs().max()))
    report(record_property, "prefill_max_abs_diff", worst)
    assert worst < TOLERANCE


@torch.inference_mode()
def test_batched_prefill_then_decode_match(
    reference: torch.nn.Module,
    model: Transformer,
    prompt_ids: list[list[int]],
    record_property: RecordProperty,
) -> None:
    """All prompts in one padded batch (slots 3, 1, 2), then 4 batched decode steps fed the
    reference's greedy tokens; every logits row is compared to transformers on the full text."""
    b = len(prompt_ids)
    t = max(len(ids) for ids in prompt_ids)
    tokens = torch.zeros(b, t, dtype=torch.long)
    pos = torch.full((b, t), -1, dtype=torch.long)
    for i, ids in enumerate(prompt_ids):
        tokens[i, : len(ids)] = torch.tensor(ids)
        pos[i, : len(ids)] = torch.arange(len(ids))
    slots = torch.tensor([3, 1, 2])
    hidden = model(tokens, pos, slots, 64)
    seqs = [list(ids) for ids in prompt_ids]
    last = [hidden[i, len(ids) - 1] for i, ids in enumerate(prompt_ids)]
    worst = 0.0
    for _ in range(4):
        step_tokens, step_pos = [], []
        for i, seq in enumerate(seqs):
            ref = ref_logits(reference, seq)[-1]
            worst = max(worst, float((model.logits(last[i][None])[0] - ref).abs().max()))
            step_pos.append(len(seq))
            seq.append(int(ref.argmax()))
            step_tokens.append(seq[-1])
        hidden = model(
            torch.tensor(step_tokens)[:, None], torch.tensor(step_pos)[:, None], slots, 64
        )
        last = list(hidden[:, 0])
    report(record_property, "batched_decode_max_abs_diff", worst)
    assert worst < TOLERANCE
