"""Findings of an adversarial pass, kept as regressions (fake llama-server upstream)."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import httpx
import pytest

from gateway.admission.admission import Admission
from gateway.core.capacity import Charge, Layout
from gateway.wire.sse import EventSplitter, EventTooLarge
from tests.conftest import Harness
from tests.fakes import ManualClock

pytestmark = pytest.mark.anyio
CHAT = "/v1/chat/completions"


def generations(h: Harness) -> list[dict[str, Any]]:
    return h.fake.generations


async def test_n_predict_cannot_get_past_the_reservation(harness: Harness) -> None:
    r = await harness.chat("hi", max_tokens=5, n_predict=5)
    assert r.status_code == 200 and generations(harness)[-1]["n_predict"] == 5
    r = await harness.chat("hi", max_tokens=5, n_predict=300)
    assert r.status_code == 400 and r.json()["error"]["param"] == "max_tokens"
    r = await harness.chat("hi", n_predict=40)
    assert r.status_code == 200
    assert generations(harness)[-1]["n_predict"] == 40 == generations(harness)[-1]["max_tokens"]
    r = await harness.chat("hi", n_predict=-1)  # llama-server's "unlimited": charge the default
    assert r.status_code == 200 and generations(harness)[-1]["n_predict"] == 1024
    assert len(generations(harness)) == 3


async def test_n_cmpl_is_charged_like_n(harness: Harness) -> None:
    r = await harness.chat("hi", max_tokens=5, n_cmpl=5)
    assert r.status_code == 400 and r.json()["error"]["param"] == "n"
    r = await harness.chat("hi", max_tokens=5, n=1, n_cmpl=2)
    assert r.status_code == 400 and "disagree" in r.json()["error"]["message"]
    assert generations(harness) == []


@pytest.mark.parametrize("extra", [
    {"n_probs": 1_000_000_000}, {"top_logprobs": 21}, {"logprobs": 3},
    {"temperature": "hot"}, {"top_k": "x"}, {"seed": 1.5}, {"stop": [1, 2]},
    {"tools": "x"}, {"tools": [{"type": "function"}]},
])
async def test_more_client_mistakes_are_400(harness: Harness, extra: dict[str, Any]) -> None:
    r = await harness.chat("hi", max_tokens=5, **extra)
    assert r.status_code == 400, extra
    assert generations(harness) == []


@pytest.mark.parametrize("raw", [
    b'{"messages": [{"role": "user", "content": "hi"}], "x": ' + b"[" * 5000 + b"]" * 5000 + b"}",
    b'{"messages": [{"role": "user", "content": "hi"}], "temperature": NaN}',
    b'{"messages": [{"role": "user", "content": "hi"}], "temperature": Infinity}',
    b'{"messages": [{"role": "user", "content": "\\ud800"}]}',
    b'{"messages": [{"role": "user", "content": [1, 2]}]}',
    b'{"messages": [{"role": "user", "content": [{"text": "no type"}]}]}',
    b'{"messages": [{"role": "user", "content": [{"type": "text", "text": 5}]}]}',
    b'{"messages": [{"role": "user", "content": "x", "tool_calls": "x"}]}',
])
async def test_malformed_bodies_are_400_not_500(harness: Harness, raw: bytes) -> None:
    r = await harness.client.post(CHAT, content=raw, headers={"content-type": "application/json"})
    assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error"
    assert generations(harness) == []


async def test_paired_surrogates_are_fine(harness: Harness) -> None:
    raw = b'{"messages": [{"role": "user", "content": "\\ud83d\\ude00"}], "max_tokens": 2}'
    r = await harness.client.post(CHAT, content=raw, headers={"content-type": "application/json"})
    assert r.status_code == 200


@pytest.mark.parametrize("prompt", [[-1], [2**40], [1, True]])
async def test_bad_token_ids_are_400(harness: Harness, prompt: list[Any]) -> None:
    r = await harness.client.post("/v1/completions", json={"prompt": prompt, "max_tokens": 2})
    assert r.status_code == 400 and generations(harness) == []


async def test_prompt_batch_is_counted_and_charged_per_prompt(harness: Harness) -> None:
    r = await harness.client.post("/v1/completions", json={
        "prompt": ["a b c d e f", "a"], "max_tokens": 10})
    assert r.status_code == 200
    assert r.headers["x-gateway-prompt-tokens"] == "7"  # the longest prompt
    assert len([q for q in harness.fake.requests if q.url.path == "/tokenize"]) == 2
    r = await harness.client.post("/v1/completions", json={
        "prompt": ["a"] * 5, "max_tokens": 10})
    assert r.status_code == 400 and r.json()["error"]["param"] == "n"  # 5 prompts > 4 slots


async def test_compressed_body_is_415(harness: Harness) -> None:
    r = await harness.client.post(CHAT, content=b"{}", headers={
        "content-type": "application/json", "content-encoding": "gzip"})
    assert r.status_code == 415


@pytest.mark.parametrize("value", ["\u00b2", "9" * 5000, "-1", "abc"])
async def test_odd_retry_count_headers_do_not_crash(harness: Harness, value: str) -> None:
    body = json.dumps({"messages": [{"role": "user", "content": "x"}], "max_tokens": 2})
    r = await harness.client.post(CHAT, content=body.encode(), headers={
        "content-type": "application/json",
        "x-stainless-retry-count": value.encode("latin-1")})
    assert r.status_code == 200


async def test_backend_refusing_to_count_means_400_and_no_forward(
    harness: Harness, fake: Any
) -> None:
    async def refuse(request: httpx.Request) -> httpx.Response:
        if request.url.path == "/v1/chat/completions/input_tokens":
            return httpx.Response(400, json={"error": {
                "code": 400, "message": "image input is not supported", "type":
                "invalid_request_error"}})
        return await fake.handle(request)

    harness.state.client._transport = httpx.MockTransport(refuse)
    r = await harness.chat("hi", max_tokens=5)
    assert r.status_code == 400 and "image input is not supported" in r.json()["error"]["message"]
    assert generations(harness) == []


async def test_unreachable_backend_is_not_forwarded_to_until_it_answers(
    harness: Harness, fake: Any
) -> None:
    fake.mode = "connect"
    r = await harness.chat("hi", max_tokens=5)
    assert r.status_code == 502
    for _ in range(200):  # the re-discovery that the failure started marks it not ready
        if not harness.backend.ready:
            break
        await asyncio.sleep(0.001)
    calls = len(fake.requests)
    r = await harness.chat("hi", max_tokens=5)
    assert r.status_code == 503 and r.json()["error"]["code"] == "backend_unavailable"
    assert "retry-after" in r.headers
    assert all(q.url.path == "/props" for q in fake.requests[calls:])  # nothing else sent
    fake.mode = "ok"
    for _ in range(300):
        if harness.backend.ready:
            break
        await asyncio.sleep(0.01)
    assert (await harness.chat("hi", max_tokens=5)).status_code == 200


async def test_full_queue_answers_before_counting(harness_factory: Any, fake: Any) -> None:
    fake.hold = asyncio.Event()
    h = await harness_factory({"max_queue": 1})
    running = asyncio.ensure_future(h.chat("x", max_tokens=1500))
    queued = None
    for _ in range(1000):
        if h.sample("gateway_inflight_requests", backend="local") == 1 and queued is None:
            queued = asyncio.ensure_future(h.chat("y", max_tokens=1500))
        if h.sample("gateway_queue_depth", backend="local") == 1:
            break
        await asyncio.sleep(0.001)
    counts = sum(q.url.path.endswith("input_tokens") for q in fake.requests)
    r = await h.chat("z", max_tokens=5)
    assert r.status_code == 503 and r.json()["error"]["code"] == "queue_full"
    assert sum(q.url.path.endswith("input_tokens") for q in fake.requests) == counts
    fake.hold.set()
    assert queued is not None
    assert (await running).status_code == 200 and (await queued).status_code == 200


async def test_oversized_event_ends_the_stream_with_an_error(
    harness_factory: Any, fake: Any
) -> None:
    from tests.test_proxy_asgi import AsgiCall, chat

    harness = await harness_factory({"abandon_confirm_timeout_s": 0.2})

    async def huge(request: httpx.Request) -> httpx.Response:
        if request.url.path != CHAT:
            return await fake.handle(request)

        async def body() -> Any:
            for _ in range(700):  # 11 MB without an event boundary
                yield b"x" * 16384

        return httpx.Response(200, headers={"content-type": "text/event-stream"}, content=body())

    harness.state.client._transport = httpx.MockTransport(huge)
    call = AsgiCall(harness, chat())
    await call.run()
    assert b'"error"' in call.chunks[-1] and b"too large" in call.chunks[-1]
    # The gateway stopped reading: the reservation waits for /slots, which never shows
    # this request, so it goes after abandon_confirm_timeout_s.
    assert harness.sample("gateway_kv_reserved_tokens", backend="local") > 0
    await asyncio.wait_for(harness.backend.slot_watch._task, 5)
    assert harness.sample("gateway_kv_reserved_tokens", backend="local") == 0


def test_splitter_is_linear_and_bounded() -> None:
    s = EventSplitter(max_event_bytes=1000)
    with pytest.raises(EventTooLarge):
        for _ in range(100):
            s.feed(b"y" * 100)


async def test_upstream_429_gets_retry_after_ms(harness: Harness, fake: Any) -> None:
    async def limited(request: httpx.Request) -> httpx.Response:
        if request.url.path == CHAT:
            return httpx.Response(429, headers={"Retry-After": "3"}, json={"error": "slow"})
        return await fake.handle(request)

    harness.state.client._transport = httpx.MockTransport(limited)
    r = await harness.chat("x", max_tokens=5)
    assert r.headers["retry-after"] == "3" and r.headers["retry-after-ms"] == "3000"


async def test_no_openapi_and_no_slash_redirect(harness: Harness) -> None:
    assert (await harness.client.get("/openapi.json")).status_code == 404
    r = await harness.client.post(CHAT + "/", json={})
    assert r.status_code == 404


async def test_fast_failures_do_not_shorten_retry_after() -> None:
    clock = ManualClock()
    adm = Admission(Layout(1, 2048), max_queue=4, max_wait_s=30, clock=clock)
    lease = await adm.admit(Charge(10, 10))
    clock.advance(20.0)
    adm.release(lease)
    lease = await adm.admit(Charge(10, 10))
    clock.advance(20.0)
    adm.release(lease)
    for _ in range(30):  # failures released in no time
        failed = await adm.admit(Charge(10, 10))
        adm.release(failed, served=False)
    assert adm.retry_after_s() >= 20.0


async def test_hopelessly_large_prompt_is_refused_without_counting(harness: Harness) -> None:
    r = await harness.chat("x" * 400_000, max_tokens=5)  # >= 3125 tokens for a 2048 slot
    assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded"
    assert not any(q.url.path.endswith("input_tokens") for q in harness.fake.requests)
    r = await harness.client.post("/v1/completions", json={"prompt": list(range(3000)),
                                                           "max_tokens": 5})
    assert r.status_code == 400 and generations(harness) == []


async def test_huge_numbers_are_400(harness: Harness) -> None:
    for raw in (b'{"messages": [{"role": "user", "content": "x"}], "max_tokens": ' + b"9" * 5000
                + b"}", b'{"messages": [{"role": "user", "content": "x"}], "temperature": 1e999}'):
        r = await harness.client.post(CHAT, content=raw,
                                      headers={"content-type": "application/json"})
        assert r.status_code == 400
    assert generations(harness) == []


async def test_backend_500_on_counting_a_bad_body_is_400(harness: Harness, fake: Any) -> None:
    async def refuse(request: httpx.Request) -> httpx.Response:
        if request.url.path == "/v1/chat/completions/input_tokens":
            return httpx.Response(500, json={"error": {
                "code": 500, "message": "image input is not supported - hint: if this is "
                "unexpected, you may need to provide the mmproj", "type": "server_error"}})
        return await fake.handle(request)

    harness.state.client._transport = httpx.MockTransport(refuse)
    r = await harness.chat("hi", max_tokens=5)
    assert r.status_code == 400 and "mmproj" in r.json()["error"]["message"]
    assert generations(harness) == []


async def test_streams_ask_upstream_to_close_the_connection(harness: Harness) -> None:
    from tests.test_proxy_asgi import AsgiCall, chat

    await AsgiCall(harness, chat()).run()
    gen = [q for q in harness.fake.requests if q.url.path == CHAT][-1]
    assert gen.headers["connection"] == "close"


CALL = [{"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}]


@pytest.mark.parametrize("messages,param", [
    ([{"role": "user", "content": None}], "messages[0].content"),
    ([{"role": "user"}], "messages[0].content"),
    ([{"role": "system"}, {"role": "user", "content": "hi"}], "messages[0].content"),
    ([{"role": "user", "content": "hi"}, {"role": "assistant", "content": None}],
     "messages[1].content"),
    ([{"role": "user", "content": "hi"}, {"role": "assistant", "tool_calls": CALL},
      {"role": "tool", "content": "42"}], "messages[2].tool_call_id"),
    ([{"role": "user", "content": "hi"}, {"role": "assistant", "tool_calls": CALL},
      {"role": "tool", "tool_call_id": "c1"}], "messages[2].content"),
])
async def test_a_field_a_role_requires_is_checked_before_forwarding(
        harness: Harness, messages: list[dict[str, Any]], param: str) -> None:
    """Issue 14: a user message with "content": null was forwarded, where the OpenAI API
    answers 400. Each role's required fields are checked, and nothing is forwarded."""
    r = await harness.client.post(CHAT, json={"messages": messages, "max_tokens": 5})
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == param and error["type"] == "invalid_request_error"
    assert generations(harness) == []


async def test_what_the_roles_allow_is_still_forwarded(harness: Harness) -> None:
    for messages in (
        [{"role": "user", "content": "hi"}, {"role": "assistant", "tool_calls": CALL},
         {"role": "tool", "tool_call_id": "c1", "content": "42"}],
        [{"role": "user", "content": ""}],  # empty, not missing
        [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "Sure"}],
        [{"role": "ipython", "content": None}, {"role": "user", "content": "hi"}],
    ):
        r = await harness.client.post(CHAT, json={"messages": messages, "max_tokens": 5})
        assert r.status_code == 200, (messages, r.text)
    assert len(generations(harness)) == 4
