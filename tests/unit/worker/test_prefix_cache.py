"""The prefix cache's slot choice: in place where a free slot holds a prefix of the prompt and
nothing else, the least recently used free slot else (what other slots hold is kept), and a copy
from the slot holding the longest prefix where that is at least `MIN_COPY` tokens more."""

from __future__ import annotations

from neuron_worker.prefix_cache import MIN_COPY, PrefixCache, Reuse

SYSTEM = list(range(100, 140))  # a 40-token shared prefix


def test_a_free_slot_holding_the_prompt_is_reused_in_place_up_to_its_last_token() -> None:
    cache = PrefixCache(4)
    prompt = [*SYSTEM, 7, 8]
    cache.hold(2, prompt)
    assert cache.plan(prompt, [0, 1, 2, 3]) == Reuse(2, len(prompt) - 1)
    # A longer prompt (the conversation's next turn) reuses all of the held one.
    assert cache.plan([*prompt, 9], [0, 1, 2, 3]) == Reuse(2, len(prompt))
    # A shorter one would overwrite the rest: it copies its prefix into an empty slot, or, under
    # MIN_COPY tokens, computes it there.
    assert cache.plan(SYSTEM[:30], [0, 1, 2, 3]) == Reuse(0, 29, 2)
    assert cache.plan(SYSTEM[:10], [0, 1, 2, 3]) == Reuse(0, 0)
    assert cache.plan([5], [0, 1, 2, 3]).length == 0  # a one-token prompt computes it


def served(cache: PrefixCache, slot: int, prompt: list[int]) -> None:
    """A request with `prompt` ran in `slot` and finished."""
    cache.take(prompt, [slot])
    cache.hold(slot, prompt)
    cache.release(slot)


def test_a_prompt_sharing_a_slot_s_prefix_keeps_that_slot_s_own_tokens() -> None:
    """Slot 0 holds the system prompt and its own question: the next question copies the system
    prompt into the slot used least recently instead of overwriting slot 0's question (which a
    repeat of it, or its conversation's next turn, reuses)."""
    cache = PrefixCache(4)
    served(cache, 0, [*SYSTEM, 1])
    served(cache, 1, [*SYSTEM[:20], 99])
    served(cache, 2, [7])
    assert cache.plan([*SYSTEM, 2], [0, 1, 2, 3]) == Reuse(3, len(SYSTEM), 0)  # 3: empty
    assert cache.plan([*SYSTEM, 2], [0, 1, 2]) == Reuse(0, len(SYSTEM))  # 0: used longest ago
    assert cache.plan([*SYSTEM[:20], 5], [1, 2]) == Reuse(1, 20)  # 2 is newer than 1
    # No match anywhere: the slot used longest ago (3 was never used, then 0, 1, 2).
    assert cache.plan([77, 78], [0, 1, 2, 3]) == Reuse(3, 0)
    assert cache.plan([77, 78], [0, 1, 2]) == Reuse(0, 0)
    # Between slots holding a prefix and nothing else, the longest prefix wins.
    served(cache, 3, SYSTEM[:30])
    assert cache.plan([*SYSTEM, 2], [0, 1, 2, 3]) == Reuse(3, 30)


def test_a_prefix_a_running_slot_holds_is_copied_into_a_free_one() -> None:
    cache = PrefixCache(4)
    served(cache, 0, SYSTEM[:5])
    served(cache, 1, [9])
    cache.take([*SYSTEM, 1, 2], [3])  # a running request's slot: not free
    cache.hold(3, [*SYSTEM, 1, 2])
    reuse = cache.plan([*SYSTEM, 5], [0, 1, 2])
    assert reuse == Reuse(0, len(SYSTEM), 3)  # 0 holds a prefix of it: it loses nothing
    # Less than MIN_COPY more than a free slot holds: computed, in that slot.
    served(cache, 0, SYSTEM[: len(SYSTEM) - MIN_COPY + 1])
    assert cache.plan([*SYSTEM, 5], [0, 1, 2]) == Reuse(0, len(SYSTEM) - MIN_COPY + 1)


def test_a_copy_goes_to_a_slot_that_holds_only_a_prefix_of_the_prompt() -> None:
    """Slot 0 holds the prompt's first 20 tokens and nothing else, slot 1 (used longest ago)
    another prompt, slot 2 (running) the prompt's first 40: the copy overwrites slot 0, which
    loses nothing to it, and slot 1 keeps its prompt."""
    cache = PrefixCache(3)
    served(cache, 1, [7, 8, 9])
    served(cache, 0, SYSTEM[:20])
    cache.take([*SYSTEM, 1], [2])
    cache.hold(2, [*SYSTEM, 1])
    assert cache.plan([*SYSTEM, 5], [0, 1]) == Reuse(0, len(SYSTEM), 2)


def test_taking_a_slot_keeps_only_what_it_holds_of_the_new_prompt() -> None:
    cache = PrefixCache(1)
    cache.hold(0, [*SYSTEM, 1, 2, 3])
    reuse = cache.take([*SYSTEM, 4], [0])
    assert reuse == Reuse(0, len(SYSTEM))
    assert cache.held(0) == SYSTEM  # until the prompt pass writes the rest
    cache.hold(0, [*SYSTEM, 4])
    assert cache.plan([*SYSTEM, 4, 5], [0]) == Reuse(0, len(SYSTEM) + 1)


