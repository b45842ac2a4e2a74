"""What a step does with tokens once they are known: the grammar's answer (its forced tokens,
ends and failures) and sampled tokens (EOS, stop ids, stop strings, the length limits). Every
path that adds tokens to a request, prefill, decode and speculative commit alike, goes through
here, and ends the request through the engine's `finish`."""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Protocol

from neuron_worker.events import EngineError, ErrorKind, FinishReason
from neuron_worker.grammar_client import RowOutcome
from neuron_worker.metrics import Metrics
from neuron_worker.request import Request, TokenLogprob
from neuron_worker.step_device import Sampled
from neuron_worker.step_rows import Draw

FR = FinishReason


def _empty_language() -> EngineError:
    return EngineError(
        ErrorKind.INVALID_ARGUMENT,
        "the constraint matches no output at all (its language is empty)",
        [("constraint", "matches nothing")],
        reason="EMPTY_LANGUAGE",
    )


class Finish(Protocol):
    """The engine's end of a request (`Engine.finish`)."""

    def __call__(
        self,
        req: Request,
        reason: FinishReason,
        *,
        stop_string: str = "",
        error: str = "",
        status: Exception | None = None,
    ) -> None: ...


class Ledger:
    """Token bookkeeping for the step loop (module docstring)."""

    def __init__(
        self,
        *,
        vocab_size: int,
        eos_ids: Sequence[int],
        max_seq_len: int,
        metrics: Metrics,
        finish: Finish,
    ) -> None:
        self.vocab_size = vocab_size
        self.eos_ids = tuple(eos_ids)
        self.max_seq_len = max_seq_len
        self.metrics = metrics
        self.finish = finish

    def room(self, r: Request) -> int:
        """Tokens the request may still add (max_tokens and the context limit)."""
        return min(r.sampling.max_tokens - len(r.output), self.max_seq_len - r.seq_len)

    def apply_answer(self, r: Request, out: RowOutcome | None) -> list[int] | None:
        """The grammar's answer for a request, at prefill or in a decode step: errors, forced
        tokens (appended), ends. Returns the forced tokens, or None when the request finished.
        Before a request's first draw nothing was streamed, so a failure is a status instead of
        a half answer; after it, the final message's `error`."""
        if out is None:
            return []
        first = r.sampled == 0
        if not out.ok:
            if first:
                self.finish(r, FR.ERROR, status=out.status())
            else:
                self.finish(r, FR.ERROR, error=f"constraint failed: {out.error}")
            return None
        ff = out.ff_tokens
        if ff and self.append(r, ff, forced=True):
            return None  # finished (stop string or length) inside the forced tokens
        if out.finished and not out.accepting:
            # The grammar can produce nothing more and is not complete. Ending with `stop`
            # would pass a non-matching output off as success; at the first step the
            # constraint's language is empty.
            if first:
                self.finish(r, FR.ERROR, status=_empty_language())
            else:
                error = "constraint failed: dead end before a match"
                self.finish(r, FR.ERROR, error=error)
            return None
        if out.finished:
            self.finish(r, FR.STOP)
            return None
        return ff

    def accept_draws(self, draws: Sequence[Draw | None], sampled: Sampled) -> None:
        """Each draw's token (None, or a request that left: ignored)."""
        count = 0
        for i, (draw, tok) in enumerate(zip(draws, sampled.tokens, strict=False)):
            if draw is None or draw.req.finished:
                continue
            count += 1
            self.accept(draw.req, tok, sampled.logprobs[i] if sampled.logprobs else None)
        self.metrics.tokens(count, 0)

    def accept(self, req: Request, tok: int, logprob: TokenLogprob | None = None) -> None:
        """A sampled token: end the request or make it the next step's pending token."""
        req.sampled += 1
        if req.first_token_at is None:
            req.first_token_at = time.monotonic()
        if tok < 0 or tok >= self.vocab_size:
            self.finish(
                req,
                FR.ERROR,
                error="the constraint allows no token here (grammar dead end)",
            )
            return
        s = req.sampling
        if tok in s.stop_token_ids or (
            tok in self.eos_ids and not (s.ignore_eos and req.grammar is None)
        ):
            self.finish(req, FR.STOP)
            return
        if self.append(req, [tok], forced=False, logprob=logprob):
            return
        req.pending = tok

    def append(
        self,
        req: Request,
        tokens: list[int],
        *,
        forced: bool,
        logprob: TokenLogprob | None = None,
    ) -> bool:
        """Add tokens within the request's limits; True when the request finished."""
        take = tokens[: max(self.room(req), 0)]
        stop = req.append(take, forced=forced, logprob=logprob) if take else None
        if forced:
            self.metrics.tokens(0, len(take))
        if stop is not None:
            self.finish(req, FR.STOP_STRING, stop_string=stop)
            return True
        if len(take) < len(tokens) or self.room(req) <= 0:
            self.finish(req, FR.LENGTH)
            return True
        return False
