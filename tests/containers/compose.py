"""The compose stack of deploy/docker/compose.yaml run by podman-compose, as the container suite
drives it: containers listed by service, health checks run on demand, metrics read inside a
container (its ports stay unpublished), logs kept for a failure's message."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import time
import tomllib
from collections.abc import Callable
from pathlib import Path
from typing import Any

import yaml

from maskwire.supervise import grpc_healthy, http_healthy
from tests.support.metrics import metric_in
from tests.support.processes import ROOT

COMPOSE_FILE = ROOT / "deploy" / "docker" / "compose.yaml"
SERVICES = ("grammar", "worker", "gateway")
VERSION = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"]
IMAGES = {name: f"maskwire-{name}:{VERSION}" for name in SERVICES}
SETUP = "make test-containers sets the machine up (deploy/podman-setup.sh, deploy/images.sh)"


def podman(
    *args: str, timeout_s: float = 120, check: bool = True
) -> subprocess.CompletedProcess[str]:
    done = subprocess.run(
        ["podman", *args], capture_output=True, text=True, timeout=timeout_s, check=False
    )
    if check and done.returncode != 0:
        raise AssertionError(f"podman {' '.join(args)}: exit {done.returncode}: {done.stderr}")
    return done


def engine_problem() -> str | None:
    """Why this machine cannot run the suite's containers, or None when it can."""
    for tool in ("podman", "podman-compose"):
        if shutil.which(tool) is None:
            return f"{tool} is not installed; {SETUP}"
    for image in IMAGES.values():
        if podman("image", "exists", image, check=False).returncode != 0:
            return f"image {image} is missing; {SETUP}"
    # The hardening the compose file asks for, on the smallest image.
    probe = podman(
        "run", "--rm", "--network=none", "--read-only", "--cap-drop=ALL", "--tmpfs=/tmp",
        IMAGES["gateway"], "--help", check=False, timeout_s=60,
    )  # fmt: skip
    if probe.returncode != 0:
        return f"podman cannot run a container here: {probe.stderr.strip()[-2000:]}"
    return dns_problem()


def dns_problem() -> str | None:
    """Why containers on one network cannot resolve each other's names (the stack finds its
    services by name), or None when they can."""
    tag = f"maskwire-dns-probe-{os.getpid()}"
    python = ("--entrypoint=python", IMAGES["gateway"], "-c")
    podman("network", "create", tag)
    try:
        podman("run", "-d", "--rm", f"--network={tag}", f"--name={tag}", *python,
               "import time; time.sleep(60)")  # fmt: skip
        lookup = podman("run", "--rm", f"--network={tag}", *python,
                        f"import socket; socket.getaddrinfo('{tag}', 80)", check=False)  # fmt: skip
        if lookup.returncode != 0:
            return (
                "containers on one network cannot resolve each other's names (with CNI, the "
                f"dnsname plugin is missing); {SETUP}: {lookup.stderr.strip()[-500:]}"
            )
        return None
    finally:
        podman("rm", "-f", "-t", "0", tag, check=False)
        podman("network", "rm", "-f", tag, check=False)


