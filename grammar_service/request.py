"""One live request on a Session stream, and the errors its rows are answered with.

A request that fails keeps its error (`dead`): every later row for it is answered with that error
until the worker closes it.
"""

from __future__ import annotations

import grpc
from google.rpc import status_pb2

from grammar_service import metrics
from grammar_service.backend import RequestGrammar
from grammar_service.reasoning import ReasoningGate
from grammar_service.schema.monitor import Monitor
from maskwire.rpc import status_proto


class Request:
    """One live request: its grammar, token count, options and output check."""

    __slots__ = ("dead", "gate", "grammar", "jump_forward", "monitor", "position", "request_id")

    def __init__(
        self,
        request_id: str,
        grammar: RequestGrammar,
        jump_forward: bool,
        gate: ReasoningGate | None,
        monitor: Monitor | None = None,
    ) -> None:
        self.request_id = request_id
        self.grammar = grammar
        self.jump_forward = jump_forward
        self.gate = gate
        self.monitor = monitor
        self.position = 0
        self.dead: status_pb2.Status | None = None

    def kill(self, message: str, reason: str) -> None:
        self.dead = row_error(message, reason)

    def kill_by_grammar(self) -> None:
        err = self.grammar.error() or "the grammar rejected the token"
        self.dead = row_error(err, "TOKEN_REJECTED")

    def kill_expensive(self, spent: float, budget: float) -> None:
        metrics.BUDGET_KILLS.inc()
        self.kill(
            f"the grammar took {spent * 1e3:.0f} ms of work in one step for this request "
            f"(limit {budget * 1e3:g} ms, --max-request-step-ms): it is too ambiguous or too "
            "expensive to follow",
            "GRAMMAR_TOO_EXPENSIVE",
        )

    def kill_unconsumed(self, spent: float, budget: float) -> None:
        """A run of tokens was not consumed: rejected by the grammar, or cut at the budget."""
        if spent > budget:
            self.kill_expensive(spent, budget)
        else:
            self.kill_by_grammar()

    def unsatisfied(self, why: str) -> None:
        metrics.SCHEMA_UNSATISFIED.inc()
        self.kill(f"constraint could not be satisfied: {why}", "CONSTRAINT_UNSATISFIABLE")


def row_error(message: str, reason: str) -> status_pb2.Status:
    return status_proto(grpc.StatusCode.INVALID_ARGUMENT, message, reason=reason)


def unknown_request(rid: str) -> status_pb2.Status:
    return status_proto(
        grpc.StatusCode.NOT_FOUND,
        f"no live request {rid!r} on this stream",
        reason="UNKNOWN_REQUEST",
    )
