"""Scheduler: bounded queue, slot reuse, buckets, prefill budget."""

from __future__ import annotations

from collections.abc import Callable

import grpc
import pytest

from maskwire.rpc import RpcError
from neuron_worker.detokenize import Detokenizer
from neuron_worker.events import EngineError
from neuron_worker.prefix_cache import Reuse
from neuron_worker.request import Request, Sampling, State
from neuron_worker.scheduler import Scheduler, bucket_for, parse_buckets, pow2_buckets
from neuron_worker.servicer import status


def make(i: int, n_prompt: int = 4, peer: str = "", group: str = "") -> Request:
    return Request(
        request_id=f"r{i}",
        prompt=[1] * n_prompt,
        sampling=Sampling(max_tokens=4),
        detok=Detokenizer(lambda t: b"x"),
        peer=peer,
        group=group,
    )


def sched(**kw: int) -> Scheduler:
    args = dict(max_batch=2, max_queue=2, max_seq_len=256, max_prefill_tokens=4096)
    args.update(kw)
    return Scheduler(
        batch_buckets=pow2_buckets(1, args["max_batch"]),
        seq_buckets=pow2_buckets(64, args["max_seq_len"]),
        **args,
    )


def test_buckets() -> None:
    assert pow2_buckets(1, 8) == [1, 2, 4, 8]
    assert pow2_buckets(128, 300) == [128, 256, 300]
    assert parse_buckets("3, 1,16", 8, 1) == [1, 3, 8]
    assert parse_buckets("", 6, 1) == [1, 2, 4, 6]
    assert bucket_for([1, 2, 4], 3) == 4
    with pytest.raises(ValueError):
        bucket_for([1, 2, 4], 5)
    with pytest.raises(ValueError):
        parse_buckets("0,2", 8, 1)


def as_status(call: Callable[[], object]) -> None:
    """`call`, its refusal raised as the status the servicer answers with."""
    try:
        call()
    except EngineError as e:
        raise status(e) from e


def test_queue_full_is_resource_exhausted() -> None:
    s = sched()
    s.enqueue([make(0)])
    s.enqueue([make(1)])
    with pytest.raises(RpcError) as e:
        as_status(lambda: s.enqueue([make(2)]))
    assert e.value.code is grpc.StatusCode.RESOURCE_EXHAUSTED


def test_admission_fills_free_slots_and_release_reuses_them() -> None:
    s = sched()
    reqs = [make(i) for i in range(2)]
    for r in reqs:
        s.enqueue([r])
    admitted = s.admit()
    assert admitted == reqs and {r.slot for r in reqs} == {0, 1}
    assert all(r.state is State.RUNNING for r in reqs)
    late = make(9)
    s.enqueue([late])
    assert s.admit() == []  # no free slot
    slot = reqs[0].slot
    s.release(reqs[0])
    assert reqs[0].state is State.FINISHED and reqs[0].slot == -1
    assert s.admit() == [late] and late.slot == slot


def test_release_of_waiting_request_leaves_the_queue() -> None:
    s = sched()
    r = make(0)
    s.enqueue([r])
    s.release(r)
    assert s.queue_depth == 0 and r.finished


def test_prefill_budget_splits_admission_but_always_admits_one() -> None:
    s = sched(max_batch=4, max_queue=8, max_prefill_tokens=64)
    big = [make(i, n_prompt=60) for i in range(3)]
    for r in big:
        s.enqueue([r])
    assert s.admit() == big[:1]  # one 64-token row fits; two would be 128
    assert s.admit() == big[1:2]


# -- fair shares between clients (peers) -----------------------------------------------------


def _refused(call: Callable[[], object]) -> RpcError:
    with pytest.raises(RpcError) as e:
        as_status(call)
    assert e.value.code is grpc.StatusCode.RESOURCE_EXHAUSTED and e.value.reason == "QUEUE_FULL"
    return e.value


def test_a_client_alone_may_fill_the_whole_queue() -> None:
    s = sched(max_queue=4)
    for i in range(4):
        assert s.enqueue([make(i, peer="a")]) == []
    _refused(lambda: s.check_room("a", 1))
    _refused(lambda: s.enqueue([make(9, peer="a")]))


