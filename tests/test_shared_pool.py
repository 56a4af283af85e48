"""Pools with ``[state] backend = "redis"`` (gateway/fleet/shared_pool.py): one model
served by two backends, shared by several gateway "processes" (apps, each with its own
SharedStore and owner id, in one event loop) through one real ``redis-server``
(tests/realredis.py), in front of the fake llama-servers of tests/fakes.py (one per
host). What Redis holds is read back from Redis itself."""

from __future__ import annotations

import asyncio
import hashlib
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import httpx
import pytest
import redis.asyncio as aioredis
from prometheus_client import CollectorRegistry

from gateway.admission.lease import Lease
from gateway.admission.shared import close_bounded
from gateway.backends.target import Target
from gateway.config import load_settings
from gateway.core.capacity import Charge
from gateway.errors import QueueFull, QueueTimeout
from gateway.fleet.pool import Candidate, ModelQueue
from gateway.fleet.shared_pool import SharedPoolGrantor
from gateway.http.app import create_app
from tests.fakes import FakeLlamaServer

CHAT = "/v1/chat/completions"
PREFIX = "pool"
NAMES = ("a", "b")
POOL_TOKENS, SLOTS = 2048, 4  # the fake's layout: 4 slots sharing 2,048 cells


def key(name: str, part: str) -> str:
    """A backend's key in Redis (``{prefix}:b:{name}@{url hash}:{part}``)."""
    digest = hashlib.sha256(f"http://{name}:8080".encode()).hexdigest()[:8]
    return f"{PREFIX}:b:{name}@{digest}:{part}"


async def until(check: Callable[[], bool], timeout: float = 5.0) -> None:
    """Wait (polling) until ``check()`` holds; fail after ``timeout`` seconds."""
    async def poll() -> None:
        while not check():
            await asyncio.sleep(0.005)
    await asyncio.wait_for(poll(), timeout)


async def until_redis(check: Callable[[], Awaitable[bool]], timeout: float = 3.0) -> None:
    """Wait (polling) until the async ``check()`` holds; fail after ``timeout`` seconds
    (a withdrawal goes with the pump's next call, which a loaded machine delays)."""
    async def poll() -> None:
        while not await check():
            await asyncio.sleep(0.02)
    await asyncio.wait_for(poll(), timeout)


class Proc:
    """One gateway process: an app over the fakes, backends ``a`` and ``b`` of model
    ``m``."""

    def __init__(self, fakes: dict[str, FakeLlamaServer], redis_url: str,
                 refused: set[str], **sections: Any) -> None:
        async def route(request: httpx.Request) -> httpx.Response:
            host = request.url.host
            if host in refused:  # a server that went away refuses every path
                raise httpx.ConnectError("connection refused", request=request)
            return await fakes[host].handle(request)

        settings = load_settings(
            admission={"disconnect_grace_s": 0.0, **sections.pop("admission", {})},
            state={"backend": "redis", "redis_url": redis_url, "key_prefix": PREFIX,
                   "renew_interval_s": 0.2, "lease_ttl_s": 1.0, "poll_interval_s": 0.5,
                   "op_timeout_s": 0.5},
            backends=[{"name": n, "url": f"http://{n}:8080", "model": "m"}
                      for n in NAMES], **sections)
        self.app = create_app(settings, http_client=httpx.AsyncClient(
            transport=httpx.MockTransport(route)), registry=CollectorRegistry(),
            discover=False)
        self.state = self.app.state.gateway
        self.client = httpx.AsyncClient(transport=httpx.ASGITransport(app=self.app),
                                        base_url="http://gateway", timeout=30)

    @property
    def backends(self) -> list[Target]:
        return list(self.state.fleet.backends.values())

    @property
    def queue(self) -> ModelQueue:
        queue = self.state.fleet.queue_for(self.backends)
        assert queue is not None and isinstance(queue.grantor, SharedPoolGrantor)
        return queue

    def plan(self, tokens: int) -> list[Candidate]:
        """A request of ``tokens`` KV tokens planned on both backends."""
        return [Candidate(b, Charge(10, tokens - 10), {}) for b in self.backends]

    async def chat(self, content: str = "hello there", **extra: Any) -> httpx.Response:
        body = {"model": "m", "messages": [{"role": "user", "content": content}], **extra}
        return await self.client.post(CHAT, json=body)

    def idle(self) -> bool:
        """Nothing held or waiting in this process."""
        return not self.queue.waiting and all(
            b.admission.stats().inflight == 0 and b.admission.oldest_wait_s() == 0.0
            for b in self.backends)


