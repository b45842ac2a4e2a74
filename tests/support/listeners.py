"""Things a service must never touch, that record it when it does: loopback TCP listeners that
count connections (one answers like a web server, one accepts and never answers) and a file whose
access time moves when it is read. Schemas that reference them are in `external_schemas`."""

from __future__ import annotations

import os
import socket
import threading
import time
from pathlib import Path
from types import TracebackType
from typing import Any

_OLD_ATIME = 1_000_000_000  # before the file's mtime: any read updates it (relatime)


class Listener:
    """A TCP listener on 127.0.0.1 counting the connections it gets. `answer=False`: it accepts
    and then never answers, so a client waiting for a reply hangs until its own timeout."""

    def __init__(self, answer: bool) -> None:
        self.server = socket.create_server(("127.0.0.1", 0))
        self.server.settimeout(0.1)
        self.answer = answer
        self.connections = 0
        self._held: list[socket.socket] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    @property
    def port(self) -> int:
        return int(self.server.getsockname()[1])

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}/schema.json"

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                conn, _ = self.server.accept()
            except TimeoutError:
                continue
            self.connections += 1
            if self.answer:
                with conn:
                    conn.sendall(b'HTTP/1.0 200 OK\r\n\r\n{"type": "integer"}')
            else:
                self._held.append(conn)

    def proves_itself(self) -> None:
        """Connect once and see it counted (so a check that it saw nothing can fail)."""
        before = self.connections
        with socket.create_connection(("127.0.0.1", self.port)):
            pass
        deadline = time.monotonic() + 10
        while self.connections == before and time.monotonic() < deadline:
            time.sleep(0.01)
        assert self.connections == before + 1

    def close(self) -> None:
        self._stop.set()
        self._thread.join()
        for c in self._held:
            c.close()
        self.server.close()

    def __enter__(self) -> Listener:
        return self

    def __exit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()


def watched_file(directory: Path) -> Path:
    """A schema file (`{"type": "integer"}`) whose access time moves when anything reads it."""
    path = directory / "integer.json"
    path.write_text('{"type": "integer"}')
    os.utime(path, (_OLD_ATIME, time.time()))
    return path


def unread(path: Path) -> bool:
    return os.stat(path).st_atime == _OLD_ATIME


def file_proves_itself(path: Path) -> None:
    """Read it once and see the access time move, then set it back."""
    assert unread(path)
    path.read_text()
    assert not unread(path), "this file system does not record reads (noatime)"
    os.utime(path, (_OLD_ATIME, time.time()))


def external_schemas(url: str) -> list[dict[str, Any]]:
    """Schemas referencing `url` where the grammar never looks: only the output check would
    resolve it."""
    return [
        {"type": "integer", "not": {"$ref": url}},
        {"type": "integer", "if": {"$ref": url}, "then": {"minimum": 0}},
        {"type": "array", "items": {"$dynamicRef": url + "#meta"}},
        {"type": "object", "propertyNames": {"$ref": url}},
        {"type": "string", "oneOf": [{"$ref": url}, {"maxLength": 3}]},
    ]
