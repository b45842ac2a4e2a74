"""One grammar step for B rows: in-process llguidance vs the grammar service over a Session stream.

Tekken tokenizer (131,072 tokens, 16 KB mask rows), MaskBench JSON schemas, rows starting inside
strings and between keys. Every step advances each row by one token of a valid instance and asks
for its next mask. Measured in the same run:

* `inprocess`: the service's own llguidance calls (`LlgBackend`: batched consume, mask fill into
  a preallocated buffer with the same executor threads and small-batch shortcuts) and nothing
  else: the floor any wrapper pays.
* `dense` / `compact`: the worker's own stream client (`neuron_worker.grammar_replica.Replica`)
  in this process, the service in its own process: one Step round trip as a worker does it
  (build the Step, serialize, loopback transport, service Python, mask fill, answer, parse,
  `maskwire.bitmask.step_masks` into a reused buffer), with
  dense answers and with `Step.compact_masks` (the service's default `--compact-min-rows 16`,
  so B < 16 is answered dense there too).
* `echo`: a bare grpc.aio bidi echo of a message of the same size between the same two kinds of
  process (the transport floor).
* breakdown: `Session.step` run in this process with warm caches (llguidance calls, the service's
  Python, compact encoding, each timed), the same step's mean time inside the service process
  (from its `maskwire_grammar_step_seconds` metric; the difference is what running between
  network messages, with cold caches, adds), serialization + parsing of the request and answer,
  the client's decode, and the rest: gRPC transport and framework.

Each measurement runs in `--rounds` interleaved slices, so a slow spell of the machine hits
all of them alike.

Both ends run on uvloop when it is installed, as the services do. Writes
bench/results/grammar_step.json and .png. Usage: python bench/grammar_step.py [--iters N]
[--batches 1 64] [--service-args '--mask-threads 1']
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import platform
import random
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import grpc
import httpx
import llguidance
import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import grammar_service.step as step_module  # noqa: E402
from grammar_service.backend import LlgBackend, LlgRequest  # noqa: E402
from grammar_service.compile_cache import CompileCache  # noqa: E402
from grammar_service.compile_pool import Compiler  # noqa: E402
from grammar_service.config import Limits, ParserLimits  # noqa: E402
from grammar_service.runtime import Runtime  # noqa: E402
from grammar_service.session import Session  # noqa: E402
from maskwire import event_loop  # noqa: E402
from maskwire.bitmask import encode_rows, step_masks  # noqa: E402
from maskwire.rpc import channel_options  # noqa: E402
from maskwire.tokenizer import Tokenizer, load_tokenizer, tekken_path  # noqa: E402
from maskwire.v1 import common_pb2, grammar_pb2  # noqa: E402
from neuron_worker.grammar_replica import Replica  # noqa: E402
from tests.support.processes import ServiceProcess, free_port  # noqa: E402

TESTDATA = ROOT / "tests" / "fixtures" / "third_party" / "maskbench"
BATCHES = (1, 8, 32, 64)
COMPACT = {
    "whitespace_flexible": False,
    "item_separator": ", ",
    "key_separator": ": ",
    "lenient": True,
}
ECHO_METHOD = "/bench.Echo/Echo"
MODES = ("dense", "compact")


# -- workload ----------------------------------------------------------------------------------


def workload(tok: Tokenizer, n_rows: int, min_left: int, seed: int = 0) -> list[dict[str, Any]]:
    """Rows: (schema, instance tokens, start offset), half inside strings, half between keys."""
    rng = random.Random(seed)
    candidates = []
    for path in sorted((TESTDATA / "instances").glob("*.jsonl.gz")):
        with gzip.open(path, "rt") as f:
            for line in f:
                entry = json.loads(line)
                schema = (TESTDATA / entry["schema_file"]).read_text()
                g = llguidance.LLMatcher.grammar_from_json_schema(schema, defaults=COMPACT)  # type: ignore[arg-type]
                if llguidance.LLMatcher.validate_grammar(g, tok.ll):
                    continue
                for t in entry["tests"]:
                    if not t["valid"]:
                        continue
                    text = json.dumps(t["data"], ensure_ascii=False)
                    toks = list(tok.ll.tokenize_str(text))
                    m = llguidance.LLMatcher(tok.ll, g, log_level=0)
                    if len(toks) < min_left + 8 or not m.consume_tokens(toks):
                        continue
                    candidates.append((schema, g, text, toks))
    rows: list[dict[str, Any]] = []
    rng.shuffle(candidates)
    i = 0
    while len(rows) < n_rows:
        schema, g, text, toks = candidates[i % len(candidates)]
        i += 1
        kinds = {"string": [], "between_keys": []}
        for s in range(1, len(toks) - min_left):
            prefix = tok.ll.decode_bytes(toks[:s]).decode(errors="replace")
            if prefix.endswith((", ", "{")) and prefix.rstrip().endswith((",", "{")):
                kinds["between_keys"].append(s)
            elif _inside_string(prefix):
                kinds["string"].append(s)
        want = "string" if len(rows) % 2 == 0 else "between_keys"
        choices = kinds[want] or kinds["string"] or kinds["between_keys"]
        if not choices:
            continue
        rows.append(
            {
                "schema": schema,
                "grammar": g,
                "tokens": toks,
                "start": rng.choice(choices),
                "kind": want,
            }
        )
    return rows


def _inside_string(prefix: str) -> bool:
    inside = False
    esc = False
    for ch in prefix:
        if esc:
            esc = False
        elif ch == "\\":
            esc = True
        elif ch == '"':
            inside = not inside
    return inside


# -- in-process baseline -------------------------------------------------------------------------


def bench_inprocess(
    tok: Tokenizer, rows: list[dict[str, Any]], iters: int, warmup: int
) -> dict[str, Any]:
    """The service's own llguidance calls (`LlgBackend`: same executor, same small-batch
    shortcuts), with no protocol and no gRPC around them."""
    w = tok.words_per_row
    backend = LlgBackend()
    buf = np.zeros((len(rows), w), dtype=np.int32)
    templates = {
        g: llguidance.LLMatcher(tok.ll, g, log_level=0) for g in {r["grammar"] for r in rows}
    }

    def fresh(r: dict[str, Any]) -> LlgRequest:
        # What the service's Open with replay_tokens does: copy the compiled template, replay.
        g = LlgRequest(templates[r["grammar"]].deep_copy())
        assert g.consume(r["tokens"][: r["start"]])
        return g

    grammars = [fresh(r) for r in rows]
    pos = [r["start"] for r in rows]
    times, fill_times = [], []
    for it in range(warmup + iters):
        for k, r in enumerate(rows):  # wrap (untimed): back to the start state
            if pos[k] >= len(r["tokens"]):
                grammars[k] = fresh(r)
                pos[k] = r["start"]
        t0 = time.perf_counter()
        oks = backend.consume_each([(g, rows[k]["tokens"][pos[k]]) for k, g in enumerate(grammars)])
        t1 = time.perf_counter()
        backend.fill(
            [(g, k) for k, g in enumerate(grammars)], [], buf.ctypes.data, w * 4, len(rows)
        )
        t2 = time.perf_counter()
        assert all(oks)
        for k in range(len(rows)):
            pos[k] += 1
        if it >= warmup:
            times.append(t2 - t0)
            fill_times.append(t2 - t1)
    return {"step": times, "fill": fill_times, "mask_threads": backend.threads}


# -- Session.step without gRPC -------------------------------------------------------------------


class TimedBackend(LlgBackend):
    """`LlgBackend` that adds up the time its llguidance calls take."""

    spent = 0.0

    def consume_each(self, pairs: Any) -> list[bool]:
        t = time.perf_counter()
        try:
            return super().consume_each(pairs)
        finally:
            self.spent += time.perf_counter() - t

    def fill(self, *args: Any) -> None:
        t = time.perf_counter()
        try:
            super().fill(*args)
        finally:
            self.spent += time.perf_counter() - t


class TimedEncode:
    """Stands in for `step.encode_rows` and adds up its time."""

    spent = 0.0

    def __call__(self, rows: np.ndarray, vocab: int) -> Any:
        t = time.perf_counter()
        try:
            return encode_rows(rows, vocab)
        finally:
            self.spent += time.perf_counter() - t


async def bench_session_pure(
    tok: Tokenizer, rows: list[dict[str, Any]], iters: int, warmup: int, compact: bool = False
) -> dict[str, Any]:
    backend = TimedBackend()
    encode = TimedEncode()
    step_module.encode_rows = encode  # type: ignore[assignment]
    rt = Runtime(
        tokenizers=[tok],
        compiler=Compiler(limits=ParserLimits()),
        cache=CompileCache(64),
        backend=backend,
        limits=Limits(),
    )
    s = Session(rt)
    fp = tok.fingerprint.to_proto()
    for k, r in enumerate(rows):
        opened = await s.open(open_msg(k, r, fp))
        assert not opened.HasField("error"), opened.error
    pos = [r["start"] for r in rows]
    times, ser, parse, dec, llg, enc = [], [], [], [], [], []
    decoded = np.empty((len(rows), tok.words_per_row), dtype=np.int32)
    for it in range(warmup + iters):
        for k, r in enumerate(rows):
            if pos[k] >= len(r["tokens"]):
                s.close(grammar_pb2.Close(request_id=f"r{k}"))
                await s.open(open_msg(k, r, fp))
                pos[k] = r["start"]
        msg = step_msg(it, rows, pos, compact)
        backend.spent = encode.spent = 0.0
        t0 = time.perf_counter()
        res = s.step(msg)
        t1 = time.perf_counter()
        wire_req = grammar_pb2.SessionRequest(step=msg).SerializeToString()
        out = grammar_pb2.SessionResponse(step_result=res)
        t2 = time.perf_counter()
        wire = out.SerializeToString()
        t3 = time.perf_counter()
        parsed = grammar_pb2.SessionResponse.FromString(wire)
        grammar_pb2.SessionRequest.FromString(wire_req)
        t4 = time.perf_counter()
        step_masks(parsed.step_result, out=decoded)
        t5 = time.perf_counter()
        assert all(r.status == grammar_pb2.ROW_STATUS_OK for r in res.rows)
        for k in range(len(rows)):
            pos[k] += 1
        if it >= warmup:
            times.append(t1 - t0)
            llg.append(backend.spent)
            enc.append(encode.spent)
            ser.append(t3 - t2)
            parse.append(t4 - t3)
            dec.append(t5 - t4)
    step_module.encode_rows = encode_rows
    python = [t - a - b for t, a, b in zip(times, llg, enc, strict=True)]
    return {
        "session_step": times,
        "llguidance": llg,
        "compact_encode": enc,
        "service_python": python,
        "client_decode": dec,
        "serialize_answer": ser,
        "parse_both": parse,
        "answer_bytes": len(wire),
        "request_bytes": len(wire_req),
    }


def open_msg(k: int, r: dict[str, Any], fp: common_pb2.TokenizerFingerprint) -> grammar_pb2.Open:
    return grammar_pb2.Open(
        request_id=f"r{k}",
        constraint=common_pb2.Constraint(
            json_schema=r["schema"], json_options=common_pb2.JsonOptions(lenient=True)
        ),
        tokenizer=fp,
        replay_tokens=r["tokens"][: r["start"]],
    )


def step_msg(
    it: int, rows: list[dict[str, Any]], pos: list[int], compact: bool = False
) -> grammar_pb2.Step:
    return grammar_pb2.Step(
        step=it + 1,
        compact_masks=compact,
        rows=[
            grammar_pb2.StepRow(
                request_id=f"r{k}", new_tokens=[r["tokens"][pos[k]]], position=pos[k] + 1
            )
            for k, r in enumerate(rows)
        ],
    )


# -- over gRPC -----------------------------------------------------------------------------------


async def bench_service(
    address: str,
    tok: Tokenizer,
    rows: list[dict[str, Any]],
    iters: int,
    warmup: int,
    compact: bool = False,
) -> dict[str, Any]:
    """The worker's path: build the Step, one round trip through the worker's own stream client
    (`neuron_worker.grammar_replica.Replica`: a reader task always waiting for the next answer),
    mask rows into a reused buffer."""
    fp = tok.fingerprint.to_proto()
    replica = Replica(address)
    try:

        async def send(m: grammar_pb2.SessionRequest) -> grammar_pb2.SessionResponse:
            return await (await replica.send(m))

        for k, r in enumerate(rows):
            resp = await send(grammar_pb2.SessionRequest(open=open_msg(k, r, fp)))
            assert not resp.opened.HasField("error"), resp.opened.error
        pos = [r["start"] for r in rows]
        times = []
        answer_bytes = 0
        decoded = np.empty((len(rows), tok.words_per_row), dtype=np.int32)
        for it in range(warmup + iters):
            for k, r in enumerate(rows):
                if pos[k] >= len(r["tokens"]):
                    await send(
                        grammar_pb2.SessionRequest(close=grammar_pb2.Close(request_id=f"r{k}"))
                    )
                    await send(grammar_pb2.SessionRequest(open=open_msg(k, r, fp)))
                    pos[k] = r["start"]
            t0 = time.perf_counter()
            msg = grammar_pb2.SessionRequest(step=step_msg(it, rows, pos, compact))
            res = (await send(msg)).step_result
            got = step_masks(res, out=decoded)
            t1 = time.perf_counter()
            assert got.shape == (len(rows), tok.words_per_row)
            answer_bytes = max(answer_bytes, res.ByteSize())
            for k in range(len(rows)):
                pos[k] += 1
            if it >= warmup:
                times.append(t1 - t0)
    finally:
        await replica.aclose()
    return {"step": times, "max_answer_bytes": answer_bytes}


async def bench_echo(address: str, size: int, iters: int, warmup: int) -> dict[str, Any]:
    payload = os.urandom(size)
    async with grpc.aio.insecure_channel(address, options=channel_options()) as ch:
        call = ch.stream_stream(ECHO_METHOD)()
        times = []
        for it in range(warmup + iters):
            t0 = time.perf_counter()
            await call.write(payload)
            got = await call.read()
            t1 = time.perf_counter()
            assert len(got) == size
            if it >= warmup:
                times.append(t1 - t0)
        await call.done_writing()
    return {"step": times, "bytes": size}


async def echo_server(port: int) -> None:
    async def echo(it: Any, context: Any) -> Any:
        async for m in it:
            yield m

    server = grpc.aio.server(options=channel_options())
    handler = grpc.method_handlers_generic_handler(
        "bench.Echo", {"Echo": grpc.stream_stream_rpc_method_handler(echo)}
    )
    server.add_generic_rpc_handlers((handler,))
    server.add_insecure_port(f"127.0.0.1:{port}")
    await server.start()
    print("ready", flush=True)
    await server.wait_for_termination()


# -- reporting -----------------------------------------------------------------------------------


async def step_seconds(url: str) -> tuple[float, float]:
    """The service's own `maskwire_grammar_step_seconds` (sum, count), from its /metrics."""
    async with httpx.AsyncClient() as client:
        text = (await client.get(url)).text
    values = {}
    for line in text.splitlines():
        if line.startswith(
            ("maskwire_grammar_step_seconds_sum", "maskwire_grammar_step_seconds_count")
        ):
            name, value = line.split()
            values[name.rsplit("_", 1)[1]] = float(value)
    return values["sum"], values["count"]


