"""The XLA stage: runs in `.venv-xla` (torch 2.9 + torch_xla) on the XLA CPU device.

`make test-xla` runs `pytest -m xla tests/xla` there; without torch_xla these tests skip.
"""

from __future__ import annotations

import os

import pytest

os.environ.setdefault("PJRT_DEVICE", "CPU")
pytest.importorskip("torch_xla", reason="needs the torch_xla environment (make test-xla)")
