"""Prefill deferral (gateway/admission/defer.py, issue 26 item 4): while streams with an
ITL target decode on a backend, a request whose predicted prefill is longer than their
target is held back, for at most ``admission.prefill_defer_s`` and never past its TTFT
slack; in a pool it goes where no targeted stream decodes. The pure rule is
:func:`gateway.core.latency.prefill_hold_s`; the rest runs on a :class:`ManualClock`."""

from __future__ import annotations

import asyncio

import httpx
import pytest
from hypothesis import given
from hypothesis import strategies as st

from gateway.admission.admission import Admission
from gateway.admission.lease import Lease
from gateway.backends.target import Target
from gateway.config import AdmissionSettings, BackendSettings, ConfigError, load_settings
from gateway.core.capacity import Charge, Layout
from gateway.core.fairness import Party
from gateway.core.latency import HOLD_RECHECK_S, prefill_hold_s
from gateway.fleet.pool import Candidate, ModelQueue
from tests.conftest import closed_at_test_end
from tests.fakes import ManualClock

LAYOUT = Layout(slots=4, ctx_per_slot=4096, pool_tokens=16384)
CHAT = Party(priority="chat", itl_target_s=0.05)
LONG = 2000  # prompt tokens: 2 s of prefill at the 1,000 tokens/s learnt below
SHORT = 20  # 20 ms: under the 50 ms target


async def _settle() -> None:
    for _ in range(5):
        await asyncio.sleep(0)


def _learn_rates(adm: Admission, tps: float = 1000.0) -> None:
    for _ in range(3):
        adm.slo.observe_prefill(1000, 1000 / tps)
    for level in range(1, LAYOUT.slots):  # every level known to hold the target (45 ms
        for _ in range(adm.slo.params.min_samples):  # a token): the SLO limit's slow
            adm.slo.model.observe_itl(0.045, level)  # start holds nothing, only deferral


def _streaming(adm: Admission, party: Party = CHAT, left: int = 10) -> Lease:
    """A lease of ``party`` whose stream has its first token (it decodes now), with
    ``left`` tokens of its cap of 100 to go (10: 0.5 s at the 50 ms target's pace)."""
    lease = adm.try_admit(Charge(SHORT, 100), party=party)
    assert lease is not None
    adm.slo.set_itl_target(lease, party.itl_target_s)  # as the relay does when an attempt starts
    adm.observe(lease, 1)
    lease.streamed = 100 - left  # as the relay counts the tokens it relays
    return lease


def _admission(clock: ManualClock, defer_s: float = 2.0) -> Admission:
    adm = Admission(LAYOUT, max_queue=16, max_wait_s=60.0, clock=clock)
    adm.slo.defer.defer_s = defer_s
    _learn_rates(adm)
    closed_at_test_end(adm.close)  # its wakes end with the test
    return adm


# -- the pure rule ----------------------------------------------------------------------

@given(prompt=st.integers(0, 100_000), tps=st.floats(1.0, 1e5),
       target=st.floats(0.001, 2.0), defer=st.floats(0.0, 30.0),
       waited=st.floats(0.0, 60.0), slack=st.none() | st.floats(-10.0, 60.0),
       streams=st.none() | st.floats(0.0, 60.0))
def test_the_hold_is_bounded_and_only_for_a_prefill_over_the_target(
        prompt: int, tps: float, target: float, defer: float, waited: float,
        slack: float | None, streams: float | None) -> None:
    held = prefill_hold_s(prompt_tokens=prompt, prefill_tps=tps, itl_target_s=target,
                          defer_s=defer, waited_s=waited, slack_s=slack,
                          streams_left_s=streams)
    assert 0.0 <= held <= defer
    left = max(0.0, min(defer, defer if slack is None else slack) - waited)
    if prompt / tps <= target or left == 0.0:
        assert held == 0.0
    elif streams is None:
        assert held == pytest.approx(left)
    elif streams > left:
        assert held == 0.0  # the streams would outlast it: holding spares nothing
    else:  # looked at again once they should have ended
        assert held == pytest.approx(min(left, max(streams, HOLD_RECHECK_S)))
    # Waiting longer never lengthens it past its bound.
    later = prefill_hold_s(prompt_tokens=prompt, prefill_tps=tps, itl_target_s=target,
                           defer_s=defer, waited_s=waited + 0.5, slack_s=slack)
    assert later <= max(0.0, left - 0.5) + 1e-9


