"""Adversarial tests of ``[state] backend = "redis"`` (gateway/admission/shared.py,
shared_tenants.py): several apps ("processes") in one event loop, sharing one real
``redis-server`` (tests/realredis.py), in front of the fake llama-server of
tests/fakes.py. After each scenario, what Redis holds for the backend (its leases hash
and queue) and each app's local admission figures must be back to nothing."""

from __future__ import annotations

import asyncio
import hashlib
import json
from collections.abc import AsyncIterator, Callable
from typing import Any

import pytest
import redis.asyncio as aioredis
from prometheus_client import CollectorRegistry
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff
from redis.exceptions import ConnectionError as RedisConnectionError

from gateway.admission.shared import close_bounded
from gateway.config import load_settings
from gateway.http.app import create_app
from tests.conftest import Harness
from tests.fakes import FakeLlamaServer

CHAT = "/v1/chat/completions"
PREFIX = "atk"


def chat_body(content: str = "hello there", **extra: Any) -> dict[str, Any]:
    return {"messages": [{"role": "user", "content": content}], **extra}


async def until(check: Callable[[], bool], timeout: float = 5.0) -> None:
    """Wait (polling) until ``check()`` holds; fail after ``timeout`` seconds."""
    async def poll() -> None:
        while not check():
            await asyncio.sleep(0.01)
    await asyncio.wait_for(poll(), timeout)


#: Backend ``local`` at ``http://upstream:8080`` as the shared state names it
#: (``{name}@{8 hex digits of the URL's SHA-256}``).
LOCAL = "local@" + hashlib.sha256(b"http://upstream:8080").hexdigest()[:8]


class RedisView:
    """What Redis holds for backend ``local`` under :data:`PREFIX`."""

    def __init__(self, url: str, prefix: str = PREFIX) -> None:
        # Reconnects once when Redis restarted under it.
        self.client = aioredis.Redis.from_url(
            url, retry=Retry(NoBackoff(), 2), retry_on_error=[RedisConnectionError])
        self.prefix = prefix

    async def leases(self) -> dict[str, str]:
        raw = await self.client.hgetall(f"{self.prefix}:b:{LOCAL}:leases")
        return {k.decode(): v.decode() for k, v in raw.items()}

    async def queue(self) -> list[str]:
        return [m.decode() for m in
                await self.client.zrange(f"{self.prefix}:b:{LOCAL}:queue", 0, -1)]

    async def settled(self, timeout: float = 5.0) -> None:
        """Wait until the backend's leases and queue are empty in Redis."""
        async def poll() -> None:
            while await self.leases() or await self.queue():
                await asyncio.sleep(0.02)
        try:
            await asyncio.wait_for(poll(), timeout)
        except TimeoutError:
            raise AssertionError(f"Redis still holds leases {await self.leases()} and "
                                 f"tickets {await self.queue()}") from None


def idle(h: Harness) -> bool:
    """The app's own admission holds nothing and nobody waits."""
    s = h.backend.admission
    return s._inflight == 0 and not s._room and not s._grantor.account.leases


@pytest.fixture
def redis_server(tmp_path: Any) -> Any:
    """A real redis-server that takes DEBUG from loopback (DEBUG SLEEP stalls it)."""
    from tests.realredis import RedisServer

    server = RedisServer(tmp_path, extra=("--enable-debug-command", "local")).start()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture
async def view(redis_server: Any) -> AsyncIterator[RedisView]:
    v = RedisView(redis_server.url)
    yield v
    await close_bounded(v.client.aclose())


@pytest.fixture
async def apps(fake: FakeLlamaServer, redis_server: Any
               ) -> AsyncIterator[Callable[..., Any]]:
    """``await apps(n, state={...}, admission={...}, tenants=[...])``: n apps sharing
    the redis server, each started (store and discovery)."""
    made: list[Harness] = []

    async def build(n: int = 2, *, state: dict[str, Any] | None = None,
                    admission: dict[str, Any] | None = None, clock: Any = None,
                    **sections: Any) -> list[Harness]:
        out = []
        for _ in range(n):
            settings = load_settings(
                admission={"disconnect_grace_s": 0.0, **(admission or {})},
                state={"backend": "redis", "redis_url": redis_server.url,
                       "key_prefix": PREFIX, "renew_interval_s": 0.2,
                       "lease_ttl_s": 1.0, "poll_interval_s": 0.5, "op_timeout_s": 0.5,
                       **(state or {})},
                backends=[{"name": "local", "url": "http://upstream:8080"}], **sections)
            app = create_app(settings, http_client=fake.client(),
                             registry=CollectorRegistry(), discover=False, clock=clock)
            h = Harness(app, fake)
            await h.state.store.start()
            await h.backend.discover()
            made.append(h)
            out.append(h)
        return out

    yield build
    for h in made:
        await h.aclose()


