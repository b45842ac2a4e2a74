"""The engine's limits and switches (each one a worker flag), shared by the engine and the device
side of a step (`neuron_worker.step_device`), which tensor-parallel follower ranks build too."""

from __future__ import annotations

from dataclasses import dataclass

from neuron_worker.drafter import DraftConfig

__all__ = ["EngineConfig"]


@dataclass(frozen=True)
class EngineConfig:
    """Engine limits and switches (each one a CLI flag)."""

    max_batch: int = 8
    max_seq_len: int = 2048
    max_queue: int = 256
    batch_buckets: tuple[int, ...] = (1, 2, 4, 8)
    seq_buckets: tuple[int, ...] = (128, 256, 512, 1024, 2048)
    max_prefill_tokens: int = 4096
    # From idle, how long the first request may wait for others to share its prefill (at most),
    # and the gap between arrivals that ends the wait early; 0 = admit at once.
    admit_window_s: float = 0.020
    admit_quiet_s: float = 0.004
    # A running request's new tokens go to its stream at most this often (its first at once,
    # its last with the final message); 0 = after every step.
    stream_interval_s: float = 0.020
    # Multi-token passes of at most this many tokens run one token per row (`neuron_worker.graphs`,
    # dynamic shapes); None = the runner's default, 0 = never.
    flat_tokens: int | None = None
    # Tokens per row in one forward pass (prefill, jump-forward); () = 1, 2, 4, ..., max_seq_len.
    token_buckets: tuple[int, ...] = ()
    # Forward shapes: every dimension padded to the buckets above (XLA: one graph per bucket), or
    # dynamic (three graphs with symbolic sizes; `neuron_worker.graphs`). The sampler always uses
    # `batch_buckets`.
    bucketed: bool = True
    structured_outputs: bool = True
    # A prompt reuses the K/V a slot holds for its prefix (`neuron_worker.prefix_cache`).
    prefix_cache: bool = True
    # KV slots beyond the batch's that only keep finished requests' prompts (and answers) for
    # later ones: the cache holds `kv_slots` prompts while `max_batch` requests run.
    prefix_cache_slots: int = 8
    # While idle, prompt passes of at most this many tokens rewrite finished answers into their
    # slots, for the conversation's next turn (`PrefixCache.refresh`); 0 = never.
    prefix_refresh_tokens: int = 32
    # ... once the worker has been idle this long (a client's next request comes first).
    prefix_refresh_idle_s: float = 0.05
    overlap: bool = True
    jump_forward: bool = True
    # Passes of one token per row as one C++ call (`neuron_worker.model.fused_decode`) where it
    # serves the model; else the forward graph.
    fused_decode: bool = True
    # All-greedy steps without penalties or logprobs sampled in one C++ call
    # (`neuron_worker.greedy_kernel`) where the kernels run; else the sampler's graphs.
    greedy_kernel: bool = True
    # Speculative decoding (n-gram drafts checked by the grammar); None = off.
    speculative: DraftConfig | None = None

    @property
    def kv_slots(self) -> int:
        """KV cache slots (the padding slot aside): one per running request, plus those that
        only keep prompts for the prefix cache."""
        return self.max_batch + (self.prefix_cache_slots if self.prefix_cache else 0)

    @property
    def verify_width(self) -> int:
        """Logits rows per request in a verification pass (1 = no drafts)."""
        return self.speculative.verify_width if self.speculative else 1
