"""What the engine tells its callers, in its own types: the events on a request's output queue
(:class:`Delta`, :class:`Final`, or the exception that failed it) and the errors it raises
(:class:`EngineError`). The servicer (`neuron_worker.servicer`) turns them into `maskwire.v1`
messages and gRPC statuses; nothing here knows either."""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass, field

__all__ = [
    "Delta",
    "EngineError",
    "ErrorKind",
    "Final",
    "FinishReason",
    "Output",
    "TokenEntry",
    "Usage",
]


class FinishReason(enum.Enum):
    """Why a request ended (its value is the metrics label)."""

    STOP = "stop"  # EOS, a stop token id, or the grammar's end
    LENGTH = "length"  # max_tokens or the context
    STOP_STRING = "stop_string"
    ABORT = "abort"
    ERROR = "error"


class ErrorKind(enum.Enum):
    """The kinds of the engine's own errors, named as the gRPC status codes they become."""

    INVALID_ARGUMENT = enum.auto()
    FAILED_PRECONDITION = enum.auto()
    ALREADY_EXISTS = enum.auto()
    RESOURCE_EXHAUSTED = enum.auto()
    UNAVAILABLE = enum.auto()


class EngineError(Exception):
    """A request the engine refuses or fails before anything was streamed: a kind, a message
    that says what to change, (field, description) violations and a machine-readable
    reason."""

    def __init__(
        self,
        kind: ErrorKind,
        message: str,
        violations: Sequence[tuple[str, str]] = (),
        *,
        reason: str = "",
    ) -> None:
        super().__init__(message)
        self.kind = kind
        self.message = message
        self.violations = list(violations)
        self.reason = reason


@dataclass(frozen=True)
class TokenEntry:
    """One generated token's logprob entry: a forced token has logprob 0 and only itself as
    alternative; a sampled one its best `top` alternatives (token id, bytes, logprob)."""

    token_id: int
    token: bytes
    forced: bool
    logprob: float = 0.0
    top: tuple[tuple[int, bytes, float], ...] = ()


@dataclass
class Delta:
    """What one choice generated since its last event."""

    request_id: str  # the call's id
    index: int  # the choice
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    logprobs: list[TokenEntry] = field(default_factory=list)


@dataclass(frozen=True)
class Usage:
    prompt_tokens: int
    completion_tokens: int
    forced_tokens: int
    forward_passes: int
    draft_tokens: int
    accepted_draft_tokens: int
    cached_prompt_tokens: int = 0


@dataclass
class Final:
    """A choice's last event: its last delta, why it ended and its usage."""

    delta: Delta
    reason: FinishReason
    usage: Usage
    stop_string: str = ""
    error: str = ""


Output = Delta | Final | Exception
"""An item of a request's output queue; an exception (an :class:`EngineError`, or the grammar
client's status for a request it failed) ends the call with that error."""