def test_nothing_is_held_without_a_target_a_rate_or_a_bound() -> None:
    base = {"prompt_tokens": LONG, "prefill_tps": 1000.0, "itl_target_s": 0.05,
            "defer_s": 2.0, "waited_s": 0.0}
    assert prefill_hold_s(**base) == 2.0
    for off in ({"itl_target_s": None}, {"prefill_tps": None}, {"prefill_tps": 0.0},
                {"defer_s": 0.0}, {"prompt_tokens": 0}, {"waited_s": 2.5}):
        assert prefill_hold_s(**{**base, **off}) == 0.0, off


# -- one backend's admission ------------------------------------------------------------

async def test_a_long_prompt_waits_while_a_targeted_stream_decodes_then_goes() -> None:
    clock = ManualClock()
    adm = _admission(clock)
    stream = _streaming(adm)
    held = asyncio.ensure_future(adm.admit(Charge(LONG, 100), party=CHAT))
    await _settle()
    assert not held.done()  # memory has room; the prefill would stall the stream 2 s
    assert adm.slo.defer.deferred == 1
    clock.advance(1.0)
    await _settle()
    assert not held.done()
    clock.advance(1.0)  # its 2 s bound: it goes, stream or not
    await _settle()
    lease = await asyncio.wait_for(held, 1)
    assert lease.waited_s == pytest.approx(2.0)
    assert adm.slo.defer.deferred == 1  # asked again and again, counted once
    adm.release(lease)
    adm.release(stream)


async def test_nothing_is_held_for_streams_that_would_outlast_the_hold() -> None:
    """A stream with 60 tokens of its cap to go (3 s at the target's pace) would still
    decode when a 2 s hold ran out: the long prompt would stall it anyway, so it goes
    at once (measured on llama-server: holding to the bound alone moved the stall and
    made TTFT p95 32–41 % longer)."""
    clock = ManualClock()
    adm = _admission(clock)
    stream = _streaming(adm, left=60)
    lease = adm.try_admit(Charge(LONG, 100), party=CHAT)
    assert lease is not None and adm.slo.defer.deferred == 0
    adm.release(lease)
    stream.streamed = 90  # 10 to go: 0.5 s, within the hold
    assert adm.try_admit(Charge(LONG, 100), party=CHAT) is None
    assert adm.slo.defer.deferred == 1
    adm.release(stream)


async def test_the_hold_ends_when_the_targeted_streams_end() -> None:
    clock = ManualClock()
    adm = _admission(clock)
    stream = _streaming(adm)
    held = asyncio.ensure_future(adm.admit(Charge(LONG, 100), party=CHAT))
    await _settle()
    assert not held.done()
    clock.advance(0.3)
    adm.release(stream)
    lease = await asyncio.wait_for(held, 1)
    assert lease.waited_s == pytest.approx(0.3)
    adm.release(lease)


async def test_what_is_not_held() -> None:
    clock = ManualClock()
    adm = _admission(clock)
    # No stream decodes: a stream granted but still in its own prefill loses nothing.
    quiet = adm.try_admit(Charge(SHORT, 100), party=CHAT)
    assert quiet is not None
    adm.slo.set_itl_target(quiet, CHAT.itl_target_s)
    first = adm.try_admit(Charge(LONG, 100), party=CHAT)
    assert first is not None
    adm.observe(quiet, 1)  # now it decodes
    # A short prompt; one going to a slot that caches its prefix; a stream of a class
    # without a target decoding alone (a fresh admission).
    assert (short := adm.try_admit(Charge(SHORT, 100), party=CHAT)) is not None
    assert (cached := adm.try_admit(Charge(LONG, 100), party=CHAT, prefer=3)) is not None
    assert adm.slo.defer.deferred == 0
    for lease in (quiet, first, short, cached):
        adm.release(lease)
    other = _admission(clock)
    plain = _streaming(other, Party(priority="batch"))
    assert other.try_admit(Charge(LONG, 100)) is not None
    other.release(plain)
    # Off: prefill_defer_s = 0.
    off = _admission(clock, defer_s=0.0)
    _streaming(off)
    assert off.try_admit(Charge(LONG, 100), party=CHAT) is not None


