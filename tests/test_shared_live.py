"""The predictive policy shared between gateway processes
(gateway/admission/shared_live.py), against a real ``redis-server``
(tests/realredis.py). As in tests/test_shared_state.py, each "process" is a
:class:`SharedStore` with its own owner id and Redis connection, in one event loop; the
run of several real gateway processes in front of a real llama-server is
tests/integration/test_shared_predictive_real.py."""

from __future__ import annotations

import asyncio
import math
from collections.abc import AsyncIterator
from typing import Any

import pytest
import redis.asyncio as aioredis
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gateway.admission.admission import Admission
from gateway.admission.lease import Lease
from gateway.admission.live import GROWTH_HORIZON_S, LiveAccounting
from gateway.admission.shared import Ask, SharedStore, close_bounded
from gateway.admission.shared_grant import SharedGrantor
from gateway.admission.shared_live import (
    LiveFigures,
    LiveRule,
    SharedLive,
    growth,
    live_reserved,
)
from gateway.clock import MonotonicClock
from gateway.core import capacity
from gateway.core.capacity import Budget, Charge, Layout
from tests.fakes import ManualClock
from tests.test_shared_state import state_settings

POOL = Layout(slots=4, ctx_per_slot=2048, pool_tokens=2048)
HORIZON_MS = int(GROWTH_HORIZON_S * 1000)
FAR = 2**45  # an `at` after any Redis time: the figures' age is 0


class Proc:
    """One simulated gateway process under ``predictive``: a store and an admission of
    backend ``b`` on a manual clock (its leases' decode rates follow that clock)."""

    def __init__(self, url: str, name: str, clock: ManualClock, **kw: Any) -> None:
        self.store = SharedStore(state_settings(url, renew_interval_s=1.0,
                                                lease_ttl_s=60.0, **kw),
                                 clock=clock, owner=name)
        self.admission = Admission(POOL, max_queue=100, max_wait_s=30.0, clock=clock,
                                   predictive=True,
                                   grantor=SharedGrantor(self.store.account("b"), clock))
        self.preempted: list[Lease] = []

    @property
    def live(self) -> SharedLive:
        live = self.store.account("b").live
        assert isinstance(live, SharedLive)
        return live

    async def admit(self, charge: Charge) -> Lease:
        lease = await asyncio.wait_for(self.admission.admit(charge), 5)
        lease.tracked = lease.preemptible = True
        lease.on_preempt = lambda reason: self.preempted.append(lease)
        return lease


async def fresh_redis(url: str) -> None:
    """Empty Redis, and no resync window (as after a long-running deployment)."""
    client = aioredis.Redis.from_url(url)
    try:
        await client.flushall()
        await client.set("t:epoch", 0)
    finally:
        await close_bounded(client.aclose())


@pytest.fixture
async def two(redis_server: Any) -> AsyncIterator[tuple[Proc, Proc, ManualClock]]:
    await fresh_redis(redis_server.url)
    clock = ManualClock()
    a, b = Proc(redis_server.url, "A", clock), Proc(redis_server.url, "B", clock)
    for proc in (a, b):
        # Each round of the live loop is run by the test (SharedLive.step), in order.
        proc.live.kick = lambda: None  # type: ignore[method-assign]
        await proc.store.start()
    try:
        yield a, b, clock
    finally:
        await a.store.close()
        await b.store.close()


def decode(proc: Proc, lease: Lease, upto: int, clock: ManualClock) -> None:
    """``lease`` generates up to ``upto`` tokens at 100 tokens/s (its first token now)."""
    if lease.generated == 0:
        proc.admission.observe(lease, 1)
    clock.advance((upto - lease.generated) / 100)
    proc.admission.observe(lease, upto)


# -- one source of rules: the grant script decides as live_reserved + capacity.fits ----

figures_st = st.builds(
    lambda used, room, rate, progress, state, age: (used, room, rate, progress, state, age),
    st.integers(0, 3000), st.integers(0, 2000), st.integers(0, 400_000),
    st.integers(0, 2000), st.integers(0, 2), st.integers(0, 2000))
