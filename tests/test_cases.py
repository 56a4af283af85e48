"""The shared public cases (shared/cases/public.md) that touch the gateway core.

They run against the fake llama-server (tests/fakes.py), which follows llama-server's
documented API; the same scenarios run against a real llama-server in tests/integration.
Ollama- and vLLM-specific cases (P03 busy bodies, P05, P09 a/b, P10) belong to the
Ollama/vLLM backend issue.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

import httpx
import pytest

from tests.conftest import Harness

pytestmark = pytest.mark.anyio


def words(n: int) -> str:
    # The fake counts one token per word, plus 4 per message and 2.
    return " ".join(["w"] * (n - 6))


async def peak_during(h: Harness, coro: Any, gauge: str) -> tuple[Any, float]:
    task = asyncio.ensure_future(coro)
    peak = 0.0
    while not task.done():
        peak = max(peak, h.sample(gauge, backend="local"))
        await asyncio.sleep(0.001)
    return task.result(), peak


async def test_p01_per_slot_context_comes_from_the_backend(
    harness_factory: Any, fake: Any
) -> None:
    # llama-server -c 8192 -np 4: /props says 2048 per slot; the gateway must not use 8192.
    fake.slots, fake.n_ctx, fake.token_delay, fake.tokens = 4, 2048, 0.01, 5
    h = await harness_factory(kv_unified=False)
    assert h.sample("gateway_backend_ctx_per_slot", backend="local") == 2048
    t0 = time.monotonic()
    r = await h.chat(words(1900), max_tokens=300)
    assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded"
    assert time.monotonic() - t0 < 0.5 and h.fake.generations == []
    bodies = [h.chat(words(1500), max_tokens=500) for _ in range(5)]
    results, peak_queue = await peak_during(h, asyncio.gather(*bodies), "gateway_queue_depth")
    assert [x.status_code for x in results] == [200] * 5
    assert fake.peak == 4 and peak_queue >= 1  # four ran at once, the fifth waited


async def test_p02_unified_pool_budget_is_the_pool_not_slots_times_ctx(
    harness_factory: Any, fake: Any
) -> None:
    fake.slots, fake.n_ctx, fake.token_delay = 4, 4096, 0.01
    h = await harness_factory()
    bodies = [h.chat(words(1500), max_tokens=500) for _ in range(3)]
    results, peak_reserved = await peak_during(h, asyncio.gather(*bodies),
                                               "gateway_kv_reserved_tokens")
    assert [x.status_code for x in results] == [200] * 3
    assert fake.peak == 2  # two admitted (4000 of 4096), the third waited
    assert peak_reserved <= 4096
    assert h.sample("gateway_upstream_errors_total", backend="local", kind="context_overflow") == 0


async def test_p02_variant_no_queue_answers_503_fast(harness_factory: Any, fake: Any) -> None:
    fake.slots, fake.n_ctx, fake.hold = 4, 4096, asyncio.Event()
    h = await harness_factory({"max_queue": 0})
    running = [asyncio.ensure_future(h.chat(words(1500), max_tokens=500)) for _ in range(2)]
    while h.sample("gateway_inflight_requests", backend="local") < 2:
        await asyncio.sleep(0.001)
    t0 = time.monotonic()
    r = await h.chat(words(1500), max_tokens=500)
    assert r.status_code == 503 and "retry-after" in r.headers
    assert time.monotonic() - t0 < 0.5
    fake.hold.set()
    assert [(await t).status_code for t in running] == [200, 200]


async def test_p04_bounded_queue_on_a_single_slot(harness_factory: Any, fake: Any) -> None:
    # Ollama-like NUM_PARALLEL=1 modelled as one slot; the gateway's own bound must hold.
    fake.slots, fake.hold = 1, asyncio.Event()
    h = await harness_factory({"max_queue": 2}, kv_unified=False)
    tasks = [asyncio.ensure_future(h.chat(words(200), max_tokens=200)) for _ in range(6)]
    for _ in range(2000):
        if sum(t.done() for t in tasks) == 3:
            break
        await asyncio.sleep(0.001)
    fake.hold.set()
    codes = sorted([(await t).status_code for t in tasks])
    assert codes == [200, 200, 200, 503, 503, 503]
    assert fake.peak == 1
    assert h.sample("gateway_rejections_total", backend="local", reason="queue_full") == 3


async def test_p07_stream_options_empty_object_gets_no_usage_chunk(harness: Harness) -> None:
    from tests.test_proxy_asgi import AsgiCall, chat

    call = AsgiCall(harness, chat(stream_options={}))
    await call.run()
    assert b'"usage"' not in b"".join(call.chunks)
    assert harness.fake.generations[-1]["stream_options"] == {"include_usage": True}
    assert harness.sample("gateway_completion_tokens_sum", backend="local") == 5


async def test_p08_missing_max_tokens_charges_the_default_not_the_window(
    harness_factory: Any, fake: Any
) -> None:
    # llama-server -c 16384 -np 4 --kv-unified: slots of 16384 sharing one 16384 pool.
    fake.slots, fake.n_ctx, fake.hold = 4, 16384, asyncio.Event()
    h = await harness_factory(pool_tokens=16384)
    tasks = [asyncio.ensure_future(h.chat(words(200))) for _ in range(4)]
    while h.sample("gateway_inflight_requests", backend="local") < 4:
        await asyncio.sleep(0.001)
    assert h.sample("gateway_queue_depth", backend="local") == 0  # all four admitted together
    assert h.sample("gateway_kv_reserved_tokens", backend="local") == 4 * (200 + 1024)
    fake.hold.set()
    assert [(await t).status_code for t in tasks] == [200] * 4
    assert all(g["max_tokens"] == 1024 for g in fake.generations)
    assert h.sample("gateway_default_max_tokens_applied_total", backend="local") == 4


async def test_p09_clamp_policy_is_decided_before_queueing(
    harness_factory: Any, fake: Any
) -> None:
    fake.n_ctx = 8193  # usable 8192, as vLLM's --max-model-len 8192 rule
    h = await harness_factory({"overlong": "clamp"})
    exact = await h.chat(words(4192), max_tokens=4000)
    assert exact.status_code == 200 and "x-gateway-max-tokens-clamped" not in exact.headers
    over = await h.chat(words(4200), max_tokens=4000)
    assert over.status_code == 200
    assert over.headers["x-gateway-max-tokens-clamped"] == "3992"
    assert fake.generations[-1]["max_tokens"] == 3992


async def test_p11_global_limit_and_no_leak_under_burst(harness_factory: Any, fake: Any) -> None:
    fake.slots, fake.token_delay = 4, 0.002
    h = await harness_factory({"max_queue": 20, "max_queue_wait_s": 5}, kv_unified=False)
    results = await asyncio.gather(*(h.chat(words(100), max_tokens=10) for _ in range(60)))
    codes = [r.status_code for r in results]
    assert fake.peak <= 4
    assert set(codes) <= {200, 503} and codes.count(200) >= 24
    assert h.sample("gateway_inflight_requests", backend="local") == 0
    assert h.sample("gateway_kv_reserved_tokens", backend="local") == 0
    assert h.sample("gateway_queue_depth", backend="local") == 0


async def test_p12_upstream_retry_after_is_kept(harness: Harness, fake: Any) -> None:
    async def busy(request: httpx.Request) -> httpx.Response:
        if request.url.path == "/v1/chat/completions":
            return httpx.Response(503, headers={"Retry-After": "7"}, json={
                "error": {"code": 503, "message": "busy", "type": "unavailable_error"}})
        return await fake.handle(request)

    harness.state.client._transport = httpx.MockTransport(busy)
    r = await harness.chat("x", max_tokens=5)
    assert r.status_code == 503
    assert r.headers["retry-after"] == "7" and r.headers["retry-after-ms"] == "7000"


async def test_p12_upstream_429_passes_with_its_retry_after(harness: Harness, fake: Any) -> None:
    async def limited(request: httpx.Request) -> httpx.Response:
        if request.url.path == "/v1/chat/completions":
            return httpx.Response(429, headers={"Retry-After": "3"}, json={
                "error": {"message": "slow down", "type": "rate_limit_error"}})
        return await fake.handle(request)

    harness.state.client._transport = httpx.MockTransport(limited)
    r = await harness.chat("x", max_tokens=5)
    assert r.status_code == 429 and r.headers["retry-after"] == "3"


async def test_p12_openai_sdk_honours_the_gateway_retry_after(
    harness_factory: Any, fake: Any
) -> None:
    import openai

    fake.hold = asyncio.Event()
    h = await harness_factory({"max_queue": 0})
    blocker = asyncio.ensure_future(h.chat("x", max_tokens=1500))
    while h.sample("gateway_inflight_requests", backend="local") < 1:
        await asyncio.sleep(0.001)
    attempts: list[float] = []

    async def record(request: httpx.Request) -> None:
        attempts.append(time.monotonic())

    sdk_http = httpx.AsyncClient(transport=httpx.ASGITransport(app=h.app),
                                 base_url="http://gateway", event_hooks={"request": [record]})
    client = openai.AsyncOpenAI(base_url="http://gateway/v1", api_key="x",
                                http_client=sdk_http, max_retries=2)
    with pytest.raises(openai.APIStatusError) as info:
        await client.chat.completions.create(
            model="local", messages=[{"role": "user", "content": "y"}], max_tokens=1500)
    assert info.value.status_code == 503
    gaps = [b - a for a, b in zip(attempts, attempts[1:], strict=False)]
    assert len(attempts) == 3
    assert all(0.9 <= g <= 3.0 for g in gaps), gaps  # Retry-After 1 s, not the 0.4-1 s backoff
    assert h.sample("gateway_client_retries_total", attempt="1") == 1
    assert h.sample("gateway_client_retries_total", attempt="2") == 1
    fake.hold.set()
    await blocker
    await sdk_http.aclose()
