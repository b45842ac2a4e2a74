"""The real worker on the XLA CPU device, structured outputs on: every bucketed graph compiles
during warm-up, mixed constrained + unconstrained traffic compiles nothing new, neither do prompts
that reuse a prefix copied between KV slots, and greedy outputs match the CPU backend token for
token.

Processes: one grammar service, one `--device xla` worker, one `--device cpu` worker with the same
buckets. Small buckets keep warm-up short (each SmolLM2 forward graph takes ~20-30 s to compile
on 2 CPU cores): batch 1,2 x tokens per row 1,8,128 x kv_len 128.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from maskwire.tokenizer import load_tokenizer
from tests.support.processes import ServiceProcess, free_port, running
from tests.xla.support import Case, chat, check_constrained, generate_all, mixed_cases, scrape

pytestmark = [pytest.mark.xla, pytest.mark.timeout(1800)]  # warm-up compiles for minutes

BUCKETS = [
    "--max-batch-size", "2", "--batch-buckets", "1,2",
    "--max-seq-len", "128", "--seq-buckets", "128", "--token-buckets", "1,8,128",
]  # fmt: skip
FORWARD_GRAPHS = 2 * 3 * 1  # batch x token x kv buckets
# batch buckets x (greedy, sample, top-k/top-p) x (plain, with penalties and logprobs)
SAMPLER_GRAPHS = 2 * 3 * 2
REPLACE_GRAPHS = 3  # (batch, jump-forward rows): (1,1), (2,1), (2,2)
COPY_GRAPHS = 1  # a prefix copy between KV slots: one per kv bucket


@pytest.fixture(scope="module")
def grammar_service() -> Iterator[ServiceProcess]:
    with running("grammar-service", ["--tokenizer", "default"]) as gs:
        yield gs


@pytest.fixture(scope="module")
def xla_worker(grammar_service: ServiceProcess) -> Iterator[tuple[ServiceProcess, int]]:
    port = free_port()
    args = ["--device", "xla", "--grammar-service", grammar_service.address, *BUCKETS]
    with running("worker", [*args, "--metrics-port", str(port)], timeout_s=1500) as w:
        yield w, port


@pytest.fixture(scope="module")
def cpu_worker(grammar_service: ServiceProcess) -> Iterator[ServiceProcess]:
    args = ["--device", "cpu", "--grammar-service", grammar_service.address, *BUCKETS]
    with running("worker", args) as w:
        yield w


def test_warmup_compiles_every_bucket(xla_worker: tuple[ServiceProcess, int]) -> None:
    worker, port = xla_worker
    graphs = FORWARD_GRAPHS + SAMPLER_GRAPHS + REPLACE_GRAPHS + COPY_GRAPHS
    assert f"warm-up ran {graphs} graphs" in worker.log_text()
    metrics = scrape(port)
    # Loading the weights and allocating the cache add a couple of graphs of their own.
    assert graphs <= metrics["maskwire_worker_xla_compilations_total"] <= graphs + 3


async def test_mixed_traffic_compiles_nothing_and_matches_cpu(
    xla_worker: tuple[ServiceProcess, int], cpu_worker: ServiceProcess
) -> None:
    worker, port = xla_worker
    cases = mixed_cases()
    before = scrape(port)
    on_xla = await generate_all(worker.address, cases)
    after = scrape(port)

    assert (
        after["maskwire_worker_xla_executions_total"]
        > before["maskwire_worker_xla_executions_total"]
    )
    new = (
        after["maskwire_worker_xla_compilations_total"]
        - before["maskwire_worker_xla_compilations_total"]
    )
    assert new == 0, f"{new} graphs compiled after warm-up:\n{worker.log_text()[-3000:]}"

    on_cpu = await generate_all(cpu_worker.address, cases)
    for case in cases:
        xla, cpu = on_xla[case.name], on_cpu[case.name]
        assert xla.ids, case.name
        if case.constraint is not None:
            check_constrained(case, xla)
        if case.greedy:
            assert xla.ids == cpu.ids, (case.name, xla.text, cpu.text)
            assert xla.finish_reason == cpu.finish_reason, case.name
    assert on_xla["plain-raw"].text.startswith(" Paris.")
    assert len(on_xla["plain-ignore-eos"].ids) == 12


async def test_prefix_copies_compile_nothing_and_match_cpu(
    xla_worker: tuple[ServiceProcess, int], cpu_worker: ServiceProcess
) -> None:
    """Three requests with one system prompt no slot holds, on two batch rows: the ones that
    share it wait for the first one's prompt pass and copy its K/V (or find it in place), on
    the warm copy graph; the answers are the CPU backend's."""
    worker, port = xla_worker
    system = (
        "<|im_start|>system\nYou are the desk of a ferry line between Dover and Calais. Answer "
        "in one short sentence and never promise a crossing time.<|im_end|>\n"
    )
    cases = [
        Case(f"ferry-{i}", system + chat(q), sampling={"max_tokens": 12})
        for i, q in enumerate(("Do you take cars?", "Is there Wi-Fi?", "Can I bring a dog?"))
    ]
    before = scrape(port)["maskwire_worker_xla_compilations_total"]
    on_xla = await generate_all(worker.address, cases)
    new = scrape(port)["maskwire_worker_xla_compilations_total"] - before
    assert new == 0, f"{new} graphs compiled after warm-up:\n{worker.log_text()[-3000:]}"
    shared = len(load_tokenizer("default").encode(system)) - 2
    reused = sorted(o.cached_prompt_tokens for o in on_xla.values())
    assert all(n >= shared for n in reused[1:]), (reused, shared)
    on_cpu = await generate_all(cpu_worker.address, cases)
    for case in cases:
        assert on_xla[case.name].ids == on_cpu[case.name].ids, case.name