def test_a_client_under_its_share_takes_the_place_of_the_greediest_newest_call() -> None:
    s = sched(max_queue=4)
    greedy = [make(i, peer="a") for i in range(4)]
    for r in greedy:
        s.enqueue([r])
    s.check_room("b", 2)  # b's fair share is half the queue
    _refused(lambda: s.check_room("b", 3))
    assert s.enqueue([make(10, peer="b")]) == [greedy[3]]
    assert s.enqueue([make(11, peer="b")]) == [greedy[2]]
    _refused(lambda: s.enqueue([make(12, peer="b")]))  # b holds its share now
    _refused(lambda: s.enqueue([make(13, peer="a")]))
    assert [r.request_id for r in s.waiting] == ["r0", "r1", "r10", "r11"]


def test_the_choices_of_a_call_leave_the_queue_together() -> None:
    s = sched(max_queue=4)
    reqs = [make(0, peer="a"), make(1, peer="a"), make(2, peer="a", group="g")]
    reqs.append(make(3, peer="a", group="g"))
    for r in reqs:
        s.enqueue([r])
    assert s.enqueue([make(10, peer="b")]) == reqs[2:]
    assert s.queue_depth == 3


def test_the_choices_of_a_call_are_queued_all_or_none() -> None:
    s = sched(max_queue=4)
    s.enqueue([make(0, peer="a"), make(1, peer="a")])
    _refused(lambda: s.enqueue([make(i, peer="a", group="g") for i in range(2, 5)]))
    assert [r.request_id for r in s.waiting] == ["r0", "r1"]
    s.enqueue([make(i, peer="a", group="h") for i in range(5, 7)])
    assert s.queue_depth == 4


def test_a_free_slot_goes_to_the_client_with_the_fewest_running() -> None:
    s = sched(max_batch=2, max_queue=8)
    greedy = [make(i, peer="a") for i in range(4)]
    for r in greedy:
        s.enqueue([r])
    late = make(10, peer="b")
    s.enqueue([late])
    assert s.admit() == [greedy[0], late]  # first come first, then the client with none running
    s.release(greedy[0])
    assert s.admit() == [greedy[1]]


def test_between_equals_a_free_slot_goes_to_the_client_admitted_least_recently() -> None:
    s = sched(max_batch=1, max_queue=8)
    greedy = [make(i, peer="a") for i in range(3)]
    for r in greedy:
        s.enqueue([r])
    assert s.admit() == [greedy[0]]
    late = make(10, peer="b")
    s.enqueue([late])
    s.release(greedy[0])
    assert s.admit() == [late]  # a had the slot last; b's request is younger but goes first
    s.release(late)
    assert s.admit() == [greedy[1]]


def test_the_prefill_budget_counts_only_the_tokens_a_prompt_computes() -> None:
    """Two 60-token prompts would need two 64-token rows (over the budget of 64); whose K/V a
    slot holds already, they run one token each and are admitted together."""
    s = sched(max_batch=4, max_queue=8, max_prefill_tokens=64)
    first = make(0, n_prompt=60)
    s.enqueue([first])
    assert s.admit() == [first]
    slot = first.slot
    s.prefixes.hold(slot, first.prompt)  # what the engine records after its prompt pass
    s.release(first)
    again = [make(i, n_prompt=60) for i in (1, 2)]
    for r in again:
        s.enqueue([r])
    assert s.admit() == again
    assert again[0].reuse == Reuse(slot, 59)  # in place
    assert again[1].reuse.length == 59 and again[1].reuse.source == slot  # copied from it


def test_a_request_sharing_a_prefix_with_one_admitted_waits_for_its_prompt_pass() -> None:
    """Three requests arrive together, two with the same 40-token system prompt: the second
    waits a turn (the one behind it, sharing nothing, goes ahead) and then copies the prefix
    the first one's prompt pass wrote instead of computing it in the same pass."""
    s = sched(max_batch=4, max_queue=8)
    system = list(range(100, 140))
    first, second, other = make(0), make(1), make(2)
    first.prompt, second.prompt, other.prompt = [*system, 1, 2], [*system, 3], [7, 8, 9]
    for r in (first, second, other):
        s.enqueue([r])
    assert s.admit() == [first, other]
    assert list(s.waiting) == [second]
    s.prefixes.hold(first.slot, first.prompt)  # what the engine records after the pass
    s.prefixes.hold(other.slot, other.prompt)
    assert s.admit() == [second]
    assert second.reuse == Reuse(second.slot, len(system), first.slot)