def scope_of(path: str, body: bytes, headers: list[tuple[bytes, bytes]] = ()
             ) -> dict[str, Any]:
    return {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1",
            "method": "POST", "scheme": "http", "path": path, "raw_path": path.encode(),
            "query_string": b"", "root_path": "", "client": ("127.0.0.1", 1),
            "server": ("gateway", 80),
            "headers": [(b"content-type", b"application/json"),
                        (b"content-length", str(len(body)).encode()), *headers]}


class RawCall:
    """One request driven through the app's ASGI interface, whose client leaves (its
    ``receive`` answers ``http.disconnect``) when :meth:`leave` is called."""

    def __init__(self, h: Harness, body: dict[str, Any],
                 headers: list[tuple[bytes, bytes]] = ()) -> None:
        data = json.dumps(body).encode()
        self.sent: list[dict[str, Any]] = []
        self._gone = asyncio.Event()
        self._body_sent = False

        async def receive() -> dict[str, Any]:
            if not self._body_sent:
                self._body_sent = True
                return {"type": "http.request", "body": data, "more_body": False}
            await self._gone.wait()
            return {"type": "http.disconnect"}

        async def send(message: dict[str, Any]) -> None:
            if self._gone.is_set():
                raise OSError("client gone")
            self.sent.append(message)

        self.task = asyncio.ensure_future(h.app(scope_of(CHAT, data, list(headers)),
                                                receive, send))

    def leave(self) -> None:
        self._gone.set()

    @property
    def status(self) -> int | None:
        for m in self.sent:
            if m["type"] == "http.response.start":
                return int(m["status"])
        return None


# -- leases that are never given back ---------------------------------------------------

async def test_client_leaving_while_queued_leaves_nothing(apps: Any, view: RedisView,
                                                          fake: FakeLlamaServer) -> None:
    a, b = await apps(2)
    fake.hold = asyncio.Event()
    running = [RawCall(h, chat_body(max_tokens=400)) for h in (a, b, a, b)]
    await until(lambda: fake.active == 4)
    waiting = [RawCall(h, chat_body(max_tokens=400)) for h in (a, b)]
    await until(lambda: len(a.backend.admission._room) == 1
                and len(b.backend.admission._room) == 1)
    await asyncio.sleep(0.3)
    assert len(await view.queue()) == 2
    for call in waiting:
        call.leave()
    await asyncio.wait_for(asyncio.gather(*(c.task for c in waiting)), 5)
    assert len(await view.queue()) == 0
    fake.hold.set()
    await asyncio.wait_for(asyncio.gather(*(c.task for c in running)), 5)
    assert [c.status for c in running] == [200] * 4
    await view.settled()
    await until(lambda: idle(a) and idle(b))


async def test_client_leaving_mid_stream_leaves_nothing(apps: Any, view: RedisView,
                                                        fake: FakeLlamaServer) -> None:
    a, b = await apps(2)
    fake.tokens, fake.token_delay = 50, 0.02
    calls = [RawCall(h, chat_body(stream=True, max_tokens=100)) for h in (a, b, a, b)]
    await until(lambda: fake.active == 4)
    assert len(await view.leases()) == 4
    for call in calls:
        call.leave()
    await asyncio.wait_for(asyncio.gather(*(c.task for c in calls),
                                          return_exceptions=True), 5)
    await view.settled()
    await until(lambda: idle(a) and idle(b))


@pytest.mark.parametrize("mode", ["connect", "boom", "overflow", "midstream", "loading",
                                  "truncated", "midstream_overflow", "bad_request"])
@pytest.mark.parametrize("stream", [False, True])
async def test_upstream_failures_give_back_every_lease(apps: Any, view: RedisView,
                                                       fake: FakeLlamaServer, mode: str,
                                                       stream: bool) -> None:
    a, b = await apps(2)
    fake.mode = mode
    rs = await asyncio.wait_for(asyncio.gather(
        *(h.client.post(CHAT, json=chat_body(stream=stream, max_tokens=50))
          for h in (a, b, a, b, a, b))), 20)
    assert all(r.status_code < 600 for r in rs)
    await view.settled()
    await until(lambda: idle(a) and idle(b))


