"""The prefix cache on real processes, in the arithmetic users run (4-bit decode kernels where
the CPU has them, the dense prompt pass): a prompt that starts like one a KV slot holds computes
only its new tokens, reports the rest as `cached_prompt_tokens`, and answers exactly what a
worker without the cache answers, whether the prefix is reused in place (a repeated request), or
copied from the slot of a request still running (a shared system prompt) or from one sent at the
same time, or the previous turn's answer rewritten into its slot while the worker was idle,
constrained or not,
with n > 1, and per cache salt; and it keeps more prompts than requests run at once. Two workers
start for it: a slow suite (the default run checks reuse through the gateway's shared stack,
`cached_tokens` and the same answers, and the engine against its fake model)."""

from __future__ import annotations

import asyncio
import json
import urllib.request
from collections.abc import Iterator
from typing import Any, NamedTuple

import jsonschema
import pytest
from prometheus_client.parser import text_string_to_metric_families

from maskwire.tokenizer import load_tokenizer
from maskwire.v1 import common_pb2, worker_pb2, worker_pb2_grpc
from tests.integration.worker.conftest import Result, channel, chat, generate
from tests.support.metrics import metric, settled
from tests.support.processes import ServiceProcess, free_port, running, spawned
from tests.support.schemas import PERSON

FLAGS = [*("--quantize", "int4", "--dtype", "auto", "--max-batch-size", "4")]
FLAGS += ["--max-seq-len", "512"]
SYSTEM = (
    "<|im_start|>system\nYou answer questions for the customers of a shipping company that "
    "moves containers between Rotterdam, Singapore and Los Angeles. Be brief, be polite, and "
    "never promise a delivery date you cannot check.<|im_end|>\n"
)
TOK = load_tokenizer("default")

pytestmark = pytest.mark.slow


def reused_tokens(port: int) -> float:
    """The worker's `maskwire_worker_prompt_tokens_total{source="reused"}`."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as r:
        text = r.read().decode()
    return sum(
        s.value
        for fam in text_string_to_metric_families(text)
        for s in fam.samples
        if s.name == "maskwire_worker_prompt_tokens_total" and s.labels["source"] == "reused"
    )


REFRESHED = "maskwire_worker_refreshed_answer_tokens_total"


class Services(NamedTuple):
    """The worker with the prefix cache, one without, and their metrics ports."""

    cached: ServiceProcess
    plain: ServiceProcess
    cached_metrics: int
    plain_metrics: int


@pytest.fixture(scope="module")
def services() -> Iterator[Services]:
    ports = free_port(), free_port()
    with running("grammar-service", ["--tokenizer", "default"]) as gs:
        common = ["--model", "default", "--grammar-service", gs.address, *FLAGS]
        with (
            spawned("worker", [*common, "--metrics-port", str(ports[0])]) as cached,
            spawned(
                "worker", [*common, "--metrics-port", str(ports[1]), "--no-prefix-cache"]
            ) as plain,
        ):
            cached.wait_ready(300.0)
            plain.wait_ready(300.0)
            yield Services(cached, plain, *ports)


async def both(
    services: Services,
    prompt: str,
    constraint: common_pb2.Constraint | None = None,
    **sampling: Any,
) -> tuple[Result, Result]:
    """`prompt` on the worker with the cache, then on the one without."""
    out = []
    for worker in (services.cached, services.plain):
        async with channel(worker.address) as ch:
            stub = worker_pb2_grpc.WorkerStub(ch)
            out.append(await generate(stub, prompt, constraint, **sampling))
    return out[0], out[1]


def cached_tokens(result: Result) -> int:
    return result.final.usage.cached_prompt_tokens


def shared_prefix(a: str, b: str) -> int:
    x, y = TOK.encode(a), TOK.encode(b)
    n = 0
    while n < min(len(x), len(y)) and x[n] == y[n]:
        n += 1
    return n


async def test_a_repeated_prompt_computes_only_its_last_token(services: Services) -> None:
    prompt = SYSTEM + chat("Which ports do you serve?")
    before = reused_tokens(services.cached_metrics)
    first, plain = await both(services, prompt, max_tokens=24)
    again, _ = await both(services, prompt, max_tokens=24)
    n = again.final.usage.prompt_tokens
    assert cached_tokens(again) == n - 1 and cached_tokens(first) < n - 1
    assert cached_tokens(plain) == 0
    assert again.ids == first.ids == plain.ids, (again.text, first.text, plain.text)
    assert reused_tokens(services.cached_metrics) - before == cached_tokens(first) + n - 1
    assert reused_tokens(services.plain_metrics) == 0


async def test_a_prefix_held_by_a_running_request_is_copied(services: Services) -> None:
    """B arrives while A, with the same long system prompt, still decodes: B's free slots hold
    none of it, A's does."""
    system = SYSTEM.replace("shipping company", "freight forwarder")  # held by no slot yet
    a_prompt = system + chat("Tell me a long story about a container ship.")
    b_prompt = system + chat("Do you ship to Hamburg?")
    cached, plain, port, _ = services
    before = reused_tokens(port)
    async with channel(cached.address) as ch:
        stub = worker_pb2_grpc.WorkerStub(ch)
        started = asyncio.Event()
        a_task = asyncio.create_task(
            generate(stub, a_prompt, started=started, max_tokens=64, ignore_eos=True)
        )
        await started.wait()
        b = await generate(stub, b_prompt, max_tokens=24)
        assert not a_task.done()  # B was admitted while A ran
        a = await a_task
    async with channel(plain.address) as ch:
        stub = worker_pb2_grpc.WorkerStub(ch)
        a_plain = await generate(stub, a_prompt, max_tokens=64, ignore_eos=True)
        b_plain = await generate(stub, b_prompt, max_tokens=24)
    assert cached_tokens(b) == shared_prefix(a_prompt, b_prompt) > len(TOK.encode(system)) - 2
    assert reused_tokens(port) - before == cached_tokens(a) + cached_tokens(b)
    assert a.ids == a_plain.ids, (a.text, a_plain.text)
    assert b.ids == b_plain.ids, (b.text, b_plain.text)


