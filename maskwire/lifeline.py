"""Children of `maskwire up` end when it does, even when it is SIGKILLed.

The supervisor names itself in the child's environment; the child, once running, asks Linux to
SIGTERM it when its parent dies (`PR_SET_PDEATHSIG`). This runs in the child after exec, not in a
`preexec_fn` between fork and exec: a fork of the multi-threaded, gRPC-using supervisor runs
grpcio's fork handlers, which crash some children before they reach exec.
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys

SUPERVISOR_PID_ENV = "MASKWIRE_SUPERVISOR_PID"
_PR_SET_PDEATHSIG = 1


def supervised_env() -> dict[str, str]:
    """Environment entries that make a child started now follow this process (see `hold_on`)."""
    return {SUPERVISOR_PID_ENV: str(os.getpid())}


def hold_on() -> None:
    """In a child: SIGTERM this process when its supervisor dies (now, if it already has).

    Does nothing outside Linux or without a supervisor in the environment.
    """
    supervisor = os.environ.pop(SUPERVISOR_PID_ENV, "")  # not inherited any further
    if not supervisor or not sys.platform.startswith("linux"):
        return
    try:
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)
    except (OSError, AttributeError):
        return
    if os.getppid() != int(supervisor):  # it died before prctl: nobody else will stop us
        os.kill(os.getpid(), signal.SIGTERM)
