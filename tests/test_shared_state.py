"""Admission shared between gateway processes (gateway/admission/shared.py), against a
real ``redis-server`` (tests/realredis.py). Each "process" here is a
:class:`SharedStore` with its own owner id and Redis connection, in one event loop; the
multi-process runs in front of a real llama-server are in
tests/integration/test_shared_real.py."""

from __future__ import annotations

import asyncio
import random
from collections.abc import AsyncIterator
from typing import Any

import pytest
import redis.asyncio as aioredis
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gateway.admission.admission import Admission
from gateway.admission.shared import Ask, SharedStore, close_bounded
from gateway.admission.shared_grant import SharedGrantor
from gateway.clock import MonotonicClock
from gateway.config import StateSettings
from gateway.core import capacity
from gateway.core.capacity import Budget, Charge, Layout
from gateway.errors import QueueTimeout, StateUnavailable

LAYOUT = Layout(slots=4, ctx_per_slot=2048, pool_tokens=2048)


def state_settings(url: str, **kw: Any) -> StateSettings:
    base: dict[str, Any] = {"backend": "redis", "redis_url": url, "key_prefix": "t",
                            "renew_interval_s": 0.2, "lease_ttl_s": 0.8,
                            "poll_interval_s": 5.0, "op_timeout_s": 0.5}
    return StateSettings(**{**base, **kw})


class Proc:
    """One simulated gateway process: a store and an admission of backend ``b``."""

    def __init__(self, url: str, name: str, **kw: Any) -> None:
        self.store = SharedStore(state_settings(url, **kw), clock=MonotonicClock(),
                                 owner=name)
        self.admission = Admission(LAYOUT, max_queue=100, max_wait_s=10.0,
                                   grantor=SharedGrantor(self.store.account("b")))

    async def __aenter__(self) -> Proc:
        await self.store.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.store.close()


async def shared_sums(url: str) -> tuple[int, int]:
    """(reserved tokens, busy slots) of backend ``b`` as Redis holds them."""
    client = aioredis.Redis.from_url(url)
    try:
        values = await client.hvals("t:b:b:leases")
    finally:
        await close_bounded(client.aclose())
    tokens = slots = 0
    for v in values:
        _, tok, sl, _ = v.decode().split("|")
        tokens, slots = tokens + int(tok), slots + int(sl)
    return tokens, slots


@pytest.fixture
async def procs(redis_server: Any) -> AsyncIterator[tuple[Proc, Proc]]:
    async with Proc(redis_server.url, "A") as a, Proc(redis_server.url, "B") as b:
        yield a, b


async def test_two_processes_share_one_pool(procs: tuple[Proc, Proc],
                                            redis_server: Any) -> None:
    a, b = procs
    big = Charge(100, 800)  # 900 tokens: two fit the pool of 2048, three do not
    a1 = await asyncio.wait_for(a.admission.admit(big), 2)
    b1 = await asyncio.wait_for(b.admission.admit(big), 2)
    assert await shared_sums(redis_server.url) == (1800, 2)
    # A third, on either process, must wait although each process holds only 900.
    a2 = asyncio.ensure_future(a.admission.admit(big))
    await asyncio.sleep(0.3)
    assert not a2.done()
    assert a.admission.stats().reserved_tokens == 1800  # the shared figure
    loop = asyncio.get_running_loop()
    started = loop.time()
    b.admission.release(b1)
    lease = await asyncio.wait_for(a2, 3)
    # Woken by the release's notification, not by the 5 s poll.
    assert loop.time() - started < 1.0
    assert await shared_sums(redis_server.url) == (1800, 2)
    a.admission.release(a1)
    a.admission.release(lease)
    await asyncio.sleep(0.2)
    assert await shared_sums(redis_server.url) == (0, 0)


async def test_first_to_arrive_on_any_process_goes_first(procs: tuple[Proc, Proc]) -> None:
    a, b = procs
    fill = Charge(100, 1500)  # 1600: nothing else of 900 fits beside it
    held = await asyncio.wait_for(a.admission.admit(fill), 2)
    order: list[str] = []

    async def want(proc: Proc, tag: str) -> None:
        # 1,200 each: the two never fit together, so the order of grants is the order
        # seen (two grants together could resume in either order)
        lease = await proc.admission.admit(Charge(100, 1100))
        order.append(tag)
        await asyncio.sleep(0.3)
        proc.admission.release(lease)

    first = asyncio.ensure_future(want(b, "b-first"))
    await asyncio.sleep(0.1)
    second = asyncio.ensure_future(want(a, "a-second"))  # A's own queue was empty
    await asyncio.sleep(0.1)
    a.admission.release(held)
    await asyncio.wait_for(asyncio.gather(first, second), 5)
    assert order == ["b-first", "a-second"]


