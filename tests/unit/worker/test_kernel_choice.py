"""The decode kernel per kind of projection, chosen by timing (`neuron_worker.kernel_choice`):
the selection with injected timings, the cache of the table, and the model it configures."""

from __future__ import annotations

import json
import math
from collections.abc import Mapping, Sequence
from pathlib import Path

import pytest
import torch

from neuron_worker import compile_cache, kernel_choice
from neuron_worker.drafter import DraftConfig
from neuron_worker.engine_config import EngineConfig
from neuron_worker.kernel_choice import Kind, Timings, choose, decode_rows, pick, scores
from neuron_worker.model import Transformer, build_model, load_model
from neuron_worker.model.linear import DecodeForm, ServingLinear
from neuron_worker.model.llama import PROJECTION_KINDS
from tests.unit.model.tiny import SERVING, random_weights, serving_dtype

LAYERS = Kind("w13", (3072, 576), ("int4", "int8", "none"), ("own-bf16", "own-bf16", "onednn"))
WIDTHS = (1, 2, 4, 8)


def flat(ms: Mapping[str, float]) -> dict[str, dict[int, float]]:
    """Each candidate's time, the same at every width."""
    return {c: dict.fromkeys(WIDTHS, t) for c, t in ms.items()}


def test_the_score_is_the_geometric_mean_of_time_relative_to_the_fastest() -> None:
    times = {"int4": {1: 1.0, 8: 4.0}, "int8": {1: 2.0, 8: 2.0}, "none": {1: 4.0, 8: 2.0}}
    got = scores(times)
    # fastest at 1: int4; at 8: int8 and dense; ratios int4 1, 2; int8 2, 1; dense 4, 1
    assert got == pytest.approx({"int4": math.sqrt(2), "int8": math.sqrt(2), "none": 2.0})
    # a tie keeps the default, whatever the order of the candidates
    assert pick(LAYERS, times) == "int4"


@pytest.mark.parametrize("winner", ["int4", "int8", "none"])
def test_each_candidate_wins_where_it_is_clearly_faster(winner: str) -> None:
    times = flat({c: 0.5 if c == winner else 1.0 for c in LAYERS.candidates})
    assert pick(LAYERS, times) == winner


def test_another_candidate_needs_to_beat_the_default_by_the_margin() -> None:
    assert kernel_choice.MARGIN == 0.10
    assert pick(LAYERS, flat({"int4": 1.0, "int8": 0.95, "none": 2.0})) == "int4"  # noise
    assert pick(LAYERS, flat({"int4": 1.0, "int8": 0.85, "none": 2.0})) == "int8"
    assert pick(LAYERS, flat({"int4": 1.0, "int8": 0.85, "none": 0.8})) == "none"
    # the head's default is its stored scheme, first in its candidates
    head = Kind("head", (49152, 576), ("int8", "none"), ("own-bf16", "onednn"))
    assert pick(head, flat({"int8": 1.0, "none": 0.95})) == "int8"
    assert pick(head, flat({"int8": 1.0, "none": 0.5})) == "none"


def test_a_candidate_whose_rows_vary_with_the_width_is_never_chosen(
    caplog: pytest.LogCaptureFixture,
) -> None:
    times = flat({"int4": 1.0, "int8": 0.85, "none": 0.5})
    assert pick(LAYERS, times) == "none"
    assert pick(LAYERS, times, eligible=("int4", "int8")) == "int8"  # the next best
    noise = flat({"int4": 1.0, "int8": 0.95, "none": 0.5})
    assert pick(LAYERS, noise, eligible=("int4", "int8")) == "int4"  # by the usual margin
    # the default varies: the best candidate that does not, even a slower one
    slower = flat({"int4": 0.5, "int8": 1.0, "none": 2.0})
    assert pick(LAYERS, slower, eligible=("int8", "none")) == "int8"
    # every candidate varies: the default, with a warning
    assert pick(LAYERS, times, eligible=()) == "int4"
    assert "no decode kernel for w13 computes a row alike at every width" in caplog.text


