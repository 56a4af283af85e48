"""The app in-process (httpx.ASGITransport) over a fake llama-server (httpx.MockTransport).

Ollama/vLLM are not involved here; the fake follows llama-server's documented shapes.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

import httpx
import pytest

from tests.conftest import Harness

pytestmark = pytest.mark.anyio


async def until_inflight(h: Harness, n: int) -> None:
    for _ in range(2000):
        if h.sample("gateway_inflight_requests", backend="local") >= n:
            return
        await asyncio.sleep(0.001)
    raise AssertionError(f"never reached {n} in flight")


def sent_body(h: Harness) -> dict[str, Any]:
    return h.fake.generations[-1]


async def test_chat_is_forwarded_with_the_charged_cap(harness: Harness) -> None:
    r = await harness.chat("one two three", max_tokens=50, temperature=0.1, custom_field=[1])
    assert r.status_code == 200
    assert r.json()["usage"]["completion_tokens"] == 5
    body = sent_body(harness)
    assert body["max_tokens"] == 50 and body["temperature"] == 0.1 and body["custom_field"] == [1]
    assert r.headers["x-gateway-prompt-tokens"] == "9"  # 3 words + 4 + 2
    assert harness.sample("gateway_token_count_source_total", backend="local", source="backend") == 1
    assert harness.sample("gateway_requests_total", backend="local", route="chat", code="200") == 1
    assert harness.sample("gateway_completion_tokens_sum", backend="local") == 5
    assert harness.sample("gateway_kv_reserved_tokens", backend="local") == 0


async def test_default_cap_is_charged_and_forwarded(harness_factory: Any) -> None:
    h = await harness_factory({"default_max_tokens": 100})
    r = await h.chat("hi")
    assert r.status_code == 200
    assert sent_body(h)["max_tokens"] == 100
    assert h.sample("gateway_default_max_tokens_applied_total", backend="local") == 1


async def test_max_completion_tokens_is_rewritten_too(harness: Harness) -> None:
    r = await harness.chat("hi", max_completion_tokens=30)
    assert r.status_code == 200
    assert sent_body(harness)["max_completion_tokens"] == 30
    assert sent_body(harness)["max_tokens"] == 30


async def test_completions_route_counts_with_tokenize(harness: Harness) -> None:
    r = await harness.client.post("/v1/completions", json={"prompt": "a b c", "max_tokens": 4})
    assert r.status_code == 200
    tokenize = [q for q in harness.fake.requests if q.url.path == "/tokenize"][-1]
    sent = json.loads(tokenize.content)
    assert sent["add_special"] is True and sent["parse_special"] is True
    assert r.headers["x-gateway-prompt-tokens"] == "4"


async def test_never_fits_is_400_and_not_forwarded(harness_factory: Any) -> None:
    h = await harness_factory(ctx_per_slot=64)
    r = await h.chat("word " * 100, max_tokens=10)
    assert r.status_code == 400
    err = r.json()["error"]
    # llama-server's type and figures, OpenAI's code
    assert err["code"] == "context_length_exceeded"
    assert err["type"] == "exceed_context_size_error"
    assert (err["n_prompt_tokens"], err["n_ctx"]) == (106, 64)
    assert "106" in err["message"] and "64" in err["message"]
    assert h.fake.generations == []
    assert r.headers["x-should-retry"] == "false"
    assert h.sample("gateway_rejections_total", backend="local",
                    reason="context_length_exceeded") == 1


@pytest.mark.parametrize(("path", "body", "param"), [
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "word " * 60}]},
     "messages"),
    ("/v1/completions", {"prompt": "word " * 64}, "prompt"),
    ("/completion", {"prompt": "word " * 64}, "prompt"),
])
async def test_a_prompt_that_fills_the_slot_names_its_own_field(
        harness_factory: Any, path: str, body: dict[str, Any], param: str) -> None:
    """The 400 of a prompt that leaves no room for output names the field the prompt
    came in (found by a new user: completions said ``messages``)."""
    h = await harness_factory(ctx_per_slot=64)
    r = await h.client.post(path, json={**body, "max_tokens": 4})
    assert r.status_code == 400
    err = r.json()["error"]
    assert err["code"] == "context_length_exceeded" and err["param"] == param
    assert h.fake.generations == []


async def test_overlong_cap_rejected_then_clamped(harness_factory: Any) -> None:
    h = await harness_factory(ctx_per_slot=128)
    r = await h.chat("hi", max_tokens=500)
    assert r.status_code == 400 and "500" in r.json()["error"]["message"]
    h2 = await harness_factory({"overlong": "clamp"}, ctx_per_slot=128)
    r2 = await h2.chat("hi", max_tokens=500)
    assert r2.status_code == 200
    assert r2.headers["x-gateway-max-tokens-clamped"] == str(127 - 7)
    assert sent_body(h2)["max_tokens"] == 120


async def test_queue_full_is_503_with_retry_after(harness_factory: Any, fake: Any) -> None:
    # P02 variant: the pool holds one request at a time and max_queue = 0.
    fake.hold = asyncio.Event()
    h = await harness_factory({"max_queue": 0}, pool_tokens=2048)
    first = asyncio.ensure_future(h.chat("x", max_tokens=1500))
    await until_inflight(h, 1)
    r = await h.chat("y", max_tokens=1500)
    assert r.status_code == 503
    assert r.json()["error"]["code"] == "queue_full"
    assert 1 <= int(r.headers["retry-after"]) <= 60 and int(r.headers["retry-after-ms"]) >= 1000
    fake.hold.set()
    assert (await first).status_code == 200
    assert h.sample("gateway_rejections_total", backend="local", reason="queue_full") == 1
    assert len(fake.generations) == 1


async def test_queued_request_runs_when_room_frees(harness: Harness, fake: Any) -> None:
    fake.hold = asyncio.Event()
    first = asyncio.ensure_future(harness.chat("x", max_tokens=1500))
    second = asyncio.ensure_future(harness.chat("y", max_tokens=1500))
    while harness.sample("gateway_queue_depth", backend="local") < 1:
        await asyncio.sleep(0.001)
    assert fake.active <= 1
    await asyncio.sleep(0.02)
    assert harness.sample("gateway_queue_oldest_wait_seconds", backend="local") >= 0.02
    fake.hold.set()
    assert (await first).status_code == 200 and (await second).status_code == 200
    assert fake.peak == 1  # the pool never held both
    assert harness.sample("gateway_queue_oldest_wait_seconds", backend="local") == 0
    assert harness.sample("gateway_queue_wait_seconds_count", backend="local") == 2


async def test_queue_timeout_is_503(harness_factory: Any, fake: Any) -> None:
    fake.hold = asyncio.Event()
    h = await harness_factory({"max_queue_wait_s": 0.05})
    first = asyncio.ensure_future(h.chat("x", max_tokens=1500))
    await until_inflight(h, 1)
    r = await h.chat("y", max_tokens=1500)
    assert r.status_code == 503 and r.json()["error"]["code"] == "queue_timeout"
    assert "retry-after" in r.headers
    fake.hold.set()
    await first
    assert h.sample("gateway_rejections_total", backend="local", reason="queue_timeout") == 1


@pytest.mark.parametrize("mode,status,code,kind", [
    ("connect", 502, "upstream_unavailable", "connect"),
    ("timeout", 504, "upstream_timeout", "timeout"),
    ("overflow", 503, "upstream_context_overflow", "context_overflow"),
    ("boom", 502, "upstream_error", "status_5xx"),
    ("loading", 503, "backend_unavailable", "status_5xx"),
])
async def test_upstream_failures_map_to_clean_5xx(
    harness: Harness, fake: Any, mode: str, status: int, code: str, kind: str
) -> None:
    fake.mode = mode
    r = await harness.chat("hi", max_tokens=10)
    assert r.status_code == status
    assert r.json()["error"]["code"] == code
    if status == 503:
        assert "retry-after" in r.headers
    assert harness.sample("gateway_upstream_errors_total", backend="local", kind=kind) == 1
    if mode == "timeout":
        # The gateway gave up on a request the backend had taken: its reservation stays
        # until /slots shows the slot free (one poll, POLL_INTERVAL_S later).
        assert harness.sample("gateway_kv_reserved_tokens", backend="local") > 0
        await asyncio.wait_for(harness.backend.slot_watch._task, 5)
    assert harness.sample("gateway_kv_reserved_tokens", backend="local") == 0
    assert harness.sample("gateway_inflight_requests", backend="local") == 0


async def test_upstream_4xx_is_relayed_in_the_openai_shape(harness: Harness, fake: Any
                                                           ) -> None:
    fake.mode = "bad_request"
    r = await harness.chat("hi", max_tokens=10)
    assert r.status_code == 400
    err = r.json()["error"]
    # llama-server's {"code": 400, "type": "exceed_context_size_error"}: its type and its
    # own figures kept, OpenAI's string code.
    assert err["type"] == "exceed_context_size_error"
    assert err["code"] == "context_length_exceeded"
    assert err["param"] is None and "exceeds the available context" in err["message"]
    assert (err["n_prompt_tokens"], err["n_ctx"]) == (9000, 2048)


async def test_grammar_error_from_generation_is_openai_shaped(harness: Harness, fake: Any
                                                             ) -> None:
    async def refuse(request: httpx.Request) -> httpx.Response:
        if request.url.path == "/v1/chat/completions":
            return httpx.Response(400, json={"error": {
                "code": 400, "type": "invalid_request_error",
                "message": "Failed to initialize samplers: failed to parse grammar"}})
        return await fake.handle(request)

    harness.state.client._transport = httpx.MockTransport(refuse)
    r = await harness.chat("hi", max_tokens=10, grammar="root ::= (")
    err = r.json()["error"]
    assert r.status_code == 400 and set(err) == {"message", "type", "param", "code"}
    assert err["type"] == "invalid_request_error" and err["code"] is None


async def test_counting_falls_back_to_estimate(harness: Harness, fake: Any) -> None:
    fake.count_fails = True
    r = await harness.chat("hello world", max_tokens=10)
    assert r.status_code == 200
    assert harness.sample("gateway_token_count_source_total", backend="local",
                          source="estimate") == 1
    assert int(r.headers["x-gateway-prompt-tokens"]) >= 2 + 8 + 8


async def test_a_burst_of_one_prompt_is_counted_once(harness: Harness, fake: Any) -> None:
    # Ten requests with the same prompt arrive while its count is asked: they wait for
    # that answer (gateway.backends.once), not ask the backend ten times (issue 37).
    fake.count_hold = asyncio.Event()
    burst = [asyncio.ensure_future(harness.chat("the same prompt", max_tokens=4 + i))
             for i in range(10)]
    while not any(q.url.path.endswith("/input_tokens") for q in fake.requests):
        await asyncio.sleep(0.01)
    await asyncio.sleep(0.05)
    fake.count_hold.set()
    answers = await asyncio.gather(*burst)
    assert [r.status_code for r in answers] == [200] * 10
    counted = [q for q in fake.requests if q.url.path.endswith("/input_tokens")]
    assert len(counted) == 1
    assert len({r.headers["x-gateway-prompt-tokens"] for r in answers}) == 1


async def test_old_build_counts_with_apply_template(harness: Harness, fake: Any) -> None:
    fake.input_tokens_route = False
    r = await harness.chat("one two", max_tokens=10)
    assert r.status_code == 200
    paths = [q.url.path for q in fake.requests]
    assert "/apply-template" in paths and "/tokenize" in paths
    assert harness.sample("gateway_token_count_source_total", backend="local",
                          source="backend") == 1


async def test_conversation_id_header_is_dropped(harness: Harness, fake: Any) -> None:
    body = {"messages": [{"role": "user", "content": "x"}], "max_tokens": 3}
    r = await harness.client.post("/v1/chat/completions", json=body, headers={
        "X-Conversation-Id": "abc", "Authorization": "Bearer k"})
    assert r.status_code == 200
    gen = [q for q in fake.requests if q.url.path == "/v1/chat/completions"][-1]
    assert "x-conversation-id" not in gen.headers
    assert "authorization" not in gen.headers  # the client's key is not the backend's


async def test_backend_not_ready_is_503(harness_factory: Any, fake: Any) -> None:
    fake.mode = "loading"
    h = await harness_factory(discover=False)
    r = await h.chat("hi")
    assert r.status_code == 503 and r.json()["error"]["code"] == "backend_unavailable"
    assert "retry-after" in r.headers
    assert (await h.client.get("/ready")).status_code == 503
    assert fake.generations == []


async def test_health_ready_models_metrics(harness: Harness) -> None:
    assert (await harness.client.get("/health")).json() == {"status": "ok"}
    ready = await harness.client.get("/ready")
    assert ready.status_code == 200
    assert ready.json()["backends"]["local"]["slots"] == 4
    models = await harness.client.get("/v1/models")
    assert models.json()["data"][0]["id"] == "fake"  # fake.gguf, by its file name
    await harness.chat("hi", max_tokens=3)
    text = (await harness.client.get("/metrics")).text
    for name in [
        "gateway_requests_total", "gateway_rejections_total", "gateway_queue_depth",
        "gateway_inflight_requests", "gateway_kv_reserved_tokens", "gateway_kv_capacity_tokens",
        "gateway_slots", "gateway_queue_wait_seconds", "gateway_ttft_seconds",
        "gateway_itl_seconds", "gateway_request_duration_seconds", "gateway_prompt_tokens",
        "gateway_completion_tokens", "gateway_upstream_errors_total",
        "gateway_token_count_source_total",
    ]:
        assert name in text, name
    assert 'gateway_kv_capacity_tokens{backend="local"} 2048.0' in text
    assert 'gateway_slots{backend="local"} 4.0' in text


async def test_unknown_route_is_openai_shaped_404(harness: Harness) -> None:
    r = await harness.client.get("/v1/nope")
    assert r.status_code == 404 and r.json()["error"]["code"] == "not_found"


async def test_n_greater_than_slots_is_400(harness: Harness) -> None:
    r = await harness.chat("hi", n=5, max_tokens=10)
    assert r.status_code == 400 and r.json()["error"]["param"] == "n"
    assert harness.fake.generations == []


async def test_config_values_win_over_discovery(harness_factory: Any) -> None:
    h = await harness_factory(slots=2, ctx_per_slot=1024, kv_unified=False)
    stats = h.backend.admission.stats()
    assert (stats.slots, stats.ctx_per_slot, stats.capacity_tokens) == (2, 1024, 2048)


async def test_overlong_max_completion_tokens_is_named_in_the_error(harness_factory: Any) -> None:
    h = await harness_factory(ctx_per_slot=128)
    r = await h.chat("hi", max_completion_tokens=500)
    err = r.json()["error"]
    assert r.status_code == 400 and err["param"] == "max_completion_tokens"
    assert "max_completion_tokens 500" in err["message"]


async def test_ready_reports_the_layout(harness_factory: Any) -> None:
    h = await harness_factory(kv_unified=False)
    body = (await h.client.get("/ready")).json()["backends"]["local"]
    assert body["kv_unified"] is False and body["capacity_tokens"] == 4 * 2048


@pytest.mark.parametrize("prompt", [["a b", "c d"], "a b"])
async def test_a_whole_stream_whose_upstream_stays_open_counts_as_served(
        harness: Harness, fake: Any, prompt: Any) -> None:
    # llama-server writes the chunked terminator after the last event; a stream whole at
    # [DONE] is served (200), batch (unpinned) or not, however late the tail comes.
    fake.after_done = asyncio.Event()
    r = await harness.client.post("/v1/completions", json={
        "prompt": prompt, "max_tokens": 4, "stream": True})
    assert r.status_code == 200 and r.text.endswith("data: [DONE]\n\n")
    assert harness.sample("gateway_requests_total", code="200") == 1
    assert harness.sample("gateway_requests_total", code="499") == 0
    fake.after_done.set()


@pytest.mark.parametrize("path", ["/health", "/v1/health", "/ready", "/v1/models",
                                  "/metrics"])
async def test_probes_answer_head_as_get_without_a_body(harness: Harness, path: str
                                                        ) -> None:
    """As llama-server answers ``HEAD /health`` (a load balancer's check may use HEAD;
    found by a new user: every GET route answered HEAD with 405)."""
    got = await harness.client.get(path)
    head = await harness.client.head(path)
    assert (got.status_code, head.status_code) == (200, 200)
    assert head.content == b"" and got.content != b""
    assert head.headers["content-type"] == got.headers["content-type"]


async def test_a_wrong_method_is_405_with_allow_and_an_unknown_path_404(
        harness: Harness) -> None:
    r = await harness.client.get("/v1/chat/completions")
    assert r.status_code == 405 and r.json()["error"]["code"] == "method_not_allowed"
    assert r.headers["allow"] == "POST"  # RFC 9110: a 405 names what the path takes
    r = await harness.client.delete("/health")
    assert r.status_code == 405 and set(r.headers["allow"].split(", ")) == {"GET", "HEAD"}
    r = await harness.client.get("/nothing/here")
    assert r.status_code == 404 and r.json()["error"]["code"] == "not_found"
    assert "allow" not in r.headers
    assert harness.fake.generations == []
