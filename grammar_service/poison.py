"""Constraints that crashed a process of this service, remembered so they are refused, not retried.

Two ways a constraint gets here:

* a compile-sandbox child died while verifying it (`Compiler` adds it at once);
* this service process itself died while building its matcher. Before that work starts, the
  constraint's key is written to `STATE_DIR/inflight/`; the file is removed when it ends. A file
  still there at the next start names what was in flight when the process died: alone, it is
  poison; beside others, each gets a strike, and two strikes make poison (an innocent constraint
  that happened to compile at the same moment is not refused for one crash).

The list lives in `STATE_DIR/poison.jsonl` (one JSON object per line), so a replica restarted on
the same state directory (same port under `maskwire up`, an `emptyDir` volume on Kubernetes)
keeps refusing what crashed its predecessor. Entries expire after `ttl_s`. Without a writable
state directory the list lives in memory only, which still covers sandbox crashes.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import logging
import os
import time
from collections import OrderedDict
from collections.abc import Iterator
from pathlib import Path

from grammar_service.config import CompileSettings

log = logging.getLogger(__name__)

_MAX_ENTRIES = 10_000


class PoisonList:
    def __init__(self, state_dir: Path | None, ttl_s: float = CompileSettings.poison_ttl_s) -> None:
        self.ttl_s = ttl_s
        self.state_dir = state_dir
        self._poison: OrderedDict[str, tuple[str, float]] = OrderedDict()  # key -> (why, until)
        self._strikes: dict[str, list[float]] = {}
        self._seq = itertools.count()
        self._file: Path | None = None
        self._inflight: Path | None = None
        if state_dir is not None:
            try:
                (state_dir / "inflight").mkdir(parents=True, exist_ok=True)
                self._file = state_dir / "poison.jsonl"
                self._inflight = state_dir / "inflight"
                self._load()
            except OSError as e:
                log.warning(
                    "state directory %s is not usable (%s): constraints that crash this process "
                    "are remembered in memory only",
                    state_dir,
                    e,
                )
                self._file = self._inflight = None

    # ------------------------------------------------------------------ queries
    def reason(self, key: str) -> str | None:
        """Why `key` is refused (None: it is not)."""
        entry = self._poison.get(key)
        if entry is None:
            return None
        why, until = entry
        if time.time() >= until:
            del self._poison[key]
            return None
        return why

    def __len__(self) -> int:
        return len(self._poison)

    # ------------------------------------------------------------------ updates
    def add(self, key: str, why: str) -> None:
        """Refuse `key` from now on (for `ttl_s`)."""
        until = time.time() + self.ttl_s
        self._remember(key, why, until)
        self._append({"key": key, "why": why, "until": until})
        log.error("constraint %s is poison from now on: %s", key, why)

    def _strike(self, key: str, why: str) -> None:
        now = time.time()
        strikes = [t for t in self._strikes.get(key, []) if t > now - self.ttl_s] + [now]
        self._strikes[key] = strikes
        self._append({"key": key, "strike": now})
        if len(strikes) >= 2:
            self.add(key, why)

    def _remember(self, key: str, why: str, until: float) -> None:
        self._poison[key] = (why, until)
        self._poison.move_to_end(key)
        while len(self._poison) > _MAX_ENTRIES:
            self._poison.popitem(last=False)

    @contextlib.contextmanager
    def journal(self, key: str) -> Iterator[None]:
        """Mark `key` as being compiled in this process for the duration of the block."""
        if self._inflight is None:
            yield
            return
        marker = self._inflight / f"{key}.{os.getpid()}.{next(self._seq)}"
        try:
            marker.touch()
        except OSError:
            marker = None  # type: ignore[assignment]
        try:
            yield
        finally:
            if marker is not None:
                with contextlib.suppress(OSError):
                    marker.unlink()

    # ------------------------------------------------------------------ persistence
    def _append(self, entry: dict[str, object]) -> None:
        if self._file is None:
            return
        try:
            with self._file.open("a") as f:
                f.write(json.dumps(entry) + "\n")
        except OSError as e:
            log.warning("cannot record poison in %s: %s", self._file, e)

    def _load(self) -> None:
        """Read the list, turn what was in flight at the last death into poison or strikes,
        and rewrite the file with the entries that are still live."""
        assert self._file is not None and self._inflight is not None
        now = time.time()
        if self._file.exists():
            for line in self._file.read_text().splitlines():
                try:
                    entry = json.loads(line)
                    key = str(entry["key"])
                    if "strike" in entry:
                        t = float(entry["strike"])
                        if t > now - self.ttl_s:
                            self._strikes.setdefault(key, []).append(t)
                    elif float(entry["until"]) > now:
                        self._remember(key, str(entry["why"]), float(entry["until"]))
                except (ValueError, KeyError, TypeError):
                    continue  # a torn last line from a crash mid-write
        self._rewrite()
        markers = [p for p in self._inflight.iterdir() if not _owner_alive(p.name)]
        crashed = sorted({p.name.split(".", 1)[0] for p in markers})
        for p in markers:
            with contextlib.suppress(OSError):
                p.unlink()
        if len(crashed) == 1:
            self.add(crashed[0], "the grammar service died while compiling it")
        for key in crashed if len(crashed) > 1 else ():
            self._strike(key, "the grammar service died twice while compiling it")
        if crashed:
            log.warning("the previous process died while compiling %s", ", ".join(crashed))

    def _rewrite(self) -> None:
        assert self._file is not None
        lines = [
            json.dumps({"key": k, "why": why, "until": until})
            for k, (why, until) in self._poison.items()
        ] + [json.dumps({"key": k, "strike": t}) for k, ts in self._strikes.items() for t in ts]
        tmp = self._file.with_suffix(".tmp")
        tmp.write_text("".join(line + "\n" for line in lines))
        tmp.replace(self._file)


def _owner_alive(marker: str) -> bool:
    """Whether the process that wrote `KEY.PID.SEQ` still runs (a replica sharing the directory;
    the usual case, a dead predecessor, answers False)."""
    try:
        pid = int(marker.split(".")[1])
    except (IndexError, ValueError):
        return False
    if pid == os.getpid():
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
