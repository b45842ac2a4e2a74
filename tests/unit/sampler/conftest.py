"""Devices for the sampler tests: the CPU, plus CUDA when present, or the ones listed in
``MASKWIRE_TEST_DEVICES`` (comma-separated, e.g. ``cpu,cuda``)."""

from __future__ import annotations

import os

import pytest
import torch


def _devices() -> list[str]:
    listed = os.environ.get("MASKWIRE_TEST_DEVICES")
    if listed:
        return [d.strip() for d in listed.split(",") if d.strip()]
    return ["cpu", "cuda"] if torch.cuda.is_available() else ["cpu"]


@pytest.fixture(params=_devices())
def device(request: pytest.FixtureRequest) -> torch.device:
    return torch.device(request.param)
