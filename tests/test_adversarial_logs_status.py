"""Regression tests from an adversarial review of the access line (gateway/observe/logs.py,
gateway/http/middleware.py, gateway/relay/response.py) and the status page (gateway/http/status.py,
gateway/http/static/status.html).

Each test pins either a fault the review found and that has been fixed (the first
section), or an edge the rest of the suite does not reach and that held (the second)."""

from __future__ import annotations

import asyncio
import base64
import contextlib
import io
import json
import logging
import os
import shutil
import socket
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

import httpx
import pytest
from prometheus_client import CollectorRegistry, Counter

from gateway.config import ServerSettings, load_settings
from gateway.fleet.reload import reload
from gateway.http.app import create_app
from gateway.http.status import RejectionLog
from gateway.observe.logs import TextFormatter, configure_logging, log_access
from tests.conftest import Harness
from tests.fake_vllm import FakeVllm
from tests.fakes import FakeLlamaServer, ManualClock
from tests.served import request_bytes, served
from tests.test_fleet import Fleet
from tests.test_predictive import _predictive, _warm

pytestmark = pytest.mark.anyio
CHAT = "/v1/chat/completions"
ADMIN_KEY = "adm1n-key-for-review"
CHROMIUM = os.environ.get("CHROMIUM", "/usr/bin/chromium")


def access_records(caplog: pytest.LogCaptureFixture) -> list[logging.LogRecord]:
    return [r for r in caplog.records if r.name == "gateway.access"]


