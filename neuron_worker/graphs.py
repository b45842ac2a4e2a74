"""One forward pass as the engine runs it: the shapes its graphs take, the graphs, warm-up, and
the count of graphs compiled after warm-up (which must stay 0).

The engine describes a pass as rows of tokens (host arrays padded to `shape(...)`); the runner
puts them on the device and runs the model's `step_logits` (or `prefill_logits`, see Roles),
which returns the logits `Pass.last` names.
Two shape policies:

* **Buckets** (XLA, where every distinct shape is a graph): rows, tokens per row and the KV length
  are each padded to a bucket; every (rows, tokens, kv) bucket is one graph, all traced at warm-up.
* **Dynamic** (`torch.compile` on CPU/CUDA, and eager): `decode` takes one token per row,
  `multi` several (prefill, jump-forward, speculative verification). Rows (2..max), tokens per
  row (2..max), logits rows (2..max) and the KV length (2..max) are symbolic, so no request
  shape can need a new graph. Passes are padded to 2 rows at least: a 1-row decode gets a
  padding row; a 1-row multi-token pass is split into two half-rows on the same cache slot (the
  second attends the first's keys, written earlier in the same layer), which costs nothing.
  Symbolic sizes start at 2 because torch specializes sizes 0 and 1.
  **Flat passes**: a multi-token pass of at most `flat_tokens` real tokens runs instead as one
  token per row, each on its row's cache slot (the same trick as the split: a token attends the
  keys its row's earlier tokens wrote in the same layer), through the `decode` graph. A
  jump-forward or verification pass is mostly padding in the [rows x tokens] grid (8 rows, one
  with 5 forced tokens, is 48 tokens for 12 real ones); flat, its matmuls see only the real
  tokens. Where attention reads the cache in place, prefills of up to `MAX_FLAT_TOKENS` run flat
  too (`default_flat_tokens`), and a larger pass runs as consecutive flat chunks (`chunked`), so
  `multi` is never used there.
  **Roles**: a model with weight-only quantized projections (`quantized`) runs passes over
  prompts (`Pass.prefill`) through `prefill_logits` (dense weights) and the others through
  `step_logits` (quantized), each with its own graphs (kinds `prefill`, `prefill_multi`). The
  role, not the size, picks the weights, so a token's logits do not depend on what shares its
  pass (`neuron_worker.model.linear`).

Which logits a pass returns: one per entry of `Pass.last`, a flat index into the [rows x tokens]
grid. A decode pass names each of its rows; a flat pass, only the tokens whose logits are wanted
(the LM head runs for those alone); a verification pass, the draft positions of every row but
the grammar's forced ones (`verify_width` per row at most; bucketed: the logits rows are padded
to rows x `verify_width` for such passes, one more graph per forward bucket).
"""

from __future__ import annotations

import logging
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol, cast

import numpy as np
import torch
from torch import Tensor, nn

from neuron_worker.backends import Backend
from neuron_worker.cuda_graphs import DecodeGraphs
from neuron_worker.model.fused_decode import FusedDecode, unsupported
from neuron_worker.model.llama import Transformer
from neuron_worker.saved_graphs import SavedGraphs
from neuron_worker.scheduler import bucket_for, forward_shapes

log = logging.getLogger(__name__)

# KV lengths are rounded up to this many positions (aligned attention reads, fewer distinct
# shapes for the bucketed policy's neighbours).
KV_ALIGN = 64
# The dynamic graphs' kinds and symbolic ranges are versioned by `compile_cache.GRAPH_LAYOUT`:
# bump it when a kind's range changes.
# Flat passes run at most this many rows (larger ones in chunks, where attention reads in place):
# without that kernel a flat row gathers its slot's KV (~1.5 MB per row at a 2048 KV length for
# SmolLM2), and the largest pass runs at warm-up.
MAX_FLAT_TOKENS = 512


