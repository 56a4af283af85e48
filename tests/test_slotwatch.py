"""Abandoned requests keep their reservation until llama-server's /slots shows them ended.

The decision (:func:`where_is`) is tested on plain values; the loop over a fake upstream
whose slots can be made to linger after the gateway closes the connection, as
llama-server's do (issue 15: 18–23 s for a non-streamed request under load).
"""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from gateway.admission.slotwatch import (
    POLL_INTERVAL_S,
    Seen,
    SlotView,
    Ticket,
    idle_for,
    parse_slots,
    where_is,
)
from tests.conftest import Harness
from tests.fakes import ManualClock
from tests.test_proxy_asgi import AsgiCall, chat

pytestmark = pytest.mark.anyio


def ticket(slot: int | None = 1, tag: tuple[str, int] | None = ("n_discard", 77),
           n_predict: int = 970, tasks: int = 1) -> Ticket:
    return Ticket(slot=slot, tasks=tasks, tag=tag, n_predict=n_predict, since=0.0)


def view(i: int, processing: bool, n_discard: int | None = 77, n_predict: int | None = 970,
         seed: int | None = None) -> SlotView:
    params = {"n_predict": n_predict, "n_discard": n_discard, "seed": seed}
    return SlotView(id=i, processing=processing,
                    params=tuple((k, v) for k, v in params.items() if v is not None))


def test_pinned_request_running_then_finished() -> None:
    t = ticket()
    assert where_is(t, [view(0, True, 5), view(1, True)]) is Seen.running
    assert where_is(t, [view(0, True, 5), view(1, False)]) is Seen.finished


def test_pinned_slot_showing_another_task_is_unseen() -> None:
    # The request has not reached the slot yet (queued inside llama-server), whether the
    # slot is idle with its previous task or busy with one that is not ours.
    assert where_is(ticket(), [view(1, False, 3)]) is Seen.unseen
    assert where_is(ticket(), [view(1, True, 3)]) is Seen.unseen
    assert where_is(ticket(), [view(1, False, n_predict=12)]) is Seen.unseen


def test_a_seed_tag_is_matched_like_n_discard() -> None:
    t = ticket(tag=("seed", 1234))
    assert where_is(t, [view(1, True, seed=1234)]) is Seen.running
    assert where_is(t, [view(1, False, seed=1234)]) is Seen.finished
    assert where_is(t, [view(1, False, seed=7)]) is Seen.unseen


def test_untagged_request_must_be_seen_running_before_it_counts_as_finished() -> None:
    # The adversarial case: the slot's previous task had the same cap (and the client's
    # seed); an idle slot then says nothing about whether this request has started.
    t = ticket(tag=None)
    assert where_is(t, [view(1, False)]) is Seen.unseen
    assert where_is(t, [view(1, True)]) is Seen.running
    assert where_is(t, [view(1, False)], seen_running=True) is Seen.finished
    assert where_is(t, [view(1, True, n_predict=5)]) is Seen.unseen


def test_pinned_slot_gone_after_a_restart_is_finished() -> None:
    assert where_is(ticket(slot=3), [view(0, False), view(1, False)]) is Seen.finished


def test_batches_need_every_task_seen_ended() -> None:
    t = ticket(slot=None, tasks=2)
    assert where_is(t, [view(0, False), view(2, True)]) is Seen.running
    assert where_is(t, [view(0, False), view(2, False, 1)]) is Seen.unseen
    assert where_is(t, [view(0, False), view(2, False)]) is Seen.finished


def test_parse_slots_reads_llama_server_shape() -> None:
    data = [{"id": 0, "n_ctx": 2048, "is_processing": True, "id_task": 9,
             "params": {"seed": 4294967295, "n_predict": -1, "n_discard": 0,
                        "temperature": 0.8}},
            {"id": 1, "n_ctx": 2048, "is_processing": False}]
    assert parse_slots(data) == [view(0, True, 0, -1, 4294967295),
                                 SlotView(id=1, processing=False)]
    for bad in ({"slots": []}, [{"id": "0"}], ["x"]):
        with pytest.raises(ValueError):
            parse_slots(bad)


async def settle() -> None:
    for _ in range(20):
        await asyncio.sleep(0)


async def tick(clock: ManualClock, seconds: float = POLL_INTERVAL_S, times: int = 1) -> None:
    for _ in range(times):
        clock.advance(seconds)
        await settle()


