"""The poison list: what crashed a process is refused, also after a restart on the same state."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from grammar_service import poison as poison_module
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


def lines(state: Path) -> list[dict[str, object]]:
    return [json.loads(line) for line in (state / "poison.jsonl").read_text().splitlines()]


def test_a_restart_drops_what_expired_and_keeps_what_did_not(tmp_path: Path) -> None:
    now = time.time()
    entries = [
        {"key": "old", "why": "crashed", "until": now - 1},
        {"key": "live", "why": "crashed", "until": now + 600},
        {"key": "stale-strike", "strike": now - 700},
        {"key": "fresh-strike", "strike": now - 10},
    ]
    (tmp_path / "poison.jsonl").write_text("".join(json.dumps(e) + "\n" for e in entries))
    poison = PoisonList(tmp_path, ttl_s=600)
    assert poison.reason("old") is None and poison.reason("live") == "crashed"
    assert len(poison) == 1
    # The file is rewritten with the live entries only.
    assert sorted(str(e["key"]) for e in lines(tmp_path)) == ["fresh-strike", "live"]


def test_a_strike_older_than_the_ttl_does_not_count(tmp_path: Path) -> None:
    """Two keys in flight at a crash get a strike each; a second strike makes poison only while
    the first is younger than the TTL."""
    now = time.time()
    (tmp_path / "poison.jsonl").write_text(
        json.dumps({"key": "bad", "strike": now - 700})
        + "\n"
        + json.dumps({"key": "worse", "strike": now - 10})
        + "\n"
    )
    die_compiling(tmp_path, "bad", "worse")
    poison = PoisonList(tmp_path, ttl_s=600)
    assert poison.reason("bad") is None
    assert poison.reason("worse") == "the grammar service died twice while compiling it"


def test_the_oldest_entries_are_evicted_past_the_limit(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(poison_module, "_MAX_ENTRIES", 3)
    poison = PoisonList(tmp_path)
    for k in ("k0", "k1", "k2", "k3"):
        poison.add(k, f"{k} crashed")
    assert [poison.reason(k) for k in ("k0", "k1", "k2", "k3")] == [
        None,
        "k1 crashed",
        "k2 crashed",
        "k3 crashed",
    ]
    poison.add("k1", "k1 crashed again")  # the newest now
    poison.add("k4", "k4 crashed")
    assert poison.reason("k2") is None and len(poison) == 3
    # A restart reads every line of the file and keeps the newest three.
    restarted = PoisonList(tmp_path)
    assert {k: restarted.reason(k) for k in ("k0", "k1", "k2", "k3", "k4")} == {
        "k0": None,
        "k1": "k1 crashed again",
        "k2": None,
        "k3": "k3 crashed",
        "k4": "k4 crashed",
    }
    assert len(lines(tmp_path)) == 3


def test_a_torn_last_line_loses_nothing_before_it(tmp_path: Path) -> None:
    """A crash mid-write leaves half a line: the entries before it still count, the file is
    rewritten whole, and what is added next is a line of its own."""
    until = time.time() + 600
    whole = json.dumps({"key": "a", "why": "crashed", "until": until})
    torn = json.dumps({"key": "b", "why": "crashed", "until": until})[:25]
    (tmp_path / "poison.jsonl").write_text(whole + "\n" + torn)
    poison = PoisonList(tmp_path)
    assert poison.reason("a") == "crashed" and poison.reason("b") is None
    poison.add("c", "crashed too")
    assert [e["key"] for e in lines(tmp_path)] == ["a", "c"]
    assert PoisonList(tmp_path).reason("c") == "crashed too"
