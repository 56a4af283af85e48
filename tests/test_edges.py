"""Issue 15, points 2–8: the faults found at the gateway's edges, each kept as a test.

The upstream is the fake llama-server (tests/fakes.py); points 3, 4 and 7 are also run
against the real llama-server in tests/integration/test_edges_real.py.
"""

from __future__ import annotations

import asyncio
import json
import time
from typing import Any

import httpx
import pytest

from gateway.http.middleware import MAX_HEADER_BYTES, MAX_HEADERS
from tests.conftest import Harness
from tests.fakes import FakeLlamaServer
from tests.served import exchange, request_bytes, served, split_response

pytestmark = pytest.mark.anyio
CHAT = "/v1/chat/completions"


def requests_total(h: Harness, code: str, route: str = "chat", backend: str = "local"
                   ) -> float:
    return h.sample("gateway_requests_total", backend=backend, route=route, code=code)


# 2. A charge planned before a layout change must not block the queue.
async def test_charge_planned_before_a_layout_change_is_refused_at_once(
    harness_factory: Any, fake: FakeLlamaServer
) -> None:
    h = await harness_factory({"max_queue_wait_s": 30})
    count = h.backend.count_prompt

    async def count_then_shrink(route: str, body: dict[str, Any]) -> int | None:
        counted = await count(route, body)
        fake.n_ctx = 1024  # the backend restarts with a smaller slot meanwhile
        await h.backend.discover()
        return counted

    h.backend.count_prompt = count_then_shrink
    started = time.monotonic()
    r = await h.chat("hello", max_tokens=1500)
    assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded"
    assert "1024" in r.json()["error"]["message"]
    assert time.monotonic() - started < 5  # not after max_queue_wait_s
    h.backend.count_prompt = count
    small = await h.chat("hi", max_tokens=10)  # nothing is left blocking the queue
    assert small.status_code == 200
    assert h.backend.admission.stats().queued == 0


# 3. Headers: only what the backend needs is forwarded; bounds at the front; error bodies
# that are empty or not in the OpenAI shape are put in shape.
async def test_cookies_and_unknown_headers_are_not_forwarded(harness: Harness,
                                                             fake: FakeLlamaServer) -> None:
    r = await harness.client.post(CHAT, json={"messages": [{"role": "user", "content": "x"}],
                                              "max_tokens": 3},
                                  headers={"Cookie": "a=" + "x" * 8300, "X-Custom": "1",
                                           "X-Request-Id": "req-7"})
    assert r.status_code == 200
    sent = [q for q in fake.requests if q.url.path == CHAT][-1]
    assert "cookie" not in sent.headers and "x-custom" not in sent.headers
    # the client's id, made unique for the backend (gateway.observe.logs.request_id_of)
    assert sent.headers["x-request-id"].startswith("req-7-")


@pytest.mark.parametrize("headers", [
    {f"X-H{i}": "v" for i in range(MAX_HEADERS + 1)},
    {"X-Big": "x" * (MAX_HEADER_BYTES + 1)},
])
async def test_too_many_or_too_large_headers_get_431(
    harness: Harness, fake: FakeLlamaServer, headers: dict[str, str]
) -> None:
    r = await harness.client.post(CHAT, json={"messages": [{"role": "user", "content": "x"}]},
                                  headers=headers)
    assert r.status_code == 431
    assert r.json()["error"]["code"] == "request_header_fields_too_large"
    assert not [q for q in fake.requests if q.url.path not in ("/props", "/v1/models")]
    assert requests_total(harness, "431", backend="none") == 1


@pytest.mark.parametrize("status,content,shown", [
    (400, b"", "no error message"),
    (400, b"Bad Request", "Bad Request"),
    (413, b'{"error": "too big"}', "too big"),
])
async def test_upstream_4xx_without_an_openai_body_is_put_in_shape(
    harness: Harness, fake: FakeLlamaServer, status: int, content: bytes, shown: str
) -> None:
    async def refuse(request: httpx.Request) -> httpx.Response:
        if request.url.path == CHAT:
            return httpx.Response(status, content=content)
        return await fake.handle(request)

    harness.state.client._transport = httpx.MockTransport(refuse)
    r = await harness.chat("x", max_tokens=3)
    assert r.status_code == status
    err = r.json()["error"]
    assert err["code"] == "upstream_refused" and shown in err["message"]
    assert err["type"] == "invalid_request_error"


# 4. A backend started with --api-key.
async def test_backend_api_key_is_sent_on_every_upstream_call(
    harness_factory: Any, fake: FakeLlamaServer
) -> None:
    fake.api_key = "s3cret"
    h = await harness_factory(api_key="s3cret")
    assert h.backend.ready
    r = await h.chat("hello there", max_tokens=3, stream=True)
    assert r.status_code == 200
    paths = {q.url.path for q in fake.requests}
    assert {"/props", "/v1/chat/completions/input_tokens", CHAT} <= paths
    assert all(q.headers.get("authorization") == "Bearer s3cret" for q in fake.requests)


