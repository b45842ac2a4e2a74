"""`maskwire up` supervising stand-in services: start order, health wait, demo, stop order, deaths."""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from maskwire import up
from maskwire.supervise import RestartPolicy

ROOT = Path(__file__).resolve().parents[3]


def start_up(tmp_path: Path, *args: str, **env: str) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [
            sys.executable,
            "-m",  # a module run from ROOT, so it imports this checkout's maskwire
            "tests.unit.cli.run_up_with_fakes",
            "--model",
            "fake",
            "--log-dir",
            str(tmp_path / "logs"),
            *args,
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd=ROOT,
        env={**os.environ, "FAKE_EVENTS": str(tmp_path / "events"), **env},
    )


def finish(proc: subprocess.Popen[str], timeout: float = 60) -> tuple[int, str, str]:
    out, err = proc.communicate(timeout=timeout)
    return proc.returncode, out, err


def events(tmp_path: Path) -> list[str]:
    return (tmp_path / "events").read_text().splitlines()


def order(tmp_path: Path, what: str) -> list[str]:
    return [e.split()[0] for e in events(tmp_path) if e.split()[1] == what]


def test_demo_starts_in_order_sends_request_and_stops_in_reverse(tmp_path: Path) -> None:
    rc, out, err = finish(start_up(tmp_path, "--demo", "--grammar-replicas", "2"))
    assert rc == 0, err
    assert "maskwire is up." in out
    assert "valid   yes" in out
    assert '"population": 67000000' in out
    assert order(tmp_path, "start") == ["grammar-service", "grammar-service", "worker", "gateway"]
    assert order(tmp_path, "stop") == ["gateway", "worker", "grammar-service", "grammar-service"]
    # The worker was pointed at both grammar replicas, the gateway at the worker.
    starts = {e.split()[0]: e for e in events(tmp_path) if " start " in e}
    grammar_ports = [
        e.split("--port ")[1].split()[0]
        for e in events(tmp_path)
        if e.startswith("grammar-service start")
    ]
    worker_args = starts["worker"].split()
    targets = worker_args[worker_args.index("--grammar-service") + 1].split(",")
    assert sorted(t.rsplit(":", 1)[1] for t in targets) == sorted(grammar_ports)
    worker_port = worker_args[worker_args.index("--port") + 1]
    assert f"--worker 127.0.0.1:{worker_port}" in starts["gateway"]
    request = json.loads(next(e for e in events(tmp_path) if e.startswith("gateway request"))[16:])
    assert request["model"] == "fake-model"
    assert request["response_format"]["json_schema"]["schema"]["required"] == [
        "name",
        "capital",
        "population",
    ]
    assert (tmp_path / "logs" / "worker.log").read_text().startswith("fake worker: listening")


def test_demo_rejects_an_answer_that_breaks_the_schema(tmp_path: Path) -> None:
    rc, _, err = finish(start_up(tmp_path, "--demo", FAKE_ANSWER='{"name": "France"}'))
    assert rc == 1
    assert "breaks the schema" in err and "capital" in err
    assert order(tmp_path, "stop") == ["gateway", "worker", "grammar-service"]


FREE_PORTS = ("--port", "0", "--worker-port", "0", "--grammar-port", "0")


def wait_for_line(
    proc: subprocess.Popen[str], needle: str, timeout: float = 60, *, stderr: bool = False
) -> str:
    stream = proc.stderr if stderr else proc.stdout
    assert stream is not None
    seen = ""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        line = stream.readline()
        if not line:
            break
        seen += line
        if needle in line:
            return seen
    raise AssertionError(f"{needle!r} not printed; got:\n{seen}")


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_signal_stops_everything_in_reverse_order(tmp_path: Path, sig: int) -> None:
    proc = start_up(tmp_path, *FREE_PORTS)
    banner = wait_for_line(proc, "Press Ctrl-C to stop.")
    assert "OpenAI-compatible REST  http://127.0.0.1:" in banner
    proc.send_signal(sig)
    rc, _, err = finish(proc)
    assert rc == 0, err
    assert order(tmp_path, "stop") == ["gateway", "worker", "grammar-service"]
    assert f"{signal.Signals(sig).name} received" in err
    # Service logs were echoed with a prefix (--show-logs is the default without --demo).
    assert "[worker] fake worker: listening" in err


