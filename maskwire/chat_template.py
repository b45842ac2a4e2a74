"""Render a model's Jinja chat template the way Hugging Face `apply_chat_template` does."""

from __future__ import annotations

import datetime
import functools
import json
from collections.abc import Mapping, Sequence
from typing import Any

import jinja2
from jinja2.sandbox import ImmutableSandboxedEnvironment


class ChatTemplateError(ValueError):
    """The template is missing, malformed, or refused the messages."""


def _raise_exception(message: str) -> None:
    raise ChatTemplateError(message)


def _strftime_now(fmt: str) -> str:
    return datetime.datetime.now().strftime(fmt)


def _tojson(
    x: Any,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: Any = None,
    sort_keys: bool = False,
) -> str:
    # transformers' override: Jinja's own `tojson` HTML-escapes `<`, `>`, `&` and `'`.
    return json.dumps(
        x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


@functools.lru_cache(maxsize=16)
def _compile(template: str) -> jinja2.Template:
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env.from_string(template)


def check_template(template: str) -> None:
    """Raise ChatTemplateError when `template` does not compile (for start-up flag checks)."""
    try:
        _compile(template)
    except jinja2.TemplateError as e:
        raise ChatTemplateError(f"chat template does not compile: {e}") from e


def render_chat(
    template: str,
    messages: Sequence[Mapping[str, Any]],
    *,
    bos_token: str = "",
    eos_token: str = "",
    add_generation_prompt: bool = True,
    **extra: Any,
) -> str:
    """The prompt text for `messages` (`[{"role": ..., "content": ...}]`).

    Same environment as transformers: sandboxed, `trim_blocks`/`lstrip_blocks`, `tojson`, and the
    `raise_exception` / `strftime_now` globals templates call.
    """
    if not template:
        raise ChatTemplateError("the model has no chat template")
    try:
        compiled = _compile(template)
        return compiled.render(
            messages=[dict(m) for m in messages],
            bos_token=bos_token,
            eos_token=eos_token,
            add_generation_prompt=add_generation_prompt,
            **extra,
        )
    except jinja2.TemplateError as e:
        raise ChatTemplateError(f"chat template failed: {e}") from e
