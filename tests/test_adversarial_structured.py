"""Adversarial cases for the changes of issue 38 (found by the adversarial pass):
tracked structured answers fed odd tool calls or cut by an overflow, model file paths
in what clients see, and Ollama contexts of models the configuration does not name.
Against the fakes (tests/fakes.py, tests/fake_ollama.py)."""
from __future__ import annotations

import asyncio
import json
from typing import Any

import httpx
import pytest
from prometheus_client import CollectorRegistry

from gateway.config import load_settings
from gateway.http.app import create_app
from gateway.wire.resume import Reassembler
from tests.conftest import Harness
from tests.fake_ollama import FakeOllama
from tests.fakes import FakeLlamaServer
from tests.test_predictive import _predictive

pytestmark = pytest.mark.anyio
TOOL = {"type": "function", "function": {"name": "f", "parameters": {}}}


def _sse(events: list[Any]) -> bytes:
    return b"".join(b"data: " + json.dumps(e).encode() + b"\n\n" for e in events) + \
        b"data: [DONE]\n\n"


class _Bytes(httpx.AsyncByteStream):
    def __init__(self, data: bytes) -> None:
        self.data = data

    async def __aiter__(self):  # type: ignore[override]
        yield self.data


def _streaming(fake: Any, events: list[Any]) -> None:
    generate = fake._generate

    async def custom(request: httpx.Request) -> httpx.Response:
        body = json.loads(request.content)
        if body.get("tools") and body.get("stream"):
            fake.generations.append(body)
            return httpx.Response(200, headers={"content-type": "text/event-stream"},
                                  stream=_Bytes(_sse(events)))
        return await generate(request)

    fake._generate = custom


@pytest.mark.parametrize("tool_calls", [5, [{"index": -1, "function": {"name": "f"}}],
                                        [{"index": 10**9, "function": {"name": "f"}}]])
async def test_odd_tool_calls_from_upstream_do_not_crash_nor_leak(
        harness_factory: Any, fake: Any, tool_calls: Any) -> None:
    """A tracked structured answer whose upstream sends odd tool_calls (not a list, a
    negative or huge index) is answered whole, and its lease is given back."""
    fake.pool, fake.n_ctx = 2048, 2048
    h = await _predictive(harness_factory, fake)
    _streaming(fake, [
        {"id": "a", "choices": [{"index": 0, "delta": {"role": "assistant", "content": None}}]},
        {"id": "a", "choices": [{"index": 0, "delta": {"tool_calls": tool_calls}}]},
        {"id": "a", "choices": [{"index": 0, "delta": {}, "finish_reason": "tool_calls"}]},
        {"id": "a", "choices": [], "usage": {"prompt_tokens": 3, "completion_tokens": 2,
                                              "total_tokens": 5}}])
    r = await h.chat("x", max_tokens=50, tools=[TOOL])
    assert r.status_code == 200, r.text  # (was an unhandled 500)
    for _ in range(300):
        await asyncio.sleep(0.01)
        if h.backend.stats().inflight == 0:
            break
    stats = h.backend.stats()
    assert stats.inflight == 0 and stats.reserved_tokens == 0


def test_two_calls_in_one_delta_without_index_stay_two() -> None:
    """A piece without an index but with a new id starts a new call (it was merged
    into the last one: its name and arguments run together)."""
    whole = Reassembler("chat")
    whole.feed({"choices": [{"index": 0, "delta": {"tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "a", "arguments": "{}"}},
        {"id": "c2", "type": "function", "function": {"name": "b", "arguments": "{}"}}]}}]})
    calls = whole.answer()["choices"][0]["message"]["tool_calls"]
    assert [(c["id"], c["function"]["name"]) for c in calls] == [("c1", "a"), ("c2", "b")]


async def test_a_tool_call_answer_failed_by_an_overflow_restarts_without_duplicates(
        harness_factory: Any, fake: Any) -> None:
    """The backend overflows midway through a tool call: the answer is sent again from
    the start, and the client gets the call once, with the last attempt's usage."""
    fake.pool, fake.n_ctx = 2048, 2048
    h = await _predictive(harness_factory, fake)
    head = [{"id": "a", "choices": [{"index": 0, "delta": {"role": "assistant", "content": None}}]},
            {"id": "a", "choices": [{"index": 0, "delta": {"tool_calls": [
                {"index": 0, "id": "c1", "type": "function",
                 "function": {"name": "f", "arguments": "{"}}]}}]},
            {"id": "a", "choices": [{"index": 0, "delta": {"tool_calls": [
                {"index": 0, "function": {"arguments": "\"x\":1"}}]}}]}]
    tail = [{"id": "a", "choices": [{"index": 0, "delta": {"tool_calls": [
                {"index": 0, "function": {"arguments": "}"}}]}}]},
            {"id": "a", "choices": [{"index": 0, "delta": {}, "finish_reason": "tool_calls"}]},
            {"id": "a", "choices": [], "usage": {"prompt_tokens": 3, "completion_tokens": 3,
                                                  "total_tokens": 6}}]
    overflow = {"error": {"code": 500, "type": "server_error",
                          "message": "Context size has been exceeded."}}
    calls = []
    generate = fake._generate

    async def custom(request: httpx.Request) -> httpx.Response:
        body = json.loads(request.content)
        if body.get("tools") and body.get("stream"):
            calls.append(body)
            events = head + [overflow] if len(calls) == 1 else head + tail
            data = b"".join(b"data: " + json.dumps(e).encode() + b"\n\n" for e in events)
            if len(calls) > 1:
                data += b"data: [DONE]\n\n"
            return httpx.Response(200, headers={"content-type": "text/event-stream"},
                                  stream=_Bytes(data))
        return await generate(request)

    fake._generate = custom
    r = await h.chat("x", max_tokens=50, tools=[TOOL])
    assert r.status_code == 200, r.text
    msg = r.json()["choices"][0]["message"]
    assert len(calls) == 2
    assert msg["tool_calls"] == [{"type": "function", "id": "c1",
                                  "function": {"name": "f", "arguments": '{"x":1}'}}], msg
    assert r.json()["usage"]["completion_tokens"] == 3
    for _ in range(100):
        await asyncio.sleep(0.01)
    stats = h.backend.stats()
    assert stats.inflight == 0 and stats.reserved_tokens == 0

