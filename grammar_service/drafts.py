"""Speculative drafts on the grammar side: which drafts the grammar accepts, and drafts of the text
it forces (`StepRow.forced_draft_room`).

A worker drafts without knowing what the grammar will force. When a row gets jump-forward tokens,
its drafts of what is forced *beyond* them replace the worker's own (`of_forced`); when a row's
drafts all pass and end where the grammar forces bytes (a closed JSON string), they are extended by
those bytes' tokens (`forced_tail`). Everything goes through the `Backend` protocol; the grammar
state is left as it was.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

from grammar_service.backend import Backend, RequestGrammar
from grammar_service.reasoning import ReasoningGate
from maskwire.tokenizer import Tokenizer

# Bytes of forced text looked at per forced draft.
_MAX_TOKEN_BYTES = 32


class Checked(NamedTuple):
    """A row's drafts after the grammar's check: the drafts to answer with, how many lead the
    grammar accepts, and for drafts extended by a forced tail, (start, count) of the forced
    tokens among them."""

    drafts: list[int]
    accepted: int
    jump: tuple[int, int] | None = None


class Drafter:
    """Checks one stream's drafts (its tokenizer) and drafts what its grammars force."""

    def __init__(self, backend: Backend, tok: Tokenizer) -> None:
        self.backend = backend
        self.tok = tok
        self.vocab = tok.vocab_size

    def _tokens(self, data: bytes) -> list[int]:
        return self.backend.tokenize_bytes(self.tok, data)

    def _in_range(self, drafts: Sequence[int]) -> int:
        """How many leading drafts are token ids of the vocabulary."""
        vocab = self.vocab
        return next((j for j, t in enumerate(drafts) if not 0 <= t < vocab), len(drafts))

    def unconstrained(self, gate: ReasoningGate, drafts: list[int]) -> int:
        """Drafts of a reasoning part are all acceptable, up to (not including) the one that
        would end it: the position after it needs a constrained mask row."""
        cut = self._in_range(drafts)
        end = gate.would_end(drafts[:cut], self.tok.token_bytes)
        return cut if end is None else end

    def of_forced(self, g: RequestGrammar, room: int) -> list[int]:
        """Up to `room` drafts of the bytes the grammar forces but cannot tokenize yet (after
        its jump-forward tokens were consumed)."""
        # A long forced literal: tokenize no more than the drafts can use.
        tail = g.ff_bytes()[: room * _MAX_TOKEN_BYTES]
        return self._tokens(tail)[:room] if tail else []

    def check(
        self, g: RequestGrammar, drafts: list[int], tail_room: int, jump_forward: bool
    ) -> Checked:
        """How many leading `drafts` the grammar accepts; with `tail_room`, drafts that all pass
        are extended by the forced tail after them (`forced_tail`)."""
        cut = self._in_range(drafts)
        accepted = g.validate_drafts(drafts[:cut]) if cut else 0
        if drafts and accepted == len(drafts) and tail_room:
            extended = self.forced_tail(g, drafts, tail_room, jump_forward)
            if extended is not None:
                longer, at, count = extended
                return Checked(longer, g.validate_drafts(longer), (at, count))
        return Checked(drafts, accepted)

    def forced_tail(
        self, g: RequestGrammar, drafts: list[int], room: int, jump_forward: bool
    ) -> tuple[list[int], int, int] | None:
        """`drafts` (all valid) extended by what the grammar forces once they are consumed (the
        next key after drafts that close a JSON string), as a step without speculation would
        produce it: the last draft re-tokenized with the forced bytes after it as the model
        writes them (`"` then `, "city": "` is `",`), the tokens jump-forward forces after that
        (` "` `city` `":`), then drafts of the bytes forced beyond them (` "`). Returns the
        drafts and where the forced tokens start among them and how many there are; None when
        nothing is forced there or more than `room` drafts would be added."""
        if not g.consume(drafts):
            return None  # not reached: the drafts were just validated
        try:
            forced = g.ff_bytes()
        finally:
            g.rollback(len(drafts))
        if not forced:
            return None
        head = drafts[:-1]
        last = self._tokens(self.tok.token_bytes(drafts[-1]) + forced[:_MAX_TOKEN_BYTES])[0]
        # Checked before it is consumed: a token the grammar refuses would leave it in error.
        if g.validate_drafts([*head, last]) < len(drafts) or not g.consume([*head, last]):
            return None
        consumed = len(drafts)
        try:
            jump = g.ff_tokens() if jump_forward else []
            if len(jump) > room or (jump and not g.consume(jump)):
                return None
            consumed += len(jump)
            rest = g.ff_bytes()[: room * _MAX_TOKEN_BYTES]
            beyond = self._tokens(rest)[: room - len(jump)] if rest else []
        finally:
            g.rollback(consumed)
        return [*head, last, *jump, *beyond], len(drafts), len(jump)
