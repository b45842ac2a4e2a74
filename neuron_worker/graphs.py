"""One forward pass as the engine runs it: the shapes its graphs take, the graphs, warm-up, and
the count of graphs compiled after warm-up (which must stay 0).

The engine describes a pass as rows of tokens (host arrays padded to `shape(...)`); the runner
puts them on the device and runs the model's `step_logits`, which returns the logits `Pass.last`
names.
Two shape policies:

* **Buckets** (XLA, where every distinct shape is a graph): rows, tokens per row and the KV length
  are each padded to a bucket; every (rows, tokens, kv) bucket is one graph, all traced at warm-up.
* **Dynamic** (`torch.compile` on CPU/CUDA, and eager): three graphs in all. `decode` takes one
  token per row, up to `max_rows` rows; `multi` takes several (prefill, jump-forward, speculative
  verification). Rows (2..max), tokens per row (2..max), logits rows (2..max) and the KV length
  (2..max) are symbolic, so no request shape can need a new graph. Passes are padded to 2 rows at
  least: a 1-row decode gets a padding row; a 1-row multi-token pass is split into two half-rows
  on the same cache slot (the second attends the first's keys, written earlier in the same
  layer), which costs nothing. Symbolic sizes start at 2 because torch specializes sizes 0 and 1.
  **Flat passes**: a multi-token pass of at most `flat_tokens` real tokens runs instead as one
  token per row, each on its row's cache slot (the same trick as the split: a token attends the
  keys its row's earlier tokens wrote in the same layer). A jump-forward or verification pass is
  mostly padding in the [rows x tokens] grid (8 rows, one with 5 forced tokens, is 48 tokens for
  12 real ones); flat, its matmuls see only the real tokens, and up to `max_rows` tokens it is
  the decode graph itself, with the decode pass's kernels (4-bit weights where the worker uses
  them): the same per-row results as decoding those tokens one step at a time. Above `max_rows`
  tokens it is the third graph, `wide` (one token per row, `max_rows + 1`..`flat_tokens` rows).
  Where attention reads the cache in place, prefills of up to `MAX_FLAT_TOKENS` run flat too
  (`default_flat_tokens`).

Which logits a pass returns: one per entry of `Pass.last`, a flat index into the [rows x tokens]
grid. A decode pass names each of its rows; a flat pass, only the tokens whose logits are wanted
(the LM head runs for those alone); a verification pass, every draft position of every row
(`verify_width` per row at most; bucketed: the logits rows are padded to rows x `verify_width`
for such passes, one more graph per forward bucket).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import numpy as np
import torch
from torch import Tensor, nn

from neuron_worker.backends import Backend
from neuron_worker.saved_graphs import SavedGraphs
from neuron_worker.scheduler import bucket_for, forward_shapes

log = logging.getLogger(__name__)

# KV lengths are rounded up to this many positions (aligned attention reads, fewer distinct
# shapes for the bucketed policy's neighbours).
KV_ALIGN = 64
# Flat passes run at most this many rows: the wide graph gathers each row's KV (~1.5 MB per row
# at a 2048 KV length for SmolLM2), and its largest pass runs at warm-up.
MAX_FLAT_TOKENS = 512


class StepModel(Protocol):
    """What the runner needs of a model (`neuron_worker.model.Transformer`, or a stand-in)."""

    config: Any  # .vocab_size (logits dimension), .max_seq_len, .name

    def setup_caches(self, max_batch: int, max_seq: int) -> None: ...

    def copy_slot(self, src: int, dst: int, length: int) -> None: ...

    def step_logits(
        self,
        tokens: Tensor,
        input_pos: Tensor,
        cache_slots: Tensor,
        kv_positions: Tensor,
        last: Tensor,
    ) -> Tensor: ...


@dataclass(frozen=True)
class Pass:
    """A forward pass as host arrays, already padded: tokens/positions int64 [rows, tokens]
    (position -1 = padding), slots int64 [rows], last int64 [logits rows]: flat indices
    `row * tokens + column` of the tokens whose logits the pass returns (one token per row:
    rows; a decode pass names each of its rows), kv_len."""

    tokens: np.ndarray
    positions: np.ndarray
    slots: np.ndarray
    last: np.ndarray
    kv_len: int


class ForwardRunner:
    """Shapes and graphs of the engine's forward passes (module docstring)."""

    def __init__(
        self,
        model: StepModel,
        backend: Backend,
        *,
        max_rows: int,
        max_seq: int,
        pad_slot: int,
        batch_buckets: Sequence[int] = (),
        token_buckets: Sequence[int] = (),
        seq_buckets: Sequence[int] = (),
        verify_width: int = 1,
        flat_tokens: int | None = None,
        graph_dir: Path | None = None,
    ) -> None:
        """Buckets given: the bucket policy (all three must be); none: dynamic shapes.
        `verify_width`: logits rows per row of a verification pass (1 + drafts; 1 = none).
        `flat_tokens`: the most real tokens of a multi-token pass run flat (module docstring;
        dynamic policy only; None = `max_rows * max(4, verify_width)`, 0 = never; at most
        `MAX_FLAT_TOKENS`). `graph_dir`: compiled dynamic graphs are saved there and loaded
        from there (`neuron_worker.saved_graphs`; CPU only)."""
        self.model = model
        self.backend = backend
        self.max_rows = max_rows
        self.max_seq = max_seq
        self.pad_slot = pad_slot
        self.bucketed = bool(batch_buckets)
        self.batch_buckets = list(batch_buckets)
        self.token_buckets = list(token_buckets)
        self.seq_buckets = list(seq_buckets)
        self.verify_width = max(1, verify_width)
        if flat_tokens is None:
            flat_tokens = default_flat_tokens(model, max_rows, self.verify_width)
        self.flat_tokens = 0 if self.bucketed else min(flat_tokens, MAX_FLAT_TOKENS)
        self.dynamic = backend.compile_enabled and not self.bucketed
        # One compiled function; its decode (1 token per row) and multi-token graphs differ in
        # the token dimension, static 1 in one and symbolic in the other.
        self._step = model.step_logits
        if backend.compile_enabled:
            self._step = backend.compile(model.step_logits, name="step", dynamic=self.dynamic)
        self._saved: SavedGraphs | None = None
        if self.dynamic and graph_dir is not None and isinstance(model, nn.Module):
            ranges = f"rows{max_rows} seq{max_seq} verify{self.verify_width} flat{self.flat_tokens}"
            self._saved = SavedGraphs(
                model,
                graph_dir,
                ranges=ranges,
                mark_dynamic=self._mark_dynamic,
                fallback=self._step,
            )
        self._kv: Tensor | None = None

    # ------------------------------------------------------------------ shapes
    def shape(self, rows: int, tokens: int, end: int) -> tuple[int, int, int]:
        """(rows, tokens per row, kv_len) of a pass of `rows` rows of at most `tokens` tokens
        whose last position is `end - 1`."""
        if self.bucketed:
            rows_p = bucket_for(self.batch_buckets, rows)
            tokens_p = bucket_for(self.token_buckets, tokens)
            return rows_p, tokens_p, bucket_for(self.seq_buckets, end)
        kv = min(-(-end // KV_ALIGN) * KV_ALIGN, self.max_seq)
        if tokens > 1 and rows == 1:
            return 1, tokens, max(kv, 2)  # split into two half-rows by `run`
        return max(rows, 2), tokens, max(kv, 2)

    def logits_count(self, rows: int, outputs: int, per_row: int) -> int:
        """Logits rows (`len(Pass.last)`) of a pass of `rows` padded rows that wants `outputs`
        logits, at most `per_row` of them from one row."""
        if per_row > self.verify_width:
            raise ValueError(f"{per_row} logits from one row; verify_width is {self.verify_width}")
        if self.bucketed:
            return rows if per_row == 1 else rows * self.verify_width
        return max(2, rows if per_row == 1 else outputs)

    # ------------------------------------------------------------------ running
    def run(self, p: Pass) -> Tensor:
        """Device thread: logits [len(p.last), vocab] float32 (padding entries: garbage)."""
        multi_token = p.tokens.shape[1] > 1
        if multi_token and 0 < int((p.positions >= 0).sum()) <= self.flat_tokens:
            q = _flatten(p)
        elif not self.bucketed and p.tokens.shape[0] == 1 and multi_token:
            q = _split_row(p)
        else:
            q = p
        backend = self.backend
        with backend.inference_mode():
            args = (
                backend.to_device(torch.from_numpy(q.tokens)),
                backend.to_device(torch.from_numpy(q.positions)),
                backend.to_device(torch.from_numpy(q.slots)),
                self._kv_positions(q.kv_len),
                backend.to_device(torch.from_numpy(q.last)),
            )
            kind = graph_kind(q, self.max_rows)
            if self._saved is not None:
                logits = self._saved(kind, args)
            else:
                if self.dynamic:
                    self._mark_dynamic(kind, args)
                logits = self._step(*args)
            backend.mark_step()
            backend.sync()
        return logits

    def logits_rows(self, verify: bool = True) -> list[int]:
        """Every row count `run` returns (what the sampler must take); `verify=False`: only
        those of passes with one logits row per row."""
        width = self.verify_width if verify else 1
        if self.bucketed:
            return sorted({*self.batch_buckets, *(n * width for n in self.batch_buckets)})
        return sorted({2, max(2, self.max_rows * width)})

    def _mark_dynamic(self, kind: str, args: tuple[Tensor, ...]) -> None:
        """Mark the symbolic dimensions of a `kind` pass's inputs, each with its range."""
        tokens, pos, slots, kv, last = args
        rows_max = max(2, self.max_rows)
        low, high = 2, rows_max
        if kind == "wide":  # a flat pass of more rows than a batch has: its own graph
            low, high = rows_max + 1, self.flat_tokens
        for t in (tokens, pos):
            torch._dynamo.mark_dynamic(t, 0, min=low, max=high)
            if kind == "multi":
                torch._dynamo.mark_dynamic(t, 1, min=2, max=self.max_seq)
        torch._dynamo.mark_dynamic(slots, 0, min=low, max=high)
        torch._dynamo.mark_dynamic(last, 0, min=2, max=max(2, rows_max * self.verify_width))
        torch._dynamo.mark_dynamic(kv, 0, min=2, max=self.max_seq)

    def _kv_positions(self, kv_len: int) -> Tensor:
        if self._kv is None:
            self._kv = self.backend.to_device(torch.arange(self.max_seq, dtype=torch.int64))
        return self._kv[:kv_len]

    # ------------------------------------------------------------------ warm-up
    def warmup(self, on_graph: Callable[[str], None]) -> int:
        """Device thread: run every graph once on padding inputs (the pad slot's scratch
        position); returns how many passes ran."""
        count = 0
        for rows, tokens, kv, outputs in self._warmup_shapes():
            pos = np.full((rows, tokens), -1, dtype=np.int64)
            slots = np.full(rows, self.pad_slot, dtype=np.int64)
            self.run(
                Pass(
                    np.zeros((rows, tokens), dtype=np.int64),
                    pos,
                    slots,
                    np.zeros(outputs, np.int64),
                    kv,
                )
            )
            on_graph(f"forward rows={rows} tokens={tokens} kv_len={kv} logits={outputs}")
            count += 1
        return count

    def _warmup_shapes(self) -> list[tuple[int, int, int, int]]:
        """(rows, tokens, kv_len, logits rows) of every pass to run at warm-up."""
        if self.bucketed:
            shapes = forward_shapes(self.batch_buckets, self.token_buckets, self.seq_buckets)
            out = [(n, t, kv, n) for n, t, kv in shapes]
            if self.verify_width > 1:  # verification passes: every multi-token bucket, wide
                out += [(n, t, kv, n * self.verify_width) for n, t, kv in shapes if t > 1]
            return out
        # Both ends of every symbolic range: the graphs must cover them without recompiling.
        small, big = max(2, KV_ALIGN), self.max_seq
        rows = max(2, self.max_rows)
        passes = [
            (2, 1, small, 2),
            (rows, 1, big, rows),
            (2, 2, small, 2),
            (rows, min(64, big), big, max(2, rows * self.verify_width)),
        ]
        if self.flat_tokens > rows:  # the wide graph: flat passes of more than `rows` tokens
            passes += [(rows + 1, 1, small, 2), (self.flat_tokens, 1, big, 2)]
        return passes


def default_flat_tokens(model: StepModel, max_rows: int, verify_width: int) -> int:
    """Where multi-token passes stop running flat by default. With attention that reads each
    row's cache slot in place, every pass up to `MAX_FLAT_TOKENS` runs flat, prefills included:
    a batch of prompts then costs its real tokens, not rows x the longest prompt (8 chat prompts
    of 46-67 tokens: 440 real tokens in a grid of 552). Otherwise attention gathers each flat
    row's keys, and only jump-forward and verification passes run flat."""
    if getattr(model, "attends_in_place", False):
        return MAX_FLAT_TOKENS
    return max(2, max_rows) * max(4, verify_width)


def _split_row(p: Pass) -> Pass:
    """One row of T tokens as two rows of ceil(T/2) tokens on the same cache slot."""
    t = p.tokens.shape[1]
    h = (t + 1) // 2
    tokens = np.zeros((2, h), dtype=np.int64)
    positions = np.full((2, h), -1, dtype=np.int64)
    tokens[0] = p.tokens[0, :h]
    positions[0] = p.positions[0, :h]
    tokens[1, : t - h] = p.tokens[0, h:]
    positions[1, : t - h] = p.positions[0, h:]
    # A flat index `k` into [1, t] is the same flat index `k` into [2, h]: `last` is unchanged.
    return Pass(tokens, positions, np.repeat(p.slots[:1], 2), p.last, p.kv_len)


def _flatten(p: Pass) -> Pass:
    """A multi-token pass as one row per real token (a decode pass); its `last` names, for each
    entry of `p.last`, the row that now holds that token (padding entries: row 0)."""
    real = np.flatnonzero(p.positions.reshape(-1) >= 0)
    row_of = np.zeros(p.tokens.size, dtype=np.int64)
    row_of[real] = np.arange(len(real))
    tokens = p.tokens.reshape(-1)[real]
    positions = p.positions.reshape(-1)[real]
    slots = np.repeat(p.slots, p.tokens.shape[1])[real]
    if len(real) < 2:  # a pass has 2 rows at least (module docstring): one padding row
        tokens, positions, slots = (
            np.append(tokens, 0),
            np.append(positions, -1),
            np.append(slots, p.slots[-1]),
        )
    return Pass(tokens.reshape(-1, 1), positions.reshape(-1, 1), slots, row_of[p.last], p.kv_len)


def graph_kind(p: Pass, max_rows: int) -> str:
    """Which dynamic graph runs `p` (module docstring): "decode", "wide" or "multi"."""
    rows, tokens = p.tokens.shape
    if tokens > 1:
        return "multi"
    return "wide" if rows > max(2, max_rows) else "decode"


class CompileCounter:
    """Graphs compiled by torch.compile in this process; after `ready()`, each new one is a
    compile while serving (a request waited for it) and is counted in `after_ready`."""

    def __init__(self, on_compile: Callable[[int], None] | None = None) -> None:
        self._on_compile = on_compile
        self._ready_at: int | None = None
        self.after_ready = 0

    @staticmethod
    def graphs() -> int:
        from torch._dynamo.utils import counters

        return int(counters["stats"]["unique_graphs"])

    def ready(self) -> None:
        self._ready_at = self.graphs()

    def check(self) -> None:
        """Call after each step: counts graphs compiled since the last check."""
        if self._ready_at is None:
            return
        now = self.graphs()
        if now > self._ready_at:
            new = now - self._ready_at
            self.after_ready += new
            self._ready_at = now
            log.warning("%d graph(s) compiled while serving (a request waited for it)", new)
            if self._on_compile is not None:
                self._on_compile(new)
