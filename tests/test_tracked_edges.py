"""Edges of followed requests, queue/prefill progress and quick /slots reads, found by
an adversarial pass (each failed before its fix; the comments say what was seen)."""
from __future__ import annotations

import asyncio
import json
from typing import Any

import httpx
import pytest
from prometheus_client import CollectorRegistry

from gateway.admission.admission import Admission
from gateway.admission.slotwatch import SlotView, SlotWatch, Ticket
from gateway.config import load_settings
from gateway.core.capacity import Charge, Layout
from gateway.http.app import create_app
from tests.conftest import Harness
from tests.fake_ollama import FakeOllama
from tests.fakes import ManualClock
from tests.test_predictive import _predictive, _stream_text, _warm

pytestmark = pytest.mark.anyio


async def test_a_continuation_with_a_slow_prefill_starts_the_response_once(
        harness_factory: Any, fake: Any) -> None:
    fake.pool, fake.n_ctx, fake.token_delay, fake.tokens = 2048, 2048, 0.01, 10**6
    h = await _predictive(harness_factory, fake, queue_progress_s=0.05)
    await _warm(h)
    req = asyncio.ensure_future(h.client.post(
        "/v1/chat/completions", headers={"X-Queue-Progress": "1"},
        json={"messages": [{"role": "user", "content": "go answer=30"}],
              "max_tokens": 500, "stream": True}))
    adm = h.backend.admission
    while not (adm._active and next(iter(adm._active.values())).generated >= 3):
        await asyncio.sleep(0.01)
    fake.prepare = asyncio.Event()  # the continuation's prefill takes 0.6 s
    asyncio.get_running_loop().call_later(0.6, fake.prepare.set)
    adm.preempt(next(iter(adm._active.values())), "pool_pressure")
    r = await req  # was: a second http.response.start (AssertionError in the transport)
    text, _ids, done, errors = _stream_text(r.text)
    assert text == "".join(f" t{i}" for i in range(30)) and done == 1 and not errors


async def test_a_served_followed_request_counts_as_200_and_served(
        harness_factory: Any, fake: Any) -> None:
    fake.pool, fake.n_ctx, fake.tokens = 2048, 2048, 3
    h = await harness_factory({"policy": "predictive"}, kv_unified=True, pool_tokens=2048)
    seen: list[float] = []
    orig = h.backend.admission.record_duration
    h.backend.admission.record_duration = lambda s, c: (seen.append(s), orig(s, c))
    r = await h.chat("hi", max_tokens=20, stream=True)
    assert r.status_code == 200 and r.text.rstrip().endswith("data: [DONE]")
    got = {c: h.sample("gateway_requests_total", backend="local", route="chat", code=c)
           for c in ("200", "499")}
    assert got == {"200": 1.0, "499": 0.0} and seen  # was: 499, and not served


async def test_an_ollama_ndjson_stream_ignores_the_progress_header() -> None:
    ollama, gate = FakeOllama(), asyncio.Event()
    inner = ollama.handle

    async def handle(request: httpx.Request) -> httpx.Response:
        if request.url.path == "/api/chat":
            await gate.wait()  # model load / prefill: no headers yet
        return await inner(request)

    ollama.handle = handle  # type: ignore[method-assign]
    app = create_app(load_settings(
        admission={"disconnect_grace_s": 0.0, "queue_progress_s": 0.05},
        backends=[{"name": "ollama", "url": "http://ollama:11434", "kind": "ollama"}]),
        http_client=ollama.client(), registry=CollectorRegistry(), discover=False)
    h = Harness(app, ollama)  # type: ignore[arg-type]
    await app.state.gateway.fleet.backends["ollama"].discover()
    asyncio.get_running_loop().call_later(0.3, gate.set)
    r = await h.client.post("/api/chat", headers={"X-Queue-Progress": "1"}, json={
        "model": "llama3.2:1b", "messages": [{"role": "user", "content": "hi"}],
        "options": {"num_predict": 3}})
    await h.client.aclose()
    # was: text/event-stream, ": processing prompt" lines, then every NDJSON line
    # buffered to the end and sent as one "data: {...}\n{...}\n{...}" event
    assert r.headers["content-type"].startswith("application/x-ndjson")
    lines = [json.loads(x) for x in r.text.splitlines() if x.strip()]
    assert [x["message"]["content"] for x in lines[:-1]] == ["t0 ", "t1 ", "t2 "]


