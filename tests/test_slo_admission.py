"""Latency targets in admission (gateway.admission.slo): the SLO limit learnt from ITL
samples holds requests in the queue below the memory limit while a lease with a target
is in flight, and a request whose predicted TTFT misses its deadline is refused at
arrival (503 slo_unattainable)."""

from __future__ import annotations

import asyncio

import pytest

from gateway.admission.admission import Admission
from gateway.admission.lease import Lease
from gateway.admission.slo import FIRST_SAMPLES, TARGET_MEMORY_S
from gateway.core.capacity import Charge, Layout
from gateway.core.fairness import Party
from gateway.errors import QueueWaitPredicted, SloUnattainable
from tests.fakes import ManualClock

LAYOUT = Layout(slots=4, ctx_per_slot=4096, pool_tokens=16384)
CHAT = Party(priority="chat", itl_target_s=0.025, ttft_target_s=1.0)


def _admission(clock: ManualClock, *, known: int = 3) -> Admission:
    """An admission whose latency model already knows levels 1 to ``known`` to hold
    CHAT's target (5 ms a token): the slow start lets ``known + 1`` streams in."""
    adm = Admission(LAYOUT, max_queue=16, max_wait_s=60.0, clock=clock)
    for level in range(1, known + 1):
        for _ in range(adm.slo.params.min_samples):
            adm.slo.model.observe_itl(0.005, level)
    return adm


def _feed(adm: Admission, clock: ManualClock, per_stream_s: float, samples: int) -> None:
    """ITL samples from a backend whose decode step costs ``per_stream_s`` per busy slot,
    at the busy count of the leases in flight."""
    for _ in range(samples):
        clock.advance(0.01)
        adm.slo.observe_itl(per_stream_s * adm.slo.busy(), adm.layout)


async def _settle() -> None:
    for _ in range(5):
        await asyncio.sleep(0)


def _grant(adm: Admission, party: Party = CHAT) -> Lease:
    lease = adm.try_admit(Charge(100, 100), party=party)
    assert lease is not None
    adm.slo.set_itl_target(lease, party.itl_target_s)  # as the relay does when an attempt starts
    return lease


async def test_the_limit_holds_requests_below_memory_while_a_target_is_in_flight() -> None:
    clock = ManualClock()
    adm = _admission(clock)
    leases = [_grant(adm) for _ in range(4)]  # memory takes all four
    _feed(adm, clock, 0.01, 120)  # 40 ms at 4 busy: over the 25 ms target
    assert adm.slo.limit == 3
    adm.release(leases.pop())
    _feed(adm, clock, 0.01, 120)  # 30 ms at 3 busy: still over
    assert adm.slo.limit == 2
    # Memory has room for two more, the SLO limit for none: they wait, in order.
    assert adm.try_admit(Charge(100, 100), party=CHAT) is None
    first = asyncio.ensure_future(adm.admit(Charge(100, 100), party=CHAT))
    second = asyncio.ensure_future(adm.admit(Charge(100, 100), party=CHAT))
    await _settle()
    assert not first.done() and adm.stats().queued == 2
    adm.release(leases.pop())  # 2 busy: at the limit still
    await _settle()
    assert not first.done()
    adm.release(leases.pop())  # 1 busy: one may go, the first in line
    await _settle()
    assert first.done() and not second.done()
    adm.release(first.result())
    await _settle()
    adm.release(second.result())
    adm.release(leases.pop())
    assert adm.stats().busy_slots == 0 and adm.stats().queued == 0


async def test_the_limit_binds_while_a_target_was_in_flight_recently() -> None:
    """The limit holds a request with a target while one was in flight within
    TARGET_MEMORY_S, even once none is; after that, memory alone decides again."""
    clock = ManualClock()
    adm = _admission(clock)
    leases = [_grant(adm) for _ in range(4)]
    _feed(adm, clock, 0.01, 120)
    assert adm.slo.limit == 3
    adm.release(leases.pop())
    first = asyncio.ensure_future(adm.admit(Charge(100, 100), party=CHAT))
    await _settle()
    assert not first.done()  # memory has room for one; the limit has none
    for lease in leases:
        adm.release(lease)
    await _settle()
    assert first.done()
    adm.release(first.result())
    clock.advance(TARGET_MEMORY_S + 1)
    _feed(adm, clock, 0.01, 1)
    assert adm.slo.limit is None


