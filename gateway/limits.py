"""Defaults of the gateway's input limits, in a module light enough for its CLI to import before
FastAPI loads."""

from __future__ import annotations

# UTF-8 bytes of the prompt text sent to a worker (the rendered chat, or a completions prompt).
from maskwire.text import DEFAULT_MAX_PROMPT_BYTES as DEFAULT_MAX_PROMPT_BYTES

DEFAULT_MAX_N = 8
"""Most choices (`n`) per request: each takes a worker batch slot for the whole request."""

DEFAULT_MAX_JSON_DEPTH = 64
"""Nesting levels of a body (`{"a": [1]}` is 2), and of JSON sent as text inside a field. A JSON
Schema nested 25 levels (OpenAI allows 10) in a tool definition is about 60; Python code walking
the body stays far from the recursion limit."""
