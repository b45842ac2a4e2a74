"""Chat prompts: the model's template, tools in the prompt, tool conversations, refusals."""

from __future__ import annotations

from typing import Any

import pytest

from gateway import schemas, tools
from gateway.chat_template import ChatTemplate, TemplateError, build_prompt
from gateway.errors import APIError
from gateway.tool_formats import FORMATS
from tests.unit.gateway.fake_worker import CHATML

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Weather for a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
    },
}

# A template with native tool support, shaped like Qwen2.5's (tools as JSON lines, calls as dicts).
NATIVE = (
    "{% if tools %}<tools>{% for t in tools %}{{ t | tojson }}\n{% endfor %}</tools>\n{% endif %}"
    "{% for m in messages %}[{{ m.role }}]{{ m.content }}"
    "{% for c in m.tool_calls or [] %}<call>{{ c.function.name }} "
    "{{ c.function.arguments | tojson }}</call>{% endfor %}"
    "{% if m.tool_call_id %}({{ m.tool_call_id }}){% endif %}\n{% endfor %}"
    "{% if add_generation_prompt %}[assistant]{% endif %}"
)


def render(template: str, **kw: Any) -> str:
    req = schemas.ChatCompletionRequest.model_validate({"model": "m", **kw})
    return build_prompt(
        ChatTemplate(template, eos_token="<|im_end|>"), req, tools.plan(req), FORMATS["hermes"]
    )


def test_embedded_model_template_renders_chatml() -> None:
    prompt = render(CHATML, messages=[{"role": "user", "content": "Hi"}])
    assert prompt == (
        "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging "
        "Face<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
    )


def test_developer_role_and_text_parts() -> None:
    prompt = render(
        CHATML,
        messages=[
            {"role": "developer", "content": "Be brief."},
            {
                "role": "user",
                "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}],
            },
        ],
    )
    assert prompt.startswith(
        "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nab<|im_end|>"
    )


def test_tools_go_into_a_hermes_system_prompt() -> None:
    prompt = render(
        CHATML,
        messages=[{"role": "system", "content": "S."}, {"role": "user", "content": "Hi"}],
        tools=[WEATHER],
    )
    assert prompt.startswith("<|im_start|>system\nS.\n\n# Tools")
    assert '{"type": "function", "function": {"name": "get_weather"' in prompt
    assert (
        '<tool_call>{"name": <function-name>, "arguments": <args-json-object>}</tool_call>'
        in prompt
    )
    # tool_choice none: the model does not see the tools.
    none = render(
        CHATML, messages=[{"role": "user", "content": "Hi"}], tools=[WEATHER], tool_choice="none"
    )
    assert "<tools>" not in none


def test_tool_conversation_without_native_support() -> None:
    prompt = render(
        CHATML,
        messages=[
            {"role": "user", "content": "Weather?"},
            {
                "role": "assistant",
                "content": None,
                "tool_calls": [
                    {
                        "id": "c1",
                        "type": "function",
                        "function": {"name": "get_weather", "arguments": '{"city":"Paris"}'},
                    }
                ],
            },
            {"role": "tool", "tool_call_id": "c1", "content": "sunny"},
        ],
        tools=[WEATHER],
    )
    assert (
        '<|im_start|>assistant\n<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}'
        "</tool_call><|im_end|>" in prompt
    )
    assert "<|im_start|>user\n<tool_response>\nsunny\n</tool_response><|im_end|>" in prompt


def test_native_tool_template_gets_tools_and_dict_arguments() -> None:
    prompt = render(
        NATIVE,
        messages=[
            {"role": "user", "content": "Weather?"},
            {
                "role": "assistant",
                "tool_calls": [
                    {
                        "id": "c1",
                        "type": "function",
                        "function": {"name": "get_weather", "arguments": '{"city":"<P>"}'},
                    }
                ],
            },
            {"role": "tool", "tool_call_id": "c1", "content": "sunny"},
        ],
        tools=[WEATHER],
    )
    assert prompt.startswith('<tools>{"type": "function", "function": {"name": "get_weather"')
    assert '<call>get_weather {"city": "<P>"}</call>' in prompt  # tojson without HTML escaping
    assert "[tool]sunny(c1)" in prompt
    assert prompt.endswith("[assistant]")


def test_template_raise_exception_is_400() -> None:
    tpl = (
        "{% if messages[0].role != 'user' %}{{ raise_exception('first must be user') }}{% endif %}x"
    )
    with pytest.raises(APIError) as e:
        render(tpl, messages=[{"role": "assistant", "content": "a"}])
    assert e.value.status == 400 and "first must be user" in e.value.message


def test_non_text_content_is_400() -> None:
    with pytest.raises(APIError) as e:
        render(
            CHATML,
            messages=[
                {"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}
            ],
        )
    assert e.value.status == 400 and e.value.param == "messages[0].content[0]"


def test_tool_message_needs_call_id() -> None:
    with pytest.raises(APIError):
        render(CHATML, messages=[{"role": "tool", "content": "x"}])


def test_bad_template_is_refused() -> None:
    with pytest.raises(TemplateError):
        ChatTemplate("{% for %}")
