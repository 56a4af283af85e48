"""Latency targets under attack (issue 26): pools, a busy backend whose wait is not yet
predicted, a deadline partly spent before admission, a prefill rate learnt under a
model's load, the SLO limit's gauge (before a layout, after it shrank, under Redis), and
the refusal in each route's own error shape. Over the fakes (tests/fakes.py,
tests/fake_ollama.py); the relay tests run in real time, for a second or two each."""

from __future__ import annotations

import asyncio
import hashlib
from typing import Any

import httpx
import pytest
from prometheus_client import CollectorRegistry

from gateway.admission.admission import Admission
from gateway.admission.lease import Lease
from gateway.admission.slo import PROBE_S, late_backends, spent
from gateway.config import load_settings
from gateway.core.capacity import Charge, Layout
from gateway.core.fairness import Party
from gateway.errors import SloUnattainable
from gateway.fleet.pool import Candidate, ModelQueue
from gateway.http.app import create_app
from tests.conftest import Harness
from tests.fake_ollama import FakeOllama
from tests.fakes import FakeLlamaServer, ManualClock
from tests.test_fleet import Fleet, _target

LAYOUT = Layout(slots=4, ctx_per_slot=4096, pool_tokens=16384)
LONG = Charge(3000, 100)  # 3 s of prefill at 1,000 tokens/s
KEY = "sk-web-0123456789"


async def _settle() -> None:
    for _ in range(5):
        await asyncio.sleep(0)


def _learn(adm: Admission, tokens_per_s: float) -> None:
    for _ in range(3):
        adm.slo.observe_prefill(1000, 1000 / tokens_per_s)


# -- one backend ---------------------------------------------------------------------


async def test_a_busy_backend_refuses_what_an_idle_one_refuses() -> None:
    """With its queue wait not predicted yet (no lease served), a request that would
    queue is still refused when its prefill alone misses its deadline: before, a busy
    backend queued what an idle one refused."""
    clock = ManualClock()
    adm = Admission(Layout(slots=1, ctx_per_slot=4096), max_queue=4, max_wait_s=60.0,
                    clock=clock)
    _learn(adm, 1000.0)
    with pytest.raises(SloUnattainable):
        adm.try_admit(LONG, party=Party(ttft_deadline_s=1.0))  # idle: refused
    held = adm.try_admit(Charge(100, 100))
    assert held is not None and adm.predict_wait_s(LONG) is None
    late = asyncio.ensure_future(adm.admit(LONG, party=Party(ttft_deadline_s=1.0)))
    await _settle()
    assert late.done() and isinstance(late.exception(), SloUnattainable)
    assert adm.stats().queued == 0
    in_time = asyncio.ensure_future(adm.admit(LONG, party=Party(ttft_deadline_s=5.0)))
    await _settle()
    assert not in_time.done()  # the prefill fits its deadline: it waits
    adm.release(held)
    await _settle()
    adm.release(in_time.result())
    assert adm.stats().busy_slots == 0


def test_what_was_spent_before_admission_counts_towards_the_deadline() -> None:
    assert spent(Party(ttft_deadline_s=1.0), 0.25).ttft_spent_s == 0.25
    none = Party(priority="batch")
    assert spent(none, 3.0) is none  # no deadline: nothing to count against
    adm = Admission(LAYOUT, max_queue=4, max_wait_s=60.0, clock=ManualClock())
    _learn(adm, 1000.0)
    charge = Charge(500, 100)  # 0.5 s of prefill
    assert adm.try_admit(charge, party=spent(Party(ttft_deadline_s=1.0), 0.25))
    with pytest.raises(SloUnattainable) as refused:
        adm.try_admit(charge, party=spent(Party(ttft_deadline_s=1.0), 0.75))
    # From its arrival: 0.75 s spent and 0.5 s of prefill; sent afresh it would be in
    # time, so Retry-After is the least.
    assert refused.value.details == {"predicted_ttft_ms": 1250, "deadline_ms": 1000}
    assert refused.value.retry_after_s == 1.0
    with pytest.raises(SloUnattainable):  # the class's target counts the same way
        adm.try_admit(charge, party=spent(Party(ttft_target_s=1.0), 0.75))