async def test_a_class_without_a_target_is_held_by_memory_only() -> None:
    """Issue 38: with a tight ITL target in one class, the backend's SLO limit held the
    requests of classes without one too, which the latency docs promise behave as
    before. They are admitted as far as memory allows; the class with the target waits
    for its limit."""
    clock = ManualClock()
    adm = _admission(clock)
    chat = _grant(adm)
    batch = [_grant(adm, Party(priority="batch")) for _ in range(3)]
    _feed(adm, clock, 0.01, 120)
    assert adm.slo.limit == 3
    adm.release(batch.pop())  # 3 busy: at the limit, one slot of memory free
    assert adm.try_admit(Charge(100, 100), party=CHAT) is None  # held by the limit
    bulk = Party(priority="batch")
    first = asyncio.ensure_future(adm.admit(Charge(100, 100), party=bulk))
    second = asyncio.ensure_future(adm.admit(Charge(100, 100), party=bulk))
    await _settle()
    assert first.done() and not second.done()  # the last free slot, then memory holds
    adm.release(chat)
    await _settle()
    assert second.done()
    for lease in [*batch, first.result(), second.result()]:
        adm.release(lease)
    assert adm.stats().busy_slots == 0


def test_an_idle_backend_shows_no_limit_once_its_targets_expired() -> None:
    """No stream runs after the last chat ended, so no step clears the limit: what
    gateway_slo_limit and the status page show follows what admission applies."""
    clock = ManualClock()
    adm = _admission(clock)
    leases = [_grant(adm) for _ in range(4)]
    _feed(adm, clock, 0.01, 120)
    assert adm.slo.limit == 3 and adm.slo.binds(4) and adm.slo.in_force(4) == 3
    for lease in leases:
        adm.release(lease)
    clock.advance(TARGET_MEMORY_S / 2)  # the chat users were here a moment ago
    assert adm.slo.binds(4) and adm.slo.in_force(4) == 3
    # a layout that shrank to the limit is bounded by memory, not by the limit
    assert not adm.slo.binds(3) and adm.slo.in_force(3) == 3
    clock.advance(TARGET_MEMORY_S)  # gone: admission takes four again
    assert adm.slo.limited(adm.layout) is adm.layout
    assert adm.slo.limit == 3  # (left from the last step)
    assert not adm.slo.binds(4) and adm.slo.in_force(4) == 4


async def test_without_targets_samples_are_learnt_and_nothing_is_held() -> None:
    clock = ManualClock()
    adm = _admission(clock)
    leases = [_grant(adm, Party()) for _ in range(3)]
    _feed(adm, clock, 0.05, 200)
    assert adm.slo.limit is None and adm.slo.model.itl_p95(3) == pytest.approx(0.15, rel=0.1)
    assert adm.try_admit(Charge(100, 100)) is not None  # the fourth, as memory allows
    for lease in leases:
        adm.release(lease)


async def test_the_limit_rises_again_when_the_backend_is_fast() -> None:
    clock = ManualClock()
    adm = _admission(clock)
    leases = [_grant(adm) for _ in range(4)]
    _feed(adm, clock, 0.01, 120)
    assert adm.slo.limit == 3
    adm.release(leases.pop())
    waiting = asyncio.ensure_future(adm.admit(Charge(100, 100), party=CHAT))
    await _settle()
    assert not waiting.done()
    clock.advance(31)  # the hold on level 4 is over; the backend is fast now
    _feed(adm, clock, 0.002, 120)
    await _settle()
    assert waiting.done(), adm.slo.limit  # the limit rose, and the rise woke the queue
    for lease in [*leases, waiting.result()]:
        adm.release(lease)


def _learn_prefill(adm: Admission, tokens_per_s: float) -> None:
    for _ in range(3):
        adm.slo.observe_prefill(1000, 1000 / tokens_per_s)


