"""Answers name the served model, never the backend's model file (routing.answer_model):
through the gateway in process, on an upstream that writes its ``-m`` path into every
answer's ``model`` as llama-server does (the shapes measured on the build in use, cut to
the members that matter), on every generation route, whole and streamed, plain and
followed token by token."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any

import httpx
import pytest
from prometheus_client import CollectorRegistry

from gateway.config import load_settings
from gateway.http.app import create_app

pytestmark = pytest.mark.anyio

PATH = "/home/someone/models/gemma-3-270m-q4_k_m.gguf"
SERVED = "gemma-3-270m-q4_k_m"  # its file name, without .gguf


def _sse(*objs: Any, done: bool = True, events: list[str] | None = None) -> bytes:
    out = b""
    for i, obj in enumerate(objs):
        head = f"event: {events[i]}\n".encode() if events else b""
        out += head + b"data: " + json.dumps(obj, separators=(",", ":")).encode() + b"\n\n"
    return out + (b"data: [DONE]\n\n" if done else b"")


def _chat(stream: bool) -> bytes | dict[str, Any]:
    usage = {"completion_tokens": 2, "prompt_tokens": 5, "total_tokens": 7}
    if not stream:
        return {"choices": [{"finish_reason": "length", "index": 0, "message": {
            "role": "assistant", "content": "hi"}}], "created": 1, "model": PATH,
            "object": "chat.completion", "usage": usage, "id": "chatcmpl-1"}
    chunk = {"created": 1, "id": "chatcmpl-1", "model": PATH,
             "object": "chat.completion.chunk"}
    return _sse({"choices": [{"index": 0, "delta": {"role": "assistant", "content": None}}],
                 **chunk},
                {"choices": [{"index": 0, "delta": {"content": "h"}}], **chunk},
                {"choices": [{"index": 0, "delta": {"content": "i"}}], **chunk},
                {"choices": [{"finish_reason": "length", "index": 0, "delta": {}}], **chunk},
                {"choices": [], **chunk, "usage": usage})


def _completions(stream: bool) -> bytes | dict[str, Any]:
    usage = {"completion_tokens": 2, "prompt_tokens": 2, "total_tokens": 4}
    base = {"created": 1, "model": PATH, "object": "text_completion", "id": "cmpl-1"}
    if not stream:
        return {"choices": [{"text": "hi", "index": 0, "finish_reason": "length"}],
                **base, "usage": usage}
    return _sse({"choices": [{"text": "h", "index": 0, "finish_reason": None}], **base},
                {"choices": [{"text": "i", "index": 0, "finish_reason": "length"}], **base,
                 "usage": usage})


def _native(stream: bool) -> bytes | dict[str, Any]:
    last = {"index": 0, "content": "" if stream else "hi", "stop": True, "model": PATH,
            "tokens_predicted": 2, "tokens_evaluated": 2}
    if not stream:
        return last
    return _sse({"index": 0, "content": "h", "stop": False}, last, done=False)


def _responses(stream: bool) -> bytes | dict[str, Any]:
    whole = {"id": "resp_1", "model": PATH, "object": "response", "status": "completed",
             "output": [{"type": "message", "content": [{"type": "output_text",
                                                          "text": "hi"}]}],
             "usage": {"input_tokens": 5, "output_tokens": 2, "total_tokens": 7}}
    if not stream:
        return whole
    return _sse({"type": "response.created", "response": {"id": "resp_1",
                                                          "status": "in_progress"}},
                {"type": "response.output_text.delta", "item_id": "m", "delta": "hi"},
                {"type": "response.completed", "response": whole}, done=False,
                events=["response.created", "response.output_text.delta",
                        "response.completed"])


def _messages(stream: bool) -> bytes | dict[str, Any]:
    if not stream:
        return {"id": "m", "type": "message", "role": "assistant", "model": PATH,
                "content": [{"type": "text", "text": "hi"}], "stop_reason": "max_tokens",
                "usage": {"input_tokens": 5, "output_tokens": 2}}
    return _sse({"type": "message_start", "message": {
                    "id": "m", "type": "message", "role": "assistant", "content": [],
                    "model": PATH, "usage": {"input_tokens": 5, "output_tokens": 0}}},
                {"type": "content_block_delta", "index": 0,
                 "delta": {"type": "text_delta", "text": "hi"}},
                {"type": "message_delta", "delta": {"stop_reason": "max_tokens"},
                 "usage": {"output_tokens": 2}},
                {"type": "message_stop"}, done=False,
                events=["message_start", "content_block_delta", "message_delta",
                        "message_stop"])


def _embeddings(stream: bool) -> dict[str, Any]:
    return {"model": PATH, "object": "list", "data": [
        {"embedding": [0.1, 0.2], "index": 0, "object": "embedding"}],
        "usage": {"prompt_tokens": 2, "total_tokens": 2}}


ANSWERS = {"/v1/chat/completions": _chat, "/v1/completions": _completions,
           "/completion": _native, "/v1/responses": _responses, "/v1/messages": _messages,
           "/v1/embeddings": _embeddings}


class _Events(httpx.AsyncByteStream):
    """A stream written event by event, as llama-server writes one per token."""

    def __init__(self, raw: bytes) -> None:
        self.events = [e + b"\n\n" for e in raw.split(b"\n\n") if e]

    async def __aiter__(self) -> AsyncIterator[bytes]:
        for event in self.events:
            yield event


async def upstream(request: httpx.Request) -> httpx.Response:
    """llama-server, as far as these tests need it, with its model file's path in every
    answer."""
    path = request.url.path
    if path == "/props":
        return httpx.Response(200, json={"total_slots": 4, "model_path": PATH,
                                         "default_generation_settings": {"n_ctx": 2048}})
    if path == "/v1/models":
        return httpx.Response(200, json={"object": "list", "data": [
            {"id": PATH, "meta": {"n_vocab": 1000}}]})
    if path == "/slots":
        return httpx.Response(200, json=[{"id": i, "n_ctx": 2048, "is_processing": False}
                                         for i in range(4)])
    if path.endswith(("/input_tokens", "/count_tokens")):
        return httpx.Response(200, json={"input_tokens": 5})
    if path == "/tokenize":
        return httpx.Response(200, json={"tokens": [1, 2, 3]})
    body = json.loads(request.content)
    answer = ANSWERS[path](bool(body.get("stream")))
    if isinstance(answer, bytes):
        return httpx.Response(200, stream=_Events(answer),
                              headers={"content-type": "text/event-stream"})
    return httpx.Response(200, json=answer)


async def gateway(**routing: Any) -> tuple[httpx.AsyncClient, Any]:
    policy = routing.pop("policy", "strict")
    settings = load_settings(
        admission={"disconnect_grace_s": 0.0, "policy": policy}, routing=routing,
        backends=[{"name": "local", "url": "http://llama:8080", "survey": False}])
    app = create_app(settings, http_client=httpx.AsyncClient(
        transport=httpx.MockTransport(upstream)), registry=CollectorRegistry(),
        discover=False)
    await app.state.gateway.fleet.backends["local"].discover()
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=app),
                             base_url="http://gateway"), app


BODIES = {
    "/v1/chat/completions": {"messages": [{"role": "user", "content": "hi"}],
                             "max_tokens": 4},
    "/v1/completions": {"prompt": "hi", "max_tokens": 4},
    "/completion": {"prompt": "hi", "n_predict": 4},
    "/v1/responses": {"input": "hi", "max_output_tokens": 4},
    "/v1/messages": {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4},
    "/v1/embeddings": {"input": "hi"},
}
CASES = [(path, stream) for path in BODIES for stream in (False, True)
         if not (stream and path == "/v1/embeddings")]


def models_in(text: str) -> list[Any]:
    """Every value of a "model" member in a whole JSON answer or in an SSE stream."""
    found: list[Any] = []

    def walk(value: Any) -> None:
        if isinstance(value, dict):
            for key, item in value.items():
                if key == "model":
                    found.append(item)
                walk(item)
        elif isinstance(value, list):
            for item in value:
                walk(item)

    if text.lstrip().startswith("{"):
        walk(json.loads(text))
    for line in text.splitlines():
        if line.startswith("data: {"):
            walk(json.loads(line[6:]))
    return found


@pytest.mark.parametrize("path,stream", CASES,
                         ids=[f"{p}{' stream' if s else ''}" for p, s in CASES])
async def test_every_answer_names_the_model_asked_for_else_the_served_one(
        path: str, stream: bool) -> None:
    client, _ = await gateway()
    async with client:
        for asked, expected in ((None, SERVED), ("my-gemma", "my-gemma")):
            body = {**BODIES[path], **({"stream": True} if stream else {})}
            if asked is not None:
                body["model"] = asked
            r = await client.post(path, json=body)
            assert r.status_code == 200, r.text
            models = models_in(r.text)
            assert models and set(models) == {expected}, (path, r.text)
            assert PATH not in r.text


@pytest.mark.parametrize("stream", [False, True])
async def test_a_followed_answer_names_the_served_model(stream: bool) -> None:
    # admission.policy = "predictive" follows a chat token by token
    # (gateway/relay/follow.py), rebuilding a whole answer from the stream.
    client, app = await gateway(policy="predictive")
    async with client:
        r = await client.post("/v1/chat/completions",
                              json={**BODIES["/v1/chat/completions"], "stream": stream})
        assert r.status_code == 200, r.text
        assert set(models_in(r.text)) == {SERVED} and PATH not in r.text
    assert app.state.gateway.fleet.backends["local"].predictive


async def test_answer_model_backend_keeps_the_backends_own_value() -> None:
    client, _ = await gateway(answer_model="backend")
    async with client:
        for stream in (False, True):
            r = await client.post("/v1/chat/completions", json={
                **BODIES["/v1/chat/completions"], "model": "my-gemma", "stream": stream})
            assert set(models_in(r.text)) == {PATH}


@pytest.mark.parametrize("answer_model", ["served", "backend"])
async def test_the_model_list_names_a_path_by_its_file_name(answer_model: str) -> None:
    client, app = await gateway(answer_model=answer_model)
    async with client:
        listed = (await client.get("/v1/models")).json()["data"]
    expected = SERVED if answer_model == "served" else PATH
    assert [m["id"] for m in listed] == [expected] and listed[0]["meta"]["n_vocab"] == 1000
    # The name the list and the answers give reaches the backend, as its path does.
    assert {SERVED, PATH} <= app.state.gateway.fleet.backends["local"].model_names


async def test_a_huge_model_name_is_not_copied_into_every_event() -> None:
    # A 100 KB name repeated in each chunk would turn one request into 100 KB x chunks.
    client, _ = await gateway()
    async with client:
        for stream in (False, True):
            r = await client.post("/v1/chat/completions", json={
                **BODIES["/v1/chat/completions"], "model": "x" * 100_000, "stream": stream})
            assert r.status_code == 200, r.text[:300]
            assert set(models_in(r.text)) == {SERVED} and len(r.content) < 10_000
        r = await client.post("/v1/chat/completions", json={
            **BODIES["/v1/chat/completions"], "model": "y" * 256})
        assert set(models_in(r.text)) == {"y" * 256}  # up to the bound, echoed


async def test_an_event_that_is_not_json_does_not_hide_the_next_ones_model() -> None:
    # An event that is not JSON (a stray bracket and quote), then chunks, in one read.
    chunk = {"choices": [{"index": 0, "delta": {"content": "h"}}], "created": 1,
             "id": "c", "model": PATH, "object": "chat.completion.chunk"}
    last = {**chunk, "choices": [{"index": 0, "delta": {}, "finish_reason": "length"}],
            "usage": {"completion_tokens": 1, "prompt_tokens": 5, "total_tokens": 6}}
    raw = (b'data: [{"oops\n\n' + b"data: " + json.dumps(chunk).encode() + b"\n\n"
           + b"data: " + json.dumps(last).encode() + b"\n\ndata: [DONE]\n\n")

    async def one_read(request: httpx.Request) -> httpx.Response:
        if request.url.path == "/v1/chat/completions":
            events = _Events(b"")
            events.events = [raw]  # every event in one read
            return httpx.Response(200, stream=events,
                                  headers={"content-type": "text/event-stream"})
        return await upstream(request)

    settings = load_settings(admission={"disconnect_grace_s": 0.0},
                             backends=[{"name": "local", "url": "http://llama:8080", "survey": False}])
    app = create_app(settings, http_client=httpx.AsyncClient(
        transport=httpx.MockTransport(one_read)), registry=CollectorRegistry(),
        discover=False)
    await app.state.gateway.fleet.backends["local"].discover()
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app),
                                 base_url="http://gateway") as client:
        r = await client.post("/v1/chat/completions",
                              json={**BODIES["/v1/chat/completions"], "stream": True})
    assert r.status_code == 200, r.text
    assert PATH not in r.text and set(models_in(r.text)) == {SERVED}
