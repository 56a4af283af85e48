"""The status page (gateway/http/status.py): GET /status and GET /status.json over the fake
llama-server (tests/fakes.py): the JSON's fields and that its numbers are the admission
stats and the /metrics figures, recent rejections, backend states, pools, who may read
it, and a page that loads nothing from elsewhere. The page in a real browser is
tests/integration/test_status_browser.py."""

from __future__ import annotations

import asyncio
import base64
import fnmatch
import hashlib
import re
import tomllib
from collections.abc import AsyncIterator, Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

import httpx
import pytest
from prometheus_client import CollectorRegistry, Counter

from gateway.config import load_settings
from gateway.errors import GatewayError
from gateway.http.app import create_app
from gateway.http.auth import status_authorized
from gateway.http.status import GAUGES, STATUS_PATHS, RejectionLog, status_page
from tests.conftest import Harness
from tests.fakes import FakeLlamaServer, ManualClock
from tests.test_fleet import Fleet

pytestmark = pytest.mark.anyio
ADMIN_KEY, TENANT_KEY = "admin-status-key-7", "sk-tenant-status-1"
ROOT = Path(__file__).resolve().parent.parent

BACKEND_FIELDS = {
    "name", "model", "kind", "state", "ready", "up", "draining", "retiring", "problem",
    "fallbacks", "down_for_s", "layout", "slots", "busy_slots", "ctx_per_slot", "pool_tokens",
    "capacity_tokens", "reserved_tokens", "live_tokens", "inflight", "queued",
    "queue_capacity", "oldest_wait_s", "router", "slo", "rejections",
}


def basic(password: str, user: str = "admin") -> dict[str, str]:
    token = base64.b64encode(f"{user}:{password}".encode()).decode()
    return {"authorization": f"Basic {token}"}


def bearer(key: str) -> dict[str, str]:
    return {"authorization": f"Bearer {key}"}


async def until(check: Callable[[], bool]) -> None:
    while not check():
        await asyncio.sleep(0.01)


@pytest.fixture
async def make(fake: FakeLlamaServer) -> AsyncIterator[Callable[..., Any]]:
    """A harness whose settings may have [server] and [[tenants]] sections."""
    made: list[Harness] = []

    async def build(*, server: dict[str, Any] | None = None,
                    tenants: list[dict[str, Any]] | None = None, clock: Any = None,
                    admission: dict[str, Any] | None = None) -> Harness:
        settings = load_settings(
            server=server or {}, admission={"disconnect_grace_s": 0.0, **(admission or {})},
            backends=[{"name": "local", "url": "http://upstream:8080"}],
            tenants=tenants or [])
        app = create_app(settings, http_client=fake.client(), registry=CollectorRegistry(),
                         clock=clock, discover=False)
        h = Harness(app, fake)
        await h.backend.discover()
        made.append(h)
        return h

    yield build
    for h in made:
        await h.client.aclose()


TENANTS = [{"name": "web", "key_hashes": [hashlib.sha256(TENANT_KEY.encode()).hexdigest()]}]


# -- the JSON and its numbers ---------------------------------------------------------------

async def test_the_json_has_every_field_of_an_idle_backend(harness: Harness) -> None:
    r = await harness.client.get("/status.json")
    assert r.status_code == 200 and r.headers["cache-control"] == "no-store"
    data = r.json()
    assert set(data) == {"generated_at", "draining", "refresh_ms", "recent_window_s",
                         "backends", "retiring", "pools", "unassigned_rejections",
                         "state"}
    assert data["state"] == {"backend": "memory"}
    assert data["retiring"] == []
    assert data["draining"] is False and data["pools"] == []
    (row,) = data["backends"]
    assert set(row) == BACKEND_FIELDS
    # The fake llama-server: 4 slots, n_ctx 2048, one unified pool (llama-server's default).
    assert row | {"rejections": None} == {
        "name": "local", "model": "fake", "kind": "llama.cpp", "state": "up",
        "ready": True, "up": True, "draining": False, "retiring": False, "problem": None,
        "fallbacks": [], "down_for_s": 0.0, "layout": "unified", "slots": 4, "busy_slots": 0,
        "ctx_per_slot": 2048, "pool_tokens": 2048, "capacity_tokens": 2048,
        "reserved_tokens": 0, "live_tokens": 0, "inflight": 0, "queued": 0,
        "queue_capacity": 64, "oldest_wait_s": 0.0, "router": None, "rejections": None,
        # no class has a target, nothing is learnt: the latency limit is the memory's
        "slo": {"limit": 4, "binding": False, "itl_target_s": None, "itl_p95_s": {},
                "prefill_tokens_per_s": None, "attainment": {}}}
    assert row["rejections"] == {"total": {}, "recent": {}}