class Redis:
    """What Redis holds for the two backends."""

    def __init__(self, url: str) -> None:
        self.client = aioredis.Redis.from_url(url)

    async def sums(self, name: str) -> tuple[int, int]:
        """(reserved tokens, busy slots) of backend ``name`` over every process."""
        tokens = slots = 0
        for value in await self.client.hvals(key(name, "leases")):
            _, tok, sl, _ = value.decode().split("|")
            tokens, slots = tokens + int(tok), slots + int(sl)
        return tokens, slots

    async def tickets(self, name: str) -> list[str]:
        return [m.decode() for m in await self.client.zrange(key(name, "queue"), 0, -1)]

    async def settled(self, timeout: float = 5.0) -> None:
        """Wait until no backend holds a lease or a ticket in Redis."""
        async def empty() -> bool:
            for name in NAMES:
                if await self.client.hlen(key(name, "leases")) or await self.tickets(name):
                    return False
            return True

        async def poll() -> None:
            while not await empty():
                await asyncio.sleep(0.02)
        await asyncio.wait_for(poll(), timeout)


async def resynced(url: str) -> None:
    """Wait for the end of the resync window a fresh Redis opens (nothing is granted
    before it: gateway/admission/shared.py)."""
    client = aioredis.Redis.from_url(url)
    try:
        while True:
            until_ms = await client.get(f"{PREFIX}:epoch")
            seconds, micros = await client.time()
            if until_ms is not None and int(until_ms) <= seconds * 1000 + micros // 1000:
                return
            await asyncio.sleep(0.05)
    finally:
        await close_bounded(client.aclose())


@pytest.fixture
def fakes() -> dict[str, FakeLlamaServer]:
    return {n: FakeLlamaServer() for n in NAMES}


@pytest.fixture
async def view(redis_server: Any) -> AsyncIterator[Redis]:
    v = Redis(redis_server.url)
    yield v
    await close_bounded(v.client.aclose())


@pytest.fixture
async def procs(fakes: dict[str, FakeLlamaServer], redis_server: Any
                ) -> AsyncIterator[Callable[..., Any]]:
    """``await procs(n, refused=set(), **sections)``: n started processes."""
    made: list[Proc] = []

    async def build(n: int = 2, refused: set[str] | None = None,
                    **sections: Any) -> list[Proc]:
        out = []
        for _ in range(n):
            p = Proc(fakes, redis_server.url, refused if refused is not None else set(),
                     **sections)
            await p.state.store.start()
            for backend in p.backends:
                await backend.discover()
            made.append(p)
            out.append(p)
        await resynced(redis_server.url)
        return out

    yield build
    for p in made:
        await p.client.aclose()
        await p.state.store.close()


def test_a_pool_with_redis_state_loads() -> None:
    settings = load_settings(state={"backend": "redis"}, backends=[
        {"name": n, "url": f"http://{n}:8080", "model": "m"} for n in NAMES])
    assert [b.model for b in settings.backends] == ["m", "m"]


async def test_an_overload_over_two_processes_never_passes_either_budget(
        procs: Any, fakes: dict[str, FakeLlamaServer], view: Redis) -> None:
    p1, p2 = await procs(2)
    for fake in fakes.values():
        fake.token_delay = 0.01  # 5 tokens: each answer takes ~50 ms
    peaks = {n: (0, 0) for n in NAMES}
    done = asyncio.Event()

    async def sample() -> None:
        while not done.is_set():
            for n in NAMES:
                tokens, slots = await view.sums(n)
                peaks[n] = (max(peaks[n][0], tokens), max(peaks[n][1], slots))
            await asyncio.sleep(0.002)

    sampler = asyncio.ensure_future(sample())
    # ~710 KV tokens each: two fit one backend's 2,048 cells, three do not.
    calls = [(p1 if i % 2 else p2).chat(f"question {i}", max_tokens=700)
             for i in range(24)]
    answers = await asyncio.wait_for(asyncio.gather(*calls), 60)
    done.set()
    await sampler
    assert [r.status_code for r in answers] == [200] * 24
    for n in NAMES:
        assert 0 < peaks[n][0] <= POOL_TOKENS and 0 < peaks[n][1] <= SLOTS, peaks
        assert fakes[n].peak <= 2, (n, fakes[n].peak)  # what the pool holds
        assert fakes[n].generations  # both backends served
    await view.settled()
    assert p1.idle() and p2.idle()