async def test_a_refusal_does_not_lock_itself_in() -> None:
    """A prefill rate learnt far too slow refuses every long prompt; nothing served,
    nothing learnt. Once PROBE_S passes with no prefill seen, one such request is served
    (asked again as it queues, it still is), and only one per PROBE_S."""
    clock = ManualClock()
    adm = Admission(LAYOUT, max_queue=4, max_wait_s=60.0, clock=clock)
    _learn(adm, 100.0)  # as under a model's load: 30 s predicted for LONG
    party = Party(ttft_deadline_s=2.0)
    with pytest.raises(SloUnattainable):
        adm.try_admit(LONG, party=party)
    clock.advance(PROBE_S)
    probe = adm.try_admit(LONG, party=party)
    assert probe is not None
    assert adm.slo.probe(LONG, party, 0.0)  # the same request asking again
    with pytest.raises(SloUnattainable):
        adm.try_admit(LONG, party=Party(ttft_deadline_s=2.0))  # the next is refused
    clock.advance(PROBE_S - 1)
    adm.slo.observe_prefill(3000, 3.0)  # a prefill seen: the rate is being learnt
    adm.release(probe)
    clock.advance(2)  # PROBE_S since the last probe, not since the last prefill
    with pytest.raises(SloUnattainable):
        adm.try_admit(LONG, party=Party(ttft_deadline_s=2.0))
    clock.advance(PROBE_S)
    late = adm.try_admit(LONG, party=Party(ttft_deadline_s=2.0))
    assert late is not None
    adm.release(late)
    assert adm.stats().busy_slots == 0


async def test_a_late_wait_is_not_probed() -> None:
    """A request late for its queue wait alone is refused even when a probe is due: a
    probe learns a prefill rate, and would learn nothing here."""
    clock = ManualClock()
    adm = Admission(Layout(slots=1, ctx_per_slot=4096), max_queue=4, max_wait_s=600.0,
                    clock=clock)
    _learn(adm, 10_000.0)
    for _ in range(8):
        lease = adm.try_admit(Charge(100, 100))
        assert lease is not None
        clock.advance(10.0)
        adm.record_duration(10.0, lease.charge)
        adm.release(lease)
    held = adm.try_admit(Charge(100, 100))  # 80 s since the last prefill: a probe is due
    assert held is not None
    wait = adm.predict_wait_s(Charge(100, 100))
    assert wait is not None and wait > 1.0
    late = asyncio.ensure_future(adm.admit(Charge(100, 100), party=Party(ttft_deadline_s=1.0)))
    await _settle()
    assert late.done() and isinstance(late.exception(), SloUnattainable)
    adm.release(held)


# -- the SLO limit's gauge -------------------------------------------------------------


def _grant(adm: Admission) -> Lease:
    lease = adm.try_admit(Charge(100, 100))
    assert lease is not None
    adm.slo.set_itl_target(lease, 0.025)
    return lease


def _feed(adm: Admission, clock: ManualClock, per_slot_s: float, samples: int) -> None:
    for _ in range(samples):
        clock.advance(0.01)
        adm.slo.observe_itl(per_slot_s * adm.slo.busy(), adm.layout)


async def test_the_limit_shown_stays_within_one_and_the_slots() -> None:
    fake = FakeLlamaServer(slots=4)
    clock = ManualClock()
    settings = load_settings(admission={"disconnect_grace_s": 0.0},
                             backends=[{"name": "local", "url": "http://upstream:8080"}])
    app = create_app(settings, http_client=fake.client(), registry=CollectorRegistry(),
                     clock=clock, discover=False)
    h = Harness(app, fake)
    try:
        limit = [s for f in h.registry.collect() for s in f.samples
                 if s.name == "gateway_slo_limit"]
        assert limit == []  # no layout yet: no limit, rather than 0
        await h.backend.discover()
        adm = h.backend.admission
        for level in (1, 2, 3):  # three streams are known to hold the target
            for _ in range(50):
                adm.slo.model.observe_itl(0.005, level)
        leases = [_grant(adm) for _ in range(4)]
        _feed(adm, clock, 0.01, 120)  # 40 ms at 4 busy: over the 25 ms target
        assert adm.slo.limit == 3 and h.sample("gateway_slo_limit", backend="local") == 3
        for lease in leases:
            adm.release(lease)
        fake.slots = 2  # restarted with fewer slots
        await h.backend.discover()
        assert adm.layout is not None and adm.layout.slots == 2
        assert h.sample("gateway_slo_limit", backend="local") == 2
        lease = _grant(adm)  # a target in flight: the limit of 3 is no cap on 2 slots
        assert adm.slo.limited(adm.layout) is adm.layout
        adm.release(lease)
    finally:
        await h.client.aclose()