leases_st = st.lists(st.tuples(st.sampled_from("QRS"), st.integers(1, 2500),
                               st.integers(1, 2), st.none() | figures_st), max_size=5)


@settings(max_examples=150, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(pool=st.integers(2048, 8192), leases=leases_st, near=st.integers(-4, 4),
       margin=st.integers(0, 200), rate=st.floats(1.0, 500.0))
async def test_grant_script_decides_as_live_reserved(
        redis_server: Any, pool: int, leases: list[Any], near: int, margin: int,
        rate: float) -> None:
    layout = Layout(slots=8, ctx_per_slot=pool, pool_tokens=pool)
    client = aioredis.Redis.from_url(redis_server.url)
    store = SharedStore(state_settings(redis_server.url), clock=MonotonicClock(),
                        owner="P", client=client)
    try:
        await fresh_redis(redis_server.url)
        await client.zadd("t:procs", {o: 2**50 for o in "QRS"})  # other live processes
        t = await client.time()
        redis_now = int(t[0]) * 1000 + int(t[1]) // 1000
        held: dict[str, tuple[int, int]] = {}
        figures: dict[str, LiveFigures] = {}
        for i, (owner, tokens, n, fig) in enumerate(leases):
            lease_id = f"{owner}#{i}"
            held[lease_id] = (tokens, n)
            await client.hset("t:b:b:leases", lease_id, f"{owner}|{tokens}|{n}|")
            if fig is not None:
                used, room, rate_m, progress, state, age = fig
                figures[lease_id] = LiveFigures(used, room, rate_m, progress, state, 0,
                                                redis_now - age)
                await client.hset("t:b:b:live", lease_id,
                                  f"{figures[lease_id].encode()}|{redis_now - age}")
        await client.hset("t:b:b:live", "Q#gone", "5000|0|0|0|0|0|0")  # no lease: ignored
        live = SharedLive.of(store.account("b"), horizon_s=GROWTH_HORIZON_S)
        live.bind(dict, lambda: None, lambda: rate, margin)
        reserved = sum(tokens for tokens, _ in held.values())
        # A charge within a few tokens of what is left (as of now: the script's clock is
        # a little later), where a rule that differs shows.
        left = pool - live_reserved(reserved, held, figures, redis_now, live.rule())
        tokens = max(2, min(pool - 1, left + near))
        charge = Charge(tokens // 2, tokens - tokens // 2)
        reply = await store.account("b").grant(layout, [Ask("P#1", 1, charge)])
        budget = Budget(live_reserved(reserved, held, figures, reply.now_ms, live.rule()),
                        sum(n for _, n in held.values()))
        assert ("P#1" in reply.granted) == capacity.fits(layout, budget, charge)
        assert not await client.hexists("t:b:b:live", "Q#gone")
    finally:
        await close_bounded(client.aclose())


lease_st = st.builds(
    lambda prompt, cap, predicted, tracked, done, n: (prompt, cap, predicted, tracked,
                                                      done, n),
    st.integers(1, 600), st.integers(1, 800), st.none() | st.integers(0, 800),
    st.booleans(), st.floats(0.0, 1.0), st.integers(1, 2))


@settings(max_examples=80, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(specs=st.lists(lease_st, min_size=1, max_size=4), near=st.integers(-3, 3),
       margin=st.integers(0, 100))
async def test_grant_script_decides_as_live_accounting_fits(
        redis_server: Any, specs: list[Any], near: int, margin: int) -> None:
    """One process's leases, published by it: the script, judging on Redis's figures,
    and LiveAccounting.fits, judging on the leases themselves, give the same answer."""
    client = aioredis.Redis.from_url(redis_server.url)
    clock = ManualClock()
    store = SharedStore(state_settings(redis_server.url, lease_ttl_s=60.0,
                                       renew_interval_s=1.0), clock=clock, owner="P",
                        client=client)
    try:
        await fresh_redis(redis_server.url)
        await client.zadd("t:procs", {"P": 2**50})
        account = store.account("b")
        active: dict[int, Lease] = {}
        live = SharedGrantor(account, clock).live(clock, predictive=True,
                                                  margin_tokens=margin, active=active)
        for i, (p, c, predicted, tracked, done, n) in enumerate(specs):
            charge = Charge(p, c, n=n, predicted=predicted)
            lease = Lease(charge, granted_at=clock.now(), shared_id=f"P#{i}",
                          tracked=tracked, preemptible=tracked)
            active[i] = lease
            lease.first_token_at = clock.now()  # (as observe would, without its loop)
            clock.advance(0.5)
            lease.generated = max(1, int(done * c))
            await client.hset("t:b:b:leases", f"P#{i}", f"P|{charge.tokens}|{n}|")
        shared = live.peers
        assert isinstance(shared, SharedLive)
        shared.kick = lambda: None  # type: ignore[method-assign]  # no loop here
        await shared.publish(shared.collect())
        for lease_id, value in (await client.hgetall("t:b:b:live")).items():
            head = value.decode().rsplit("|", 1)[0]
            await client.hset("t:b:b:live", lease_id, f"{head}|{FAR}")  # age 0
        budget = Budget(sum(x.charge.tokens for x in active.values()),
                        sum(x.charge.n for x in active.values()))

        def fits(tokens: int) -> bool:
            return live.fits(POOL, budget, list(active.values()),
                             Charge(tokens // 2, tokens - tokens // 2))

        # Within a few tokens of the largest charge that fits, where a rule that
        # differs shows.
        largest = max((t for t in range(2, 2048) if fits(t)), default=2)
        tokens = max(2, min(2047, largest + near))
        charge = Charge(tokens // 2, tokens - tokens // 2)
        reply = await account.grant(POOL, [Ask("P#new", 1, charge)])
        expected = live.fits(POOL, budget, list(active.values()), charge)
        assert ("P#new" in reply.granted) == expected
    finally:
        await store.close()
        await close_bounded(client.aclose())


@settings(max_examples=200)
@given(rate=st.integers(1_000, 500_000), age_ms=st.integers(0, 5000),
       room=st.integers(0, 4000), n=st.integers(1, 4), used=st.integers(0, 4000))
def test_a_reader_projection_covers_what_decoded_since_and_within_the_horizon(
        rate: int, age_ms: int, room: int, n: int, used: int) -> None:
    """A stream decoding at its published rate: what it holds one horizon after the
    read is never more than its figures projected over the horizon plus their age."""
    fig = LiveFigures(used, room, rate, 0, 1, 0, at_ms=1000)
    window = HORIZON_MS + age_ms
    decoded = min(room, math.floor(rate * window / 1_000_000))  # per sequence, whole
    true_then = used + n * decoded
    projected = live_reserved(0, {"x": (0, n)}, {"x": fig}, 1000 + age_ms,
                              LiveRule(0, HORIZON_MS, 0))
    assert projected >= true_then
    # and not much more: the token in flight and the one partly decoded, per sequence
    assert projected - true_then <= 2 * n


# -- across processes --------------------------------------------------------------------

async def test_a_grant_counts_the_live_use_another_process_published(
        two: tuple[Proc, Proc, ManualClock]) -> None:
    a, b, clock = two
    a1 = await a.admit(Charge(100, 1500, predicted=300))  # charged 400
    decode(a, a1, 1400, clock)  # holds 1,500 now
    await a.live.step()
    # 400 + 600 fit the reservations, but not A's live use plus margin and growth.
    with pytest.raises(TimeoutError):
        await asyncio.wait_for(b.admission.admit(Charge(100, 500)), 1.0)
    alone = LiveAccounting(clock, predictive=True, margin_tokens=32)
    assert alone.fits(POOL, Budget(400, 1), [], Charge(100, 500))  # strict sums: fits
    a.admission.release(a1)
    lease = await b.admit(Charge(100, 500))
    assert lease.charge.tokens == 600
    b.admission.release(lease)


async def test_pressure_is_judged_on_the_whole_backend_and_each_preempts_its_own(
        two: tuple[Proc, Proc, ManualClock]) -> None:
    a, b, clock = two
    a1 = await a.admit(Charge(100, 1500, predicted=300))
    clock.advance(0.05)
    b1 = await b.admit(Charge(100, 1500, predicted=300))
    decode(a, a1, 900, clock)
    decode(b, b1, 800, clock)
    for proc in (a, b, a):
        await proc.live.step()
    assert a.preempted == b.preempted == []  # 1,000 + 900 + growth fit the pool
    decode(a, a1, 1000, clock)  # 1,100 + 900 + growth pass 2,048 - 32
    await a.live.step()
    await b.live.step()
    # Each process alone holds about half the pool; together they would overflow it.
    # B's lease was granted last: B preempts it, A keeps its own. (By grant time, not
    # progress: each process reads the others' progress at another age.)
    assert b.preempted == [b1] and a.preempted == []
    assert b.admission.preemptions == {"pool_pressure": 1}
    a.admission.release(a1)
    b.admission.release(b1)


async def test_figures_are_batched_sent_when_changed_and_go_with_their_lease(
        two: tuple[Proc, Proc, ManualClock], redis_server: Any) -> None:
    a, b, clock = two
    calls: list[str] = []

    def count(op: str, outcome: str, seconds: float) -> None:
        if op == "live":  # (the pump's grant calls are not counted)
            calls.append(op)

    a.store._on_op = count
    leases = [await a.admit(Charge(10, 100, predicted=20)) for _ in range(3)]
    for lease in leases:
        lease.preemptible = False  # nothing of A's could be a victim
        decode(a, lease, 5, clock)
    calls.clear()
    await a.live.step()
    assert calls == ["live"]  # three leases, one call
    client = aioredis.Redis.from_url(redis_server.url)
    try:
        assert await client.hlen("t:b:b:live") == 3
        await a.live.step()
        assert calls == ["live"]  # nothing changed: no call
        decode(a, leases[0], 9, clock)
        await a.live.step()
        assert calls == ["live", "live"]
        a.admission.release(leases[0])
        await asyncio.sleep(0.2)  # the release runs in the background
        assert await client.hlen("t:b:b:live") == 2
        # A dies: its figures go with its leases (the TTL purge) at B's next call.
        await a.store.close()
        await client.hset("t:b:b:leases", "A#99", "A|10|1|")
        await client.hset("t:b:b:live", "A#99", "10|0|0|0|0|0|0")
        await client.zadd("t:procs", {"A": 0})
        await asyncio.wait_for(b.admission.admit(Charge(10, 10)), 5)
        assert await client.hlen("t:b:b:live") == 0
    finally:
        await close_bounded(client.aclose())


def test_check_config_accepts_predictive_with_redis(tmp_path: Any) -> None:
    import json
    import subprocess
    import sys

    config = tmp_path / "g.toml"
    config.write_text('[admission]\npolicy = "predictive"\n\n[state]\nbackend = "redis"\n'
                      "live_interval_s = 0.05\n")
    done = subprocess.run([sys.executable, "-m", "gateway", "check-config", str(config)],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    shown = json.loads(done.stdout)
    assert shown["state"]["live_interval_s"] == 0.05
    assert shown["admission"]["policy"] == "predictive"
    config.write_text('[state]\nbackend = "redis"\nlive_interval_s = 0\n')
    done = subprocess.run([sys.executable, "-m", "gateway", "check-config", str(config)],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode != 0 and "live_interval_s" in done.stdout + done.stderr


def test_growth_is_bounded_by_the_room_left() -> None:
    assert growth(2, 0, 100_000, 250) == 0  # an untracked lease, or one at its cap
    assert growth(2, 5, 100_000, 250) == 10
    assert growth(1, 1000, 100_000, 250) == 26  # 25 tokens in 0.25 s, and one in flight
