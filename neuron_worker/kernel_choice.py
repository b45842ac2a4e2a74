"""Which kernel each kind of projection runs in decode passes, chosen by timing them on this host.

A pass over generated tokens (decode, jump-forward, draft verification: the decode role,
`Transformer.step_logits`) can run a projection through the worker's own 4-bit kernel (the
checkpoint's Q4_1 weights as stored; aten's int4 where the own kernels are absent), its own 8-bit
kernel (Q8_0), or the dense weight prepacked by oneDNN (bf16 only, where the CPU computes it
natively: AVX512-BF16, or AMX tiles where the CPU has them). Which is fastest depends on the CPU
(caches, cores, matrix engine), the weight's shape and the tokens per pass, so `choose` times the
candidates at start for every kind (`PROJECTION_KINDS`: fused q/k/v, attention output, fused
gate/up, down, LM head) at every width the worker's decode passes take (`decode_rows`), with
random weights of the kind's shape and dtype.

It keeps ONE path per kind for the whole decode role, never one per width: a token's logits must
not depend on how many rows share its pass (batch invariance, `neuron_worker.model.linear`), on
which speculation's identical outputs rely. A path that served only some widths would make a
token's logits depend on its company. For the same reason a candidate whose own rows change with
the width (a library kernel that blocks or splits its sums by the number of rows, as a matrix
engine's may) is not eligible: the timing also runs each candidate on prefixes of one input at
every width and compares the rows bit for bit (`Timings.width_dependent`, logged with the table).

The score (`scores`): a candidate's time relative to the fastest candidate's at each width,
combined by the geometric mean over the widths (1.0: fastest at every width; every width counts
alike). The default (`Kind.default`: int4 for the layers, the checkpoint's own weights; for the
head its stored scheme) stays unless another candidate scores lower by more than `MARGIN`, so
that noise does not flip a choice (`pick`).

A time is the fastest of `SAMPLES` single calls (after `WARMUP` untimed ones; the candidates
take turns call by call), each on the next of enough copies of the weight to fill
`FOOTPRINT_CACHES` times the last-level cache, so that the weights stream from memory as they do
in a pass through the whole model, not from a cache they would not stay in beside the other
layers. Few calls per cell: on a small model the table takes a few seconds (docs/benchmarks.md).

The table is cached as JSON beside the kernels in the compile cache (`<root>/kernels/choice-
<key>.json`), keyed by what the timings depend on (`cache_key`: the CPU's model name and flags,
torch's version, the kernel sources, dtype, threads, each kind's shape and candidates, the
widths): a restart with the same key reads it instead of timing, any change times again.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import logging
import math
import os
import statistics
import tempfile
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from torch import Tensor

from maskwire.cpus import cpu_model_and_flags
from neuron_worker import kernels
from neuron_worker.compile_cache import kernel_directory
from neuron_worker.engine_config import EngineConfig
from neuron_worker.model.linear import DecodeForm, can_pack, kernel_for

if TYPE_CHECKING:
    from neuron_worker.model.linear import ExactWeight
    from neuron_worker.model.llama import Transformer

log = logging.getLogger(__name__)

MARGIN = 0.10  # another candidate replaces the default only when it scores this much lower
WARMUP = 1  # untimed calls per candidate and width
SAMPLES = 10  # timed calls per candidate and width (the fastest counts)
FOOTPRINT_CACHES = 2  # a candidate's copies fill this many times the last-level cache
FALLBACK_CACHE = 32 << 20  # the last-level cache's size where /sys does not say it
MAX_FOOTPRINT = 512 << 20  # the most memory a kind's copies take (all candidates, beyond one each)
MAX_COPIES = 1024  # copies of a tiny weight (never a real model's) stop here
CACHE_FORMAT = 2  # bump when the file's layout or the measuring method changes
DENSE = "none"  # the dense form's scheme (as `ServingLinear` names it)

# kind -> candidate scheme -> tokens per pass -> ms per call
Table = dict[str, dict[str, dict[int, float]]]


@dataclass(frozen=True)
class Timings:
    """What the timing found: ms per call, and per kind the candidates whose rows are not
    bit-identical at every width (never chosen)."""

    ms: Table
    width_dependent: dict[str, tuple[str, ...]]

    def eligible(self, kind: Kind) -> tuple[str, ...]:
        """`kind`'s candidates that compute a row the same way at every width."""
        dependent = self.width_dependent.get(kind.name, ())
        return tuple(c for c in kind.candidates if c not in dependent)