async def test_burst_over_three_apps_never_passes_the_slots(apps: Any, view: RedisView,
                                                           fake: FakeLlamaServer) -> None:
    fake.slots = 2
    fake.tokens, fake.token_delay = 3, 0.005
    hs = await apps(3, admission={"max_queue": 200, "max_queue_wait_s": 60})
    peak_leases = 0
    done = asyncio.Event()

    async def sample() -> None:
        nonlocal peak_leases
        while not done.is_set():
            peak_leases = max(peak_leases, len(await view.leases()))
            await asyncio.sleep(0.005)

    sampler = asyncio.ensure_future(sample())
    rs = await asyncio.wait_for(asyncio.gather(
        *(hs[i % 3].client.post(CHAT, json=chat_body(max_tokens=20, stream=i % 2 == 0))
          for i in range(120))), 60)
    done.set()
    await sampler
    assert sorted({r.status_code for r in rs}) == [200]
    assert fake.peak <= 2
    assert peak_leases <= 2
    await view.settled()
    await until(lambda: all(idle(h) for h in hs))


# -- the heartbeat racing a grant -------------------------------------------------------

def unit_settings(url: str, **kw: Any) -> Any:
    from gateway.config import StateSettings
    base: dict[str, Any] = {"backend": "redis", "redis_url": url, "key_prefix": PREFIX,
                            "renew_interval_s": 30.0, "lease_ttl_s": 120.0,
                            "poll_interval_s": 5.0, "op_timeout_s": 3.0}
    return StateSettings(**{**base, **kw})


async def stall_redis(url: str, seconds: float) -> asyncio.Future[Any]:
    """Make Redis sleep ``seconds`` (DEBUG SLEEP from a client of its own); returns once
    it sleeps, with the future of that client's call."""
    other = aioredis.Redis.from_url(url)

    async def run() -> None:
        try:
            await other.execute_command("DEBUG", "SLEEP", seconds)
        finally:
            await close_bounded(other.aclose())
    blocker = asyncio.ensure_future(run())
    await asyncio.sleep(0.05)
    return blocker


async def test_a_heartbeat_during_a_grant_keeps_the_lease(redis_server: Any,
                                                          view: RedisView) -> None:
    """The heartbeat's call, sent while a grant was on its way, republished this
    process's leases as they were before the grant's reply: Redis ran the grant, then
    the heartbeat, which deleted the lease just granted (and queued its ticket again).
    The process went on with a lease Redis no longer counted, so others could be granted
    its capacity: measured over three apps, 4 streams at once on a 2-slot backend."""
    from gateway.admission.admission import Admission
    from gateway.admission.shared import SharedStore
    from gateway.admission.shared_grant import SharedGrantor
    from gateway.clock import MonotonicClock
    from gateway.core.capacity import Charge, Layout

    store = SharedStore(unit_settings(redis_server.url), clock=MonotonicClock(),
                        owner="A")
    await view.client.set(f"{PREFIX}:epoch", 0)  # no resync window (Redis is not new)
    await store.start()
    try:
        adm = Admission(Layout(slots=2, ctx_per_slot=2048, pool_tokens=4096),
                        max_queue=10, max_wait_s=10.0, grantor=SharedGrantor(store.account("local", "http://upstream:8080")))
        blocker = await stall_redis(redis_server.url, 0.4)
        admit = asyncio.ensure_future(adm.admit(Charge(10, 10)))
        await asyncio.sleep(0.05)  # the grant is sent, and waits behind the sleep
        beat = asyncio.ensure_future(store.heartbeat())
        lease = await asyncio.wait_for(admit, 5)
        await asyncio.wait_for(beat, 5)
        await blocker
        assert list(await view.leases()) == [lease.shared_id]
        assert await view.queue() == []
        adm.release(lease)
        await view.settled()
    finally:
        await store.close()


async def test_a_heartbeat_during_a_tenant_acquire_keeps_the_place(
        redis_server: Any, view: RedisView) -> None:
    """The same race on a tenant's max_inflight places: the heartbeat sent while an
    acquire was on its way made this process's places those before it, dropping the one
    just taken, so another process could pass the tenant's max_inflight."""
    from gateway.admission.shared import SharedStore
    from gateway.clock import MonotonicClock

    store = SharedStore(unit_settings(redis_server.url), clock=MonotonicClock(),
                        owner="A")
    await store.start()
    try:
        share = store.tenant("web")
        blocker = await stall_redis(redis_server.url, 0.4)
        taken = asyncio.ensure_future(share.acquire(1))
        await asyncio.sleep(0.05)
        # The heartbeat's renewal of the tenant's places (the part of heartbeat() that
        # raced; what comes before it in heartbeat() only delays it).
        beat = asyncio.ensure_future(store.renew_tenant(share))
        assert await asyncio.wait_for(taken, 5)
        await asyncio.wait_for(beat, 5)
        await blocker
        places = await view.client.zrange(f"{PREFIX}:t:web:inflight", 0, -1)
        assert [p.decode() for p in places] == share.held
        share.release()
        for _ in range(100):
            if not await view.client.zcard(f"{PREFIX}:t:web:inflight"):
                break
            await asyncio.sleep(0.02)
        assert not await view.client.zcard(f"{PREFIX}:t:web:inflight")
    finally:
        await store.close()


