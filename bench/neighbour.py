"""The worker beside busy neighbours and under a CPU quota: does it keep its share of the machine?

Starts `maskwire up` (its defaults, or `--up-args`) and sends the same chat workload under each
condition, in this order, so drifting load is visible as a difference between the two quiet runs:

* `quiet`: nothing else runs;
* `busy1`, `busy2`: one / two other processes spin in a plain Python loop (a neighbour pod, a
  browser, a CI job);
* `quota`: the whole stack in a cgroup with a CPU quota of `--quota` CPUs (how a Kubernetes CPU
  limit looks to a process: cgroup v2 `cpu.max` or v1 `cpu.cfs_quota_us`; needs root);
* `quiet_again`.

Workload per condition: c1 (requests one after another) and c8 (8 at once), unconstrained and
constrained (a JSON schema), greedy, `--max-tokens` new tokens, through the gateway's
OpenAI-compatible API with streaming. c1: decode tok/s = (tokens - 1) / (end - first token),
median over requests; c8: aggregate tok/s = tokens / wall time. With `--llama-server PATH` the same
workload runs against llama.cpp's server (same GGUF, `-t 2 -np 8`) under the same conditions, as
the peer a CPU user compares with first.

Writes bench/results/<name>.json and .png. Never part of CI: it needs a quiet machine.
With `--versus ARGS` it instead compares two `maskwire up` stacks, both up at once and measured in
alternating order under each condition (e.g. the default against `--worker-arg=
--no-adaptive-threads`: what the thread governor costs a quiet host); `--versus-body JSON` compares
on one stack, its requests without and with those body fields (e.g. `{"speculative": false}`:
speculation against none with the same worker, threads and caches on both sides).

Usage: python bench/neighbour.py [--max-tokens 64] [--conditions quiet,busy1,...] [--name N]
       python bench/neighbour.py --versus "--worker-arg=--no-adaptive-threads" [--rounds 4]
       python bench/neighbour.py --versus-body '{"speculative": false}' --conditions quiet,busy1
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import json
import multiprocessing
import os
import platform
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "bench" / "results"

PROMPTS = [
    "Describe a fictional city in one paragraph.",
    "Write a short note about the history of tea.",
    "Explain how a bicycle works.",
    "Tell me about a famous mountain.",
    "Summarise the plot of a heist movie you invent.",
    "Describe your ideal breakfast.",
    "Give advice to someone learning to cook.",
    "Describe a day at the seaside.",
]
SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string"},
        "population": {"type": "integer"},
        "landmarks": {"type": "array", "items": {"type": "string"}},
        "summary": {"type": "string"},
    },
    "required": ["name", "population", "landmarks", "summary"],
    "additionalProperties": False,
}
CONDITIONS = ("quiet", "busy1", "busy2", "quota", "quiet_again")


# ------------------------------------------------------------------ neighbours and quotas
def _spin() -> None:
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    while True:
        pass


@contextlib.contextmanager
def busy_neighbours(n: int) -> Iterator[None]:
    """`n` processes that each keep one core busy (a plain Python loop) until the block ends."""
    procs = [multiprocessing.Process(target=_spin, daemon=True) for _ in range(n)]
    for p in procs:
        p.start()
    try:
        time.sleep(1.0)  # let the scheduler settle them
        yield
    finally:
        for p in procs:
            p.terminate()
            p.join()


class CpuQuota:
    """A cgroup with a CPU quota that processes can be moved into (v2, else v1; needs root)."""

    def __init__(self, cpus: float, name: str = "maskwire-bench") -> None:
        period = 100_000
        quota = int(cpus * period)
        v2 = Path("/sys/fs/cgroup")
        v1 = Path("/sys/fs/cgroup/cpu")
        if (v2 / "cgroup.controllers").exists():
            self.path = v2 / name
            self.path.mkdir(exist_ok=True)
            (self.path / "cpu.max").write_text(f"{quota} {period}")
        elif v1.is_dir():
            self.path = v1 / name
            self.path.mkdir(exist_ok=True)
            (self.path / "cpu.cfs_period_us").write_text(str(period))
            (self.path / "cpu.cfs_quota_us").write_text(str(quota))
        else:
            raise RuntimeError("no writable cgroup CPU controller")
        self.cpus = cpus

    def add(self, pid: int) -> None:
        (self.path / "cgroup.procs").write_text(str(pid))

    def throttled_s(self) -> float:
        """Seconds the group has been throttled so far (v2 `throttled_usec`, v1 `throttled_time`)."""
        for line in (self.path / "cpu.stat").read_text().splitlines():
            key, value = line.split()
            if key == "throttled_usec":
                return int(value) / 1e6
            if key == "throttled_time":
                return int(value) / 1e9
        return 0.0

    def remove(self) -> None:
        with contextlib.suppress(OSError):
            self.path.rmdir()


# ------------------------------------------------------------------ servers
def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def wait_http(url: str, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        with contextlib.suppress(OSError), urllib.request.urlopen(url, timeout=2) as r:
            if r.status == 200:
                return
        time.sleep(0.5)
    raise TimeoutError(f"{url} not ready after {timeout_s} s")


class Server:
    """A server process with an OpenAI-compatible API: its base URL and how to stop it."""

    def __init__(self, name: str, argv: list[str], base: str, health: str, cgroup: Any) -> None:
        self.name = name
        fd, self.log_path = tempfile.mkstemp(prefix=f"{name}-", suffix=".log")
        hook: Callable[[], None] | None = None
        if cgroup is not None:
            hook = lambda: cgroup.add(os.getpid())  # noqa: E731 (children inherit the group)
        self.proc = subprocess.Popen(
            argv, stdout=fd, stderr=subprocess.STDOUT, preexec_fn=hook, start_new_session=True
        )
        os.close(fd)
        self.base = base
        self.body: dict[str, Any] = {}  # fields added to every request's body
        wait_http(health, 900)
        with urllib.request.urlopen(f"{base}/models", timeout=10) as r:
            self.model = json.loads(r.read())["data"][0]["id"]

    def stop(self) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGINT)
        try:
            self.proc.wait(60)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()


def start_maskwire(up_args: list[str], cgroup: Any) -> Server:
    port = free_port()
    argv = [sys.executable, "-m", "maskwire.cli", "up", "--port", str(port), "--worker-port", "0"]
    argv += ["--grammar-port", "0", "--no-show-logs", *up_args]
    url = f"http://127.0.0.1:{port}"
    return Server("maskwire", argv, f"{url}/v1", f"{url}/ready", cgroup)


def smollm_gguf() -> Path:
    from maskwire.tokenizer import resolve_spec

    return Path(resolve_spec("default"))


def start_llama_server(binary: Path, max_tokens: int, cgroup: Any) -> Server:
    port = free_port()
    argv = [str(binary), "-m", str(smollm_gguf()), "--host", "127.0.0.1", "--port", str(port)]
    argv += ["-t", "2", "-np", "8", "-c", str(8 * (256 + max_tokens)), "--no-webui"]
    url = f"http://127.0.0.1:{port}"
    return Server("llama-server", argv, f"{url}/v1", f"{url}/health", cgroup)


# ------------------------------------------------------------------ workload
def chat_chunks(server: Server, body: dict[str, Any]) -> Iterator[dict[str, Any]]:
    """POST a streamed chat completion `body` to `server`; its SSE chunks, parsed, as they
    arrive."""
    req = urllib.request.Request(
        f"{server.base}/chat/completions",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
    )
    with urllib.request.urlopen(req, timeout=600) as r:
        for raw in r:
            line = raw.decode().strip()
            if line.startswith("data:") and line != "data: [DONE]":
                yield json.loads(line[5:])


def one_request(
    server: Server,
    prompt: str,
    constrained: bool,
    max_tokens: int,
    arrivals: list[float] | None = None,
) -> dict[str, Any]:
    """One streamed chat request's figures; `arrivals`, when given, gets each content chunk's
    arrival time (`time.monotonic`)."""
    body: dict[str, Any] = {
        "model": server.model,
        "messages": [{"role": "user", "content": prompt}],
        "max_tokens": max_tokens,
        "temperature": 0,
        "stream": True,
        # Tokens are counted from the usage chunk: a streamed chunk can carry several tokens
        # (jump-forward, accepted drafts), so counting chunks would undercount them.
        "stream_options": {"include_usage": True},
    }
    body.update(server.body)
    if constrained:
        body["response_format"] = {
            "type": "json_schema",
            "json_schema": {"name": "answer", "schema": SCHEMA},
        }
    else:
        body["ignore_eos"] = True
    began = time.perf_counter()
    first: float | None = None
    pieces = 0
    text = []
    for chunk in chat_chunks(server, body):
        choices = chunk.get("choices") or []
        delta = choices[0].get("delta", {}).get("content") if choices else None
        if delta:
            if arrivals is not None:
                arrivals.append(time.monotonic())
            first = first or time.perf_counter()
            pieces += 1
            text.append(delta)
        usage = chunk.get("usage")
        if usage:
            pieces = max(pieces, int(usage.get("completion_tokens") or 0))
    end = time.perf_counter()
    tokens = pieces
    decode_s = end - (first or end)
    return {
        "tokens": tokens,
        "ttft_s": (first or end) - began,
        "wall_s": end - began,
        "decode_tok_s": (tokens - 1) / decode_s if tokens > 1 and decode_s > 0 else 0.0,
        "text": "".join(text),
    }


def workload(server: Server, max_tokens: int, requests: int) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for constrained in (False, True):
        kind = "constrained" if constrained else "unconstrained"
        c1 = [one_request(server, p, constrained, max_tokens) for p in PROMPTS[:requests]]
        out[f"c1_{kind}"] = {
            "decode_tok_s": statistics.median(r["decode_tok_s"] for r in c1),
            "ttft_ms": 1000 * statistics.median(r["ttft_s"] for r in c1),
            "runs": [r["decode_tok_s"] for r in c1],
        }
        began = time.perf_counter()
        with ThreadPoolExecutor(8) as pool:
            jobs = [pool.submit(one_request, server, p, constrained, max_tokens) for p in PROMPTS]
            c8 = [j.result() for j in jobs]
        wall = time.perf_counter() - began
        out[f"c8_{kind}"] = {"agg_tok_s": sum(r["tokens"] for r in c8) / wall, "wall_s": wall}
        if constrained:
            out[f"c8_{kind}"]["valid"] = sum(_valid(r["text"]) for r in c8)
    return out


def _valid(text: str) -> bool:
    try:
        value = json.loads(text)
    except ValueError:
        return False
    return isinstance(value, dict) and set(value) == set(SCHEMA["required"])


def headline(result: dict[str, Any]) -> dict[str, float]:
    return {
        "c1_unconstrained": result["c1_unconstrained"]["decode_tok_s"],
        "c1_constrained": result["c1_constrained"]["decode_tok_s"],
        "c8_unconstrained": result["c8_unconstrained"]["agg_tok_s"],
        "c8_constrained": result["c8_constrained"]["agg_tok_s"],
    }


def run_engine(
    name: str, start: Callable[[Any], Server], args: argparse.Namespace
) -> dict[str, Any]:
    """Every condition for one engine; the stack is restarted for the quota (a cgroup is joined
    at start) and kept running across the others."""
    results: dict[str, Any] = {}
    server = start(None)
    try:
        one_request(server, PROMPTS[0], True, 8)  # warm-up: first schema, first graphs
        one_request(server, PROMPTS[0], False, 8)
        for cond in args.conditions:
            if cond == "quota":
                continue
            busy = {"busy1": 1, "busy2": 2}.get(cond, 0)
            with busy_neighbours(busy):
                results[cond] = workload(server, args.max_tokens, args.c1_requests)
            print(name, cond, _fmt(headline(results[cond])), flush=True)
    finally:
        server.stop()
    if "quota" in args.conditions:
        group = CpuQuota(args.quota)
        try:
            server = start(group)
            try:
                one_request(server, PROMPTS[0], True, 8)
                one_request(server, PROMPTS[0], False, 8)
                before = group.throttled_s()
                results["quota"] = workload(server, args.max_tokens, args.c1_requests)
                results["quota"]["throttled_s"] = group.throttled_s() - before
            finally:
                server.stop()
            print(name, "quota", _fmt(headline(results["quota"])), flush=True)
        finally:
            group.remove()
    return results


def interleaved(
    up_args: list[str], versus: list[str], versus_body: dict[str, Any], args: argparse.Namespace
) -> dict[str, Any]:
    """Two variants, the workload on each in alternating order for `args.rounds` rounds under
    each condition (quiet, busy1, busy2; the neighbours run while both are measured): a
    difference between them is not drift. The variants: two `maskwire up` stacks at once
    (`up_args` and `versus`), or one stack whose requests go without and with the fields
    `versus_body` (which then also rules out a difference between two processes)."""
    conditions = [c for c in args.conditions if c != "quota"]
    servers = {"maskwire": start_maskwire(up_args, None)}
    try:
        if versus_body:
            servers["versus"] = copy.copy(servers["maskwire"])
            servers["versus"].body = versus_body
        else:
            servers["versus"] = start_maskwire(versus, None)
        for server in servers.values():
            one_request(server, PROMPTS[0], True, 8)
            one_request(server, PROMPTS[0], False, 8)
        rounds: dict[str, dict[str, list[dict[str, float]]]] = {
            c: {name: [] for name in servers} for c in conditions
        }
        for r in range(args.rounds):
            for cond in conditions:
                busy = {"busy1": 1, "busy2": 2}.get(cond, 0)
                with busy_neighbours(busy):
                    for name in list(servers)[:: 1 if r % 2 == 0 else -1]:
                        h = headline(workload(servers[name], args.max_tokens, args.c1_requests))
                        rounds[cond][name].append(h)
                        print(name, cond, f"round {r}", _fmt(h), flush=True)
    finally:
        for server in {s.proc.pid: s for s in servers.values()}.values():
            server.stop()
    return {cond: _compare(by_name) for cond, by_name in rounds.items()}


def _compare(rounds: dict[str, list[dict[str, float]]]) -> dict[str, Any]:
    medians = {
        name: {k: statistics.median(h[k] for h in hs) for k in hs[0]} for name, hs in rounds.items()
    }
    ratio = {k: medians["maskwire"][k] / medians["versus"][k] for k in medians["maskwire"]}
    return {"rounds": rounds, "medians": medians, "maskwire_over_versus": ratio}


def _fmt(h: dict[str, float]) -> str:
    return " ".join(f"{k} {v:.1f}" for k, v in h.items())


def summarise(results: dict[str, Any], quota: float) -> dict[str, Any]:
    """Each condition's figures as a share of the quiet ones (the mean of the two quiet runs)."""
    quiet_runs = [headline(results[c]) for c in ("quiet", "quiet_again") if c in results]
    if not quiet_runs:
        return {}
    quiet = {k: statistics.mean(q[k] for q in quiet_runs) for k in quiet_runs[0]}
    out: dict[str, Any] = {"quiet": quiet}
    for cond, res in results.items():
        h = headline(res)
        share = {k: h[k] / quiet[k] for k in h if quiet[k] > 0}
        out[cond] = share
        if cond == "quota":
            out["quota_vs_scaled_quiet"] = {k: v / (quota / 2) for k, v in share.items()}
    return out


