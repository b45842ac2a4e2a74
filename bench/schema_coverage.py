"""Schema coverage of the grammar service before and after the schema layer.

Over the schema collections (MaskBench's Handwritten, Synthesized and MCPspec subsets, all 605
schemas, read from the full copy beside the project, `../shared/testdata/maskbench`; and every
schema of the JSON-Schema-Test-Suite draft2020-12 + optional/format, which the repository
carries in `tests/fixtures/third_party`), through a real grammar service's `Compile`:

* acceptance: the share of the schemas a JSON Schema validator accepts (jsonschema's metaschema
  check for the schema's draft, default 2020-12) that compile, in `strict` mode (before: the
  schema goes to llguidance as it is) and `complete` mode (after: the schema layer), with the
  reasons for what is still refused;
* compile time p50/p99 in each mode (the service's own `compile_ms`, compile sandbox included),
  against the compile deadline (`--compile-timeout-s`, 10 s);
* what the layer did: schemas with rewritten, run-time and annotation keywords;
* MaskBench's labelled instances (one token per step through a Session, masks checked): schemas
  compiled, valid instances accepted, invalid instances accepted, in strict mode with
  `lenient` (how MaskBench runs llguidance), strict mode, and complete mode;
* what the output check costs per decode step: one request stepped token by token through a
  fixed output in this process (the service's `Session`), for a schema llguidance enforces
  alone (strict), the same schema in complete mode (validated at the end only), and one with a
  run-time keyword (uniqueItems over strings: each token that could close an item is tried).

Then real generations (the embedded SmolLM2 on a real worker, temperature 0.7, fixed seeds) for
a sample of the schemas the layer made acceptable or checks at run time: how each ends (finished,
`length`, `constraint could not be satisfied`), and whether every finished output validates
against its schema (jsonschema, format checking on): the compliance of finished outputs.

Writes bench/results/schema_coverage.json and .png.

Usage: python bench/schema_coverage.py [--generate 24] [--max-tokens 160] [--seed 0]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import platform
import random
import statistics
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any

import grpc

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from grammar_service.schema.checks import validator_class  # noqa: E402
from maskwire.rpc import RpcError  # noqa: E402
from maskwire.tokenizer import load_tokenizer  # noqa: E402
from maskwire.v1 import common_pb2, grammar_pb2, grammar_pb2_grpc, worker_pb2, worker_pb2_grpc  # noqa: E402
from tests.support.processes import running  # noqa: E402

RESULTS = ROOT / "bench" / "results"
TESTDATA = ROOT / "tests" / "fixtures" / "third_party"
# The repository carries only the 166 MaskBench schemas with instances; acceptance counts all 605.
MASKBENCH_SCHEMAS = ROOT.parent / "shared" / "testdata" / "maskbench" / "schemas"
MODES = {"strict": common_pb2.SCHEMA_MODE_STRICT, "complete": common_pb2.SCHEMA_MODE_COMPLETE}
COMPILE_DEADLINE_S = 10.0
PROMPT = (
    "<|im_start|>system\nYou answer with JSON only.<|im_end|>\n"
    "<|im_start|>user\nWrite a JSON value that matches this JSON schema:\n{schema}<|im_end|>\n"
    "<|im_start|>assistant\n"
)


def collections() -> list[tuple[str, str, Any]]:
    """(collection, id, schema) for every schema of the collections."""
    if not MASKBENCH_SCHEMAS.is_dir():
        raise SystemExit(f"the full MaskBench schema collection is missing at {MASKBENCH_SCHEMAS}")
    out: list[tuple[str, str, Any]] = []
    for path in sorted(MASKBENCH_SCHEMAS.glob("*/*.json")):
        out.append(
            (path.parent.name.removeprefix("maskbench_"), path.stem, json.loads(path.read_text()))
        )
    suite = TESTDATA / "json-schema-test-suite" / "tests" / "draft2020-12"
    for path in [
        *sorted(suite.glob("*.json")),
        *sorted((suite / "optional" / "format").glob("*.json")),
    ]:
        for group in json.loads(path.read_text()):
            out.append(("TestSuite", f"{path.stem}/{group['description']}", group["schema"]))
    return out


def well_formed(schema: Any) -> bool:
    """Whether a JSON Schema validator accepts the schema itself (its draft's metaschema)."""
    try:
        validator_class(schema).check_schema(schema)
    except Exception:
        return False
    return True


def compile_all(
    stub: grammar_pb2_grpc.GrammarServiceStub,
    fp: common_pb2.TokenizerFingerprint,
    items: list[tuple[str, str, Any]],
) -> dict[str, list[dict[str, Any]]]:
    out: dict[str, list[dict[str, Any]]] = {m: [] for m in MODES}
    for mode, value in MODES.items():
        for collection, sid, schema in items:
            constraint = common_pb2.Constraint(
                json_schema=json.dumps(schema),
                json_options=common_pb2.JsonOptions(schema_mode=value),
            )
            row: dict[str, Any] = {"collection": collection, "id": sid}
            try:
                resp = stub.Compile(
                    grammar_pb2.CompileRequest(constraint=constraint, tokenizer=fp), timeout=60
                )
                row.update(
                    ok=True,
                    cached=resp.cached,  # the same schema twice (the suite repeats some)
                    compile_ms=round(resp.compile_ms, 3),
                    layer=_layer_kinds(resp.schema_report),
                )
            except grpc.RpcError as e:
                err = RpcError.from_call_error(e)  # type: ignore[arg-type]
                row.update(ok=False, reason=err.reason or err.code.name, message=err.message[:160])
            out[mode].append(row)
    return out


def _layer_kinds(report: common_pb2.SchemaReport) -> list[str]:
    """How the layer treated some keyword of the schema: rewritten, runtime, annotation."""
    names = {
        common_pb2.ENFORCEMENT_REWRITTEN: "rewritten",
        common_pb2.ENFORCEMENT_RUNTIME: "runtime",
        common_pb2.ENFORCEMENT_ANNOTATION: "annotation",
    }
    return sorted({names[k.enforcement] for k in report.keywords})


def maskbench_instances(channel: grpc.Channel) -> dict[str, Any]:
    """Per mode: MaskBench schemas with instances compiled, and instances accepted."""
    from tests.integration.grammar_service.test_maskbench import _compile_all, _run

    tok = load_tokenizer("default")
    modes = {
        "strict+lenient": common_pb2.JsonOptions(lenient=True, schema_mode=MODES["strict"]),
        "strict": common_pb2.JsonOptions(schema_mode=MODES["strict"]),
        "complete": common_pb2.JsonOptions(schema_mode=MODES["complete"]),
    }
    out: dict[str, Any] = {}
    for name, options in modes.items():
        instances, refused = _compile_all(TESTDATA / "maskbench", channel, tok, options)
        _run(channel, tok, instances)
        valid = [i for i, _ in instances if i.valid]
        invalid = [i for i, _ in instances if not i.valid]
        out[name] = {
            "schemas_compiled": len({i.schema_id for i, _ in instances}),
            "schemas_refused": len(refused),
            "valid_accepted": sum(i.service_accepting for i in valid),
            "invalid_accepted": sum(i.service_accepting for i in invalid),
            "valid_instances": len(valid),
            "invalid_instances": len(invalid),
        }
    return out


def percentile(values: list[float], q: float) -> float:
    if not values:
        return 0.0
    s = sorted(values)
    return s[min(len(s) - 1, int(q * len(s)))]


def summarize(
    items: list[tuple[str, str, Any]], compiled: dict[str, list[dict[str, Any]]]
) -> dict[str, Any]:
    valid = [well_formed(schema) for _, _, schema in items]
    out: dict[str, Any] = {"schemas": len(items), "well_formed": sum(valid), "modes": {}}
    # The same schemas in both modes: what the layer adds to a compile llguidance already takes.
    both = [
        (a, b)
        for a, b in zip(compiled["strict"], compiled["complete"], strict=True)
        if a["ok"] and b["ok"] and not a["cached"] and not b["cached"]
    ]
    out["accepted_by_both"] = {
        "schemas": len(both),
        **{
            f"{mode}_ms_p{q}": round(percentile([p[k]["compile_ms"] for p in both], q / 100), 2)
            for k, mode in enumerate(MODES)
            for q in (50, 99)
        },
    }
    names = sorted({c for c, _, _ in items})
    for mode, rows in compiled.items():
        per: dict[str, Any] = {}
        for name in [*names, "all"]:
            picked = [
                r
                for r, v in zip(rows, valid, strict=True)
                if v and name in ("all", r["collection"])
            ]
            ok = [r for r in picked if r["ok"]]
            times = [r["compile_ms"] for r in ok if not r["cached"]]
            per[name] = {
                "schemas": len(picked),
                "accepted": len(ok),
                "acceptance": round(len(ok) / len(picked), 4) if picked else 0.0,
                "compile_ms_p50": round(percentile(times, 0.5), 2),
                "compile_ms_p99": round(percentile(times, 0.99), 2),
                "compile_ms_max": round(max(times, default=0.0), 2),
            }
        refused = Counter(
            r["message"].split(":")[1].strip()[:80] if ":" in r["message"] else r["reason"]
            for r, v in zip(rows, valid, strict=True)
            if v and not r["ok"]
        )
        layer = Counter(how for r in rows if r["ok"] for how in r["layer"])
        out["modes"][mode] = {
            "by_collection": per,
            "refused": dict(refused.most_common()),
            "schemas_with": dict(layer),
        }
    return out


async def generate_all(
    worker: str, sample: list[tuple[str, str, Any]], max_tokens: int, seed: int
) -> list[dict[str, Any]]:
    async with grpc.aio.insecure_channel(worker) as ch:
        stub = worker_pb2_grpc.WorkerStub(ch)
        gate = asyncio.Semaphore(8)  # the worker's batch

        async def one(i: int, collection: str, sid: str, schema: Any) -> dict[str, Any]:
            req = worker_pb2.GenerateRequest(
                text=PROMPT.format(schema=json.dumps(schema)[:1500]),
                sampling=worker_pb2.SamplingParams(
                    temperature=0.7, max_tokens=max_tokens, seed=seed + i
                ),
                constraint=common_pb2.Constraint(json_schema=json.dumps(schema)),
            )
            text, final = "", None
            async with gate:
                t0 = time.perf_counter()
                try:
                    async for msg in stub.Generate(req, timeout=600):
                        text += msg.text
                        final = msg
                except grpc.aio.AioRpcError as e:
                    return {
                        "collection": collection,
                        "id": sid,
                        "outcome": "refused",
                        "error": e.details(),
                    }
                seconds = time.perf_counter() - t0
            assert final is not None
            row = {
                "collection": collection,
                "id": sid,
                "text": text[:300],
                "seconds": round(seconds, 2),
            }
            reason = final.finish_reason
            if reason == worker_pb2.FINISH_REASON_STOP:
                ok = _validates(schema, text)
                row["outcome"] = "finished_valid" if ok else "finished_invalid"
            elif reason == worker_pb2.FINISH_REASON_LENGTH:
                row["outcome"] = "length"
            elif "constraint could not be satisfied" in final.error:
                row.update(outcome="unsatisfied", error=final.error[:300])
            else:
                row.update(outcome="error", error=final.error[:300])
            return row

        return list(await asyncio.gather(*(one(i, *s) for i, s in enumerate(sample))))


def _validates(schema: Any, text: str) -> bool:
    try:
        value = json.loads(text)
    except ValueError:
        return False
    cls = validator_class(schema)
    return bool(cls(schema, format_checker=cls.FORMAT_CHECKER).is_valid(value))


def pick_sample(
    items: list[tuple[str, str, Any]], compiled: dict[str, list[dict[str, Any]]], n: int, seed: int
) -> list[tuple[str, str, Any]]:
    """Schemas (not the adversarial Synthesized set) that compile only in complete mode or have
    run-time keywords: where the layer matters."""
    rng = random.Random(seed)
    pool = [
        item
        for item, strict, complete in zip(
            items, compiled["strict"], compiled["complete"], strict=True
        )
        if item[0] != "Synthesized"
        and isinstance(item[2], dict)
        and complete["ok"]
        and (not strict["ok"] or "runtime" in complete["layer"])
    ]
    rng.shuffle(pool)
    return pool[:n]


STEP_CASES = {
    "strict": ({"type": "array", "items": {"type": "string"}}, common_pb2.SCHEMA_MODE_STRICT),
    "complete, validated at the end": (
        {"type": "array", "items": {"type": "string"}},
        common_pb2.SCHEMA_MODE_COMPLETE,
    ),
    "complete, uniqueItems checked": (
        {"type": "array", "items": {"type": "string"}, "uniqueItems": True},
        common_pb2.SCHEMA_MODE_COMPLETE,
    ),
}
STEP_OUTPUT = json.dumps([f"item number {i}" for i in range(12)])


async def step_costs(repeats: int = 5) -> dict[str, Any]:
    """Median per-step wall time (µs) of one request through `Session.step`, per STEP_CASES."""
    from grammar_service.backend import LlgBackend
    from grammar_service.compile_cache import CompileCache
    from grammar_service.compile_pool import Compiler
    from grammar_service.config import Limits, ParserLimits
    from grammar_service.runtime import Runtime
    from grammar_service.session import Session

    tok = load_tokenizer("default")
    tokens = tok.ll.tokenize_str(STEP_OUTPUT)
    out: dict[str, Any] = {"output_tokens": len(tokens)}
    for name, (schema, mode) in STEP_CASES.items():
        runtime = Runtime(
            tokenizers=[tok],
            compiler=Compiler(limits=ParserLimits()),
            cache=CompileCache(4),
            backend=LlgBackend(1),
            limits=Limits(max_request_step_s=1.0),  # measured here, not enforced
        )
        times: list[float] = []
        for r in range(repeats):
            s = Session(runtime)
            opts = common_pb2.JsonOptions(schema_mode=mode)
            opened = await s.open(
                grammar_pb2.Open(
                    request_id="r",
                    constraint=common_pb2.Constraint(
                        json_schema=json.dumps(schema), json_options=opts
                    ),
                    tokenizer=tok.fingerprint.to_proto(),
                )
            )
            assert not opened.HasField("error"), opened.error
            for i in range(len(tokens) + 1):
                new = tokens[i - 1 : i] if i else []
                row = grammar_pb2.StepRow(request_id="r", new_tokens=new, position=i)
                t0 = time.perf_counter()
                res = s.step(grammar_pb2.Step(step=i, rows=[row]))
                if r:  # the first round warms caches
                    times.append(time.perf_counter() - t0)
                assert res.rows[0].status == grammar_pb2.ROW_STATUS_OK, res.rows[0]
        out[name] = {
            "step_us_p50": round(1e6 * percentile(times, 0.5), 1),
            "step_us_p90": round(1e6 * percentile(times, 0.9), 1),
        }
    return out


def plot(results: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(16, 4.8))
    summary = results["summary"]["modes"]
    names = [n for n in summary["strict"]["by_collection"] if n != "all"] + ["all"]
    x = range(len(names))
    for k, mode in enumerate(MODES):
        vals = [100 * summary[mode]["by_collection"][n]["acceptance"] for n in names]
        axes[0].bar([i + 0.38 * k for i in x], vals, 0.38, label=f"{mode}")
    axes[0].axhline(95, color="grey", linestyle="--", linewidth=0.8)
    axes[0].set_xticks([i + 0.19 for i in x], names, rotation=20)
    axes[0].set_ylabel("% of well-formed schemas that compile")
    axes[0].set_title("acceptance: strict (before) vs complete (after)")
    axes[0].legend()

    for mode in MODES:
        times = results["compile_ms"][mode]
        axes[1].plot(times, [i / len(times) for i in range(len(times))], label=mode)
    axes[1].axvline(COMPILE_DEADLINE_S * 1e3, color="grey", linestyle="--", linewidth=0.8)
    axes[1].set_xscale("log")
    axes[1].set_xlabel("compile time (ms, log; dashed: the 10 s deadline)")
    axes[1].set_ylabel("share of accepted schemas")
    axes[1].set_title("compile time CDF")
    axes[1].legend()

    outcomes = Counter(r["outcome"] for r in results["generations"])
    labels = ["finished_valid", "finished_invalid", "length", "unsatisfied", "error", "refused"]
    axes[2].bar(labels, [outcomes.get(k, 0) for k in labels], color="tab:green")
    axes[2].set_title(f"{len(results['generations'])} SmolLM2 generations (complete mode)")
    axes[2].tick_params(axis="x", rotation=25)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


async def bench(args: argparse.Namespace) -> dict[str, Any]:
    items = collections()
    tok = load_tokenizer("default")
    steps = await step_costs()
    with running("grammar-service", ["--tokenizer", "default"]) as gs:
        with grpc.insecure_channel(gs.address) as ch:
            compiled = compile_all(
                grammar_pb2_grpc.GrammarServiceStub(ch), tok.fingerprint.to_proto(), items
            )
            maskbench = maskbench_instances(ch)
        sample = pick_sample(items, compiled, args.generate, args.seed)
        generations: list[dict[str, Any]] = []
        if sample:
            with running(
                "worker", ["--model", "default", "--grammar-service", gs.address], timeout_s=600
            ) as w:
                generations = await generate_all(w.address, sample, args.max_tokens, args.seed)
    finished = [g for g in generations if g["outcome"].startswith("finished")]
    return {
        "machine": {"platform": platform.platform(), "python": platform.python_version()},
        "args": vars(args),
        "summary": summarize(items, compiled),
        "step_costs": steps,
        "maskbench_instances": maskbench,
        "generation_summary": {
            "sample": len(generations),
            "outcomes": dict(Counter(g["outcome"] for g in generations)),
            "finished": len(finished),
            "compliance": (
                round(sum(g["outcome"] == "finished_valid" for g in finished) / len(finished), 4)
                if finished
                else None
            ),
            "median_seconds": statistics.median([g.get("seconds", 0.0) for g in generations])
            if generations
            else None,
        },
        # Per mode, every compile time (cache hits left out), sorted; what complete mode refuses.
        "compile_ms": {
            mode: sorted(r["compile_ms"] for r in rows if r["ok"] and not r["cached"])
            for mode, rows in compiled.items()
        },
        "refused_complete": [
            {k: r[k] for k in ("collection", "id", "message")}
            for r in compiled["complete"]
            if not r["ok"]
        ],
        "generations": generations,
    }


def main() -> int:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--generate", type=int, default=24, help="schemas to generate an output for")
    p.add_argument("--max-tokens", type=int, default=160)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    results = asyncio.run(bench(args))
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "schema_coverage.json").write_text(json.dumps(results, indent=1) + "\n")
    plot(results, RESULTS / "schema_coverage.png")
    s = results["summary"]
    for mode in MODES:
        a = s["modes"][mode]["by_collection"]["all"]
        print(
            f"{mode}: {a['accepted']}/{a['schemas']} accepted ({100 * a['acceptance']:.1f}%), "
            f"compile p50 {a['compile_ms_p50']} ms p99 {a['compile_ms_p99']} ms"
        )
    print("step costs:", results["step_costs"])
    print("maskbench instances:", results["maskbench_instances"])
    print("generations:", results["generation_summary"])
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