def summarize(parts: list[dict[str, Any]]) -> dict[str, Any]:
    """Concatenate the rounds' samples and turn each list into stats; other values: the max."""
    out: dict[str, Any] = {}
    for key, value in parts[0].items():
        if isinstance(value, list):
            out[key] = stats([x for p in parts for x in p[key]])
        else:
            out[key] = max(p[key] for p in parts)
    return out


def stats(xs: list[float]) -> dict[str, float]:
    a = np.array(xs) * 1e6
    return {
        "p50_us": float(np.percentile(a, 50)),
        "p99_us": float(np.percentile(a, 99)),
        "mean_us": float(a.mean()),
        "n": len(xs),
    }


def plot(results: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    batches = results["batches"]
    bs = [r["B"] for r in batches]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(13, 4.8))
    x = np.arange(len(bs))
    series = [
        ("in-process llguidance", lambda r: r["inprocess"]["step"]),
        ("service, dense rows", lambda r: r["dense"]["service"]["step"]),
        ("service, compact rows", lambda r: r["compact"]["service"]["step"]),
        ("bare gRPC echo of the dense answer", lambda r: r["dense"]["echo"]["step"]),
    ]
    wd = 0.2
    for j, (label, get) in enumerate(series):
        off = (j - 1.5) * wd
        ax1.bar(x + off, [get(r)["p50_us"] for r in batches], wd, label=label)
        ax1.scatter(x + off, [get(r)["p99_us"] for r in batches], marker="_", color="k", s=90)
    ax1.set_xticks(x, [f"B={b}" for b in bs])
    ax1.set_yscale("log")
    ax1.set_ylabel("µs per step (bar p50, tick p99; log)")
    ax1.set_title("One grammar step, Tekken 131k vocab")
    ax1.legend(fontsize=8)
    parts = [
        "llguidance",
        "service_python",
        "compact_encode",
        "in_service_slowdown",
        "serialization",
        "client_decode",
        "transport",
    ]
    colors = ["C0", "C1", "C5", "C6", "C2", "C4", "C3"]
    for k, mode in enumerate(MODES):
        bottom = np.zeros(len(bs))
        for part, color in zip(parts, colors, strict=True):
            vals = np.array([r[mode]["breakdown_p50_us"][part] for r in batches])
            ax2.bar(
                x + (k - 0.5) * 0.38,
                vals,
                0.36,
                bottom=bottom,
                color=color,
                label=part if k == 0 else None,
                hatch="//" if mode == "compact" else None,
            )
            bottom += vals
    ax2.set_xticks(x, [f"B={b}\ndense | compact" for b in bs])
    ax2.set_ylabel("µs (p50)")
    ax2.set_title("Where the service's step time goes (hatched: compact)")
    ax2.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


