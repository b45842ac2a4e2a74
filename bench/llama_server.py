"""llama.cpp's `llama-server` as a benchmark peer, on the shared peers workload.

Starts `llama-server` (built by bench/build_llama_server.sh; never part of CI or the tests) on a
free loopback port with the embedded SmolLM2 GGUF, 2 threads, 8 slots, no prompt caching unless
asked (the harness runs its peers without prefix caching), and drives it with the peers harness's
own client
(`bench_maskwire.run` from `../shared/peers`): the same 8 chat prompts and JSON schemas, greedy,
64 new tokens, c1 and c8, constrained (`response_format` json_schema, which llama-server turns into
a grammar) and not, through the OpenAI-compatible API with streaming. TTFT, decode tok/s and
aggregate tok/s are therefore computed exactly as for maskwire, and every constrained answer is
validated with jsonschema.

The server inherits the environment. Its OpenMP threads spin while they wait (libgomp's default):
on a host that other work keeps busy, -t 2 then falls apart (4-5 decode tok/s against 30 with
OMP_WAIT_POLICY=passive and 35-40 with -t 1, one request, a 2-vCPU host at load 8). Measure on an
idle host, or say which policy the figures used (recorded as `omp_wait_policy`).

Usage: python bench/llama_server.py --binary PATH [--rounds 1] [--peers ../shared/peers]
Writes bench/results/<name>.json (`--name`, default llama_server).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import importlib.util
import json
import os
import signal
import socket
import statistics
import subprocess
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

from vs_vllm import FIGURES, RESULTS, ROOT, cpu_features, figures, with_latency

from maskwire.tokenizer import EMBEDDED_NAME, embedded_model_path

# Prompt (at most ~70 tokens with the chat template) + 64 new tokens, with room to spare.
CTX_PER_SLOT = 256


def load_harness(peers: Path) -> ModuleType:
    """The peers harness's maskwire client (`run(url)`), which speaks plain OpenAI over HTTP."""
    spec = importlib.util.spec_from_file_location("peers_client", peers / "bench_maskwire.py")
    if spec is None or spec.loader is None:
        raise SystemExit(f"no peers harness in {peers} (see --peers)")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    # llama-server (cpp-httplib) closes a keep-alive connection after a few requests, and the
    # harness's client (`max_retries=0`) then fails the next request it sends on it: "Server
    # disconnected without sending a response". Nothing was processed, so retrying is safe.
    vars(module)["openai"] = _RetryingOpenAI(vars(module)["openai"])
    return module


class _RetryingOpenAI:
    """The `openai` module as the harness sees it, with clients that retry a closed connection."""

    def __init__(self, openai: ModuleType) -> None:
        self._openai = openai

    def __getattr__(self, name: str) -> Any:
        return getattr(self._openai, name)

    def AsyncOpenAI(self, **kwargs: Any) -> Any:
        kwargs["max_retries"] = max(int(kwargs.get("max_retries", 0)), 3)
        return self._openai.AsyncOpenAI(**kwargs)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def server_args(threads: int, parallel: int, prefix_caching: bool = False) -> list[str]:
    no_cache = [] if prefix_caching else ["--no-cache-prompt", "--cache-ram", "0"]
    return [
        "-m",
        str(embedded_model_path()),
        "-a",
        EMBEDDED_NAME,
        "-t",
        str(threads),
        "-tb",
        str(threads),
        "-np",
        str(parallel),
        "-c",
        str(parallel * CTX_PER_SLOT),
        *no_cache,
        "--no-webui",
    ]


@contextlib.contextmanager
def llama_server(
    binary: Path, args: list[str], log: Path, timeout: float = 300.0
) -> Iterator[tuple[str, float]]:
    """Run `llama-server` on a free loopback port until /health answers 200; yield (url, ready s)."""
    port = free_port()
    cmd = [str(binary), *args, "--host", "127.0.0.1", "--port", str(port)]
    url = f"http://127.0.0.1:{port}"
    t0 = time.time()
    with log.open("ab") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=out, start_new_session=True)
    try:
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"llama-server exited with {proc.returncode}; see {log}")
            # Connection refused while it starts, 503 while it loads the model.
            with (
                contextlib.suppress(OSError),
                urllib.request.urlopen(url + "/health", timeout=2) as r,
            ):
                if r.status == 200:
                    break
            if time.time() - t0 > timeout:
                raise TimeoutError(f"llama-server was not healthy after {timeout:.0f} s")
            time.sleep(0.5)
        yield url, time.time() - t0
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()


def run_llama_server_workload(
    binary: Path,
    peers: Path,
    *,
    threads: int = 2,
    parallel: int = 8,
    log: Path = Path(os.devnull),
    prefix_caching: bool = False,
) -> dict[str, Any]:
    """One pass of the harness's protocol against a fresh llama-server: the harness's result
    (`summary` with c1/c8 blocks and validity, `rows`) plus start-up time and the command line."""
    harness = load_harness(peers)
    args = server_args(threads, parallel, prefix_caching)
    with llama_server(binary, args, log) as (url, ready_s):
        res: dict[str, Any] = with_latency(asyncio.run(harness.run(url)))
    res["engine"] = "llama-server"
    res["summary"]["ready_s"] = ready_s
    res["server_args"] = args
    res["omp_wait_policy"] = os.environ.get("OMP_WAIT_POLICY", "")
    return res


def version(binary: Path) -> str:
    out = subprocess.run([str(binary), "--version"], capture_output=True, text=True, timeout=60)
    return (out.stdout + out.stderr).strip()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--binary", type=Path, required=True, help="llama-server executable")
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--peers", type=Path, default=ROOT.parent / "shared" / "peers")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--parallel", type=int, default=8, help="llama-server slots (-np)")
    ap.add_argument("--log", type=Path, default=Path("/tmp/llama_server_bench.log"))
    ap.add_argument("--name", default="llama_server", help="result file name (without extension)")
    a = ap.parse_args()

    rounds: list[dict[str, Any]] = []
    last: dict[str, Any] = {}
    for i in range(a.rounds):
        last = run_llama_server_workload(
            a.binary, a.peers, threads=a.threads, parallel=a.parallel, log=a.log
        )
        s = last["summary"]
        rounds.append(
            {
                "figures": figures(s),
                "ready_s": s["ready_s"],
                "valid": {k: s[k] for k in ("c1_valid", "c8_valid")},
            }
        )
        print(f"round {i + 1}/{a.rounds}: {json.dumps(rounds[-1])}", flush=True)
    median = {k: statistics.median(r["figures"][k] for r in rounds) for k in FIGURES}
    out = {
        "binary": str(a.binary),
        "version": version(a.binary),
        "server_args": last["server_args"],
        "omp_wait_policy": last["omp_wait_policy"],
        "rounds": rounds,
        "median": median,
        "last_round_rows": last["rows"],
        "load_avg": os.getloadavg(),
        "cpu": cpu_features(),
    }
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / f"{a.name}.json").write_text(json.dumps(out, indent=1) + "\n")
    for k, (label, _, _) in FIGURES.items():
        print(f"{label}: {median[k]:.1f}")
    print("valid:", ", ".join(json.dumps(r["valid"]) for r in rounds))


if __name__ == "__main__":
    main()
