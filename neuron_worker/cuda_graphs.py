"""CUDA graphs of the one-token-per-row forward (`--cuda-graphs`, CUDA only).

A compiled decode step of SmolLM2 on an H200 takes ~12 ms, nearly all of it launching ~400 small
kernels from Python (the worker's timers: decode forward 11.8 ms for a 135M model). A
CUDA graph replays the same kernels in one launch. The dynamic `decode` graph
(`neuron_worker.graphs`) is captured at warm-up once per (rows, KV length) bucket: rows 2, 4,
8, ... up to the widest pass a step makes (the batch, times 1 + drafts when speculating), KV
lengths 256, 512, ... up to the longest sequence. A pass is padded up to its bucket, so the
graph's kernels read only static buffers:

* padding rows are the pad slot's scratch position (position -1), as in every padded pass;
* the KV length only bounds what attention reads: keys past a row's position are masked, so a
  longer bucket gives the same logits;
* the graph returns the logits of every row; the pass's `last` picks its rows after the replay
  (a copy, so the graph's output buffer may be reused by the next replay).

Passes a bucket does not cover (multi-token, wider, prefill on a quantized model) run the
compiled graph as before. Capture happens before `/ready`, so no request waits for it.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch
from torch import Tensor

from neuron_worker.scheduler import bucket_for, pow2_buckets

if TYPE_CHECKING:
    from torch.cuda import _POOL_HANDLE

log = logging.getLogger(__name__)

# The shortest KV bucket: below it a longer read costs nothing measurable on a GPU.
MIN_KV_BUCKET = 256


def graph_buckets(widest: int, max_seq: int) -> tuple[list[int], list[int]]:
    """(row buckets, KV buckets) to capture for passes of at most `widest` rows and sequences
    of at most `max_seq` positions."""
    rows = pow2_buckets(2, max(2, widest))
    return rows, pow2_buckets(min(MIN_KV_BUCKET, max_seq), max_seq)


def padded_rows(
    tokens: np.ndarray, positions: np.ndarray, slots: np.ndarray, rows: int, pad_slot: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """A one-token-per-row pass's (tokens [n, 1], positions [n, 1], slots [n]) padded to
    `rows` rows: padding rows hold token 0 at position -1 on `pad_slot`."""
    n = tokens.shape[0]
    tok = np.zeros((rows, 1), dtype=np.int64)
    pos = np.full((rows, 1), -1, dtype=np.int64)
    slot = np.full(rows, pad_slot, dtype=np.int64)
    tok[:n], pos[:n], slot[:n] = tokens, positions, slots
    return tok, pos, slot


@dataclass
class _Captured:
    """A graph and the buffers it reads and writes: every one must outlive the graph (a freed
    input's memory would be handed to another tensor while the graph still reads it)."""

    graph: torch.cuda.CUDAGraph
    inputs: tuple[Tensor, ...]  # tokens, positions, slots (refilled per replay), kv, last
    logits: Tensor


class DecodeGraphs:
    """Captured replays of a compiled one-token-per-row forward `fn(tokens, positions, slots,
    kv_positions, last)`, one per (rows, KV length) bucket (module docstring)."""

    def __init__(
        self,
        fn: Callable[..., Tensor],
        *,
        widest: int,
        max_seq: int,
        pad_slot: int,
        mark_dynamic: Callable[[str, tuple[Tensor, ...]], None],
    ) -> None:
        """`widest`: the most rows a captured pass may have; `mark_dynamic`: the runner's
        marking of a decode pass's symbolic dimensions (a capture must hit the same graph)."""
        self._fn = fn
        self.rows, self.kv_lens = graph_buckets(widest, max_seq)
        self._pad_slot = pad_slot
        self._mark_dynamic = mark_dynamic
        self._graphs: dict[tuple[int, int], _Captured] = {}
        self.replays = 0

    def covers(self, rows: int, kv_len: int) -> bool:
        """Whether a one-token-per-row pass of `rows` rows replays a captured graph."""
        return bool(self._graphs) and rows <= self.rows[-1] and kv_len <= self.kv_lens[-1]

    def capture(self, kv_positions: Tensor, on_graph: Callable[[str], None]) -> int:
        """Capture every bucket, largest first (later graphs reuse its memory pool);
        `kv_positions`: the runner's int64 arange over the longest sequence, on the device.
        A capture that fails is logged and the worker serves the compiled graph instead."""
        pool = torch.cuda.graph_pool_handle()
        try:
            for rows in reversed(self.rows):
                for kv_len in reversed(self.kv_lens):
                    self._graphs[(rows, kv_len)] = self._capture(rows, kv_positions[:kv_len], pool)
                    on_graph(f"cuda graph rows={rows} kv_len={kv_len}")
            torch.cuda.synchronize(kv_positions.device)
        except RuntimeError:
            log.exception("capturing the decode pass as a CUDA graph failed; serving it compiled")
            self._graphs.clear()
            return 0
        log.info(
            "captured %d CUDA graphs of the decode pass (rows %s x KV lengths %s)",
            len(self._graphs),
            self.rows,
            self.kv_lens,
        )
        return len(self._graphs)

    def _capture(self, rows: int, kv_positions: Tensor, pool: _POOL_HANDLE) -> _Captured:
        device = kv_positions.device
        args = (
            torch.zeros((rows, 1), dtype=torch.int64, device=device),
            torch.full((rows, 1), -1, dtype=torch.int64, device=device),
            torch.full((rows,), self._pad_slot, dtype=torch.int64, device=device),
            kv_positions,
            torch.arange(rows, dtype=torch.int64, device=device),
        )
        self._mark_dynamic("decode", args)
        # Run it once outside capture, on a side stream as torch.cuda.graph expects: lazy work
        # (autotuning, cuBLAS handles, a new shape's first call) must not be recorded.
        side = torch.cuda.Stream(device)
        side.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(side):
            self._fn(*args)
        torch.cuda.current_stream(device).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=pool):
            logits = self._fn(*args)
        return _Captured(graph, args, logits)

    def run(
        self,
        tokens: np.ndarray,
        positions: np.ndarray,
        slots: np.ndarray,
        last: Tensor,
        kv_len: int,
    ) -> Tensor:
        """Replay the bucket of a pass (`covers` it): logits [len(last), vocab] of the rows
        `last` names."""
        rows = bucket_for(self.rows, tokens.shape[0])
        captured = self._graphs[(rows, bucket_for(self.kv_lens, kv_len))]
        padded = padded_rows(tokens, positions, slots, rows, self._pad_slot)
        for buffer, host in zip(captured.inputs, padded, strict=False):  # the first three
            buffer.copy_(torch.from_numpy(host))
        captured.graph.replay()
        self.replays += 1
        return captured.logits.index_select(0, last)
