"""`maskwire up`: grammar service replicas, a worker and the gateway on this machine, supervised.

Starts the tiers in dependency order (grammar replicas, then the worker pointed at them, then the
gateway pointed at the worker), waits for each to pass its health check, prints where to send
requests and runs until Ctrl-C or SIGTERM. Then it stops the tiers in reverse order (gateway,
worker, grammar), each with a grace period to drain before SIGKILL.

A child that dies is reported with its last log lines. A grammar replica is restarted on the same
port (with backoff; the worker re-opens its requests elsewhere meanwhile and uses the replica again
once it is back), unless it keeps dying. The worker and the gateway are not restarted: their death,
a replica dying too often, or any death during startup stops everything with exit code 1.
"""

from __future__ import annotations

import argparse
import contextlib
import shlex
import signal
import socket
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from types import FrameType
from typing import TYPE_CHECKING

from maskwire.signal_flag import SignalFlag

if TYPE_CHECKING:
    from maskwire.supervise import Child

DEFAULT_GATEWAY_PORT = 8000
DEFAULT_WORKER_PORT = 50052
# Ten ports above the worker (and the grammar-service command's own default), so replicas
# counting up from here never reach the worker's port.
DEFAULT_GRAMMAR_PORT = 50061

# A grammar replica is restarted after 1 s, 2 s, 4 s, ... (at most 8 s); dying for the fifth time
# within a minute stops the stack.
RESTART_LIMIT = 5
RESTART_WINDOW_S = 60.0
RESTART_BACKOFF_S = (1.0, 8.0)

SERVICE_COMMAND: list[str] = [sys.executable, "-m", "maskwire.cli"]
"""How children are started: `SERVICE_COMMAND + [command, --port, P, --host, H, ...]`."""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--port",
        type=int,
        default=DEFAULT_GATEWAY_PORT,
        help=f"gateway HTTP port (default {DEFAULT_GATEWAY_PORT}; 0 picks a free port)",
    )
    parser.add_argument(
        "--host", default="127.0.0.1", help="address every service binds (default 127.0.0.1)"
    )
    parser.add_argument(
        "--worker-port",
        type=int,
        default=DEFAULT_WORKER_PORT,
        help=f"worker gRPC port (default {DEFAULT_WORKER_PORT}, where `maskwire generate` looks; "
        "0 picks a free port)",
    )
    parser.add_argument(
        "--grammar-port",
        type=int,
        default=DEFAULT_GRAMMAR_PORT,
        help=f"gRPC port of the first grammar replica, the next ones count up (default "
        f"{DEFAULT_GRAMMAR_PORT}; 0 picks free ports)",
    )
    parser.add_argument(
        "--grammar-replicas",
        type=int,
        default=1,
        metavar="N",
        help=f"grammar service processes to run (default 1). One that dies is restarted on its "
        f"port; dying {RESTART_LIMIT} times in {RESTART_WINDOW_S:g}s stops everything",
    )
    parser.add_argument(
        "--metrics",
        action="store_true",
        help="serve Prometheus /metrics from the worker and every grammar replica, on free ports "
        "listed in the banner (the gateway serves /metrics on its own port anyway)",
    )
    parser.add_argument(
        "--model", default="default", help="model SPEC (default: the embedded SmolLM2-135M)"
    )
    parser.add_argument(
        "--device", choices=("cpu", "cuda", "xla"), default="cpu", help="worker device (cpu)"
    )
    parser.add_argument(
        "--worker-arg",
        action="append",
        default=[],
        metavar="ARG",
        help="extra argument passed to `maskwire worker` (repeat it; use --worker-arg=--flag)",
    )
    parser.add_argument(
        "--log-dir",
        type=Path,
        default=None,
        help="write each service's log here (default: a new temporary directory)",
    )
    parser.add_argument(
        "--show-logs",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="echo service logs to stderr, prefixed by service (default: on, off with --demo)",
    )
    parser.add_argument(
        "--startup-timeout",
        type=float,
        default=600.0,
        metavar="SECONDS",
        help="how long each service may take to become healthy (default 600)",
    )
    parser.add_argument(
        "--grace",
        type=float,
        default=20.0,
        metavar="SECONDS",
        help="on stop, how long each service may drain before SIGKILL (default 20)",
    )
    parser.add_argument(
        "--demo",
        action="store_true",
        help="start everything on free ports, send one JSON-schema-constrained chat request "
        "through the gateway, print it and the validated answer, then stop",
    )


@dataclass
class Ports:
    gateway: int
    worker: int
    grammar: list[int]
    worker_metrics: int  # 0: no metrics server (without --metrics)
    grammar_metrics: list[int]  # one per replica, like `grammar`