# -- Redis restarted, stalled, unreachable ----------------------------------------------

async def test_a_redis_restart_is_not_taken_for_a_late_renewal(
        redis_server: Any, view: RedisView, caplog: pytest.LogCaptureFixture) -> None:
    """After Redis restarted empty, the first process to call opened the resync window;
    every other process then found itself absent from ``procs`` and took that for its own
    late renewal: an ERROR ("renewed its liveness later than lease_ttl_s ... may
    overflow") and a ``renewed_late`` expiry, though nobody had been taken for dead."""
    from gateway.admission.admission import Admission
    from gateway.admission.shared import SharedStore
    from gateway.admission.shared_grant import SharedGrantor
    from gateway.clock import MonotonicClock
    from gateway.core.capacity import Charge, Layout

    expiries: list[tuple[int, str]] = []
    stores, leases = [], []
    await view.client.set(f"{PREFIX}:epoch", 0)
    for name in ("A", "B"):
        store = SharedStore(unit_settings(redis_server.url, renew_interval_s=0.2,
                                          lease_ttl_s=5.0, op_timeout_s=0.5),
                            clock=MonotonicClock(), owner=name,
                            on_expired=lambda n, why: expiries.append((n, why)))
        await store.start()
        adm = Admission(Layout(slots=4, ctx_per_slot=2048, pool_tokens=8192),
                        max_queue=10, max_wait_s=10.0, grantor=SharedGrantor(store.account("local", "http://upstream:8080")))
        stores.append(store)
        leases.append((adm, await asyncio.wait_for(adm.admit(Charge(10, 10)), 5)))
    try:
        redis_server.stop()
        redis_server.start()  # the same port, every key lost
        await asyncio.sleep(1.5)  # several renewals of both
        assert len(await view.leases()) == 2  # both republished
        assert expiries == []
        assert "later than lease_ttl_s" not in caplog.text
    finally:
        for adm, lease in leases:
            adm.release(lease)
        for store in stores:
            await store.close()


# -- passwords and the [state] section ---------------------------------------------------

SECRET = "s3cret-Pw"


def write_config(tmp_path: Any, url: str, extra: str = "") -> str:
    path = tmp_path / "gateway.toml"
    path.write_text(f'[state]\nbackend = "redis"\nredis_url = "{url}"\n{extra}\n'
                    '[[backends]]\nname = "local"\nurl = "http://127.0.0.1:8080"\n')
    return str(path)


@pytest.mark.parametrize("url", [f"redis://:{SECRET}@127.0.0.1:6379/0",
                                 f"rediss://user:{SECRET}@cache.internal:6380/1",
                                 f"unix://:{SECRET}@/run/redis.sock",
                                 f"redis://127.0.0.1:6379/0?password={SECRET}"])
def test_check_config_never_prints_the_redis_password(tmp_path: Any, url: str,
                                                      capsys: pytest.CaptureFixture[str]
                                                      ) -> None:
    """check-config printed the effective settings with redis_url as written, password
    and all (docs/replicas.md: "a password goes in the URL (it is never logged)")."""
    from gateway.__main__ import main

    assert main(["check-config", write_config(tmp_path, url)]) == 0
    out = capsys.readouterr()
    assert SECRET not in out.out + out.err
    shown = json.loads(out.out)["state"]["redis_url"]
    assert "***" in shown and shown.split("://")[0] == url.split("://")[0]


@pytest.mark.parametrize("url", [f"http://:{SECRET}@127.0.0.1:6379/0",
                                 f"redis://:{SECRET}@127.0.0.1:notaport/0",
                                 f"redis://:{SECRET}@[::1/0",
                                 f"redis://:{SECRET}@127.0.0.1:6379/0?socket_timeout=x"])
def test_check_config_refuses_an_unreadable_redis_url_without_its_password(
        tmp_path: Any, url: str, capsys: pytest.CaptureFixture[str]) -> None:
    """A URL of another scheme was refused with the password in the message; one the
    Redis client cannot read (a port that is not a number) passed check-config and then
    stopped ``gateway serve`` with a ValueError from inside create_app."""
    from gateway.__main__ import main

    assert main(["check-config", write_config(tmp_path, url)]) == 2
    err = capsys.readouterr().err
    assert "redis_url" in err
    assert SECRET not in err