async def test_a_request_that_would_start_too_late_is_refused_at_once() -> None:
    clock = ManualClock()
    adm = _admission(clock, known=0)
    prompt = Charge(3000, 100)  # 3 s of prefill at 1,000 tokens/s
    deadline = Party(ttft_deadline_s=1.0)
    first = adm.try_admit(prompt, party=deadline)
    assert first is not None  # nothing learnt yet: nothing is refused on a guess
    adm.release(first)
    _learn_prefill(adm, 1000.0)
    with pytest.raises(SloUnattainable) as refused:
        adm.try_admit(prompt, party=deadline)
    err = refused.value
    assert err.status_code == 503 and err.code == "slo_unattainable"
    assert err.details == {"predicted_ttft_ms": 3000, "deadline_ms": 1000}
    assert err.retry_after_s == pytest.approx(2.0)
    with pytest.raises(SloUnattainable):
        await adm.admit(prompt, party=Party(ttft_target_s=2.0))  # the class's target
    assert adm.stats().queued == 0
    assert adm.try_admit(Charge(500, 100), party=deadline) is not None  # 0.5 s: in time
    assert adm.try_admit(prompt, party=Party(ttft_deadline_s=1.0, serve_late=True))
    assert adm.try_admit(prompt, front=True, party=deadline)  # a resumed one is kept


async def test_the_predicted_wait_counts_towards_the_deadline() -> None:
    clock = ManualClock()
    adm = Admission(Layout(slots=1, ctx_per_slot=4096), max_queue=4, max_wait_s=60.0,
                    clock=clock)
    _learn_prefill(adm, 10_000.0)  # a 1,000-token prompt: 0.1 s
    for _ in range(8):  # served leases of 10 s each: the wait is predicted
        lease = adm.try_admit(Charge(100, 100))
        assert lease is not None
        clock.advance(10.0)
        adm.record_duration(10.0, lease.charge)
        adm.release(lease)
    held = adm.try_admit(Charge(100, 100))
    assert held is not None
    wait = adm.predict_wait_s(Charge(1000, 100))
    assert wait is not None and wait > 2.0
    with pytest.raises(SloUnattainable) as refused:
        await asyncio.wait_for(adm.admit(Charge(1000, 100),
                                         party=Party(ttft_deadline_s=2.0)), 1.0)
    assert refused.value.details["predicted_ttft_ms"] > 2000
    waiting = asyncio.ensure_future(adm.admit(Charge(1000, 100),
                                              party=Party(ttft_deadline_s=60.0)))
    await _settle()
    assert not waiting.done()
    adm.release(held)
    await _settle()
    adm.release(waiting.result())


async def test_a_fresh_gateway_refuses_a_doomed_request_from_the_first_tokens() -> None:
    """No served lease is timed yet, so the old prediction said nothing and a doomed
    request waited its whole max wait. The first stream's tokens give the decode pace
    (30 ms a token here): two 900-token answers hold the one slot for about 27 s each,
    so a third is refused at once with a Retry-After near when it could start. (The
    answers run to their caps, ignore_eos: a pace per token says how long they hold.)"""
    clock = ManualClock()
    adm = Admission(Layout(slots=1, ctx_per_slot=4096), max_queue=4, max_wait_s=6.0,
                    clock=clock, reject_doomed=True)
    first = adm.try_admit(Charge(800, 900, to_cap=True))
    assert first is not None
    second = asyncio.ensure_future(adm.admit(Charge(800, 900, to_cap=True)))
    await _settle()
    assert not second.done()  # nothing learnt: it queues, as before
    second.cancel()
    await asyncio.gather(second, return_exceptions=True)
    for _ in range(FIRST_SAMPLES):
        clock.advance(0.03)
        adm.slo.observe_itl(0.03, adm.layout)
    assert adm.slo.seconds_per_token() == pytest.approx(0.03, rel=0.1)
    with pytest.raises(QueueWaitPredicted) as doomed:
        await asyncio.wait_for(adm.admit(Charge(800, 900, to_cap=True)), 1.0)
    assert 20 <= doomed.value.retry_after_s <= 60  # it could start after about 27 s
    adm.release(first)


async def test_the_wait_prediction_counts_the_slo_limit() -> None:
    """Found trying it on llama-server: under a limit of one, requests that memory would
    take at once were predicted to wait nothing, admitted, and waited past their
    deadline. The replay runs on the limited layout: a request behind the one in flight
    is predicted to wait for its end, and refused when that is past its deadline."""
    clock = ManualClock()
    adm = _admission(clock)
    _learn_prefill(adm, 100_000.0)
    for _ in range(8):  # served leases holding 10 ms per token of cap
        lease = adm.try_admit(Charge(100, 100))
        assert lease is not None
        clock.advance(1.0)
        adm.record_duration(1.0, lease.charge)
        adm.release(lease)
    first = adm.try_admit(Charge(50, 4000), party=CHAT)  # held about 40 s at that pace
    assert first is not None
    adm.slo.set_itl_target(first, CHAT.itl_target_s)
    leases = [first, *(_grant(adm) for _ in range(3))]
    _feed(adm, clock, 0.05, 400)  # every level breaks the 25 ms target: the limit is 1
    for lease in leases[1:]:
        adm.release(lease)
    clock.advance(30.0)  # the holds on the levels above have passed; the limit stays 1
    _feed(adm, clock, 0.05, 60)
    assert adm.slo.limit == 1
    long_one = Charge(100, 900)  # 9 s of cap behind the one in flight
    predicted = adm.predict_wait_s(long_one, CHAT)
    assert predicted is not None and predicted > 0.5
    with pytest.raises(SloUnattainable):
        await asyncio.wait_for(adm.admit(long_one, party=Party(
            priority="chat", itl_target_s=0.025, ttft_deadline_s=0.5)), 1.0)
    adm.release(leases[0])


