"""CPU accounting for the per-request grammar budgets (`Limits.max_request_step_s`, `max_replay_s`).

Grammar work done for one request alone is timed on that request's `CpuMeter` (this thread's CPU
time: llguidance holds the GIL for a whole call, so wall time would count other threads' work).
"""

from __future__ import annotations

import time

from grammar_service.backend import RequestGrammar

# Tokens consumed per call when a long run (replay, forced tokens) is checked against its budget.
_CHUNK = 32


class CpuMeter:
    """`with meter:` adds the CPU time this thread spends inside to `meter.spent`."""

    __slots__ = ("_start", "spent")

    def __init__(self) -> None:
        self.spent = 0.0
        self._start = 0.0

    def __enter__(self) -> CpuMeter:
        self._start = time.thread_time()
        return self

    def __exit__(self, *exc: object) -> None:
        self.spent += time.thread_time() - self._start

    def elapsed(self) -> float:
        """CPU time since the current `with` began."""
        return time.thread_time() - self._start


def consume_within(
    grammar: RequestGrammar, tokens: list[int], budget_s: float, meter: CpuMeter
) -> bool:
    """Consume `tokens` in chunks until done, rejected, or past `budget_s` of CPU time in this
    call (chunks keep each llguidance call short), timed on `meter`. Returns whether every token
    was accepted; past the budget the rest is left unconsumed, and `meter.spent` says so."""
    with meter:
        for at in range(0, len(tokens), _CHUNK):
            if not grammar.consume(tokens[at : at + _CHUNK]):
                return False
            if meter.elapsed() > budget_s and at + _CHUNK < len(tokens):
                return False
    return True
