"""Logprobs, penalties, logit bias and n > 1 with the official `openai` SDK against the live stack
(embedded SmolLM2, real tokenizer, grammar service; shared stack from `conftest.py`)."""

from __future__ import annotations

import math
from typing import Any

import openai
import pytest

from maskwire.tokenizer import load_tokenizer

MODEL = "SmolLM2-135M-Instruct"
LABELS = ["positive", "negative", "neutral"]
REVIEW = [{"role": "user", "content": "Classify the sentiment: 'I loved this film.'"}]


def classify(client: openai.OpenAI, **kw: Any) -> Any:
    extra = {"structured_outputs": {"choice": LABELS}, **kw.pop("extra_body", {})}
    args: dict[str, Any] = {
        "temperature": 0,
        "max_tokens": 10,
        "logprobs": True,
        "top_logprobs": 20,
    }
    return client.chat.completions.create(
        model=MODEL,
        messages=REVIEW,  # type: ignore[arg-type]
        extra_body=extra,
        **{**args, **kw},
    )


def test_choice_logprobs_sum_to_one_and_greedy_is_the_best(client: openai.OpenAI) -> None:
    r = classify(client)
    choice = r.choices[0]
    assert choice.message.content in LABELS
    content = choice.logprobs.content
    assert "".join(t.token for t in content) == choice.message.content
    first = content[0]
    assert first.model_extra["forced"] is False
    # The allowed first tokens are the options' first tokens: their probabilities sum to 1.
    assert 0 < len(first.top_logprobs) < 20
    assert math.fsum(math.exp(t.logprob) for t in first.top_logprobs) == pytest.approx(
        1.0, abs=1e-3
    )
    assert all(any(label.startswith(t.token) for label in LABELS) for t in first.top_logprobs)
    # Greedy: the chosen token has the highest logprob.
    assert first.logprob == pytest.approx(max(t.logprob for t in first.top_logprobs), abs=1e-6)
    assert first.token == first.top_logprobs[0].token
    for t in content[1:]:
        if t.model_extra["forced"]:  # jump-forward: not sampled
            assert t.logprob == 0.0 and [a.token for a in t.top_logprobs] == [t.token]


def test_raw_logprobs_are_the_model_distribution(client: openai.OpenAI) -> None:
    masked = classify(client).choices[0].logprobs.content[0]
    raw = classify(client, extra_body={"logprobs_mode": "raw"}).choices[0].logprobs.content[0]
    assert raw.token == masked.token
    assert raw.logprob < masked.logprob  # the mass outside the options is not renormalised away
    assert len(raw.top_logprobs) == 20
    assert math.fsum(math.exp(t.logprob) for t in raw.top_logprobs) < 1.0


def test_streamed_chat_logprobs_match_the_text(client: openai.OpenAI) -> None:
    text, tokens = "", []
    for chunk in client.chat.completions.create(
        model=MODEL,
        messages=REVIEW,  # type: ignore[arg-type]
        temperature=0,
        max_tokens=8,
        logprobs=True,
        top_logprobs=3,
        stream=True,
    ):
        for c in chunk.choices:
            text += c.delta.content or ""
            if c.logprobs is not None and c.logprobs.content:
                tokens += c.logprobs.content
    assert text and "".join(t.token for t in tokens) == text
    for t in tokens:
        assert len(t.top_logprobs) == 3 and t.logprob == pytest.approx(t.top_logprobs[0].logprob)


def test_completion_logprobs(client: openai.OpenAI) -> None:
    r = client.completions.create(
        model=MODEL, prompt="The capital of France is", max_tokens=3, temperature=0, logprobs=5
    )
    c = r.choices[0]
    lp = c.logprobs
    assert lp is not None and c.text.startswith(" Paris")
    assert "".join(lp.tokens) == c.text
    assert lp.text_offset[0] == 0 and lp.text_offset[1] == len(lp.tokens[0])
    for token, value, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs, strict=True):
        assert len(top) == 5 and value == pytest.approx(max(top.values())) and token in top


