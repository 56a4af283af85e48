"""Review of issue 27 (vLLM's own queue limits, read as "backend full"): the paths the
first tests did not walk. A client leaving while its request waits for room, a drain
during that wait, a pool whose backends are all full, another 503 that is a failure,
the tenant's tokens of a request vLLM never ran; each leaves every reservation given
back. Against the fake vLLM (tests/fake_vllm.py), whose queue limits follow vLLM's
``AsyncLLM.check_admission``.
"""

from __future__ import annotations

import asyncio
import hashlib
import json

import httpx
import pytest
from prometheus_client import CollectorRegistry

from gateway.config import load_settings
from gateway.http.app import create_app
from tests.conftest import Harness
from tests.fake_vllm import FakeVllm
from tests.fakes import ManualClock
from tests.test_shared_attack import RawCall
from tests.test_vllm import build, chat, drive, until

pytestmark = pytest.mark.anyio
CHAT = "/v1/chat/completions"


def idle(h: Harness) -> bool:
    """Every backend holds nothing: no lease, no reservation, no waiter."""
    return all(s.inflight == 0 and s.reserved_tokens == 0 and s.queued == 0
               and s.busy_slots == 0 for s in (b.admission.stats()
                                               for b in h.state.fleet.backends.values()))


async def test_a_client_leaving_while_its_request_waits_for_room_leaves_nothing() -> None:
    # --max-num-queued-reqs 1: the second request is refused, waits in the gateway's
    # queue (the busy cap holds it), and its client leaves there.
    vllm = FakeVllm(max_num_queued_reqs=1, hold=asyncio.Event())
    h = await build([("vllm", vllm)])
    first = asyncio.ensure_future(h.client.post(CHAT, json=chat(max_tokens=3)))
    await until(lambda: len(vllm.generations) == 1, "the first reached vLLM")
    second = RawCall(h, chat(max_tokens=3))
    backend = h.state.fleet.backends["vllm"]
    await until(lambda: backend.admission.stats().queued == 1, "the second waits")
    second.leave()
    await asyncio.wait_for(second.task, 5)
    assert backend.admission.stats().queued == 0
    vllm.hold.set()
    assert (await first).status_code == 200
    assert idle(h) and vllm.refused == ["queue_full"]
    assert h.sample("gateway_upstream_errors_total") == 0


async def test_a_client_leaving_during_the_pause_between_refusals_leaves_nothing() -> None:
    # --max-num-queued-reqs 0 refuses everything: after its second refusal the request
    # pauses (0.25 s) before it is admitted again; its client leaves in that pause.
    clock = ManualClock()
    vllm = FakeVllm(max_num_queued_reqs=0)
    h = await build([("vllm", vllm)], {"max_queue_wait_s": 30.0}, clock=clock)
    call = RawCall(h, chat(max_tokens=3))
    await until(lambda: len(vllm.refused) == 2, "two refusals")
    for _ in range(50):
        await asyncio.sleep(0)
    assert not call.task.done() and idle(h)  # pausing: nothing held
    call.leave()
    await asyncio.wait_for(call.task, 5)
    clock.advance(10)
    for _ in range(50):
        await asyncio.sleep(0)
    assert len(vllm.refused) == 2 and idle(h)  # not sent again once its client left


