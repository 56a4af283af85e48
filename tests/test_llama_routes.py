"""llama-server's own clients through the gateway, over the fake llama-server
(tests/fakes.py): its path aliases (forwarded, counted and charged as their twins), its
side routes (passed through, no admission, the tenant's key), the routes refused on
purpose, a backend's own /metrics, CORS as llama-server answers it, and the request
shapes llama-server takes that the gateway used to refuse.

The fake answers the generation and counting routes; the few llama-server routes it
lacks (native /completion and /embedding, the side routes, /metrics) are answered here
in llama-server's shapes (tools/server/server-context.cpp, as measured on the build in
use: tests/integration/test_llama_compat_real.py compares with the real one).
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import AsyncIterator, Callable
from typing import Any

import httpx
import pytest
from prometheus_client import CollectorRegistry

from gateway.config import ConfigError, load_settings
from gateway.http.app import create_app
from gateway.http.middleware import title_case
from tests.conftest import Harness
from tests.fakes import FakeLlamaServer

pytestmark = pytest.mark.anyio
KEY = "sk-web-0123456789"
TENANTS = [{"name": "web", "key_hashes": [hashlib.sha256(KEY.encode()).hexdigest()]}]
METRICS_BODY = b"# TYPE llamacpp:prompt_tokens_total counter\nllamacpp:prompt_tokens_total 7\n"


class Upstream:
    """The fake llama-server, plus the routes it lacks; ``requests`` keeps what came."""

    def __init__(self, fake: FakeLlamaServer) -> None:
        self.fake = fake
        self.requests: list[httpx.Request] = []
        self.fail: Exception | None = None  # raised for the side routes when set
        self.count_status: tuple[int, dict[str, Any]] | None = None  # chat counting

    def client(self) -> httpx.AsyncClient:
        return httpx.AsyncClient(transport=httpx.MockTransport(self.handle))

    async def handle(self, request: httpx.Request) -> httpx.Response:
        self.requests.append(request)
        path = request.url.path
        side = {"/detokenize": {"content": "hello"}, "/lora-adapters": [],
                "/tools": [{"tool": "read_file", "type": "builtin"}],
                "/models": {"models": [{"name": "fake.gguf"}], "data": [{"id": "fake.gguf"}]},
                "/v1/responses/input_tokens": {"input_tokens": 3,
                                               "object": "response.input_tokens"},
                "/v1/messages/count_tokens": {"input_tokens": 9},
                "/chat/completions/input_tokens": {"input_tokens": 3,
                                                   "object": "response.input_tokens"}}
        if self.fail is not None and path in (*side, "/tokenize", "/metrics"):
            raise self.fail
        if path == "/v1/chat/completions/input_tokens" and self.count_status is not None:
            status, body = self.count_status
            return httpx.Response(status, json=body)
        if path in side:
            return httpx.Response(200, json=side[path], headers={"x-upstream": "yes"})
        if path == "/metrics":
            return httpx.Response(200, content=METRICS_BODY, headers={
                "content-type": "text/plain; version=0.0.4",
                "process-start-time-unix": "1796200000",
                "access-control-allow-origin": "from-upstream"})
        if path == "/completion":  # llama-server's native answer (no usage)
            body = json.loads(request.content)
            self.fake.generations.append(body)
            return httpx.Response(200, json={"content": " tok", "stop": True,
                                             "tokens_predicted": 1, "tokens_evaluated": 2})
        if path == "/v1/messages":  # Anthropic's shape (server-common.cpp)
            self.fake.generations.append(json.loads(request.content))
            return httpx.Response(200, json={
                "type": "message", "role": "assistant", "stop_reason": "max_tokens",
                "content": [{"type": "text", "text": "tok"}],
                "usage": {"input_tokens": 9, "output_tokens": 1}})
        if path in ("/embedding", "/v1/embeddings", "/v1/rerank", "/v1/responses"):
            self.fake.generations.append(json.loads(request.content))
            return httpx.Response(200, json={"object": "list", "data": [],
                                             "usage": {"prompt_tokens": 2,
                                                       "total_tokens": 2}})
        return await self.fake.handle(request)

    def sent(self, path: str) -> list[httpx.Request]:
        return [r for r in self.requests if r.url.path == path]


@pytest.fixture
def upstream(fake: FakeLlamaServer) -> Upstream:
    return Upstream(fake)


@pytest.fixture
async def make(upstream: Upstream) -> AsyncIterator[Callable[..., Any]]:
    made: list[Harness] = []

    async def build(*, server: dict[str, Any] | None = None, tenants: list[Any] | None = None,
                    discover: bool = True, **backend: Any) -> Harness:
        settings = load_settings(
            server=server or {}, admission={"disconnect_grace_s": 0.0},
            backends=[{"name": "local", "url": "http://upstream:8080", "calibrate": False,
                       **backend}],
            tenants=tenants or [])
        app = create_app(settings, http_client=upstream.client(),
                         registry=CollectorRegistry(), discover=False)
        h = Harness(app, upstream.fake)
        if discover:
            await h.backend.discover()
        made.append(h)
        return h

    yield build
    for h in made:
        await h.client.aclose()


PLACING = ("id_slot", "n_discard")
CHAT = {"messages": [{"role": "user", "content": "hello there"}], "max_tokens": 4}
PROMPT = {"prompt": "hello there", "n_predict": 4}
ALIASES = [
    ("/chat/completions", "/v1/chat/completions", "chat", "/v1/chat/completions", CHAT),
    ("/completions", "/completion", "completion", "/completion", PROMPT),
    ("/responses", "/v1/responses", "responses", "/v1/responses",
     {"input": "hello there", "max_output_tokens": 4}),
    ("/embeddings", "/embedding", "embedding", "/embedding", {"input": "hello there"}),
    ("/rerank", "/v1/rerank", "rerank", "/v1/rerank", {"query": "a", "documents": ["b c"]}),
    ("/reranking", "/v1/rerank", "rerank", "/v1/rerank", {"query": "a", "documents": ["b"]}),
    ("/v1/reranking", "/v1/rerank", "rerank", "/v1/rerank", {"query": "a", "documents": ["b"]}),
]


@pytest.mark.parametrize("alias,twin,label,upstream_path,body", ALIASES,
                         ids=[a[0] for a in ALIASES])
async def test_an_alias_is_forwarded_counted_and_charged_as_its_twin(
        make: Any, upstream: Upstream, alias: str, twin: str, label: str,
        upstream_path: str, body: dict[str, Any]) -> None:
    h = await make()
    forwarded = []
    for path in (twin, alias):
        resp = await h.client.post(path, json=body)
        assert resp.status_code == 200, resp.text
        sent = json.loads(upstream.sent(upstream_path)[-1].content)
        # id_slot and the n_discard tag place each request on its slot
        forwarded.append({k: v for k, v in sent.items() if k not in PLACING})
    assert forwarded[0] == forwarded[1]  # the same charged cap, the same body
    assert len(upstream.sent(upstream_path)) == 2
    assert h.sample("gateway_requests_total", route=label, code="200") == 2
    assert h.sample("gateway_requests_total", route="other") == 0
    assert h.backend.stats().inflight == 0  # each lease given back


async def test_an_alias_is_refused_as_its_twin(make: Any, fake: FakeLlamaServer
                                                         ) -> None:
    h = await make(slots=1)
    resp = await h.client.post("/chat/completions", json={**CHAT, "max_tokens": 100000})
    assert resp.status_code == 400  # the twin's refusal: it can never fit
    assert resp.json()["error"]["code"] == "context_length_exceeded"
    assert fake.generations == []


SIDE = [
    ("POST", "/tokenize", {"content": "hello world"}),
    ("POST", "/detokenize", {"tokens": [1, 2]}),
    ("POST", "/apply-template", {"messages": [{"role": "user", "content": "hi"}]}),
    ("POST", "/chat/completions/input_tokens", {"messages": [{"role": "user", "content": "hi"}]}),
    ("POST", "/v1/responses/input_tokens", {"input": "hi"}),
    ("GET", "/props", None),
    ("GET", "/models", None),
    ("GET", "/lora-adapters", None),
    ("GET", "/slots?fail_on_no_slot=1", None),
]


@pytest.mark.parametrize("method,path,body", SIDE, ids=[s[1] for s in SIDE])
async def test_a_side_route_is_passed_through_with_no_admission(
        make: Any, upstream: Upstream, method: str, path: str, body: Any) -> None:
    h = await make(api_key="backend-key")
    upstream.requests.clear()
    resp = await h.client.request(method, path, json=body,
                                  headers={"authorization": "Bearer client-key"})
    assert resp.status_code == 200, resp.text
    sent = upstream.requests[-1]
    assert len(upstream.requests) == 1  # relayed once, nothing counted first
    assert sent.method == method and str(sent.url).endswith(path)  # query kept
    assert sent.headers["authorization"] == "Bearer backend-key"  # never the client's
    if body is not None:
        assert json.loads(sent.content) == body
    assert upstream.fake.generations == [] and h.backend.stats().inflight == 0
    label = path.split("?")[0].lstrip("/").replace("-", "_").split("/")[0]
    label = {"chat": "input_tokens", "v1": "input_tokens"}.get(label, label)
    assert h.sample("gateway_requests_total", route=label, code="200") == 1


async def test_side_routes_pass_while_every_slot_is_held(make: Any, fake: FakeLlamaServer
                                                        ) -> None:
    import asyncio
    h = await make(slots=1)
    fake.hold = asyncio.Event()
    chat = asyncio.create_task(h.chat())
    while h.backend.stats().inflight == 0:
        await asyncio.sleep(0)
    resp = await h.client.post("/tokenize", json={"content": "a b"})
    assert resp.status_code == 200 and resp.json() == {"tokens": [0, 1, 2]}
    fake.hold.set()
    assert (await chat).status_code == 200


async def test_the_upstream_answer_and_headers_are_relayed(make: Any, upstream: Upstream
                                                          ) -> None:
    h = await make()
    resp = await h.client.get("/lora-adapters")
    assert resp.json() == [] and resp.headers["x-upstream"] == "yes"
    props = await h.client.get("/props")
    assert props.json()["total_slots"] == 4  # the fake's own /props


async def test_a_side_answer_past_the_size_limit_is_502(make: Any) -> None:
    h = await make()
    h.app.state.side_routes.max_answer_bytes = 8
    resp = await h.client.get("/models")
    assert resp.status_code == 502 and "8 bytes" in resp.json()["error"]["message"]


async def test_a_side_route_that_times_out_is_504(make: Any, upstream: Upstream) -> None:
    h = await make()
    upstream.fail = httpx.ReadTimeout("slow")
    resp = await h.client.post("/detokenize", json={"tokens": [1]})
    assert resp.status_code == 504 and resp.json()["error"]["code"] == "upstream_timeout"


async def test_a_kind_without_the_route_is_a_404_naming_the_backend(make: Any) -> None:
    h = await make(kind="ollama", discover=False)
    resp = await h.client.post("/tokenize", json={"content": "a"})
    assert resp.status_code == 404
    message = resp.json()["error"]["message"]
    assert "'local'" in message and "ollama" in message


async def test_vllm_serves_its_own_tokenize_but_not_props(make: Any, upstream: Upstream
                                                         ) -> None:
    # vLLM's /tokenize and /detokenize (vllm/entrypoints/openai/api_server.py).
    h = await make(kind="vllm", discover=False)
    assert (await h.client.post("/detokenize", json={"tokens": [1]})).status_code == 200
    assert upstream.sent("/detokenize")
    resp = await h.client.get("/props")
    assert resp.status_code == 404 and "vllm" in resp.json()["error"]["message"]


REFUSED = [
    ("POST", "/slots/0?action=save", 403), ("POST", "/slots/1?action=restore", 403),
    ("POST", "/slots/0?action=erase", 403), ("POST", "/props", 403),
    ("POST", "/lora-adapters", 403), ("GET", "/cors-proxy?url=http://example.com", 403),
    ("POST", "/predict", 404), ("GET", "/", 404), ("GET", "/tools", 403),
    ("POST", "/tools", 403),  # relayed only with server.relay_tools
    # A router's model management: the gateway loads and unloads its models itself.
    ("POST", "/models", 403), ("DELETE", "/models?model=x", 403),
    ("POST", "/models/load", 403), ("POST", "/models/unload", 403),
]


@pytest.mark.parametrize("method,path,status", REFUSED, ids=[r[1] for r in REFUSED])
async def test_routes_refused_on_purpose_say_why(make: Any, upstream: Upstream, method: str,
                                                 path: str, status: int) -> None:
    h = await make()
    upstream.requests.clear()
    resp = await h.client.request(method, path, json={"filename": "x.bin"})
    assert resp.status_code == status
    error = resp.json()["error"]
    assert error["code"] == ("not_relayed" if status == 403 else "not_found")
    assert "gateway" in error["message"] and len(error["message"]) > 60
    assert upstream.requests == []  # nothing reaches the backend


async def test_a_backends_own_metrics_are_relayed_with_its_headers(make: Any) -> None:
    h = await make()
    resp = await h.client.get("/backends/local/metrics")
    assert resp.status_code == 200 and resp.content == METRICS_BODY
    assert resp.headers["process-start-time-unix"] == "1796200000"
    assert resp.headers["content-type"].startswith("text/plain")
    assert "access-control-allow-origin" not in resp.headers  # CORS is the gateway's own
    own = await h.client.get("/metrics")
    assert b"gateway_requests_total" in own.content and b"llamacpp:" not in own.content
    assert h.sample("gateway_requests_total", route="backend_metrics") == 1
    missing = await h.client.get("/backends/nope/metrics")
    assert missing.status_code == 404 and "local" in missing.json()["error"]["message"]


async def test_backend_metrics_need_the_admin_key_as_metrics(make: Any) -> None:
    h = await make(server={"admin_key": "admin-secret-42"}, tenants=TENANTS)
    tenant = {"authorization": f"Bearer {KEY}"}
    assert (await h.client.get("/backends/local/metrics", headers=tenant)).status_code == 401
    admin = {"authorization": "Bearer admin-secret-42"}
    assert (await h.client.get("/backends/local/metrics", headers=admin)).status_code == 200


async def test_slots_show_every_request_so_need_the_admin_key(make: Any) -> None:
    h = await make(server={"admin_key": "admin-secret-42"}, tenants=TENANTS)
    tenant = {"authorization": f"Bearer {KEY}"}
    assert (await h.client.get("/slots", headers=tenant)).status_code == 401
    admin = {"authorization": "Bearer admin-secret-42"}
    assert (await h.client.get("/slots", headers=admin)).status_code == 200
    assert (await (await make()).client.get("/slots")).status_code == 200  # no tenants


async def test_a_backend_refusing_the_gateways_key_is_a_502(make: Any,
                                                           upstream: Upstream) -> None:
    h = await make()
    upstream.fake.api_key = "backend-secret"
    resp = await h.client.post("/tokenize", json={"content": "a b"})
    assert resp.status_code == 502, resp.text
    assert "backends[].api_key" in resp.json()["error"]["message"]


async def test_side_routes_are_refused_while_draining_and_answer_head(make: Any) -> None:
    h = await make()
    head = await h.client.head("/props")
    assert head.status_code == 200 and head.content == b""
    assert (await h.client.head("/backends/local/metrics")).status_code == 200
    h.app.state.gateway.draining = True
    resp = await h.client.post("/tokenize", json={"content": "a"})
    assert resp.status_code == 503 and resp.json()["error"]["code"] == "shutting_down"
    assert "retry-after" in resp.headers


async def test_an_ollama_backend_has_no_metrics_to_relay(make: Any) -> None:
    h = await make(kind="ollama", discover=False)
    resp = await h.client.get("/backends/local/metrics")
    assert resp.status_code == 404 and "ollama" in resp.json()["error"]["message"]


async def test_with_tenants_side_routes_need_a_key_and_slot_actions_stay_refused(
        make: Any, upstream: Upstream) -> None:
    h = await make(tenants=TENANTS)
    key = {"authorization": f"Bearer {KEY}"}
    assert (await h.client.post("/tokenize", json={"content": "a"})).status_code == 401
    assert (await h.client.get("/slots")).status_code == 403  # needs an admin key
    assert (await h.client.get("/slots", headers=key)).status_code == 403
    assert (await h.client.post("/tokenize", json={"content": "a"}, headers=key)
            ).status_code == 200
    assert (await h.client.post("/slots/0?action=erase")).status_code == 401
    resp = await h.client.post("/slots/0?action=erase", headers=key)
    assert resp.status_code == 403 and not upstream.sent("/slots/0")
    assert (await h.client.post("/chat/completions", json=CHAT)).status_code == 401
    assert (await h.client.post("/chat/completions", json=CHAT, headers=key)
            ).status_code == 200


# -- CORS ------------------------------------------------------------------------------

PREFLIGHT = {"origin": "localhost", "access-control-request-method": "POST",
             "access-control-request-headers": "Authorization"}


async def test_cors_is_off_by_default(make: Any) -> None:
    h = await make()
    resp = await h.client.options("/completions", headers=PREFLIGHT)
    assert resp.status_code == 405 and "access-control-allow-origin" not in resp.headers
    resp = await h.client.post("/completions", json=PROMPT, headers={"origin": "localhost"})
    assert "access-control-allow-origin" not in resp.headers


async def test_a_preflight_is_answered_as_llama_server_does(make: Any) -> None:
    # llama-server's defaults (--cors-origins *, --cors-methods, --cors-credentials).
    h = await make(server={"cors_origins": ["*"]}, tenants=TENANTS)
    resp = await h.client.options("/completions", headers=PREFLIGHT)  # no key: browsers
    assert resp.status_code == 200
    assert resp.headers["access-control-allow-origin"] == "localhost"
    assert resp.headers["access-control-allow-credentials"] == "true"
    assert resp.headers["access-control-allow-methods"] == "GET, POST, DELETE, OPTIONS"
    assert resp.headers["access-control-allow-headers"] == "Authorization"


async def test_cors_headers_are_on_answers_streams_and_errors(make: Any) -> None:
    h = await make(server={"cors_origins": ["*"]}, tenants=TENANTS)
    origin = {"origin": "http://web.example"}
    key = {"authorization": f"Bearer {KEY}", **origin}
    answers = [
        await h.client.post("/v1/chat/completions", json={**CHAT, "stream": True},
                            headers=key),  # the direct path, streamed
        await h.client.post("/chat/completions", json=CHAT, headers=key),
        await h.client.post("/chat/completions", json=CHAT, headers=origin),  # 401
        await h.client.post("/chat/completions", json={"messages": 3}, headers=key),  # 400
        await h.client.post("/tokenize", json={"content": "a"}, headers=key),
        await h.client.get("/health", headers=origin),
    ]
    assert [r.status_code for r in answers] == [200, 200, 401, 400, 200, 200]
    assert "data: " in answers[0].text
    for resp in answers:
        assert resp.headers["access-control-allow-origin"] == "http://web.example"
        assert resp.headers["access-control-allow-credentials"] == "true"


async def test_cors_never_covers_the_status_page_or_admin(make: Any) -> None:
    h = await make(server={"cors_origins": ["*"], "admin_key": "admin-secret-42"})
    origin = {"origin": "http://evil.example", "authorization": "Bearer admin-secret-42"}
    for path in ("/status.json", "/admin/backends"):
        resp = await h.client.get(path, headers=origin)
        assert resp.status_code == 200 and "access-control-allow-origin" not in resp.headers


async def test_listed_origins_only(make: Any) -> None:
    h = await make(server={"cors_origins": ["http://app.example"]})
    ok = await h.client.get("/health", headers={"origin": "http://app.example"})
    assert ok.headers["access-control-allow-origin"] == "http://app.example"
    other = await h.client.get("/health", headers={"origin": "http://evil.example"})
    assert "access-control-allow-origin" not in other.headers
    refused = await h.client.options("/completions", headers={**PREFLIGHT,
                                                               "origin": "http://evil.example"})
    # As llama-server answers it: 200 with no CORS header (the browser then refuses).
    assert refused.status_code == 200 and refused.content == b""
    assert not [k for k in refused.headers if k.lower().startswith("access-control-")]


@pytest.mark.parametrize("origin,allowed", [
    ("http://localhost", True), ("http://localhost:8080", True), ("http://127.0.0.1", True),
    ("https://127.0.0.1:3000", True), ("http://[::1]", True), ("http://[::1]:3000", True),
    ("http://web.mydomain.fr", False), ("http://evil.com", False),
    ("http://notlocalhost", False), ("http://localhost.evil.com", False),
    ("http://localhost:80.evil.com", False), ("file://localhost", False),
    ("x-evil://localhost", False),
])
async def test_localhost_allows_this_machines_origins_only(make: Any, origin: str,
                                                           allowed: bool) -> None:
    # llama-server's --cors-origins localhost (tools/server/server-http.cpp,
    # origin_is_localhost); llama.cpp's test_cors_origins_localhost_*.
    h = await make(server={"cors_origins": ["localhost"]})
    resp = await h.client.options("/completions", headers={**PREFLIGHT, "origin": origin})
    assert resp.status_code == 200
    assert resp.headers.get("access-control-allow-origin") == (origin if allowed else None)


async def test_header_names_are_sent_in_llama_servers_case(make: Any) -> None:
    # Read from a plain dictionary, as llama.cpp's suite reads them (test_cors_options).
    h = await make(server={"cors_origins": ["*"]})
    resp = await h.client.options("/completions", headers=PREFLIGHT)
    names = [k for k, _ in resp.headers.raw]
    assert b"Access-Control-Allow-Origin" in names and b"Access-Control-Allow-Methods" in names
    answer = await h.client.post("/completions", json=PROMPT)
    names = [k for k, _ in answer.headers.raw]
    assert b"Content-Type" in names and b"X-Request-Id" in names
    assert all(n == title_case(n) for n in names)


@pytest.mark.parametrize("method,path,body", [
    ("POST", "/completions", PROMPT),
    ("POST", "/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}],
                                      "max_tokens": 4, "stream": True}),
    ("POST", "/v1/chat/completions", {"messages": "not a list"}),  # the gateway's 400
    ("GET", "/health", None),
    ("GET", "/no/such/route", None),  # the framework's 404
])
async def test_header_names_are_in_llama_servers_case_without_cors_too(
        make: Any, method: str, path: str, body: Any) -> None:
    h = await make()
    resp = await h.client.request(method, path, json=body)
    names = [k for k, _ in resp.headers.raw]
    assert b"X-Request-Id" in names and all(n == title_case(n) for n in names), names


def test_a_blank_origin_is_a_config_error() -> None:
    with pytest.raises(ConfigError, match="cors_origins"):
        load_settings(server={"cors_origins": [" "]})
    assert load_settings().server.cors_origins == []


# -- the request shapes llama-server takes ---------------------------------------------

async def test_a_prompt_object_is_forwarded_and_its_media_charged(make: Any,
                                                                  upstream: Upstream) -> None:
    h = await make()
    resp = await h.client.post("/completion", json={"prompt": {"prompt_string": "hello"},
                                                    "n_predict": 2})
    assert resp.status_code == 200
    assert json.loads(upstream.sent("/completion")[-1].content)["prompt"] == {
        "prompt_string": "hello"}
    # 1,600 tokens per media item (IMAGE_TOKENS): more than a slot of 1,024 tokens.
    image = {"prompt": {"prompt_string": "a <__media__>", "multimodal_data": ["aGk="]},
             "n_predict": 2}
    assert (await h.client.post("/completion", json=image)).status_code == 200
    upstream.fake.n_ctx = 1024
    small = await make()
    resp = await small.client.post("/completion", json=image)
    assert resp.status_code == 400 and resp.json()["error"]["code"] == \
        "context_length_exceeded"
    bad = await h.client.post("/completion", json={"prompt": {"prompt_string": 3}})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "prompt"


async def test_an_anthropic_request_with_no_messages_is_forwarded(make: Any,
                                                                  upstream: Upstream) -> None:
    h = await make()
    body = {"model": "x", "max_tokens": 4, "messages": [], "system": "be brief"}
    resp = await h.client.post("/v1/messages", json=body)
    assert resp.status_code == 200, resp.text
    assert json.loads(upstream.sent("/v1/messages")[-1].content)["messages"] == []
    assert (await h.client.post("/v1/messages", json={**body, "messages": {}})
            ).status_code == 400  # still an array


async def test_an_image_for_a_text_model_stays_a_400(make: Any, upstream: Upstream) -> None:
    # llama-server answers 500 server_error "image input is not supported" (measured);
    # a client's mistake is a 4xx here (docs/differences.md).
    h = await make()
    upstream.count_status = (500, {"error": {"code": 500, "type": "server_error",
                                             "message": "image input is not supported"}})
    resp = await h.client.post("/chat/completions", json=CHAT)
    assert resp.status_code == 400 and "image input" in resp.json()["error"]["message"]
    assert upstream.fake.generations == []


async def test_tools_are_relayed_when_the_operator_says_so(make: Any, upstream: Upstream
                                                          ) -> None:
    # llama-server's /tools runs its built-in tools and MCP servers: off unless
    # server.relay_tools, then a side route as the others, under the tenant's key.
    h = await make(server={"relay_tools": True}, tenants=TENANTS)
    assert (await h.client.get("/tools")).status_code == 401
    key = {"authorization": f"Bearer {KEY}"}
    listed = await h.client.get("/tools", headers=key)
    assert listed.status_code == 200 and listed.json()[0]["tool"] == "read_file"
    run = await h.client.post("/tools", headers=key,
                              json={"tool": "read_file", "params": {"path": "x"}})
    assert run.status_code == 200
    sent = [r for r in upstream.requests if r.url.path == "/tools"]
    assert [r.method for r in sent] == ["GET", "POST"]
    assert json.loads(sent[1].content)["tool"] == "read_file"
    assert h.sample("gateway_requests_total", route="tools") == 3  # the 401 too
