"""The status page in a real browser: headless Chromium (Debian's ``/usr/bin/chromium``,
driven by Playwright, which never downloads a browser here) loads ``GET /status`` from
the gateway served by uvicorn on a loopback port, in front of the fake llama-server
(tests/fakes.py) served on another loopback port, while traffic runs through it.

Traffic is held at the upstream (4 streams on the 4 slots, 2 more queued), so the
gateway's state stands still: at that quiescent moment the numbers the page shows must
be those of ``/metrics``; so must they after the traffic ends, which the page must show
by itself (it refreshes from ``/status.json``). The admin key is set, so the browser
gets in only with it as the HTTP Basic password. Skipped when Chromium or Playwright
is missing. ``UPDATE_STATUS_SCREENSHOT=1`` rewrites docs/status.png.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import threading
import time
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import pytest
import uvicorn
from starlette.types import Receive, Scope, Send

from gateway.dev.localbackend import free_port
from gateway.http.status import GAUGES
from tests.fakes import FakeLlamaServer
from tests.integration.conftest import GatewayThread

CHROMIUM = os.environ.get("CHROMIUM", "/usr/bin/chromium")
FLAGS = ["--no-sandbox", "--disable-gpu", "--disable-background-networking",
         "--disable-component-update", "--disable-sync", "--no-first-run"]
ADMIN_KEY = "status-page-admin-key"
SCREENSHOT = Path(__file__).resolve().parents[2] / "docs" / "status.png"

sync_api = pytest.importorskip("playwright.sync_api", reason="playwright is not installed")
if not shutil.which(CHROMIUM):
    pytest.skip(f"no Chromium at {CHROMIUM} (apt-get install chromium)",
                allow_module_level=True)


class SocketFake:
    """The fake llama-server as an ASGI app, so that uvicorn serves it on a real port:
    each request is handed to :meth:`FakeLlamaServer.handle` and its answer streamed
    back as it comes."""

    def __init__(self, fake: FakeLlamaServer) -> None:
        self.fake = fake
        self.loop: asyncio.AbstractEventLoop | None = None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        assert scope["type"] == "http"
        self.loop = asyncio.get_running_loop()
        body, more = b"", True
        while more:
            message = await receive()
            body += message.get("body", b"")
            more = message.get("more_body", False)
        query = scope["query_string"].decode()
        request = httpx.Request(scope["method"], "http://fake" + scope["path"]
                                + (f"?{query}" if query else ""),
                                headers=scope["headers"], content=body)
        response = await self.fake.handle(request)
        headers = [(k.encode(), v.encode()) for k, v in response.headers.items()
                   if k not in ("content-length", "transfer-encoding")]
        await send({"type": "http.response.start", "status": response.status_code,
                    "headers": headers})
        try:
            whole = response.content  # a JSON answer, already in hand
        except httpx.ResponseNotRead:  # a stream, sent on as its events come
            try:
                async for chunk in response.aiter_raw():
                    await send({"type": "http.response.body", "body": chunk,
                                "more_body": True})
            finally:
                await response.aclose()
            whole = b""
        await send({"type": "http.response.body", "body": whole})

    def call(self, fn: Any) -> None:
        """Run ``fn()`` on the fake's event loop (from the test's thread)."""
        assert self.loop is not None
        self.loop.call_soon_threadsafe(fn)


@pytest.fixture
def upstream() -> Iterator[tuple[SocketFake, str]]:
    """The fake llama-server (4 slots, n_ctx 2048, a unified pool) on a loopback port;
    its generations wait for ``fake.hold``."""
    fake = FakeLlamaServer(hold=asyncio.Event())
    app = SocketFake(fake)
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, lifespan="off",
                                           log_level="warning", loop="asyncio"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 20
    while not server.started:
        assert time.monotonic() < deadline, "the fake upstream did not start"
        time.sleep(0.02)
    try:
        yield app, f"http://127.0.0.1:{port}"
    finally:
        if app.loop is not None:
            app.call(fake.hold.set)  # type: ignore[union-attr]
        server.should_exit = True
        thread.join(10)


def chat(url: str, words: int, max_tokens: int, stream: bool = True) -> httpx.Response:
    body = {"messages": [{"role": "user", "content": " ".join(["word"] * words)}],
            "max_tokens": max_tokens, "stream": stream}
    return httpx.post(url + "/v1/chat/completions", json=body, timeout=120)


def status_json(gateway: GatewayThread) -> dict[str, Any]:
    r = httpx.get(gateway.url + "/status.json", headers=gateway.metrics_headers, timeout=5)
    r.raise_for_status()
    return r.json()


def generated_at(page: Any) -> float:
    """When the page's last reading of /status.json was made (Unix seconds; 0: none)."""
    return float(page.evaluate("() => Number(document.body.dataset.generatedAt || 0)"))