async def test_a_model_path_is_not_shown_in_a_404_nor_in_metrics() -> None:
    """Two llama-servers without --alias: their ids are their -m paths. No page a client
    reads without the admin key shows them, nor the 404 for an unknown model (which
    listed them)."""
    fakes = {"a": FakeLlamaServer(), "b": FakeLlamaServer()}

    async def route(request: httpx.Request) -> httpx.Response:
        host = request.url.host
        if request.url.path == "/v1/models":
            return httpx.Response(200, json={"object": "list", "data": [
                {"id": f"/home/alice/models/{host}.gguf", "meta": {"n_vocab": 1000}}]})
        return await fakes[host].handle(request)

    settings = load_settings(admission={"disconnect_grace_s": 0.0}, backends=[
        {"name": n, "url": f"http://{n}:8080", "calibrate": False} for n in fakes])
    app = create_app(settings, http_client=httpx.AsyncClient(
        transport=httpx.MockTransport(route)), registry=CollectorRegistry(), discover=False)
    h = Harness(app, fakes["a"])
    for b in h.state.fleet.backends.values():
        await b.discover()
    ready = (await h.client.get("/ready")).text
    assert "/home/alice" not in ready  # today's fix
    for path in ("/v1/models", "/metrics", "/status.json"):
        assert "/home/alice" not in (await h.client.get(path)).text, path
    r = await h.client.post("/v1/chat/completions", json={
        "model": "nosuch", "messages": [{"role": "user", "content": "hi"}]})
    assert r.status_code == 404
    assert "/home/alice" not in r.text, r.text


async def test_an_unnamed_model_without_num_ctx_is_not_refused_below_the_server_default(
        ) -> None:
    """Ollama runs with OLLAMA_CONTEXT_LENGTH=32768: the loaded model shows 32768 in
    /api/ps. A request names another pulled model whose Modelfile sets no num_ctx: Ollama
    would load it at 32768 too. The gateway's /api/show reading assumes 4096 and refuses
    a 6,000-token prompt with 400 (before today it was forwarded)."""
    ollama = FakeOllama(model="llama3.2:1b", num_ctx=32768, default_num_ctx=32768)
    other = FakeOllama(model="qwen3:8b", parameters={"stop": ["<|im_end|>"]},
                       default_num_ctx=32768, loaded=False)

    async def route(request: httpx.Request) -> httpx.Response:
        if request.method == "POST" and request.content:
            name = json.loads(request.content).get("model")
            if isinstance(name, str) and name.startswith("qwen3"):
                return await other.handle(request)
        return await ollama.handle(request)

    settings = load_settings(admission={"disconnect_grace_s": 0.0}, backends=[
        {"name": "ollama", "url": "http://ollama:11434", "kind": "ollama", "slots": 1}])
    app = create_app(settings, http_client=httpx.AsyncClient(
        transport=httpx.MockTransport(route)), registry=CollectorRegistry(), discover=False)
    h = Harness(app, ollama)  # type: ignore[arg-type]
    backend = h.state.fleet.backends["ollama"]
    await backend.discover()
    assert backend.admission.layout.ctx_per_slot == 32768
    r = await h.client.post("/v1/chat/completions", json={
        "model": "qwen3:8b", "max_tokens": 16,
        "messages": [{"role": "user", "content": " ".join(["word"] * 6000)}]})
    assert r.status_code == 200, r.text
    assert len(other.generations) == 1  # forwarded, and Ollama fits it


async def test_a_second_request_during_the_first_show_is_not_checked() -> None:
    """The model's context (2048) is read from /api/show at its first request; a second
    request arriving while that /api/show is answered skips the check (the model is in
    _asked already) and its over-long prompt is forwarded, to be cut by Ollama."""
    import asyncio
    ollama = FakeOllama(num_ctx=2048, loaded=False)

    async def route(request: httpx.Request) -> httpx.Response:
        if request.url.path == "/api/show":
            await asyncio.sleep(0.3)
        return await ollama.handle(request)

    settings = load_settings(admission={"disconnect_grace_s": 0.0}, backends=[
        {"name": "ollama", "url": "http://ollama:11434", "kind": "ollama", "slots": 2}])
    app = create_app(settings, http_client=httpx.AsyncClient(
        transport=httpx.MockTransport(route)), registry=CollectorRegistry(), discover=False)
    h = Harness(app, ollama)  # type: ignore[arg-type]
    await h.state.fleet.backends["ollama"].discover()
    body = {"model": "llama3.2:1b", "max_tokens": 16,
            "messages": [{"role": "user", "content": " ".join(["word"] * 2100)}]}
    first = asyncio.ensure_future(h.client.post("/v1/chat/completions", json=body))
    await asyncio.sleep(0.05)
    second = await h.client.post("/v1/chat/completions", json=body)
    assert (await first).status_code == 400
    assert second.status_code == 400, second.text
    assert not ollama.generations