async def test_requests_sent_together_compute_a_new_system_prompt_once(
    services: Services,
) -> None:
    """Three requests with a system prompt no slot holds, sent at once: one computes it, the
    others copy it from that one's slot (they wait for its prompt pass rather than compute it
    beside it), and every answer is the plain worker's."""
    system = SYSTEM.replace("shipping company", "ferry line")
    prompts = [system + chat(q) for q in ("Do you take cars?", "Is there Wi-Fi?", "Pets?")]
    cached, plain, port, _ = services
    before = reused_tokens(port)
    async with channel(cached.address) as ch:
        stub = worker_pb2_grpc.WorkerStub(ch)
        together = await asyncio.gather(*(generate(stub, p, max_tokens=16) for p in prompts))
    async with channel(plain.address) as ch:
        stub = worker_pb2_grpc.WorkerStub(ch)
        alone = [await generate(stub, p, max_tokens=16) for p in prompts]
    system_tokens = len(TOK.encode(system))
    reused = sorted(cached_tokens(r) for r in together)
    # The first may reuse the few tokens every system prompt starts with, in place.
    assert reused[0] < 16 and all(n >= system_tokens - 2 for n in reused[1:]), reused
    assert reused_tokens(port) - before == sum(reused)
    for got, want in zip(together, alone, strict=True):
        assert got.ids == want.ids, (got.text, want.text)


async def test_more_prompts_are_kept_than_requests_run_at_once(services: Services) -> None:
    """Batch 4 with the default 8 slots that only keep prompts: after a prompt, 7 others (sent
    together, they run 4 at a time) leave it held, and sent again it computes its last token
    only (with a batch's 4 slots alone, the 7 would have evicted it)."""
    cities = ("Lima", "Oslo", "Cairo", "Perth", "Quito", "Riga", "Dakar", "Hanoi")
    prompts = [chat(f"Plan a day in {city} for a family with two children.") for city in cities]
    cached, plain, _, _ = services
    async with channel(cached.address) as ch:
        stub = worker_pb2_grpc.WorkerStub(ch)
        await generate(stub, prompts[0], max_tokens=8)
        await asyncio.gather(*(generate(stub, p, max_tokens=8) for p in prompts[1:]))
        again = await generate(stub, prompts[0], max_tokens=24)
    async with channel(plain.address) as ch:
        alone = await generate(worker_pb2_grpc.WorkerStub(ch), prompts[0], max_tokens=24)
    assert cached_tokens(again) == again.final.usage.prompt_tokens - 1
    assert again.ids == alone.ids, (again.text, alone.text)