async def test_slots_are_never_held_twice(procs: tuple[Proc, Proc]) -> None:
    a, b = procs
    small = Charge(10, 10)
    leases = [await asyncio.wait_for(p.admission.admit(small), 2) for p in (a, b, a, b)]
    ids = [lease.slot_ids for lease in leases]
    assert sorted(i for t in ids for i in t) == [0, 1, 2, 3]
    # A fifth finds no slot, though the pool has room for it.
    fifth = asyncio.ensure_future(b.admission.admit(small))
    await asyncio.sleep(0.2)
    assert not fifth.done()
    a.admission.release(leases[0])
    got = await asyncio.wait_for(fifth, 3)
    assert got.slot_ids == leases[0].slot_ids
    for lease in (*leases[1:], got):
        (a if lease in leases[::2] else b).admission.release(lease)


async def test_a_dead_process_gives_back_its_capacity(redis_server: Any) -> None:
    # (Under load a wake-up may come late: the poll, 1 s here, bounds the wait.)
    async with Proc(redis_server.url, "B", poll_interval_s=1.0) as b:
        a = Proc(redis_server.url, "A", poll_interval_s=1.0)
        await a.store.start()
        await asyncio.wait_for(a.admission.admit(Charge(100, 1500)), 2)
        # A dies: its heartbeat stops, nothing is released (kill -9). (_running too: on
        # Python 3.11 a cancellation that meets a finished wait_for may be swallowed.)
        a.store._running = False
        for task in list(a.store._tasks):
            task.cancel()
        loop = asyncio.get_running_loop()
        started = loop.time()
        lease = await asyncio.wait_for(b.admission.admit(Charge(100, 1500)), 10)
        waited = loop.time() - started
        # Not before the TTL (0.8 s), and soon after (the next heartbeat of B sees it).
        assert 0.5 < waited < 4.0, waited
        assert await shared_sums(redis_server.url) == (1600, 1)
        b.admission.release(lease)


async def test_redis_lost_refuses_then_recovers(redis_server: Any) -> None:
    async with Proc(redis_server.url, "A") as a:
        held = await asyncio.wait_for(a.admission.admit(Charge(10, 10)), 2)
        redis_server.stop()
        with pytest.raises(StateUnavailable) as info:
            await asyncio.wait_for(a.admission.admit(Charge(10, 10)), 3)
        assert info.value.status_code == 503 and info.value.retry_after_s > 0
        assert not a.store.up
        redis_server.start()  # empty: every key is gone
        # The resync window (two renewals) passes, the heartbeat republishes the lease
        # still held, and admission resumes by itself.
        lease = await asyncio.wait_for(a.admission.admit(Charge(10, 10)), 5)
        assert a.store.up
        assert await shared_sums(redis_server.url) == (40, 2)
        assert set(lease.slot_ids).isdisjoint(held.slot_ids)
        a.admission.release(held)
        a.admission.release(lease)


async def test_a_waiter_that_times_out_leaves_the_shared_queue(redis_server: Any) -> None:
    async with Proc(redis_server.url, "A") as a, Proc(redis_server.url, "B") as b:
        short = Admission(LAYOUT, max_queue=10, max_wait_s=0.3,
                          grantor=SharedGrantor(a.store.account("b")))
        held = await asyncio.wait_for(b.admission.admit(Charge(100, 1500)), 2)
        with pytest.raises(QueueTimeout):
            await short.admit(Charge(100, 1500))
        await asyncio.sleep(0.2)
        client = aioredis.Redis.from_url(redis_server.url)
        try:
            assert await client.zcard("t:b:b:queue") == 0
        finally:
            await close_bounded(client.aclose())
        b.admission.release(held)


# -- one source of rules: the script decides as gateway.core.capacity.fits -------------

layouts = st.builds(
    lambda slots, ctx, unified, extra: Layout(
        slots, ctx, pool_tokens=(ctx + extra) if unified else None),
    st.integers(1, 8), st.integers(2, 4096), st.booleans(), st.integers(0, 8192))


