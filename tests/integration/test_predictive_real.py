"""The predictive policy against the real llama-server (``-c 2048``, default layout: 4
slots sharing 2048 cells).

The model's chat template never lets a chat stop by itself, so short natural answers
come from completions that stop at the end of their first sentence (``"stop": ["."]``:
10 tokens at the median and 20 at p95 over 40 prompts probed here, now and then one that
runs to its cap), as in ``bench/goodput.py``.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

import httpx
import pytest

from gateway.dev.localbackend import LlamaServer
from gateway.wire.naming import served_name
from tests.integration.conftest import GatewayThread, long_prompt

pytestmark = [pytest.mark.llama, pytest.mark.anyio]

SHORT = ["My first visit to the mountain", "My first visit to the forest",
         "My first visit to the school", "My first visit to the market",
         "My first visit to the castle", "My first visit to the harbour",
         "My first visit to the museum", "My first visit to the factory"]
# The median of four answers: one of them may run to its cap.
PREDICTIVE = {"policy": "predictive", "predict_min_history": 4, "predict_quantile": 0.5}


def short(prompt: str) -> dict[str, Any]:
    return {"prompt": prompt, "max_tokens": 1024, "temperature": 0, "stop": ["."]}


async def warm(client: httpx.AsyncClient, url: str) -> None:
    """Serve four short answers, so that the gateway predicts from them."""
    for prompt in SHORT[:4]:
        r = await client.post(url + "/v1/completions", json=short(prompt))
        assert r.status_code == 200, r.text


def events(text: str) -> tuple[list[dict[str, Any]], int]:
    """The JSON events of an SSE body and its count of [DONE]."""
    objs, done = [], 0
    for block in text.split("\n\n"):
        if block.startswith("data: "):
            if block[6:] == "[DONE]":
                done += 1
            else:
                objs.append(json.loads(block[6:]))
    return objs, done


async def test_short_answers_under_generous_caps_run_together(
        default_server: LlamaServer) -> None:
    with GatewayThread({"url": default_server.url}, PREDICTIVE) as gw:
        async with httpx.AsyncClient(timeout=300) as client:
            await warm(client, gw.url)
            busy: list[int] = []

            async def watch() -> None:
                while True:
                    slots = (await client.get(default_server.url + "/slots")).json()
                    busy.append(sum(1 for s in slots if s["is_processing"]))
                    await asyncio.sleep(0.1)

            watcher = asyncio.ensure_future(watch())
            try:
                results = await asyncio.gather(*(client.post(
                    gw.url + "/v1/completions", json={**short(p), "stream": True})
                    for p in SHORT))
            finally:
                watcher.cancel()
                await asyncio.gather(watcher, return_exceptions=True)
        for r in results:
            objs, done = events(r.text)
            assert r.status_code == 200 and done == 1
            assert not any("error" in o for o in objs)
        assert max(busy) >= 2  # strict charges 1024 + prompt each: one at a time
        assert gw.metric("gateway_upstream_errors_total", backend="local",
                         kind="context_overflow") == 0


async def test_an_overflowing_workload_is_rescued_by_preemption(
        default_server: LlamaServer) -> None:
    """The seed scenario under predictive: after short answers the gateway predicts a
    short answer for three ~790-token prompts that each run to 900 tokens, lets two in,
    and must preempt one before the pool overflows. Every answer arrives whole: the
    streams in one stream with one [DONE], the whole answer well-formed."""
    prompt = long_prompt(55)  # ~790 tokens with the template
    with GatewayThread({"url": default_server.url}, PREDICTIVE) as gw:
        async with httpx.AsyncClient(timeout=600) as client:
            await warm(client, gw.url)

            def chat(i: int, stream: bool) -> Any:
                return client.post(gw.url + "/v1/chat/completions", json={
                    "messages": [{"role": "user", "content": f"Story {i}. {prompt}"}],
                    "max_tokens": 900, "temperature": 0, "stream": stream,
                    **({"stream_options": {"include_usage": True}} if stream else {})})

            results = await asyncio.gather(chat(0, True), chat(1, True), chat(2, False))
        for r in results[:2]:
            assert r.status_code == 200, r.text
            objs, done = events(r.text)
            assert done == 1 and not any("error" in o for o in objs)
            assert len({o["id"] for o in objs}) == 1
            assert sum(1 for o in objs if (o.get("choices") or [{}])[0].get(
                "delta", {}).get("role")) == 1
            usage = [o["usage"] for o in objs if o.get("usage")]
            assert usage[-1]["completion_tokens"] == 900
            assert usage[-1]["prompt_tokens"] == int(r.headers["x-gateway-prompt-tokens"])
        whole = results[2]
        assert whole.status_code == 200, whole.text
        answer = whole.json()
        assert answer["object"] == "chat.completion"
        assert answer["choices"][0]["finish_reason"] == "length"
        assert answer["choices"][0]["message"]["content"]
        assert answer["usage"]["completion_tokens"] == 900
        preempted = gw.metric("gateway_preemptions_total", backend="local",
                              reason="pool_pressure") + gw.metric(
            "gateway_preemptions_total", backend="local", reason="overflow")
        assert preempted >= 1
        assert gw.metric("gateway_resumes_total", backend="local", outcome="failed") == 0


async def test_a_whole_answer_rebuilt_from_the_stream_matches_llama_server(
        default_server: LlamaServer) -> None:
    """Under predictive a whole answer is streamed upstream and rebuilt: field by field
    it is what llama-server sends for the same request (greedy, so the text is equal)."""
    body = {"prompt": SHORT[0], "max_tokens": 64, "temperature": 0, "stop": ["."]}
    chat = {"messages": [{"role": "user", "content": "Say hello."}], "max_tokens": 12,
            "temperature": 0}
    with GatewayThread({"url": default_server.url}, PREDICTIVE) as gw:
        async with httpx.AsyncClient(timeout=120) as client:
            for path, sent in (("/v1/completions", body), ("/v1/chat/completions", chat)):
                direct = (await client.post(default_server.url + path, json=sent)).json()
                rebuilt = (await client.post(gw.url + path, json=sent)).json()
                assert list(rebuilt) == list(direct)  # the same keys in the same order
                for key in ("object", "system_fingerprint"):
                    assert rebuilt[key] == direct[key]
                # the model file's path, named by its file name (routing.answer_model)
                assert rebuilt["model"] == served_name(direct["model"]) != direct["model"]
                assert rebuilt["choices"] == direct["choices"]
                for key in ("prompt_tokens", "completion_tokens", "total_tokens"):
                    assert rebuilt["usage"][key] == direct["usage"][key]
                assert set(rebuilt["timings"]) == set(direct["timings"])
                assert rebuilt["id"].startswith("chatcmpl-")