def test_a_pace_from_whole_answers_or_calibration_stands_in_until_itl_is_learnt() -> None:
    """Whole answers and the calibration teach a pace (by busy slots) that the wait
    prediction uses while no level has FIRST_SAMPLES ITL samples; the learnt ITL wins
    once it has; a nonsense pace is ignored."""
    clock = ManualClock()
    adm = _admission(clock, known=0)
    assert adm.slo.seconds_per_token() is None
    adm.slo.observe_pace(float("nan"))
    adm.slo.observe_pace(-1.0)
    assert adm.slo.seconds_per_token() is None
    adm.slo.calibration_s = 0.1  # a cold server's calibration: the last stand-in
    assert adm.slo.seconds_per_token() == pytest.approx(0.1)
    adm.slo.observe_pace(0.02, level=1)  # an answer's pace replaces it, not averaged
    assert adm.slo.seconds_per_token() == pytest.approx(0.02)
    adm.slo.observe_pace(0.04, level=1)  # the mean of the last and the new one
    assert adm.slo.seconds_per_token() == pytest.approx(0.03)
    adm.slo.observe_pace(0.08, level=4)
    held = [adm.try_admit(Charge(100, 100)) for _ in range(3)]
    assert adm.slo.seconds_per_token() == pytest.approx(0.08)  # 3 busy: the level above
    for _ in range(FIRST_SAMPLES):
        adm.slo.observe_itl(0.05, adm.layout)
    assert adm.slo.seconds_per_token() == pytest.approx(0.05, rel=0.1)
    for lease in held:
        assert lease is not None
        adm.release(lease)


async def test_a_target_starts_slow_on_a_fresh_gateway_burst() -> None:
    """Issue 38: a burst of targeted streams on a fresh gateway ran four at once, a
    level never measured, and made ITL worse than no target. Now one runs first (its
    own class's target holds the burst before any lease carried one), and the limit
    grows one level at a time as each level is learnt to hold the target; a class
    without a target, or a whole answer (whose party carries none), is held by memory
    only."""
    clock = ManualClock()
    adm = _admission(clock, known=0)
    first = _grant(adm)
    assert adm.try_admit(Charge(100, 100), party=CHAT) is None
    whole = adm.try_admit(Charge(100, 100), party=Party(priority="chat"))
    assert whole is not None  # no ITL target: memory alone
    adm.release(whole)
    waiting = [asyncio.ensure_future(adm.admit(Charge(100, 100), party=CHAT))
               for _ in range(3)]
    await _settle()
    assert sum(w.done() for w in waiting) == 0 and adm.slo.binds(4)
    assert adm.slo.in_force(4) == 1
    _feed(adm, clock, 0.005, 60)  # 5 ms a token alone: level 1 holds the 25 ms target
    await _settle()
    assert sum(w.done() for w in waiting) == 1 and adm.slo.limit == 2
    for w in waiting:
        if w.done():
            adm.slo.set_itl_target(w.result(), CHAT.itl_target_s)
    _feed(adm, clock, 0.005, 60)  # 10 ms at two: holds, so three
    await _settle()
    assert sum(w.done() for w in waiting) == 2 and adm.slo.limit == 3
    _feed(adm, clock, 0.01, 120)  # 30 ms at three: over; back to two, nothing more
    await _settle()
    assert sum(w.done() for w in waiting) == 2 and adm.slo.limit == 2
    adm.release(first)
    for w in waiting[:2]:
        adm.release(w.result())
    await _settle()
    assert waiting[2].done()
    adm.release(waiting[2].result())
    assert adm.stats().busy_slots == 0