async def test_the_first_to_arrive_on_any_process_goes_first(procs: Any) -> None:
    p1, p2 = await procs(2)
    # Both backends full: 1,600 of 2,048 each; 1,200 more fits neither.
    fills = [await asyncio.wait_for(p1.queue.admit(p1.plan(1600)), 2) for _ in NAMES]
    assert {c.backend.name for c, _ in fills} == set(NAMES)
    order: list[str] = []
    held: dict[str, tuple[Target, Lease]] = {}

    async def want(p: Proc, tag: str) -> None:
        candidate, lease = await p.queue.admit(p.plan(1200))
        order.append(tag)
        held[tag] = (candidate.backend, lease)

    tags = [f"{i}-{'p1' if i % 2 else 'p2'}" for i in range(6)]
    tasks = []
    for i, tag in enumerate(tags):  # alternating processes, 30 ms apart
        tasks.append(asyncio.ensure_future(want(p1 if i % 2 else p2, tag)))
        await asyncio.sleep(0.03)
    assert order == []
    # Each release makes room on its backend for one of them; the oldest lease first.
    pending = [(c.backend, lease) for c, lease in fills]
    while len(order) < len(tags):
        backend, lease = pending.pop(0)
        n = len(order)
        backend.admission.release(lease)
        await until(lambda n=n: len(order) == n + 1)
        pending.append(held[order[-1]])
    await asyncio.gather(*tasks)
    assert order == tags
    for backend, lease in pending:
        backend.admission.release(lease)


async def test_a_request_goes_where_it_fits_and_keeps_its_affinity(
        procs: Any, fakes: dict[str, FakeLlamaServer], view: Redis) -> None:
    (p1,) = await procs(1)
    # Backend a is full for a 1,200-token request (other process's lease, in Redis).
    (p2,) = await procs(1)
    a, _ = p2.backends
    blocker = await asyncio.wait_for(
        p2.queue.admit([Candidate(a, Charge(10, 1590), {})]), 2)
    candidate, lease = await asyncio.wait_for(p1.queue.admit(p1.plan(1200)), 2)
    assert candidate.backend.name == "b"
    candidate.backend.admission.release(lease)
    a.admission.release(blocker[1])
    await view.settled()
    # A conversation goes back to the backend that served it last (the affinity bonus
    # outweighs the other backend's room).
    r = await p1.chat("tell me a story", max_tokens=10)
    first = next(n for n, f in fakes.items() if f.generations)
    assert r.status_code == 200
    for _ in range(3):
        assert (await p1.chat("tell me a story", max_tokens=10)).status_code == 200
    assert len(fakes[first].generations) == 4
    await view.settled()
    assert p1.idle() and p2.idle()


async def test_a_refused_backend_fails_over_and_is_marked_down_in_every_process(
        procs: Any, fakes: dict[str, FakeLlamaServer], view: Redis) -> None:
    refused: set[str] = set()
    p1, p2 = await procs(2, refused=refused)
    refused.add("a")  # after discovery: both processes know a, which then goes away
    r = await p1.chat(max_tokens=10)
    assert r.status_code == 200
    a = p1.state.fleet.backends["a"]
    # Sent to a (first of equals), refused, sent again to b.
    assert not a.usable(p1.state.clock.now()) and len(fakes["b"].generations) == 1
    # While a is down, requests go to b only, in p2 too: the mark is shared
    # (gateway.admission.shared_marks).
    refused.clear()
    for _ in range(3):
        assert (await p1.chat(max_tokens=10)).status_code == 200
    assert len(fakes["b"].generations) == 4
    assert (await p2.chat(max_tokens=10)).status_code == 200
    assert len(fakes["b"].generations) == 5 and not fakes["a"].generations
    await view.settled()
    assert p1.idle() and p2.idle()


async def _tickets_are(view: Redis, **counts: int) -> bool:
    for name, n in counts.items():
        if len(await view.tickets(name)) != n:
            return False
    return True


