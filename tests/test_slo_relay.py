"""Latency targets through the whole gateway, against the fake llama-server at the
transport level (tests/fakes.py): its decode cost per token grows with the generations
in flight (``itl_per_stream``, a synthetic curve, not llama-server's measured one), and
its prefill takes a fixed time per prompt token (``prefill_s_per_token``). Real time:
these tests sleep for a few seconds."""

from __future__ import annotations

import asyncio
from typing import Any

import httpx
import pytest
from prometheus_client import CollectorRegistry

from gateway.config import load_settings
from gateway.http.app import create_app
from tests.conftest import Harness
from tests.fakes import FakeLlamaServer


async def _harness(fake: FakeLlamaServer, classes: list[dict[str, Any]]) -> Harness:
    settings = load_settings(
        admission={"disconnect_grace_s": 0.0, "max_queue": 64, "max_queue_wait_s": 120},
        backends=[{"name": "local", "url": "http://upstream:8080"}], classes=classes)
    app = create_app(settings, http_client=fake.client(), registry=CollectorRegistry(),
                     discover=False)
    h = Harness(app, fake)
    await h.backend.discover()
    return h


async def _stream(h: Harness, tokens: int, words: int = 5,
                  headers: dict[str, str] | None = None) -> httpx.Response:
    return await h.client.post("/v1/chat/completions", headers=headers or {}, json={
        "messages": [{"role": "user", "content": " ".join(["word"] * words)}],
        "max_tokens": tokens, "stream": True})


async def _wave(h: Harness, streams: int, tokens: int) -> int:
    """``streams`` streams at once; returns the most generations the backend ran at once."""
    h.fake.peak = 0
    answers = await asyncio.gather(*(_stream(h, tokens) for _ in range(streams)))
    assert all(r.status_code == 200 and "[DONE]" in r.text for r in answers)
    return h.fake.peak


async def test_an_itl_target_holds_concurrency_where_the_curve_meets_it() -> None:
    """ITL is 10 ms per generation in flight; the target 25 ms holds up to two. The
    first wave starts slow: one stream, then two once one is learnt to hold the target,
    then a probe of three, which breaks it (memory alone ran four at once, a level never
    measured, before slow start); later waves never run more than two at once."""
    fake = FakeLlamaServer(itl_per_stream=0.01, tokens=1000)
    h = await _harness(fake, [{"name": "chat", "itl_p95_s": 0.025}])
    try:
        assert 2 <= await _wave(h, 6, 60) <= 3
        for _ in range(2):
            await _wave(h, 6, 60)
        assert await _wave(h, 6, 40) <= 2
        limit = h.sample("gateway_slo_limit", backend="local")
        assert 1 <= limit <= 2
        # Attainment: the probe's three at once broke the 25 ms ITL target (30 ms
        # gaps) for the streams running then; most streams met it.
        def attained(outcome: str) -> float:
            return h.sample("gateway_slo_requests_total", backend="local", priority="chat",
                            target="itl", outcome=outcome)
        assert attained("met") > attained("missed")
        assert attained("met") + attained("missed") == 24
        assert h.sample("gateway_latency_itl_p95_seconds", backend="local",
                        level="3") > 0.025
        assert h.sample("gateway_latency_itl_samples", backend="local", level="4") == 0
        # idle, but the class's users were here a moment ago: their target still binds
        assert h.sample("gateway_slo_itl_target_seconds", backend="local") == 0.025
        # The status page shows the same figures as /metrics.
        (row,) = (await h.client.get("/status.json")).json()["backends"]
        slo = row["slo"]
        assert slo["limit"] == limit and slo["binding"] is True
        assert slo["itl_target_s"] == 0.025
        assert slo["attainment"] == {"chat": {"itl": {"met": attained("met"),
                                                      "missed": attained("missed")}}}
        assert slo["itl_p95_s"]["3"] == pytest.approx(h.sample(
            "gateway_latency_itl_p95_seconds", backend="local", level="3"), abs=1e-4)
        assert slo["prefill_tokens_per_s"] == pytest.approx(h.sample(
            "gateway_latency_prefill_tokens_per_second", backend="local"), abs=0.1)
    finally:
        await h.client.aclose()


async def test_without_a_target_memory_alone_decides() -> None:
    fake = FakeLlamaServer(itl_per_stream=0.01, tokens=1000)
    h = await _harness(fake, [{"name": "chat"}])
    try:
        for _ in range(2):
            assert await _wave(h, 6, 60) == 4
        assert h.sample("gateway_slo_limit", backend="local") == 4
        assert h.sample("gateway_latency_itl_samples", backend="local", level="4") > 50
    finally:
        await h.client.aclose()