async def _shared_harness(fake: FakeLlamaServer, redis_url: str, prefix: str, *,
                          poll_s: float) -> Harness:
    """A gateway over ``fake`` with state in Redis (key prefix ``prefix``) and a class
    ``chat`` with a 25 ms ITL target, its shared store started."""
    settings = load_settings(
        admission={"disconnect_grace_s": 0.0},
        state={"backend": "redis", "redis_url": redis_url, "key_prefix": prefix,
               "renew_interval_s": 0.2, "lease_ttl_s": 1.0, "poll_interval_s": poll_s,
               "op_timeout_s": 0.5},
        backends=[{"name": "local", "url": "http://upstream:8080"}],
        classes=[{"name": "chat", "itl_p95_s": 0.025}])
    app = create_app(settings, http_client=fake.client(), registry=CollectorRegistry(),
                     discover=False)
    h = Harness(app, fake)
    await h.state.store.start()
    return h


async def test_under_redis_the_limit_is_applied_to_the_shared_grant(redis_server: Any
                                                                    ) -> None:
    """Under Redis the SLO limit goes to the shared grant as a busy cap (issue 26): a
    second flood after the limit was learnt never has more streams on the backend than
    the limit, and gateway_slo_limit shows what is applied."""
    fake = FakeLlamaServer(itl_per_stream=0.01, tokens=1000)
    h = await _shared_harness(fake, redis_server.url, "slo", poll_s=0.5)

    async def flood() -> list[httpx.Response]:
        return await asyncio.gather(*(h.client.post("/v1/chat/completions", json={
            "messages": [{"role": "user", "content": "hi"}], "max_tokens": 40,
            "stream": True}) for _ in range(4)))

    try:
        await h.backend.discover()
        slo = h.backend.admission.slo
        for level in (1, 2, 3):  # three streams are known to hold the target
            for _ in range(50):
                slo.model.observe_itl(0.005, level)
        assert all(r.status_code == 200 for r in await flood())  # (slow start: four)
        assert slo.model.itl_p95(4) is not None and slo.model.itl_p95(4) > 0.025
        limit = slo.limit
        assert limit is not None and limit < 4  # learnt over the shared busy count
        fake.peak = 0
        second = asyncio.ensure_future(flood())
        await asyncio.sleep(0.05)
        shown = h.sample("gateway_slo_limit", backend="local")
        assert all(r.status_code == 200 for r in await second)
        assert 1 <= fake.peak <= limit and shown <= limit
        assert h.backend.admission.stats().inflight == 0
    finally:
        await h.client.aclose()
        await h.state.store.close()


async def test_under_redis_a_fresh_burst_starts_slow(redis_server: Any) -> None:
    """Issue 38: a fresh gateway's first burst with a target ran every stream at once,
    a level never measured. Under Redis too, the shared grant gets the slow start's
    cap from the first request's arrival: the burst never has four at once, and every
    stream is served."""
    fake = FakeLlamaServer(itl_per_stream=0.01, tokens=1000)
    h = await _shared_harness(fake, redis_server.url, "slow", poll_s=0.2)
    try:
        await h.backend.discover()
        fake.peak = 0
        answers = await asyncio.gather(*(h.client.post("/v1/chat/completions", json={
            "messages": [{"role": "user", "content": "hi"}], "max_tokens": 80,
            "stream": True}) for _ in range(4)))
        assert all(r.status_code == 200 and "[DONE]" in r.text for r in answers)
        assert 1 <= fake.peak <= 3  # one, then one more per level learnt to hold
        assert h.backend.admission.slo.model.itl_p95(4) is None  # never ran
    finally:
        await h.client.aclose()
        await h.state.store.close()


# -- pools ---------------------------------------------------------------------------


async def test_a_pool_starts_a_request_only_where_it_can_start_in_time() -> None:
    clock = ManualClock()
    slow, fast = (_target(n, Layout(slots=2, ctx_per_slot=4096), clock)
                  for n in ("slow", "fast"))
    queue = ModelQueue([slow, fast], max_queue=8, max_wait_s=60.0, clock=clock)
    _learn(slow.admission, 100.0)  # LONG: 30 s there
    _learn(fast.admission, 10_000.0)  # 0.3 s there
    party = Party(ttft_deadline_s=2.0)

    def planned() -> list[Candidate]:
        return [Candidate(t, LONG, {}) for t in (slow, fast)]

    got = queue.try_admit(planned(), affinity="slow", party=party)  # affinity or not
    assert got is not None and got[0].backend is fast
    held = [got[1], fast.admission.try_admit(LONG)]
    assert held[1] is not None
    waiting = asyncio.ensure_future(queue.admit(planned(), party=party))
    await _settle()
    assert not waiting.done()  # slow has room, but it would start late there
    assert slow.admission.stats().busy_slots == 0
    fast.admission.release(held.pop())
    await _settle()
    candidate, lease = waiting.result()
    assert candidate.backend is fast
    fast.admission.release(lease)
    fast.admission.release(held.pop())
    _learn(fast.admission, 100.0)  # now both are slow
    fast.admission.slo.observe_prefill(1000, 10.0)
    with pytest.raises(SloUnattainable):
        await queue.admit(planned(), party=Party(ttft_deadline_s=2.0))
    served = queue.try_admit(planned(), party=Party(ttft_deadline_s=2.0, serve_late=True))
    assert served is not None
    served[0].backend.admission.release(served[1])
    assert queue.waiting == 0
    for t in (slow, fast):
        assert t.admission.stats().busy_slots == 0