@settings(max_examples=150, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(layout=layouts, reserved=st.integers(0, 12000), busy=st.integers(0, 8),
       prompt=st.integers(0, 5000), cap=st.integers(1, 5000), n=st.integers(1, 4))
async def test_script_decides_as_the_capacity_model(
        redis_server: Any, layout: Layout, reserved: int, busy: int, prompt: int,
        cap: int, n: int) -> None:
    client = aioredis.Redis.from_url(redis_server.url)
    store = SharedStore(state_settings(redis_server.url), clock=MonotonicClock(),
                        owner="P", client=client)
    try:
        await client.flushall()
        await client.set("t:epoch", 0)  # not resyncing
        await client.zadd("t:procs", {"Q": 2**50})  # another live process holds this
        if busy or reserved:
            await client.hset("t:b:b:leases", "Q#1", f"Q|{reserved}|{busy}|")
        charge = Charge(prompt, cap, n=n, block_size=layout.block_size)
        account = store.account("b")
        reply = await account.grant(layout, [Ask("P#1", 1, charge)])
        expected = capacity.fits(layout, Budget(reserved, busy), charge)
        assert ("P#1" in reply.granted) == expected
    finally:
        await close_bounded(client.aclose())


async def test_interleavings_keep_the_budget_within_the_pool(redis_server: Any) -> None:
    """Random reserve, release, renewal and death over three processes: the shared sums
    never pass the pool or go negative, and return to zero (a dead process's leases
    included)."""
    rng = random.Random(7)
    procs = [Proc(redis_server.url, name, lease_ttl_s=0.7, renew_interval_s=0.2)
             for name in "XYZ"]
    for p in procs:
        await p.store.start()
    held: list[tuple[Proc, Any]] = []
    client = aioredis.Redis.from_url(redis_server.url)
    try:
        for _ in range(120):
            op = rng.random()
            alive = [p for p in procs if p.store._running]
            p = rng.choice(alive)
            if op < 0.5:
                charge = Charge(rng.randint(1, 300), rng.randint(1, 900))
                try:
                    lease = await asyncio.wait_for(p.admission.admit(charge), 0.05)
                    held.append((p, lease))
                except TimeoutError:
                    pass
            elif op < 0.85 and held:
                owner, lease = held.pop(rng.randrange(len(held)))
                owner.admission.release(lease)
            elif op < 0.95:
                await p.store.heartbeat()
            elif len(alive) > 1:  # a process dies (kill -9): its renewals stop, and
                # Redis takes it for dead at once, as after its TTL
                p.store._running = False
                for task in list(p.store._tasks):
                    task.cancel()
                await client.zadd("t:procs", {p.store.owner: 0})
                held = [(o, lease) for o, lease in held if o is not p]
            tokens, slots = await shared_sums(redis_server.url)
            assert 0 <= tokens <= LAYOUT.capacity_tokens
            assert 0 <= slots <= LAYOUT.slots
        for owner, lease in held:
            owner.admission.release(lease)
        await asyncio.sleep(0.3)
        for p in procs:
            if p.store._running:
                await p.store.heartbeat()
        assert await shared_sums(redis_server.url) == (0, 0)
    finally:
        await close_bounded(client.aclose())
        for p in procs:
            await p.store.close()


# -- configuration -------------------------------------------------------------------

def test_state_settings_refuse_what_cannot_be_shared(tmp_path: Any) -> None:
    import subprocess
    import sys

    from gateway.config import ConfigError, load_settings

    redis_state = {"backend": "redis"}
    # The predictive policy is shared too (tests/test_shared_live.py).
    assert load_settings(state=redis_state, admission={"policy": "predictive"})
    with pytest.raises(ConfigError, match="live_interval_s"):
        load_settings(state={**redis_state, "live_interval_s": 2.0})
    with pytest.raises(ConfigError, match="lease_ttl_s"):
        load_settings(state={**redis_state, "lease_ttl_s": 2, "renew_interval_s": 1})
    with pytest.raises(ConfigError, match="redis_url"):
        load_settings(state={**redis_state, "redis_url": "http://localhost:6379"})
    assert load_settings().state.backend.value == "memory"
    # --workers N > 1 is refused without the shared state, before anything starts.
    done = subprocess.run([sys.executable, "-m", "gateway", "serve", "--workers", "2"],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 2
    assert 'backend = "redis"' in done.stderr


async def test_a_process_taken_for_dead_says_so_when_it_renews(
        redis_server: Any, caplog: pytest.LogCaptureFixture) -> None:
    async with Proc(redis_server.url, "A") as a:
        seen: list[tuple[int, str]] = []
        a.store._on_expired = lambda n, why: seen.append((n, why))
        held = await asyncio.wait_for(a.admission.admit(Charge(10, 10)), 3)
        client = aioredis.Redis.from_url(redis_server.url)
        try:
            await client.zadd("t:procs", {"A": 0})  # its liveness lapsed (a long stall)
        finally:
            await close_bounded(client.aclose())
        await a.store.heartbeat()
        assert (0, "renewed_late") in seen
        assert "renewed its liveness later than lease_ttl_s" in caplog.text
        a.admission.release(held)


def test_a_backend_is_shared_by_name_and_url_only(tmp_path: Any) -> None:
    """Gateways in front of different servers that share a Redis, a prefix and a backend
    name (the default "local") do not share a budget."""
    store = SharedStore(state_settings("redis://127.0.0.1:1/0"), clock=MonotonicClock(),
                        owner="P")
    one = store.account("local", "http://10.0.0.1:8080")
    assert store.account("local", "http://10.0.0.1:8080") is one
    other = store.account("local", "http://10.0.0.2:8080")
    assert other.keys[0] != one.keys[0] and other.channel != one.channel
    assert one.keys[0].startswith("t:b:local@") and one.keys[0].endswith(":leases")


def test_check_config_masks_the_redis_password(tmp_path: Any) -> None:
    import json
    import subprocess
    import sys

    config = tmp_path / "g.toml"
    config.write_text('[state]\nbackend = "redis"\n'
                      'redis_url = "redis://user:s3cret@127.0.0.1:6399/0"\n')
    done = subprocess.run([sys.executable, "-m", "gateway", "check-config", str(config)],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert "s3cret" not in done.stdout + done.stderr
    shown = json.loads(done.stdout)["state"]["redis_url"]
    assert shown == "redis://user:***@127.0.0.1:6399/0"


async def test_redis_lost_with_a_local_fallback_admits_a_share(redis_server: Any) -> None:
    async with Proc(redis_server.url, "A", on_unavailable="local", replicas=2) as a:
        await asyncio.wait_for(a.admission.admit(Charge(1, 1)), 3)  # learns the layout
        for lease in list(a.admission._active.values()):
            a.admission.release(lease)
        redis_server.stop()
        # Half the pool (1,024 tokens) and two of the four slots are this process's.
        first = await asyncio.wait_for(a.admission.admit(Charge(100, 800)), 3)
        assert a.store.up is False
        with pytest.raises(TimeoutError):  # 900 more would pass its half
            await asyncio.wait_for(a.admission.admit(Charge(100, 800)), 1.0)
        small = await asyncio.wait_for(a.admission.admit(Charge(10, 10)), 3)
        redis_server.start()
        # Once Redis answers, the heartbeat publishes what was granted alone.
        deadline = asyncio.get_running_loop().time() + 5
        while (await shared_sums(redis_server.url)) != (920, 2):
            assert asyncio.get_running_loop().time() < deadline
            await asyncio.sleep(0.1)
        a.admission.release(first)
        a.admission.release(small)


async def test_a_close_that_never_ends_is_left_after_its_bound() -> None:
    """redis-py's asyncio close can wait for ever on the socket's ``wait_closed``
    (redis/redis-py#3941): a run of the shared-state tests hung in a fixture's close with
    the event loop idle. ``close_bounded`` gives such a close its bound and goes on, and
    one that fails is quiet."""
    import time

    ever = asyncio.Event()

    async def hangs() -> None:
        await ever.wait()

    async def fails() -> None:
        raise ConnectionError("gone")

    started = time.monotonic()
    await close_bounded(hangs(), 0.2)
    assert 0.15 < time.monotonic() - started < 2.0
    await close_bounded(fails(), 1.0)  # (raises nothing)
    await asyncio.sleep(0)  # the abandoned close was cancelled, not left running
    assert not [t for t in asyncio.all_tasks() if t.get_coro().__name__ == "hangs"]


async def test_a_close_left_behind_that_fails_later_is_not_reported(
        caplog: pytest.LogCaptureFixture) -> None:
    """A close cancelled at its bound that then fails in its cleanup was logged by the
    loop as "Task exception was never retrieved"."""
    async def fails_when_cancelled() -> None:
        try:
            await asyncio.sleep(10)
        except asyncio.CancelledError:
            await asyncio.sleep(0.05)
            raise ConnectionError("cleanup failed after cancel") from None

    await close_bounded(fails_when_cancelled(), 0.05)
    await asyncio.sleep(0.2)
    import gc
    gc.collect()
    await asyncio.sleep(0)
    assert "never retrieved" not in caplog.text