class StepModel(Protocol):
    """What the runner needs of a model (`neuron_worker.model.Transformer`, or a stand-in)."""

    config: Any  # .vocab_size (logits dimension), .max_seq_len, .name

    def setup_caches(self, max_batch: int, max_seq: int) -> None: ...

    def copy_slot(self, src: int | Tensor, dst: int | Tensor, length: int) -> None: ...

    def step_logits(
        self,
        tokens: Tensor,
        input_pos: Tensor,
        cache_slots: Tensor,
        kv_positions: Tensor,
        last: Tensor,
    ) -> Tensor: ...

    # A model whose `quantized` is true also has `prefill_logits` (same arguments), for passes
    # over prompts (`Pass.prefill`); the others run every pass through `step_logits`.


@dataclass(frozen=True)
class Pass:
    """A forward pass as host arrays, already padded: tokens/positions int64 [rows, tokens]
    (position -1 = padding), slots int64 [rows], last int64 [logits rows]: flat indices
    `row * tokens + column` of the tokens whose logits the pass returns (one token per row:
    rows; a decode pass names each of its rows), kv_len. `prefill`: a pass over prompts
    (`Transformer.prefill_logits`), not over tokens the requests generated. `copies`: (source
    slot, destination slot, length) K/V prefixes copied before the pass."""

    tokens: np.ndarray
    positions: np.ndarray
    slots: np.ndarray
    last: np.ndarray
    kv_len: int
    prefill: bool = False
    copies: tuple[tuple[int, int, int], ...] = ()


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
        fused_decode: bool = False,
    ) -> None:
        """Buckets given: the bucket policy (all three must be); none: dynamic shapes.
        `verify_width`: logits rows per row of a verification pass (1 + drafts; 1 = none).
        `flat_tokens`: the most real tokens of a multi-token pass run flat (module docstring;
        dynamic policy only; None = `max_rows * max(4, verify_width)`, 0 = never; at most
        `MAX_FLAT_TOKENS`). `graph_dir`: compiled dynamic graphs are saved there and loaded
        from there (`neuron_worker.saved_graphs`; CPU only). `fused_decode`: passes of one token
        per row run `neuron_worker.model.fused_decode` where it serves the model (dynamic policy
        only), not a graph."""
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
        # Where attention reads the cache in place, a multi-token pass of more than
        # `flat_tokens` runs flat too, in chunks: no pass ever needs the `multi` graph.
        self.chunked = self.flat_tokens > 0 and bool(getattr(model, "attends_in_place", False))
        self.flat_rows = max(2, max_rows, self.flat_tokens)  # rows of a one-token-per-row pass
        self.dynamic = backend.compile_enabled and not self.bucketed
        self._functions = self._pass_functions()
        self._saved = self._saved_graphs(graph_dir)
        self._kv: Tensor | None = None
        self._cuda_graphs = self._decode_graphs()
        # Decode passes through `FusedDecode` where it serves the model (`_fused_step`).
        self.fused_decode = fused_decode and not self.bucketed
        self._fused: FusedDecode | None = None

    def _pass_functions(self) -> dict[str, Callable[..., Tensor]]:
        """The pass functions by name, compiled where the backend compiles: `prefill_logits`
        only where it differs (`Pass.prefill`). Each compiled function's one-token-per-row and
        multi-token graphs differ in the token dimension, static 1 in one and symbolic in the
        other."""
        names = ["step_logits"]
        if getattr(self.model, "quantized", False):
            names.append("prefill_logits")
        functions: dict[str, Callable[..., Tensor]] = {}
        for name in names:
            fn = getattr(self.model, name)
            if self.backend.compile_enabled:
                fn = self.backend.compile(
                    fn, name=name.removesuffix("_logits"), dynamic=self.dynamic
                )
            functions[name] = fn
        return functions

    def _saved_graphs(self, graph_dir: Path | None) -> SavedGraphs | None:
        """The compiled dynamic graphs saved to and loaded from `graph_dir` (None: not saved)."""
        model = self.model
        if not (self.dynamic and graph_dir is not None and isinstance(model, nn.Module)):
            return None
        ranges = (
            # The KV cache's slots (the padding one last) are a static size in every graph.
            f"rows{self.max_rows} slots{self.pad_slot + 1} seq{self.max_seq} "
            f"verify{self.verify_width} "
            f"flat{self.flat_tokens}"
        )
        return SavedGraphs(
            model,
            graph_dir,
            ranges=ranges,
            mark_dynamic=self._mark_dynamic,
            fallbacks=self._functions,
        )

    def _decode_graphs(self) -> DecodeGraphs | None:
        """Decode passes of up to a step's widest (every row with its drafts) replay CUDA
        graphs (None: no CUDA graphs)."""
        if not (self.backend.cuda_graphs and self.dynamic):
            return None
        return DecodeGraphs(
            self._functions["step_logits"],
            widest=min(self.flat_rows, max(2, self.max_rows) * self.verify_width),
            max_seq=self.max_seq,
            pad_slot=self.pad_slot,
            mark_dynamic=self._mark_dynamic,
        )

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
    def copy_prefixes(self, copies: Sequence[tuple[int, int, int]]) -> None:
        """Device thread: K/V prefix copies (source slot, destination slot, length) between
        cache slots, in order. Bucketed, each copy is a graph of its own (cut before the pass
        that follows, whose graph would otherwise change) with the slots as device tensors, so
        one graph per length bucket serves every pair of slots (warmed up)."""
        for src, dst, length in copies:
            if not self.bucketed:
                self.model.copy_slot(src, dst, length)
                continue
            slots = self.backend.to_device(torch.tensor([src, dst], dtype=torch.int64))
            self.model.copy_slot(slots[:1], slots[1:], length)
            self.backend.mark_step()

    def run(self, p: Pass) -> Tensor:
        """Device thread: logits [len(p.last), vocab] float32 (padding entries: garbage)."""
        if p.tokens.shape[1] > 1:
            real = int((p.positions >= 0).sum())
            if self.chunked and real > self.flat_tokens:
                return self._run_chunks(_flatten(p))
            if 0 < real <= self.flat_tokens:
                return self._run_graph(_flatten(p))
            if not self.bucketed and p.tokens.shape[0] == 1:
                return self._run_graph(_split_row(p))
        return self._run_graph(p)

    def _run_chunks(self, flat: Pass) -> Tensor:
        """A flat pass of more than `flat_tokens` rows as consecutive flat passes of at most
        that many: a row's later tokens attend the keys its earlier ones wrote in an earlier
        chunk, so the logits are those of one pass."""
        pieces: list[Tensor] = []
        order: list[np.ndarray] = []
        for begin in range(0, flat.tokens.shape[0], self.flat_tokens):
            end = begin + self.flat_tokens
            wanted = np.flatnonzero((flat.last >= begin) & (flat.last < end))
            logits = self._run_graph(_chunk(flat, begin, end, flat.last[wanted] - begin))
            pieces.append(logits[: len(wanted)])
            order.append(wanted)
        inverse = np.empty(len(flat.last), dtype=np.int64)
        inverse[np.concatenate(order)] = np.arange(len(flat.last))
        with self.backend.inference_mode():
            index = self.backend.to_device(torch.from_numpy(inverse))
            return torch.cat(pieces).index_select(0, index)

    def _run_graph(self, q: Pass) -> Tensor:
        backend = self.backend
        prefill = q.prefill and "prefill_logits" in self._functions
        function = "prefill_logits" if prefill else "step_logits"
        graphs = self._cuda_graphs
        one_token = q.tokens.shape[1] == 1
        if (
            graphs is not None
            and not prefill
            and one_token
            and graphs.covers(q.tokens.shape[0], q.kv_len)
        ):
            with backend.inference_mode():
                last = backend.to_device(torch.from_numpy(q.last))
                return graphs.run(q.tokens, q.positions, q.slots, last, q.kv_len)
        fused = self._fused_step() if one_token and not prefill else None
        if fused is not None:
            return self._run_fused(fused, q)
        with backend.inference_mode():
            args = (
                backend.to_device(torch.from_numpy(q.tokens)),
                backend.to_device(torch.from_numpy(q.positions)),
                backend.to_device(torch.from_numpy(q.slots)),
                self._kv_positions(q.kv_len),
                backend.to_device(torch.from_numpy(q.last)),
            )
            kind = graph_kind(q, prefill)
            if self._saved is not None:
                logits = self._saved(kind, function, args)
            else:
                if self.dynamic:
                    self._mark_dynamic(kind, args)
                logits = self._functions[function](*args)
            backend.mark_step()
            backend.sync()
        return logits

    def _run_fused(self, fused: FusedDecode, q: Pass) -> Tensor:
        """A pass of one token per row through the fused step, less its trailing padding rows:
        the shapes that keep graphs general (2 rows at least) cost it a row's work (a one-row
        decode: ~20% of its time). A logits row of a padding row is garbage either way: here it
        is a copy of the last real row's."""
        real = q.tokens.shape[0]
        while real > 1 and q.positions[real - 1, 0] < 0:
            real -= 1
        with self.backend.inference_mode():
            return fused(
                torch.from_numpy(q.tokens[:real]),
                torch.from_numpy(q.positions[:real]),
                torch.from_numpy(q.slots[:real]),
                self._kv_positions(q.kv_len),
                torch.from_numpy(np.minimum(q.last, real - 1)),
            )

    def _fused_step(self) -> FusedDecode | None:
        """The fused decode step on the model's current KV caches (built at first use, again
        after `setup_caches`), or None where it is off or cannot serve the model."""
        if not self.fused_decode:
            return None
        model = self.model
        if self._fused is None or not self._fused.serves(cast(Transformer, model)):
            reason = unsupported(cast(nn.Module, model))
            if reason is not None:
                log.info("decode passes run the model's graphs: no fused decode step (%s)", reason)
                self.fused_decode = False
                return None
            if self._fused is not None:
                self._fused.close()
            self._fused = FusedDecode(cast(Transformer, model))
            log.info("decode passes run the fused decode step (one C++ call per pass)")
        return self._fused

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
        multi = kind.endswith("multi")
        high = rows_max if multi else self.flat_rows  # a flat pass: one row per token
        for t in (tokens, pos):
            torch._dynamo.mark_dynamic(t, 0, min=2, max=high)
            if multi:
                torch._dynamo.mark_dynamic(t, 1, min=2, max=self.max_seq)
        torch._dynamo.mark_dynamic(slots, 0, min=2, max=high)
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
        for rows, tokens, kv, outputs, prefill in self._warmup_shapes():
            pos = np.full((rows, tokens), -1, dtype=np.int64)
            slots = np.full(rows, self.pad_slot, dtype=np.int64)
            self.run(
                Pass(
                    np.zeros((rows, tokens), dtype=np.int64),
                    pos,
                    slots,
                    np.zeros(outputs, np.int64),
                    kv,
                    prefill,
                )
            )
            role = " prefill" if prefill else ""
            on_graph(f"forward{role} rows={rows} tokens={tokens} kv_len={kv} logits={outputs}")
            count += 1
        if self.bucketed:  # prefix copies (the prefix cache, n > 1): one graph per length
            for length in self.seq_buckets:
                self.copy_prefixes([(self.pad_slot, self.pad_slot, length)])
                on_graph(f"prefix copy length={length}")
                count += 1
        if self._cuda_graphs is not None:
            with self.backend.inference_mode():
                count += self._cuda_graphs.capture(self._kv_positions(self.max_seq), on_graph)
        return count

    def _warmup_shapes(self) -> list[tuple[int, int, int, int, bool]]:
        """(rows, tokens, kv_len, logits rows, prefill) of every pass to run at warm-up."""
        roles = [False, True] if "prefill_logits" in self._functions else [False]
        if self.bucketed:
            shapes = forward_shapes(self.batch_buckets, self.token_buckets, self.seq_buckets)
            out = [(n, t, kv, n, role) for role in roles for n, t, kv in shapes]
            if self.verify_width > 1:  # verification passes: every multi-token bucket, wide
                out += [(n, t, kv, n * self.verify_width, False) for n, t, kv in shapes if t > 1]
            return out
        # Both ends of every symbolic range: the graphs must cover them without recompiling.
        small, big = max(2, KV_ALIGN), self.max_seq
        rows = max(2, self.max_rows)
        logits = max(2, rows * self.verify_width)
        passes = []
        for prefill in roles:
            outputs = rows if prefill else logits
            passes += [(2, 1, small, 2, prefill), (self.flat_rows, 1, big, outputs, prefill)]
            if not self.chunked:  # else every multi-token pass runs flat
                passes += [(2, 2, small, 2, prefill), (rows, min(64, big), big, outputs, prefill)]
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
    return Pass(tokens, positions, np.repeat(p.slots[:1], 2), p.last, p.kv_len, p.prefill)


