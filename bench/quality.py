"""Output quality of the worker's configurations against the reference, on the embedded SmolLM2.

The reference is the configuration integration tests run (eager float32, no quantization). Each
configuration decodes the same chat prompts through the worker's own model, kernels and graphs
(`tests.support.quality`): greedy continuations (how many are identical to the reference's, the
mean common prefix) and logits teacher-forced on the reference's tokens (top-1 agreement, max and
mean absolute error). Configurations: the defaults (compiled, bf16 where native, 4-bit decode
kernels, Q8_0 head), dense bf16 weights (`--quantize none`), `--quantize int8`, and the model
loaded from a Hugging Face checkpoint directory exported from the GGUF with the defaults.

Writes bench/results/quality.json. The test (tests/integration/worker/test_default_quality.py)
runs the first 16 prompts at 48 tokens; docs/quality.md has the figures.
Usage: python bench/quality.py [--prompts 40] [--tokens 96]
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import tempfile
from dataclasses import asdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from neuron_worker.model import export_hf_checkpoint  # noqa: E402
from tests.support.quality import QUESTIONS, measure  # noqa: E402

RESULTS = ROOT / "bench" / "results"


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    p.add_argument("--prompts", type=int, default=len(QUESTIONS))
    p.add_argument("--tokens", type=int, default=96)
    p.add_argument("--out", type=Path, default=RESULTS / "quality.json")
    a = p.parse_args()
    with tempfile.TemporaryDirectory(prefix="maskwire-quality-") as tmp:
        work = Path(tmp)
        checkpoint = export_hf_checkpoint("default", work / "smollm2-hf")
        figures = measure(
            {
                "default": [],
                "dense": ["--quantize", "none"],
                "int8": ["--quantize", "int8"],
                "hf": ["--model", str(checkpoint)],
            },
            count=a.prompts,
            max_tokens=a.tokens,
            workdir=work,
        )
    result = {
        "prompts": a.prompts,
        "max_tokens": a.tokens,
        "cpu": platform.processor() or platform.machine(),
        "configurations": {name: asdict(f) for name, f in figures.items()},
    }
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(json.dumps(result, indent=1) + "\n")
    for name, f in figures.items():
        print(
            f"{name:11s} identical {f.identical}/{f.prompts}, prefix {f.mean_prefix:.1f}, "
            f"top-1 {f.top1:.4f}, max error {f.max_error:.3f}, mean error {f.mean_error:.4f} "
            f"({f.settings}; kernels {f.kernels})"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
