"""The gateway in front of vLLM (``kind = "vllm"``), against the fake in
tests/fake_vllm.py: vLLM cannot run on these machines (no GPU). Shared cases P07
(streamed usage), P09 (strict max_model_len) and P10 (preemption on over-admission) are
here.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Awaitable
from typing import Any

import httpx
import pytest
from prometheus_client import CollectorRegistry

from gateway.backends.vllm import parse_metrics
from gateway.config import load_settings
from gateway.http.app import create_app
from tests.conftest import Harness
from tests.fake_vllm import FakeVllm
from tests.fakes import ManualClock

pytestmark = pytest.mark.anyio
MODEL = "Qwen/Qwen2.5-1.5B-Instruct"


@pytest.fixture
def vllm() -> FakeVllm:
    return FakeVllm()


@pytest.fixture
async def make(vllm: FakeVllm) -> Any:
    made: list[Harness] = []

    async def build(admission: dict[str, Any] | None = None, **backend: Any) -> Harness:
        backend.setdefault("slots", 16)  # --max-num-seqs 16
        settings = load_settings(
            admission={"disconnect_grace_s": 0.0, **(admission or {})},
            backends=[{"name": "vllm", "url": "http://vllm:8000", "kind": "vllm", **backend}])
        app = create_app(settings, http_client=vllm.client(), registry=CollectorRegistry(),
                         discover=False)
        h = Harness(app, vllm)  # type: ignore[arg-type]
        await target(h).discover()
        made.append(h)
        return h

    yield build
    for h in made:
        await h.client.aclose()


def target(h: Harness) -> Any:
    return h.state.fleet.backends["vllm"]


def sample(h: Harness, name: str, **labels: str) -> float:
    return h.sample(name, backend="vllm", **labels)


def chat(content: str = "Why is the sky blue?", **extra: Any) -> dict[str, Any]:
    return {"model": MODEL, "messages": [{"role": "user", "content": content}], **extra}


def ids(n: int) -> list[int]:
    """A token-id prompt of exactly ``n`` tokens (vLLM counts ids as given)."""
    return [7] * n


async def test_discovery_reads_max_model_len_and_the_block_pool(make: Any, vllm: FakeVllm
                                                                ) -> None:
    h = await make()
    ready = (await h.client.get("/ready")).json()["backends"]["vllm"]
    assert (ready["kind"], ready["slots"], ready["ctx_per_slot"]) == ("vllm", 16, 8192)
    assert ready["capacity_tokens"] == 20_000 and ready["kv_unified"] is True
    layout = target(h).admission.layout
    assert (layout.block_size, layout.stop_margin) == (16, 0)


async def test_older_vllm_pool_is_blocks_times_block_size(make: Any, vllm: FakeVllm) -> None:
    vllm.show_pool_tokens, vllm.num_gpu_blocks, vllm.block_size = False, 600, 32
    h = await make()
    assert (target(h).admission.layout.pool_tokens, target(h).admission.layout.block_size) == (19_200, 32)
    assert parse_metrics(vllm.metrics_text()) == {
        "block_size": 32, "num_gpu_blocks": 600, "preemptions": 0}


async def test_max_num_seqs_defaults_to_vllms_own(make: Any) -> None:
    h = await make(slots=None)
    assert target(h).admission.layout.slots == 256


async def test_chat_is_counted_by_tokenize_and_capped(make: Any, vllm: FakeVllm) -> None:
    h = await make()
    r = await h.client.post("/v1/chat/completions", json=chat(max_tokens=4))
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 4
    counted = vllm.prompt_tokens(chat())
    assert r.headers["x-gateway-prompt-tokens"] == str(counted) == str(
        r.json()["usage"]["prompt_tokens"])
    tokenize = [json.loads(q.content) for q in vllm.requests if q.url.path == "/tokenize"]
    assert tokenize[-1]["messages"] == chat()["messages"] and "max_tokens" not in tokenize[-1]
    assert vllm.generations[-1]["max_tokens"] == 4
    assert sample(h, "gateway_token_count_source_total", source="backend") == 1


async def test_max_completion_tokens_gets_the_charged_cap_too(make: Any, vllm: FakeVllm
                                                              ) -> None:
    # vLLM reads max_completion_tokens before max_tokens: both carry the charge.
    h = await make({"overlong": "clamp"})
    r = await h.client.post("/v1/chat/completions", json=chat(max_completion_tokens=9000))
    assert r.status_code == 200
    sent = vllm.generations[-1]
    assert sent["max_completion_tokens"] == sent["max_tokens"] == int(
        r.headers["x-gateway-max-tokens-clamped"])


async def test_completions_without_a_cap_get_vllms_16(make: Any, vllm: FakeVllm) -> None:
    h = await make()
    r = await h.client.post("/v1/completions", json={"model": MODEL, "prompt": "Once upon"})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 16
    assert vllm.generations[-1]["max_tokens"] == 16
    r = await h.client.post("/v1/chat/completions", json=chat())  # chat: the room left,
    assert vllm.generations[-1]["max_tokens"] == 1024  # within default_max_tokens


async def test_streams_relay_sse_and_count_usage(make: Any, vllm: FakeVllm) -> None:
    h = await make()
    r = await h.client.post("/v1/completions", json={
        "model": MODEL, "prompt": "Once upon", "max_tokens": 3, "stream": True})
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
    texts = [json.loads(e[6:])["choices"][0]["text"] for e in r.text.split("\n\n")
             if e.startswith("data: {")]
    assert "".join(texts) == "t0 t1 t2 " and r.text.rstrip().endswith("data: [DONE]")
    assert sample(h, "gateway_completion_tokens_sum") == 3
    assert target(h).stats().reserved_tokens == 0


async def test_p07_usage_only_when_asked_but_always_counted(make: Any, vllm: FakeVllm) -> None:
    # vLLM sends usage only when stream_options is present (and "{}" already asks).
    h = await make()
    body = chat(max_tokens=2, stream=True)
    plain = await h.client.post("/v1/chat/completions", json=body)
    empty = await h.client.post("/v1/chat/completions", json={**body, "stream_options": {}})
    asked = await h.client.post("/v1/chat/completions",
                                json={**body, "stream_options": {"include_usage": True}})
    assert "usage" not in plain.text and "usage" not in empty.text
    usage = [json.loads(e[6:]) for e in asked.text.split("\n\n") if '"usage"' in e]
    assert len(usage) == 1 and usage[0]["choices"] == []
    assert all(g["stream_options"]["include_usage"] for g in vllm.generations)
    assert sample(h, "gateway_completion_tokens_sum") == 6


async def test_p09_exactly_max_model_len_is_admitted(make: Any, vllm: FakeVllm) -> None:
    # shared case P09: --max-model-len 8192; 4192 + 4000 is exactly 8192.
    h = await make()
    ok = await h.client.post("/v1/completions", json={
        "model": MODEL, "prompt": ids(4192), "max_tokens": 4000})
    assert ok.status_code == 200 and ok.json()["usage"]["total_tokens"] == 8192


async def test_p09_one_over_is_refused_before_queueing_not_by_vllm(make: Any, vllm: FakeVllm
                                                                   ) -> None:
    h = await make()
    r = await h.client.post("/v1/completions", json={
        "model": MODEL, "prompt": ids(4200), "max_tokens": 4000})
    err = r.json()["error"]
    assert r.status_code == 400 and err["code"] == "context_length_exceeded"
    assert "4200" in err["message"] and "3992" in err["message"] and "8192" in err["message"]
    assert vllm.generations == []  # never forwarded, never queued
    assert "retry-after" not in r.headers


async def test_p09_clamp_policy_forwards_the_room_left(make: Any, vllm: FakeVllm) -> None:
    h = await make({"overlong": "clamp"})
    r = await h.client.post("/v1/completions", json={
        "model": MODEL, "prompt": ids(4200), "max_tokens": 4000})
    assert r.status_code == 200 and r.headers["x-gateway-max-tokens-clamped"] == "3992"
    assert vllm.generations[-1]["max_tokens"] == 3992
    assert r.json()["usage"]["total_tokens"] == 8192


async def p10_requests(url: str, client: httpx.AsyncClient) -> list[httpx.Response]:
    body = {"model": MODEL, "prompt": ids(3000), "max_tokens": 1500, "ignore_eos": True}
    return list(await asyncio.gather(*[client.post(url, json=body, timeout=60)
                                       for _ in range(6)]))


async def test_p10_vllm_alone_preempts_when_over_admitted(vllm: FakeVllm) -> None:
    # The baseline: 6 x (3000 + 1500) on a 20,000-token pool, straight to vLLM.
    async with vllm.client() as client:
        replies = await p10_requests("http://vllm:8000/v1/completions", client)
    assert [r.status_code for r in replies] == [200] * 6
    assert vllm.preemptions > 0 and vllm.peak_running > 4


async def test_p10_the_gateway_admits_what_fits_and_nothing_is_preempted(
    make: Any, vllm: FakeVllm
) -> None:
    h = await make()
    replies = await p10_requests("/v1/completions", h.client)
    assert [r.status_code for r in replies] == [200] * 6
    assert vllm.preemptions == 0 and vllm.peak_running == 4  # 4 x 4512 <= 20,000
    assert sample(h, "gateway_queue_wait_seconds_count") == 6
    await target(h).discover()
    assert sample(h, "gateway_backend_preemptions_total") == 0


async def test_preemptions_while_admitting_shrink_the_pool_model(make: Any, vllm: FakeVllm
                                                                ) -> None:
    # Traffic that bypasses the gateway holds 8,000 of the 20,000 tokens, so the gateway's
    # model of the pool lets vLLM over-admit; the rise in vllm:num_preemptions_total is
    # seen at the next discovery and the model shrinks.
    h = await make()
    vllm.blocks_used_elsewhere = 500
    replies = await p10_requests("/v1/completions", h.client)
    assert [r.status_code for r in replies] == [200] * 6 and vllm.preemptions > 0
    await target(h).discover()
    assert target(h).admission.layout.pool_tokens == 18_000
    assert sample(h, "gateway_backend_preemptions_total") == vllm.preemptions
    await target(h).discover()  # no new preemptions, no further shrink
    assert target(h).admission.layout.pool_tokens == 18_000


async def test_a_configured_pool_never_exceeds_the_reported_one(make: Any) -> None:
    h = await make(pool_tokens=40_000, ctx_per_slot=16_384)
    assert (target(h).admission.layout.pool_tokens, target(h).admission.layout.ctx_per_slot) == (20_000, 8192)
    h = await make(pool_tokens=12_000)
    assert target(h).admission.layout.pool_tokens == 12_000  # config may narrow it


async def test_preemptions_without_gateway_traffic_are_not_blamed(make: Any, vllm: FakeVllm
                                                                  ) -> None:
    h = await make()
    vllm.preemptions += 5  # someone else's traffic, with nothing admitted here
    await target(h).discover()
    assert target(h).admission.layout.pool_tokens == 20_000
    assert sample(h, "gateway_backend_preemptions_total") == 0


@pytest.mark.parametrize("wording", ["renderer", "legacy", "newer"])
async def test_vllms_own_context_400_is_context_length_exceeded(
    make: Any, vllm: FakeVllm, wording: str
) -> None:
    vllm.wording = wording
    h = await make()
    vllm.max_model_len = 4096  # restarted with a shorter context the gateway has not seen
    r = await h.client.post("/v1/completions", json={
        "model": MODEL, "prompt": ids(3000), "max_tokens": 2000})
    assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded"
    assert "4096" in r.json()["error"]["message"]
    assert target(h).stats().reserved_tokens == 0


async def test_a_request_no_backend_takes_within_its_wait_gets_503_retry_after(
        vllm: FakeVllm, caplog: pytest.LogCaptureFixture) -> None:
    # --max-num-queued-reqs 0: vLLM refuses everything. The gateway tries again (at
    # once, then after 0.25 s, 0.5 s, ...) within the request's 2 s of queue wait, then
    # answers its own queue timeout; vLLM's 503 is never relayed nor counted as a failure.
    caplog.set_level(logging.INFO, logger="gateway")
    vllm.max_num_queued_reqs = 0
    clock = ManualClock()
    h = await build([("vllm", vllm)], {"max_queue_wait_s": 2.0}, clock=clock)
    reply = await drive(clock, h.client.post("/v1/chat/completions", json=chat(max_tokens=2)))
    assert reply.status_code == 503 and "retry-after" in reply.headers
    err = reply.json()["error"]
    assert err["code"] == "queue_timeout" and "had no room" in err["message"]
    assert "engine is currently busy" not in reply.text
    assert len(vllm.refused) >= 3 and set(vllm.refused) == {"queue_full"}
    assert sample(h, "gateway_backend_full_total", cause="queue_full") == len(vllm.refused)
    assert sample(h, "gateway_upstream_errors_total") == 0
    assert sample(h, "gateway_rejections_total", reason="queue_timeout") == 1
    assert target(h).health.failures == 0 and target(h).up
    assert target(h).stats().reserved_tokens == 0
    assert any("had no room" in r.getMessage() and "queue_full" in r.getMessage()
               for r in caplog.records)


async def test_dead_engine_is_not_ready(make: Any, vllm: FakeVllm) -> None:
    h = await make()
    vllm.healthy = False
    with pytest.raises(Exception, match="not ready"):
        await target(h).discover()
    r = await h.client.post("/v1/chat/completions", json=chat(max_tokens=2))
    assert r.status_code == 503 and r.json()["error"]["code"] == "backend_unavailable"


async def test_api_key_is_sent_and_a_missing_one_is_named(vllm: FakeVllm, make: Any) -> None:
    vllm.api_key = "s3cret"
    h = await make(api_key="s3cret")
    r = await h.client.post("/v1/chat/completions", json=chat(max_tokens=2))
    assert r.status_code == 200
    with pytest.raises(Exception, match="api_key"):
        await make()


async def test_a_bad_body_refused_by_tokenize_is_a_client_error(make: Any, vllm: FakeVllm
                                                                ) -> None:
    h = await make()
    r = await h.client.post("/v1/chat/completions", json={**chat(), "model": "other"})
    assert r.status_code == 404 and "does not exist" in r.json()["error"]["message"]
    assert target(h).stats().reserved_tokens == 0


async def test_the_openai_client_library_works_unchanged(make: Any, vllm: FakeVllm) -> None:
    import openai

    h = await make()
    client = openai.AsyncOpenAI(base_url="http://gateway/v1", api_key="x",
                                http_client=httpx.AsyncClient(
                                    transport=httpx.ASGITransport(app=h.app)))
    reply = await client.chat.completions.create(model=MODEL, max_tokens=3, messages=[
        {"role": "user", "content": "hi"}])
    assert reply.choices[0].message.content == "tok tok tok " and reply.usage.total_tokens > 3
    stream = await client.completions.create(model=MODEL, prompt="hi", max_tokens=2,
                                             stream=True)
    assert "".join([c.choices[0].text async for c in stream if c.choices]) == "t0 t1 "
    with pytest.raises(openai.BadRequestError) as err:
        await client.completions.create(model=MODEL, prompt=ids(8192), max_tokens=1)
    assert err.value.code == "context_length_exceeded"


async def test_a_failed_metrics_read_keeps_the_last_pool(make: Any, vllm: FakeVllm) -> None:
    # One failed scrape must not shrink the pool to one max_model_len: queued requests
    # that fit the real pool would get a 400 that cannot be retried.
    h = await make()
    vllm.metrics_status = 500
    await target(h).discover()
    assert target(h).admission.layout.pool_tokens == 20_000
    r = await h.client.post("/v1/completions", json={
        "model": MODEL, "prompt": ids(3000), "max_tokens": 3000, "n": 3})
    assert r.status_code == 200


async def test_an_unknown_model_is_404_before_queueing(make: Any, vllm: FakeVllm) -> None:
    h = await make()
    for path, body in (("/v1/chat/completions", {**chat(), "model": "other"}),
                       ("/v1/completions", {"model": "other", "prompt": "hi"})):
        r = await h.client.post(path, json=body)
        assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"
    assert vllm.generations == []


async def test_min_tokens_raise_the_default_cap(make: Any, vllm: FakeVllm) -> None:
    h = await make()
    r = await h.client.post("/v1/chat/completions", json=chat(min_tokens=2000))
    assert r.status_code == 200 and vllm.generations[-1]["max_tokens"] == 2000


async def test_chat_documents_are_counted(make: Any, vllm: FakeVllm) -> None:
    h = await make()
    docs = [{"title": "t", "text": "word " * 3000}]
    r = await h.client.post("/v1/chat/completions", json=chat(documents=docs, max_tokens=2))
    assert int(r.headers["x-gateway-prompt-tokens"]) == r.json()["usage"]["prompt_tokens"]
    assert int(r.headers["x-gateway-prompt-tokens"]) > 3000


async def test_a_batch_over_the_slots_is_refused_before_counting(make: Any, vllm: FakeVllm
                                                                 ) -> None:
    h = await make()
    r = await h.client.post("/v1/completions", json={"model": MODEL,
                                                     "prompt": ["hi"] * 64, "max_tokens": 2})
    assert r.status_code == 400 and r.json()["error"]["param"] == "n"
    assert not [q for q in vllm.requests if q.url.path == "/tokenize"]


async def test_an_explicit_null_cap_on_completions_is_not_vllms_16(make: Any, vllm: FakeVllm
                                                                   ) -> None:
    h = await make()
    r = await h.client.post("/v1/completions", json={"model": MODEL, "prompt": "hi",
                                                     "max_tokens": None})
    assert r.status_code == 200 and vllm.generations[-1]["max_tokens"] == 1024


async def test_a_midstream_error_is_the_final_event_in_the_openai_shape(
    make: Any, vllm: FakeVllm
) -> None:
    vllm.fail_after = 2
    h = await make()
    r = await h.client.post("/v1/chat/completions", json=chat(max_tokens=10, stream=True))
    events = [e for e in r.text.split("\n\n") if e.startswith("data: ")]
    last = json.loads(events[-1][6:])
    assert last["error"]["code"] == "server_error" and "EngineCore" in last["error"]["message"]
    assert "[DONE]" not in r.text
    assert sample(h, "gateway_upstream_errors_total", kind="stream_aborted") == 1
    assert target(h).stats().reserved_tokens == 0


async def test_the_pool_penalty_recovers_and_a_restart_clears_it(make: Any, vllm: FakeVllm
                                                                 ) -> None:
    h = await make()
    vllm.blocks_used_elsewhere = 500
    await p10_requests("/v1/completions", h.client)
    await target(h).discover()
    assert target(h).admission.layout.pool_tokens == 18_000
    target(h).pool.penalized_at -= 301  # five quiet minutes later: half the penalty back
    await target(h).discover()
    assert target(h).admission.layout.pool_tokens == 19_000
    vllm.num_gpu_blocks = 2500  # restarted with a larger cache: the penalty is moot
    await target(h).discover()
    assert target(h).admission.layout.pool_tokens == 40_000


async def test_routes_vllm_does_not_serve_here_are_404(make: Any, vllm: FakeVllm) -> None:
    h = await make()
    r = await h.client.post("/infill", json={"input_prefix": "def f("})
    assert r.status_code == 404 and "No configured backend serves this route" in r.text
    r = await h.client.post("/v1/messages", json={"model": MODEL, "max_tokens": 5,
                                                  "messages": [{"role": "user",
                                                                "content": "hi"}]})
    assert r.status_code == 404 and r.json()["type"] == "error"  # Anthropic's shape
    assert vllm.generations == []


async def test_a_backend_named_by_model_without_the_route_is_404(vllm: FakeVllm) -> None:
    from tests.fakes import FakeLlamaServer

    llama = FakeLlamaServer()

    async def route(request: httpx.Request) -> httpx.Response:
        fake = vllm if request.url.host == "vllm" else llama
        return await fake.handle(request)

    settings = load_settings(admission={"disconnect_grace_s": 0.0}, backends=[
        {"name": "local", "url": "http://llama:8080"},
        {"name": "big", "url": "http://vllm:8000", "kind": "vllm", "slots": 16}])
    app = create_app(settings, http_client=httpx.AsyncClient(
        transport=httpx.MockTransport(route)), registry=CollectorRegistry(), discover=False)
    for backend in app.state.gateway.fleet.backends.values():
        await backend.discover()
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app),
                                 base_url="http://gateway") as client:
        r = await client.post("/v1/messages", json={"model": "big", "max_tokens": 5,
                                                    "messages": [{"role": "user",
                                                                  "content": "hi"}]})
    assert r.status_code == 404 and "'big'" in r.json()["error"]["message"]
    assert llama.generations == [] and vllm.generations == []


# -- issue 27: vLLM's own queue limits (--max-num-queued-reqs, --max-num-queued-tokens)


async def build(fakes: list[tuple[str, FakeVllm]], admission: dict[str, Any] | None = None,
                clock: Any = None) -> Harness:
    """A gateway over fake vLLMs, one backend per (name, fake), each on host ``name``."""
    by_host = dict(fakes)

    async def route(request: httpx.Request) -> httpx.Response:
        return await by_host[request.url.host].handle(request)

    settings = load_settings(
        admission={"disconnect_grace_s": 0.0, **(admission or {})},
        backends=[{"name": name, "url": f"http://{name}:8000", "kind": "vllm", "slots": 16}
                  for name, _ in fakes])
    app = create_app(settings, http_client=httpx.AsyncClient(transport=httpx.MockTransport(
        route)), registry=CollectorRegistry(), clock=clock, discover=False)
    h = Harness(app, fakes[0][1])  # type: ignore[arg-type]
    for backend in h.state.fleet.backends.values():
        await backend.discover()
    return h


async def until(done: Any, what: str) -> None:
    """Let the loop run until ``done()`` (no wall-clock wait)."""
    for _ in range(2000):
        if done():
            return
        await asyncio.sleep(0)
    raise AssertionError(f"never happened: {what}")


async def drive(clock: ManualClock, work: Awaitable[httpx.Response]) -> httpx.Response:
    """Run ``work`` while moving ``clock`` on by 50 ms steps."""
    task = asyncio.ensure_future(work)
    for _ in range(400):
        for _ in range(20):
            await asyncio.sleep(0)
        if task.done():
            return task.result()
        clock.advance(0.05)
    task.cancel()
    raise AssertionError("the request never ended")


async def test_a_full_vllm_in_a_pool_sends_the_overflow_to_the_other_backend() -> None:
    # a runs --max-num-queued-reqs 1; the gateway thinks both take 16. The third request
    # goes to a (the two tie, a is first), which refuses it: it goes to b, and a is
    # capped at the one request it holds, never marked down.
    hold = asyncio.Event()
    a, b = FakeVllm(max_num_queued_reqs=1, hold=hold), FakeVllm(hold=hold)
    h = await build([("a", a), ("b", b)])
    body = chat(max_tokens=3)
    first = asyncio.ensure_future(h.client.post("/v1/chat/completions", json=body))
    await until(lambda: len(a.generations) == 1, "the first request reached a")
    second = asyncio.ensure_future(h.client.post("/v1/chat/completions", json=body))
    await until(lambda: len(b.generations) == 1, "the second request reached b")
    third = asyncio.ensure_future(h.client.post("/v1/chat/completions", json=body))
    await until(lambda: len(b.generations) == 2, "the overflow reached b")
    assert a.refused == ["queue_full"] and len(a.generations) == 2  # the one 503
    hold.set()
    replies = await asyncio.gather(first, second, third)
    assert [r.status_code for r in replies] == [200, 200, 200]
    backend_a = h.state.fleet.backends["a"]
    assert backend_a.health.failures == 0 and backend_a.up
    assert backend_a.admission.layout.busy_cap == 1
    assert h.sample("gateway_backend_full_total", backend="a", cause="queue_full") == 1
    assert h.sample("gateway_upstream_errors_total") == 0
    assert h.sample("gateway_failovers_total") == 0  # not a failure


async def test_a_lone_full_vllm_makes_the_request_wait_then_answers_it(
        make: Any, vllm: FakeVllm, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="gateway")
    vllm.max_num_queued_reqs, vllm.hold = 1, asyncio.Event()
    h = await make()
    first = asyncio.ensure_future(h.client.post("/v1/chat/completions",
                                                json=chat(max_tokens=3)))
    await until(lambda: len(vllm.generations) == 1, "the first request reached vLLM")
    second = asyncio.ensure_future(h.client.post("/v1/chat/completions",
                                                 json=chat(max_tokens=3, stream=True)))
    await until(lambda: vllm.refused == ["queue_full"], "vLLM refused the second")
    await until(lambda: target(h).stats().queued == 1, "the second waits in the queue")
    assert not second.done() and target(h).admission.layout.busy_cap == 1
    vllm.hold.set()
    one, two = await asyncio.gather(first, second)
    assert one.status_code == 200 and two.status_code == 200
    assert two.text.rstrip().endswith("data: [DONE]") and "error" not in two.text
    assert len(vllm.generations) == 3 and vllm.refused == ["queue_full"]
    assert target(h).health.failures == 0 and target(h).up
    assert sample(h, "gateway_backend_full_total", cause="queue_full") == 1
    assert sample(h, "gateway_upstream_errors_total") == 0
    assert sample(h, "gateway_queue_wait_seconds_count") == 2
    warned = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert any("want of room (queue_full)" in m and "at most 1 busy" in m for m in warned)


async def test_a_prefill_backlog_503_is_waited_out_too(make: Any, vllm: FakeVllm) -> None:
    # --max-num-queued-tokens 100: while the first prompt (over 100 tokens) is still in
    # prefill, vLLM refuses the next one.
    vllm.max_num_queued_tokens, vllm.hold = 100, asyncio.Event()
    h = await make()
    first = asyncio.ensure_future(h.client.post("/v1/completions", json={
        "model": MODEL, "prompt": ids(150), "max_tokens": 2}))
    await until(lambda: len(vllm.generations) == 1, "the first request reached vLLM")
    second = asyncio.ensure_future(h.client.post("/v1/completions", json={
        "model": MODEL, "prompt": "Once upon", "max_tokens": 2}))
    await until(lambda: vllm.refused == ["prefill_backlog"], "vLLM refused the second")
    vllm.hold.set()
    assert [r.status_code for r in await asyncio.gather(first, second)] == [200, 200]
    assert sample(h, "gateway_backend_full_total", cause="prefill_backlog") == 1
    assert sample(h, "gateway_upstream_errors_total") == 0 and target(h).up


async def test_vllms_full_503_is_read_as_full_and_others_as_not_ready(make: Any) -> None:
    from gateway.errors import BackendFull, BackendNotReady
    from tests.fake_vllm import ERRORS

    h = await make()
    for kind, cause in (("queue_full", "queue_full"), ("prefill_backlog", "prefill_backlog")):
        exc = target(h).translate_error(503, json.dumps(ERRORS[kind]).encode(), None)
        assert isinstance(exc, BackendFull) and exc.cause == cause
        assert exc.upstream_kind is None and exc.status_code == 503
    other = target(h).translate_error(503, b'{"error": {"message": "loading"}}', "7")
    assert isinstance(other, BackendNotReady) and other.retry_after_s == 7.0
    assert other.upstream_kind == "status_5xx"


def test_the_busy_cap_is_learnt_relaxed_and_cleared() -> None:
    from gateway.core.capacity import Budget, Charge, Layout, fits
    from gateway.core.pool_model import CAP_RECOVERY_S, Limits, PoolModel

    class Found:
        slots, ctx_per_slot, pool_tokens, block_size, preemptions = 16, 8192, 20_000, 16, None

    pool, limits = PoolModel(), Limits(slots=16, unified=True, stop_margin=0)
    assert pool.layout(limits, Found()).busy_cap is None
    assert pool.full(busy=5, refused=1, now=0.0) == 4  # the others held 4
    assert pool.full(busy=7, refused=1, now=1.0) == 4  # never raised by a refusal
    assert pool.full(busy=1, refused=1, now=2.0) == 1  # at least one
    layout = pool.layout(limits, Found())
    assert layout.busy_cap == 1 and layout.slots == 16
    charge = Charge(100, 10)
    assert fits(layout, Budget(), Charge(100, 10, n=3))  # alone, whatever its n
    assert not fits(layout, Budget(reserved_tokens=110, busy_slots=1), charge)
    assert not pool.relax(2.0 + CAP_RECOVERY_S - 1, 16)
    assert pool.relax(2.0 + CAP_RECOVERY_S, 16) and pool.busy_cap == 2
    pool.busy_cap = 8
    pool.capped_at = 0.0
    assert pool.relax(CAP_RECOVERY_S, 16) and pool.busy_cap is None  # reached the slots
    pool.full(busy=3, refused=1, now=0.0)
    pool.restarted()
    assert pool.busy_cap is None
    with pytest.raises(ValueError):
        Layout(4, 100, busy_cap=0)


@pytest.mark.parametrize("name", ["team-llm", "llm-alias"])
async def test_a_chat_by_the_gateways_name_is_counted_under_the_served_id(
        make: Any, vllm: FakeVllm, name: str) -> None:
    # vLLM's /tokenize answers 404 to a model name it does not serve, as its generations do.
    h = await make(model="team-llm", aliases=["llm-alias"])
    r = await h.client.post("/v1/chat/completions", json={**chat(max_tokens=3), "model": name})
    assert r.status_code == 200, r.text
    tokenize = [json.loads(q.content) for q in vllm.requests if q.url.path == "/tokenize"]
    assert tokenize and tokenize[-1]["model"] == vllm.model
    assert vllm.generations[-1]["model"] == vllm.model
    assert r.json()["model"] == name  # the answer names what the client asked for


async def test_a_request_naming_no_model_gets_the_served_one(make: Any, vllm: FakeVllm
                                                             ) -> None:
    """Found by the adversarial pass: vLLM answered 404 "The model `None` does not
    exist" to a chat without "model"; the gateway names the one vLLM serves."""
    h = await make()
    body = {k: v for k, v in chat(max_tokens=3).items() if k != "model"}
    r = await h.client.post("/v1/chat/completions", json=body)
    assert r.status_code == 200, r.text
    assert vllm.generations[-1]["model"] == MODEL
    tokenize = [json.loads(q.content) for q in vllm.requests if q.url.path == "/tokenize"]
    assert tokenize[-1]["model"] == MODEL