def test_the_password_is_never_logged(tmp_path: Any, caplog: pytest.LogCaptureFixture
                                      ) -> None:
    from gateway.admission.shared import SharedStore
    from gateway.clock import MonotonicClock

    for url in (f"redis://:{SECRET}@127.0.0.1:1/0", f"redis://127.0.0.1:1/0?password={SECRET}"):
        store = SharedStore(unit_settings(url), clock=MonotonicClock())
        assert SECRET not in store._where()
        assert "127.0.0.1:1" in store._where()


async def build_one(fake: FakeLlamaServer, url: str, **state: Any) -> Harness:
    settings = load_settings(
        admission={"disconnect_grace_s": 0.0},
        state={"backend": "redis", "redis_url": url, "key_prefix": PREFIX,
               "renew_interval_s": 0.2, "lease_ttl_s": 1.0, "op_timeout_s": 0.3, **state},
        backends=[{"name": "local", "url": "http://upstream:8080"}])
    h = Harness(create_app(settings, http_client=fake.client(),
                           registry=CollectorRegistry(), discover=False), fake)
    await h.state.store.start()
    await h.backend.discover()
    return h


async def test_a_wrong_redis_url_refuses_requests_and_ready_says_why(
        fake: FakeLlamaServer, caplog: pytest.LogCaptureFixture) -> None:
    """Nothing listens at the URL: the app starts, each request gets 503
    state_unavailable with Retry-After and never reaches the backend, and /ready says
    the shared state is down (its body had only the backends, all ready)."""
    from gateway.dev.localbackend import free_port

    h = await build_one(fake, f"redis://:{SECRET}@127.0.0.1:{free_port()}/0")
    try:
        before = len(fake.generations)
        r = await h.chat()
        assert r.status_code == 503, r.text
        assert r.json()["error"]["code"] == "state_unavailable"
        assert int(r.headers["retry-after"]) >= 1
        assert len(fake.generations) == before
        ready = (await h.client.get("/ready")).json()
        assert ready["state"] == {"backend": "redis", "up": False}
        assert h.sample("gateway_state_up") == 0
        assert SECRET not in caplog.text
        assert caplog.text.count("cannot be reached") == 1
    finally:
        await h.client.aclose()
        await h.state.store.close()


@pytest.fixture
def locked_redis(tmp_path: Any) -> Any:
    from tests.realredis import RedisServer

    server = RedisServer(tmp_path, extra=("--requirepass", SECRET), password=SECRET)
    server.start()
    try:
        yield server
    finally:
        server.stop()


async def test_a_password_protected_redis(locked_redis: Any, fake: FakeLlamaServer,
                                          caplog: pytest.LogCaptureFixture) -> None:
    port = locked_redis.port
    without = await build_one(fake, f"redis://127.0.0.1:{port}/0")
    wrong = await build_one(fake, f"redis://:nope-{SECRET}@127.0.0.1:{port}/0")
    right = await build_one(fake, f"redis://:{SECRET}@127.0.0.1:{port}/0")
    try:
        for h in (without, wrong):
            r = await h.chat()
            assert r.status_code == 503, r.text
            assert r.json()["error"]["code"] == "state_unavailable"
        r = await right.chat()
        assert r.status_code == 200, r.text
        assert (await right.client.get("/ready")).json()["state"]["up"] is True
        assert SECRET not in caplog.text
    finally:
        for h in (without, wrong, right):
            await h.client.aclose()
            await h.state.store.close()


async def test_a_stalled_redis_refuses_cleanly_and_leaves_nothing(
        apps: Any, view: RedisView, fake: FakeLlamaServer, redis_server: Any) -> None:
    """Redis stalls 2 s (longer than op_timeout_s) while requests arrive and others
    stream: the new ones get 503 state_unavailable, the running ones finish, and once
    Redis answers again the grants that ran late in Redis (after the caller gave up)
    are dropped, nothing stays reserved, and new requests are served."""
    a, b = await apps(2)
    fake.hold = asyncio.Event()
    running = [RawCall(h, chat_body(max_tokens=50)) for h in (a, b)]
    await until(lambda: fake.active == 2)
    blocker = await stall_redis(redis_server.url, 2)
    arriving = await asyncio.wait_for(asyncio.gather(
        *(h.client.post(CHAT, json=chat_body(max_tokens=50)) for h in (a, b, a, b))), 10)
    assert [r.status_code for r in arriving] == [503] * 4
    assert {r.json()["error"]["code"] for r in arriving} == {"state_unavailable"}
    fake.hold.set()
    await asyncio.wait_for(asyncio.gather(*(c.task for c in running)), 10)
    assert [c.status for c in running] == [200, 200]
    await blocker
    await view.settled()
    await until(lambda: idle(a) and idle(b))
    rs = await asyncio.wait_for(asyncio.gather(
        *(h.client.post(CHAT, json=chat_body(max_tokens=50)) for h in (a, b, a, b))), 10)
    assert [r.status_code for r in rs] == [200] * 4
    await view.settled()


