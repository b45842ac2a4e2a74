"""A stand-in for `maskwire <command>` used by the `maskwire up` tests: health only, no model.

Usage: python -m tests.unit.cli.fake_service COMMAND --port P --host H [ARGS...]. grammar-service and worker serve gRPC
health, gateway serves HTTP /health, /v1/models and a canned /v1/chat/completions. Environment:
FAKE_EVENTS (file to append "COMMAND start|stop ARGS" lines to), FAKE_CRASH=COMMAND (exit 3 a moment
after becoming healthy: FAKE_CRASH_AFTER seconds, default 1.5, or a comma list of them for its 1st,
2nd, ... run, the last repeating, an empty one for a run that does not crash; runs are counted in
FAKE_EVENTS), FAKE_NEVER_READY=COMMAND (never report healthy),
FAKE_IGNORE_TERM=COMMAND, FAKE_BAD_STOP=COMMAND (exit 4 on SIGTERM), FAKE_ANSWER (chat content).
"""

from __future__ import annotations

import json
import os
import signal
import sys
import threading
import time
from concurrent import futures
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from maskwire.lifeline import hold_on
from maskwire.signal_flag import SignalFlag

ANSWER = '{"name": "France", "capital": "Paris", "population": 67000000}'


def record(event: str) -> None:
    path = os.environ.get("FAKE_EVENTS")
    if path:
        with open(path, "a") as f:
            f.write(event + "\n")


def runs(command: str) -> int:
    """How often `command` was started so far (this run included)."""
    with open(os.environ["FAKE_EVENTS"]) as f:
        return sum(line.startswith(f"{command} start") for line in f)


def crash_after(command: str) -> float | None:
    """Seconds this run lives after becoming healthy before it crashes; None: it does not."""
    if os.environ.get("FAKE_CRASH") != command:
        return None
    delays = os.environ.get("FAKE_CRASH_AFTER", "1.5").split(",")
    delay = delays[min(runs(command), len(delays)) - 1]
    return float(delay) if delay else None


def main() -> None:
    hold_on()  # as `maskwire.cli` does
    command, rest = sys.argv[1], sys.argv[2:]
    port = int(rest[rest.index("--port") + 1])
    host = rest[rest.index("--host") + 1]
    record(f"{command} start {' '.join(rest)}")
    ready = os.environ.get("FAKE_NEVER_READY") != command
    stop = SignalFlag()  # not threading.Event: set from the SIGTERM handler
    if os.environ.get("FAKE_IGNORE_TERM") == command:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    else:
        signal.signal(signal.SIGTERM, lambda *_: stop.set())
    print(f"fake {command}: listening on {host}:{port}", flush=True)
    if command == "gateway":
        server = _http(host, port, ready)
        threading.Thread(target=server.serve_forever, daemon=True).start()
    else:
        grpc_server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
        servicer = health.HealthServicer()
        servicer.set(
            "",
            health_pb2.HealthCheckResponse.SERVING
            if ready
            else health_pb2.HealthCheckResponse.NOT_SERVING,
        )
        health_pb2_grpc.add_HealthServicer_to_server(servicer, grpc_server)
        grpc_server.add_insecure_port(f"{host}:{port}")
        grpc_server.start()
    crash = crash_after(command)
    if crash is not None:
        time.sleep(crash)
        print(f"fake {command}: boom, something broke", flush=True)
        sys.exit(3)
    while not stop.wait(0.2):
        pass
    record(f"{command} stop")
    if os.environ.get("FAKE_BAD_STOP") == command:
        print(f"fake {command}: drain failed", flush=True)
        sys.exit(4)
    print(f"fake {command}: stopped", flush=True)


def _http(host: str, port: int, ready: bool) -> ThreadingHTTPServer:
    class Handler(BaseHTTPRequestHandler):
        def _send(self, code: int, body: object) -> None:
            data = json.dumps(body).encode()
            self.send_response(code)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def do_GET(self) -> None:
            if self.path in ("/health", "/ready"):
                self._send(200 if ready else 503, {"status": "ok" if ready else "starting"})
            elif self.path == "/v1/models":
                self._send(200, {"object": "list", "data": [{"id": "fake-model"}]})
            else:
                self._send(404, {"error": {"message": "not found"}})

        def do_POST(self) -> None:
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            record(f"gateway request {json.dumps(body)}")
            content = os.environ.get("FAKE_ANSWER", ANSWER)
            self._send(
                200,
                {
                    "choices": [{"message": {"content": content}, "finish_reason": "stop"}],
                    "usage": {"completion_tokens": 21},
                },
            )

        def log_message(self, *args: object) -> None:
            pass

    return ThreadingHTTPServer((host, port), Handler)


if __name__ == "__main__":
    main()