def test_without_the_prefix_cache_requests_sharing_a_prefix_are_admitted_together() -> None:
    s = Scheduler(
        max_batch=4,
        max_queue=8,
        max_seq_len=256,
        max_prefill_tokens=4096,
        batch_buckets=pow2_buckets(1, 4),
        seq_buckets=pow2_buckets(64, 256),
        prefix_cache=False,
    )
    reqs = [make(i, n_prompt=40) for i in range(3)]
    for r in reqs:
        s.enqueue([r])
    assert s.admit() == reqs


def test_a_request_waits_for_another_prompt_pass_once_only() -> None:
    """Where the slot it waited for was taken in the meantime, it computes the prefix itself
    rather than wait for the next request that shares it."""
    s = sched(max_batch=4, max_queue=8)
    system = list(range(100, 140))
    first, second, third = make(0), make(1), make(2)
    first.prompt, second.prompt, third.prompt = [*system, 1], [*system, 2], [*system, 3]
    for r in (first, second):
        s.enqueue([r])
    assert s.admit() == [first]
    s.release(first)  # it ended (or failed) before its prompt pass wrote anything
    s.enqueue([third])
    assert s.admit() == [second]  # no second wait, though third is new and shares it too
    assert second.reuse.length == 0
    assert list(s.waiting) == [third]  # third waits for second's pass: its first wait


def test_a_request_that_ended_normally_leaves_its_answer_to_refresh() -> None:
    s = sched(max_batch=2, max_seq_len=64)
    done, failed = make(0, n_prompt=4), make(1, n_prompt=4)
    for r in (done, failed):
        s.enqueue([r])
    assert s.admit() == [done, failed]
    for r in (done, failed):
        s.prefixes.hold(r.slot, r.prompt)
    done.output = list(range(100, 170))  # past the context: only 64 tokens fit the slot
    failed.output = [7, 8]
    slot = done.slot
    s.release(done, answered=True)
    s.release(failed)
    assert s.refresh(100) == (slot, 4, list(range(100, 160)))


def test_slots_beyond_the_batch_keep_prompts_but_never_run_more_than_the_batch() -> None:
    """Two running at most, four slots: four distinct prompts run two by two and stay held, so
    each one sent again reuses its whole prefix; a batch's worth of slots would hold only the
    last two."""
    s = sched(max_batch=2, kv_slots=4, max_queue=8)
    prompts = [[10 * i + t for t in range(40)] for i in range(1, 5)]
    slots = []
    for pair in (prompts[:2], prompts[2:]):
        reqs = [make(i) for i in range(2)]
        for r, prompt in zip(reqs, pair, strict=True):
            r.prompt = prompt
            s.enqueue([r])
        late = make(9)
        s.enqueue([late])
        assert s.admit() == reqs and len(s.running) == 2  # the third waits: the batch is full
        s.release(late)
        for r in reqs:
            s.prefixes.hold(r.slot, r.prompt)
            slots.append(r.slot)
            s.release(r)
    assert sorted(slots) == [0, 1, 2, 3]
    for prompt, slot in zip(prompts, slots, strict=True):
        again = make(5)
        again.prompt = prompt
        s.enqueue([again])
        assert s.admit() == [again] and again.reuse == Reuse(slot, 39)
        s.release(again)


def test_without_slots_beyond_the_batch_the_oldest_prompts_are_evicted() -> None:
    s = sched(max_batch=2, max_queue=8)
    prompts = [[10 * i + t for t in range(40)] for i in range(1, 5)]
    for prompt in prompts:
        r = make(0)
        r.prompt = prompt
        s.enqueue([r])
        assert s.admit() == [r]
        s.prefixes.hold(r.slot, r.prompt)
        s.release(r)
    first = make(1)
    first.prompt = prompts[0]
    s.enqueue([first])
    assert s.admit() == [first] and first.reuse.length == 0