async def test_the_hold_never_passes_the_ttft_slack() -> None:
    clock = ManualClock()
    adm = _admission(clock)
    stream = _streaming(adm)
    # A 3 s deadline, 2 s of it its own prefill: 1 s of slack, under the 2 s bound.
    party = Party(priority="chat", itl_target_s=0.05, ttft_deadline_s=3.0)
    held = asyncio.ensure_future(adm.admit(Charge(LONG, 100), party=party))
    await _settle()
    assert not held.done()
    clock.advance(0.4)
    await _settle()
    assert not held.done()
    clock.advance(0.7)
    lease = await asyncio.wait_for(held, 1)
    assert lease.waited_s < 1.2  # its slack, not the 2 s bound
    adm.release(lease)
    adm.release(stream)


async def test_the_order_is_kept_behind_a_held_request() -> None:
    clock = ManualClock()
    adm = _admission(clock)
    stream = _streaming(adm)
    held = asyncio.ensure_future(adm.admit(Charge(LONG, 100), party=CHAT))
    await _settle()
    behind = asyncio.ensure_future(adm.admit(Charge(SHORT, 100), party=CHAT))
    await _settle()
    assert not held.done() and not behind.done()  # FIFO: it does not pass the head
    adm.release(stream)
    first, second = await asyncio.wait_for(asyncio.gather(held, behind), 1)
    assert first.granted_at <= second.granted_at
    adm.release(first)
    adm.release(second)


async def test_a_request_back_at_the_front_is_not_held() -> None:
    clock = ManualClock()
    adm = _admission(clock)
    stream = _streaming(adm)
    lease = await asyncio.wait_for(adm.admit(Charge(LONG, 100), front=True, party=CHAT), 1)
    assert adm.slo.defer.deferred == 0
    adm.release(lease)
    adm.release(stream)


# -- a pool ---------------------------------------------------------------------------

def _target(clock: ManualClock, name: str) -> Target:
    side = httpx.AsyncClient(transport=httpx.MockTransport(lambda r: httpx.Response(500)))
    target = Target(BackendSettings(name=name, model="m"),
                    AdmissionSettings(max_queue=4, max_queue_wait_s=10.0), side, clock=clock)
    target.admission.set_layout(LAYOUT)
    target.reachable = True
    _learn_rates(target.admission)
    return target


async def test_a_pool_sends_a_long_prompt_where_no_targeted_stream_decodes() -> None:
    clock = ManualClock()
    a, b = _target(clock, "a"), _target(clock, "b")
    assert a.admission.slo.defer.defer_s == 2.0  # admission.prefill_defer_s's default
    queue = ModelQueue([a, b], max_queue=4, max_wait_s=10.0, clock=clock)
    # b has more room (the score would pick it), but a targeted stream decodes there.
    hog = a.admission.try_admit(Charge(3000, 1000))
    assert hog is not None
    stream = _streaming(b.admission)
    got = queue.try_admit([Candidate(a, Charge(LONG, 100), {}),
                           Candidate(b, Charge(LONG, 100), {})], party=CHAT)
    assert got is not None and got[0].backend is a
    a.admission.release(got[1])
    # Streams on both: it waits in the pool's queue for the first to free, or its bound.
    other = _streaming(a.admission)
    waiting = asyncio.ensure_future(queue.admit(
        [Candidate(a, Charge(LONG, 100), {}), Candidate(b, Charge(LONG, 100), {})],
        party=CHAT))
    await _settle()
    assert not waiting.done()
    b.admission.release(stream)
    candidate, lease = await asyncio.wait_for(waiting, 1)
    assert candidate.backend is b
    candidate.backend.admission.release(lease)
    # Held on both until its bound runs out: then the best-scored backend takes it.
    stream = _streaming(b.admission)
    waiting = asyncio.ensure_future(queue.admit(
        [Candidate(a, Charge(LONG, 100), {}), Candidate(b, Charge(LONG, 100), {})],
        party=CHAT))
    await _settle()
    clock.advance(2.0)
    candidate, lease = await asyncio.wait_for(waiting, 1)
    assert lease.waited_s == pytest.approx(2.0)
    for t, held in ((candidate.backend, lease), (a, other), (b, stream), (a, hog)):
        t.admission.release(held)


