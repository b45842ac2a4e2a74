"""CUDA graphs of the decode pass: the buckets, the padding, and (on a CUDA machine) replays
that give the compiled graph's logits without compiling anything after warm-up."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from neuron_worker.backends import create_backend
from neuron_worker.cuda_graphs import graph_buckets, padded_rows
from neuron_worker.graphs import CompileCounter, ForwardRunner
from neuron_worker.model import build_model
from tests.unit.model.tiny import TINY, random_weights
from tests.unit.worker.test_graphs import serve_random_passes


def test_buckets_cover_the_widest_pass_and_the_longest_sequence() -> None:
    assert graph_buckets(8, 2048) == ([2, 4, 8], [256, 512, 1024, 2048])
    # 8 rows with 4 drafts each; a short context
    assert graph_buckets(40, 128) == ([2, 4, 8, 16, 32, 40], [128])
    assert graph_buckets(1, 300) == ([2], [256, 300])


def test_padding_rows_write_the_pad_slots_scratch_position() -> None:
    tok, pos, slot = padded_rows(
        np.array([[5], [7]]), np.array([[3], [9]]), np.array([1, 0]), rows=4, pad_slot=8
    )
    assert tok[:, 0].tolist() == [5, 7, 0, 0]
    assert pos[:, 0].tolist() == [3, 9, -1, -1]
    assert slot.tolist() == [1, 0, 8, 8]
    assert tok.dtype == pos.dtype == slot.dtype == np.int64


def cuda_runner(weights: dict[str, torch.Tensor], compile: bool, graphs: bool) -> ForwardRunner:
    backend = create_backend("cuda", compile=compile, cuda_graphs=graphs)
    m = build_model(TINY, weights, device=backend.device)
    m.setup_caches(5, 256)
    return ForwardRunner(m, backend, max_rows=4, max_seq=256, pad_slot=4)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_replays_give_the_eager_logits_and_compile_nothing_after_warm_up() -> None:
    """Every decode pass of the mixed sequence (1-4 rows, flat jump-forward passes, KV lengths
    up to 256) replays a captured graph; multi-token passes run the compiled graph; the logits
    are the eager model's, and nothing compiles once warm-up has captured the graphs."""
    torch._dynamo.reset()
    weights = random_weights(TINY)
    eager, graphed = cuda_runner(weights, False, False), cuda_runner(weights, True, True)
    counter = CompileCounter()
    labels: list[str] = []
    graphed.warmup(labels.append)
    assert sum(label.startswith("cuda graph") for label in labels) == 2  # rows 2, 4 x KV 256
    counter.ready()
    graphs = graphed._cuda_graphs
    assert graphs is not None
    before = graphs.replays
    serve_random_passes(eager, graphed)
    counter.check()
    assert counter.after_ready == 0
    # the decode passes (1-4 rows); jump-forward and prompt passes of up to 16 tokens run flat,
    # wider than a step's widest decode pass (4 rows), so compiled
    assert graphs.replays - before == 4
