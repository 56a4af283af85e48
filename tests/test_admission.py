"""The async admission queue: FIFO, bounds, timeouts, cancellation, layout changes."""

from __future__ import annotations

import asyncio

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gateway.admission.admission import Admission
from gateway.admission.lease import Lease
from gateway.core.capacity import Charge, Layout
from gateway.errors import BackendNotReady, ContextLengthExceeded, QueueFull, QueueTimeout
from tests.fakes import ManualClock

pytestmark = pytest.mark.anyio

POOL = Layout(slots=4, ctx_per_slot=2048, pool_tokens=2048)
BIG = Charge(790, 900)  # 1690 tokens: only one fits the pool at a time
SMALL = Charge(10, 10)


async def settle() -> None:
    for _ in range(5):
        await asyncio.sleep(0)


def make(layout: Layout | None = POOL, *, max_queue: int = 8, wait: float = 30.0,
         clock: ManualClock | None = None) -> Admission:
    return Admission(layout, max_queue=max_queue, max_wait_s=wait, clock=clock or ManualClock())


async def test_fits_now_is_granted_at_once() -> None:
    adm = make()
    lease = await adm.admit(BIG)
    assert adm.stats().reserved_tokens == 1690 and adm.stats().inflight == 1
    adm.release(lease)
    adm.release(lease)  # idempotent
    assert adm.stats().reserved_tokens == 0 and adm.stats().inflight == 0


async def test_fifo_and_no_overtaking() -> None:
    adm = make()
    first = await adm.admit(BIG)
    order: list[str] = []

    async def go(name: str, charge: Charge) -> Lease:
        lease = await adm.admit(charge)
        order.append(name)
        return lease

    t_big = asyncio.ensure_future(go("big", BIG))
    await settle()
    t_small = asyncio.ensure_future(go("small", SMALL))  # would fit now, but must not overtake
    await settle()
    assert order == [] and adm.stats().queued == 2
    assert adm.try_admit(SMALL) is None  # refuses while others wait
    adm.release(first)
    await settle()
    assert order == ["big", "small"]
    adm.release(await t_big)
    adm.release(await t_small)
    assert adm.stats().reserved_tokens == 0


async def test_queue_full_is_immediate_with_retry_after() -> None:
    adm = make(max_queue=1)
    held = await adm.admit(BIG)
    waiting = asyncio.ensure_future(adm.admit(BIG))
    await settle()
    with pytest.raises(QueueFull) as info:
        await adm.admit(BIG)
    assert 1 <= info.value.retry_after_s <= 60
    waiting.cancel()
    await settle()
    adm.release(held)
    assert adm.stats() .queued == 0 and adm.stats().reserved_tokens == 0


async def test_max_queue_zero_never_waits() -> None:
    adm = make(max_queue=0)
    held = await adm.admit(BIG)
    with pytest.raises(QueueFull):
        await adm.admit(BIG)
    adm.release(held)


async def test_queue_timeout_uses_the_clock() -> None:
    clock = ManualClock()
    adm = make(wait=5.0, clock=clock)
    held = await adm.admit(BIG)
    waiting = asyncio.ensure_future(adm.admit(BIG))
    await settle()
    clock.advance(4.9)
    await settle()
    assert not waiting.done()
    clock.advance(0.2)
    await settle()
    with pytest.raises(QueueTimeout):
        await waiting
    assert adm.stats().queued == 0
    adm.release(held)
    assert adm.stats().reserved_tokens == 0


async def test_cancelled_waiter_leaves_the_queue_and_unblocks_the_next() -> None:
    adm = make()
    held = await adm.admit(Charge(1000, 900))  # 1900 of 2048
    blocked = asyncio.ensure_future(adm.admit(BIG))
    await settle()
    small = asyncio.ensure_future(adm.admit(Charge(50, 50)))  # fits, but waits behind BIG
    await settle()
    assert not small.done()
    blocked.cancel()
    await settle()
    assert small.done()
    adm.release(small.result())
    adm.release(held)
    assert adm.stats() == adm.stats().__class__(0, 0, 0, 0, 2048, 4, 2048, admitted=2,
                                                queue_capacity=8)


