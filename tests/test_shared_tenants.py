"""Tenant quotas over several gateway processes (gateway/admission/shared_tenants.py):
two apps sharing one real ``redis-server``, in front of one fake llama-server (the fake
of tests/fakes.py; its counting is described there), a tenant's requests alternating
between them."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from typing import Any

import pytest
import redis.asyncio as aioredis
from prometheus_client import CollectorRegistry

from gateway.admission.shared import close_bounded
from gateway.config import load_settings
from gateway.http.app import create_app
from tests.conftest import Harness
from tests.fakes import FakeLlamaServer
from tests.test_tenants import CHAT, CLASSES, TENANTS, WEB_KEY, bearer, chat_body, post, until


@pytest.fixture
async def pair(fake: FakeLlamaServer, redis_server: Any
               ) -> AsyncIterator[Callable[..., Any]]:
    made: list[Harness] = []

    async def build(tenants: list[dict[str, Any]]) -> tuple[Harness, Harness]:
        out = []
        for _ in range(2):
            settings = load_settings(
                admission={"disconnect_grace_s": 0.0},
                state={"backend": "redis", "redis_url": redis_server.url,
                       "key_prefix": "tt", "renew_interval_s": 0.2, "lease_ttl_s": 1.0,
                       "poll_interval_s": 5.0},
                backends=[{"name": "local", "url": "http://upstream:8080"}],
                classes=CLASSES, tenants=tenants)
            app = create_app(settings, http_client=fake.client(),
                             registry=CollectorRegistry(), discover=False)
            h = Harness(app, fake)
            await h.state.store.start()
            await h.backend.discover()
            made.append(h)
            out.append(h)
        return out[0], out[1]

    yield build
    for h in made:
        await h.client.aclose()
        await h.state.store.close()


async def test_tokens_per_minute_holds_across_processes(pair: Any) -> None:
    a, b = await pair([{**TENANTS[0], "tokens_per_minute": 30}, TENANTS[1]])
    # The fake counts "hello there" as 8 prompt tokens and answers 5: 13 a request.
    for h in (a, b):
        r = await h.client.post(CHAT, json=chat_body(), headers=bearer(WEB_KEY))
        assert r.status_code == 200, r.text
        await asyncio.sleep(0.1)  # the completion is counted in the background
    # 26 used over both; A itself served only 13, but 8 more would pass 30.
    r = await a.client.post(CHAT, json=chat_body(), headers=bearer(WEB_KEY))
    assert r.status_code == 429, r.text
    assert "tokens per minute" in r.json()["error"]["message"]
    assert r.headers["x-ratelimit-remaining-tokens"] == "4"
    assert 50 <= int(r.headers["retry-after"]) <= 60


async def test_max_inflight_holds_across_processes(pair: Any, fake: FakeLlamaServer
                                                   ) -> None:
    a, b = await pair([{**TENANTS[0], "max_inflight": 1}, TENANTS[1]])
    fake.hold = asyncio.Event()
    first = post(a, WEB_KEY, "w1")
    await until(lambda: a.backend.stats().inflight == 1)
    second = post(b, WEB_KEY, "w2")
    tenant_b = b.state.tenants.by_name["web"]
    await until(lambda: tenant_b.waiting == 1)
    await asyncio.sleep(0.2)
    assert b.backend.admission.stats().inflight == 0  # held at its gate on B
    loop = asyncio.get_running_loop()
    fake.hold.set()
    started = loop.time()
    assert [r.status_code for r in await asyncio.gather(first, second)] == [200, 200]
    assert loop.time() - started < 2.0  # woken by A's release, not the 5 s poll
    assert (tenant_b.inflight, tenant_b.waiting) == (0, 0)


@pytest.mark.parametrize("where", ["gate", "capacity"])
async def test_max_queued_holds_across_processes(pair: Any, fake: FakeLlamaServer,
                                                 where: str) -> None:
    # The tenant's waiters alternate between A and B; each process has one waiting when
    # the next comes, so only a count over both refuses it. They wait at the gate
    # (max_inflight 1) or for capacity (the fake's one slot).
    quota = {"max_queued": 2, **({"max_inflight": 1} if where == "gate" else {})}
    if where == "capacity":
        fake.slots = 1
    a, b = await pair([{**TENANTS[0], **quota}, TENANTS[1]])
    fake.hold = asyncio.Event()
    first = post(a, WEB_KEY, "w1")
    await until(lambda: a.backend.stats().inflight == 1)
    second = post(b, WEB_KEY, "w2")
    await until(lambda: b.state.tenants.by_name["web"].waiting == 1)
    third = post(a, WEB_KEY, "w3")
    await until(lambda: a.state.tenants.by_name["web"].waiting == 1)
    r = await b.client.post(CHAT, json=chat_body("w4"), headers=bearer(WEB_KEY))
    assert r.status_code == 429, r.text
    assert "max_queued (2)" in r.json()["error"]["message"]
    fake.hold.set()
    assert [r.status_code for r in await asyncio.gather(first, second, third)] == [200] * 3
    # The places are given back: two more may wait again.
    await until(lambda: not (a.state.tenants.by_name["web"].quota.queued
                             or b.state.tenants.by_name["web"].quota.queued))


async def test_a_dead_process_s_queued_places_expire(pair: Any, redis_server: Any
                                                     ) -> None:
    a, _b = await pair([{**TENANTS[0], "max_queued": 1}, TENANTS[1]])
    # A process that had one request of the tenant waiting, then was killed: its
    # liveness runs out in 0.6 s and is never renewed. (Every request waits for the
    # shared grant's answer, so each needs a waiting place.)
    view = aioredis.Redis.from_url(redis_server.url)
    try:
        t = await view.time()
        now_ms = int(t[0]) * 1000 + int(t[1]) // 1000
        await view.zadd("tt:procs", {"ghost": now_ms + 600})
        await view.zadd("tt:t:web:queued", {"ghost#1": now_ms})
        r = await a.client.post(CHAT, json=chat_body("w1"), headers=bearer(WEB_KEY))
        assert r.status_code == 429, r.text  # the dead process's waiter still counts
        assert "max_queued (1)" in r.json()["error"]["message"]
        await asyncio.sleep(0.7)
        r = await a.client.post(CHAT, json=chat_body("w2"), headers=bearer(WEB_KEY))
        assert r.status_code == 200, r.text
        assert b"ghost#1" not in await view.zrange("tt:t:web:queued", 0, -1)
    finally:
        await close_bounded(view.aclose())