async def test_a_request_that_cannot_start_in_time_is_refused_at_once() -> None:
    """Prefill is 1 ms per prompt token here. Once three prefills are learnt, a
    2,000-word prompt with a 500 ms deadline is a 503 ``slo_unattainable`` with
    Retry-After, never forwarded; a short one with the same deadline is served, and so
    is the long one in a class that serves late."""
    fake = FakeLlamaServer(prefill_s_per_token=0.001, tokens=1000)
    h = await _harness(fake, [{"name": "chat"}, {"name": "bulk", "late": "serve"}])
    try:
        for _ in range(3):
            assert (await _stream(h, 2, words=300)).status_code == 200
        assert h.sample("gateway_latency_prefill_tokens_per_second", backend="local") > 0
        sent = len(fake.generations)
        deadline = {"x-gateway-slo-ttft-ms": "500"}
        refused = await _stream(h, 2, words=2000, headers=deadline)
        assert refused.status_code == 503, refused.text
        error = refused.json()["error"]
        assert error["code"] == "slo_unattainable" and error["deadline_ms"] == 500
        assert error["predicted_ttft_ms"] > 1500
        assert 1 <= int(refused.headers["retry-after"]) <= 60
        assert len(fake.generations) == sent  # not forwarded
        assert h.sample("gateway_rejections_total", backend="local",
                        reason="slo_unattainable") == 1
        assert (await _stream(h, 2, words=50, headers=deadline)).status_code == 200
        assert h.sample("gateway_slo_requests_total", backend="local", target="ttft",
                        outcome="met") == 1  # 50 words: about 50 ms, by its 500 ms deadline
        late = await _stream(h, 2, words=2000, headers={**deadline, "x-priority": "bulk"})
        assert late.status_code == 200
    finally:
        await h.client.aclose()


@pytest.mark.parametrize("header", ["x-gateway-slo-ttft-ms", "x-llm-d-slo-ttft-ms"])
async def test_the_llm_d_header_is_a_deadline_too(header: str) -> None:
    fake = FakeLlamaServer(prefill_s_per_token=0.001, tokens=1000)
    h = await _harness(fake, [{"name": "chat"}])
    try:
        for _ in range(3):
            await _stream(h, 2, words=300)
        r = await _stream(h, 2, words=1500, headers={header: "200"})
        assert r.status_code == 503 and r.json()["error"]["code"] == "slo_unattainable"
    finally:
        await h.client.aclose()


async def test_the_gaps_of_an_n_above_one_stream_are_not_learnt() -> None:
    """Choices decoded in one step arrive back to back: their gaps are not an ITL."""
    fake = FakeLlamaServer(tokens=1000)
    h = await _harness(fake, [{"name": "chat"}])
    try:
        r = await h.client.post("/v1/chat/completions", json={
            "messages": [{"role": "user", "content": "hi"}], "max_tokens": 20,
            "stream": True, "n": 2})
        assert r.status_code == 200
        assert h.backend.admission.slo.model.levels == {}
        assert (await _stream(h, 20)).status_code == 200
        assert sum(hist.samples for hist in h.backend.admission.slo.model.levels.values()) > 10
    finally:
        await h.client.aclose()


async def test_a_long_prompt_waits_for_the_targeted_streams_decoding() -> None:
    """Prefill deferral through the relay, in strict mode (found on the real llama-server:
    a strict stream's lease never got a first-token time, so nothing was ever held).
    The fake's prefill costs 2 ms a prompt token: a 600-word prompt would stall the
    streams 1.2 s, over the 50 ms target. It waits until the streams decoding beside it
    end (about 0.6 s), under admission.prefill_defer_s (2 s)."""
    fake = FakeLlamaServer(prefill_s_per_token=0.002, tokens=1000, token_delay=0.02)
    h = await _harness(fake, [{"name": "chat", "itl_p95_s": 0.05}])
    try:
        for _ in range(3):  # the prefill rate is learnt
            assert (await _stream(h, 2, words=100)).status_code == 200
        for level in (1, 2):  # and two streams are known to hold the target
            for _ in range(50):
                h.backend.admission.slo.model.observe_itl(0.02, level)
        fake.peak = 0
        streams = [asyncio.ensure_future(_stream(h, 30)) for _ in range(2)]
        await asyncio.sleep(0.2)  # they decode now
        long = await _stream(h, 2, words=600)
        assert long.status_code == 200
        assert h.sample("gateway_prefill_deferred_total", backend="local") == 1
        for done in await asyncio.gather(*streams):
            assert done.status_code == 200
        # The long prompt started after the streams ended, not beside them (without
        # deferral, three ran at once).
        assert fake.peak == 2
    finally:
        await h.client.aclose()


async def test_whole_answers_of_a_targeted_class_are_held_by_memory_only() -> None:
    """A whole answer has no ITL a client sees and teaches none: held by the slow
    start's limit it would wait for a level no stream ever measures. Its party carries
    no ITL target, so four run at once as memory allows; the streams of the same class
    start slow."""
    fake = FakeLlamaServer(itl_per_stream=0.01, tokens=1000)
    h = await _harness(fake, [{"name": "chat", "itl_p95_s": 0.025}])
    try:
        fake.peak = 0
        answers = await asyncio.gather(*(h.client.post("/v1/chat/completions", json={
            "messages": [{"role": "user", "content": "hi"}], "max_tokens": 30})
            for _ in range(4)))
        assert all(r.status_code == 200 for r in answers)
        assert fake.peak == 4
        assert h.backend.admission.slo.target() is None  # nothing with a target came
        assert await _wave(h, 4, 30) < 4  # the streams: one level at a time
    finally:
        await h.client.aclose()