async def test_a_redis_restart_with_requests_in_flight(
        apps: Any, view: RedisView, fake: FakeLlamaServer, redis_server: Any) -> None:
    fake.slots = 2
    a, b = await apps(2)
    fake.hold = asyncio.Event()
    running = [RawCall(h, chat_body(max_tokens=50)) for h in (a, b)]
    await until(lambda: fake.active == 2)
    redis_server.stop()
    redis_server.start()
    await asyncio.sleep(0.1)
    # Both republish their leases; while they do, and after, nothing else fits.
    late = [asyncio.ensure_future(h.client.post(CHAT, json=chat_body(max_tokens=50)))
            for h in (a, b)]
    await asyncio.sleep(1.0)
    assert len(await view.leases()) == 2
    assert fake.active == 2 and fake.peak == 2
    fake.hold.set()
    await asyncio.wait_for(asyncio.gather(*(c.task for c in running)), 10)
    rs = await asyncio.wait_for(asyncio.gather(*late), 10)
    assert [c.status for c in running] == [200, 200]
    assert all(r.status_code in (200, 503) for r in rs), [r.text for r in rs]
    assert fake.peak == 2
    await view.settled()
    await until(lambda: idle(a) and idle(b))


# -- tenants over several processes -------------------------------------------------------

def tenants_with(**web: Any) -> dict[str, Any]:
    from tests.test_tenants import CLASSES, TENANTS
    return {"classes": CLASSES, "tenants": [{**TENANTS[0], **web}, TENANTS[1]]}


def web() -> list[tuple[bytes, bytes]]:
    from tests.test_tenants import WEB_KEY
    return [(b"authorization", f"Bearer {WEB_KEY}".encode())]


async def tenant_keys(view: RedisView) -> tuple[list[str], list[str]]:
    """(the web tenant's tokens window entries, its max_inflight places) in Redis."""
    window = [m.decode() for m in await view.client.zrange(f"{PREFIX}:t:web:tpm", 0, -1)]
    places = [m.decode() for m in
              await view.client.zrange(f"{PREFIX}:t:web:inflight", 0, -1)]
    return window, places


async def test_requests_refused_after_the_hold_give_back_their_tokens(
        apps: Any, view: RedisView, fake: FakeLlamaServer) -> None:
    """Shared case P11: a request refused (here the queue is full) uses no quota."""
    fake.slots = 1
    a, b = await apps(2, admission={"max_queue": 0}, **tenants_with(tokens_per_minute=1000))
    fake.hold = asyncio.Event()
    running = RawCall(a, chat_body(max_tokens=20), web())
    await until(lambda: fake.active == 1)
    refused = await asyncio.gather(*(h.client.post(CHAT, json=chat_body(max_tokens=20),
                                                   headers=dict(web()))
                                     for h in (a, b, a, b)))
    assert [r.status_code for r in refused] == [503] * 4
    fake.hold.set()
    await asyncio.wait_for(running.task, 5)
    await asyncio.sleep(0.3)  # settles run in the background
    window, _ = await tenant_keys(view)
    # The served request's prompt and completion only.
    assert len(window) == 2, window
    await view.settled()


async def test_max_inflight_places_survive_disconnects_and_refusals(
        apps: Any, view: RedisView, fake: FakeLlamaServer) -> None:
    a, b = await apps(2, admission={"max_queue": 1},
                      **tenants_with(max_inflight=2, max_queued=10))
    fake.hold = asyncio.Event()
    first = [RawCall(h, chat_body(max_tokens=20), web()) for h in (a, b)]
    await until(lambda: fake.active == 2)
    assert len((await tenant_keys(view))[1]) == 2
    # Two more wait at the gate (one per app), then leave.
    gated = [RawCall(h, chat_body(max_tokens=20), web()) for h in (a, b)]
    await until(lambda: all(h.state.tenants.by_name["web"].waiting == 1 for h in (a, b)))
    for call in gated:
        call.leave()
    await asyncio.wait_for(asyncio.gather(*(c.task for c in gated)), 5)
    # One running request's client leaves too.
    first[0].leave()
    await asyncio.wait_for(first[0].task, 5)
    await until(lambda: fake.active == 1)
    fake.hold.set()
    await asyncio.wait_for(first[1].task, 5)
    assert first[1].status == 200
    for _ in range(50):
        if not (await tenant_keys(view))[1]:
            break
        await asyncio.sleep(0.02)
    assert (await tenant_keys(view))[1] == []
    for h in (a, b):
        t = h.state.tenants.by_name["web"]
        assert (t.inflight, t.waiting, t.quota.held) == (0, 0, [])
    await view.settled()
    await until(lambda: idle(a) and idle(b))
    # And the quota still lets two through at once.
    rs = await asyncio.gather(*(h.client.post(CHAT, json=chat_body(max_tokens=20),
                                              headers=dict(web())) for h in (a, b)))
    assert [r.status_code for r in rs] == [200, 200]


