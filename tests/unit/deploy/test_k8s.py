"""deploy/k8s: every overlay renders, validates against the Kubernetes schemas, and is wired right."""

from __future__ import annotations

from typing import Any

import kubernetes_validate
import pytest

from maskwire.discovery import parse_target

from .manifests import OVERLAYS, expand_env, parse_service_args, render

# Oldest version we claim (native gRPC probes are GA since 1.27) and the newest the validator knows.
KUBE_VERSIONS = ("1.27.0", kubernetes_validate.latest_version())


def test_overlays_exist() -> None:
    assert OVERLAYS == ["cpu", "neuron", "secure"]


@pytest.fixture(scope="module", params=OVERLAYS)
def rendered(request: pytest.FixtureRequest) -> tuple[str, dict[tuple[str, str], dict[str, Any]]]:
    objects = render(request.param)
    by_key = {(o["kind"], o["metadata"]["name"]): o for o in objects}
    assert len(by_key) == len(objects), "duplicate objects"
    return request.param, by_key


def _deploy(objs: dict[tuple[str, str], dict[str, Any]], name: str) -> dict[str, Any]:
    return objs[("Deployment", f"maskwire-{name}")]


def _container(objs: dict[tuple[str, str], dict[str, Any]], name: str) -> dict[str, Any]:
    containers = _deploy(objs, name)["spec"]["template"]["spec"]["containers"]
    assert len(containers) == 1
    return containers[0]


def _args(container: dict[str, Any]) -> Any:
    env = {e["name"]: e["value"] for e in container.get("env", []) if "value" in e}
    return parse_service_args([expand_env(a, env) for a in container["args"]])


@pytest.mark.parametrize("version", KUBE_VERSIONS)
def test_objects_validate_against_kubernetes_schemas(rendered, version: str) -> None:
    _, objs = rendered
    for obj in objs.values():
        # strict: unknown fields (typos) are errors too.
        kubernetes_validate.validate(obj, version, strict=True)


def test_expected_objects(rendered) -> None:
    _, objs = rendered
    expected = {
        ("Namespace", "maskwire"),
        ("Deployment", "maskwire-grammar"),
        ("Service", "maskwire-grammar"),
        ("HorizontalPodAutoscaler", "maskwire-grammar"),
        ("PodDisruptionBudget", "maskwire-grammar"),
        ("Deployment", "maskwire-worker"),
        ("Service", "maskwire-worker"),
        ("PodDisruptionBudget", "maskwire-worker"),
        ("Deployment", "maskwire-gateway"),
        ("Service", "maskwire-gateway"),
        ("PodDisruptionBudget", "maskwire-gateway"),
    }
    assert set(objs) == expected
    for (kind, _), obj in objs.items():
        if kind != "Namespace":
            assert obj["metadata"]["namespace"] == "maskwire"
        assert obj["metadata"]["labels"]["app.kubernetes.io/part-of"] == "maskwire"


def test_container_args_are_real_cli_flags(rendered) -> None:
    _, objs = rendered
    for name, command in (
        ("grammar", "grammar-service"),
        ("worker", "worker"),
        ("gateway", "gateway"),
    ):
        args = _args(_container(objs, name))
        assert args.command == command
        assert args.host == "0.0.0.0", f"{name} must listen on the pod IP"


def test_services_select_pods_and_target_named_ports(rendered) -> None:
    _, objs = rendered
    for (kind, name), svc in objs.items():
        if kind != "Service":
            continue
        deploy = objs[("Deployment", name)]
        pod_labels = deploy["spec"]["template"]["metadata"]["labels"]
        assert svc["spec"]["selector"].items() <= pod_labels.items()
        assert deploy["spec"]["selector"]["matchLabels"].items() <= pod_labels.items()
        port_names = {
            p["name"] for p in deploy["spec"]["template"]["spec"]["containers"][0]["ports"]
        }
        for port in svc["spec"]["ports"]:
            assert port["targetPort"] in port_names
    for (kind, name), pdb in objs.items():
        if kind == "PodDisruptionBudget":
            labels = objs[("Deployment", name)]["spec"]["template"]["metadata"]["labels"]
            assert pdb["spec"]["selector"]["matchLabels"].items() <= labels.items()