def wait_for(check: Any, what: str, timeout: float = 20) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


# Reads what the page shows for one backend: each [data-field] element's text, the
# rejection rows, the bar's drawn widths, and the gateway-wide rejection rows.
READ_PAGE = """(name) => {
  const card = document.querySelector(`section.backend[data-backend="${name}"]`);
  const fields = {};
  for (const el of card.querySelectorAll("[data-field]")) {
    if (!el.closest("table")) fields[el.dataset.field] = el.textContent;
  }
  const rows = (table) => Object.fromEntries([...table.querySelectorAll("tr[data-reason]")]
    .map((tr) => [tr.dataset.reason, {
      recent: Number(tr.querySelector('[data-field="recent"]').textContent),
      total: Number(tr.querySelector('[data-field="total"]').textContent)}]));
  const bar = card.querySelector(".bar").getBoundingClientRect().width;
  return {fields, rejections: rows(card.querySelector("table.rejections")),
          unassigned: rows(document.querySelector("#unassigned table")),
          unassignedShown: !document.getElementById("unassigned").hidden,
          reservedWidth: card.querySelector(".reserved").getBoundingClientRect().width / bar,
          liveWidth: card.querySelector(".live").getBoundingClientRect().width / bar,
          label: card.querySelector(".bar").getAttribute("aria-label")};
}"""


def rejections_in_metrics(gateway: GatewayThread, backend: str,
                          reasons: list[str]) -> dict[str, int]:
    return {r: int(gateway.metric("gateway_rejections_total", backend=backend, reason=r))
            for r in reasons}


def check_against_metrics(gateway: GatewayThread, shown: dict[str, Any]) -> None:
    """The figures the page shows equal /metrics now (the gateway is quiescent)."""
    for field, gauge in GAUGES.items():
        assert int(shown["fields"][field]) == gateway.metric(gauge, backend="local"), field
    backend = rejections_in_metrics(gateway, "local", list(shown["rejections"]))
    assert {r: v["total"] for r, v in shown["rejections"].items()} == backend
    none = rejections_in_metrics(gateway, "none", list(shown["unassigned"]))
    assert {r: v["total"] for r, v in shown["unassigned"].items()} == none
    # No reason /metrics counts is missing from the page.
    counted = sum(v["total"] for v in shown["rejections"].values()) + sum(
        v["total"] for v in shown["unassigned"].values())
    assert counted == gateway.metric("gateway_rejections_total")


def check_the_stranger_is_asked_for_the_key(browser: Any, url: str) -> None:
    """Without the key the browser is asked for it (Playwright answers the prompt with
    nothing, so the navigation fails) and is shown nothing else."""
    stranger = browser.new_context()
    page = stranger.new_page()
    answers: list[Any] = []
    page.on("response", lambda r: answers.append(r))
    with pytest.raises(sync_api.Error, match="ERR_INVALID_AUTH_CREDENTIALS"):
        page.goto(url + "/status")
    assert [(a.url, a.status) for a in answers] == [(url + "/status", 401)]
    assert answers[0].headers["www-authenticate"].startswith('Basic realm="llm-gateway"')
    stranger.close()


def test_the_page_shows_what_metrics_count_while_traffic_runs(
        upstream: tuple[SocketFake, str]) -> None:
    fake_app, fake_url = upstream
    fake = fake_app.fake
    with GatewayThread({"url": fake_url}, admission={"policy": "predictive", "max_queue": 2},
                       server={"admin_key": ADMIN_KEY}) as gateway, \
            ThreadPoolExecutor(8) as pool:
        try:
            with sync_api.sync_playwright() as pw:
                browser = pw.chromium.launch(executable_path=CHROMIUM, headless=True,
                                             args=FLAGS)
                try:
                    watch_traffic(gateway, fake_app, pool, browser)
                finally:
                    browser.close()
        finally:
            fake_app.call(fake.hold.set)  # type: ignore[union-attr]