async def test_a_pool_whose_backends_are_both_full_serves_the_overflow_when_room_frees(
        ) -> None:
    # a and b each take one request (--max-num-queued-reqs 1); the third is refused by
    # both, waits in the pool's queue, and is served by the first backend to free room.
    clock = ManualClock()
    hold = asyncio.Event()
    a, b = FakeVllm(max_num_queued_reqs=1, hold=hold), FakeVllm(max_num_queued_reqs=1,
                                                                hold=hold)
    h = await build([("a", a), ("b", b)], {"max_queue_wait_s": 30.0}, clock=clock)
    body = chat(max_tokens=3)
    first = asyncio.ensure_future(h.client.post(CHAT, json=body))
    await until(lambda: len(a.generations) == 1, "the first reached a")
    second = asyncio.ensure_future(h.client.post(CHAT, json=body))
    await until(lambda: len(b.generations) == 1, "the second reached b")
    third = asyncio.ensure_future(h.client.post(CHAT, json=body))
    await until(lambda: a.refused == ["queue_full"] and b.refused == ["queue_full"],
                "both refused the third")
    clock.advance(1.0)  # past its pause: it waits in the pool's queue, capped out of both
    await until(lambda: not third.done() and idle_but_two(h), "the third waits")
    hold.set()
    replies = await asyncio.gather(first, second, third)
    assert [r.status_code for r in replies] == [200, 200, 200]
    assert len(a.refused) + len(b.refused) == 2  # never sent to a full one again
    for name in ("a", "b"):
        backend = h.state.fleet.backends[name]
        assert backend.up and backend.health.failures == 0
    assert h.sample("gateway_upstream_errors_total") == 0
    assert h.sample("gateway_failovers_total") == 0
    assert idle(h)


def idle_but_two(h: Harness) -> bool:
    """The two first requests hold their leases, nothing else is held."""
    stats = [b.admission.stats() for b in h.state.fleet.backends.values()]
    return sum(s.inflight for s in stats) == 2 and sum(s.busy_slots for s in stats) == 2


async def test_another_503_of_vllm_is_a_failure_it_fails_over_from() -> None:
    # A 503 that is not a queue limit (the engine not ready) still marks the backend
    # down in a pool, counts as an upstream error, and the request fails over.
    a, b = FakeVllm(), FakeVllm()
    answer = a.handle

    async def not_ready(request: httpx.Request) -> httpx.Response:
        if request.url.path == "/v1/chat/completions":
            return httpx.Response(503, json={"error": {
                "message": "The engine is not ready yet.", "type": "Service Unavailable",
                "param": None, "code": 503}})
        return await answer(request)

    a.handle = not_ready  # type: ignore[method-assign]
    h = await build([("a", a), ("b", b)])
    r = await h.client.post(CHAT, json=chat(max_tokens=3))
    assert r.status_code == 200 and len(b.generations) == 1
    assert h.sample("gateway_upstream_errors_total", backend="a", kind="status_5xx") == 1
    assert h.sample("gateway_backend_full_total") == 0
    assert h.sample("gateway_failovers_total") == 1
    assert not h.state.fleet.backends["a"].up  # marked down for the pool's backoff
    assert h.state.fleet.backends["a"].admission.layout.busy_cap is None
    assert idle(h)


async def test_the_engine_dead_500_is_a_failure_not_room() -> None:
    from tests.fake_vllm import ERRORS

    vllm = FakeVllm()
    h = await build([("vllm", vllm)])
    exc = h.state.fleet.backends["vllm"].translate_error(
        500, json.dumps(ERRORS["engine_dead"]).encode(), None)
    assert type(exc).__name__ != "BackendFull" and exc.upstream_kind == "status_5xx"
    # The queue-full wording under another status is not a queue limit either.
    other = h.state.fleet.backends["vllm"].translate_error(
        500, json.dumps(ERRORS["queue_full"]).encode(), None)
    assert type(other).__name__ != "BackendFull"


KEY = "sk-tenant-0123456789"