def reserved(h: Harness) -> float:
    return h.sample("gateway_kv_reserved_tokens", backend="local")


async def abandon(h: Harness, **body: Any) -> None:
    """Send a request, wait until the fake runs it, then drop the client."""
    call = AsgiCall(h, chat(**body))
    task = asyncio.ensure_future(call.run())
    for _ in range(100):
        await settle()
        if h.fake.active:
            break
    assert h.fake.active == 1
    call.gone.set()
    await asyncio.wait_for(task, 2)


async def test_abandoned_request_holds_until_its_slot_is_seen_free(
    harness_factory: Any, fake: Any
) -> None:
    clock = ManualClock()
    h = await harness_factory({"disconnect_grace_s": 0.5}, clock=clock)
    fake.hold, fake.linger = asyncio.Event(), asyncio.Event()
    await abandon(h, stream=False, max_tokens=970)
    sent = fake.generations[-1]
    assert sent["id_slot"] == 0 and isinstance(sent["n_discard"], int) and "seed" not in sent
    assert fake.slot_state[0]["processing"]  # the backend goes on after the client left
    await tick(clock, times=10)  # 15 s: far past any fixed grace
    assert reserved(h) > 0 and h.backend.slot_watch.waiting == 1
    assert h.sample("gateway_abandoned_reservations", backend="local") == 1
    fake.linger.set()  # the backend notices and frees the slot
    await settle()
    await tick(clock)
    assert reserved(h) == 0 and h.backend.slot_watch.waiting == 0
    assert h.backend.admission.held_slots == frozenset()


async def test_next_request_is_pinned_to_another_slot_while_one_is_held(
    harness_factory: Any, fake: Any
) -> None:
    clock = ManualClock()
    h = await harness_factory(clock=clock)
    fake.hold, fake.linger = asyncio.Event(), asyncio.Event()
    await abandon(h, stream=False, max_tokens=100)
    fake.hold = None
    r = await h.chat("next", max_tokens=10)
    assert r.status_code == 200
    assert fake.generations[-1]["id_slot"] == 1


async def test_backend_without_slots_falls_back_to_the_grace(
    harness_factory: Any, fake: Any
) -> None:
    clock = ManualClock()
    h = await harness_factory({"disconnect_grace_s": 2.0}, clock=clock)
    fake.hold, fake.slots_route = asyncio.Event(), False
    await abandon(h, stream=False, max_tokens=100)
    await tick(clock)  # the first /slots read says 501
    assert reserved(h) > 0 and not h.backend.slot_watch.supported
    await tick(clock, 1.0)
    assert reserved(h) > 0
    await tick(clock, 1.0)
    assert reserved(h) == 0
    await tick(clock, 60.0)
    assert h.backend.slot_watch.supported  # asked again: it may have been restarted


async def test_request_still_being_prepared_is_held_open_until_it_runs(
    harness_factory: Any, fake: Any
) -> None:
    # llama-server can spend seconds building a grammar from a json_schema before the
    # task exists; meanwhile /slots shows every slot idle. The upstream request stays open
    # (so the backend cannot drop it unseen) and the reservation stays held.
    clock = ManualClock()
    h = await harness_factory(clock=clock)
    fake.prepare, fake.hold = asyncio.Event(), asyncio.Event()
    call = AsgiCall(h, chat(stream=False, max_tokens=900))
    task = asyncio.ensure_future(call.run())
    await settle()
    call.gone.set()
    await asyncio.wait_for(task, 2)
    await tick(clock, times=20)  # 30 s of idle slots
    assert reserved(h) > 0 and fake.active == 0
    fake.prepare.set()  # the task now starts on its slot
    await settle()
    assert fake.active == 1
    await tick(clock)  # seen running: the gateway closes the connection, the fake stops
    assert fake.active == 0 and reserved(h) > 0
    await tick(clock)  # seen ended
    assert reserved(h) == 0


async def test_answer_arriving_before_it_is_seen_releases_at_once(
    harness_factory: Any, fake: Any
) -> None:
    clock = ManualClock()
    h = await harness_factory(clock=clock)
    fake.hold, fake.hide_slots = asyncio.Event(), True
    await abandon(h, stream=False, max_tokens=100)
    await tick(clock, times=3)
    assert reserved(h) > 0
    fake.hold.set()  # the backend finishes and sends the whole answer
    await settle()
    assert reserved(h) == 0


