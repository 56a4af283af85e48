"""The graceful drain (issue 14, part 1) in-process: what the gateway answers while it
drains, and what it waits for. The signal handling is tested against the real process in
``tests/integration/test_drain_real.py``."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

pytestmark = pytest.mark.anyio


async def _one_in_flight_one_queued(h: Any, fake: Any) -> tuple[Any, Any]:
    """Two chats whose caps do not fit together, held by the fake: one runs, one waits."""
    fake.hold = asyncio.Event()
    inflight = asyncio.ensure_future(h.chat("one", max_tokens=1500))
    queued = asyncio.ensure_future(h.chat("two", max_tokens=1500))
    for _ in range(100):
        await asyncio.sleep(0.01)
        if h.backend.stats().queued == 1:
            break
    assert h.backend.stats().queued == 1
    return inflight, queued


async def test_a_drain_refuses_new_work_and_waits_for_what_is_in_hand(
        harness_factory: Any, fake: Any) -> None:
    h = await harness_factory({"max_queue_wait_s": 60.0})
    inflight, queued = await _one_in_flight_one_queued(h, fake)
    assert (await h.client.get("/ready")).status_code == 200
    drain = asyncio.ensure_future(h.state.drain())
    await asyncio.sleep(0.05)
    ready = await h.client.get("/ready")
    assert ready.status_code == 503 and ready.json()["draining"] is True
    refused = await h.chat("three", max_tokens=5)
    assert refused.status_code == 503 and refused.json()["error"]["code"] == "shutting_down"
    assert "retry-after" in refused.headers
    assert not drain.done()  # one in flight, one queued: both still to serve
    fake.hold.set()
    assert (await inflight).status_code == 200 and (await queued).status_code == 200
    assert await asyncio.wait_for(drain, 5) is True


async def test_a_drain_can_refuse_the_queue_and_gives_up_after_its_timeout(
        harness_factory: Any, fake: Any) -> None:
    h = await harness_factory({"max_queue_wait_s": 60.0})
    settings = h.state.settings
    h.state.settings = settings.model_copy(update={"server": settings.server.model_copy(
        update={"drain_queued": "refuse", "drain_timeout_s": 0.3})})
    inflight, queued = await _one_in_flight_one_queued(h, fake)
    assert await h.state.drain() is False  # the one in flight outlives the timeout
    r = await queued
    assert r.status_code == 503 and r.json()["error"]["code"] == "shutting_down"
    fake.hold.set()
    assert (await inflight).status_code == 200


async def test_a_drain_that_runs_out_of_time_ends_each_stream_with_an_error_event(
        harness_factory: Any, fake: Any) -> None:
    from gateway.http.serving import _cut

    h = await harness_factory({"max_queue_wait_s": 60.0})
    settings = h.state.settings
    h.state.settings = settings.model_copy(update={"server": settings.server.model_copy(
        update={"drain_timeout_s": 0.3})})
    fake.tokens, fake.token_delay = 1000, 0.05  # a long answer, a token every 50 ms
    stream = asyncio.ensure_future(h.chat("long", max_tokens=1000, stream=True))
    whole = asyncio.ensure_future(h.chat("long too", max_tokens=1000))
    await asyncio.sleep(0.3)
    assert await h.state.drain() is False
    await _cut(h.state)
    r = await asyncio.wait_for(stream, 5)
    events = [line for line in r.text.splitlines() if line.startswith("data: ")]
    assert len(events) > 2 and '"shutting_down"' in events[-1]  # tokens, then the cut
    r = await asyncio.wait_for(whole, 5)
    assert r.status_code == 503 and r.json()["error"]["code"] == "shutting_down"
    assert h.backend.stats().inflight - h.backend.stats().abandoned_held == 0