async def test_cancel_after_grant_gives_the_lease_back() -> None:
    adm = make()
    held = await adm.admit(BIG)
    waiting = asyncio.ensure_future(adm.admit(BIG))
    await settle()
    adm.release(held)  # grants the waiter's future ...
    waiting.cancel()  # ... but the waiter is cancelled before it resumes
    await settle()
    assert waiting.cancelled()
    assert adm.stats().reserved_tokens == 0 and adm.stats().inflight == 0


async def test_unknown_layout_is_not_ready() -> None:
    adm = make(layout=None)
    with pytest.raises(BackendNotReady):
        await adm.admit(SMALL)


async def test_layout_change_fails_waiters_that_can_never_fit() -> None:
    adm = make()
    held = await adm.admit(BIG)
    waiting = asyncio.ensure_future(adm.admit(BIG))
    await settle()
    adm.set_layout(Layout(4, 1024, pool_tokens=1024))
    await settle()
    with pytest.raises(ContextLengthExceeded):
        await waiting
    adm.release(held)
    assert adm.stats().reserved_tokens == 0


async def test_layout_growth_admits_waiters() -> None:
    adm = make()
    held = await adm.admit(BIG)
    waiting = asyncio.ensure_future(adm.admit(BIG))
    await settle()
    adm.set_layout(Layout(4, 2048, pool_tokens=8192))
    await settle()
    adm.release(await waiting)
    adm.release(held)
    assert adm.stats().reserved_tokens == 0


async def test_retry_after_follows_the_drain_rate() -> None:
    clock = ManualClock()
    adm = make(clock=clock)
    for _ in range(5):  # one release every 4 s
        lease = await adm.admit(BIG)
        clock.advance(4.0)
        adm.release(lease)
    held = await adm.admit(BIG)
    waiters = [asyncio.ensure_future(adm.admit(BIG)) for _ in range(2)]
    await settle()
    assert adm.retry_after_s() == pytest.approx(12.0)  # 3 ahead × 4 s
    for w in waiters:
        w.cancel()
    await settle()
    adm.release(held)


# --- the interleaving property -----------------------------------------------

ops = st.lists(
    st.one_of(
        st.tuples(st.just("arrive"), st.integers(1, 1500), st.integers(1, 1500)),
        st.tuples(st.just("finish"), st.integers(0, 20), st.just(0)),
        st.tuples(st.just("cancel"), st.integers(0, 20), st.just(0)),
        st.tuples(st.just("timeout"), st.just(0), st.just(0)),
    ),
    max_size=40,
)


@settings(max_examples=150, deadline=None)
@given(st.sampled_from([POOL, Layout(3, 2048), Layout(1, 512)]), st.integers(0, 4), ops)
def test_any_interleaving_keeps_the_budget_within_capacity(
    layout: Layout, max_queue: int, script: list[tuple[str, int, int]]
) -> None:
    async def run() -> None:
        clock = ManualClock()
        adm = Admission(layout, max_queue=max_queue, max_wait_s=10.0, clock=clock)
        tasks: list[asyncio.Task[Lease]] = []

        def check() -> None:
            s = adm.stats()
            assert s.reserved_tokens <= layout.capacity_tokens
            assert s.busy_slots <= layout.slots
            assert s.queued <= max_queue

        for op, a, b in script:
            if op == "arrive":
                prompt = min(a, layout.usable_per_slot - 1)
                cap = min(b, layout.usable_per_slot - prompt)
                tasks.append(asyncio.ensure_future(adm.admit(Charge(prompt, cap))))
            elif op == "finish":
                done = [t for t in tasks if t.done() and not t.cancelled()
                        and t.exception() is None and not t.result().released]
                if done:
                    adm.release(done[a % len(done)].result())
            elif op == "cancel":
                if tasks:
                    tasks[a % len(tasks)].cancel()
            else:
                clock.advance(10.0)
            await settle()
            check()
        for t in tasks:
            t.cancel()
        await settle()
        for t in tasks:
            if t.done() and not t.cancelled() and t.exception() is None:
                adm.release(t.result())
        s = adm.stats()
        assert (s.reserved_tokens, s.busy_slots, s.inflight, s.queued) == (0, 0, 0, 0)

    asyncio.run(run())


