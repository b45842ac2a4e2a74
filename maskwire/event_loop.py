"""Which asyncio event loop the gRPC services run on.

uvloop shortens every grpc.aio message hop: a 16 KB bidi echo between two processes on loopback
takes ~200 µs with uvloop on both ends against ~310 µs with the default loop (2-core machine,
`bench/grammar_step.py` measures it). The services use it when it is installed (it is a
dependency on Linux) and fall back to asyncio elsewhere; `--event-loop asyncio` opts out.
"""

from __future__ import annotations

import argparse
import asyncio
from collections.abc import Coroutine
from typing import Any, TypeVar

T = TypeVar("T")

CHOICES = ("auto", "uvloop", "asyncio")


def add_event_loop_argument(p: argparse._ActionsContainer) -> None:
    p.add_argument(
        "--event-loop",
        choices=CHOICES,
        default="auto",
        help="asyncio event loop: uvloop when installed (auto, the default), or the standard one",
    )


def run(main: Coroutine[Any, Any, T], loop: str = "auto") -> T:
    """`asyncio.run(main)` on the chosen loop. `uvloop` fails when uvloop is not installed."""
    if loop not in CHOICES:
        main.close()
        raise ValueError(f"event loop must be one of {CHOICES}, not {loop!r}")
    if loop != "asyncio":
        try:
            import uvloop
        except ImportError:
            if loop == "uvloop":
                main.close()
                raise
        else:
            with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
                return runner.run(main)
    return asyncio.run(main)
