"""The pure slot map (free, LRU, pinning) and the slot affinity index."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from gateway.core.prefix import Prefix
from gateway.core.slots import PromptIndex, SlotMap


def test_a_new_map_gives_slots_in_index_order_then_least_recently_used() -> None:
    slots = SlotMap(3)
    assert slots.free == (0, 1, 2)
    first, second = slots.pick(True, 1), slots.pick(True, 1)
    assert (first, second) == ((0,), (1,))
    slots.release(second)
    slots.release(first)  # 1 then 0 given back: 2 (never used) is the least recent
    assert slots.free == (2, 1, 0)
    assert slots.pick(True, 1) == (2,)
    assert slots.last_released(0) > slots.last_released(1) > slots.last_released(2) == -1


def test_the_preferred_slot_is_taken_when_free_and_extra_completions_take_the_lowest() -> None:
    slots = SlotMap(4)
    assert slots.pick(True, 1, prefer=2) == (2,)
    assert slots.pick(True, 1, prefer=2) == (0,)  # held: the LRU one instead
    assert slots.pick(True, 2) == (1, 3)  # n = 2: the LRU first, then the lowest free
    assert slots.held == frozenset({0, 1, 2, 3}) and slots.free == ()


def test_unpinned_leases_stop_pinning_until_they_are_all_back() -> None:
    slots = SlotMap(4)
    assert slots.pick(False, 1) == ()  # a batch is never pinned
    assert slots.unpinned == 1
    assert slots.pick(True, 1) == ()  # nor anything while it is in flight
    slots.release(())
    slots.release(())
    assert slots.unpinned == 0
    assert slots.pick(True, 1) == (0,)


def test_no_free_slot_means_unpinned() -> None:
    slots = SlotMap(1)
    assert slots.pick(True, 1) == (0,)
    assert slots.pick(True, 1) == ()
    assert slots.unpinned == 1


def test_a_layout_change_keeps_held_slots_held_and_drops_missing_ones() -> None:
    slots = SlotMap(4)
    held = slots.pick(True, 1, prefer=3)
    slots.resize(2)
    assert slots.free == (0, 1) and not slots.is_free(3)
    slots.release(held)  # past the new layout: not free again
    assert slots.free == (0, 1) and slots.held == frozenset()
    slots.resize(5)
    assert slots.free == (0, 1, 2, 3, 4)
    assert slots.is_free(4) and not slots.is_free(5)


@settings(max_examples=200, deadline=None)
@given(st.integers(0, 6), st.lists(st.tuples(st.booleans(), st.integers(1, 3),
                                             st.one_of(st.none(), st.integers(0, 7)),
                                             st.booleans()), max_size=30))
def test_a_held_slot_is_never_handed_out_and_releasing_all_restores_the_free_set(
        count: int, steps: list[tuple[bool, int, int | None, bool]]) -> None:
    slots = SlotMap(count)
    out: list[tuple[int, ...]] = []
    for pinnable, n, prefer, give_back in steps:
        if give_back and out:
            slots.release(out.pop(0))
            continue
        before = slots.held
        got = slots.pick(pinnable, n, prefer)
        assert not set(got) & before  # never one already held
        assert len(set(got)) == len(got) <= n
        assert all(0 <= s < count for s in got)
        out.append(got)
        assert set(slots.free).isdisjoint(slots.held)
    for got in out:
        slots.release(got)
    assert sorted(slots.free) == list(range(count))
    assert slots.held == frozenset() and slots.unpinned == 0


def test_the_prompt_index_finds_the_free_slot_a_request_continues() -> None:
    slots, index = SlotMap(3), PromptIndex()
    opening, turn = Prefix(("sys", "q1")), Prefix(("sys", "q1", "a1", "q2"))
    index.remember(1, opening)
    assert index.slot_for(turn, slots) == 1
    assert index.slot_for(opening, slots) is None  # the same prompt does not extend it
    assert index.slot_for(None, slots) is None
    held = slots.pick(True, 1, prefer=1)
    assert index.slot_for(turn, slots) is None  # not free
    slots.release(held)
    index.remember(1, Prefix(("other",)))  # another conversation used it since
    assert index.slot_for(turn, slots) is None


def test_the_prompt_index_prefers_the_longest_prefix_then_the_least_recently_used() -> None:
    slots, index = SlotMap(4), PromptIndex()
    for slot in (0, 1, 2):
        slots.release(slots.pick(True, 1, prefer=slot))  # released in the order 0, 1, 2
    index.remember(2, Prefix(("sys",)))
    index.remember(1, Prefix(("sys", "q1")))
    index.remember(0, Prefix(("sys", "q1")))
    turn = Prefix(("sys", "q1", "a1"))
    assert index.slot_for(turn, slots) == 0  # longest match; 0 freed before 1
    index.remember(0, None)  # unknown now
    assert index.slot_for(turn, slots) == 1
    index.remember(1, None)
    assert index.slot_for(turn, slots) == 2