def test_the_choice_passes_over_and_logs_a_width_dependent_candidate(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    model = tiny_model()
    layer_candidates = next(k for k in kernel_choice.kinds_of(model, {}) if k.name == "w2")
    if len(layer_candidates.candidates) < 2:
        pytest.skip("one decode kernel for the layers on this CPU: nothing to choose")
    fastest = layer_candidates.candidates[-1]
    caplog.set_level("INFO", logger="neuron_worker.kernel_choice")
    timer = Timer(dict.fromkeys(WIDTHS, fastest), width_dependent=[fastest])
    choice = choose(model, {}, WIDTHS, directory=tmp_path, measure=timer)
    assert choice.schemes["w2"] == "int4"
    assert f"{kernel_choice.name(fastest)} (" in caplog.text
    assert "rows vary with the width" in caplog.text
    # the finding is cached with the times
    again = choose(model, {}, WIDTHS, directory=tmp_path, measure=timer)
    assert timer.calls == 1 and again.timings == choice.timings
    assert again.schemes["w2"] == "int4"


def test_the_timing_finds_a_kernel_whose_rows_vary_with_the_width(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A candidate that rounds differently by the number of rows (as a kernel blocking its sums
    by rows may) is found on the real timing path, and the choice passes it over."""
    real = DecodeForm.of

    class Varying(DecodeForm):
        def __call__(self, x: torch.Tensor) -> torch.Tensor:
            return super().__call__(x) + (x.shape[0] > 2) * 1e-2

        def copy(self) -> DecodeForm:
            return Varying(self.scheme, self.kernel, super().copy().tensors)

    def of(weight: torch.Tensor, scheme: str) -> DecodeForm:
        form = real(weight, scheme)
        return Varying(form.scheme, form.kernel, form.tensors) if scheme == "int4" else form

    monkeypatch.setattr(DecodeForm, "of", staticmethod(of))
    kinds = [k for k in kernel_choice.kinds_of(tiny_model(), {}) if "int4" in k.candidates]
    if not kinds or len(kinds[0].candidates) < 2:
        pytest.skip("one decode kernel for the layers on this CPU: nothing to choose")
    timings = kernel_choice.measure_table(kinds, (1, 2, 4), serving_dtype())
    for kind in kinds:
        assert timings.width_dependent[kind.name] == ("int4",)
        assert "int4" not in timings.eligible(kind)
        assert pick(kind, timings.ms[kind.name], eligible=timings.eligible(kind)) != "int4"


def test_the_widths_are_every_decode_pass_and_the_verification_ones() -> None:
    assert decode_rows(EngineConfig()) == (1, 2, 3, 4, 5, 6, 7, 8)
    assert decode_rows(EngineConfig(max_batch=32)) == (1, 2, 3, 4, 5, 6, 7, 8, 16, 32)
    spec = EngineConfig(speculative=DraftConfig(pass_tokens=8))  # the CPU's default limit
    assert decode_rows(spec) == (1, 2, 3, 4, 5, 6, 7, 8, 13)  # 13: 1 + 4 drafts + 8 forced
    unlimited = EngineConfig(max_batch=4, speculative=DraftConfig(num_draft_tokens=2))
    assert decode_rows(unlimited) == (1, 2, 3, 4, 11, 44)


def tiny_model() -> Transformer:
    return build_model(SERVING, random_weights(SERVING), dtype=serving_dtype())


class Timer:
    """A `measure` that hands out `winners[width]` as the fastest at each width (others
    twice as slow), finds the `width_dependent` candidates' rows varying, and counts its calls."""

    def __init__(
        self, winners: Mapping[int, str] | None = None, width_dependent: Sequence[str] = ()
    ) -> None:
        self.winners = winners or {}
        self.width_dependent = tuple(width_dependent)
        self.calls = 0

    def __call__(self, kinds: Sequence[Kind], rows: Sequence[int], dtype: torch.dtype) -> Timings:
        self.calls += 1
        ms = {
            k.name: {
                c: {r: 1.0 if self.winners.get(r, k.default) == c else 2.0 for r in rows}
                for c in k.candidates
            }
            for k in kinds
        }
        dependent = {
            k.name: tuple(c for c in k.candidates if c in self.width_dependent) for k in kinds
        }
        return Timings(ms, {k: c for k, c in dependent.items() if c})


def test_the_layers_candidates_are_every_kernel_the_cpu_runs() -> None:
    """int4 first (the default), the 8-bit kernel where the worker's own run, the dense weight
    where bf16 is native; never int4a8, which rounds the activations (a forced choice only)."""
    from neuron_worker import kernels

    model = tiny_model()
    if model.tok_embeddings.weight.dtype != torch.bfloat16 or not kernels.bf16_available():
        pytest.skip("the bf16 kernels do not run here")
    kinds = {k.name: k for k in kernel_choice.kinds_of(model, {})}
    dense = ("none",) if torch.ops.mkldnn._is_mkldnn_bf16_supported() else ()
    for name in ("wqkv", "wo", "w13", "w2"):
        assert kinds[name].candidates == ("int4", "int8", *dense), name
        assert kinds[name].kernels[:2] == ("own-bf16",) * 2


def test_one_path_per_kind_whatever_wins_at_each_width(tmp_path: Path) -> None:
    """Batch invariance: whichever candidate is fastest at which width, each kind gets one
    scheme for every decode pass, and a row's logits are the same whatever shares its pass."""
    model = tiny_model()
    kinds = {k.name: k for k in kernel_choice.kinds_of(model, {})}
    layer_candidates = kinds["wqkv"].candidates
    if len(layer_candidates) < 2:
        pytest.skip("one decode kernel for the layers on this CPU: nothing to choose")
    # the last candidate fastest at one width, the first beyond the default at the others
    best = layer_candidates[1]
    winners = {WIDTHS[0]: layer_candidates[-1]} | dict.fromkeys(WIDTHS[1:], best)
    choice = choose(model, {}, WIDTHS, directory=tmp_path, measure=Timer(winners))
    assert set(choice.schemes) == set(PROJECTION_KINDS)
    assert choice.schemes["wqkv"] == best  # the best score over every width
    assert choice.schemes["head"] == "none"  # no stored quants: the dense head only
    model.use_serving_linears(choice.schemes)
    for kind in ("wqkv", "wo", "w13", "w2"):
        layers = [m for n, m in model.named_modules() if n.endswith(kind)]
        assert len(layers) == SERVING.n_layers
        assert {m.quantize for m in layers if isinstance(m, ServingLinear)} == {
            choice.schemes[kind]
        }
    # a row's logits through the chosen kernels, alone or in passes of other widths
    model.setup_caches(8, 32)
    kv = torch.arange(32)
    tokens = torch.arange(8).reshape(8, 1) * 7 % SERVING.vocab_size
    with torch.inference_mode():
        for n in (8, 1):
            model.step_logits(
                tokens[:n] + 1,
                torch.zeros(n, 1, dtype=torch.long),
                torch.arange(n),
                kv,
                torch.arange(n),
            )
        alone = model.step_logits(
            tokens[:1], torch.ones(1, 1, dtype=torch.long), torch.arange(1), kv, torch.arange(1)
        )
        for n in (2, 5, 8):
            shared = model.step_logits(
                tokens[:n], torch.ones(n, 1, dtype=torch.long), torch.arange(n), kv, torch.arange(n)
            )
            assert torch.equal(shared[:1], alone), n


def test_every_candidate_is_timed_at_every_width(tmp_path: Path) -> None:
    """The real timing, on the tiny model's shapes: a time for each kind, candidate and width,
    and a choice among the candidates."""
    model = tiny_model()
    kinds = kernel_choice.kinds_of(model, {})
    timings = kernel_choice.measure_table(kinds, (1, 3), serving_dtype())
    for kind in kinds:
        assert set(timings.ms[kind.name]) == set(kind.candidates)
        for times in timings.ms[kind.name].values():
            assert set(times) == {1, 3} and all(0 < t < 1000 for t in times.values())
        # the worker's own kernels compute a row alike at every width (a library's may not)
        assert kind.default in timings.eligible(kind), kind
    choice = choose(model, {}, (1, 3), directory=tmp_path)
    assert all(choice.schemes[k.name] in k.candidates for k in kinds)


def test_a_restart_reads_the_cached_table_and_a_new_key_times_again(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    model = tiny_model()
    timer = Timer()
    first = choose(model, {}, WIDTHS, directory=tmp_path, measure=timer)
    assert timer.calls == 1 and first.origin.startswith("timed in")
    files = list(tmp_path.glob("choice-*.json"))
    assert len(files) == 1 and str(files[0]) in first.origin
    caplog.set_level("INFO", logger="neuron_worker.kernel_choice")
    again = choose(model, {}, WIDTHS, directory=tmp_path, measure=timer)
    assert timer.calls == 1 and again.origin == f"read from {files[0]}"
    assert (again.schemes, again.timings) == (first.schemes, first.timings)
    # the table is logged, with where it came from and the choice per kind
    assert f"decode kernels read from {files[0]}" in caplog.text
    assert "wqkv [" in caplog.text and "-> " in caplog.text
    # another key: other widths, another CPU, another thread count
    choose(model, {}, (1, 2), directory=tmp_path, measure=timer)
    assert timer.calls == 2
    monkeypatch.setattr(kernel_choice, "cpu_identity", lambda: "another CPU | avx512f amx_tile")
    choose(model, {}, WIDTHS, directory=tmp_path, measure=timer)
    assert timer.calls == 3
    monkeypatch.undo()
    monkeypatch.setattr(torch, "get_num_threads", lambda: 64)
    choose(model, {}, WIDTHS, directory=tmp_path, measure=timer)
    assert timer.calls == 4
    monkeypatch.undo()
    # a damaged file is timed again (and rewritten)
    files[0].write_text("{not json")
    choose(model, {}, WIDTHS, directory=tmp_path, measure=timer)
    assert timer.calls == 5 and json.loads(files[0].read_text())["table"]
    assert "unusable" in caplog.text


def test_a_forced_quantize_times_nothing_and_auto_takes_the_measured_choice(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setattr(compile_cache, "_root", tmp_path)

    def fail(kinds: Sequence[Kind], rows: Sequence[int], dtype: torch.dtype) -> Timings:
        raise AssertionError("timed")

    monkeypatch.setattr(kernel_choice, "measure_table", fail)
    dtype = serving_dtype()
    for forced in ("int4", "none"):
        model = load_model("default", dtype=dtype, serving=True, quantize=forced)
        assert {m.quantize for n, m in model.named_modules() if n.endswith(".w2")} == {forced}
    assert not list(tmp_path.rglob("choice-*.json"))
    # auto: each kind takes the fastest of the (fake) timings: dense where it is a candidate
    monkeypatch.setattr(kernel_choice, "measure_table", Timer(dict.fromkeys(range(1, 9), "none")))
    model = load_model("default", dtype=dtype, serving=True, quantize="auto", decode_rows=(1, 8))
    kinds = {k.name: k for k in kernel_choice.kinds_of(model, {})}
    want = "none" if "none" in kinds["w2"].candidates else "int4"
    assert {m.quantize for n, m in model.named_modules() if n.endswith(".w2")} == {want}
    assert len(list((tmp_path / "kernels").glob("choice-*.json"))) == 1