def test_worker_finds_every_grammar_replica_through_the_headless_service(rendered) -> None:
    _, objs = rendered
    grammar_svc = objs[("Service", "maskwire-grammar")]
    assert grammar_svc["spec"]["clusterIP"] == "None"
    grammar_args = _args(_container(objs, "grammar"))
    target = parse_target(_args(_container(objs, "worker")).grammar_service)
    assert target.resolve, "the worker must resolve every replica (dns:///...)"
    assert target.host.split(".")[0] == "maskwire-grammar"
    assert target.port == grammar_svc["spec"]["ports"][0]["port"] == grammar_args.port
    # Same tokenizer on both sides (the session protocol checks fingerprints, but fail early).
    assert grammar_args.tokenizer == [_args(_container(objs, "worker")).model]


def test_gateway_points_at_the_worker_service(rendered) -> None:
    _, objs = rendered
    worker_port = _args(_container(objs, "worker")).port
    assert _args(_container(objs, "gateway")).worker == [f"maskwire-worker:{worker_port}"]
    assert objs[("Service", "maskwire-worker")]["spec"]["ports"][0]["port"] == worker_port


def test_probes(rendered) -> None:
    _, objs = rendered
    for name in ("grammar", "worker"):
        c = _container(objs, name)
        args = _args(c)
        # Kubernetes gRPC probes cannot speak TLS: a TLS server is probed on its plaintext
        # health-only port.
        assert bool(args.tls_cert) == bool(args.health_port), name
        port = args.health_port or args.port
        for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
            assert c[probe]["grpc"]["port"] == port, (name, probe)
    gw = _container(objs, "gateway")
    assert gw["readinessProbe"]["httpGet"]["path"] == "/ready"
    assert gw["readinessProbe"]["httpGet"]["port"] == "http"
    assert gw["livenessProbe"]["httpGet"]["path"] == "/health"


def test_resources_and_graceful_termination(rendered) -> None:
    _, objs = rendered
    for name in ("grammar", "worker", "gateway"):
        spec = _deploy(objs, name)["spec"]["template"]["spec"]
        c = spec["containers"][0]
        assert c["resources"]["requests"]["cpu"] and c["resources"]["requests"]["memory"]
        assert c["resources"]["limits"]["memory"]
        pre_stop = int(c["lifecycle"]["preStop"]["exec"]["command"][-1])
        args = _args(c)
        drain = getattr(args, "drain_grace_s", 30.0)  # the gateway: uvicorn's 30 s
        assert spec["terminationGracePeriodSeconds"] > pre_stop + drain, name
        assert spec["securityContext"]["runAsNonRoot"] is True


def test_grammar_autoscales_on_cpu(rendered) -> None:
    _, objs = rendered
    hpa = objs[("HorizontalPodAutoscaler", "maskwire-grammar")]
    assert hpa["apiVersion"] == "autoscaling/v2"
    assert hpa["spec"]["scaleTargetRef"] == {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "name": "maskwire-grammar",
    }
    (metric,) = hpa["spec"]["metrics"]
    assert metric["resource"]["name"] == "cpu"
    assert 1 <= hpa["spec"]["minReplicas"] <= hpa["spec"]["maxReplicas"]
    # CPU utilization needs a CPU request to be measured against.
    assert _container(objs, "grammar")["resources"]["requests"]["cpu"]


def test_device_per_overlay(rendered) -> None:
    overlay, objs = rendered
    c = _container(objs, "worker")
    args = _args(c)
    limits = c["resources"]["limits"]
    env = {e["name"]: e.get("value") for e in c["env"]}
    if overlay == "neuron":
        assert limits["aws.amazon.com/neuron"] == 1
        assert args.device == "xla" and env["PJRT_DEVICE"] == "NEURON"
        assert c["image"].startswith("maskwire-worker-neuron:")
    else:
        assert "aws.amazon.com/neuron" not in limits
        assert args.device == "cpu"
        assert c["image"].startswith("maskwire-worker:")
        # compiled graphs outlive a container restart: the default cache is on a volume
        mounts = {m["mountPath"]: m["name"] for m in c["volumeMounts"]}
        assert env["XDG_CACHE_HOME"] in mounts
        volumes = {
            v["name"] for v in _deploy(objs, "worker")["spec"]["template"]["spec"]["volumes"]
        }
        assert mounts[env["XDG_CACHE_HOME"]] in volumes