def watch_traffic(gateway: GatewayThread, fake_app: SocketFake, pool: ThreadPoolExecutor,
                  browser: Any) -> None:
    fake, url = fake_app.fake, gateway.url
    # Rejections: a prompt that can never fit a slot (400), then, below, a full queue.
    assert chat(url, 3000, 10).status_code == 400
    running: list[Future[httpx.Response]] = [
        pool.submit(chat, url, 150, 300) for _ in range(4)]  # one stream per slot
    wait_for(lambda: fake.active == 4, "4 streams upstream")
    waiting = [pool.submit(chat, url, 40, 100, False) for _ in range(2)]
    wait_for(lambda: status_json(gateway)["backends"][0]["queued"] == 2, "2 queued")
    assert chat(url, 40, 100, False).status_code == 503  # the queue is full
    check_the_stranger_is_asked_for_the_key(browser, url)
    frozen_at = time.time()

    context = browser.new_context(http_credentials={"username": "ops", "password": ADMIN_KEY},
                                  viewport={"width": 1000, "height": 500})
    page = context.new_page()
    requested: list[str] = []
    problems: list[str] = []
    page.on("request", lambda r: requested.append(r.url))
    page.on("console", lambda m: problems.append(m.text) if m.type == "error" else None)
    page.on("pageerror", lambda e: problems.append(str(e)))
    answer = page.goto(url + "/status")
    assert answer is not None and answer.status == 200
    # (Polled from here: the page's policy forbids the eval that wait_for_function uses.)
    wait_for(lambda: generated_at(page) >= frozen_at, "a reading after the freeze")
    page.wait_for_timeout(600)  # the bar's width transition (0.4 s) ends
    shown = page.evaluate(READ_PAGE, "local")

    # The quiescent moment: held streams, a full queue, nothing moving.
    fields = shown["fields"]
    assert (fields["name"], fields["state"], fields["layout"]) == (
        "local", "up", "unified KV pool")
    assert (fields["slots"], fields["busy_slots"], fields["pool_tokens"]) == ("4", "4", "2048")
    assert (fields["inflight"], fields["queued"], fields["queue_capacity"]) == ("4", "2", "2")
    check_against_metrics(gateway, shown)
    reserved, live = int(fields["reserved_tokens"]), int(fields["live_tokens"])
    assert 0 < live < reserved <= int(fields["capacity_tokens"])
    assert shown["reservedWidth"] == pytest.approx(reserved / 2048, abs=0.01)
    assert shown["liveWidth"] == pytest.approx(live / 2048, abs=0.01)
    assert shown["label"] == f"{reserved} reserved and {live} live of 2048 KV tokens"
    assert {r: v["total"] for r, v in shown["rejections"].items()} == {
        "context_length_exceeded": 1, "queue_full": 1}
    assert shown["unassignedShown"]  # the stranger's 401
    assert {r: v["total"] for r, v in shown["unassigned"].items()} == {
        "unauthorized": gateway.metric("gateway_rejections_total", reason="unauthorized")}
    # The oldest wait grows from one reading to the next, without a reload.
    first_wait = float(fields["oldest_wait_s"])
    assert first_wait > 0
    wait_for(lambda: float(page.evaluate(READ_PAGE, "local")["fields"]["oldest_wait_s"])
             > first_wait, "a later reading")
    if os.environ.get("UPDATE_STATUS_SCREENSHOT") == "1":
        SCREENSHOT.parent.mkdir(exist_ok=True)
        page.screenshot(path=str(SCREENSHOT), full_page=True)

    fake_app.call(fake.hold.set)  # type: ignore[union-attr]
    assert [f.result().status_code for f in (*running, *waiting)] == [200] * 6
    wait_for(lambda: status_json(gateway)["backends"][0]["inflight"] == 0, "the end")
    ended_at = time.time()
    wait_for(lambda: generated_at(page) >= ended_at, "a reading after the end")
    page.wait_for_timeout(600)
    shown = page.evaluate(READ_PAGE, "local")
    fields = shown["fields"]
    assert [fields[f] for f in ("inflight", "queued", "busy_slots", "reserved_tokens",
                                "live_tokens", "oldest_wait_s")] == ["0"] * 6
    assert shown["reservedWidth"] == 0
    check_against_metrics(gateway, shown)
    # Two 401s in all: the stranger's, and the first load before the browser sent the
    # key; the browser then sends it with each reading of status.json unasked.
    assert gateway.metric("gateway_rejections_total", reason="unauthorized") == 2
    assert problems == []  # no script error, no inline code blocked by the policy (CSP)
    assert len([u for u in requested if u.endswith("/status.json")]) >= 3
    assert all(u.startswith(url + "/") for u in requested), requested
    context.close()
    check_a_key_in_the_address_works(browser, url)