def test_disabled_it_holds_nothing() -> None:
    cache = PrefixCache(2, enabled=False)
    cache.hold(0, [*SYSTEM, 1])
    assert cache.held(0) == []
    assert cache.plan([*SYSTEM, 1], [0, 1]) == Reuse(0, 0)


def test_a_prompt_cached_under_another_salt_is_neither_reused_nor_copied() -> None:
    cache = PrefixCache(3)
    cache.take([*SYSTEM, 1], [0], salt="tenant-a")
    cache.hold(0, [*SYSTEM, 1])
    cache.release(0)
    cache.take([*SYSTEM, 2], [1], salt="tenant-a")  # running, holds SYSTEM too
    cache.hold(1, [*SYSTEM, 2])
    assert cache.plan([*SYSTEM, 3], [0, 2], salt="tenant-b") == Reuse(2, 0)
    assert cache.plan([*SYSTEM, 3], [0, 2]) == Reuse(2, 0)  # no salt is a salt of its own
    assert cache.plan([*SYSTEM, 3], [0, 2], salt="tenant-a") == Reuse(2, len(SYSTEM), 0)
    # Taken by another tenant, slot 0 is that tenant's: only the running slot 1 serves a.
    cache.take([*SYSTEM, 4], [0], salt="tenant-b")
    assert cache.plan([*SYSTEM, 1], [0, 2], salt="tenant-a") == Reuse(2, len(SYSTEM), 1)


def test_a_request_waits_for_a_prompt_pass_that_writes_more_of_its_prefix() -> None:
    cache = PrefixCache(4)
    coming = [([*SYSTEM, 1], "")]  # admitted this turn, its prompt pass not run yet
    assert cache.worth_waiting([*SYSTEM, 2], "", 0, coming)
    # What the pass adds to what the request reuses anyway must reach MIN_COPY.
    assert cache.worth_waiting([*SYSTEM, 2], "", len(SYSTEM) - MIN_COPY, coming)
    assert not cache.worth_waiting([*SYSTEM, 2], "", len(SYSTEM) - MIN_COPY + 1, coming)
    assert not cache.worth_waiting([*SYSTEM[: MIN_COPY - 1], 2], "", 0, coming)
    # Its own last token always runs: a prompt equal to the coming one shares all but that.
    assert cache.worth_waiting([*SYSTEM, 1], "", 0, coming)
    assert not cache.worth_waiting(SYSTEM[:MIN_COPY], "", 0, coming)
    assert not cache.worth_waiting([*SYSTEM, 2], "", 0, [])


def test_nothing_waits_across_salts_or_disabled() -> None:
    coming = [([*SYSTEM, 1], "tenant-a")]
    assert PrefixCache(4).worth_waiting([*SYSTEM, 2], "tenant-a", 0, coming)
    assert not PrefixCache(4).worth_waiting([*SYSTEM, 2], "tenant-b", 0, coming)
    assert not PrefixCache(4, enabled=False).worth_waiting([*SYSTEM, 2], "tenant-a", 0, coming)


def test_a_finished_answer_is_refreshed_in_chunks_most_recent_slot_first() -> None:
    cache = PrefixCache(3)
    for slot, prompt in ((0, [1, 2, 3]), (1, [4, 5])):
        cache.take(prompt, [slot])
        cache.hold(slot, prompt)
    cache.release(0, [1, 2, 3, 10, 11, 12, 13, 14])
    cache.release(1, [4, 5, 20])
    assert cache.refresh([0, 1, 2], 4) == (1, 2, [20])  # freed last
    cache.refreshed(1, 1)
    assert cache.refresh([0, 1, 2], 4) == (0, 3, [10, 11, 12, 13])
    cache.refreshed(0, 4)
    assert cache.refresh([1, 2], 4) is None  # slot 0 is no longer free
    assert cache.refresh([0, 1, 2], 4) == (0, 7, [14])
    cache.refreshed(0, 1)
    assert cache.refresh([0, 1, 2], 4) is None
    # The whole exchange is held: a next turn reuses it.
    assert cache.plan([1, 2, 3, 10, 11, 12, 13, 14, 30, 31], [0, 1, 2]) == Reuse(0, 8)


def test_no_refresh_once_the_slot_is_taken_without_an_answer_or_disabled() -> None:
    cache = PrefixCache(2)
    cache.take([1, 2], [0])
    cache.hold(0, [1, 2])
    cache.release(0, [1, 2, 3, 4])
    assert cache.refresh([0, 1], 0) is None  # limit 0: never
    cache.take([1, 2, 9], [0, 1])  # a new request in slot 0: its old answer is gone
    assert cache.refresh([1], 8) is None
    cache.take([5], [1])
    cache.hold(1, [5])
    cache.release(1)  # aborted or failed: no answer
    assert cache.refresh([0, 1], 8) is None
    off = PrefixCache(2, enabled=False)
    off.release(0, [1, 2, 3])
    assert off.refresh([0, 1], 8) is None