async def test_a_next_turn_reuses_the_answer_refreshed_while_idle(services: Services) -> None:
    """The first turn's answer (written by the 4-bit steps) is rewritten into its slot by idle
    prompt passes; the second turn, which repeats the exchange, computes only its new message
    and answers exactly what the worker without the cache answers."""
    prompt = SYSTEM + chat("Which documents do I need to ship a car?")
    cached, _, port, _ = services
    # Earlier tests' answers are rewritten first: then the next passes are this answer's.
    before = settled(port, REFRESHED)
    async with channel(cached.address) as ch:
        first = await generate(worker_pb2_grpc.WorkerStub(ch), prompt, max_tokens=40)
    for _ in range(600):
        if metric(port, REFRESHED) - before >= len(first.ids):
            break
        await asyncio.sleep(0.05)
    follow_up = prompt + first.text + "<|im_end|>\n" + chat("And for a motorbike?")
    second, alone = await both(services, follow_up, max_tokens=24)
    n = len(TOK.encode(prompt)) + len(first.ids)
    assert cached_tokens(second) >= n - 1, (cached_tokens(second), n, first.text)
    assert second.ids == alone.ids, (second.text, alone.text)


async def test_constrained_answers_reuse_the_prompt_too(services: Services) -> None:
    prompt = SYSTEM + chat("Give me a JSON record for a person named Ada, 36.")
    constraint = common_pb2.Constraint(json_schema=json.dumps(PERSON))
    first, plain = await both(services, prompt, constraint, max_tokens=48)
    again, _ = await both(services, prompt, constraint, max_tokens=48)
    assert cached_tokens(again) == again.final.usage.prompt_tokens - 1
    assert again.ids == first.ids == plain.ids
    jsonschema.validate(json.loads(again.text), PERSON)


async def test_n_choices_share_a_reused_prompt(services: Services) -> None:
    """The first choice's prompt pass starts after the reused prefix; the others copy all of
    it from its slot: greedy, every choice is the plain worker's answer. (A system prompt of its
    own: no other slot holds more than its first tokens.)"""
    system = SYSTEM.replace("You answer", "At the documents desk you answer")
    prompt = system + chat("What is a bill of lading?")
    single, plain = await both(services, prompt, max_tokens=20)
    cached, _, _, _ = services
    async with channel(cached.address) as ch:
        stub = worker_pb2_grpc.WorkerStub(ch)
        call = worker_pb2.GenerateRequest(
            text=prompt, n=3, sampling=worker_pb2.SamplingParams(max_tokens=20)
        )
        ids: dict[int, list[int]] = {0: [], 1: [], 2: []}
        finals: dict[int, worker_pb2.GenerateResponse] = {}
        async for msg in stub.Generate(call):
            ids[msg.index] += list(msg.token_ids)
            if msg.finish_reason:
                finals[msg.index] = msg
    assert all(ids[i] == plain.ids for i in range(3)), ids
    n = single.final.usage.prompt_tokens
    assert all(f.usage.cached_prompt_tokens == n - 1 for f in finals.values())


async def test_a_prompt_cached_under_another_salt_is_computed_again(services: Services) -> None:
    """Tenants (cache salts) never reuse each other's prompts, which would show in their
    response times; within a tenant they do."""
    prompt = SYSTEM + chat("Where is your office in Singapore?")
    async with channel(services.cached.address) as ch:
        stub = worker_pb2_grpc.WorkerStub(ch)
        a = await generate(stub, prompt, cache_salt="tenant-a", max_tokens=12)
        b = await generate(stub, prompt, cache_salt="tenant-b", max_tokens=12)
        a_again = await generate(stub, prompt, cache_salt="tenant-a", max_tokens=12)
    n = a.final.usage.prompt_tokens
    assert [cached_tokens(r) for r in (a, b, a_again)] == [0, 0, n - 1]
    assert a.ids == b.ids == a_again.ids