async def until(check: Callable[[], bool], timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, "timed out"
        await asyncio.sleep(0.01)


async def admin_harness(fake: FakeLlamaServer, **server: Any) -> Harness:
    settings = load_settings(server={"admin_key": ADMIN_KEY, **server},
                             admission={"disconnect_grace_s": 0.0},
                             backends=[{"name": "local", "url": "http://upstream:8080"}])
    app = create_app(settings, http_client=fake.client(), registry=CollectorRegistry(),
                     discover=False)
    h = Harness(app, fake)
    await h.backend.discover()
    return h


def logfmt_pairs(text: str) -> list[tuple[str, str]]:
    """Parse ``key=value`` pairs as go-logfmt's decoder (the reference logfmt parser,
    used by Grafana/Loki and go-kit) does: an unquoted value may not hold ``=`` or
    ``"``; a quoted one is JSON-like. Raises ValueError where go-logfmt reports a
    syntax error."""
    pairs, i, n = [], 0, len(text)
    while i < n:
        while i < n and text[i] <= " ":
            i += 1
        if i >= n:
            break
        start = i
        while i < n and text[i] not in "= " and text[i] != '"':
            i += 1
        if i < n and text[i] == '"':
            raise ValueError(f"unexpected '\"' at {i}")
        key = text[start:i]
        if i >= n or text[i] != "=":
            pairs.append((key, ""))
            continue
        i += 1
        if i < n and text[i] == '"':
            j, esc = i + 1, False
            while j < n:
                if esc:
                    esc = False
                elif text[j] == "\\":
                    esc = True
                elif text[j] == '"':
                    break
                j += 1
            pairs.append((key, json.loads(text[i:j + 1])))
            i = j + 1
            continue
        start = i
        while i < n and text[i] > " ":
            if text[i] in '="':
                raise ValueError(f"unexpected {text[i]!r} at {i} in value of {key}")
            i += 1
        pairs.append((key, text[start:i]))
    return pairs


# ===========================================================================================
# Faults found and fixed
# ===========================================================================================

async def test_an_internal_error_is_logged_and_counted_as_500(
        harness: Harness, fake: FakeLlamaServer, caplog: pytest.LogCaptureFixture,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """An unexpected exception in the forwarding path (aiohttp's bare RuntimeError on a
    closed session, or a bug) is answered 500 internal_error, and the access line and
    gateway_requests_total say 500 too. The proxy's ``finally`` must not leave its
    "client left" default (``x.status or 499``) in scope state for the middleware to
    prefer over the 500 it sent: a gateway fault would be blamed on the client."""
    caplog.set_level(logging.INFO)

    async def broken(request: httpx.Request) -> httpx.Response:
        raise RuntimeError("Session is closed")

    monkeypatch.setattr(fake, "_generate", broken)
    r = await harness.chat(max_tokens=3)
    assert r.status_code == 500 and r.json()["error"]["code"] == "internal_error"
    (line,) = access_records(caplog)
    assert line.status == 500, f"a 500 should log status=500, not {line.status}"
    assert harness.sample("gateway_requests_total", code="500") == 1
    assert harness.sample("gateway_requests_total", code="499") == 0


async def test_upstream_error_text_never_reaches_the_log(
        caplog: pytest.LogCaptureFixture) -> None:
    """llama-server answers 500 "Failed to parse input at pos N: <the model's output>"
    when it cannot parse a tool call (ggml-org/llama.cpp#20532), and other servers echo
    input in 5xx messages. When a pool fails over, the WARNING the gateway logs
    (proxy.py ``_fails_over``) names the error by its kind (``errors.describe``), never
    by the backend's message: otherwise completion and prompt text would reach the log
    (README: "No prompt or completion text ... is written, at any level"), and its
    newlines would break the text format's one line per record."""
    caplog.set_level(logging.DEBUG)
    secret_prompt, secret_output = "purple-elephant-prompt", "SECRET-MODEL-OUTPUT-42"
    fakes = {n: FakeLlamaServer() for n in ("a", "b")}
    generate = fakes["a"]._generate

    async def unparsable(request: httpx.Request) -> httpx.Response:
        body = json.loads(request.content)
        if body.get("messages"):
            said = body["messages"][-1]["content"]
            return httpx.Response(500, json={"error": {
                "code": 500, "type": "server_error",
                "message": f"Failed to parse input at pos 0: <tool_call>{secret_output}\n"
                           f"(user: {said})"}})
        return await generate(request)

    fakes["a"]._generate = unparsable  # type: ignore[method-assign]
    fleet = Fleet(fakes, [{"name": "a", "model": "m"}, {"name": "b", "model": "m"}])
    try:
        await fleet.discover()
        r = await fleet.chat(secret_prompt, model="m", max_tokens=3)
        assert r.status_code == 200  # failed over to b: the client never sees the text
        assert len(fakes["a"].requests) and len(fakes["b"].generations) == 1
        leaked = [f"{rec.name} {rec.levelname}: {rec.getMessage()}" for rec in caplog.records
                  if secret_output in rec.getMessage() or secret_prompt in rec.getMessage()]
        assert not leaked, leaked
    finally:
        await fleet.client.aclose()


def test_the_text_access_line_quotes_equals_signs() -> None:
    """A value holding ``=``, such as a client's base64 X-Request-Id ``dGVzdA==`` (or a
    path with ``=``), is quoted in the text format (``_BARE`` has no ``=``). go-logfmt
    (Loki/Grafana's logfmt, go-kit) rejects ``=`` inside an unquoted value ("unexpected
    '='") and stops parsing the line, losing every field after it (route, backend,
    tenant, status, reason...); the client chooses its id, so it could otherwise make
    its own access lines unparseable."""
    stream = io.StringIO()
    handler = logging.StreamHandler(stream)
    handler.setFormatter(TextFormatter("%(levelname)s %(name)s: %(message)s"))
    logger = logging.getLogger("gateway.access")
    logger.addHandler(handler)
    saved = logger.level
    logger.setLevel(logging.INFO)
    try:
        log_access({"request_id": "dGVzdA==", "method": "POST", "path": CHAT,
                    "route": "chat", "backend": "local", "tenant": "web", "status": 200,
                    "reason": None, "duration_ms": 1.0})
    finally:
        logger.removeHandler(handler)
        logger.setLevel(saved)
    line = stream.getvalue().strip()
    fields = line.split(": ", 1)[1].split(" ", 3)[3]  # after "POST /path 200"
    parsed = dict(logfmt_pairs(fields))  # raises where go-logfmt would
    assert parsed["request_id"] == "dGVzdA==" and parsed["tenant"] == "web"


@contextlib.asynccontextmanager
async def reloaded_while_serving(harness: Harness, fake: FakeLlamaServer,
                                 backend: dict[str, str]) -> AsyncIterator[list[str]]:
    """One request held in flight on "local", then a reload to the single ``backend``
    (discovered if it keeps the name "local"); yields the reload's changes, and lets the
    request finish on the way out."""
    fake.hold = asyncio.Event()
    task = asyncio.ensure_future(harness.chat(max_tokens=5))
    try:
        await until(lambda: fake.active == 1)
        new = load_settings(admission={"disconnect_grace_s": 0.0}, backends=[backend])
        changes = await reload(harness.state, new)
        if backend["name"] == "local":  # the replaced backend's successor
            await harness.state.fleet.backends["local"].discover()
        yield changes
    finally:
        fake.hold.set()
        await task


async def test_a_replaced_backend_is_listed_apart_while_it_retires(
        harness: Harness, fake: FakeLlamaServer) -> None:
    """A reload that changes a backend's URL keeps the old target (retiring, finishing
    its requests) and adds a new one of the same name. In /status.json ``backends``
    holds only the new one, as /metrics does, and the old one is in ``retiring``: two
    rows of one name in ``backends`` would share their rejection counts (looked up by
    name) and overwrite each other's card on a page that keyed cards by name (see the
    browser test below)."""
    async with reloaded_while_serving(
            harness, fake, {"name": "local", "url": "http://upstream2:8080"}) as changes:
        assert changes == ["changed backend local"]
        data = (await harness.client.get("/status.json")).json()
        rows = data["backends"]
        names = [row["name"] for row in rows]
        assert len(names) == len(set(names)), f"rows: {[(r['name'], r['state']) for r in rows]}"
        (old,) = data["retiring"]
        assert (old["name"], old["state"], old["inflight"]) == ("local", "retiring", 1)


def _render_status_page(page_bytes: bytes, headers: dict[str, str],
                        json_bytes: bytes) -> dict[str, Any]:
    """Load the page in headless Chromium (playwright) from a fake origin that serves
    ``page_bytes`` at /status and ``json_bytes`` at /status.json; return what it shows."""
    from playwright.sync_api import sync_playwright

    flags = ["--no-sandbox", "--disable-gpu", "--disable-background-networking",
             "--disable-component-update", "--disable-sync", "--no-first-run"]
    with sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=CHROMIUM, headless=True, args=flags)
        try:
            page = browser.new_page()
            dialogs: list[str] = []
            page.on("dialog", lambda d: (dialogs.append(d.message), d.dismiss()))

            def serve(route: Any) -> None:
                if route.request.url.endswith("/status.json"):
                    route.fulfill(status=200, body=json_bytes,
                                  headers={"content-type": "application/json"})
                else:
                    route.fulfill(status=200, body=page_bytes, headers=headers)

            page.route("**/*", serve)
            page.goto("http://gateway.test/status")
            page.wait_for_function("() => document.body.dataset.generatedAt")
            page.wait_for_timeout(200)
            cards = page.evaluate("""() => [...document.querySelectorAll('section.backend')]
              .map(c => ({name: c.dataset.backend,
                          state: c.querySelector('.badge').textContent,
                          inflight: c.querySelector('[data-field=inflight]').textContent,
                          model: c.querySelector('[data-field=model]').textContent,
                          problem: c.querySelector('.problem').textContent}))""")
            injected = page.evaluate(
                "() => document.querySelectorAll('img, script:not(:first-of-type), "
                "iframe, svg, b').length")
            return {"cards": cards, "dialogs": dialogs, "injected": injected,
                    "pwned": page.evaluate("() => window.__pwned === 1")}
        finally:
            browser.close()


def _need_browser() -> None:
    pytest.importorskip("playwright.sync_api", reason="playwright is not installed")
    if not shutil.which(CHROMIUM):
        pytest.skip(f"no Chromium at {CHROMIUM}")


async def test_the_page_shows_the_live_backend_and_its_retiring_predecessor(
        harness: Harness, fake: FakeLlamaServer) -> None:
    """The same reload as above, in a real browser: the page has a card for the live
    "local" (up, 0 in flight, what /metrics shows) and one for its retiring
    predecessor (cards are keyed by name and retiring, ``cardKey`` in status.html), so
    the retiring twin cannot hide the live backend."""
    _need_browser()
    async with reloaded_while_serving(
            harness, fake, {"name": "local", "url": "http://upstream2:8080"}):
        page = await harness.client.get("/status")
        data = await harness.client.get("/status.json")
        headers = {k: v for k, v in page.headers.items()
                   if k in ("content-type", "content-security-policy")}
        shown = await asyncio.to_thread(_render_status_page, page.content, headers,
                                        data.content)
        metrics_inflight = harness.sample("gateway_inflight_requests", backend="local")
        assert metrics_inflight == 0
        states = sorted(card["state"] for card in shown["cards"])
        assert "up" in states, f"no live card among {shown['cards']}"
        assert states == ["retiring", "up"], f"cards: {shown['cards']}"


@pytest.mark.parametrize("path", ["/status.json", "/status", "/metrics"])
async def test_refused_admin_key_attempts_are_info_lines(
        fake: FakeLlamaServer, caplog: pytest.LogCaptureFixture, path: str) -> None:
    """/status, /status.json and /metrics are logged at DEBUG only when answered below
    400 (logs.py ``log_access``): a 401 for a wrong admin key is an INFO line, so
    someone guessing the admin key leaves lines an operator sees at the default level,
    not only a counter shared with tenants' 401s. Probes and scrapes are quiet for
    being routine; refusals are not routine."""
    caplog.set_level(logging.INFO)
    h = await admin_harness(fake)
    try:
        for guess in ("guess-1", "guess-2", "guess-3"):
            r = await h.client.get(path, headers={"authorization": f"Bearer {guess}"})
            assert r.status_code == 401
        seen = [rec for rec in access_records(caplog) if rec.levelno >= logging.INFO]
        assert len(seen) == 3, f"{len(seen)} INFO access lines for three refused guesses"
    finally:
        await h.client.aclose()


async def test_a_client_request_id_is_made_unique_for_the_backend() -> None:
    """vLLM makes X-Request-Id its engine request id, a unique key (README says so).
    The gateway keeps a client's id for its own logs and response header, but sends
    the backend that id with a random suffix, so two concurrent requests with the
    same id reach vLLM with different ids: a vLLM without vllm#27987 (late 2025, which
    adds a random suffix itself) refuses the second ("Request id ... already
    running"), and with several API servers the engine breaks (vllm#27711,
    vllm#10583), for every tenant."""
    vllm = FakeVllm(step_delay=0.01)
    settings = load_settings(
        admission={"disconnect_grace_s": 0.0},
        backends=[{"name": "vllm", "url": "http://vllm:8000", "kind": "vllm", "slots": 16}])
    app = create_app(settings, http_client=vllm.client(), registry=CollectorRegistry(),
                     discover=False)
    h = Harness(app, vllm)  # type: ignore[arg-type]
    try:
        await app.state.gateway.fleet.backends["vllm"].discover()
        body = {"model": vllm.model, "messages": [{"role": "user", "content": "Why?"}],
                "max_tokens": 20}
        answers = await asyncio.gather(*(
            h.client.post(CHAT, json=body, headers={"x-request-id": "trace-7"})
            for _ in range(2)))
        assert all(r.status_code == 200 for r in answers)
        sent = [r.headers["x-request-id"] for r in vllm.requests if r.url.path == CHAT]
        assert len(sent) == 2
        assert sent[0] != sent[1], f"both concurrent requests reached vLLM as {sent[0]!r}"
    finally:
        await h.client.aclose()


async def test_whole_answers_have_no_ttft_under_the_predictive_policy(
        harness_factory: Any, fake: FakeLlamaServer,
        caplog: pytest.LogCaptureFixture) -> None:
    """README: ttft_ms is "arrival to the first token relayed (streams)"; under strict an
    answer in one piece has none (tests/test_logs.py). Under the predictive policy a
    whole answer is followed as a stream upstream, yet its access line has no ttft_ms
    and gateway_ttft_seconds does not observe it, as under strict: the client saw no
    first token, the field means the same under every policy, and TTFT figures are
    not mixed with whole answers."""
    fake.pool, fake.n_ctx, fake.tokens = 2048, 2048, 5
    h = await _predictive(harness_factory, fake)
    await _warm(h)
    ttft_before = h.sample("gateway_ttft_seconds_count")
    caplog.set_level(logging.INFO)
    caplog.clear()
    r = await h.chat("whole answer=5", max_tokens=50)
    assert r.status_code == 200 and r.json()["object"] == "chat.completion"
    (line,) = access_records(caplog)
    assert line.ttft_ms is None, f"a whole answer should have no ttft_ms, not {line.ttft_ms}"
    assert h.sample("gateway_ttft_seconds_count") == ttft_before


@pytest.mark.parametrize("mode", ["midstream", "truncated", "midstream_overflow"])
async def test_a_stream_that_breaks_after_its_200_names_the_upstream_error(
        harness: Harness, fake: FakeLlamaServer, caplog: pytest.LogCaptureFixture,
        mode: str) -> None:
    """Once a stream's 200 is out, an upstream failure (connection reset, a stream cut
    short, llama-server's "Context size has been exceeded" event) ends it with a final
    error event. Its access line keeps ``status=200`` but names the failure in
    ``upstream_error``, the kind gateway_upstream_errors_total counts it under: an
    operator searching the access log for failed requests (or following a user's
    request id) can tell the answer broke, which a bare 200 would not say."""
    caplog.set_level(logging.INFO)
    fake.mode = mode
    r = await harness.chat(max_tokens=5, stream=True)
    assert r.status_code == 200 and '"error"' in r.text.split("data: ")[-1]
    (line,) = access_records(caplog)
    assert line.status == 200 and line.upstream_error == (
        "context_overflow" if mode == "midstream_overflow" else "stream_aborted")
    assert harness.sample("gateway_upstream_errors_total", kind=line.upstream_error) == 1


async def test_a_retiring_backend_is_apart_from_the_metrics_backends(
        harness: Harness, fake: FakeLlamaServer) -> None:
    """A reload that removes a backend while it serves a request: /metrics drops it at
    once (``Fleet.stats`` lists only current backends), while the request still
    runs. /status.json lists it apart, in ``retiring`` (1 request in flight), so that
    its ``backends`` rows are the ones /metrics shows and keep the README's promise
    that their figures "equal the /metrics gauges of the same backend"."""
    async with reloaded_while_serving(
            harness, fake, {"name": "other", "url": "http://upstream:8080"}):
        data = (await harness.client.get("/status.json")).json()
        # the configured backends are the ones /metrics shows; the retiring one is
        # listed apart (its successor may have its name)
        assert [r["name"] for r in data["backends"]] == ["other"]
        (gone,) = data["retiring"]
        assert gone["name"] == "local" and gone["state"] == "retiring"
        assert gone["inflight"] == 1
        assert harness.sample("gateway_inflight_requests", backend="other") == \
            data["backends"][0]["inflight"] == 0


async def test_rejections_of_a_removed_backend_stay_on_the_page(
        harness: Harness) -> None:
    """Rejections are shown per backend row, and those no row shows in
    ``unassigned_rejections``: the ones refused before a backend was chosen and, once
    a reload removes a backend, the ones of that backend, whose
    gateway_rejections_total series stay in /metrics. The page's totals thus never
    fall below /metrics (the browser test: "No reason /metrics counts is missing from
    the page")."""
    assert (await harness.chat("word " * 3000)).status_code == 400  # counted on "local"
    new = load_settings(admission={"disconnect_grace_s": 0.0},
                        backends=[{"name": "other", "url": "http://upstream:8080"}])
    await reload(harness.state, new)
    await until(lambda: not harness.state.fleet.retiring)
    data = (await harness.client.get("/status.json")).json()
    shown = sum(sum(row["rejections"]["total"].values()) for row in data["backends"]) + sum(
        data["unassigned_rejections"]["total"].values())
    assert shown == harness.sample("gateway_rejections_total") == 1


def test_recent_rejections_count_from_the_first_reading_after_a_gap() -> None:
    """README: "the first reading after nobody looked for a while covers the whole gap,
    and the next ones count from it". Open the page after an idle hour: the first
    reading spans the hour, and the ones after it span only the seconds since, so
    "recent" does not mean "the last hour" for five more minutes, showing an incident
    long over."""
    clock = ManualClock()
    counter = Counter("gateway_rejections", "t", ["backend", "reason", "tenant", "priority"],
                      registry=CollectorRegistry())
    log = RejectionLog(counter, clock, window_s=300, sample_every_s=5)
    counter.labels("local", "queue_full", "web", "default").inc(50)  # an old incident
    clock.advance(3600)
    assert log.read()[2] == 3600  # the first reading after an idle hour: documented
    for _ in range(10):  # the page stays open, reading every 5 s
        clock.advance(5)
        _totals, recent, span = log.read()
    assert span <= 305, f"50 s after opening the page 'recent' should not span {span} s"
    assert recent == {}


def test_recent_rejections_cover_the_window_while_the_page_stays_open() -> None:
    """Read every 1.5 s (the page's refresh) for 15 minutes: "recent" covers the last
    5 minutes, give or take one sampling step, at every reading; it never falls back
    to a few seconds once the window has filled."""
    clock = ManualClock()
    counter = Counter("gateway_rejections", "t", ["backend", "reason", "tenant", "priority"],
                      registry=CollectorRegistry())
    log = RejectionLog(counter, clock, window_s=300, sample_every_s=5)
    spans = []
    for step in range(600):
        clock.advance(1.5)
        if step == 10:
            counter.labels("local", "queue_full", "web", "default").inc()
        _totals, recent, span = log.read()
        spans.append(span)
        if 300 / 1.5 + 20 < step:  # over 5 minutes after the rejection
            assert recent == {}, step
    filled = spans[int(310 / 1.5):]
    assert min(filled) >= 295 and max(filled) <= 306, (min(filled), max(filled))


async def test_status_requests_of_any_method_are_route_status(
        harness: Harness) -> None:
    """README: route ``status`` is "the status page and its JSON". ``LABELS``
    (routes.py) maps /status and /status.json to it, so a request that never reaches
    the GET handler (a 405 for POST or HEAD, a 431) is counted as route ``status``
    too, not ``other``."""
    await harness.client.post("/status")
    await harness.client.head("/status.json")
    assert harness.sample("gateway_requests_total", route="other") == 0
    assert harness.sample("gateway_requests_total", route="status") == 2


# ===========================================================================================
# Edges that held
# ===========================================================================================

ERROR_CASES = [
    ("GET", "/nope", {}, None, 404),
    ("POST", "/status", {}, None, 405),
    ("OPTIONS", CHAT, {}, None, 405),
    ("POST", CHAT, {"content-type": "application/json"}, b"{", 400),
    ("POST", "/v1/messages", {"content-type": "application/json"}, b"{", 400),
    ("POST", "/api/chat", {"content-type": "application/json"}, b"{", 400),
    ("POST", CHAT, {"content-type": "text/plain"}, b"{}", 415),
    ("POST", CHAT, {"content-type": "application/json",
                    **{f"x-pad-{i}": "v" for i in range(70)}}, b"{}", 431),
    ("POST", CHAT, {"content-type": "application/json"}, b"x" * (20 * 1024 * 1024), 413),
]


@pytest.mark.parametrize(("method", "path", "headers", "body", "status"), ERROR_CASES)
async def test_every_error_has_one_request_id_and_one_access_line(
        harness: Harness, caplog: pytest.LogCaptureFixture, method: str, path: str,
        headers: dict[str, str], body: bytes | None, status: int) -> None:
    caplog.set_level(logging.DEBUG, logger="gateway.access")
    r = await harness.client.request(method, path, headers={**headers,
                                                            "x-request-id": "err-1"},
                                     content=body)
    assert r.status_code == status
    assert r.headers.get_list("x-request-id") == ["err-1"]
    (line,) = access_records(caplog)
    assert (line.request_id, line.status) == ("err-1", status)


async def test_a_refused_tenant_request_has_its_id_and_reason(
        fake: FakeLlamaServer, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO)
    settings = load_settings(admission={"disconnect_grace_s": 0.0},
                             backends=[{"name": "local", "url": "http://upstream:8080"}],
                             tenants=[{"name": "web", "key_hashes": ["0" * 64]}])
    app = create_app(settings, http_client=fake.client(), registry=CollectorRegistry(),
                     discover=False)
    h = Harness(app, fake)
    try:
        r = await h.client.post(CHAT, json={"messages": [{"role": "user", "content": "x"}]},
                                headers={"authorization": "Bearer sk-wrong-key-1",
                                         "x-request-id": "who-1"})
        assert r.status_code == 401 and r.headers["x-request-id"] == "who-1"
        (line,) = access_records(caplog)
        assert (line.status, line.reason, line.tenant) == (401, "unauthorized", "none")
        assert all("sk-wrong-key-1" not in rec.getMessage() + repr(rec.__dict__)
                   for rec in caplog.records)
    finally:
        await h.client.aclose()


async def test_several_request_id_headers_the_first_wins_and_one_goes_upstream(
        harness: Harness, fake: FakeLlamaServer, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO)
    body = json.dumps({"messages": [{"role": "user", "content": "hi"}],
                       "max_tokens": 2}).encode()
    for ids, kept in ((["first-1", "second-2"], "first-1"),
                      (["bad id", "good-2"], None),  # the first is not plain: a new one
                      ([""], None)):
        caplog.clear()
        headers = [(b"content-type", b"application/json")] + [
            (b"x-request-id", i.encode()) for i in ids]
        r = await harness.client.post(CHAT, content=body, headers=headers)
        rid = r.headers["x-request-id"]
        assert r.headers.get_list("x-request-id") == [rid]
        assert rid == kept if kept else (len(rid) == 32 and rid not in ids)
        (sent,) = fake.requests[-1].headers.get_list("x-request-id")
        assert sent == (f"{rid}-{sent[-8:]}" if kept else rid)  # a client's made unique
        (line,) = access_records(caplog)
        assert line.request_id == rid


async def test_a_path_with_newlines_and_quotes_stays_one_line_in_both_formats(
        harness: Harness, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO)
    forged = "/x%0A2026-01-01 00:00:00,000 INFO gateway.access: POST /v1/chat 200%22%0D"
    r = await harness.client.get(forged)
    assert r.status_code == 404
    (record,) = access_records(caplog)
    text = TextFormatter("%(asctime)s %(levelname)s %(name)s: %(message)s").format(record)
    assert "\n" not in text and "\r" not in text
    configure_logging(ServerSettings(log_format="json"))
    try:
        as_json = logging.getLogger().handlers[0].formatter.format(record)  # type: ignore
    finally:
        root = logging.getLogger()
        for handler in list(root.handlers):
            root.removeHandler(handler)
    assert "\n" not in as_json and json.loads(as_json)["path"].startswith("/x\n2026")


def test_a_json_exception_line_is_one_object(capsys: pytest.CaptureFixture[str]) -> None:
    root = logging.getLogger()
    saved = (root.handlers[:], root.level)
    try:
        configure_logging(ServerSettings(log_format="json"))
        try:
            raise ValueError("bad\nthing")
        except ValueError:
            logging.getLogger("gateway.http.middleware").exception("unhandled error on %s %s",
                                                              "POST", "/v1/x\ny")
    finally:
        root.handlers[:] = saved[0]
        root.setLevel(saved[1])
        logging.getLogger("gateway.access").disabled = False
        logging.getLogger("uvicorn.access").disabled = False
    lines = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    (only,) = lines
    parsed = json.loads(only)
    assert parsed["level"] == "ERROR" and "ValueError: bad\nthing" in parsed["exc_info"]


def test_a_stream_the_client_cuts_has_one_499_line_with_its_ttft(
        make_settings: Any, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO)
    fake = FakeLlamaServer(tokens=40, token_delay=0.05)
    body = json.dumps({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 40,
                       "stream": True}).encode()
    with served(make_settings(), fake.client()) as port:
        caplog.clear()
        with socket.create_connection(("127.0.0.1", port), timeout=5) as sock:
            sock.sendall(request_bytes(CHAT, body, extra=[("X-Request-Id", "cut-1")]))
            got = b""
            while b"t1 " not in got:
                got += sock.recv(4096)
        deadline = time.monotonic() + 5
        while not access_records(caplog) and time.monotonic() < deadline:
            time.sleep(0.05)
        time.sleep(0.3)
    (line,) = access_records(caplog)
    assert (line.request_id, line.status, line.backend) == ("cut-1", 499, "local")
    assert line.ttft_ms is not None and line.ttft_ms <= line.duration_ms


async def test_a_failed_over_request_has_one_line_naming_the_backend_that_served(
        caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO)
    fakes = {n: FakeLlamaServer() for n in ("a", "b")}
    fleet = Fleet(fakes, [{"name": "a", "model": "m"}, {"name": "b", "model": "m"}])
    try:
        await fleet.discover()
        fleet.refused.add("a")  # a refuses the connection: nothing reached it
        caplog.clear()
        r = await fleet.chat(model="m", max_tokens=3, stream=True)
        assert r.status_code == 200 and len(fakes["b"].generations) == 1
        assert fleet.state.metrics.failovers.labels("m")._value.get() == 1
        (line,) = access_records(caplog)
        assert (line.status, line.backend, line.reason) == (200, "b", None)
        assert line.ttft_ms is not None
        assert fakes["b"].requests[-1].headers["x-request-id"] == r.headers["x-request-id"]
    finally:
        await fleet.client.aclose()


def _basic(user: bytes, password: bytes) -> bytes:
    return b"Basic " + base64.b64encode(user + b":" + password)


@pytest.mark.parametrize(("authorization", "ok"), [
    ("bearer " + "k\u00e9y:1 x", True),
    ("BEARER " + "k\u00e9y:1 x", True),
    (_basic(b"ops", "k\u00e9y:1 x".encode()), True),
    (b"basic " + base64.b64encode("u:k\u00e9y:1 x".encode()), True),
    (_basic(b"ops", "k\u00e9y:1 x".encode("latin-1")), False),  # not UTF-8
    (_basic(b"ops", "k\u00e9y:1 x".encode())[:-1], False),  # padding cut
    (_basic("k\u00e9y:1 x".encode(), b""), False),  # the key as the user name
    (_basic(b"ops", b""), False),
    (b"Basic", False),
    (b"Basic =", False),
    (b"Digest username=ops", False),
])
async def test_status_auth_edges_with_a_unicode_key_holding_colon_and_space(
        fake: FakeLlamaServer, authorization: Any, ok: bool) -> None:
    settings = load_settings(server={"admin_key": "k\u00e9y:1 x"},
                             backends=[{"name": "local", "url": "http://upstream:8080"}])
    app = create_app(settings, http_client=fake.client(), registry=CollectorRegistry(),
                     discover=False)
    value = authorization.encode() if isinstance(authorization, str) else authorization
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app),
                                 base_url="http://gateway") as client:
        r = await client.get("/status.json", headers=[(b"authorization", value)])
    assert r.status_code == (200 if ok else 401)