async def test_a_per_slot_layout_is_shown_as_such(harness_factory: Any) -> None:
    h = await harness_factory(kv_unified=False)
    (row,) = (await h.client.get("/status.json")).json()["backends"]
    assert (row["layout"], row["pool_tokens"]) == ("per_slot", None)
    assert row["capacity_tokens"] == row["slots"] * row["ctx_per_slot"] == 4 * 2048


async def test_numbers_under_load_equal_the_admission_stats_and_metrics(
        harness_factory: Any, fake: FakeLlamaServer, clock: ManualClock) -> None:
    h = await harness_factory({"max_queue": 3}, clock=clock)
    fake.hold = asyncio.Event()
    # Rejections of two reasons: a prompt that can never fit, and a body that is no JSON.
    assert (await h.chat("word " * 3000)).status_code == 400
    assert (await h.client.post("/v1/chat/completions", content=b"{",
                                headers={"content-type": "application/json"})).status_code == 400
    running = [asyncio.ensure_future(h.chat(f"question {i}", max_tokens=100 + i))
               for i in range(4)]  # one per slot
    await until(lambda: fake.active == 4)
    waiting = [asyncio.ensure_future(h.chat("later", max_tokens=50)) for _ in range(2)]
    await until(lambda: h.backend.stats().queued == 2)
    clock.advance(2.5)
    waiting.append(asyncio.ensure_future(h.chat("last", max_tokens=50)))
    await until(lambda: h.backend.stats().queued == 3)
    clock.advance(0.5)

    data = (await h.client.get("/status.json")).json()
    (row,) = data["backends"]
    stats = h.backend.stats()
    assert stats.inflight == 4 and stats.queued == 3 and stats.reserved_tokens > 400
    for field, gauge in GAUGES.items():
        assert row[field] == getattr(stats, field) == h.sample(gauge, backend="local"), field
    assert row["live_tokens"] == row["reserved_tokens"]  # strict: a lease counts its charge
    assert row["oldest_wait_s"] == 3.0  # the first waiter came 3 s ago (the clock's)
    assert h.sample("gateway_backend_up", backend="local") == 1 and row["state"] == "up"
    totals = row["rejections"]["total"] | data["unassigned_rejections"]["total"]
    assert totals == {"context_length_exceeded": 1, "invalid_request": 1}
    for reason, n in row["rejections"]["total"].items():
        assert n == h.sample("gateway_rejections_total", backend="local", reason=reason)
    for reason, n in data["unassigned_rejections"]["total"].items():
        assert n == h.sample("gateway_rejections_total", backend="none", reason=reason)
    assert row["rejections"]["recent"] == row["rejections"]["total"]  # all just now

    fake.hold.set()
    assert all(r.status_code == 200 for r in await asyncio.gather(*running, *waiting))
    (row,) = (await h.client.get("/status.json")).json()["backends"]
    assert (row["inflight"], row["queued"], row["reserved_tokens"], row["oldest_wait_s"]) == (
        0, 0, 0, 0.0)


async def test_a_pool_queue_is_listed_with_its_oldest_wait() -> None:
    hold = asyncio.Event()
    fakes = {n: FakeLlamaServer(slots=1, hold=hold) for n in ("a", "b")}
    fleet = Fleet(fakes, [{"name": "a", "model": "m"}, {"name": "b", "model": "m"}])
    try:
        await fleet.discover()
        running = [asyncio.ensure_future(fleet.chat(model="m", max_tokens=5)) for _ in range(2)]
        await until(lambda: sum(f.active for f in fakes.values()) == 2)
        waiting = asyncio.ensure_future(fleet.chat(model="m", max_tokens=5))
        await until(lambda: any(q.waiting for q, _ in fleet.state.fleet.pool_queues()))
        await asyncio.sleep(0.05)
        data = (await fleet.client.get("/status.json")).json()
        (pool,) = data["pools"]
        assert {k: v for k, v in pool.items() if k != "oldest_wait_s"} == {
            "model": "m", "backends": ["a", "b"], "queued": 1, "queue_capacity": 64}
        assert 0.05 <= pool["oldest_wait_s"] < 5
        assert [b["queued"] for b in data["backends"]] == [0, 0]  # it waits in the pool
        hold.set()
        assert all(r.status_code == 200 for r in await asyncio.gather(*running, waiting))
        (pool,) = (await fleet.client.get("/status.json")).json()["pools"]
        assert (pool["queued"], pool["oldest_wait_s"]) == (0, 0.0)
    finally:
        await fleet.client.aclose()


