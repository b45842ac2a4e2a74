"""Per-request state for the engine: prompt, sampling, generated tokens, output events."""

from __future__ import annotations

import asyncio
import enum
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from neuron_worker.detokenize import Detokenizer
from neuron_worker.drafter import DraftBudget, Drafter
from neuron_worker.events import Delta, Final, FinishReason, Output, TokenEntry, Usage
from neuron_worker.grammar_client import GrammarRequest
from neuron_worker.prefix_cache import NO_REUSE, Reuse

if TYPE_CHECKING:
    from maskwire.v1 import common_pb2


class State(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(frozen=True)
class Sampling:
    """Validated sampling parameters (defaults already applied)."""

    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int = 0
    max_tokens: int = 0  # resolved: > 0
    stop: tuple[str, ...] = ()
    stop_token_ids: frozenset[int] = frozenset()
    ignore_eos: bool = False
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: dict[int, float] = field(default_factory=dict)
    logprobs: bool = False
    top_logprobs: int = 0
    raw_logprobs: bool = False  # the model's distribution instead of the processed one

    @property
    def penalized(self) -> bool:
        """True when the sampler must run the penalty graph for this request."""
        return bool(
            self.presence_penalty
            or self.frequency_penalty
            or self.repetition_penalty != 1.0
            or self.logit_bias
        )


@dataclass(frozen=True)
class TokenLogprob:
    """A sampled token's log-probability and its best alternatives (ids and logprobs)."""

    logprob: float
    top: tuple[tuple[int, float], ...] = ()


@dataclass(eq=False)
class Request:
    """One Generate call from admission to its final message.

    `output` holds every generated token (sampled and forced). `pending` is the last sampled
    token: part of `output`, already known to the grammar only after the next step, and not yet
    written to the KV cache (the next forward pass feeds it). `verified` are drafts accepted in
    the last step: in `output` and in the KV cache, sent to the grammar with `pending` next.
    """

    request_id: str
    prompt: list[int]
    sampling: Sampling
    detok: Detokenizer
    constraint: common_pb2.Constraint | None = None
    reasoning_end_marker: str = ""
    arrival: float = field(default_factory=time.monotonic)
    # n > 1: the Generate call's id (messages carry it) and this choice's index; the group's
    # requests share `outputs`, are admitted together and prefill the prompt once.
    group: str = ""
    index: int = 0
    group_size: int = 1
    # Who sent it (the gRPC peer: one per client connection); clients share the queue and the
    # batch slots fairly (`scheduler`).
    peer: str = ""
    # Reuses only prompt prefixes cached by requests with the same salt (`prefix_cache`).
    cache_salt: str = ""

    grammar: GrammarRequest | None = None  # set when the request is constrained
    state: State = State.WAITING
    slot: int = -1
    # The prompt prefix its slot holds at admission, or gets copied (`neuron_worker.prefix_cache`).
    reuse: Reuse = NO_REUSE
    # It waited a turn for another prompt pass to write its prefix (at most once).
    waited: bool = False
    output: list[int] = field(default_factory=list)
    pending: int | None = None
    verified: list[int] = field(default_factory=list)
    speculate: bool = True  # drafts allowed (the worker's --speculative decides if any)
    drafter: Drafter | None = None
    budget: DraftBudget | None = None
    draft_tokens: int = 0  # drafts that reached a verification pass
    accepted_drafts: int = 0  # of those, kept
    cached: int = 0  # tokens (prompt + output) whose K/V are in the cache
    cached_prompt: int = 0  # prompt tokens whose K/V the prefix cache held (never computed)
    forced_tokens: int = 0
    forward_passes: int = 0
    sampled: int = 0  # tokens drawn by the sampler (the sampler's per-request offset)
    counted: int = 0  # output tokens already in the penalty occurrence table
    abort_reason: str | None = None  # set by Abort / cancellation; acted on between steps
    first_token_at: float | None = None
    outputs: asyncio.Queue[Output] = field(default_factory=asyncio.Queue)
    sent_at: float = 0.0  # time.monotonic() of the last message with tokens; 0: none yet
    # Token ids and text not yet sent to the client.
    _unsent_ids: list[int] = field(default_factory=list)
    _unsent_text: list[str] = field(default_factory=list)
    _unsent_logprobs: list[TokenEntry] = field(default_factory=list)

    @property
    def call_id(self) -> str:
        """The id of the Generate call this request belongs to (what its messages carry)."""
        return self.group or self.request_id

    @property
    def constrained(self) -> bool:
        return self.constraint is not None

    @property
    def finished(self) -> bool:
        return self.state is State.FINISHED

    @property
    def seq_len(self) -> int:
        """Prompt plus generated tokens."""
        return len(self.prompt) + len(self.output)

    def append(
        self,
        tokens: list[int],
        *,
        forced: bool,
        logprob: TokenLogprob | None = None,
    ) -> str | None:
        """Add generated tokens; returns the stop string if one matched. With logprobs on,
        ``logprob`` is the sampled token's (forced tokens get 0)."""
        self.output.extend(tokens)
        if forced:
            self.forced_tokens += len(tokens)
        if self.sampling.logprobs:
            self._unsent_logprobs.extend(
                _logprob_entry(
                    t, forced, logprob, self.detok.token_bytes, self.sampling.top_logprobs
                )
                for t in tokens
            )
        self._unsent_ids.extend(tokens)
        delta = self.detok.feed(tokens)
        if delta.text:
            self._unsent_text.append(delta.text)
        return delta.stop

    def delta(self) -> Delta | None:
        """What was generated since the last event (None if nothing)."""
        if not self._unsent_ids and not self._unsent_text:
            return None
        delta = Delta(
            self.call_id,
            self.index,
            self._unsent_ids,
            "".join(self._unsent_text),
            self._unsent_logprobs,
        )
        self._unsent_ids = []
        self._unsent_text = []
        self._unsent_logprobs = []
        return delta

    def final(self, reason: FinishReason, *, stop_string: str = "", error: str = "") -> Final:
        """The last event: remaining delta (held text released unless a stop string hit),
        finish reason and usage."""
        if reason is not FinishReason.STOP_STRING:
            tail = self.detok.flush().text
            if tail:
                self._unsent_text.append(tail)
        usage = Usage(
            prompt_tokens=len(self.prompt),
            completion_tokens=len(self.output),
            forced_tokens=self.forced_tokens,
            forward_passes=self.forward_passes,
            draft_tokens=self.draft_tokens,
            accepted_draft_tokens=self.accepted_drafts,
            cached_prompt_tokens=self.cached_prompt,
        )
        delta = self.delta() or Delta(self.call_id, self.index)
        return Final(delta, reason, usage, stop_string=stop_string, error=error)


def _logprob_entry(
    token: int,
    forced: bool,
    logprob: TokenLogprob | None,
    token_bytes: Callable[[int], bytes],
    top: int,
) -> TokenEntry:
    """The entry of one generated token: forced tokens have logprob 0 and only themselves as
    alternative; a sampled token's alternatives are its best `top`, forbidden ones left out."""
    text = token_bytes(token)
    if forced or logprob is None:
        return TokenEntry(token, text, forced, top=((token, text, 0.0),) if top else ())
    best: list[tuple[int, bytes, float]] = []
    for tid, lp in logprob.top[:top]:
        if lp == float("-inf"):
            break
        best.append((tid, token_bytes(tid), lp))
    return TokenEntry(token, text, forced, logprob.logprob, tuple(best))