@dataclass(frozen=True)
class Kind:
    """One kind of projection: its weight shape [out, in] and the schemes it may run in decode
    passes (the default first), each with the kernel that runs it (`linear.kernel_for`)."""

    name: str
    shape: tuple[int, int]
    candidates: tuple[str, ...]
    kernels: tuple[str, ...]

    @property
    def default(self) -> str:
        return self.candidates[0]


@dataclass(frozen=True)
class Choice:
    """The scheme per kind, and what it was chosen from."""

    schemes: dict[str, str]
    kinds: tuple[Kind, ...]
    rows: tuple[int, ...]
    timings: Timings
    origin: str  # how the table was had: timed (and where cached), or read from the cache

    def describe(self) -> list[str]:
        """The table as log lines: ms per call per candidate at each width, scores, choice."""
        widths = " ".join(str(r) for r in self.rows)
        lines = [f"decode kernels {self.origin}; ms per call at {widths} tokens per pass:"]
        for kind in self.kinds:
            shape = f"{kind.name} [{kind.shape[0]}x{kind.shape[1]}]"
            chosen = self.schemes[kind.name]
            if kind.name not in self.timings.ms:
                lines.append(f"  {shape}: {name(chosen)} (the only candidate)")
                continue
            times = self.timings.ms[kind.name]
            score = scores(times)
            eligible = self.timings.eligible(kind)
            parts = [
                f"{name(c)} ({k}) {' '.join(f'{times[c][r]:.3f}' for r in self.rows)}"
                f" score {score[c]:.2f}{'' if c in eligible else ' rows vary with the width'}"
                for c, k in zip(kind.candidates, kind.kernels, strict=True)
            ]
            lines.append(f"  {shape}: {'; '.join(parts)} -> {name(chosen)}")
        return lines


def name(scheme: str) -> str:
    """A scheme as the table shows it ("dense" for the dense form)."""
    return "dense" if scheme == DENSE else scheme


def scores(times: Mapping[str, Mapping[int, float]]) -> dict[str, float]:
    """Per candidate, the geometric mean over the widths of its time relative to the fastest
    candidate's at that width (1.0: fastest at every width)."""
    widths = sorted(set.intersection(*(set(t) for t in times.values())))
    if not widths:
        raise ValueError("no width was timed for every candidate")
    best = {r: min(t[r] for t in times.values()) for r in widths}
    return {
        c: math.exp(statistics.fmean(math.log(t[r] / best[r]) for r in widths))
        for c, t in times.items()
    }


def pick(
    kind: Kind,
    times: Mapping[str, Mapping[int, float]],
    margin: float = MARGIN,
    *,
    eligible: Sequence[str] | None = None,
) -> str:
    """The scheme `kind` runs, among the `eligible` candidates (default: all): the
    best-scoring one where it scores lower than the default's by more than `margin` (0.1: 10%),
    else the default; the best-scoring one where the default is not eligible. Where none is,
    the default, with a warning (a row's logits then depend on the rows that share its pass)."""
    allowed = list(kind.candidates if eligible is None else eligible)
    if not allowed:
        log.warning("no decode kernel for %s computes a row alike at every width", kind.name)
        return kind.default
    if len(kind.candidates) == 1:
        return kind.default
    score = scores({c: times[c] for c in kind.candidates})
    best = min(allowed, key=score.__getitem__)
    if kind.default not in allowed:
        return best
    return best if score[best] * (1 + margin) < score[kind.default] else kind.default


def decode_rows(engine: EngineConfig) -> tuple[int, ...]:
    """The widths (tokens per pass) the decode role's passes take: 1 .. the max batch (beyond 8,
    its powers of two and the max itself), and with speculation one request's widest
    verification pass (its pending, draft and forced tokens) and the widest pass the
    verification limit lets through (all rows' drafts where there is no limit)."""
    b = engine.max_batch
    rows = {r for r in range(1, b + 1) if r <= 8 or r & (r - 1) == 0} | {b}
    if engine.speculative is not None:
        width = engine.verify_width
        rows |= {width, engine.speculative.pass_tokens or b * width}
    return tuple(sorted(rows))