def test_child_death_is_reported_with_its_last_lines(tmp_path: Path) -> None:
    proc = start_up(tmp_path, *FREE_PORTS, FAKE_CRASH="worker")
    rc, _, err = finish(proc)
    assert rc == 1
    assert "worker (pid" in err and "died: exit code 3" in err
    assert "    fake worker: boom, something broke" in err
    assert "full log:" in err and "worker.log" in err
    assert "worker is not restarted (only grammar replicas are); stopping everything" in err
    assert order(tmp_path, "stop")[-2:] == ["gateway", "grammar-service"]


def kill_grammar_once_up(proc: subprocess.Popen[str]) -> str:
    """Wait for the stack, SIGKILL its grammar service; what `up` logged until then."""
    log = wait_for_line(proc, "ready in", stderr=True)
    pid = re.search(r"started grammar on \S+ \(pid (\d+)\)", log)
    assert pid is not None, log
    os.kill(int(pid.group(1)), signal.SIGKILL)
    return log


def test_dead_grammar_replica_is_restarted_on_its_port(tmp_path: Path) -> None:
    proc = start_up(tmp_path, *FREE_PORTS, "--metrics", "--no-show-logs")
    kill_grammar_once_up(proc)
    banner = wait_for_line(proc, "Press Ctrl-C to stop.")
    assert "a grammar replica that dies is restarted (stops if it dies 5 times in 60s)" in banner
    log = wait_for_line(proc, "grammar is healthy again (restart 1)", stderr=True)
    assert "grammar (pid" in log and "died: signal SIGKILL" in log
    assert "restarting grammar in 0.1s (restart 1; giving up if it dies 5 times in 60s)" in log
    proc.send_signal(signal.SIGTERM)
    rc, _, err = finish(proc)
    assert rc == 0, log + err
    assert order(tmp_path, "stop") == ["gateway", "worker", "grammar-service"]
    first, again = [e for e in events(tmp_path) if e.startswith("grammar-service start")]
    assert first == again and "--metrics-port" in first  # same port, same metrics port
    grammar_log = (tmp_path / "logs" / "grammar.log").read_text()
    assert grammar_log.count("fake grammar-service: listening") == 2
    assert "\n----- restart 1 -----\n" in grammar_log


def test_grammar_replica_that_keeps_dying_stops_everything(tmp_path: Path) -> None:
    # Killed once the stack is up, then every restart crashes at once.
    proc = start_up(tmp_path, *FREE_PORTS, FAKE_CRASH="grammar-service", FAKE_CRASH_AFTER=",0")
    kill_grammar_once_up(proc)
    rc, _, err = finish(proc)
    assert rc == 1
    assert "grammar died 5 times in 60s: giving up; stopping everything" in err
    assert err.count("restarting grammar in") == 4
    assert len(order(tmp_path, "start")) == 5 + 2
    assert order(tmp_path, "stop") == ["gateway", "worker"]


def test_restart_policy_backs_off_then_gives_up() -> None:
    policy = RestartPolicy(limit=3, window_s=10.0, backoff_s=(1.0, 1.5))
    assert policy.on_death(100.0) == 1.0
    assert policy.on_death(101.0) == 1.5  # doubled, capped
    assert policy.on_death(102.0) is None  # the third death within 10 s
    fresh = RestartPolicy(limit=3, window_s=10.0, backoff_s=(1.0, 8.0))
    assert [fresh.on_death(t) for t in (0.0, 5.0, 12.0, 30.0)] == [1.0, 2.0, 2.0, 1.0]