def paris_id() -> int:
    (tid,) = load_tokenizer("default").encode(" Paris")
    return int(tid)


def test_logit_bias_moves_the_greedy_choice_but_never_past_the_grammar(
    client: openai.OpenAI,
) -> None:
    tid = paris_id()
    r = client.completions.create(
        model=MODEL,
        prompt="The capital of France is",
        max_tokens=3,
        temperature=0,
        logit_bias={str(tid): -100},
    )
    assert not r.choices[0].text.startswith(" Paris")
    # +100 on " Paris" cannot make a `choice` constraint produce it.
    r = client.completions.create(
        model=MODEL,
        prompt="The capital of France is",
        max_tokens=5,
        temperature=0,
        logit_bias={str(tid): 100},
        extra_body={"structured_outputs": {"choice": [" Lyon", " Nice"]}},
    )
    assert r.choices[0].text in (" Lyon", " Nice")


def test_penalties_change_a_repetitive_output(client: openai.OpenAI) -> None:
    prompt = "1, 1, 1, 1, 1, 1, 1,"

    def complete(**kw: Any) -> str:
        r = client.completions.create(model=MODEL, prompt=prompt, max_tokens=8, temperature=0, **kw)
        return r.choices[0].text

    plain = complete()
    assert complete() == plain
    assert complete(presence_penalty=2, frequency_penalty=2) != plain
    assert complete(extra_body={"repetition_penalty": 1.8}) != plain


def test_refusals_name_the_field(client: openai.OpenAI) -> None:
    for kw, param in (
        ({"logit_bias": {"49152": 1}}, "logit_bias"),
        ({"top_logprobs": 3}, "top_logprobs"),
        ({"n": 9}, "n"),
    ):
        with pytest.raises(openai.BadRequestError) as e:
            client.chat.completions.create(
                model=MODEL,
                messages=REVIEW,  # type: ignore[arg-type]
                max_tokens=1,
                **kw,  # type: ignore[arg-type]
            )
        assert isinstance(e.value.body, dict) and e.value.body["param"] == param


def test_n_greedy_choices_equal_the_single_answer(client: openai.OpenAI) -> None:
    """The prompt is prefilled once and copied into the other choices' KV slots: with greedy
    decoding every choice must be the n = 1 answer, token for token."""
    kw: dict[str, Any] = {"model": MODEL, "messages": REVIEW, "temperature": 0, "max_tokens": 12}
    one = client.chat.completions.create(**kw)
    three = client.chat.completions.create(n=3, **kw)
    want = one.choices[0].message.content
    assert [c.index for c in three.choices] == [0, 1, 2]
    assert [c.message.content for c in three.choices] == [want] * 3
    assert one.usage is not None and three.usage is not None
    assert three.usage.prompt_tokens == one.usage.prompt_tokens
    assert three.usage.completion_tokens == 3 * one.usage.completion_tokens


def test_n_sampled_choices_each_follow_the_constraint(client: openai.OpenAI) -> None:
    def run() -> list[str]:
        r = classify(client, n=4, temperature=1.5, seed=7, top_logprobs=None, logprobs=None)
        assert all(c.logprobs is None for c in r.choices)
        return [c.message.content for c in r.choices]

    first = run()
    assert all(label in LABELS for label in first)
    assert run() == first  # seed + i per choice: reproducible


def test_n_streamed_completions_carry_their_index(client: openai.OpenAI) -> None:
    text: dict[int, str] = {}
    finish: dict[int, str] = {}
    for chunk in client.completions.create(
        model=MODEL,
        prompt="The capital of France is",
        max_tokens=3,
        temperature=0,
        n=2,
        stream=True,
    ):
        for c in chunk.choices:
            text[c.index] = text.get(c.index, "") + c.text
            if c.finish_reason:
                finish[c.index] = c.finish_reason
    assert set(text) == {0, 1} and text[0] == text[1] and text[0].startswith(" Paris")
    assert finish == {0: "length", 1: "length"}
