"""The step's device stages as the engine calls them: forward a :class:`ForwardBatch`, sample
:class:`Draw` s, and the row shuffles (the n > 1 prefill share, the jump-forward replace). Each
runs on the device thread (`neuron_worker.device_thread`), timed into the metrics."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Hashable, Sequence
from typing import TypeVar

from neuron_worker import device_thread
from neuron_worker.graphs import Pass
from neuron_worker.metrics import Metrics
from neuron_worker.request import Request
from neuron_worker.step_device import Logits, Sampled, StepDeviceLike
from neuron_worker.step_rows import Answers, Draw, ForwardBatch, Row, sample_batch

T = TypeVar("T")

log = logging.getLogger(__name__)


async def on_device(fn: Callable[[], T], key: Hashable = None) -> T:
    """Run `fn` on the device thread; `key`: calls with equal keys do the same work (the thread
    governor compares team sizes on them)."""
    return await device_thread.run(fn, key)


class DeviceStage:
    """Host data in, logits handles and tokens out (`StepDeviceLike`); `words`: packed mask
    words per row."""

    def __init__(self, device: StepDeviceLike, metrics: Metrics, words: int) -> None:
        self.device = device
        self.metrics = metrics
        self.words = words

    def _pack(self, batch: ForwardBatch) -> Pass:
        p = batch.pack(self.device.runner, self.device.pad_slot)
        for row in batch.rows:
            row.req.forward_passes += 1
        return p

    async def forward(self, batch: ForwardBatch) -> Logits:
        """One forward pass; logits for each row's `wanted` positions, row after row."""
        p = self._pack(batch)
        began = time.perf_counter()
        logits = await on_device(
            lambda: self.device.forward(p), ("forward", p.tokens.shape, p.prefill)
        )
        self.metrics.forward(batch.kind, time.perf_counter() - began)
        return logits

    async def sample(
        self, draws: Sequence[Draw | None], logits: Logits, answers: Answers
    ) -> Sampled:
        """Mask and sample every logits row (`sample_batch`): one token per logits row, and the
        logprobs when a row asked for them."""
        batch = sample_batch(draws, answers, rows=logits.rows, words=self.words)

        def run() -> Sampled:
            return self.device.sample(logits, batch)

        began = time.perf_counter()
        result = await on_device(run, ("sample", logits.rows))
        self.metrics.sample(time.perf_counter() - began)
        return result

    async def forward_and_sample(
        self, batch: ForwardBatch, draws: Sequence[Draw | None], answers: Answers
    ) -> Sampled:
        """`forward`, then `sample` of its logits, in one call on the device thread: where a step
        needs the logits for nothing else, the device samples at once instead of waiting for the
        event loop to hand it the next call (~0.5 ms per step on 2 busy cores)."""
        p = self._pack(batch)
        sampling = sample_batch(draws, answers, rows=len(p.last), words=self.words)
        seconds: list[float] = []

        def run() -> Sampled:
            began = time.perf_counter()
            logits = self.device.forward(p)
            sampled_at = time.perf_counter()
            out = self.device.sample(logits, sampling)
            seconds.extend((sampled_at - began, time.perf_counter() - sampled_at))
            return out

        result = await on_device(run, ("forward and sample", p.tokens.shape, p.prefill))
        self.metrics.forward(batch.kind, seconds[0])
        self.metrics.sample(seconds[1])
        return result

    async def jump_forward(
        self, logits: Logits, ff_rows: list[Row], batch: Sequence[Request]
    ) -> Logits:
        """One multi-token pass over `ff_rows` (forced tokens); the logits of each one's last
        position replace its request's row of `logits` (whose rows are `batch`'s)."""
        ff_logits = await self.forward(ForwardBatch(ff_rows, "jump_forward"))
        position = {id(r): i for i, r in enumerate(batch)}
        dst = [position[id(row.req)] for row in ff_rows]
        return await on_device(lambda: self.device.replace(logits, ff_logits, dst))

    async def share(self, logits: Logits, rows: list[Row], shared: list[tuple[Row, Row]]) -> Logits:
        """n > 1: each follower's slot gets its leader's prompt K/V (copied up to the sequence
        bucket), and the logits gain one row per follower, its leader's (padded to a batch
        bucket the sampler takes). `shared`: (follower, leader) rows."""
        runner = self.device.runner
        position = {id(row): i for i, row in enumerate(rows)}
        index = list(range(len(rows)))
        copies: list[tuple[int, int, int]] = []
        for row, leader in shared:
            length = runner.shape(1, 1, row.start + len(row.tokens))[2]
            copies.append((leader.req.slot, row.req.slot, length))
            index.append(position[id(leader)])
        total = runner.shape(len(index), 1, 1)[0]
        index += [0] * (total - len(index))
        return await on_device(lambda: self.device.share(logits, copies, index))

    async def warmup(self, on_graph: Callable[[str], None] | None = None) -> int:
        """Run every graph shape the step loop can produce once, on padding inputs (the pad
        slot's scratch position), so a static-shape backend (XLA) compiles them all before
        serving. `on_graph(label)` is called after each one. Returns the number of graphs."""
        began = time.perf_counter()
        last = began

        def graph_done(label: str) -> None:
            # Per graph, so that an operator sees where a slow (cold-cache) start goes.
            nonlocal last
            now = time.perf_counter()
            log.info("warm-up: %s in %.1fs", label, now - last)
            last = now
            if on_graph is not None:
                on_graph(label)

        count = await on_device(lambda: self.device.warmup(graph_done))
        log.info("warm-up ran %d graphs in %.1fs", count, time.perf_counter() - began)
        return count