def _bind(host: str, port: int) -> socket.socket:
    """A socket bound to host:port (0: a free port); raises OSError when the port is taken."""
    s = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET)
    if port:
        # As the servers themselves do: a port whose last connections linger in TIME_WAIT (a
        # stack stopped a moment ago) is free to listen on; only a live listener makes it busy.
        # (Not for port 0, whose pick must avoid every port held meanwhile.)
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        s.bind((host, port))
    except OSError:
        s.close()
        raise
    return s


def port_free(host: str, port: int) -> bool:
    """Whether a service could listen on host:port now."""
    try:
        _bind(host, port).close()
    except OSError:
        return False
    return True


def requested_ports(args: argparse.Namespace) -> list[tuple[str, int]]:
    """(flag, port) for the gateway, the worker and each grammar replica; 0 = a free port.

    Raises SystemExit when two of them are the same port.
    """
    if args.demo:
        return [
            ("--port", 0),
            ("--worker-port", 0),
            *[("--grammar-port", 0)] * args.grammar_replicas,
        ]
    first = args.grammar_port
    wanted = [("--port", args.port), ("--worker-port", args.worker_port)]
    wanted += [("--grammar-port", first + i if first else 0) for i in range(args.grammar_replicas)]
    owner: dict[int, str] = {}
    for flag, port in wanted:
        if port and port in owner:
            raise SystemExit(
                f"maskwire up: port {port} is used twice ({owner[port]} and {flag}); "
                "choose different ports"
            )
        owner[port] = flag
    return wanted


def choose_ports(args: argparse.Namespace) -> Ports:
    """Resolve the port flags (0 = a free port; --demo = all free), check the chosen ones are
    bindable, and pick free metrics ports with --metrics."""
    host = args.host
    # Every port stays bound until all are chosen, so a free port never repeats a chosen one.
    with contextlib.ExitStack() as held:

        def hold(flag: str, port: int) -> int:
            try:
                s = held.enter_context(_bind(host, port))
            except OSError:
                raise SystemExit(
                    f"maskwire up: {host}:{port} is already in use (set {flag} to another port, "
                    "or 0 for a free one; is another `maskwire up` running?)"
                ) from None
            return int(s.getsockname()[1])

        gateway, worker, *grammar = [hold(flag, port) for flag, port in requested_ports(args)]
        worker_metrics, *grammar_metrics = [
            hold("--metrics", 0) if args.metrics else 0 for _ in range(len(grammar) + 1)
        ]
        return Ports(gateway, worker, grammar, worker_metrics, grammar_metrics)


class _Signals:
    """First SIGINT/SIGTERM asks for a graceful stop, a second one forces it."""

    def __init__(self) -> None:
        # Set from the handler: not `threading.Event`, whose `set` can deadlock there.
        self.stop = SignalFlag()
        self.force = SignalFlag()
        self.received = ""
        self._previous: dict[int, object] = {}

    def install(self) -> None:
        for sig in (signal.SIGINT, signal.SIGTERM):
            self._previous[sig] = signal.signal(sig, self._handle)

    def restore(self) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)  # type: ignore[arg-type]

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        if self.stop.is_set():
            self.force.set()
            return
        self.received = signal.Signals(signum).name
        self.stop.set()


def _say(text: str) -> None:
    print(f"maskwire up: {text}", file=sys.stderr, flush=True)


def run(args: argparse.Namespace) -> int:
    from maskwire.supervise import stop_in_order

    if not _preflight(args):
        return 2
    ports = choose_ports(args)
    show_logs = (not args.demo) if args.show_logs is None else args.show_logs
    log_dir = args.log_dir or Path(tempfile.mkdtemp(prefix="maskwire-up-"))
    log_dir.mkdir(parents=True, exist_ok=True)
    stack = _Stack(args.host, log_dir, show_logs)
    stack.plan(args, ports)
    signals = _Signals()
    signals.install()
    try:
        rc = _start_and_serve(args, stack, signals)
    finally:
        stop_in_order(
            list(reversed(stack.tiers)),
            args.grace,
            force=signals.force.is_set,
            say=_say,
        )
        signals.restore()
    rc = stack.report_exits(rc)
    _say("stopped" if rc == 0 else f"stopped (exit {rc}); logs in {log_dir}/")
    return rc


def _preflight(args: argparse.Namespace) -> bool:
    """False (said why) when the flags or the embedded model rule out starting anything."""
    if args.grammar_replicas < 1:
        _say("--grammar-replicas must be at least 1")
        return False
    if args.model == "default":
        from maskwire.tokenizer import TokenizerLoadError, embedded_model_path

        try:
            embedded_model_path()
        except TokenizerLoadError as e:
            _say(f"cannot find the embedded model: {e}")
            return False
    return True