def test_children_end_when_up_is_killed(tmp_path: Path) -> None:
    proc = start_up(tmp_path, *FREE_PORTS, "--no-show-logs")
    wait_for_line(proc, "ready in", stderr=True)
    proc.kill()
    proc.communicate(timeout=10)
    # Each child got the parent-death SIGTERM and stopped as it would on Ctrl-C.
    deadline = time.monotonic() + 20
    while len(order(tmp_path, "stop")) < 3 and time.monotonic() < deadline:
        time.sleep(0.1)
    assert sorted(order(tmp_path, "stop")) == ["gateway", "grammar-service", "worker"]


def test_service_that_never_gets_healthy_times_out(tmp_path: Path) -> None:
    rc, _, err = finish(
        start_up(tmp_path, "--demo", "--startup-timeout", "3", FAKE_NEVER_READY="worker")
    )
    assert rc == 1
    assert "worker was not healthy after 3s" in err
    assert order(tmp_path, "stop") == ["worker", "grammar-service"]


def test_busy_port_is_a_clear_error(tmp_path: Path) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        rc, _, err = finish(start_up(tmp_path, "--port", str(port)))
    assert rc == 1
    assert f"127.0.0.1:{port} is already in use (set --port" in err


def test_defaults() -> None:
    parser = argparse.ArgumentParser()
    up.add_arguments(parser)
    args = parser.parse_args([])
    assert (
        args.port,
        args.worker_port,
        args.grammar_port,
        args.grammar_replicas,
        args.model,
        args.host,
    ) == (8000, 50052, 50061, 1, "default", "127.0.0.1")


def test_bad_exit_while_stopping_is_reported(tmp_path: Path) -> None:
    rc, _, err = finish(start_up(tmp_path, "--demo", FAKE_BAD_STOP="worker"))
    assert rc == 1
    assert "worker (pid" in err and "died while stopping: exit code 4" in err
    assert "    fake worker: drain failed" in err
    assert err.count("died") == 1


def test_service_ignoring_sigterm_is_killed_after_the_grace(tmp_path: Path) -> None:
    rc, _, err = finish(start_up(tmp_path, "--demo", "--grace", "1", FAKE_IGNORE_TERM="gateway"))
    assert rc == 1
    assert "gateway did not stop within 1s: killing it" in err
    assert order(tmp_path, "stop") == ["worker", "grammar-service"]


def test_default_ports_do_not_collide_and_chosen_ones_must_not() -> None:
    parser = argparse.ArgumentParser()
    up.add_arguments(parser)
    ports = up.requested_ports(parser.parse_args(["--grammar-replicas", "3"]))
    assert ports == [
        ("--port", 8000),
        ("--worker-port", 50052),
        ("--grammar-port", 50061),
        ("--grammar-port", 50062),
        ("--grammar-port", 50063),
    ]
    clash = parser.parse_args(["--grammar-replicas", "2", "--worker-port", "50062"])
    with pytest.raises(SystemExit, match=r"port 50062 is used twice \(--worker-port and "):
        up.requested_ports(clash)


def test_metrics_on_free_ports_listed_in_the_banner(tmp_path: Path) -> None:
    proc = start_up(tmp_path, *FREE_PORTS, "--metrics", "--grammar-replicas", "2")
    banner = wait_for_line(proc, "Press Ctrl-C to stop.")
    proc.send_signal(signal.SIGTERM)
    rc, _, err = finish(proc)
    assert rc == 0, err
    listed = dict(re.findall(r"http://127\.0\.0\.1:(\d+)/metrics \((\S+)\)", banner))
    assert sorted(listed.values()) == ["gateway", "grammar-0", "grammar-1", "worker"]
    passed = [
        e.split("--metrics-port ")[1].split()[0]
        for e in events(tmp_path)
        if " start " in e and not e.startswith("gateway")
    ]
    assert sorted(passed) == sorted(p for p, name in listed.items() if name != "gateway")