def test_late_backends_refuses_only_when_every_backend_is_late() -> None:
    clock = ManualClock()
    a = Admission(LAYOUT, max_queue=4, max_wait_s=60.0, clock=clock)
    b = Admission(LAYOUT, max_queue=4, max_wait_s=60.0, clock=clock)
    _learn(a, 100.0)
    party = Party(ttft_deadline_s=2.0)
    assert late_backends({"a": (a.slo, LONG), "b": (b.slo, LONG)}, party) == {"a"}
    assert late_backends({}, party) == frozenset()
    with pytest.raises(SloUnattainable):
        late_backends({"a": (a.slo, LONG)}, party)
    clock.advance(PROBE_S)
    assert late_backends({"a": (a.slo, LONG)}, party) == frozenset()  # a probe


async def _stream(client: httpx.AsyncClient, words: int, headers: dict[str, str] | None = None,
                  **extra: Any) -> httpx.Response:
    return await client.post("/v1/chat/completions", headers=headers or {}, json={
        "messages": [{"role": "user", "content": " ".join(["word"] * words)}],
        "max_tokens": 2, "stream": True, **extra})


async def test_a_pool_refuses_a_request_late_on_every_backend() -> None:
    fakes = {n: FakeLlamaServer(prefill_s_per_token=0.001, tokens=1000, slots=1)
             for n in "ab"}
    fleet = Fleet(fakes, [{"name": "a", "model": "m"}, {"name": "b", "model": "m"}])
    try:
        await fleet.discover()
        for i in range(3):  # two at once: one on each backend
            pair = await asyncio.gather(*(_stream(fleet.client, 300 + i, model="m")
                                          for _ in range(2)))
            assert all(r.status_code == 200 for r in pair)
        backends = fleet.state.fleet.backends
        assert all(backends[n].admission.slo.model.prefill_tps() for n in "ab")
        sent = sum(len(f.generations) for f in fakes.values())
        refused = await _stream(fleet.client, 2000, {"x-gateway-slo-ttft-ms": "500"},
                                model="m")
        assert refused.status_code == 503, refused.text
        assert refused.json()["error"]["code"] == "slo_unattainable"
        assert 1 <= int(refused.headers["retry-after"]) <= 60
        assert sum(len(f.generations) for f in fakes.values()) == sent  # not forwarded
        rejected = sum(fleet.state.metrics.registry.get_sample_value(
            "gateway_rejections_total", {"backend": n, "reason": "slo_unattainable",
                                         "tenant": "anonymous", "priority": "default"}) or 0
            for n in "ab")
        assert rejected == 1
        assert (await _stream(fleet.client, 50, {"x-gateway-slo-ttft-ms": "500"},
                              model="m")).status_code == 200
        for n in "ab":
            stats = backends[n].admission.stats()
            assert (stats.busy_slots, stats.queued, stats.inflight) == (0, 0, 0)
    finally:
        await fleet.client.aclose()


# -- through the relay ----------------------------------------------------------------