# -- max_queue with a shared queue --------------------------------------------------------

async def test_max_queue_zero_still_serves_what_fits(apps: Any, fake: FakeLlamaServer,
                                                     view: RedisView) -> None:
    """With shared state every request passes through the local queue on its way to the
    grant script, and the queue bound counted it: with ``max_queue = 0`` ("never wait")
    every request was refused with 503 queue_full "(0 waiting)", on an idle backend."""
    a, b = await apps(2, admission={"max_queue": 0})
    for h in (a, b):
        r = await h.chat(max_tokens=20)
        assert r.status_code == 200, r.text
    fake.hold = asyncio.Event()
    calls = [RawCall(h, chat_body(max_tokens=20)) for h in (a, b, a, b)]
    await until(lambda: fake.active == 4)
    r = await b.chat(max_tokens=20)  # the fifth cannot start now, and may not wait
    assert r.status_code == 503 and r.json()["error"]["code"] == "queue_full", r.text
    fake.hold.set()
    await asyncio.wait_for(asyncio.gather(*(c.task for c in calls)), 5)
    await view.settled()
    await until(lambda: idle(a) and idle(b))


@pytest.mark.parametrize("shared", [False, True])
async def test_a_burst_is_bounded_as_with_memory_state(
        apps: Any, fake: FakeLlamaServer, shared: bool, harness_factory: Any) -> None:
    """A burst of 10 on an idle 4-slot backend with ``max_queue = 2``: 4 start, 2 wait,
    4 are refused, whichever the state (shared, the bound counted the requests on their
    way to their first grant too, and refused 8)."""
    fake.hold = asyncio.Event()
    if shared:
        (h,) = await apps(1, admission={"max_queue": 2})
    else:
        h = await harness_factory({"max_queue": 2})
    burst = [asyncio.ensure_future(h.chat(max_tokens=20)) for _ in range(10)]
    await until(lambda: fake.active == 4)
    await asyncio.sleep(0.2)
    refused = [t for t in burst if t.done()]
    assert len(refused) == 4
    assert {t.result().json()["error"]["code"] for t in refused} == {"queue_full"}
    fake.hold.set()
    rs = await asyncio.wait_for(asyncio.gather(*burst), 10)
    assert sorted(r.status_code for r in rs) == [200] * 6 + [503] * 4


# -- bad input never reaches Redis --------------------------------------------------------

BAD_BODIES: list[Any] = [
    b"{not json",
    b"[]",
    json.dumps({"messages": "hi"}).encode(),
    json.dumps({"messages": []}).encode(),
    json.dumps({"messages": [{"role": "user", "content": "hi"}], "max_tokens": -1}).encode(),
    json.dumps({"messages": [{"role": "user", "content": "hi"}], "n": 0}).encode(),
    json.dumps({"messages": [{"role": "user", "content": "w " * 3000}]}).encode(),
    json.dumps({"messages": [{"role": "user", "content": "hi"}], "stream": "yes"}).encode(),
]


async def test_bad_input_gets_the_memory_answer_and_no_redis_call(
        apps: Any, harness_factory: Any) -> None:
    (shared,) = await apps(1)
    memory = await harness_factory()

    def admission_ops(h: Harness) -> float:
        return sum(h.sample("gateway_state_ops_total", op=op) for op in ("grant", "tenant"))

    before = admission_ops(shared)
    for body in BAD_BODIES:
        answers = [await h.client.post(CHAT, content=body,
                                       headers={"content-type": "application/json"})
                   for h in (memory, shared)]
        assert 400 <= answers[0].status_code < 500, (body[:60], answers[0].text)
        assert answers[1].status_code == answers[0].status_code, (body[:60], answers[1].text)
        assert answers[1].json() == answers[0].json()
    assert admission_ops(shared) == before


# -- priority classes within one process ----------------------------------------------------

