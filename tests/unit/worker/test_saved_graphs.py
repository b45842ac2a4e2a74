"""Forward graphs saved whole in the compile cache: the next runner loads them without
compiling, with the same logits; a damaged file is compiled again, an unwritable directory only
costs the saving, inputs the saved guards refuse run on a graph compiled for them, and the key
changes with what the graph depends on."""

from __future__ import annotations

import logging
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
import torch

from neuron_worker import saved_graphs
from neuron_worker.backends import create_backend
from neuron_worker.compile_cache import saved_graph_counts
from neuron_worker.graphs import CompileCounter, ForwardRunner, Pass
from neuron_worker.model import build_model
from tests.unit.model.tiny import TINY, random_weights, serving_tiny
from tests.unit.worker.test_graphs import serve_random_passes, tiny_runner

KINDS = ("decode", "multi")  # fp32: one function, attention not in place (so no chunks)


@pytest.fixture(scope="module")
def weights() -> dict[str, torch.Tensor]:
    return random_weights(TINY)


@pytest.fixture(scope="module")
def saved(weights: dict[str, torch.Tensor], tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A directory holding the two graphs, compiled and saved by a first runner."""
    directory = tmp_path_factory.mktemp("graphs")
    before = saved_graph_counts()
    tiny_runner(weights, True, graph_dir=directory).warmup(lambda _: None)
    assert delta(before) == (0, 2)
    assert sorted(p.name.split("-")[0] for p in directory.glob("*.bin")) == sorted(KINDS)
    return directory


def delta(before: tuple[int, int]) -> tuple[int, int]:
    """(loaded, compiled) saved graphs since `before`."""
    now = saved_graph_counts()
    return now[0] - before[0], now[1] - before[1]


def test_the_next_runner_loads_every_graph_and_compiles_nothing(
    weights: dict[str, torch.Tensor], saved: Path
) -> None:
    before = saved_graph_counts()
    counter = CompileCounter()
    counter.ready()  # from here, any graph compiled by torch.compile is counted
    again = tiny_runner(weights, True, graph_dir=saved)
    again.warmup(lambda _: None)
    assert delta(before) == (2, 0)
    serve_random_passes(tiny_runner(weights, False), again)
    counter.check()
    assert counter.after_ready == 0


def test_a_quantized_model_saves_a_graph_per_role_and_no_grid_where_attention_is_in_place(
    tmp_path: Path,
) -> None:
    """bf16 with int4 projections, attention in place: prompts and generated tokens each have
    their one-token-per-row graph (`prefill`, `decode`); passes too large to run flat run in
    chunks, so `multi` is never compiled. A second runner loads both."""
    m = serving_tiny("int4")
    m.setup_caches(5, 64)

    def runner() -> ForwardRunner:
        backend = create_backend("cpu", compile=True)
        kw: dict[str, Any] = {"max_rows": 4, "max_seq": 64, "pad_slot": 4, "flat_tokens": 16}
        return ForwardRunner(m, backend, graph_dir=tmp_path, **kw)

    before = saved_graph_counts()
    runner().warmup(lambda _: None)
    assert delta(before) == (0, 2)
    assert sorted(p.name.split("-")[0] for p in tmp_path.glob("*.bin")) == ["decode", "prefill"]
    before = saved_graph_counts()
    runner().warmup(lambda _: None)
    assert delta(before) == (2, 0)


def test_a_damaged_file_is_compiled_again(
    weights: dict[str, torch.Tensor], saved: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    for f in saved.glob("*.bin"):
        (tmp_path / f.name).write_bytes(f.read_bytes())
    damaged = next(tmp_path.glob("multi-*.bin"))
    damaged.write_bytes(b"not a graph")
    before = saved_graph_counts()
    runner = tiny_runner(weights, True, graph_dir=tmp_path)
    with caplog.at_level(logging.WARNING, logger="neuron_worker.saved_graphs"):
        runner.warmup(lambda _: None)
    assert delta(before) == (1, 1)
    assert f"saved graph {damaged} does not load" in caplog.text
    assert damaged.stat().st_size > 1000  # saved again, whole
    serve_random_passes(tiny_runner(weights, False), runner)


def test_an_unwritable_directory_costs_only_the_saving(
    weights: dict[str, torch.Tensor], tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    (tmp_path / "a-file").write_text("")
    runner = tiny_runner(weights, True, graph_dir=tmp_path / "a-file" / "graphs")
    decode = Pass(  # two rows, one token each: the decode graph only
        np.array([[5], [7]]), np.array([[0], [0]]), np.array([0, 1]), np.array([0, 1]), 64
    )
    with torch.inference_mode(), caplog.at_level(logging.WARNING):
        got = runner.run(decode)
        want = tiny_runner(weights, False).run(decode)
    assert caplog.text.count("it compiles again next start") == 1
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


def test_a_graph_that_cannot_be_precompiled_runs_on_torch_compile(
    weights: dict[str, torch.Tensor], tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    runner = tiny_runner(weights, True, graph_dir=tmp_path)
    assert runner._saved is not None

    def refuse(_: object) -> None:
        raise RuntimeError("MODULE_MATCH guard cannot be serialized")

    runner._saved._compilers["step_logits"] = SimpleNamespace(aot_compile=refuse)
    decode = Pass(
        np.array([[5], [7]]), np.array([[0], [0]]), np.array([0, 1]), np.array([0, 1]), 64
    )
    with torch.inference_mode(), caplog.at_level(logging.WARNING):
        got = runner.run(decode)
        runner.run(decode)
        want = tiny_runner(weights, False).run(decode)
    assert caplog.text.count("graph decode cannot be precompiled (MODULE_MATCH guard") == 1
    assert not list(tmp_path.iterdir())
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


def test_inputs_the_saved_guards_refuse_run_on_a_compiled_graph(
    weights: dict[str, torch.Tensor], saved: Path, caplog: pytest.LogCaptureFixture
) -> None:
    runner = tiny_runner(weights, True, graph_dir=saved)
    graphs = runner._saved
    assert graphs is not None
    counter = CompileCounter()
    counter.ready()
    with torch.inference_mode(), caplog.at_level(logging.WARNING):
        # int32 tokens: the saved decode graph was traced for int64 (the rest as the runner has it)
        args = (
            torch.zeros(3, 1, dtype=torch.int32),
            torch.tensor([[0], [-1], [-1]]),
            torch.tensor([0, 4, 4]),
            torch.arange(64),
            torch.zeros(3, dtype=torch.int64),
        )
        got = graphs("decode", "step_logits", args)
        graphs("decode", "step_logits", args)
        four_rows = (
            torch.zeros(4, 1, dtype=torch.int32),
            torch.tensor([[1], [-1], [-1], [-1]]),
            torch.tensor([0, 4, 4, 4]),
            torch.arange(64),
            torch.zeros(4, dtype=torch.int64),
        )
        graphs("decode", "step_logits", four_rows)
    counter.check()
    # compiled once for them, by torch.compile, with the rows symbolic as in the saved graph
    assert counter.after_ready == 1
    assert caplog.text.count("saved graph decode refuses these inputs") == 1
    assert "Int" in caplog.text and "dispatch key" not in caplog.text  # torch names the dtype
    with torch.inference_mode():
        want = tiny_runner(weights, False).model.step_logits(*(a.long() for a in args))
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


def test_the_key_follows_the_model_structure_the_ranges_and_the_compile_options(
    weights: dict[str, torch.Tensor], monkeypatch: pytest.MonkeyPatch
) -> None:
    def model(dtype: torch.dtype = torch.float32, slots: int = 5) -> torch.nn.Module:
        m = build_model(TINY, weights, dtype=dtype)
        m.setup_caches(slots, 256)
        return m

    key = saved_graphs.graph_key(model(), "rows4")
    assert saved_graphs.graph_key(model(), "rows4") == key  # same structure, other weights object
    assert saved_graphs.graph_key(model(), "rows8") != key
    assert saved_graphs.graph_key(model(torch.bfloat16), "rows4") != key
    assert saved_graphs.graph_key(model(slots=9), "rows4") != key
    tweaked = model()
    tweaked.layers[0].attention.decode_kernel = True  # a setting the traced code reads
    assert saved_graphs.graph_key(tweaked, "rows4") != key
    # A graph written with inductor's output checks is not the lean one of this version.
    monkeypatch.setitem(saved_graphs.LEAN_WRAPPER, "size_asserts", True)
    assert saved_graphs.graph_key(model(), "rows4") != key


def test_the_key_follows_the_code_that_chooses_the_guards(
    weights: dict[str, torch.Tensor], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A graph saved while the guard filter kept the thread count refuses every other team
    size: a new guard policy must not load it."""
    m = build_model(TINY, weights, dtype=torch.float32)
    m.setup_caches(5, 256)
    key = saved_graphs.graph_key(m, "rows4")
    policy = saved_graphs._POLICY_SOURCES
    assert "neuron_worker/backends.py" in policy and "neuron_worker/saved_graphs.py" in policy
    root = Path(saved_graphs.__file__).resolve().parent.parent
    real = Path.read_bytes

    def edited(path: Path) -> bytes:
        data = real(path)
        return data + b"# edited" if path == root / "neuron_worker/backends.py" else data

    monkeypatch.setattr(Path, "read_bytes", edited)
    assert saved_graphs.graph_key(m, "rows4") != key


def test_a_runner_without_a_directory_saves_nothing(weights: dict[str, torch.Tensor]) -> None:
    assert tiny_runner(weights, True)._saved is None
    assert tiny_runner(weights, False, graph_dir=Path("/nonexistent"))._saved is None
    bucketed: ForwardRunner = tiny_runner(
        weights,
        True,
        graph_dir=Path("/nonexistent"),
        batch_buckets=(2, 4),
        token_buckets=(1, 8),
        seq_buckets=(256,),
    )
    assert bucketed._saved is None
    assert np.array_equal(bucketed.logits_rows(), [2, 4])