def plot(data: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    engines = [e for e in ("maskwire", "llama-server") if e in data["engines"]]
    figures = ["c1_unconstrained", "c1_constrained", "c8_unconstrained", "c8_constrained"]
    fig, axes = plt.subplots(1, len(figures), figsize=(4 * len(figures), 3.6))
    for ax, fig_name in zip(axes, figures, strict=True):
        conds = [c for c in data["conditions"] if c in data["engines"]["maskwire"]]
        width = 0.8 / len(engines)
        for i, eng in enumerate(engines):
            res = data["engines"][eng]
            vals = [headline(res[c])[fig_name] if c in res else 0 for c in conds]
            ax.bar([x + i * width for x in range(len(conds))], vals, width, label=eng)
        ax.set_xticks([x + width * (len(engines) - 1) / 2 for x in range(len(conds))])
        ax.set_xticklabels(conds, rotation=30, fontsize=8)
        ax.set_title(fig_name.replace("_", " ") + " tok/s", fontsize=9)
    axes[0].legend(fontsize=8)
    fig.suptitle(f"busy neighbours and a CPU quota ({data['cpu']})", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def cpu_model() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return platform.processor()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument(
        "--c1-requests",
        type=int,
        default=len(PROMPTS),
        help=f"c1 requests per figure, the first N prompts (default all {len(PROMPTS)})",
    )
    parser.add_argument("--conditions", default=",".join(CONDITIONS))
    parser.add_argument("--quota", type=float, default=1.5, help="CPUs of the quota condition")
    parser.add_argument("--up-args", default="", help="extra `maskwire up` arguments")
    parser.add_argument("--llama-server", type=Path, help="llama-server binary: also run it")
    parser.add_argument(
        "--versus",
        metavar="ARGS",
        help="instead of one stack per engine: the workload interleaved on two stacks, "
        "`--up-args` and these `maskwire up` arguments (e.g. --worker-arg=--no-adaptive-threads), "
        "under each of --conditions but the quota (give e.g. --conditions quiet,busy1)",
    )
    parser.add_argument(
        "--versus-body",
        metavar="JSON",
        help="like --versus, on one stack: its requests alternate without and with these body "
        "fields (e.g. '{\"speculative\": false}')",
    )
    parser.add_argument("--rounds", type=int, default=4, help="rounds per variant with --versus")
    parser.add_argument("--name", default="neighbour")
    args = parser.parse_args()
    args.conditions = [c for c in args.conditions.split(",") if c]
    unknown = set(args.conditions) - set(CONDITIONS)
    if unknown:
        parser.error(f"unknown conditions {sorted(unknown)}; known: {', '.join(CONDITIONS)}")

    data: dict[str, Any] = {
        "cpu": cpu_model(),
        "cores": os.cpu_count(),
        "loadavg_start": os.getloadavg(),
        "date": time.strftime("%Y-%m-%d"),
        "max_tokens": args.max_tokens,
        "conditions": args.conditions,
        "quota_cpus": args.quota,
        "up_args": args.up_args,
        "engines": {},
    }
    up_args = args.up_args.split()
    if args.versus is not None or args.versus_body is not None:
        versus_body = json.loads(args.versus_body or "{}")
        data.update(versus=args.versus, versus_body=versus_body, rounds=args.rounds)
        data["interleaved"] = interleaved(up_args, (args.versus or "").split(), versus_body, args)
        data["loadavg_end"] = os.getloadavg()
        RESULTS.mkdir(parents=True, exist_ok=True)
        out = RESULTS / f"{args.name}.json"
        out.write_text(json.dumps(data, indent=2) + "\n")
        ratios = {c: v["maskwire_over_versus"] for c, v in data["interleaved"].items()}
        print(json.dumps(ratios, indent=2))
        print(f"wrote {out}")
        return 0
    data["engines"]["maskwire"] = run_engine(
        "maskwire", lambda group: start_maskwire(up_args, group), args
    )
    if args.llama_server is not None:
        data["engines"]["llama-server"] = run_engine(
            "llama-server",
            lambda group: start_llama_server(args.llama_server, args.max_tokens, group),
            args,
        )
    data["shares"] = {e: summarise(r, args.quota) for e, r in data["engines"].items()}
    data["loadavg_end"] = os.getloadavg()
    RESULTS.mkdir(parents=True, exist_ok=True)
    out = RESULTS / f"{args.name}.json"
    out.write_text(json.dumps(data, indent=2) + "\n")
    plot(data, out.with_suffix(".png"))
    print(json.dumps(data["shares"], indent=2))
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