async def test_missing_or_wrong_backend_key_is_reported_as_auth(
    harness_factory: Any, fake: FakeLlamaServer
) -> None:
    fake.api_key = "s3cret"
    wrong = await harness_factory(discover=False, api_key="wrong")
    with pytest.raises(Exception, match="api_key"):
        await wrong.backend.discover()
    assert not wrong.backend.ready
    r = await wrong.chat("x", max_tokens=3)
    assert r.status_code == 503 and "api_key" in r.json()["error"]["message"]
    h = await harness_factory(api_key="s3cret")
    fake.api_key = "rotated"  # the backend's key changes after discovery
    r = await h.chat("x", max_tokens=3)
    assert r.status_code == 502 and r.json()["error"]["code"] == "upstream_auth_failed"
    assert "api_key" in r.json()["error"]["message"]
    assert not [q for q in fake.requests if q.url.path == CHAT]


# 5. Deep nesting: 400 in the OpenAI shape at every depth.
@pytest.mark.parametrize("depth", [65, 960, 5000, 100_000])
async def test_deep_nesting_is_a_400(harness: Harness, depth: int) -> None:
    raw = (b'{"messages":[{"role":"user","content":"x"}],"extra":' + b"[" * depth
           + b"]" * depth + b"}")
    r = await harness.client.post(CHAT, content=raw,
                                  headers={"content-type": "application/json"})
    assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_request"
    assert requests_total(harness, "400", backend="none") == 1


# 6. Every request that reaches a route is counted once, with its status.
async def test_405_and_404_are_counted(harness: Harness) -> None:
    assert (await harness.client.get(CHAT)).status_code == 405
    assert (await harness.client.get("/nope")).status_code == 404
    assert requests_total(harness, "405", backend="none") == 1
    assert requests_total(harness, "404", route="other", backend="none") == 1


async def test_a_client_leaving_mid_body_is_a_quiet_499(
    harness: Harness, caplog: pytest.LogCaptureFixture
) -> None:
    messages = iter([
        {"type": "http.request", "body": b'{"messages": [', "more_body": True},
        {"type": "http.disconnect"},
    ])

    async def receive() -> dict[str, Any]:
        return next(messages)

    sent: list[dict[str, Any]] = []

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1",
             "method": "POST", "scheme": "http", "path": CHAT, "raw_path": CHAT.encode(),
             "query_string": b"", "root_path": "", "client": ("127.0.0.1", 1),
             "server": ("gateway", 80),
             "headers": [(b"content-type", b"application/json"), (b"content-length", b"999")]}
    await harness.app(scope, receive, send)
    assert sent == []
    assert requests_total(harness, "499", backend="none") == 1
    assert "Traceback" not in caplog.text


async def test_each_answered_request_is_counted_once(harness: Harness) -> None:
    assert (await harness.chat("x", max_tokens=3)).status_code == 200
    assert (await harness.chat("x", max_tokens=0)).status_code == 400
    assert requests_total(harness, "200") == 1
    assert requests_total(harness, "400", backend="local") + requests_total(
        harness, "400", backend="none") == 1


# 7. HTTP/1.0 clients get a close-delimited stream, not a chunked one.
def test_http_1_0_stream_is_close_delimited(make_settings: Any) -> None:
    body = json.dumps({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3,
                       "stream": True}).encode()
    with served(make_settings(), FakeLlamaServer().client()) as port:
        raw = exchange(port, request_bytes(CHAT, body, version="1.0"), timeout=60)
    status, headers, payload = split_response(raw)
    assert status == 200 and "transfer-encoding" not in headers
    assert payload.startswith(b"data: {") and payload.endswith(b"data: [DONE]\n\n")


# 8. Token-id prompts are validated like every other body.
@pytest.mark.parametrize("extra", [
    {"seed": 10**400}, {"seed": 2**64}, {"top_k": 2**40}, {"temperature": "hot"},
])
async def test_token_id_prompts_are_validated(harness: Harness, fake: FakeLlamaServer,
                                              extra: dict[str, Any]) -> None:
    raw = json.dumps({"prompt": [2, 9259], "max_tokens": 2, **extra}).encode()
    r = await harness.client.post("/v1/completions", content=raw,
                                  headers={"content-type": "application/json"})
    assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error"
    assert not [q for q in fake.requests if q.url.path == "/v1/completions"]


async def test_token_ids_outside_the_vocabulary_are_refused(harness: Harness,
                                                            fake: FakeLlamaServer) -> None:
    assert harness.backend.discovered.n_vocab == fake.n_vocab
    r = await harness.client.post("/v1/completions",
                                  json={"prompt": [2, fake.n_vocab], "max_tokens": 2})
    assert r.status_code == 400 and "vocabulary" in r.json()["error"]["message"]
    ok = await harness.client.post("/v1/completions",
                                   json={"prompt": [2, fake.n_vocab - 1], "max_tokens": 2})
    assert ok.status_code == 200
    await asyncio.sleep(0)
