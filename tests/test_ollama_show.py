"""Review of issue 27 (Ollama: a model's context kept across unloads and read from
``POST /api/show`` before its first load; images charged on every route): what
``/api/show`` may answer besides a good body, names with and without their tag, and
what the charge for images does to the truncation check. Against the fake Ollama
(tests/fake_ollama.py).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

import httpx
import pytest
from prometheus_client import CollectorRegistry

from gateway.config import load_settings
from gateway.http.app import create_app
from tests.conftest import Harness
from tests.fake_ollama import FakeOllama

pytestmark = pytest.mark.anyio
MODEL = "llama3.2:1b"
Show = Callable[[httpx.Request], Awaitable[httpx.Response]]


async def gateway(ollama: FakeOllama, show: Show | None = None, **backend: Any
                  ) -> Harness:
    """A gateway over ``ollama``; ``show``, if given, answers ``/api/show`` instead."""
    async def route(request: httpx.Request) -> httpx.Response:
        if show is not None and request.url.path == "/api/show":
            return await show(request)
        return await ollama.handle(request)

    settings = load_settings(
        admission={"disconnect_grace_s": 0.0},
        backends=[{"name": "ollama", "url": "http://ollama:11434", "kind": "ollama",
                   **backend}])
    app = create_app(settings, http_client=httpx.AsyncClient(
        transport=httpx.MockTransport(route)), registry=CollectorRegistry(),
        discover=False)
    return Harness(app, ollama)  # type: ignore[arg-type]


async def test_an_api_show_that_times_out_leaves_the_backend_ready() -> None:
    # /api/version and /api/ps answer; /api/show does not in time (Ollama reading a
    # large model's file, say). The backend is ready on what /api/ps says, and
    # /api/show is asked again at the next discovery.
    ollama = FakeOllama(loaded=False, parameters={"num_ctx": 2048})
    slow, asked = True, []

    async def show(request: httpx.Request) -> httpx.Response:
        asked.append(request)
        if slow:
            raise httpx.ReadTimeout("timed out", request=request)
        return await ollama.handle(request)

    h = await gateway(ollama, show, model=MODEL)
    backend = h.state.fleet.backends["ollama"]
    await backend.discover()
    assert backend.ready and backend.admission.layout.ctx_per_slot == 4096
    assert (await h.client.get("/ready")).status_code == 200
    slow = False
    await backend.discover()
    assert backend.admission.layout.ctx_per_slot == 2048 and len(asked) == 2
    await backend.discover()
    assert len(asked) == 2  # read once it answered


@pytest.mark.parametrize("answer", [
    {"details": {"family": ["llama"]}, "parameters": "num_ctx 2048"},
    {"details": {"family": {"name": "llama"}}},
    {"details": "llama", "capabilities": "completion", "model_info": ["x"]},
    {"parameters": {"num_ctx": 2048}, "capabilities": [["vision"]]},
    {"model_info": {"general.architecture": {"a": 1}, "llama.context_length": "big"}},
    {"parameters": "num_ctx ²"},
])
async def test_a_malformed_api_show_answer_never_breaks_discovery(answer: Any) -> None:
    ollama = FakeOllama(loaded=False)

    async def show(request: httpx.Request) -> httpx.Response:
        return httpx.Response(200, json=answer)

    h = await gateway(ollama, show, model=MODEL)
    backend = h.state.fleet.backends["ollama"]
    await backend.discover()
    assert backend.ready and backend.admission.layout is not None
    assert 4 <= backend.admission.layout.ctx_per_slot <= 4096


@pytest.mark.parametrize("status, body", [
    (404, {"error": f"model '{MODEL}' not found"}),
    (500, {"error": "something broke"}),
    (200, None),  # not JSON
])
async def test_an_api_show_refused_or_unreadable_leaves_the_defaults(
        status: int, body: Any) -> None:
    ollama = FakeOllama(loaded=False)

    async def show(request: httpx.Request) -> httpx.Response:
        if body is None:
            return httpx.Response(status, text="<html>proxy</html>")
        return httpx.Response(status, json=body)

    h = await gateway(ollama, show, model=MODEL)
    backend = h.state.fleet.backends["ollama"]
    await backend.discover()
    assert backend.ready and backend.admission.layout.ctx_per_slot == 4096


async def test_a_model_configured_without_its_tag_keeps_its_context_across_an_unload(
        ) -> None:
    # Configured as "llama3.2"; Ollama names it "llama3.2:latest" in /api/ps.
    ollama = FakeOllama(model="llama3.2:latest", num_ctx=2048)
    h = await gateway(ollama, model="llama3.2")
    backend = h.state.fleet.backends["ollama"]
    await backend.discover()
    assert backend.admission.layout.ctx_per_slot == 2048
    ollama.loaded = False  # keep_alive passed
    await backend.discover()
    assert backend.admission.layout.ctx_per_slot == 2048


def image_chat(images: int) -> dict[str, Any]:
    parts: list[dict[str, Any]] = [{"type": "text", "text": "What is in these pictures?"}]
    parts += [{"type": "image_url", "image_url": {"url": "data:image/png;base64," + "A" * 80}}
              for _ in range(images)]
    return {"model": MODEL, "messages": [{"role": "user", "content": parts}],
            "max_tokens": 5}


async def test_images_counted_below_their_charge_are_not_taken_for_a_truncation() -> None:
    # The gateway charges 1,600 tokens an image; this Ollama's projector takes 768 (a
    # smaller one takes 256). Its prompt_eval_count is then below half of the charge,
    # but nothing was cut: the truncation check must compare the text, not the images.
    ollama = FakeOllama(num_ctx=8192)
    h = await gateway(ollama)
    await h.state.fleet.backends["ollama"].discover()
    for route, body in (("/v1/chat/completions", image_chat(3)),
                        ("/api/chat", {"model": MODEL, "stream": False, "messages": [{
                            "role": "user", "content": "What is in these pictures?",
                            "images": ["A" * 80] * 3}]})):
        r = await h.client.post(route, json=body)
        assert r.status_code == 200, r.text
    assert h.sample("gateway_suspected_truncations_total") == 0


@pytest.mark.parametrize("part, refusal", [
    ({"type": "input_audio", "input_audio": {"data": "AAAA", "format": "wav"}},
     "invalid message format"),
    ({"type": "image_url", "image_url": {"url": "https://example.com/cat.png"}},
     "image URLs are not currently supported"),
    ({"type": "image_url", "image_url": {"url": "data:image/gif;base64,AAAA"}},
     "invalid image input"),
    ({"type": "image_url"}, "invalid message format"),
])
async def test_a_media_part_ollama_refuses_is_its_400_not_a_failure(
        part: dict[str, Any], refusal: str) -> None:
    # Ollama's /v1 takes base64 images only (openai/openai.go): the gateway charges the
    # part, forwards what fits, and relays Ollama's own 400 in the OpenAI shape; the
    # backend is not taken for failing, and nothing stays reserved.
    ollama = FakeOllama(num_ctx=8192)
    h = await gateway(ollama)
    backend = h.state.fleet.backends["ollama"]
    await backend.discover()
    body = {"model": MODEL, "max_tokens": 5, "messages": [{"role": "user", "content": [
        {"type": "text", "text": "What is this?"}, part]}]}
    r = await h.client.post("/v1/chat/completions", json=body)
    assert r.status_code == 400 and refusal in r.json()["error"]["message"]
    assert r.json()["error"]["type"] == "invalid_request_error"
    assert h.sample("gateway_upstream_errors_total") == 0 and backend.up
    stats = backend.admission.stats()
    assert stats.inflight == 0 and stats.reserved_tokens == 0


# -- a model the configuration does not name (issue 38) -----------------------------------

def _chat(words: int, max_tokens: int = 16) -> dict[str, Any]:
    return {"model": MODEL, "max_tokens": max_tokens,
            "messages": [{"role": "user", "content": " ".join(["word"] * words)}]}


async def test_an_unnamed_model_s_over_long_prompt_is_refused_loaded_or_not() -> None:
    """No ``model`` in the configuration; Ollama loads the model with a context of 2048
    and unloads it 3 s after its last request. Its context was known only while the
    gateway saw it loaded, so after an unload a ~2,100-token prompt was forwarded and
    silently cut. The model a request names gets its context from /api/show (once)
    and keeps it across unloads: the prompt is refused, never forwarded."""
    ollama = FakeOllama(num_ctx=2048, keep_alive_s=3.0, loaded=False)
    h = await gateway(ollama, slots=1)
    backend = h.state.fleet.backends["ollama"]
    await backend.discover()
    assert backend.admission.layout.ctx_per_slot == 4096  # nothing loaded: the default
    r = await h.client.post("/v1/chat/completions", json=_chat(2100))
    assert r.status_code == 400, r.text  # before its first load
    assert r.json()["error"]["code"] == "context_length_exceeded"
    assert r.json()["error"]["n_ctx"] == 2048
    assert not ollama.generations
    assert (await h.client.post("/v1/chat/completions", json=_chat(10))).status_code == 200
    ollama.time += 10  # keep_alive passed: unloaded
    await backend.discover()
    for route, body in (("/v1/chat/completions", _chat(2100)),
                        ("/api/chat", {"model": MODEL, "stream": False, "messages": [
                            {"role": "user", "content": " ".join(["word"] * 2100)}]})):
        r = await h.client.post(route, json=body)
        assert r.status_code == 400, r.text
    assert len(ollama.generations) == 1
    shows = [q for q in ollama.requests if q.url.path == "/api/show"]
    assert len(shows) == 1  # asked once, kept


async def test_an_unnamed_model_s_cap_is_lowered_to_the_room_left() -> None:
    ollama = FakeOllama(num_ctx=2048, loaded=False)
    h = await gateway(ollama, slots=1)
    await h.state.fleet.backends["ollama"].discover()
    r = await h.client.post("/v1/chat/completions", json=_chat(1000, max_tokens=2500))
    assert r.status_code == 200, r.text
    sent = ollama.generations[-1]["max_tokens"]
    assert 0 < sent < 2048 - 1000


async def test_a_model_ollama_does_not_have_is_its_own_404_after_one_show() -> None:
    ollama = FakeOllama(loaded=False)
    h = await gateway(ollama, slots=1)
    await h.state.fleet.backends["ollama"].discover()
    for _ in range(2):
        r = await h.client.post("/v1/chat/completions",
                                json={**_chat(10), "model": "nosuch:7b"})
        assert r.status_code == 404
    assert len([q for q in ollama.requests if q.url.path == "/api/show"]) == 1