async def _with_history(adm: Admission, clock: ManualClock, charge: Charge) -> None:
    """Serve 8 leases of ``charge``, each held one second."""
    for _ in range(8):
        lease = await adm.admit(charge)
        clock.advance(1.0)
        adm.record_duration(1.0, charge)
        adm.release(lease)


async def test_the_wait_is_predicted_by_replaying_the_queue() -> None:
    from gateway.errors import QueueWaitPredicted

    clock = ManualClock()
    layout = Layout(slots=2, ctx_per_slot=1024, pool_tokens=1024)
    half = Charge(250, 250)  # 500 tokens: two fit the pool
    adm = Admission(layout, max_queue=8, max_wait_s=1.5, clock=clock, reject_doomed=True)
    assert adm.predict_wait_s(half) is None  # no history yet
    await _with_history(adm, clock, half)  # leases are held 1 s
    held = [await adm.admit(half), await adm.admit(half)]
    clock.advance(0.25)
    assert adm.predict_wait_s(half) == pytest.approx(0.75)  # the first end, 1 s after grant
    queued = [asyncio.ensure_future(adm.admit(half)) for _ in range(2)]
    await settle()
    # The two ahead start when the held ones end (0.75 s), this one when they end (1.75 s).
    assert adm.predict_wait_s(half) == pytest.approx(1.75)
    with pytest.raises(QueueWaitPredicted) as info:
        await adm.admit(half)
    assert info.value.retry_after_s == pytest.approx(1.75)
    assert adm.predict_wait_s(Charge(2000, 100)) is None  # can never fit
    clock.advance(0.75)
    adm.release(held[0])
    await settle()
    granted = await queued[0]
    assert granted.predicted_wait_s == pytest.approx(0.75)
    assert granted.waited_s == pytest.approx(0.75)
    for lease in [held[1], granted]:
        adm.release(lease)
    adm.release(await queued[1])


async def test_without_the_option_a_doomed_request_still_queues() -> None:
    clock = ManualClock()
    adm = Admission(Layout(1, 1024), max_queue=8, max_wait_s=0.5, clock=clock)  # no reject
    await _with_history(adm, clock, SMALL)
    held = await adm.admit(SMALL)
    waiting = asyncio.ensure_future(adm.admit(SMALL))
    await settle()
    assert not waiting.done()
    adm.release(held)
    adm.release(await waiting)


async def test_the_prediction_scales_with_the_cap_and_skips_waiters_that_time_out() -> None:
    clock = ManualClock()
    adm = Admission(Layout(1, 4096), max_queue=8, max_wait_s=10.0, clock=clock,
                    reject_doomed=True)
    await _with_history(adm, clock, Charge(10, 1000))  # 1 ms per token of cap
    held = await adm.admit(Charge(10, 1000))  # ends in 1 s
    assert adm.predict_wait_s(Charge(10, 5)) == pytest.approx(1.0)
    clock.advance(0.5)
    # A short request queued behind it holds 5 ms, not the long ones' second.
    short = asyncio.ensure_future(adm.admit(Charge(10, 5)))
    await settle()
    assert adm.predict_wait_s(Charge(10, 5)) == pytest.approx(0.505)
    adm.__dict__["_reject_doomed"] = False
    late = asyncio.ensure_future(adm.admit(Charge(10, 4000)))  # holds 4 s once started
    await settle()
    assert adm.predict_wait_s(Charge(10, 5)) == pytest.approx(4.505)
    # Waiters replayed to start after their own deadline leave, holding nothing.
    adm.__dict__["_max_wait_s"] = 0.2
    assert adm.predict_wait_s(Charge(10, 5)) == pytest.approx(0.5)
    for task in (short, late):
        task.cancel()
    await asyncio.gather(short, late, return_exceptions=True)
    adm.release(held)
