"""`maskwire.supervise.Child` started from a busy, gRPC-using supervisor."""

from __future__ import annotations

import shutil
import threading
from pathlib import Path

from maskwire.supervise import Child, grpc_healthy


def test_children_start_cleanly_while_grpc_threads_are_busy(tmp_path: Path) -> None:
    # Regression: with a preexec_fn, Popen forks and runs grpcio's fork handlers, which killed
    # about one child in twelve (SIGSEGV/SIGABRT before exec) while health probes were running.
    stop = threading.Event()

    def probe() -> None:
        while not stop.is_set():
            grpc_healthy("127.0.0.1:1", timeout_s=0.5)

    probes = [threading.Thread(target=probe) for _ in range(4)]
    for t in probes:
        t.start()
    true = shutil.which("true")
    assert true is not None
    codes = []
    try:
        for i in range(60):
            child = Child(f"c{i}", [true], log_path=tmp_path / "c.log", probe=lambda: True)
            child.start()
            assert child.wait(10)
            codes.append(child.poll())
    finally:
        stop.set()
        for t in probes:
            t.join()
    assert codes == [0] * 60