class ComposeStack:
    """One compose project (its own containers, network and compile-cache volume), gateway and
    worker published on the given loopback ports."""

    def __init__(self, project: str, gateway_port: int, worker_port: int, logs: Path) -> None:
        self.project = project
        self.gateway_port = gateway_port
        self.worker_port = worker_port
        self.logs = logs
        logs.mkdir(parents=True, exist_ok=True)
        self.overrides: list[Path] = []  # compose files applied over COMPOSE_FILE, in order

    def compose(self, *args: str, timeout_s: float = 300) -> str:
        """Run `podman-compose` on this project; its output (also kept in the log directory)."""
        command = ["podman-compose", "-p", self.project, "-f", str(COMPOSE_FILE)]
        for extra in self.overrides:
            command += ["-f", str(extra)]
        env = {
            **os.environ,
            "MASKWIRE_GATEWAY_PORT": str(self.gateway_port),
            "MASKWIRE_WORKER_PORT": str(self.worker_port),
        }
        done = subprocess.run(
            [*command, *args], capture_output=True, text=True, timeout=timeout_s, env=env
        )
        with (self.logs / "podman-compose.log").open("a") as f:
            f.write(f"$ {' '.join(command + list(args))}\n{done.stdout}{done.stderr}\n")
        # podman-compose 1.0.3 exits 0 even where a podman command failed: the suite checks the
        # containers themselves.
        return done.stdout + done.stderr

    def scale(self, service: str, replicas: int) -> None:
        """`replicas` containers of `service` (podman-compose 1.0.3 has no working --scale: the
        count goes in an override file, `deploy.replicas`)."""
        override = self.logs / f"{service}-{replicas}.yaml"
        override.write_text(
            yaml.safe_dump({"services": {service: {"deploy": {"replicas": replicas}}}})
        )
        self.overrides.append(override)
        self.compose("up", "-d", "--no-build", service)

    def containers(self, service: str) -> list[str]:
        """The service's containers (any state), in replica order."""
        out = podman(
            "ps", "-a", "--format", "{{.Names}}",
            "--filter", f"label=io.podman.compose.project={self.project}",
            "--filter", f"label=com.docker.compose.service={service}",
        ).stdout  # fmt: skip
        return sorted(out.split(), key=lambda name: int(name.rsplit("_", 1)[1]))

    def inspect(self, name: str) -> dict[str, Any]:
        return dict(json.loads(podman("inspect", name).stdout)[0])

    def healthy(self, name: str) -> bool:
        """Run the container's health check now (podman runs them from systemd timers, which a
        machine without systemd lacks): True when it passes."""
        return podman("healthcheck", "run", name, check=False, timeout_s=30).returncode == 0

    def wait_healthy(
        self, name: str, timeout_s: float, ready: Callable[[], bool] | None = None
    ) -> float:
        """Seconds until `name` passes its health check; fails after `timeout_s`, or once it has
        stayed exited for 5 checks (a restart policy brings a crashed one back sooner). `ready`:
        a cheaper check from the host through a published port, polled every second until it
        passes before the health check (a Python process in the container) runs."""
        began = time.monotonic()
        exited = 0
        while not ((ready is None or ready()) and self.healthy(name)):
            state = self.inspect(name)["State"]
            exited = 0 if state["Running"] else exited + 1
            if exited >= 5:
                raise AssertionError(f"{name} exited ({state['ExitCode']}):\n{self.tail(name)}")
            if time.monotonic() - began > timeout_s:
                raise AssertionError(
                    f"{name} not healthy after {timeout_s:.0f}s:\n{self.tail(name)}"
                )
            time.sleep(1 if ready is not None else 2)
        return time.monotonic() - began

    def worker_ready(self) -> bool:
        return grpc_healthy(f"127.0.0.1:{self.worker_port}")

    def gateway_ready(self) -> bool:
        return http_healthy(f"http://127.0.0.1:{self.gateway_port}/ready")

    def crash(self, name: str) -> None:
        """SIGKILL the container's main process from the host, as the kernel's OOM killer or a
        crash would end it (`podman kill` counts as a stop by the user: no restart follows)."""
        os.kill(int(self.inspect(name)["State"]["Pid"]), signal.SIGKILL)

    def metric(self, name: str, metric: str, unset: float | None = None) -> float:
        """A metric of the grammar service or worker in `name`, read on its own loopback;
        `unset`: the value of a labelled counter that has no sample yet."""
        read = "import urllib.request; print(urllib.request.urlopen('http://127.0.0.1:9090/metrics', timeout=5).read().decode())"
        text = podman("exec", name, "python", "-c", read).stdout
        if unset is not None and not re.search(rf"^{metric}[{{ ]", text, re.MULTILINE):
            return unset
        return metric_in(text, metric, name)

    def log(self, name: str) -> str:
        done = podman("logs", name, check=False)
        return done.stdout + done.stderr

    def tail(self, name: str, lines: int = 40) -> str:
        return "\n".join(self.log(name).splitlines()[-lines:])

    def save_logs(self) -> None:
        for service in SERVICES:
            for name in self.containers(service):
                (self.logs / f"{name}.log").write_text(self.log(name))