async def run(args: argparse.Namespace) -> dict[str, Any]:
    tok = load_tokenizer(str(tekken_path()))
    metrics_port = free_port()
    svc_metrics = f"http://127.0.0.1:{metrics_port}/metrics"
    svc = ServiceProcess(
        "grammar-service",
        [
            "--tokenizer",
            str(tekken_path()),
            "--metrics-port",
            str(metrics_port),
            *args.service_args.split(),
        ],
        free_port(),
    )
    echo_port = free_port()
    echo_address = f"127.0.0.1:{echo_port}"
    echo = subprocess.Popen(
        [sys.executable, __file__, "--echo-server", str(echo_port)],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert echo.stdout is not None and echo.stdout.readline().strip() == "ready"
        svc.wait_ready()
        all_rows = workload(tok, max(args.batches), min_left=8)
        out: dict[str, Any] = {
            "tokenizer": "tekken_240911 (V=131072)",
            "iters": args.iters,
            "rounds": args.rounds,
            "machine": f"{platform.machine()} {os.cpu_count()} cpus, python {platform.python_version()}",
            "llguidance": llguidance.get_version() if hasattr(llguidance, "get_version") else "",
            "batches": [],
        }
        for b in args.batches:
            rows = all_rows[:b]
            # Every measurement runs in `rounds` interleaved slices, so that a slow spell of this
            # shared machine lands on all of them alike instead of on one.
            parts: dict[str, list[dict[str, Any]]] = {}
            n = max(1, args.iters // args.rounds)
            for _ in range(args.rounds):
                parts.setdefault("inprocess", []).append(bench_inprocess(tok, rows, n, args.warmup))
                for mode in MODES:
                    compact = mode == "compact"
                    pure = await bench_session_pure(tok, rows, n, args.warmup, compact)
                    parts.setdefault(f"{mode}/pure", []).append(pure)
                    before = await step_seconds(svc_metrics)
                    parts.setdefault(f"{mode}/service", []).append(
                        await bench_service(svc.address, tok, rows, n, args.warmup, compact)
                    )
                    after = await step_seconds(svc_metrics)
                    parts.setdefault(f"{mode}/in_service", []).append(
                        {"step_mean": [(after[0] - before[0]) / max(1, after[1] - before[1])]}
                    )
                    parts.setdefault(f"{mode}/echo", []).append(
                        await bench_echo(echo_address, pure["answer_bytes"], n, args.warmup)
                    )
            merged = {k: summarize(v) for k, v in parts.items()}
            inproc = merged["inprocess"]
            rec: dict[str, Any] = {"B": b, "inprocess": inproc}
            line = (
                f"B={b:3d} inproc {inproc['step']['p50_us']:6.0f}/{inproc['step']['p99_us']:6.0f}"
            )
            for mode in MODES:
                pure = merged[f"{mode}/pure"]
                service = merged[f"{mode}/service"]
                echo_res = merged[f"{mode}/echo"]
                in_service = merged[f"{mode}/in_service"]["step_mean"]["mean_us"]
                llg = pure["llguidance"]["p50_us"]
                enc = pure["compact_encode"]["p50_us"]
                py = pure["service_python"]["p50_us"]
                cold = max(0.0, in_service - pure["session_step"]["mean_us"])
                ser = pure["serialize_answer"]["p50_us"] + pure["parse_both"]["p50_us"]
                decode = pure["client_decode"]["p50_us"]
                transport = max(
                    0.0, service["step"]["p50_us"] - llg - py - enc - cold - ser - decode
                )
                rec[mode] = {
                    "session_pure": pure,
                    "service": service,
                    "echo": echo_res,
                    "in_service_step_mean_us": in_service,
                    "overhead_p50_us": service["step"]["p50_us"] - inproc["step"]["p50_us"],
                    "ratio_p50": service["step"]["p50_us"] / inproc["step"]["p50_us"],
                    "breakdown_p50_us": {
                        "llguidance": llg,
                        "service_python": py,
                        "compact_encode": enc,
                        "in_service_slowdown": cold,
                        "serialization": ser,
                        "client_decode": decode,
                        "transport": transport,
                    },
                }
                line += (
                    f" | {mode} {service['step']['p50_us']:6.0f}/{service['step']['p99_us']:6.0f}"
                    f" x{rec[mode]['ratio_p50']:.2f} {pure['answer_bytes']}B"
                    f" echo {echo_res['step']['p50_us']:5.0f}"
                    f" [llg {llg:.0f} py {py:.0f} enc {enc:.0f} cold {cold:.0f} ser {ser:.0f}"
                    f" dec {decode:.0f} tr {transport:.0f}]"
                )
            out["batches"].append(rec)
            print(line, flush=True)
        return out
    finally:
        echo.terminate()
        echo.wait()
        svc.stop()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--iters", type=int, default=300)
    p.add_argument("--warmup", type=int, default=30)
    p.add_argument("--rounds", type=int, default=5, help="interleaved slices of each measurement")
    p.add_argument("--batches", type=int, nargs="+", default=list(BATCHES), help="rows per step")
    p.add_argument(
        "--service-args", default="", help="extra grammar-service flags, e.g. '--mask-threads 1'"
    )
    p.add_argument("--echo-server", type=int, default=0, help=argparse.SUPPRESS)
    p.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "grammar_step.json")
    args = p.parse_args()
    if args.echo_server:
        event_loop.run(echo_server(args.echo_server))
        return
    results = event_loop.run(run(args))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(results, indent=2))
    plot(results, args.out.with_suffix(".png"))
    print(f"wrote {args.out} and {args.out.with_suffix('.png')}")


if __name__ == "__main__":
    main()
