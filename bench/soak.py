"""Soak test through the gateway: load, cancellations, leaks and overload, on a real stack.

Starts grammar service + worker + gateway on loopback (embedded SmolLM2), then:

1. steady load: `--clients` concurrent streaming chat clients for `--duration` seconds, a mix of
   constrained (JSON schema / regex / choice) and unconstrained requests, `--cancel-fraction` of
   them closing the stream mid-way; throughput, latency and time-to-first-token percentiles,
   error counts, and the RSS of every service sampled once a second;
2. leaks: `--cancels` requests cancelled mid-stream (tiny max_tokens), then the services' own
   metrics must be back to idle: grammar live requests 0 (and only the worker's own session),
   worker running requests (KV slots) 0 and queue 0, gateway in-flight 0;
3. overload: `--overload` simultaneous requests, far over the gateway's `--max-concurrency` and
   the worker's `--max-queue`: how fast the refused ones get 429 / RESOURCE_EXHAUSTED.

Writes bench/results/soak.json and soak.png. Example: `python bench/soak.py --duration 120
--clients 8`.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import platform
import random
import sys
import threading
import time
import urllib.request
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import grpc  # noqa: E402
import httpx  # noqa: E402
import psutil  # noqa: E402
from prometheus_client.parser import text_string_to_metric_families  # noqa: E402

from maskwire.v1 import worker_pb2, worker_pb2_grpc  # noqa: E402
from tests.support.processes import ServiceProcess, free_port, running  # noqa: E402

MODEL = "SmolLM2-135M-Instruct"
RESULTS = ROOT / "bench" / "results"
PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 16},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
    },
    "required": ["name", "age"],
    "additionalProperties": False,
}


def percentiles(xs: list[float]) -> dict[str, float]:
    if not xs:
        return {}
    s = sorted(xs)

    def p(q: float) -> float:
        return s[min(len(s) - 1, int(q * len(s)))]

    return {"p50": p(0.5), "p90": p(0.9), "p99": p(0.99), "max": s[-1], "n": len(s)}


def scrape(url: str, names: list[str]) -> dict[str, float]:
    with urllib.request.urlopen(url, timeout=5) as r:
        text = r.read().decode()
    out = dict.fromkeys(names, 0.0)
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            if s.name in out:
                out[s.name] += s.value
    return out


class Stack:
    def __init__(self, gs: ServiceProcess, w: ServiceProcess, gw: ServiceProcess, gm: int, wm: int):
        self.gs, self.w, self.gw = gs, w, gw
        self.grammar_metrics = f"http://127.0.0.1:{gm}/metrics"
        self.worker_metrics = f"http://127.0.0.1:{wm}/metrics"
        self.gateway_metrics = f"http://{gw.address}/metrics"
        self.url = f"http://{gw.address}/v1/chat/completions"

    def live_state(self) -> dict[str, float]:
        g = scrape(
            self.grammar_metrics,
            ["maskwire_grammar_live_requests", "maskwire_grammar_live_sessions"],
        )
        w = scrape(
            self.worker_metrics,
            ["maskwire_worker_running_requests", "maskwire_worker_queue_depth"],
        )
        gw = scrape(self.gateway_metrics, ["maskwire_gateway_requests_in_flight"])
        return {
            "grammar_live_requests": g["maskwire_grammar_live_requests"],
            "grammar_live_sessions": g["maskwire_grammar_live_sessions"],
            "worker_running_requests": w["maskwire_worker_running_requests"],
            "worker_queue_depth": w["maskwire_worker_queue_depth"],
            "gateway_in_flight": gw["maskwire_gateway_requests_in_flight"],
        }


class RssSampler(threading.Thread):
    """RSS of each service process, once per `interval_s`."""

    def __init__(self, procs: dict[str, int], interval_s: float = 1.0) -> None:
        super().__init__(daemon=True)
        self.procs = {name: psutil.Process(pid) for name, pid in procs.items()}
        self.interval_s = interval_s
        self.samples: list[dict[str, float]] = []
        self.phases: list[tuple[float, str]] = []
        self._halt = threading.Event()
        self.t0 = time.monotonic()

    def mark(self, phase: str) -> None:
        self.phases.append((time.monotonic() - self.t0, phase))

    def run(self) -> None:
        while not self._halt.is_set():
            row: dict[str, float] = {"t": time.monotonic() - self.t0}
            for name, p in self.procs.items():
                try:
                    row[name] = p.memory_info().rss / 2**20
                except psutil.Error:
                    row[name] = float("nan")
            self.samples.append(row)
            self._halt.wait(self.interval_s)

    def stop(self) -> None:
        self._halt.set()
        self.join()


def request_body(rng: random.Random, max_tokens: int) -> tuple[str, dict[str, Any]]:
    kind = rng.choice(["plain", "plain", "schema", "regex", "choice"])
    body: dict[str, Any] = {
        "model": MODEL,
        "messages": [
            {"role": "user", "content": f"Tell me about person number {rng.randint(1, 999)}."}
        ],
        "max_tokens": max_tokens,
        "temperature": 0.7,
        "seed": rng.randint(0, 2**31),
        "stream": True,
    }
    if kind == "schema":
        body["response_format"] = {
            "type": "json_schema",
            "json_schema": {"name": "person", "schema": PERSON},
        }
    elif kind == "regex":
        body["structured_outputs"] = {"regex": r"[A-Z][a-z]{2,10}, age [0-9]{1,2}\."}
    elif kind == "choice":
        body["structured_outputs"] = {"choice": ["red", "green", "blue", "yellow"]}
    return kind, body


async def one_stream(
    client: httpx.AsyncClient, url: str, body: dict[str, Any], cancel_after: int | None
) -> dict[str, Any]:
    """One SSE request; `cancel_after` events, then the client closes the stream."""
    t0 = time.monotonic()
    out: dict[str, Any] = {"status": None, "ttft": None, "chunks": 0, "error": None}
    async with client.stream("POST", url, json=body) as r:
        out["status"] = r.status_code
        if r.status_code != 200:
            out["error"] = (await r.aread()).decode(errors="replace")[:200]
            out["latency"] = time.monotonic() - t0
            return out
        async for line in r.aiter_lines():
            if not line.startswith("data: "):
                continue
            if line == "data: [DONE]":
                break
            payload = json.loads(line[6:])
            if "error" in payload:
                out["error"] = payload["error"].get("message", "")[:200]
                break
            if out["ttft"] is None:
                out["ttft"] = time.monotonic() - t0
            out["chunks"] += 1
            if cancel_after is not None and out["chunks"] >= cancel_after:
                out["cancelled"] = True
                break
    out["latency"] = time.monotonic() - t0
    return out


async def steady(stack: Stack, args: argparse.Namespace) -> dict[str, Any]:
    rng = random.Random(args.seed)
    deadline = time.monotonic() + args.duration
    results: list[dict[str, Any]] = []

    async def client_loop(i: int) -> None:
        async with httpx.AsyncClient(timeout=httpx.Timeout(120.0)) as client:
            while time.monotonic() < deadline:
                kind, body = request_body(rng, args.max_tokens)
                cancel = rng.random() < args.cancel_fraction
                try:
                    res = await one_stream(
                        client, stack.url, body, rng.randint(1, 8) if cancel else None
                    )
                except httpx.HTTPError as e:
                    res = {"status": None, "error": f"{type(e).__name__}: {e}", "latency": 0.0}
                res["kind"] = kind
                res["t_end"] = time.monotonic()
                results.append(res)

    t0 = time.monotonic()
    await asyncio.gather(*(client_loop(i) for i in range(args.clients)))
    wall = time.monotonic() - t0
    done = [
        r
        for r in results
        if r.get("status") == 200 and not r.get("cancelled") and not r.get("error")
    ]
    cancelled = [r for r in results if r.get("cancelled")]
    errors = [r for r in results if r.get("error") or r.get("status") != 200]
    by_kind: dict[str, int] = {}
    for r in done:
        by_kind[r["kind"]] = by_kind.get(r["kind"], 0) + 1
    error_counts: dict[str, int] = {}
    for r in errors:
        key = f"{r.get('status')}: {(r.get('error') or '')[:80]}"
        error_counts[key] = error_counts.get(key, 0) + 1
    chunks = sum(r.get("chunks", 0) for r in results)
    return {
        "wall_s": wall,
        "requests": len(results),
        "completed": len(done),
        "completed_by_kind": by_kind,
        "cancelled": len(cancelled),
        "errors": len(errors),
        "error_counts": error_counts,
        "requests_per_s": len(done) / wall,
        "stream_chunks_per_s": chunks / wall,
        "latency_s": percentiles([r["latency"] for r in done]),
        "ttft_s": percentiles([r["ttft"] for r in results if r.get("ttft") is not None]),
    }


async def cancels(stack: Stack, args: argparse.Namespace) -> dict[str, Any]:
    """`args.cancels` requests each closed after its first streamed event (a 429 is retried, so
    that exactly that many are cancelled mid-stream); then the services must be idle."""
    rng = random.Random(args.seed + 1)
    outcomes: dict[str, int] = {}
    remaining = [args.cancels]

    async def worker_loop(client: httpx.AsyncClient) -> None:
        while remaining[0] > 0:
            remaining[0] -= 1
            while True:
                _, body = request_body(rng, 16)
                try:
                    res = await one_stream(client, stack.url, body, 1)
                except httpx.HTTPError as e:
                    key = type(e).__name__
                else:
                    if res["status"] == 429:
                        outcomes["429 (retried)"] = outcomes.get("429 (retried)", 0) + 1
                        await asyncio.sleep(0.05)
                        continue
                    key = "cancelled" if res.get("cancelled") else f"{res['status']} finished"
                outcomes[key] = outcomes.get(key, 0) + 1
                break

    before = stack.live_state()
    t0 = time.monotonic()
    async with httpx.AsyncClient(timeout=httpx.Timeout(120.0)) as client:
        await asyncio.gather(*(worker_loop(client) for _ in range(args.max_batch_size)))
    wall = time.monotonic() - t0
    # Give the services a bounded moment to notice the last disconnects.
    idle = {
        "grammar_live_requests": 0.0,
        "grammar_live_sessions": before["grammar_live_sessions"],
        "worker_running_requests": 0.0,
        "worker_queue_depth": 0.0,
        "gateway_in_flight": 0.0,
    }
    settle_t0 = time.monotonic()
    after = stack.live_state()
    while after != idle and time.monotonic() - settle_t0 < 30:
        await asyncio.sleep(0.2)
        after = stack.live_state()
    return {
        "requests": args.cancels,
        "wall_s": wall,
        "outcomes": outcomes,
        "state_before": before,
        "state_after": after,
        "settle_s": time.monotonic() - settle_t0,
        "leak_free": after == idle,
    }


async def overload(stack: Stack, args: argparse.Namespace) -> dict[str, Any]:
    """Far more simultaneous requests than admitted: time to 429 / RESOURCE_EXHAUSTED."""
    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": "Count to one hundred."}],
        "max_tokens": 64,
        "ignore_eos": True,
        "temperature": 0,
    }

    async def http_one(client: httpx.AsyncClient) -> tuple[int, float]:
        t0 = time.monotonic()
        r = await client.post(stack.url, json=body)
        return r.status_code, time.monotonic() - t0

    limits = httpx.Limits(max_connections=args.overload, max_keepalive_connections=args.overload)
    async with httpx.AsyncClient(timeout=httpx.Timeout(300.0), limits=limits) as client:
        # Open the connections first so the burst measures admission, not TCP handshakes.
        await asyncio.gather(
            *(client.get(f"http://{stack.gw.address}/health") for _ in range(args.overload))
        )
        http_res = await asyncio.gather(*(http_one(client) for _ in range(args.overload)))
    http_codes: dict[str, int] = {}
    for code, _ in http_res:
        http_codes[str(code)] = http_codes.get(str(code), 0) + 1

    req = worker_pb2.GenerateRequest(
        text="Count to one hundred.",
        sampling=worker_pb2.SamplingParams(max_tokens=64, ignore_eos=True),
    )

    async def grpc_one(stub: worker_pb2_grpc.WorkerStub) -> tuple[str, float]:
        t0 = time.monotonic()
        try:
            async for _ in stub.Generate(req, timeout=300):
                pass
            code = "OK"
        except grpc.aio.AioRpcError as e:
            code = e.code().name
        return code, time.monotonic() - t0

    async with grpc.aio.insecure_channel(stack.w.address) as ch:
        stub = worker_pb2_grpc.WorkerStub(ch)
        await ch.channel_ready()
        grpc_res = await asyncio.gather(*(grpc_one(stub) for _ in range(args.overload)))
    grpc_codes: dict[str, int] = {}
    for name, _ in grpc_res:
        grpc_codes[name] = grpc_codes.get(name, 0) + 1
    return {
        "simultaneous": args.overload,
        "gateway_max_concurrency": args.max_concurrency,
        "worker_max_batch_size": args.max_batch_size,
        "worker_max_queue": args.max_queue,
        "http_status_counts": http_codes,
        "http_429_latency_s": percentiles([t for c, t in http_res if c == 429]),
        "http_200_latency_s": percentiles([t for c, t in http_res if c == 200]),
        "grpc_status_counts": grpc_codes,
        "grpc_resource_exhausted_latency_s": percentiles(
            [t for c, t in grpc_res if c == "RESOURCE_EXHAUSTED"]
        ),
        "grpc_ok_latency_s": percentiles([t for c, t in grpc_res if c == "OK"]),
    }


def plot(result: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(13, 4.5))
    rss = result["rss_mib"]
    t = [s["t"] for s in rss]
    for name in ("grammar_service", "worker", "gateway"):
        ax1.plot(t, [s[name] for s in rss], label=name)
    for at, phase in result["phases"]:
        ax1.axvline(at, color="grey", lw=0.8, ls="--")
        ax1.text(at, ax1.get_ylim()[1] * 0.98, f" {phase}", fontsize=8, va="top")
    ax1.set_xlabel("seconds")
    ax1.set_ylabel("RSS (MiB)")
    ax1.set_yscale("log")
    ax1.set_title("Resident memory of each service")
    ax1.legend()

    steady_ = result["steady"]
    labels, groups = ["p50", "p90", "p99"], []
    series = {
        "latency (completed)": steady_["latency_s"],
        "time to first token": steady_["ttft_s"],
    }
    ov = result["overload"]
    if ov["http_429_latency_s"]:
        series["time to 429 (gateway)"] = ov["http_429_latency_s"]
    if ov["grpc_resource_exhausted_latency_s"]:
        series["time to RESOURCE_EXHAUSTED (worker)"] = ov["grpc_resource_exhausted_latency_s"]
    width = 0.8 / len(series)
    for k, (name, pct) in enumerate(series.items()):
        xs = [i + k * width for i in range(len(labels))]
        ax2.bar(xs, [pct.get(q, 0) for q in labels], width, label=name)
        groups.append(name)
    ax2.set_xticks([i + 0.4 - width / 2 for i in range(len(labels))], labels)
    ax2.set_yscale("log")
    ax2.set_ylabel("seconds (log)")
    ax2.set_title(
        f"{steady_['requests']} requests, {result['config']['clients']} clients, "
        f"{result['config']['duration']:.0f} s"
    )
    ax2.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


async def run(args: argparse.Namespace) -> dict[str, Any]:
    gm, wm = free_port(), free_port()
    worker_args = [
        "--model", "default", "--metrics-port", str(wm),
        "--max-batch-size", str(args.max_batch_size), "--max-queue", str(args.max_queue),
        "--max-seq-len", "1024",
    ]  # fmt: skip
    with (
        running("grammar-service", ["--tokenizer", "default", "--metrics-port", str(gm)]) as gs,
        running("worker", [*worker_args, "--grammar-service", gs.address]) as w,
        running(
            "gateway",
            ["--worker", w.address, "--max-concurrency", str(args.max_concurrency)],
            http=True,
        ) as gw,
    ):
        stack = Stack(gs, w, gw, gm, wm)
        sampler = RssSampler(
            {"grammar_service": gs.proc.pid, "worker": w.proc.pid, "gateway": gw.proc.pid}
        )
        sampler.start()
        try:
            sampler.mark("steady")
            print(f"steady load: {args.clients} clients for {args.duration:.0f}s", flush=True)
            steady_res = await steady(stack, args)
            print(json.dumps(steady_res, indent=1), flush=True)
            sampler.mark("cancels")
            print(f"{args.cancels} cancelled requests", flush=True)
            cancel_res = await cancels(stack, args)
            print(json.dumps(cancel_res, indent=1), flush=True)
            sampler.mark("overload")
            print(f"overload: {args.overload} simultaneous", flush=True)
            overload_res = await overload(stack, args)
            print(json.dumps(overload_res, indent=1), flush=True)
            final_state = stack.live_state()
        finally:
            sampler.stop()
    rss = sampler.samples
    return {
        "config": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
        "machine": {"cpus": psutil.cpu_count(), "platform": platform.platform()},
        "steady": steady_res,
        "cancels": cancel_res,
        "overload": overload_res,
        "final_state": final_state,
        "rss_mib": rss,
        "rss_summary_mib": {
            name: {
                "start": rss[0][name],
                "end": rss[-1][name],
                "max": max(s[name] for s in rss),
            }
            for name in ("grammar_service", "worker", "gateway")
        },
        "phases": sampler.phases,
    }


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--duration", type=float, default=120.0, help="steady-load seconds")
    p.add_argument("--clients", type=int, default=8, help="concurrent streaming clients")
    p.add_argument("--max-tokens", type=int, default=48, help="per request (steady load)")
    p.add_argument("--cancel-fraction", type=float, default=0.25, help="clients that hang up")
    p.add_argument("--cancels", type=int, default=1000, help="requests cancelled mid-stream")
    p.add_argument("--overload", type=int, default=96, help="simultaneous requests (overload)")
    p.add_argument("--max-concurrency", type=int, default=32, help="gateway admission limit")
    p.add_argument("--max-batch-size", type=int, default=8, help="worker batch")
    p.add_argument("--max-queue", type=int, default=8, help="worker queue")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, default=RESULTS / "soak.json")
    args = p.parse_args()
    if not (0 < args.duration <= 3600 and 0 < args.clients <= 256 and 0 <= args.cancels <= 10000):
        p.error("bounded: --duration <= 3600, --clients <= 256, --cancels <= 10000")
    result = asyncio.run(run(args))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    plot(result, args.out.with_suffix(".png"))
    print(f"wrote {args.out} and {args.out.with_suffix('.png')}")
    ok = result["cancels"]["leak_free"]
    print("leak check:", "OK" if ok else f"FAILED {result['cancels']['state_after']}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