def check_a_key_in_the_address_works(browser: Any, url: str) -> None:
    """Opened as http://user:key@host/status, the page still reads status.json (fetch
    refuses a URL with credentials, so the page must not resolve against its own)."""
    context = browser.new_context()
    page = context.new_page()
    problems: list[str] = []
    page.on("console", lambda m: problems.append(m.text) if m.type == "error" else None)
    started = time.time()
    answer = page.goto(url.replace("http://", f"http://ops:{ADMIN_KEY}@") + "/status")
    assert answer is not None and answer.status == 200
    wait_for(lambda: generated_at(page) >= started, "a reading with the key in the address")
    assert not any("credentials" in p for p in problems), problems
    context.close()


def reading(*backends: dict[str, Any], draining: bool = False,
            pools: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    """A /status.json document with the given backends (other fields zero or empty)."""
    zero = {"state": "up", "model": "m", "kind": "llama.cpp", "problem": None,
            "down_for_s": 0.0, "layout": "unified", "slots": 4, "busy_slots": 0,
            "ctx_per_slot": 2048, "pool_tokens": 2048, "capacity_tokens": 2048,
            "reserved_tokens": 0, "live_tokens": 0, "inflight": 0, "queued": 0,
            "queue_capacity": 64, "oldest_wait_s": 0.0,
            "rejections": {"total": {}, "recent": {}}}
    return {"generated_at": time.time(), "draining": draining, "refresh_ms": 1500,
            "recent_window_s": 300.0, "backends": [zero | b for b in backends],
            "pools": pools or [], "unassigned_rejections": {"total": {}, "recent": {}}}


def test_the_page_shows_each_state_and_names_only_as_text() -> None:
    """The page over canned readings (served by the browser's request interception):
    not ready with the reason, down with the time left, a per-slot layout, a pool queue,
    the gateway draining, a backend that goes away; a name with markup stays text."""
    import json

    from gateway.http.status import status_page

    hostile = '<img src=x onerror="document.title=\'pwned\'">'
    readings = [
        reading({"name": hostile, "state": "not_ready", "problem": "connection refused",
                 "layout": None, "pool_tokens": None, "slots": 0, "capacity_tokens": 0},
                {"name": "b", "state": "down", "down_for_s": 12.5, "layout": "per_slot",
                 "pool_tokens": None, "slots": 2, "ctx_per_slot": 4096,
                 "capacity_tokens": 8192, "reserved_tokens": 4096, "live_tokens": 1024},
                draining=True, pools=[{"model": "m", "backends": ["a", "b"], "queued": 3,
                                       "queue_capacity": 64, "oldest_wait_s": 1.5}]),
        reading({"name": "b", "state": "draining"}),
    ]
    served: list[int] = []

    def answer(route: Any) -> None:
        document = readings[min(len(served), len(readings) - 1)]
        served.append(1)
        route.fulfill(status=200, content_type="application/json", body=json.dumps(document))

    with sync_api.sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=CHROMIUM, headless=True, args=FLAGS)
        try:
            page = browser.new_page()
            page.route("http://gateway.test/status", lambda route: route.fulfill(
                status=200, content_type="text/html; charset=utf-8", body=status_page()))
            page.route("http://gateway.test/status.json", answer)
            page.goto("http://gateway.test/status")
            wait_for(lambda: generated_at(page) > 0, "the first reading")
            cards = page.locator("section.backend")
            assert cards.count() == 2
            first = cards.nth(0)
            assert first.locator('[data-field="name"]').text_content() == hostile
            assert first.locator('[data-field="state"]').text_content() == "not ready"
            assert first.locator(".problem").text_content() == "connection refused"
            assert first.locator('[data-field="layout"]').text_content() == "unknown"
            assert page.locator("img").count() == 0 and page.title() == "llm-gateway status"
            down = page.locator('section.backend[data-backend="b"]')
            assert down.locator(".problem").text_content() == (
                "down after a failed request, 12.5 s more")
            assert down.locator('[data-field="layout"]').text_content() == "per slot"
            assert down.locator('[data-field="pool_tokens"]').text_content() == "—"
            assert down.locator('[data-field="use_pct"]').text_content() == "50"
            assert page.locator("#draining").is_visible()
            assert page.locator('#pools tr[data-model="m"]').inner_text().split("\t") == [
                "m", "a, b", "3 of 64", "1.5"]
            # (Route handlers run only during a call into Playwright: ask the page.)
            wait_for(lambda: page.locator("section.backend").count() == 1, "the next reading")
            assert down.locator('[data-field="state"]').text_content() == "draining"
            assert down.locator(".problem").is_hidden()
            assert page.locator("#draining").is_hidden() and page.locator("#pools").is_hidden()
        finally:
            browser.close()
