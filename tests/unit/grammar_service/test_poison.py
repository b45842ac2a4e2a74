"""The poison list: what crashed a process is refused, also after a restart on the same state."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

from grammar_service.poison import PoisonList

DIE_WHILE_COMPILING = """
import os, sys
from pathlib import Path
from grammar_service.poison import PoisonList
poison = PoisonList(Path(sys.argv[1]))
with poison.journal(sys.argv[2]):
    if len(sys.argv) > 3:
        with poison.journal(sys.argv[3]):
            os.abort()
    os.abort()
"""


def die_compiling(state: Path, *keys: str) -> None:
    """A process that aborts while `keys` are being compiled (journaled)."""
    proc = subprocess.run(
        [sys.executable, "-c", DIE_WHILE_COMPILING, str(state), *keys],
        cwd=Path(__file__).resolve().parents[3],
        capture_output=True,
    )
    assert proc.returncode != 0


def test_added_keys_are_refused_until_they_expire(tmp_path: Path) -> None:
    poison = PoisonList(tmp_path, ttl_s=0.2)
    assert poison.reason("k") is None
    poison.add("k", "it crashed")
    assert poison.reason("k") == "it crashed"
    assert PoisonList(tmp_path, ttl_s=0.2).reason("k") == "it crashed"  # persisted
    time.sleep(0.25)
    assert poison.reason("k") is None
    assert PoisonList(tmp_path).reason("k") is None


def test_the_only_key_in_flight_at_a_crash_is_poison(tmp_path: Path) -> None:
    die_compiling(tmp_path, "bad")
    restarted = PoisonList(tmp_path)
    assert restarted.reason("bad") == "the grammar service died while compiling it"
    assert list((tmp_path / "inflight").iterdir()) == []


def test_keys_in_flight_together_need_two_strikes(tmp_path: Path) -> None:
    die_compiling(tmp_path, "bad", "innocent")
    first = PoisonList(tmp_path)
    assert first.reason("bad") is None and first.reason("innocent") is None
    die_compiling(tmp_path, "bad", "other")
    second = PoisonList(tmp_path)
    assert second.reason("bad") is not None
    assert second.reason("innocent") is None and second.reason("other") is None


def test_a_live_sibling_in_flight_is_not_a_crash(tmp_path: Path) -> None:
    (tmp_path / "inflight").mkdir()
    sibling = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        (tmp_path / "inflight" / f"busy.{sibling.pid}.0").touch()
        assert PoisonList(tmp_path).reason("busy") is None
        assert (tmp_path / "inflight" / f"busy.{sibling.pid}.0").exists()
    finally:
        sibling.kill()
        sibling.wait()


def test_journal_removes_its_marker(tmp_path: Path) -> None:
    poison = PoisonList(tmp_path)
    with poison.journal("k"):
        assert [p.name.split(".")[0] for p in (tmp_path / "inflight").iterdir()] == ["k"]
    assert list((tmp_path / "inflight").iterdir()) == []


def test_unusable_state_dir_keeps_the_list_in_memory(tmp_path: Path) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    poison = PoisonList(blocker / "state")
    poison.add("k", "crashed")
    assert poison.reason("k") == "crashed"
    with poison.journal("k"):
        pass
    assert os.path.isfile(blocker)