async def test_states_not_ready_down_and_draining(harness_factory: Any,
                                                  fake: FakeLlamaServer) -> None:
    fake.mode = "loading"
    h = await harness_factory(discover=False)
    with pytest.raises(GatewayError):  # the server is still loading its model
        await h.backend.discover()

    async def row() -> dict[str, Any]:
        return (await h.client.get("/status.json")).json()["backends"][0]

    first = await row()
    assert (first["state"], first["layout"], first["ready"]) == ("not_ready", None, False)
    assert first["problem"]
    fake.mode = "ok"
    await h.backend.discover()
    assert (await row())["state"] == "up"
    h.backend.request_failed(30.0, 30.0)
    down = await row()
    assert down["state"] == "down" and 29 < down["down_for_s"] <= 30 and down["up"] is False
    h.backend.health.request_served()
    h.backend.set_draining(True)
    assert (await row())["state"] == "draining"
    h.backend.set_draining(False)
    h.state.draining = True  # the whole gateway stops
    data = (await h.client.get("/status.json")).json()
    assert data["draining"] is True and data["backends"][0]["state"] == "draining"


def test_recent_rejections_cover_the_last_window() -> None:
    clock = ManualClock()
    counter = Counter("gateway_rejections", "test", ["backend", "reason", "tenant", "priority"],
                      registry=CollectorRegistry())
    log = RejectionLog(counter, clock, window_s=300, sample_every_s=5)
    counter.labels("local", "queue_full", "web", "default").inc()
    counter.labels("local", "queue_full", "batch", "batch").inc()  # summed over tenants
    counter.labels("none", "unauthorized", "none", "none").inc()
    totals, recent, span = log.read()
    assert totals == recent == {("local", "queue_full"): 2, ("none", "unauthorized"): 1}
    assert span == 0
    clock.advance(10)
    assert log.read()[1] == totals  # still within the window
    clock.advance(300)  # the snapshot taken 300 s ago becomes the baseline
    totals, recent, span = log.read()
    assert recent == {} and span == 300 and totals[("local", "queue_full")] == 2
    counter.labels("local", "context_length_exceeded", "web", "default").inc()
    assert log.read()[1] == {("local", "context_length_exceeded"): 1}
    clock.advance(1000)  # nobody looked for a while: the window says how far back it goes
    totals, recent, span = log.read()
    assert recent == {("local", "context_length_exceeded"): 1} and span == 1000


# -- who may read it ------------------------------------------------------------------------

@pytest.mark.parametrize("path", sorted(STATUS_PATHS))
async def test_without_an_admin_key_the_status_is_open_even_with_tenants(
        make: Any, path: str) -> None:
    h = await make(tenants=TENANTS)
    assert (await h.client.get(path)).status_code == 200  # no tenant key asked for
    assert (await h.chat()).status_code == 401  # while generation needs one


@pytest.mark.parametrize("path", sorted(STATUS_PATHS))
async def test_with_an_admin_key_only_that_key_opens_the_status(make: Any, path: str) -> None:
    h = await make(server={"admin_key": ADMIN_KEY}, tenants=TENANTS)
    refused = [{}, bearer(TENANT_KEY), basic(TENANT_KEY), {"x-api-key": ADMIN_KEY},
               bearer("admin-status-key-8"), basic("wrong"), {"authorization": ADMIN_KEY},
               {"authorization": "Basic !!!not-base64"},
               {"authorization": "Basic d\u00e9j\u00e0".encode()},  # not ASCII: not base64
               {"authorization": "Bearer "},
               {"authorization": "Basic " + base64.b64encode(ADMIN_KEY.encode()).decode()}]
    for headers in refused:
        r = await h.client.get(path, headers=headers)
        assert r.status_code == 401, headers
        assert r.headers["www-authenticate"].startswith('Basic realm="llm-gateway"')
        assert r.json()["error"]["code"] == "invalid_api_key"
    assert h.sample("gateway_rejections_total", reason="unauthorized") == len(refused)
    for headers in (bearer(ADMIN_KEY), basic(ADMIN_KEY), basic(ADMIN_KEY, user=""),
                    basic(ADMIN_KEY, user="anyone at all")):
        assert (await h.client.get(path, headers=headers)).status_code == 200, headers
    assert h.sample("gateway_requests_total", route="status", code="200") == 4
    assert h.sample("gateway_requests_total", route="status", code="401") == len(refused)


def test_status_authorized_takes_one_header_only() -> None:
    twice = [(b"authorization", b"Bearer k"), (b"authorization", b"Bearer k")]
    assert status_authorized([(b"authorization", b"Bearer k")], "k")
    assert not status_authorized(twice, "k")
    assert not status_authorized([], "k")
    colon = base64.b64encode(b"u:pa:ss")  # the password is everything after the first colon
    assert status_authorized([(b"Authorization", b"Basic " + colon)], "pa:ss")


# -- the page -------------------------------------------------------------------------------