@pytest.mark.parametrize("shared", [False, True])
async def test_a_higher_class_goes_first_within_one_process(
        apps: Any, harness_factory: Any, make_settings: Any, fake: FakeLlamaServer,
        shared: bool) -> None:
    """docs/replicas.md: "Within one process, the tenants' fair shares and priority
    classes order that process's waiters". An interactive request that came after a
    batch one, both waiting in one process, is served first, as with memory state."""
    from tests.test_tenants import BATCH_KEY, CLASSES, TENANTS, WEB_KEY

    fake.slots = 1
    if shared:
        (h,) = await apps(1, classes=CLASSES, tenants=TENANTS)
    else:
        settings = load_settings(admission={"disconnect_grace_s": 0.0},
                                 backends=[{"name": "local", "url": "http://upstream:8080"}],
                                 classes=CLASSES, tenants=TENANTS)
        h = Harness(create_app(settings, http_client=fake.client(),
                               registry=CollectorRegistry(), discover=False), fake)
        await h.backend.discover()
    fake.hold = asyncio.Event()

    def send(key: str, tag: str) -> asyncio.Future[Any]:
        return asyncio.ensure_future(h.client.post(
            CHAT, json=chat_body(tag, max_tokens=20),
            headers={"authorization": f"Bearer {key}"}))

    first = send(WEB_KEY, "filler")
    await until(lambda: fake.active == 1)
    batch = send(BATCH_KEY, "batch")
    await until(lambda: len(h.backend.admission._room) == 1)
    await asyncio.sleep(0.05)
    web = send(WEB_KEY, "interactive")
    await until(lambda: len(h.backend.admission._room) == 2)
    await asyncio.sleep(0.3)
    fake.hold.set()
    rs = await asyncio.wait_for(asyncio.gather(first, batch, web), 10)
    assert [r.status_code for r in rs] == [200] * 3
    served = [g["messages"][0]["content"] for g in fake.generations]
    assert served == ["filler", "interactive", "batch"]


async def test_the_slo_limit_caps_the_busy_slots_of_every_process(
        redis_server: Any, view: RedisView) -> None:
    """Process A's SLO limit (2) is a busy cap in the shared grant: with one stream of
    A's and one of B's on a 4-slot backend, A's next request waits though memory has
    room, and starts once B's ends (the grant counts both processes' slots); A's limit
    is published, so B's next request waits for it too."""
    from gateway.admission.admission import Admission
    from gateway.admission.shared import SharedStore
    from gateway.admission.shared_grant import SharedGrantor
    from gateway.clock import MonotonicClock
    from gateway.core.capacity import Charge, Layout
    from gateway.core.fairness import Party

    layout = Layout(slots=4, ctx_per_slot=2048, pool_tokens=8192)
    await view.client.set(f"{PREFIX}:epoch", 0)  # no resync window (Redis is not new)
    stores = [SharedStore(unit_settings(redis_server.url), clock=MonotonicClock(), owner=o)
              for o in ("A", "B")]
    for store in stores:
        await store.start()
    try:
        a, b = (Admission(layout, max_queue=10, max_wait_s=10.0,
                          grantor=SharedGrantor(s.account("local", "http://upstream:8080"))) for s in stores)
        chat = Party(priority="chat", itl_target_s=0.025)
        for level in (1, 2, 3):  # A knows up to three streams to hold the target: its
            for _ in range(a.slo.params.min_samples):  # slow start would allow four
                a.slo.model.observe_itl(0.01, level)
        mine = await a.admit(Charge(10, 10), party=chat)
        a.slo.set_itl_target(mine, chat.itl_target_s)  # a target in flight, as the relay sets it
        theirs = await b.admit(Charge(10, 10))
        a.slo.limit = a.slo.controller.limit = 2  # as a step after ITL over the target
        waiting = asyncio.ensure_future(a.admit(Charge(10, 10), party=chat))
        await asyncio.sleep(0.3)
        assert not waiting.done() and len(await view.leases()) == 2
        b.release(theirs)
        third = await asyncio.wait_for(waiting, 5)
        assert len(await view.leases()) == 2
        # A's limit is published: B's own grants keep to it too (found by an adversarial
        # pass: B's grant read only B's limit, so the backend ran three streams).
        blocked = asyncio.ensure_future(b.admit(Charge(10, 10)))
        await asyncio.sleep(0.3)
        assert not blocked.done() and len(await view.leases()) == 2
        a.release(third)
        later = await asyncio.wait_for(blocked, 5)
        assert len(await view.leases()) == 2
        b.release(later)
        a.release(mine)
        await view.settled()
    finally:
        for store in stores:
            await store.close()
