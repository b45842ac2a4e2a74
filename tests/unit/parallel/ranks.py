"""Run a function on every rank of a gloo group on loopback (one spawned process per rank)."""

from __future__ import annotations

from neuron_worker.parallel.group import ProcessGroup
from neuron_worker.parallel.launch import run_ranks

__all__ = ["ProcessGroup", "run_ranks"]
