"""The compiled worker as an AVX2-only host runs it, checked on an AVX-512 host.

The suites below run in a process held to AVX2 throughout: aten's kernels and inductor's vector
code (`ATEN_CPU_CAPABILITY`), the compiler's target for inductor's C++ (`TORCHINDUCTOR_CPP_MARCH`:
with its default `-march=native` the compiler would mix AVX-512 into the AVX2 vector code, which
computes garbage), oneDNN (`ONEDNN_MAX_CPU_ISA`: fp32 defaults, as bf16 is not native) and the
worker's AVX2 kernel set (`MASKWIRE_KERNELS`), each with caches of its own. Without this, the
graphs an AVX2 host compiles never run on the AVX-512 hosts the suite usually runs on.

Slow: the graphs compile from nothing (~1.5 minutes on 2 cores).
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from maskwire.cpus import cpu_model_and_flags
from neuron_worker import kernels

FLAGS = cpu_model_and_flags()[1]

pytestmark = [
    pytest.mark.slow,
    pytest.mark.timeout(1200),
    pytest.mark.skipif("avx512f" not in FLAGS, reason="an AVX2 host runs these suites as they are"),
    pytest.mark.skipif(
        not {"avx2", "fma"} <= FLAGS or kernels.compiler() is None,
        reason="no AVX2 or no C++ compiler",
    ),
]

ROOT = Path(__file__).resolve().parents[3]
SUITES = (
    "tests/unit/worker/test_graphs.py",
    "tests/unit/worker/test_saved_graphs.py",
    "tests/unit/model/test_fused_decode.py",
    "tests/unit/worker/test_greedy_kernel.py",
)
ISA_PROBE = """
from neuron_worker.kernels import cpu_kernel_set
from neuron_worker.tuning import native_bf16
from torch._inductor.cpu_vec_isa import pick_vec_isa
print(pick_vec_isa(), cpu_kernel_set().name, native_bf16("cpu"))
"""


def avx2_host(cache: Path) -> dict[str, str]:
    """The environment of a process that runs as on an AVX2-only CPU, with its caches in
    `cache`."""
    return {
        **os.environ,
        "ATEN_CPU_CAPABILITY": "avx2",
        "TORCHINDUCTOR_CPP_MARCH": "x86-64-v3",  # AVX2, FMA, F16C: what the AVX2 host has
        "ONEDNN_MAX_CPU_ISA": "AVX2",
        kernels.KERNELS_ENV: "avx2",
        "XDG_CACHE_HOME": str(cache),
        "TORCHINDUCTOR_CACHE_DIR": str(cache / "inductor"),
        "PYTHONPATH": str(ROOT),
    }


def test_the_compiled_graphs_of_an_avx2_host_match_eager(tmp_path: Path) -> None:
    env = avx2_host(tmp_path)
    probe = subprocess.run(
        [sys.executable, "-c", ISA_PROBE], cwd=ROOT, env=env, capture_output=True, text=True
    )
    # the process is held to AVX2: inductor's vector ISA, the worker's kernels, fp32 defaults
    assert probe.stdout.split() == ["avx2", "avx2", "False"], probe.stderr[-3000:]
    done = subprocess.run(
        [
            *(sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider"),
            *("--show-capture=no", "--tb=short", *SUITES, "-m", "not slow"),
        ],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=1100,
    )
    summary = done.stdout.strip().splitlines()[-1:] or [""]
    assert done.returncode == 0, done.stdout[-3000:]
    assert re.search(r"\b\d+ passed\b", summary[0]) and "failed" not in summary[0], summary