def kinds_of(model: Transformer, sources: Mapping[str, ExactWeight]) -> tuple[Kind, ...]:
    """The model's projection kinds and their candidates, on today's rules of what is eligible:
    the layers int4 (the default), int8 where the worker's own kernels run it, dense where bf16
    is native and prepacked; the head its checkpoint's quantized scheme (the default) where
    `Transformer.head_scheme` allows one, and dense where bf16 is native and prepacked."""
    head = model.head_scheme(sources)
    kinds = []
    for kind, weight in model.projection_weights().items():
        dense = weight.dtype == torch.bfloat16 and can_pack(weight)
        if kind == "head":
            candidates = [head] if head is not None else []
        else:
            # Not int4a8: it rounds the activations, which the choice never trades for speed.
            candidates = ["int4"]
            if kernel_for(weight, "int8").startswith("own"):
                candidates.append("int8")
        if dense or not candidates:
            candidates.append(DENSE)
        paths = tuple(
            ("onednn" if dense else "aten") if c == DENSE else kernel_for(weight, c)
            for c in candidates
        )
        shape = (int(weight.shape[0]), int(weight.shape[1]))
        kinds.append(Kind(kind, shape, tuple(candidates), paths))
    return tuple(kinds)


Measure = Callable[[Sequence[Kind], Sequence[int], torch.dtype], Timings]


def choose(
    model: Transformer,
    sources: Mapping[str, ExactWeight],
    rows: Sequence[int],
    *,
    directory: Path | None = None,
    measure: Measure | None = None,
) -> Choice:
    """The decode scheme per kind for `model` (`Transformer.use_serving_linears` takes
    `Choice.schemes`), timed at the widths `rows` or read from the cache in `directory`
    (default: the compile cache's kernel directory); the table is logged."""
    dtype = model.tok_embeddings.weight.dtype
    kinds = kinds_of(model, sources)
    widths = tuple(sorted(set(rows)))
    timed = [k for k in kinds if len(k.candidates) > 1]
    key = cache_key(kinds, widths, dtype, torch.get_num_threads())
    path = (directory or kernel_directory()) / f"choice-{key}.json"
    timings = _read(path, timed, widths)
    if timings is not None:
        origin = f"read from {path}"
    elif not timed:
        timings, origin = Timings({}, {}), "not timed (one candidate per kind)"
    else:
        began = time.perf_counter()
        timings = (measure or measure_table)(timed, widths, dtype)
        origin = f"timed in {time.perf_counter() - began:.1f} s"
        origin += f", cached in {path}" if _write(path, timings) else " (not cached)"
    schemes = {
        k.name: pick(k, timings.ms[k.name], eligible=timings.eligible(k))
        if k in timed
        else k.default
        for k in kinds
    }
    choice = Choice(schemes, kinds, widths, timings, origin)
    for line in choice.describe():
        log.info("%s", line)
    return choice


def cache_key(kinds: Sequence[Kind], rows: Sequence[int], dtype: torch.dtype, threads: int) -> str:
    """A digest of what the timings depend on."""
    kernel_set = kernels.cpu_kernel_set()
    parts = {
        "format": CACHE_FORMAT,
        "cpu": cpu_identity(),
        "torch": torch.__version__,
        "kernels": kernels.sources_digest(),
        "kernel_set": kernel_set.name if kernel_set is not None else None,
        "dtype": str(dtype),
        "threads": threads,
        "kinds": [[k.name, list(k.shape), list(k.candidates), list(k.kernels)] for k in kinds],
        "rows": list(rows),
        "method": [WARMUP, SAMPLES, FOOTPRINT_CACHES],
    }
    return hashlib.sha256(json.dumps(parts, sort_keys=True).encode()).hexdigest()[:16]


def cpu_identity() -> str:
    """The CPU's model name and instruction-set flags (/proc/cpuinfo's first processor)."""
    model, flags = cpu_model_and_flags()
    return f"{model} | {' '.join(sorted(flags))}"


def last_level_cache() -> int:
    """The size of the CPU's last-level cache in bytes (from /sys), or `FALLBACK_CACHE`."""
    sizes = []
    for entry in Path("/sys/devices/system/cpu/cpu0/cache").glob("index*"):
        try:
            text = (entry / "size").read_text().strip()
        except OSError:
            continue
        units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
        if text[:-1].isdigit() and text[-1] in units:
            sizes.append(int(text[:-1]) * units[text[-1]])
    return max(sizes, default=FALLBACK_CACHE)