class _Stack:
    """The children of one `maskwire up` in their tiers (grammar replicas, worker, gateway),
    where each listens, and whose death was reported."""

    def __init__(self, host: str, log_dir: Path, show_logs: bool) -> None:
        self.host = host
        self.connect_host = (
            "127.0.0.1" if host in ("0.0.0.0", "") else ("::1" if host == "::" else host)
        )
        self.log_dir = log_dir
        self.show_logs = show_logs
        self.where: dict[str, str] = {}  # name -> address
        self.metrics: dict[str, str] = {}  # name -> metrics URL
        self.grammar: list[Child] = []
        self.tiers: list[list[Child]] = []
        self.everyone: list[Child] = []
        self.gateway_url = ""
        self.reported: set[int | None] = set()  # pids whose death was already reported

    def addr(self, port: int) -> str:
        host = self.connect_host
        return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"

    def child(
        self,
        name: str,
        command: str,
        port: int,
        extra: list[str],
        probe: Callable[[], bool],
        metrics_port: int = 0,
    ) -> Child:
        from maskwire.supervise import Child

        argv = [*SERVICE_COMMAND, command, "--port", str(port)]
        argv += ["--host", self.host, *extra]
        self.where[name] = self.addr(port)
        if metrics_port:
            argv += ["--metrics-port", str(metrics_port)]
            self.metrics[name] = f"http://{self.addr(metrics_port)}/metrics"
        return Child(
            name,
            argv,
            log_path=self.log_dir / f"{name}.log",
            probe=probe,
            echo=sys.stderr if self.show_logs else None,
        )

    def plan(self, args: argparse.Namespace, ports: Ports) -> None:
        """The children, not started: each tier pointed at the one it depends on."""
        from maskwire.supervise import http_healthy

        addr = self.addr
        self.gateway_url = f"http://{addr(ports.gateway)}"
        self.metrics["gateway"] = f"{self.gateway_url}/metrics"
        self.grammar = [
            self.child(
                f"grammar-{i}" if args.grammar_replicas > 1 else "grammar",
                "grammar-service",
                port,
                ["--tokenizer", args.model],
                _grpc_probe(addr(port)),
                metrics_port,
            )
            for i, (port, metrics_port) in enumerate(
                zip(ports.grammar, ports.grammar_metrics, strict=True)
            )
        ]
        grammar_targets = ",".join(addr(p) for p in ports.grammar)
        worker_args = ["--model", args.model, "--device", args.device]
        worker = self.child(
            "worker",
            "worker",
            ports.worker,
            [*worker_args, "--grammar-service", grammar_targets, *args.worker_arg],
            _grpc_probe(addr(ports.worker)),
            ports.worker_metrics,
        )
        ready_url = f"{self.gateway_url}/ready"
        gateway = self.child(
            "gateway",
            "gateway",
            ports.gateway,
            ["--worker", addr(ports.worker)],
            lambda: http_healthy(ready_url),
        )
        self.tiers = [self.grammar, [worker], [gateway]]
        self.everyone = [*self.grammar, worker, gateway]

    def report(self, c: Child) -> None:
        self.reported.add(c.pid)
        _report_death(c)

    def start(self, timeout_s: float, signals: _Signals) -> None:
        """Start the tiers in order, each healthy before the next starts (or a signal came)."""
        for tier in self.tiers:
            for c in tier:
                c.start()
                _say(f"started {c.name} on {self.where[c.name]} (pid {c.pid})")
            for c in tier:
                t0 = time.monotonic()
                if not c.wait_ready(timeout_s, signals.stop.is_set):
                    break
                _say(f"{c.name} is healthy ({time.monotonic() - t0:.1f}s)")
            if signals.stop.is_set():
                break

    def report_exits(self, rc: int) -> int:
        """`rc`, or 1 when a child did not end cleanly: each reported once, a death while
        running or a bad exit while draining (a SIGKILL after the grace period was already
        announced)."""
        for c in self.everyone:
            if c.killed:
                rc = 1  # it ignored SIGTERM for the whole grace period (or a second Ctrl-C came)
                continue
            if c.pid in self.reported or c.poll() in (None, 0, -signal.SIGTERM):
                continue
            rc = 1
            _report_death(c, "while stopping" if c.stopping else "")
        return rc