async def test_the_page_is_small_self_contained_and_locked_down(harness: Harness) -> None:
    r = await harness.client.get("/status")
    assert r.status_code == 200 and r.headers["content-type"] == "text/html; charset=utf-8"
    page = r.text
    assert r.content == status_page() and len(r.content) < 12_000
    assert not re.search(r"https?:", page)  # no URL of another site, in any attribute
    # The only attribute naming something to load is the empty icon (no /favicon.ico).
    assert re.findall(r"""\b(?:src|href|action|srcset)\s*=\s*["']?([^"'\s>]*)""", page) == [
        "data:,"]
    assert re.findall(r"<link\b[^>]*>", page) == ['<link rel="icon" href="data:,">']
    assert not re.search(r"<(img|iframe|object|embed|base|form)\b", page)
    assert not re.search(r"@import|url\(", page)  # nor from the style
    assert re.findall(r"<script\b[^>]*>", page) == ["<script>"]  # one inline script, no src
    assert 'new URL("status.json", location.origin' in page  # no credentials in the URL
    # Every figure of a backend has an element the page writes it into.
    for field in BACKEND_FIELDS - {"ready", "up", "draining", "retiring", "down_for_s",
                                   "rejections"}:
        assert f'data-field="{field}"' in page, field
    # The policy lets only the page's own script and style run, by their hashes.
    policy = r.headers["content-security-policy"]
    for kind in ("script", "style"):
        body = re.search(rf"<{kind}>(.*?)</{kind}>", page, re.DOTALL)
        assert body is not None
        digest = base64.b64encode(hashlib.sha256(body.group(1).encode()).digest()).decode()
        assert f"{kind}-src 'sha256-{digest}'" in policy
    assert "default-src 'none'" in policy and "connect-src 'self'" in policy


@pytest.mark.parametrize(("method", "path"), [("POST", "/status"), ("DELETE", "/status.json"),
                                              ("PUT", "/status.json")])
async def test_other_methods_get_an_openai_shaped_405(harness: Harness, method: str,
                                                      path: str) -> None:
    r = await harness.client.request(method, path)
    assert r.status_code == 405
    error = r.json()["error"]
    assert error["code"] == "method_not_allowed" and error["type"] == "invalid_request_error"
    assert "GET /status" in error["message"]


def test_the_page_is_packaged_with_the_wheel() -> None:
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())
    patterns = config["tool"]["setuptools"]["package-data"]["gateway.http"]
    assert any(fnmatch.fnmatch("static/status.html", p) for p in patterns)
    assert (ROOT / "gateway" / "http" / "static" / "status.html").is_file()


async def test_unknown_paths_near_status_are_404(harness: Harness) -> None:
    for path in ("/status/", "/status.html", "/status.json/x"):
        r = await harness.client.get(path)
        assert r.status_code == 404 and r.json()["error"]["code"] == "not_found", path


async def test_a_tenant_key_does_not_open_an_admin_guarded_status_via_httpx_auth(
        make: Any) -> None:
    """httpx's BasicAuth (what a script would use) with the tenant key is refused, with
    the admin key accepted."""
    h = await make(server={"admin_key": ADMIN_KEY}, tenants=TENANTS)
    r = await h.client.get("/status.json", auth=httpx.BasicAuth("web", TENANT_KEY))
    assert r.status_code == 401
    r = await h.client.get("/status.json", auth=httpx.BasicAuth("ops", ADMIN_KEY))
    assert r.status_code == 200 and r.json()["backends"][0]["name"] == "local"


async def test_live_use_is_shown_apart_from_the_reservation(harness_factory: Any,
                                                            fake: FakeLlamaServer) -> None:
    """Under the predictive policy a streamed answer counts what it holds now (its
    prompt, before any token), less than what it reserved (prompt + cap)."""
    h = await harness_factory({"policy": "predictive"})
    fake.hold = asyncio.Event()
    task = asyncio.ensure_future(h.chat("one two three", stream=True, max_tokens=200))
    await until(lambda: fake.active == 1)
    (row,) = (await h.client.get("/status.json")).json()["backends"]
    assert row["live_tokens"] == h.sample("gateway_kv_live_tokens", backend="local") > 0
    assert row["reserved_tokens"] == h.sample("gateway_kv_reserved_tokens", backend="local")
    assert row["reserved_tokens"] - row["live_tokens"] == 200
    fake.hold.set()
    assert (await task).status_code == 200


async def test_no_unauthenticated_page_names_the_model_file(harness: Harness) -> None:
    """llama-server without --alias reports its -m path as the model's id: /ready,
    /status.json and the status page name the served model (the file name without
    .gguf, as answers do); the id as reported shows only in the admin rows."""
    harness.backend.discovered = replace(harness.backend.discovered,
                                         model_id="/srv/models/secret-7b.gguf")
    for path in ("/ready", "/status.json"):
        text = (await harness.client.get(path)).text
        assert "secret-7b" in text and "/srv/models" not in text and ".gguf" not in text
    ready = (await harness.client.get("/ready")).json()
    assert ready["backends"]["local"]["model"] == "secret-7b"
