"""deploy/k8s overlays/secure: mutual TLS on every gRPC hop from mounted Secrets, API keys from a
Secret, and each certificate path a flag names is inside the Secret volume it comes from."""

from __future__ import annotations

from pathlib import PurePosixPath
from typing import Any

import pytest

from .manifests import expand_env, parse_service_args, render

TLS_SECRETS = {
    "grammar": "maskwire-grammar-tls",
    "worker": "maskwire-worker-tls",
    "gateway": "maskwire-gateway-tls",
}


@pytest.fixture(scope="module")
def objs() -> dict[tuple[str, str], dict[str, Any]]:
    return {(o["kind"], o["metadata"]["name"]): o for o in render("secure")}


def _pod(objs: dict[tuple[str, str], dict[str, Any]], name: str) -> dict[str, Any]:
    spec: dict[str, Any] = objs[("Deployment", f"maskwire-{name}")]["spec"]["template"]["spec"]
    return spec


def _args(pod: dict[str, Any]) -> Any:
    c = pod["containers"][0]
    env = {e["name"]: e["value"] for e in c.get("env", []) if "value" in e}
    return parse_service_args([expand_env(a, env) for a in c["args"]])


def _secret_files(pod: dict[str, Any], secret: str) -> PurePosixPath:
    """The mount path of `secret` in the pod's container (read-only, group-readable only)."""
    volumes = {v["name"]: v for v in pod["volumes"]}
    (mount,) = [
        m
        for m in pod["containers"][0]["volumeMounts"]
        if volumes[m["name"]].get("secret", {}).get("secretName") == secret
    ]
    assert mount["readOnly"] is True
    assert volumes[mount["name"]]["secret"]["defaultMode"] == 0o440
    # Secret files are root-owned: the non-root user reads them through its group.
    assert pod["securityContext"]["fsGroup"] == pod["securityContext"]["runAsGroup"]
    return PurePosixPath(mount["mountPath"])


def _inside(path: str, directory: PurePosixPath) -> bool:
    return PurePosixPath(path).parent == directory


def test_grammar_service_requires_client_certificates(objs) -> None:
    pod = _pod(objs, "grammar")
    args = _args(pod)
    files = _secret_files(pod, TLS_SECRETS["grammar"])
    for path in (args.tls_cert, args.tls_key, args.tls_client_ca):
        assert path and _inside(path, files)


def test_worker_serves_mtls_and_dials_the_grammar_service_with_mtls(objs) -> None:
    pod = _pod(objs, "worker")
    args = _args(pod)
    files = _secret_files(pod, TLS_SECRETS["worker"])
    for path in (args.tls_cert, args.tls_key, args.tls_client_ca):
        assert path and _inside(path, files)
    for path in (args.grammar_tls_ca, args.grammar_tls_cert, args.grammar_tls_key):
        assert path and _inside(path, files)
    # Replicas are dialled by pod IP: the certificate is checked against the Service's name.
    assert args.grammar_tls_server_name == "maskwire-grammar"
    assert args.grammar_service.startswith("dns:///maskwire-grammar:")


def test_gateway_dials_workers_with_mtls_and_requires_api_keys(objs) -> None:
    pod = _pod(objs, "gateway")
    args = _args(pod)
    files = _secret_files(pod, TLS_SECRETS["gateway"])
    for path in (args.worker_tls_ca, args.worker_tls_cert, args.worker_tls_key):
        assert path and _inside(path, files)
    assert args.worker_tls_server_name == "maskwire-worker"
    env = {e["name"]: e for e in pod["containers"][0]["env"]}
    assert env["MASKWIRE_API_KEYS"]["valueFrom"]["secretKeyRef"] == {
        "name": "maskwire-gateway-api-keys",
        "key": "api-keys",
    }
    assert args.max_concurrency_per_key > 0
    assert not args.api_key, "keys on the command line are visible in the pod spec and `ps`"


def test_probes_use_the_plaintext_health_port(objs) -> None:
    for name in ("grammar", "worker"):
        c = _pod(objs, name)["containers"][0]
        args = _args(_pod(objs, name))
        assert args.health_port not in (0, args.port)
        assert {"name": "health", "containerPort": args.health_port} in c["ports"]
        # Services expose only the TLS port, never the health port.
        svc_ports = objs[("Service", f"maskwire-{name}")]["spec"]["ports"]
        assert [p["targetPort"] for p in svc_ports] == ["grpc"]