async def test_an_unpinned_messages_stream_gets_prefill_progress(harness_factory: Any,
                                                           fake: Any) -> None:
    gate, inner = asyncio.Event(), fake.handle

    async def handle(request: httpx.Request) -> httpx.Response:
        if request.url.path != "/v1/messages":
            return await inner(request)
        await gate.wait()
        return httpx.Response(400, json={"error": {"code": 400, "message": "no",
                                                   "type": "invalid_request_error"}})

    fake.handle = handle
    h = await harness_factory({"queue_progress_s": 0.05})
    asyncio.get_running_loop().call_later(0.3, gate.set)
    r = await h.client.post("/v1/messages", headers={"X-Queue-Progress": "1"}, json={
        "model": "m", "max_tokens": 20, "stream": True,
        "messages": [{"role": "user", "content": "hello"}]})
    # was: a plain HTTP 400 after 0.3 s of silence (unpinned: send is unless_gone)
    assert r.status_code == 200 and r.text.count(": processing prompt") >= 3


async def test_preemptions_never_cancel_a_slow_slots_read() -> None:
    clock = ManualClock()
    adm = Admission(Layout(slots=32, ctx_per_slot=512), max_queue=4, max_wait_s=30.0,
                    clock=clock)
    done: list[float] = []

    async def fetch() -> list[SlotView]:  # /slots answers in 0.5 s; all slots idle
        await clock.sleep(0.5)
        done.append(clock.now())
        return [SlotView(id=i, processing=False, params=()) for i in range(32)]

    sw = SlotWatch("b", fetch, adm, clock, unseen_timeout_s=30.0, fallback_grace_s=1.0)
    for _ in range(10):  # a preemption every 0.6 s for 6 s
        lease = adm.try_admit(Charge(10, 10))
        sw.hold(lease, Ticket(slot=lease.slot_ids[0], tasks=1, tag=None, n_predict=10,
                              since=clock.now()), served=False, launched=True, quick=True)
        for _ in range(6):
            for _ in range(20):
                await asyncio.sleep(0)
            clock.advance(0.1)
    assert done and sw.waiting == 0  # was: no read ever completed; 10 leases held


async def test_a_continuation_waiting_in_the_queue_keeps_telling_where_it_stands(
        harness_factory: Any, fake: Any) -> None:
    """A stream that asked for progress, preempted after its first tokens, waits for its
    continuation's lease with ': queued position=1' comments in the same stream."""
    fake.pool, fake.n_ctx, fake.token_delay, fake.tokens = 2048, 2048, 0.01, 10**6
    h = await _predictive(harness_factory, fake, queue_progress_s=0.05)
    await _warm(h)
    adm = h.backend.admission
    plain = adm.try_admit

    def queue_the_continuation(charge: Any, *, front: bool = False,
                               prefer: Any = None, party: Any = None) -> Any:
        return None if front else plain(charge, front=front, prefer=prefer, party=party)

    adm.try_admit = queue_the_continuation  # it queues until the old lease goes (0.2 s)
    req = asyncio.ensure_future(h.client.post(
        "/v1/chat/completions", headers={"X-Queue-Progress": "1"},
        json={"messages": [{"role": "user", "content": "go answer=40"}],
              "max_tokens": 500, "stream": True}))
    while not (adm._active and next(iter(adm._active.values())).generated >= 3):
        await asyncio.sleep(0.01)
    first = next(iter(adm._active.values()))
    fits = adm.fits
    adm.fits = lambda layout, charge, party=None: first.released and fits(layout, charge, party)
    adm.preempt(first, "pool_pressure")
    r = await req
    head, _, after_first = r.text.partition("data: ")
    assert ": queued position=1" in after_first
    text, _ids, done, errors = _stream_text(r.text)
    assert text == "".join(f" t{i}" for i in range(40)) and done == 1 and not errors