def test_the_setting_reaches_every_backend() -> None:
    settings = load_settings(admission={"prefill_defer_s": 0.5},
                             backends=[{"name": "x", "url": "http://x:1"}])
    assert settings.admission.prefill_defer_s == 0.5
    side = httpx.AsyncClient()
    target = Target(settings.backends[0], settings.admission, side, clock=ManualClock())
    assert target.admission.slo.defer.defer_s == 0.5
    with pytest.raises(ConfigError, match="prefill_defer_s"):
        load_settings(admission={"prefill_defer_s": -1})


# -- found by the adversarial pass ---------------------------------------------------

async def test_a_pools_failover_is_never_held() -> None:
    """A request coming back to a pool after a backend failed it (front) used to be held
    by fits_now with no party and no wait counted, so for as long as streams decoded,
    blocking the pool's queue behind it."""
    clock = ManualClock()
    a, b = _target(clock, "a"), _target(clock, "b")
    queue = ModelQueue([a, b], max_queue=4, max_wait_s=10.0, clock=clock)
    streams = [_streaming(a.admission), _streaming(b.admission)]
    candidate, lease = await asyncio.wait_for(queue.admit(
        [Candidate(a, Charge(LONG, 100), {}), Candidate(b, Charge(LONG, 100), {})],
        front=True, party=CHAT), 1)
    assert a.admission.slo.defer.deferred == b.admission.slo.defer.deferred == 0
    candidate.backend.admission.release(lease)
    for t, held in zip((a, b), streams, strict=True):
        t.admission.release(held)


async def test_a_hold_ends_before_the_queue_wait_limit() -> None:
    """With max_queue_wait_s (1 s) under prefill_defer_s (2 s), a held request timed out:
    a 503 though memory had room all along. The hold now ends before the limit."""
    clock = ManualClock()
    adm = Admission(LAYOUT, max_queue=16, max_wait_s=1.0, clock=clock)
    adm.slo.defer.defer_s = 2.0
    _learn_rates(adm)
    stream = _streaming(adm)
    held = asyncio.ensure_future(adm.admit(Charge(LONG, 100), party=CHAT))
    await _settle()
    assert not held.done()
    for _ in range(11):
        clock.advance(0.1)
        await _settle()
    lease = await asyncio.wait_for(held, 1)  # a lease, not QueueTimeout
    assert lease.waited_s < 1.0
    adm.release(lease)
    adm.release(stream)


async def test_each_request_held_counts_once_even_at_a_reused_address() -> None:
    """The count was keyed by the charge's id, which CPython reuses once it is freed:
    50 requests held one after the other counted as 1."""
    clock = ManualClock()
    adm = _admission(clock)
    stream = _streaming(adm)
    for _ in range(50):
        assert adm.try_admit(Charge(LONG, 100), party=CHAT) is None  # held (and freed)
    assert adm.slo.defer.deferred == 50
    adm.release(stream)


async def test_a_held_request_is_not_refused_as_late_for_the_queue_it_skipped() -> None:
    """Found by the fresh-user pass on llama-server: a request held at arrival went on
    to queue, where its TTFT was predicted from the replay of the queue (7.2 s) and it
    was refused (503 slo_unattainable, deadline 2.5 s), though it could start within
    its slack. A held request's predicted wait is its hold, within its slack."""
    clock = ManualClock()
    adm = _admission(clock)
    stream = _streaming(adm)
    adm.forecast.predict_wait_s = lambda charge, party=None: 5.0  # a replay that says late
    party = Party(priority="chat", itl_target_s=0.05, ttft_deadline_s=3.0)
    held = asyncio.ensure_future(adm.admit(Charge(LONG, 100), party=party))
    await _settle()
    assert not held.done() and adm.slo.defer.deferred == 1
    adm.release(stream)
    lease = await asyncio.wait_for(held, 1)
    adm.release(lease)
