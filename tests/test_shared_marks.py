"""Backend health marks and the discovered layout shared by gateway processes
(gateway/admission/shared_marks.py), against a real ``redis-server``
(tests/realredis.py). Two apps with their own stores (owners) in one event loop stand
for two processes, in front of one fake llama-server (tests/fakes.py, whose ``/props``
follows llama-server's: ``total_slots``, ``default_generation_settings.n_ctx``)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from typing import Any

import pytest
import redis.asyncio as aioredis
from prometheus_client import CollectorRegistry

from gateway.admission.shared import close_bounded
from gateway.backends.target import Target
from gateway.config import load_settings
from gateway.http.app import create_app
from tests.conftest import Harness
from tests.fakes import FakeLlamaServer
from tests.test_tenants import until

PREFIX = "tm"
MARKS = f"{PREFIX}:b:local@"  # + the URL's hash + ":marks"


@pytest.fixture
async def pair(fake: FakeLlamaServer, redis_server: Any
               ) -> AsyncIterator[Callable[..., Any]]:
    made: list[Harness] = []

    async def build(**state: Any) -> tuple[Harness, Harness]:
        for _ in range(2):
            settings = load_settings(
                admission={"disconnect_grace_s": 0.0},
                state={"backend": "redis", "redis_url": redis_server.url,
                       "key_prefix": PREFIX, "renew_interval_s": 0.2, "lease_ttl_s": 1.0,
                       "poll_interval_s": 5.0, "op_timeout_s": 0.3, **state},
                backends=[{"name": "local", "url": "http://upstream:8080",
                           "connect_timeout_s": 0.5}])
            app = create_app(settings, http_client=fake.client(),
                             registry=CollectorRegistry(), discover=False)
            h = Harness(app, fake)
            await h.state.store.start()
            await h.backend.discover()
            made.append(h)
        return made[0], made[1]

    yield build
    for h in made:
        await h.client.aclose()
        await h.backend.close()
        await h.state.store.close()


def usable(t: Target) -> bool:
    return t.usable(t.clock.now())


async def test_a_backend_marked_down_by_one_process_is_skipped_by_the_other(
        pair: Any) -> None:
    a, b = await pair()
    ta, tb = a.backend, b.backend
    assert usable(ta) and usable(tb)
    down = ta.request_failed(5.0, 30.0)
    assert down == 5.0 and not usable(ta)
    await until(lambda: not usable(tb))  # at once, by the notice
    assert 4.0 < tb.health.down_for_s(tb.clock.now()) <= 5.0
    # A second failure elsewhere doubles the backoff for both (failures in a row,
    # counted over every process).
    tb.request_failed(5.0, 30.0)
    await until(lambda: ta.health.failures == 2)
    assert ta.health.down_for_s(ta.clock.now()) > 9.0
    # A request served on B brings the backend back everywhere.
    tb.health.request_served()
    await until(lambda: usable(ta))
    assert ta.health.failures == 0 and usable(tb)


async def test_the_notice_carries_a_mark_before_the_next_renewal(pair: Any) -> None:
    a, b = await pair(renew_interval_s=10.0, lease_ttl_s=30.0)
    a.backend.request_failed(5.0, 30.0)
    # Renewals are 10 s apart: only the pub/sub notice can tell B this soon.
    await asyncio.wait_for(until(lambda: not usable(b.backend)), 3.0)
    b.backend.health.request_served()
    await asyncio.wait_for(until(lambda: usable(a.backend)), 3.0)


async def test_one_half_open_probe_across_processes(pair: Any) -> None:
    a, b = await pair()
    ta, tb = a.backend, b.backend
    ta.request_failed(0.3, 30.0)
    await until(lambda: tb.health.failures == 1)
    seen: set[tuple[bool, bool]] = set()
    # Once the backoff has passed, one process claims the probe (as the backoff ends,
    # without a request asking); the other keeps skipping the backend.
    while True:
        state = (usable(ta), usable(tb))
        seen.add(state)
        if any(state):
            break
        await asyncio.sleep(0.005)
    for _ in range(30):  # the probe's time-out is 1.5 s: it still holds
        seen.add((usable(ta), usable(tb)))
        await asyncio.sleep(0.01)
    assert (True, True) not in seen
    prober, other = (ta, tb) if usable(ta) else (tb, ta)
    prober.probe_started(prober.clock.now())
    assert not usable(prober)  # the probe is in flight: no second request
    prober.health.request_served()
    await until(lambda: usable(other))
    assert other.health.failures == 0


async def test_a_probe_not_sent_times_out_and_is_claimed_again(pair: Any) -> None:
    a, b = await pair()
    ta, tb = a.backend, b.backend
    ta.request_failed(0.2, 30.0)
    await until(lambda: usable(ta) or usable(tb))
    first = ta.health.down_until if usable(tb) else tb.health.down_until
    # The holder never sends it (no request came): after the probe's time-out
    # (connect_timeout_s 0.5 + 1 s) it is claimed again, by either; never both.
    loop = asyncio.get_running_loop()
    end = loop.time() + 2.5
    both = claimed_again = False
    while loop.time() < end:
        both = both or (usable(ta) and usable(tb))
        ends = [t.health.down_until for t in (ta, tb) if not usable(t)]
        claimed_again = claimed_again or any(e > first + 1.0 for e in ends)
        await asyncio.sleep(0.01)
    assert not both
    assert claimed_again


async def test_a_layout_change_discovered_by_one_process_is_adopted_by_the_other(
        pair: Any, fake: FakeLlamaServer) -> None:
    a, b = await pair()
    before = b.backend.admission.layout
    assert before is not None and before.slots == 4
    # The server restarted with -c 1024 and 2 slots; only A reads /props again.
    fake.slots, fake.n_ctx = 2, 1024
    smaller = await a.backend.discover()
    assert smaller is not None and smaller.slots == 2 and smaller != before
    loop = asyncio.get_running_loop()
    started = loop.time()
    await until(lambda: b.backend.admission.layout == smaller)
    # Within the renewal interval (0.2 s here), with margin for a loaded machine.
    assert loop.time() - started < 1.0
    # B's own read now agrees, and publishes nothing new.
    gen = b.backend.marks.layout.gen
    assert await b.backend.discover() == smaller
    assert b.backend.marks.layout.gen == gen


async def test_a_stale_read_does_not_undo_a_published_change(
        pair: Any, fake: FakeLlamaServer) -> None:
    a, b = await pair()
    fake.slots = 2
    new = await a.backend.discover()
    await until(lambda: b.backend.admission.layout == new)
    # B's read comes back with the old answer (read before the restart, say): its own
    # reads did not change, so the published layout stands.
    fake.slots = 4
    assert await b.backend.discover() == new
    await asyncio.sleep(0.3)
    assert a.backend.admission.layout == new
    # Read twice over (a stable disagreement), it is published: the published layout
    # was the wrong one.
    old = await b.backend.discover()
    assert old is not None and old.slots == 4
    await until(lambda: a.backend.admission.layout == old)


async def test_the_layout_follows_the_heartbeat_when_a_notice_is_lost(
        pair: Any, fake: FakeLlamaServer, redis_server: Any) -> None:
    a, b = await pair()
    # Another process published a layout and its notice never came: the heartbeat reads
    # it within renew_interval_s.
    view = aioredis.Redis.from_url(redis_server.url)
    try:
        key = next(k.decode() for k in await view.keys(f"{MARKS}*:marks"))
        gen = int(await view.hget(key, "gen"))
        await view.hset(key, mapping={"gen": gen + 1, "slots": 3})
    finally:
        await close_bounded(view.aclose())
    await until(lambda: a.backend.admission.layout.slots == 3
                and b.backend.admission.layout.slots == 3)


async def test_redis_lost_keeps_local_marks_and_marks_nothing(
        pair: Any, redis_server: Any) -> None:
    a, b = await pair()
    ta, tb = a.backend, b.backend
    redis_server.stop()
    try:
        await until(lambda: not (a.state.store.shared.up or b.state.store.shared.up))
        # No false mark: Redis's loss marks nothing down.
        assert usable(ta) and usable(tb)
        # A failure is this process's own meanwhile, with its own half-open probe.
        ta.request_failed(0.2, 30.0)
        assert not usable(ta)
        await asyncio.sleep(0.5)
        assert usable(tb) and tb.health.failures == 0
        assert usable(ta)  # the backoff passed: this process's probe may go
    finally:
        redis_server.start()  # the same port, every key lost
    # Back: A's mark of the outage is published at its next heartbeat.
    await until(lambda: a.state.store.shared.up and tb.health.failures == 1)


async def test_health_calls_are_counted(pair: Any) -> None:
    a, _b = await pair()
    a.backend.request_failed(1.0, 30.0)
    await until(lambda: (a.state.metrics.registry.get_sample_value(
        "gateway_state_ops_total", {"op": "health", "outcome": "ok"}) or 0) >= 1)


async def test_the_marks_loop_ends_when_a_redis_call_swallows_its_cancellation(
        pair: Any, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
        ) -> None:
    """Issue 42: on Python 3.11, redis-py's ``send_packed_command`` (an
    ``asyncio.wait_for``) returns normally when the write ends as the task is cancelled,
    and the cancellation is lost. The marks' loop, cancelled by the store's close at
    such a moment, went round again for ever and held the test run's loop open. Here a
    read of the marks swallows the cancellation the same way, every time: the loop must
    still end within the close's bound, with nothing logged as left running."""
    from gateway.admission.shared_marks import MarksHub

    a, _ = await pair()
    hub = MarksHub.of(a.state.store.shared)
    in_sync = asyncio.Event()

    async def swallowing_sync() -> None:
        in_sync.set()
        try:
            await asyncio.sleep(0.5)
        except asyncio.CancelledError:
            pass  # what wait_for does on 3.11 when the call ends as it is cancelled

    monkeypatch.setattr(hub, "sync", swallowing_sync)
    in_sync.clear()
    await asyncio.wait_for(in_sync.wait(), 5)  # the loop is inside a "Redis call"
    running = [t for t in a.state.store.shared._tasks if "MarksHub._run" in repr(t.get_coro())]
    assert len(running) == 1
    with caplog.at_level("ERROR"):
        await a.state.store.close()
    assert running[0].done()
    assert "did not end" not in caplog.text
