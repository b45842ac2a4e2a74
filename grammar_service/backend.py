"""The narrow interface between the session protocol and a grammar engine; llguidance implements it.

A `Backend` turns a compiled grammar into per-request `RequestGrammar`s, does the batched work
of a step (consume one token for many requests, fill many mask rows) and splits text into the
tokens the model would write (for drafts of forced text). A `RequestGrammar` is one request's
parser state. Errors are state (`error()`), never exceptions, as in llguidance.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import llguidance

from grammar_service.compiler import CompiledGrammar, clean_error
from maskwire.cpus import available_cpus
from maskwire.tokenizer import Tokenizer


class RequestGrammar(Protocol):
    """One request's grammar state."""

    def consume(self, tokens: Sequence[int]) -> bool: ...
    def validate_drafts(self, tokens: Sequence[int]) -> int: ...
    def rollback(self, n: int) -> bool: ...
    def ff_tokens(self) -> list[int]: ...
    def ff_bytes(self) -> bytes: ...
    def is_accepting(self) -> bool: ...
    def is_stopped(self) -> bool: ...
    def error(self) -> str: ...


class Backend(Protocol):
    """Creates request grammars and does a step's batched work."""

    def new_request(self, compiled: CompiledGrammar) -> RequestGrammar: ...

    def consume_each(self, pairs: Sequence[tuple[RequestGrammar, int]]) -> list[bool]:
        """Consume one token in each of many requests."""
        ...

    def fill(
        self,
        rows: Sequence[tuple[RequestGrammar, int]],
        draft_rows: Sequence[tuple[RequestGrammar, int, list[int]]],
        buffer_ptr: int,
        one_mask_bytes: int,
        n_slots: int,
    ) -> None:
        """Write mask rows at `buffer_ptr + slot * one_mask_bytes`. For `draft_rows`, the
        request's main row goes at `slot` and the row after each draft `i` at `slot + 1 + i`
        (every draft must be accepted). The buffer holds `n_slots` rows."""
        ...

    def tokenize_bytes(self, tokenizer: Tokenizer, data: bytes) -> list[int]:
        """`data` as `tokenizer` splits it: the tokens the model would write for it."""
        ...


class LlgRequest:
    """`RequestGrammar` over an `llguidance.LLMatcher`."""

    __slots__ = ("matcher",)

    def __init__(self, matcher: llguidance.LLMatcher) -> None:
        self.matcher = matcher

    def consume(self, tokens: Sequence[int]) -> bool:
        return bool(self.matcher.consume_tokens(list(tokens)))

    def validate_drafts(self, tokens: Sequence[int]) -> int:
        # llguidance's validate_tokens stops before EOS; a draft EOS is left to the sampler, which
        # sees it allowed in the mask row of that position when the grammar is accepting.
        return int(self.matcher.validate_tokens(list(tokens)))

    def rollback(self, n: int) -> bool:
        return bool(self.matcher.rollback(n))

    def ff_tokens(self) -> list[int]:
        return list(self.matcher.compute_ff_tokens())

    def ff_bytes(self) -> bytes:
        return bytes(self.matcher.compute_ff_bytes())

    def is_accepting(self) -> bool:
        return bool(self.matcher.is_accepting())

    def is_stopped(self) -> bool:
        return bool(self.matcher.is_stopped())

    def error(self) -> str:
        return clean_error(self.matcher.get_error()) if self.matcher.is_error() else ""


class LlgBackend:
    """llguidance: matchers copied from the compiled template, `LLExecutor` for batched work.

    The executor gets every CPU the process may use by default (`maskwire.cpus`: the affinity
    mask capped by the container's CPU limit); llguidance's own default is 80% of the node's
    CPUs, which is one thread on a 2-CPU machine and dozens under a 2-CPU limit on a big node. Small batches skip it: handing
    a few rows to the executor's threads and waiting costs more than filling them here
    (measured on 2 CPUs, Tekken: 8 rows 83 µs here vs 92-142 µs through the executor).
    """

    # Below these many rows the executor's fan-out costs more than it saves.
    PAR_CONSUME_MIN = 8
    PAR_FILL_MIN = 16

    def __init__(self, threads: int | None = None) -> None:
        self.threads = threads or available_cpus()
        self.executor = llguidance.LLExecutor(num_threads=self.threads)

    def new_request(self, compiled: CompiledGrammar) -> LlgRequest:
        return LlgRequest(compiled.new_matcher())

    def consume_each(self, pairs: Sequence[tuple[RequestGrammar, int]]) -> list[bool]:
        if len(pairs) >= self.PAR_CONSUME_MIN:
            return list(
                self.executor.consume_token_par(
                    [(g.matcher, t) for g, t in pairs]  # type: ignore[attr-defined]
                )
            )
        return [bool(g.matcher.consume_token(t)) for g, t in pairs]  # type: ignore[attr-defined]

    def fill(
        self,
        rows: Sequence[tuple[RequestGrammar, int]],
        draft_rows: Sequence[tuple[RequestGrammar, int, list[int]]],
        buffer_ptr: int,
        one_mask_bytes: int,
        n_slots: int,
    ) -> None:
        if 0 < len(rows) < self.PAR_FILL_MIN:
            for g, slot in rows:
                g.matcher.unsafe_compute_mask_ptr(  # type: ignore[attr-defined]
                    buffer_ptr + slot * one_mask_bytes, one_mask_bytes
                )
        elif rows:
            self.executor.unsafe_compute_mask_ptr(
                [(g.matcher, slot) for g, slot in rows],  # type: ignore[attr-defined]
                buffer_ptr,
                one_mask_bytes,
                n_slots,
            )
        if draft_rows:
            # Writes slot + len(drafts) + 1 rows: the caller reserved them (and passes only the
            # accepted prefix, so nothing is written past the reservation).
            self.executor.unsafe_compute_mask_ptr_with_draft_token(
                [(g.matcher, slot, d) for g, slot, d in draft_rows],  # type: ignore[attr-defined]
                buffer_ptr,
                one_mask_bytes,
                n_slots,
            )

    def tokenize_bytes(self, tokenizer: Tokenizer, data: bytes) -> list[int]:
        return list(tokenizer.ll.tokenize_bytes(data))