async def test_connection_broken_before_it_was_seen_is_released_once_its_slot_stays_idle(
    harness_factory: Any, fake: Any
) -> None:
    """Found by the adversarial pass: four connections broken in a row (a reset before
    the answer) kept the whole idle pool reserved for the confirm timeout, and every
    request meanwhile waited out its queue wait. Now each is released from the first
    reading begun BROKEN_IDLE_S after the break that shows its slot idle."""
    clock = ManualClock()
    h = await harness_factory({"abandon_confirm_timeout_s": 120.0}, clock=clock)
    fake.mode = "drop"  # the connection breaks; whether the task started is unknown
    for _ in range(4):
        r = await h.chat("x", max_tokens=100)
        assert r.status_code == 502
    assert h.backend.slot_watch.waiting == 4
    await tick(clock, times=6)  # 9 s: a grammar may still be in the making
    assert reserved(h) > 0 and h.backend.slot_watch.waiting == 4
    await tick(clock, times=2)  # the reading begun past 10 s shows the slots idle
    assert reserved(h) == 0 and h.backend.slot_watch.waiting == 0
    fake.mode = "ok"
    assert (await h.chat("y", max_tokens=5)).status_code == 200


def test_an_unseen_request_is_idle_only_where_it_would_run() -> None:
    idle, busy = SlotView(0, False), SlotView(1, True)
    pinned = Ticket(slot=0, tasks=1, tag=("n_discard", 7), n_predict=10, since=0.0)
    assert idle_for(pinned, [idle, busy])  # its own slot idle: nothing of it can wait
    assert not idle_for(Ticket(1, 1, None, 10, 0.0), [idle, busy])  # its slot is busy
    assert not idle_for(Ticket(5, 1, None, 10, 0.0), [idle, busy])  # no such slot
    batch = Ticket(slot=None, tasks=2, tag=("n_discard", 7), n_predict=10, since=0.0)
    assert not idle_for(batch, [idle, busy])  # a batch may wait for any slot
    assert idle_for(batch, [idle, SlotView(1, False)])


async def test_connection_broken_before_it_was_seen_waits_while_its_slot_is_busy(
    harness_factory: Any, fake: Any
) -> None:
    """Its slot busy with another task (the one the request would wait behind), the
    request may still start: held to the confirm timeout."""
    clock = ManualClock()
    h = await harness_factory({"abandon_confirm_timeout_s": 30.0}, clock=clock)
    fake.mode = "drop"
    r = await h.chat("x", max_tokens=100)
    assert r.status_code == 502
    fake.slot_state = {i: {"processing": True, "seed": 1, "n_predict": 5, "n_discard": 0}
                       for i in range(4)}  # every slot processes others' work
    await tick(clock, times=19)  # 28.5 s
    assert reserved(h) > 0
    await tick(clock, times=2)
    assert reserved(h) == 0


async def test_client_id_slot_is_overwritten_and_a_client_seed_kept(
    harness: Harness, fake: Any
) -> None:
    r = await harness.chat("x", max_tokens=5, seed=42, id_slot=3, n_discard=9)
    assert r.status_code == 200
    sent = fake.generations[-1]
    assert sent["id_slot"] == 0 and sent["seed"] == 42 and sent["n_discard"] == 9


async def test_a_client_n_discard_gets_a_seed_tag(harness: Harness, fake: Any) -> None:
    assert (await harness.chat("x", max_tokens=5, n_discard=9)).status_code == 200
    assert isinstance(fake.generations[-1]["seed"], int)


async def test_batches_are_not_pinned(harness: Harness, fake: Any) -> None:
    r = await harness.client.post("/v1/completions", json={"prompt": ["a b", "c d"],
                                                           "max_tokens": 5, "id_slot": 1})
    assert r.status_code == 200
    assert "id_slot" not in fake.generations[-1]


async def test_shutdown_releases_what_is_held(harness_factory: Any, fake: Any) -> None:
    clock = ManualClock()
    h = await harness_factory(clock=clock)
    fake.hold, fake.linger = asyncio.Event(), asyncio.Event()
    await abandon(h, stream=False, max_tokens=100)
    assert reserved(h) > 0
    await h.backend.slot_watch.close()
    assert reserved(h) == 0