def measure_table(kinds: Sequence[Kind], rows: Sequence[int], dtype: torch.dtype) -> Timings:
    """Time every candidate of every kind at every width, with random weights (module
    docstring), and check that each computes a row the same at every width; a kind's copies
    are freed before the next kind's are built."""
    g = torch.Generator().manual_seed(0)
    footprint = FOOTPRINT_CACHES * last_level_cache()
    table: Table = {}
    width_dependent: dict[str, tuple[str, ...]] = {}
    with torch.inference_mode():
        for kind in kinds:
            out_features, in_features = kind.shape
            weight = torch.randn(out_features, in_features, generator=g, dtype=dtype) * 0.02
            room = MAX_FOOTPRINT // len(kind.candidates)
            rotations = {}
            for scheme in kind.candidates:
                form = DecodeForm.of(weight, scheme)
                size = max(form.nbytes, 1)
                copies = max(1, min(math.ceil(footprint / size), room // size, MAX_COPIES))
                rotations[scheme] = itertools.cycle(
                    [form, *(form.copy() for _ in range(copies - 1))]
                )
            table[kind.name] = {scheme: {} for scheme in kind.candidates}
            inputs = torch.randn(max(rows), in_features, generator=g, dtype=dtype)
            for r in rows:
                for scheme, ms in _fastest_ms(rotations, inputs[:r]).items():
                    table[kind.name][scheme][r] = ms
            dependent = [s for s, forms in rotations.items() if _varies(next(forms), inputs, rows)]
            if dependent:
                width_dependent[kind.name] = tuple(dependent)
            del rotations
    return Timings(table, width_dependent)


def _varies(form: Callable[[Tensor], Tensor], inputs: Tensor, rows: Sequence[int]) -> bool:
    """Whether `form`'s output rows for a prefix of `inputs` differ from the same rows of the
    whole, at any width in `rows` (compared bit for bit)."""
    whole = form(inputs)
    return any(not torch.equal(form(inputs[:r]), whole[:r]) for r in rows)


def _fastest_ms(rotations: Mapping[str, Iterator[DecodeForm]], x: Tensor) -> dict[str, float]:
    """Per candidate, the fastest of `SAMPLES` timed calls on `x`, each on the next copy in its
    rotation, after `WARMUP` untimed ones (oneDNN builds a primitive per shape at its first
    call). The candidates take turns call by call, so that a stretch of time when another
    process holds a core slows them alike; and the fastest call counts, not the median, as
    losing a core only adds time (on a loaded host most calls of two threads may wait for one:
    a median would time the scheduler)."""
    best = dict.fromkeys(rotations, math.inf)
    for i in range(WARMUP + SAMPLES):
        for scheme, rotation in rotations.items():
            form = next(rotation)
            began = time.perf_counter()
            form(x)
            if i >= WARMUP:
                best[scheme] = min(best[scheme], time.perf_counter() - began)
    return {scheme: t * 1e3 for scheme, t in best.items()}


def _read(path: Path, kinds: Sequence[Kind], rows: Sequence[int]) -> Timings | None:
    """The cached timings at `path` where they hold every kind, candidate and width; else None."""
    try:
        raw = json.loads(path.read_text())
        table = {
            kind.name: {
                c: {r: float(raw["table"][kind.name][c][str(r)]) for r in rows}
                for c in kind.candidates
            }
            for kind in kinds
        }
        width_dependent = {
            kind: tuple(str(c) for c in candidates)
            for kind, candidates in raw["width_dependent"].items()
        }
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
        if not isinstance(e, FileNotFoundError):
            log.warning("decode kernel choice %s is unusable (%s): timing again", path, e)
        return None
    return Timings(table, width_dependent)


def _write(path: Path, timings: Timings) -> bool:
    """Store `timings` at `path` (whole or not at all); False, with a warning, where it cannot."""
    data = {
        "table": {
            kind: {c: {str(r): ms for r, ms in times.items()} for c, times in candidates.items()}
            for kind, candidates in timings.ms.items()
        },
        "width_dependent": {kind: list(c) for kind, c in timings.width_dependent.items()},
    }
    tmp: str | None = None
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(suffix=".json", dir=path.parent)
        with os.fdopen(fd, "w") as f:
            json.dump(data, f, indent=1)
        os.replace(tmp, path)
    except OSError as e:
        if tmp is not None and os.path.exists(tmp):
            os.unlink(tmp)
        log.warning("cannot cache the decode kernel choice in %s (%s)", path, e)
        return False
    return True