async def test_a_request_vllm_never_ran_costs_its_tenant_no_tokens() -> None:
    # vLLM refuses every try (--max-num-queued-reqs 0): the request ends in the gateway's
    # queue timeout, and vLLM never ran it. Like a request the gateway's own queue timed
    # out, it counts nothing in its tenant's tokens per minute.
    clock = ManualClock()
    vllm = FakeVllm(max_num_queued_reqs=0)
    settings = load_settings(
        admission={"disconnect_grace_s": 0.0, "max_queue_wait_s": 2.0},
        backends=[{"name": "vllm", "url": "http://vllm:8000", "kind": "vllm",
                   "slots": 16}],
        tenants=[{"name": "web", "key_hashes": [hashlib.sha256(KEY.encode()).hexdigest()],
                  "tokens_per_minute": 100_000}])
    app = create_app(settings, http_client=vllm.client(), registry=CollectorRegistry(),
                     clock=clock, discover=False)
    h = Harness(app, vllm)  # type: ignore[arg-type]
    await h.state.fleet.backends["vllm"].discover()
    reply = await drive(clock, h.client.post(
        CHAT, json=chat(max_tokens=3), headers={"authorization": f"Bearer {KEY}"}))
    assert reply.status_code == 503 and reply.json()["error"]["code"] == "queue_timeout"
    assert len(vllm.refused) >= 2
    assert h.sample("gateway_tenant_tokens_total", tenant="web") == 0
    assert idle(h)
    # Served once room frees, it is counted as any served request is.
    vllm.max_num_queued_reqs = None
    served = await h.client.post(CHAT, json=chat(max_tokens=3),
                                 headers={"authorization": f"Bearer {KEY}"})
    assert served.status_code == 200
    assert h.sample("gateway_tenant_tokens_total", tenant="web", kind="prompt") > 0


async def test_a_drain_waits_for_a_request_pausing_between_refusals() -> None:
    # A request between two tries (its pause after the second refusal) is work in hand:
    # the drain does not call itself complete while it pauses, and it is served.
    clock = ManualClock()
    vllm = FakeVllm(max_num_queued_reqs=0)
    h = await build([("vllm", vllm)], {"max_queue_wait_s": 30.0}, clock=clock)
    reply = asyncio.ensure_future(h.client.post(CHAT, json=chat(max_tokens=3)))
    await until(lambda: len(vllm.refused) == 2 and idle(h), "two refusals, pausing")
    drain = asyncio.ensure_future(h.state.drain())
    for _ in range(50):
        await asyncio.sleep(0)
    assert not drain.done()  # the request is in hand
    vllm.max_num_queued_reqs = None  # room now
    served = await drive(clock, reply)
    assert served.status_code == 200
    assert await drive(clock, drain)  # type: ignore[arg-type]
    assert idle(h)


async def test_the_cause_label_is_the_gateways_own_word() -> None:
    # gateway_backend_full_total{cause} comes from the gateway's list of vLLM's limits,
    # never from the text vLLM sent: its label values stay bounded.
    vllm = FakeVllm()
    h = await build([("vllm", vllm)])
    target = h.state.fleet.backends["vllm"]
    odd = {"error": {"message": "The engine has reached its prefill token backlog limit "
                                "(ABC-123 xyz).", "type": "Service Unavailable",
                     "param": None, "code": 503}}
    exc = target.translate_error(503, json.dumps(odd).encode(), None)
    assert exc.cause == "prefill_backlog"


async def test_the_busy_cap_is_relaxed_by_later_discoveries_and_never_stops_an_idle_one(
        ) -> None:
    clock = ManualClock()
    vllm = FakeVllm(max_num_queued_reqs=1, hold=asyncio.Event())
    h = await build([("vllm", vllm)], clock=clock)
    backend = h.state.fleet.backends["vllm"]
    first = asyncio.ensure_future(h.client.post(CHAT, json=chat(max_tokens=3)))
    await until(lambda: len(vllm.generations) == 1, "the first reached vLLM")
    second = asyncio.ensure_future(h.client.post(CHAT, json=chat(max_tokens=3)))
    await until(lambda: backend.admission.layout.busy_cap == 1, "capped at one")
    vllm.hold.set()
    assert [r.status_code for r in await asyncio.gather(first, second)] == [200, 200]
    assert idle(h)
    # Idle, the capped backend takes a request at once (the cap binds only what is busy).
    assert (await h.client.post(CHAT, json=chat(max_tokens=3))).status_code == 200
    caps = []
    for _ in range(5):
        clock.advance(60.0)
        await backend.discover()
        caps.append(backend.admission.layout.busy_cap)
    assert caps == [2, 4, 8, None, None]  # doubled a minute at a time, gone at 16 slots
