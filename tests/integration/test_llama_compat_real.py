"""llama-server's own clients through the gateway, on a real llama-server (Gemma 3 270M):
each alias and side route answers with the same status and body shape through the
gateway as directly; an alias is held under admission as its twin; CORS answers as
llama-server's defaults do; the deliberate differences (docs/differences.md) are what
that page says."""

from __future__ import annotations

import asyncio
import base64
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from gateway.dev.localbackend import LlamaServer
from tests.integration.conftest import GatewayThread, long_prompt

pytestmark = [pytest.mark.llama, pytest.mark.anyio]

# Weight repacking off: on some CPUs (AMX) this build's repacked kernels crash at start.
NO_REPACK = "--no-repack"
PREFLIGHT = {"Origin": "localhost", "Access-Control-Request-Method": "POST",
             "Access-Control-Request-Headers": "Authorization"}


@pytest.fixture(scope="module")
def server(llama_parts: tuple[Any, Any]) -> Iterator[LlamaServer]:
    """llama-server with its defaults (CORS included) and -c 2048 --metrics."""
    binary, model = llama_parts
    with LlamaServer(["-c", "2048", "--metrics", NO_REPACK], binary=binary,
                     model=model).running() as s:
        yield s


@pytest.fixture(scope="module")
def gateway(server: LlamaServer) -> Iterator[GatewayThread]:
    with GatewayThread({"url": server.url}, server={"cors_origins": ["*"]}) as gw:
        yield gw


def shape(value: Any) -> Any:
    """A body's shape: an object's keys (the values' shapes one level down), a list's
    first item's shape, else the type's name."""
    if isinstance(value, dict):
        return {k: type(v).__name__ for k, v in value.items()}
    if isinstance(value, list):
        return ["empty"] if not value else [shape(value[0])]
    return type(value).__name__


def both(server: LlamaServer, gw: GatewayThread, method: str, path: str,
         **kwargs: Any) -> tuple[httpx.Response, httpx.Response]:
    direct = httpx.request(method, server.url + path, timeout=120, **kwargs)
    through = httpx.request(method, gw.url + path, timeout=120, **kwargs)
    return direct, through


# Keys whose presence depends on the request's place or time, not on the route.
_VARYING = {"id_slot", "timings", "created", "id", "system_fingerprint", "model"}


def _same_shape(direct: httpx.Response, through: httpx.Response) -> None:
    assert through.status_code == direct.status_code, (direct.text, through.text)
    d, t = direct.json(), through.json()
    if isinstance(d, dict) and isinstance(t, dict) and "error" not in d:
        d = {k: v for k, v in d.items() if k not in _VARYING}
        t = {k: v for k, v in t.items() if k not in _VARYING}
    assert shape(t) == shape(d)


CHAT = {"messages": [{"role": "user", "content": "Say hi."}], "max_tokens": 4, "seed": 1,
        "temperature": 0}
CASES = [
    ("POST", "/chat/completions", CHAT),
    ("POST", "/completions", {"prompt": "Hello", "n_predict": 4, "temperature": 0}),
    ("POST", "/responses", {"input": "Say hi.", "max_output_tokens": 4}),
    ("POST", "/embeddings", {"input": "hello"}),  # 501 without --embeddings, both ways
    ("POST", "/rerank", {"query": "a", "documents": ["b"]}),  # 501 without --reranking
    ("POST", "/reranking", {"query": "a", "documents": ["b"]}),
    ("POST", "/v1/reranking", {"query": "a", "documents": ["b"]}),
    ("POST", "/tokenize", {"content": "hello world"}),
    ("POST", "/detokenize", {"tokens": [9259, 1902]}),
    ("POST", "/apply-template", {"messages": [{"role": "user", "content": "hi"}]}),
    ("POST", "/chat/completions/input_tokens", {"messages": [{"role": "user",
                                                              "content": "hi"}]}),
    ("POST", "/responses/input_tokens", {"input": "hi"}),
    ("GET", "/props", None),
    ("GET", "/models", None),
    ("GET", "/lora-adapters", None),
    ("GET", "/slots", None),
    ("GET", "/v1/health", None),
]


@pytest.mark.parametrize("method,path,body", CASES, ids=[c[1] for c in CASES])
def test_each_alias_and_side_route_answers_as_directly(
        server: LlamaServer, gateway: GatewayThread, method: str, path: str,
        body: Any) -> None:
    direct, through = both(server, gateway, method, path, json=body)
    _same_shape(direct, through)
    if path in ("/tokenize", "/detokenize", "/apply-template", "/lora-adapters",
                "/chat/completions/input_tokens"):
        assert through.json() == direct.json()


def test_an_alias_is_counted_as_its_twin(gateway: GatewayThread) -> None:
    before = gateway.metric("gateway_requests_total", route="completion")
    r = httpx.post(gateway.url + "/completions", json={"prompt": "Hi", "n_predict": 2},
                   timeout=60)
    assert r.status_code == 200 and "content" in r.json()  # llama-server's native shape
    assert gateway.metric("gateway_requests_total", route="completion") == before + 1