def _flatten(p: Pass) -> Pass:
    """A multi-token pass as one row per real token (a decode pass); its `last` names, for each
    entry of `p.last`, the row that now holds that token (padding entries: row 0)."""
    real = np.flatnonzero(p.positions.reshape(-1) >= 0)
    row_of = np.zeros(p.tokens.size, dtype=np.int64)
    row_of[real] = np.arange(len(real))
    slots = np.repeat(p.slots, p.tokens.shape[1])[real]
    rows = p.tokens.reshape(-1)[real], p.positions.reshape(-1)[real], slots
    return _one_token_rows(*rows, row_of[p.last], p)


def _chunk(flat: Pass, begin: int, end: int, last: np.ndarray) -> Pass:
    """Rows [begin, end) of a flat pass, returning the logits of its rows `last` (numbered
    from `begin`)."""
    padded = np.zeros(max(2, len(last)), dtype=np.int64)
    padded[: len(last)] = last
    rows = flat.tokens[begin:end, 0], flat.positions[begin:end, 0], flat.slots[begin:end]
    return _one_token_rows(*rows, padded, flat)


def _one_token_rows(
    tokens: np.ndarray, positions: np.ndarray, slots: np.ndarray, last: np.ndarray, like: Pass
) -> Pass:
    """A flat pass of these rows (1-D), with `like`'s KV length and role; fewer than 2 rows get a
    padding row (a pass has 2 rows at least: module docstring)."""
    if len(tokens) < 2:
        tokens, positions = np.append(tokens, 0), np.append(positions, -1)
        slots = np.append(slots, like.slots[-1])
    return Pass(
        tokens.reshape(-1, 1), positions.reshape(-1, 1), slots, last, like.kv_len, like.prefill
    )


def graph_kind(p: Pass, prefill: bool = False) -> str:
    """Which dynamic graph runs `p` (module docstring): "decode" (one token per row) or
    "multi", each with a "prefill" form where prompts run their own function."""
    kind = "multi" if p.tokens.shape[1] > 1 else "decode"
    if not prefill:
        return kind
    return "prefill" if kind == "decode" else "prefill_multi"


class CompileCounter:
    """Graphs compiled by torch.compile in this process; after `ready()`, each new one is a
    compile while serving (a request waited for it) and is counted in `after_ready`."""

    def __init__(self, on_compile: Callable[[int], None] | None = None) -> None:
        self._on_compile = on_compile
        self._ready_at: int | None = None
        self.after_ready = 0

    @staticmethod
    def graphs() -> int:
        # Dynamo is imported by the first compile (an eager worker never imports it: ~1 s).
        dynamo_utils = sys.modules.get("torch._dynamo.utils")
        if dynamo_utils is None:
            return 0
        return int(dynamo_utils.counters["stats"]["unique_graphs"])

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