@pytest.mark.parametrize("kind", ["llama.cpp", "ollama", "vllm"])
async def test_status_of_an_undiscovered_backend_of_each_kind(kind: str) -> None:
    settings = load_settings(backends=[{"name": "b", "url": "http://b:1", "kind": kind}])
    app = create_app(settings, http_client=FakeLlamaServer(mode="connect").client(),
                     registry=CollectorRegistry(), discover=False)
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app),
                                 base_url="http://gateway") as client:
        r = await client.get("/status.json")
    (row,) = r.json()["backends"]
    assert r.status_code == 200 and (row["state"], row["layout"], row["kind"]) == (
        "not_ready", None, kind)


async def test_hostile_names_models_and_problems_render_as_text(
        fake: FakeLlamaServer) -> None:
    """The page writes everything with textContent / dataset: a backend that reports a
    model name or problem with markup cannot inject any (checked in Chromium)."""
    _need_browser()
    h = await admin_harness(fake)
    try:
        page = await h.client.get("/status", headers={"authorization":
                                                      f"Bearer {ADMIN_KEY}"})
        data = (await h.client.get("/status.json", headers={
            "authorization": f"Bearer {ADMIN_KEY}"})).json()
        evil = '<img src=x onerror="window.__pwned=1"><b>x</b>'
        row = data["backends"][0]
        row.update(name=evil, model=evil, kind=evil, state="not_ready", problem=evil,
                   rejections={"total": {evil: 1}, "recent": {evil: 1}})
        data["pools"] = [{"model": evil, "backends": [evil], "queued": 1,
                          "queue_capacity": 2, "oldest_wait_s": 0.5}]
        data["unassigned_rejections"] = {"total": {evil: 2}, "recent": {}}
        headers = {k: v for k, v in page.headers.items()
                   if k in ("content-type", "content-security-policy")}
        shown = await asyncio.to_thread(_render_status_page, page.content, headers,
                                        json.dumps(data).encode())
    finally:
        await h.client.aclose()
    assert shown["injected"] == 0 and not shown["pwned"] and not shown["dialogs"]
    (card,) = shown["cards"]
    assert card["model"] == evil and card["problem"] == evil and card["name"] == evil