async def test_a_wait_at_the_tenants_gate_counts_towards_the_deadline() -> None:
    """The deadline counts from the gateway's receipt: a request held a second at its
    tenant's gate (max_inflight) cannot start within 500 ms, however fast its prefill."""
    fake = FakeLlamaServer(prefill_s_per_token=0.001, tokens=1000, slots=2)
    settings = load_settings(
        admission={"disconnect_grace_s": 0.0},
        backends=[{"name": "local", "url": "http://upstream:8080"}],
        tenants=[{"name": "web", "key_hashes": [hashlib.sha256(KEY.encode()).hexdigest()],
                  "max_inflight": 1}])
    app = create_app(settings, http_client=fake.client(), registry=CollectorRegistry(),
                     discover=False)
    h = Harness(app, fake)
    auth = {"authorization": f"Bearer {KEY}"}
    try:
        await h.backend.discover()
        for _ in range(3):
            assert (await _stream(h.client, 300, auth)).status_code == 200
        fake.hold = asyncio.Event()
        first = asyncio.ensure_future(_stream(h.client, 5, auth))
        await asyncio.sleep(0.1)
        held = asyncio.ensure_future(_stream(h.client, 50, {**auth,
                                                            "x-gateway-slo-ttft-ms": "500"}))
        await asyncio.sleep(1.0)  # at the gate, behind the first
        assert not held.done()
        fake.hold.set()
        r = await held
        assert r.status_code == 503 and r.json()["error"]["code"] == "slo_unattainable"
        error = r.json()["error"]
        assert error["deadline_ms"] == 500 and error["predicted_ttft_ms"] > 1000
        assert (await first).status_code == 200
        tenant = h.state.tenants.by_name["web"]
        assert (tenant.inflight, tenant.waiting) == (0, 0)
        assert h.backend.admission.stats().busy_slots == 0
    finally:
        await h.client.aclose()


async def _ollama(ollama: FakeOllama, classes: list[dict[str, Any]]) -> Harness:
    settings = load_settings(
        admission={"disconnect_grace_s": 0.0},
        backends=[{"name": "ollama", "url": "http://ollama:11434", "kind": "ollama"}],
        classes=classes)
    app = create_app(settings, http_client=ollama.client(), registry=CollectorRegistry(),
                     discover=False)
    h = Harness(app, ollama)  # type: ignore[arg-type]
    await app.state.gateway.fleet.backends["ollama"].discover()
    return h


async def _ollama_chat(h: Harness, words: int) -> httpx.Response:
    return await h.client.post("/api/chat", json={
        "model": "llama3.2:1b", "options": {"num_predict": 3},
        "messages": [{"role": "user", "content": " ".join(["word"] * words)}]})


async def test_a_model_loaded_under_the_first_request_does_not_refuse_for_ever() -> None:
    """Ollama loads the model under the first request (here 0.5 s; its prefill is
    instant): the rate learnt is far too slow and every long prompt is refused, which
    teaches nothing. A probe, once no prefill has been seen for its interval, is served
    and puts the rate right."""
    ollama = FakeOllama(loaded=False, load_delay=0.5, tokens=5, num_ctx=8192)
    h = await _ollama(ollama, [{"name": "chat", "ttft_p95_s": 1.0}])
    slo = h.state.fleet.backends["ollama"].admission.slo
    slo.probe_s = 0.3  # (PROBE_S is 10 s)
    try:
        for _ in range(3):
            assert (await _ollama_chat(h, 100)).status_code == 200
        refused = await _ollama_chat(h, 1500)
        assert refused.status_code == 503
        assert refused.json() == {"error": refused.json()["error"]}  # Ollama's shape
        assert "first token" in refused.json()["error"]
        assert 1 <= int(refused.headers["retry-after"]) <= 60
        await asyncio.sleep(0.35)
        assert (await _ollama_chat(h, 1500)).status_code == 200  # the probe
        assert (await _ollama_chat(h, 1500)).status_code == 200  # the rate is right now
        assert h.state.fleet.backends["ollama"].admission.stats().busy_slots == 0
    finally:
        await h.client.aclose()


async def test_the_refusal_is_in_the_anthropic_shape_on_messages() -> None:
    fake = FakeLlamaServer(tokens=1000)
    settings = load_settings(admission={"disconnect_grace_s": 0.0},
                             backends=[{"name": "local", "url": "http://upstream:8080"}])
    app = create_app(settings, http_client=fake.client(), registry=CollectorRegistry(),
                     discover=False)
    h = Harness(app, fake)
    try:
        await h.backend.discover()
        _learn(h.backend.admission, 1000.0)
        r = await h.client.post("/v1/messages", headers={"x-slo-ttft-ms": "200"}, json={
            "model": "x", "max_tokens": 4,
            "messages": [{"role": "user", "content": " ".join(["word"] * 1000)}]})
        assert r.status_code == 503, r.text
        body = r.json()
        assert body["type"] == "error" and body["error"]["type"] == "overloaded_error"
        assert "deadline" in body["error"]["message"]
        assert 1 <= int(r.headers["retry-after"]) <= 60 and "retry-after-ms" in r.headers
        assert fake.generations == []
    finally:
        await h.client.aclose()