async def test_abandoned_batch_is_read_to_its_end_then_released(
    harness_factory: Any, fake: Any
) -> None:
    # Third adversarial pass: llama-server put the batch's tasks on slots of its choosing;
    # later pinned requests overwrote their tags, and the reservation was never released.
    clock = ManualClock()
    h = await harness_factory(clock=clock)
    fake.hold = asyncio.Event()
    call = AsgiCall(h, {"prompt": ["a b", "c d"], "max_tokens": 50, "stream": True},
                    path="/v1/completions")
    task = asyncio.ensure_future(call.run())
    try:
        for _ in range(100):
            await settle()
            if fake.active:
                break
        call.gone.set()
        await settle()
        assert reserved(h) > 0 and fake.closed_streams == 0  # not closed: read to the end
    finally:
        fake.hold.set()
    await asyncio.wait_for(task, 2)
    assert reserved(h) == 0
    assert h.sample("gateway_requests_total", backend="local", route="completions",
                    code="499") == 1


async def test_no_request_is_pinned_while_a_batch_is_in_flight(
    harness_factory: Any, fake: Any
) -> None:
    h = await harness_factory()
    hold = fake.hold = asyncio.Event()
    batch = asyncio.ensure_future(h.client.post("/v1/completions", json={
        "prompt": ["a b", "c d"], "max_tokens": 5, "stream": False}))
    try:
        for _ in range(100):
            await settle()
            if fake.active:
                break
        fake.hold = None
        assert (await h.chat("x", max_tokens=5, stream=False)).status_code == 200
        assert "id_slot" not in fake.generations[-1]
    finally:
        hold.set()
    assert (await batch).status_code == 200
    assert (await h.chat("y", max_tokens=5, stream=False)).status_code == 200
    assert "id_slot" in fake.generations[-1]  # pinned again once the batch is done


def test_extra_completions_get_the_lowest_free_slots() -> None:
    from gateway.admission.admission import Admission
    from gateway.core.capacity import Charge, Layout

    adm = Admission(Layout(4, 2048, pool_tokens=8192), max_queue=4, max_wait_s=30,
                    clock=ManualClock())
    first = adm.try_admit(Charge(10, 10))
    assert first is not None and first.slot_ids == (0,)
    adm.release(first)  # slot 0 is now the most recently used
    pair = adm.try_admit(Charge(10, 10, n=2))
    assert pair is not None and pair.slot_ids == (1, 0)  # LRU first, then lowest free
    assert adm.try_admit(Charge(10, 10, pinnable=False)).slot_ids == ()
    assert adm.try_admit(Charge(10, 10)).slot_ids == ()  # nothing pinned meanwhile


async def test_a_restarted_backend_releases_what_was_held_for_the_old_one(
    harness_factory: Any, fake: Any
) -> None:
    # Fourth adversarial pass: requests that died with the old process kept their
    # reservations against the new, smaller layout.
    clock = ManualClock()
    h = await harness_factory(clock=clock)
    fake.hold, fake.linger = asyncio.Event(), asyncio.Event()
    await abandon(h, stream=False, max_tokens=500)
    await tick(clock, times=2)
    assert reserved(h) > 0
    fake.n_ctx = 1024  # restarted with another layout
    await h.backend.discover()
    assert reserved(h) == 0 and h.backend.slot_watch.waiting == 0


async def test_a_batch_whose_connection_breaks_is_released_at_once(
    harness_factory: Any, fake: Any
) -> None:
    h = await harness_factory()
    fake.mode, fake.tokens = "midstream", 6
    r = await h.client.post("/v1/completions", json={"prompt": ["a b", "c d"],
                                                     "max_tokens": 6, "stream": True})
    assert r.status_code == 200 and '"error"' in r.text
    assert reserved(h) == 0 and h.backend.slot_watch.waiting == 0