def _start_and_serve(args: argparse.Namespace, stack: _Stack, signals: _Signals) -> int:
    """Start the stack, then serve (or run the demo) until a signal or a death; the exit
    code. Stopping is the caller's."""
    from maskwire.supervise import ChildExited

    started_at = time.monotonic()
    ready = False
    try:
        _say(f"logs in {stack.log_dir}/")
        stack.start(args.startup_timeout, signals)
        if signals.stop.is_set():
            _say(f"{signals.received} received during startup: stopping")
            return 0
        ready = True
        _say(f"ready in {time.monotonic() - started_at:.1f}s")
        _print_banner(
            stack.gateway_url,
            stack.where["worker"],
            [stack.where[c.name] for c in stack.grammar],
            stack.metrics,
            stack.log_dir,
            examples=not args.demo,
        )
        if args.demo:
            from maskwire.demo import run_demo

            return run_demo(stack.gateway_url, stop=signals.stop)
        print("Press Ctrl-C to stop.", flush=True)
        _supervise(stack.everyone, stack.grammar, signals, stack.report)
        _say(f"{signals.received} received: stopping gateway, worker, grammar service")
        return 0
    except ChildExited as e:
        stack.report(e.child)
        why = e.why or (
            f"{e.child.name} is not restarted (only grammar replicas are)"
            if ready
            else f"{e.child.name} died during startup"
        )
        _say(f"{why}; stopping everything")
        return 1
    except TimeoutError as e:
        _say(str(e))
        for c in stack.everyone:
            if c.running and c.log_path.exists():
                _say(f"{c.name} log: {c.log_path}")
        return 1


def _grpc_probe(address: str) -> Callable[[], bool]:
    from maskwire.supervise import grpc_healthy

    return lambda: grpc_healthy(address)


def _supervise(
    children: list[Child],
    grammar: list[Child],
    signals: _Signals,
    report: Callable[[Child], None],
) -> None:
    """Block until a signal arrives, restarting grammar replicas that die; raise ChildExited
    when another child dies or a replica keeps dying."""
    from maskwire.supervise import RestartPolicy, watch

    policies = {
        c: RestartPolicy(
            limit=RESTART_LIMIT, window_s=RESTART_WINDOW_S, backoff_s=RESTART_BACKOFF_S
        )
        for c in grammar
    }
    watch(children, signals.stop, policies=policies, on_death=report, say=_say)


def _report_death(c: Child, when: str = "") -> None:
    when = f" {when}" if when else ""
    _say(f"{c.name} (pid {c.pid}) died{when}: {c.describe_exit()}. Its last log lines:")
    for line in c.last_lines(20):
        print(f"    {line}", file=sys.stderr)
    _say(f"full log: {c.log_path}")


def _print_banner(
    gateway_url: str,
    worker: str,
    grammar: list[str],
    metrics: dict[str, str],
    log_dir: Path,
    *,
    examples: bool,
) -> None:
    lines = [
        "",
        "maskwire is up.",
        f"  OpenAI-compatible REST  {gateway_url}/v1",
        f"  worker (gRPC)           {worker}",
        f"  grammar service (gRPC)  {', '.join(grammar)}",
    ]
    if len(metrics) > 1:  # --metrics (the gateway's alone is not worth a line)
        lines += [
            f"  {'metrics' if i == 0 else '':<24}{url} ({name})"
            for i, (name, url) in enumerate(metrics.items())
        ]
    lines.append(f"  logs                    {log_dir}/")
    if not examples:  # --demo: stops after one request, so nothing is restarted either
        print("\n".join([*lines, ""]), flush=True)
        return
    lines += [
        f"  restarts                a grammar replica that dies is restarted (stops if it dies "
        f"{RESTART_LIMIT} times in {RESTART_WINDOW_S:g}s)",
        "",
        "Try:",
        f"  curl -s {gateway_url}/v1/chat/completions -H 'Content-Type: application/json' \\",
        f"       -d {shlex.quote(_example_body(gateway_url))}",
        f"  maskwire generate --worker {worker} --chat --choice yes --choice no 'Is the sky blue?'",
        "",
    ]
    print("\n".join(lines), flush=True)


def _example_body(gateway_url: str) -> str:
    """The banner's example chat request: a JSON schema for the served model."""
    import json

    from maskwire.demo import model_id

    try:
        model = model_id(gateway_url)
    except Exception:  # the banner must not fail because /v1/models did
        model = "default"
    return json.dumps(
        {
            "model": model,
            "messages": [{"role": "user", "content": "Name a colour."}],
            "response_format": {
                "type": "json_schema",
                "json_schema": {
                    "name": "colour",
                    "schema": {
                        "type": "object",
                        "properties": {"colour": {"type": "string"}},
                        "required": ["colour"],
                    },
                },
            },
        }
    )
