"""Read a Prometheus /metrics endpoint in tests."""

from __future__ import annotations

import time
import urllib.request

from prometheus_client.parser import text_string_to_metric_families


def metric(port_or_url: int | str, name: str) -> float:
    """Sum of every sample of `name` (a gauge or counter, all labels) on a /metrics endpoint:
    a port on 127.0.0.1, or the full URL."""
    url = f"http://127.0.0.1:{port_or_url}/metrics" if isinstance(port_or_url, int) else port_or_url
    with urllib.request.urlopen(url, timeout=5) as r:
        return metric_in(r.read().decode(), name, url)


def metric_in(text: str, name: str, source: str) -> float:
    """Sum of every sample of `name` in Prometheus text read from `source` (named in the error)."""
    samples = [
        s.value
        for fam in text_string_to_metric_families(text)
        for s in fam.samples
        if s.name == name
    ]
    if not samples:
        raise AssertionError(f"{source} has no {name}")
    return float(sum(samples))


def settled(
    port_or_url: int | str, name: str, quiet_s: float = 1.0, timeout_s: float = 60
) -> float:
    """`metric(port_or_url, name)` once it has not changed for `quiet_s` (the worker's idle work,
    such as rewriting finished answers into their KV slots, is done)."""
    deadline = time.monotonic() + timeout_s
    value = metric(port_or_url, name)
    since = time.monotonic()
    while time.monotonic() - since < quiet_s:
        if time.monotonic() > deadline:
            raise AssertionError(f"{name} kept changing for {timeout_s:g} s")
        time.sleep(0.05)
        now = metric(port_or_url, name)
        if now != value:
            value, since = now, time.monotonic()
    return value
