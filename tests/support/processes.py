"""Start real maskwire processes on loopback for integration tests."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Iterator, Sequence
from pathlib import Path

import grpc
import openai
from grpc_health.v1 import health_pb2, health_pb2_grpc

from maskwire.tls import ClientTLS, make_sync_channel

ROOT = Path(__file__).resolve().parents[2]


# The device test workers run on where a test names none: `MASKWIRE_TEST_WORKER_DEVICE=cuda`
# runs the integration suites against a GPU worker (bench/cuda_check.sh); the default is the CPU.
TEST_WORKER_DEVICE = os.environ.get("MASKWIRE_TEST_WORKER_DEVICE", "cpu")


def worker_args(args: list[str]) -> list[str]:
    """`args` plus the worker's reference settings where it chooses none: integration tests run
    the worker eager in fp32 (the configuration checked against transformers), fast to start and
    with the greedy outputs the tests expect, on `TEST_WORKER_DEVICE`; tests of the fast default
    pass their own --compile / --dtype / --quantize."""
    chosen = " ".join(args)
    extra: list[str] = []
    if "--device" not in chosen:
        extra += ["--device", TEST_WORKER_DEVICE]
    if "--compile" not in chosen and "--no-compile" not in chosen:
        extra.append("--no-compile")
    if "--dtype" not in chosen:
        extra += ["--dtype", "float32"]
    if "--quantize" not in chosen:
        extra += ["--quantize", "none"]
    return [*args, *extra]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class ServiceProcess:
    """One `maskwire <command> ...` child process with its log captured to a file."""

    def __init__(
        self,
        command: str,
        args: list[str],
        port: int,
        *,
        http: bool = False,
        tls: ClientTLS | None = None,
        host: str = "127.0.0.1",
    ) -> None:
        self.command = command
        self.port = port
        self.http = http
        self.tls = tls  # how the gRPC health check reaches a TLS server
        self.address = f"{host}:{port}"  # `host` is passed as --host when it is not the default
        if host != "127.0.0.1":
            args = ["--host", host, *args]
        self.log = tempfile.NamedTemporaryFile(  # noqa: SIM115 (lives as long as the process)
            prefix=f"maskwire-{command}-", suffix=".log", delete=False
        )
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        if command == "worker":
            args = worker_args(args)
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "maskwire.cli", command, "--port", str(port), *args],
            stdout=self.log,
            stderr=subprocess.STDOUT,
            cwd=ROOT,
            env=env,
        )

    def log_text(self) -> str:
        return Path(self.log.name).read_text(errors="replace")

    def wait_ready(self, timeout_s: float = 120.0) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(
                    f"{self.command} exited with {self.proc.returncode}:\n{self.log_text()[-4000:]}"
                )
            if self._healthy():
                return
            time.sleep(0.2)
        raise TimeoutError(
            f"{self.command} not ready after {timeout_s}s:\n{self.log_text()[-4000:]}"
        )

    def _healthy(self) -> bool:
        if self.http:
            try:
                with urllib.request.urlopen(f"http://{self.address}/health", timeout=2) as r:
                    return bool(r.status == 200)
            except OSError:
                return False
        with make_sync_channel(self.address, self.tls) as ch:
            try:
                resp = health_pb2_grpc.HealthStub(ch).Check(
                    health_pb2.HealthCheckRequest(), timeout=2
                )
            except grpc.RpcError:
                return False
            return bool(resp.status == health_pb2.HealthCheckResponse.SERVING)

    def kill(self, sig: int = signal.SIGKILL) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)

    def stop(self, timeout_s: float = 20.0) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.log.close()
        return int(self.proc.returncode)


@contextlib.contextmanager
def spawned(
    command: str,
    args: list[str],
    *,
    http: bool = False,
    tls: ClientTLS | None = None,
    host: str = "127.0.0.1",
    port: int = 0,
) -> Iterator[ServiceProcess]:
    """Start a service without waiting for it; stop it (SIGTERM) afterwards. `tls` for the
    health check of a TLS server (`maskwire.tls.client_tls(...)`); `host`/`port` to listen on
    (default a free port on 127.0.0.1)."""
    svc = ServiceProcess(command, args, port or free_port(), http=http, tls=tls, host=host)
    try:
        yield svc
    finally:
        svc.stop()


@contextlib.contextmanager
def running(
    command: str,
    args: list[str],
    *,
    http: bool = False,
    timeout_s: float = 180.0,
    tls: ClientTLS | None = None,
    host: str = "127.0.0.1",
    port: int = 0,
) -> Iterator[ServiceProcess]:
    """`spawned`, and healthy before it is yielded."""
    with spawned(command, args, http=http, tls=tls, host=host, port=port) as svc:
        svc.wait_ready(timeout_s)
        yield svc


@contextlib.contextmanager
def grammar_and_worker(
    worker_args: Sequence[str] = (), grammar_args: Sequence[str] = (), *, model: str = "default"
) -> Iterator[tuple[ServiceProcess, ServiceProcess]]:
    """A grammar service (MODEL's tokenizer) and a worker on MODEL that uses it, started side by
    side (a worker serves before its grammar service answers: it connects when it needs one)."""
    with (
        spawned("grammar-service", ["--tokenizer", model, *grammar_args]) as gs,
        spawned("worker", ["--model", model, "--grammar-service", gs.address, *worker_args]) as w,
    ):
        gs.wait_ready(180.0)
        w.wait_ready(180.0)
        yield gs, w


@contextlib.contextmanager
def full_stack(
    model: str,
    gateway_args: list[str] | tuple[str, ...] = (),
    worker_args: list[str] | tuple[str, ...] = (),
) -> Iterator[ServiceProcess]:
    """Grammar service + worker + gateway on one model SPEC (its tokenizer for the grammar
    service); yields the gateway."""
    with (
        grammar_and_worker(worker_args, model=model) as (_, w),
        # The gateway reports healthy before it reaches its worker: started once the worker is.
        running("gateway", ["--worker", w.address, *gateway_args], http=True) as g,
    ):
        yield g


def openai_client(gateway: ServiceProcess, timeout_s: float = 300) -> openai.OpenAI:
    """The official SDK pointed at a gateway process (no retries: a test sees every error)."""
    return openai.OpenAI(
        base_url=f"http://{gateway.address}/v1", api_key="x", max_retries=0, timeout=timeout_s
    )