async def test_a_chat_completions_overload_is_held_as_v1_chat_completions(
        server: LlamaServer, gateway: GatewayThread) -> None:
    # Two chats of about 790 + 700 tokens each: together past the 2,048-token unified
    # pool, which straight to llama-server would end in a 500 "Context size exceeded".
    body = {"messages": [{"role": "user", "content": long_prompt(55)}], "max_tokens": 700,
            "ignore_eos": True}
    before = gateway.metric("gateway_upstream_errors_total")
    async with httpx.AsyncClient(timeout=600) as client:
        answers = await asyncio.gather(*(client.post(gateway.url + "/chat/completions",
                                                     json=body) for _ in range(2)))
    assert [r.status_code for r in answers] == [200, 200]
    assert [r.json()["usage"]["completion_tokens"] for r in answers] == [700, 700]
    assert gateway.metric("gateway_upstream_errors_total") == before  # no upstream 500
    assert gateway.metric("gateway_kv_reserved_tokens") == 0


def test_a_preflight_as_llama_server_answers_it(server: LlamaServer,
                                                gateway: GatewayThread) -> None:
    direct, through = both(server, gateway, "OPTIONS", "/completions", headers=PREFLIGHT)
    assert direct.status_code == through.status_code == 200
    for header in ("access-control-allow-origin", "access-control-allow-credentials",
                   "access-control-allow-methods"):
        assert through.headers[header] == direct.headers[header], header
    # A deliberate difference: llama-server answers "*", starlette the headers asked for
    # ("*" covers neither Authorization nor a credentialed request, in the Fetch rules).
    assert direct.headers["access-control-allow-headers"] == "*"
    assert through.headers["access-control-allow-headers"] == "Authorization"


def test_a_stream_with_an_origin_carries_cors_as_directly(server: LlamaServer,
                                                          gateway: GatewayThread) -> None:
    origin = {"Origin": "http://web.example"}
    direct, through = both(server, gateway, "POST", "/chat/completions",
                           json={**CHAT, "stream": True}, headers=origin)
    assert direct.status_code == through.status_code == 200
    assert through.headers["access-control-allow-origin"] == \
        direct.headers["access-control-allow-origin"] == "http://web.example"
    assert through.text.rstrip().endswith("data: [DONE]")


def test_the_backends_metrics_are_its_own(server: LlamaServer,
                                          gateway: GatewayThread) -> None:
    direct = httpx.get(server.url + "/metrics", timeout=10)
    through = httpx.get(gateway.url + "/backends/local/metrics", timeout=10)
    assert direct.status_code == through.status_code == 200
    assert through.headers["process-start-time-unix"] == \
        direct.headers["process-start-time-unix"]
    assert "llamacpp:prompt_tokens_total" in through.text
    assert "llamacpp:" not in httpx.get(gateway.url + "/metrics", timeout=10).text


def test_refused_routes(server: LlamaServer, gateway: GatewayThread) -> None:
    direct, through = both(server, gateway, "GET", "/cors-proxy")
    assert direct.status_code == through.status_code == 403  # disabled / not relayed
    save = httpx.post(gateway.url + "/slots/0?action=save", json={"filename": "a.bin"},
                      timeout=10)
    assert save.status_code == 403 and save.json()["error"]["code"] == "not_relayed"


def test_the_request_shapes_llama_server_takes(server: LlamaServer,
                                               gateway: GatewayThread) -> None:
    empty = {"model": "x", "max_tokens": 4, "messages": [], "system": "Be brief."}
    _same_shape(*both(server, gateway, "POST", "/v1/messages", json=empty))
    prompt = {"prompt": {"prompt_string": "Hello"}, "n_predict": 4}
    _same_shape(*both(server, gateway, "POST", "/completion", json=prompt))
    media = {"prompt": {"prompt_string": "A <__media__>", "multimodal_data": ["aGk="]},
             "n_predict": 4}
    _same_shape(*both(server, gateway, "POST", "/completion", json=media))  # both 400
    image = base64.b64encode(b"\x89PNG\r\n\x1a\n" + b"\0" * 64).decode()
    chat = {"max_tokens": 4, "messages": [{"role": "user", "content": [
        {"type": "text", "text": "hi"},
        {"type": "image_url", "image_url": {"url": f"data:image/png;base64,{image}"}}]}]}
    direct, through = both(server, gateway, "POST", "/chat/completions", json=chat)
    assert direct.status_code == 500 and through.status_code == 400  # a difference
    assert "image input is not supported" in through.json()["error"]["message"]


def test_a_prompt_and_cap_past_the_context_is_400(llama_parts: tuple[Any, Any]) -> None:
    # llama-server with context shift off stops at the context's end and answers 200;
    # the gateway refuses a reservation that can never fit (a difference).
    binary, model = llama_parts
    with LlamaServer(["-c", "256", "-np", "1", "--no-context-shift", NO_REPACK],
                     binary=binary, model=model).running() as small, \
            GatewayThread({"url": small.url}) as gw:
        body = {"prompt": long_prompt(8), "n_predict": 400}
        direct, through = both(small, gw, "POST", "/completion", json=body)
        assert direct.status_code == 200 and direct.json()["tokens_predicted"] < 400
        assert through.status_code == 400
        assert through.json()["error"]["code"] == "context_length_exceeded"