async def test_a_later_turn_goes_back_to_its_conversations_slot(harness: Any, fake: Any
                                                                 ) -> None:
    """llama-server keeps each slot's last prompt: a conversation's next turn is pinned
    to the slot that served it (routing.affinity), not the least recently used one."""
    first = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "A?"}]
    for content in ("A?", "B?", "C?"):
        msgs = [first[0], {"role": "user", "content": content}]
        assert (await harness.client.post("/v1/chat/completions", json={
            "messages": msgs, "max_tokens": 5})).status_code == 200
    slots = [g["id_slot"] for g in fake.generations]
    assert slots == [0, 1, 2]
    turn2 = [*first, {"role": "assistant", "content": "a"}, {"role": "user", "content": "more"}]
    assert (await harness.client.post("/v1/chat/completions", json={
        "messages": turn2, "max_tokens": 5})).status_code == 200
    assert fake.generations[-1]["id_slot"] == 0  # LRU would have given slot 3
    other = [{"role": "user", "content": "a new conversation"}]
    assert (await harness.client.post("/v1/chat/completions", json={
        "messages": other, "max_tokens": 5})).status_code == 200
    assert fake.generations[-1]["id_slot"] == 3  # new ones still get the LRU slot


async def test_without_affinity_the_least_recently_used_slot_is_taken(
        harness_factory: Any, fake: Any) -> None:
    h = await harness_factory()
    h.state.settings = h.state.settings.model_copy(update={
        "routing": h.state.settings.routing.model_copy(update={"affinity": False})})
    for _ in range(2):
        assert (await h.chat("same conversation", max_tokens=5)).status_code == 200
    assert [g["id_slot"] for g in fake.generations] == [0, 1]


async def test_a_slot_another_conversation_used_since_is_not_preferred(
        harness_factory: Any, fake: Any) -> None:
    """Slot affinity never does worse than least recently used: when another
    conversation has taken a slot since, its cache is gone, and a turn of the first
    conversation is not sent there (it would evict the second one's prefix too)."""
    fake.slots = 2
    h = await harness_factory(slots=2)

    async def turn(conv: str, n: int) -> int:
        msgs: list[dict[str, str]] = []
        for i in range(n):
            msgs += [{"role": "user", "content": f"{conv} question {i}"},
                     {"role": "assistant", "content": f"{conv} answer {i}"}]
        msgs.append({"role": "user", "content": f"{conv} question {n}"})
        assert (await h.client.post("/v1/chat/completions", json={
            "messages": msgs, "max_tokens": 5})).status_code == 200
        return int(fake.generations[-1]["id_slot"])

    a1, b1 = await turn("A", 0), await turn("B", 0)
    c1 = await turn("C", 0)  # least recently used: A's slot
    assert (a1, b1, c1) == (0, 1, 0)
    a2 = await turn("A", 1)  # A's slot now holds C: not preferred; LRU is B's
    assert a2 == 1
    c2 = await turn("C", 1)  # C's slot still holds C
    assert c2 == 0


async def test_conversations_with_one_opening_spread_over_the_slots(harness: Any, fake: Any
                                                                    ) -> None:
    system = {"role": "system", "content": "You are a helpful assistant."}
    slots = {}
    for conv in range(4):
        assert (await harness.client.post("/v1/chat/completions", json={
            "messages": [system, {"role": "user", "content": "Hi"}],
            "max_tokens": 5})).status_code == 200
        slots[conv] = fake.generations[-1]["id_slot"]
    assert sorted(slots.values()) == [0, 1, 2, 3]  # not all on one slot
    for conv in range(4):  # each second turn goes back where its first turn ran
        assert (await harness.client.post("/v1/chat/completions", json={
            "messages": [system, {"role": "user", "content": "Hi"},
                         {"role": "assistant", "content": "Hello"},
                         {"role": "user", "content": f"question {conv}"}],
            "max_tokens": 5})).status_code == 200
        assert fake.generations[-1]["id_slot"] == slots[conv]


async def test_an_abandoned_answer_is_closed_at_the_first_quick_read(
    harness_factory: Any, fake: Any
) -> None:
    # A whole answer the client left keeps the backend generating for nobody until the
    # read of /slots that sees it running closes it: that read comes after QUICK_POLL_S,
    # not a whole POLL_INTERVAL_S (llama.cpp's test_cancel_request gives the server 2 s).
    from gateway.admission.slotwatch import QUICK_POLL_S

    clock = ManualClock()
    h = await harness_factory(clock=clock)
    fake.hold = asyncio.Event()
    await abandon(h, stream=False, max_tokens=900)
    assert fake.active == 1
    await tick(clock, QUICK_POLL_S)  # seen running: closed, and the fake stops
    assert fake.active == 0 and reserved(h) > 0
    await tick(clock, QUICK_POLL_S)
    await tick(clock)  # seen ended
    assert reserved(h) == 0
