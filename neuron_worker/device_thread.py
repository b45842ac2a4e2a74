"""The device thread: the one thread of the worker process that runs torch.

Everything that computes with torch (loading and quantizing the model, allocating the KV cache,
warm-up, every forward pass and every sampler call) runs here, never on the event loop's thread.

Why one thread and not merely "not the event loop": torch's CPU wheels use GNU OpenMP, which keeps
a pool of worker threads for each thread that has opened a parallel region. Once two threads have
(say the model was loaded on the main thread and the forward runs on another), libgomp manages more
threads than there are CPUs on a small machine and switches every pool from spinning at barriers
to sleeping on a futex (GOMP_SPINCOUNT's throttled mode). Each of the hundreds of parallel regions
in a forward pass then pays a wake-up: on the 2-CPU machine this was measured to double the decode
step (10.6 ms with the model loaded on the thread that runs it, 23.5 ms with it loaded on another).

The thread names itself (`thread_governor.TEAM_NAME`) before it runs anything, so the OpenMP
threads it starts carry the same name: `govern` installs a `ThreadGovernor` that sizes that team
from the CPU time it really gets (see there).
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable, Hashable
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

from neuron_worker.thread_governor import ThreadGovernor, name_this_thread

T = TypeVar("T")

_executor: ThreadPoolExecutor | None = None
_governor: ThreadGovernor | None = None
_lock = threading.Lock()


def executor() -> ThreadPoolExecutor:
    """The process's device thread (started on first use, lives as long as the process)."""
    global _executor
    with _lock:
        if _executor is None:
            _executor = ThreadPoolExecutor(
                max_workers=1, thread_name_prefix="maskwire-device", initializer=name_this_thread
            )
        return _executor


def govern(governor: ThreadGovernor | None) -> None:
    """Size the device thread's intra-op team with `governor` around every call from now on
    (None: leave it as it is)."""
    global _governor
    _governor = governor


def _governed(fn: Callable[[], T], key: Hashable) -> T:
    governor = _governor
    if governor is None:
        return fn()
    token = governor.before(key)
    try:
        return fn()
    finally:
        governor.after(token)


async def run(fn: Callable[[], T], key: Hashable = None) -> T:
    """Run `fn` on the device thread and await its result. `key`: calls with equal keys do the
    same work (the governor compares team sizes on them)."""
    return await asyncio.get_running_loop().run_in_executor(executor(), _governed, fn, key)