async def test_down_and_draining_backends_are_skipped_and_left(
        procs: Any, view: Redis) -> None:
    p1, p2 = await procs(2)
    # Both backends full (p2's leases); p1's request waits in both shared queues.
    fills = [await asyncio.wait_for(p2.queue.admit(p2.plan(1600)), 2) for _ in NAMES]
    a, b = p1.backends
    waiting = asyncio.ensure_future(p1.queue.admit(p1.plan(1200)))
    await until(lambda: p1.queue.waiting == 1)
    await asyncio.sleep(0.1)
    assert len(await view.tickets("a")) == 1 and len(await view.tickets("b")) == 1
    p1.state.fleet.mark_failed(a, p1.queue)  # down in p1: its ticket on a is withdrawn
    await until_redis(lambda: _tickets_are(view, a=0))
    assert len(await view.tickets("b")) == 1
    by_name = {c.backend.name: (c, lease) for c, lease in fills}
    p2.backends[0].admission.release(by_name["a"][1])  # room on a: not for p1 now
    await asyncio.sleep(0.2)
    assert not waiting.done()
    b.set_draining(True)  # and b drains: p1's request waits on no backend
    await until_redis(lambda: _tickets_are(view, b=0))
    p2.backends[1].admission.release(by_name["b"][1])
    await asyncio.sleep(0.2)
    assert not waiting.done()
    b.set_draining(False)  # b takes requests again: the waiter is placed there
    candidate, lease = await asyncio.wait_for(waiting, 3)
    assert candidate.backend is b
    b.admission.release(lease)
    await view.settled()
    assert p1.idle() and p2.idle()


async def test_a_full_queue_and_a_timeout_are_refused_as_with_memory_state(
        procs: Any, fakes: dict[str, FakeLlamaServer], view: Redis) -> None:
    p1, p2 = await procs(2, admission={"max_queue": 1, "max_queue_wait_s": 0.5})
    fills = [await asyncio.wait_for(p2.queue.admit(p2.plan(1600)), 2) for _ in NAMES]
    first = asyncio.ensure_future(p1.chat(max_tokens=1190))
    await until(lambda: p1.queue.waiting == 1)
    await asyncio.sleep(0.1)  # the grant script has seen it wait on both backends
    full = await p1.chat(max_tokens=1190)
    assert full.status_code == 503 and full.json()["error"]["code"] == "queue_full"
    assert int(full.headers["retry-after"]) >= 1
    with pytest.raises(QueueFull):
        p1.queue.check_room()
    timed_out = await asyncio.wait_for(first, 3)
    assert timed_out.status_code == 503
    assert timed_out.json()["error"]["code"] == "queue_timeout"
    assert "any backend of its model" in timed_out.json()["error"]["message"]
    assert int(timed_out.headers["retry-after"]) >= 1
    with pytest.raises(QueueTimeout):
        await p1.queue.admit(p1.plan(1200))
    for candidate, lease in fills:
        candidate.backend.admission.release(lease)
    await view.settled()
    assert not any(f.generations for f in fakes.values())
    assert p1.idle() and p2.idle()


async def test_every_lease_is_given_back(procs: Any, view: Redis) -> None:
    p1, p2 = await procs(2)
    # Room on both: both may grant, one lease is kept, the other given back.
    for _ in range(5):
        candidate, lease = await asyncio.wait_for(p1.queue.admit(p1.plan(1000)), 2)
        await asyncio.sleep(0.05)
        assert await view.sums(candidate.backend.name) == (1000, 1)
        other = next(n for n in NAMES if n != candidate.backend.name)
        assert await view.sums(other) == (0, 0)
        candidate.backend.admission.release(lease)
        await view.settled()
    # A waiter cancelled (its client left) leaves both queues.
    fills = [await asyncio.wait_for(p2.queue.admit(p2.plan(1600)), 2) for _ in NAMES]
    waiting = asyncio.ensure_future(p1.queue.admit(p1.plan(1200)))
    await asyncio.sleep(0.1)
    waiting.cancel()
    await asyncio.gather(waiting, return_exceptions=True)
    await asyncio.sleep(0.1)
    assert await view.tickets("a") == [] and await view.tickets("b") == []
    for candidate, lease in fills:
        candidate.backend.admission.release(lease)
    await view.settled()
    assert p1.idle() and p2.idle()


async def test_a_dead_process_s_pool_leases_expire(procs: Any, view: Redis) -> None:
    p1, p2 = await procs(2)
    fills = [await asyncio.wait_for(p1.queue.admit(p1.plan(1600)), 2) for _ in NAMES]
    assert {c.backend.name for c, _ in fills} == set(NAMES)
    # p1 dies: no renewal, nothing released (kill -9).
    p1.state.store.shared._running = False
    for task in list(p1.state.store.shared._tasks):
        task.cancel()
    loop = asyncio.get_running_loop()
    started = loop.time()
    candidate, lease = await asyncio.wait_for(p2.queue.admit(p2.plan(1600)), 10)
    assert 0.7 < loop.time() - started < 5.0  # after the TTL (1 s), soon after
    candidate.backend.admission.release(lease)
