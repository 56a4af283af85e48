"""The gateway in front of a real llama-server running Gemma 3 270M Q4_K_M."""

from __future__ import annotations

import asyncio
import json
import time
from typing import Any

import httpx
import pytest

from gateway.dev.localbackend import LlamaServer
from tests.integration.conftest import GatewayThread, gather_chats, long_prompt

pytestmark = [pytest.mark.llama, pytest.mark.anyio]

OVERFLOW_PROMPT = long_prompt(55)  # about 790 tokens with Gemma 3's chat template


def overflow_chat(max_tokens: int = 900) -> dict[str, Any]:
    return {"messages": [{"role": "user", "content": OVERFLOW_PROMPT}],
            "max_tokens": max_tokens, "ignore_eos": True}


def backend_metric(server: LlamaServer, name: str) -> float:
    for line in httpx.get(server.url + "/metrics", timeout=5).text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[1])
    raise AssertionError(f"{name} not in llama-server /metrics")


async def test_shared_pool_overflow_fails_direct_and_succeeds_through_gateway(
    default_server: LlamaServer,
) -> None:
    # Straight to llama-server: three chats that each fit alone overflow the shared pool.
    direct = await gather_chats(default_server.url, [overflow_chat() for _ in range(3)])
    statuses = [r.status_code for r in direct]
    assert 500 in statuses, statuses
    assert any("Context size has been exceeded" in r.text for r in direct if r.status_code == 500)

    with GatewayThread({"url": default_server.url}) as gw:
        through = await gather_chats(gw.url, [overflow_chat() for _ in range(3)])
        assert [r.status_code for r in through] == [200, 200, 200]
        assert [r.json()["usage"]["completion_tokens"] for r in through] == [900, 900, 900]
        assert gw.metric("gateway_upstream_errors_total", kind="context_overflow") == 0
        assert gw.metric("gateway_upstream_errors_total", kind="status_5xx") == 0
        assert gw.metric("gateway_kv_reserved_tokens") == 0


async def test_prompt_longer_than_a_slot_is_rejected_before_generation(
    default_server: LlamaServer,
) -> None:
    with GatewayThread({"url": default_server.url}) as gw:
        # (read once the gateway is up: its calibration at discovery has prompt tokens)
        before = backend_metric(default_server, "llamacpp:prompt_tokens_total")
        r = httpx.post(gw.url + "/v1/chat/completions", timeout=30, json={
            "messages": [{"role": "user", "content": long_prompt(200)}], "max_tokens": 10})
        assert r.status_code == 400
        err = r.json()["error"]
        assert err["code"] == "context_length_exceeded" and "2048" in err["message"]
    assert backend_metric(default_server, "llamacpp:prompt_tokens_total") == before


@pytest.mark.parametrize("kind,body", [
    ("completion", {"prompt": "The capital of France is", "max_tokens": 4}),
    ("single chat", {"messages": [{"role": "user", "content": "Name a colour."}],
                     "max_tokens": 4}),
    ("system + multi", {"messages": [
        {"role": "system", "content": "You answer in one word."},
        {"role": "user", "content": "Name a fruit."},
        {"role": "assistant", "content": "Apple."},
        {"role": "user", "content": "Another one?"}], "max_tokens": 4}),
    ("non-English", {"messages": [{"role": "user",
                                   "content": "Grüße aus Köln! 東京の天気はどうですか？ Привет, мир."}],
                     "max_tokens": 4}),
])
def test_gateway_count_equals_backend_usage(
    default_server: LlamaServer, kind: str, body: dict[str, Any]
) -> None:
    path = "/v1/completions" if "prompt" in body else "/v1/chat/completions"
    with GatewayThread({"url": default_server.url}) as gw:
        r = httpx.post(gw.url + path, json=body, timeout=60)
        assert r.status_code == 200, r.text
        assert int(r.headers["x-gateway-prompt-tokens"]) == r.json()["usage"]["prompt_tokens"], kind
        # The same prompt sampled otherwise: its count is the one kept, and still exact.
        r = httpx.post(gw.url + path, json={**body, "max_tokens": 3, "temperature": 0.5},
                       timeout=60)
        assert r.status_code == 200, r.text
        assert int(r.headers["x-gateway-prompt-tokens"]) == r.json()["usage"]["prompt_tokens"], kind
        assert gw.metric("gateway_token_count_source_total", source="cache") == 1
        assert gw.metric("gateway_token_count_source_total", source="backend") == 1


async def test_stream_arrives_event_by_event_with_usage_and_done(
    default_server: LlamaServer,
) -> None:
    with GatewayThread({"url": default_server.url}) as gw:
        body = {"messages": [{"role": "user", "content": "Tell a story."}], "max_tokens": 60,
                "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
        arrivals: list[tuple[float, str]] = []
        async with httpx.AsyncClient(timeout=60) as client:
            async with client.stream("POST", gw.url + "/v1/chat/completions", json=body) as r:
                assert r.status_code == 200
                assert r.headers["x-accel-buffering"] == "no"
                async for line in r.aiter_lines():
                    if line.startswith("data: "):
                        arrivals.append((time.monotonic(), line[6:]))
        assert arrivals[-1][1] == "[DONE]"
        usage_chunk = json.loads(arrivals[-2][1])
        assert usage_chunk["choices"] == [] and usage_chunk["usage"]["completion_tokens"] == 60
        # Spread over the decode (60 tokens at tens of tokens/s), not one burst at the end.
        assert arrivals[-1][0] - arrivals[0][0] > 0.2
        distinct = {round(t, 2) for t, _ in arrivals}
        assert len(distinct) > 10
        assert gw.metric("gateway_ttft_seconds_count") == 1
        assert gw.metric("gateway_itl_seconds_count") >= 50


async def test_client_disconnect_frees_the_slot(default_server: LlamaServer) -> None:
    with GatewayThread({"url": default_server.url}) as gw:
        body = {"messages": [{"role": "user", "content": "Write a long essay."}],
                "max_tokens": 1500, "ignore_eos": True, "stream": True}
        async with httpx.AsyncClient(timeout=60) as client:
            async with client.stream("POST", gw.url + "/v1/chat/completions", json=body) as r:
                seen = 0
                async for line in r.aiter_lines():
                    seen += line.startswith("data: ")
                    if seen >= 5:
                        break
                assert gw.metric("gateway_kv_reserved_tokens") > 0
        left = time.monotonic()
        while time.monotonic() - left < 2.0:
            slots = httpx.get(default_server.url + "/slots", timeout=5).json()
            if not any(s["is_processing"] for s in slots):
                break
            await asyncio.sleep(0.05)
        assert not any(s["is_processing"] for s in slots), "slot still busy 2 s after disconnect"
        # The reservation is held until /slots shows the slot free, then released.
        for _ in range(80):
            if gw.metric("gateway_kv_reserved_tokens") == 0:
                break
            await asyncio.sleep(0.05)
        assert gw.metric("gateway_kv_reserved_tokens") == 0


def test_discovery_reads_layout_from_the_backend(default_server: LlamaServer) -> None:
    with GatewayThread({"url": default_server.url}) as gw:
        ready = httpx.get(gw.url + "/ready", timeout=5).json()["backends"]["local"]
        assert (ready["slots"], ready["ctx_per_slot"], ready["capacity_tokens"]) == (4, 2048, 2048)
        assert gw.metric("gateway_slots") == 4
        # Admission uses the discovered slot: 1000 prompt-ish + 1500 cap cannot fit 2048.
        r = httpx.post(gw.url + "/v1/chat/completions", timeout=30, json={
            "messages": [{"role": "user", "content": long_prompt(40)}], "max_tokens": 1500})
        assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded"


async def test_per_slot_layout_runs_three_together_and_queues_the_fourth(
    llama_parts: tuple[Any, Any],
) -> None:
    binary, model = llama_parts
    server = LlamaServer(["-c", "6144", "-np", "3", "--no-kv-unified"], binary=binary,
                         model=model)
    with server.running(), GatewayThread({"url": server.url, "kv_unified": False}) as gw:
        ready = httpx.get(gw.url + "/ready", timeout=5).json()["backends"]["local"]
        assert (ready["slots"], ready["ctx_per_slot"], ready["capacity_tokens"]) == (3, 2048, 6144)
        bodies = [overflow_chat(max_tokens=250) for _ in range(4)]
        task = asyncio.ensure_future(gather_chats(gw.url, bodies))
        max_busy = max_queued = 0
        while not task.done():
            slots = httpx.get(server.url + "/slots", timeout=5).json()
            max_busy = max(max_busy, sum(s["is_processing"] for s in slots))
            max_queued = max(max_queued, gw.metric("gateway_queue_depth"))
            await asyncio.sleep(0.1)
        results = task.result()
        assert [r.status_code for r in results] == [200] * 4
        assert max_busy == 3, max_busy  # the three ran together ...
        assert max_queued >= 1  # ... and the fourth waited in the gateway
        assert gw.metric("gateway_upstream_errors_total", kind="status_5xx") == 0


def test_llama_server_dies_with_its_parent(llama_parts: tuple[Any, Any]) -> None:
    import os
    import signal
    import subprocess
    import sys

    binary, model = llama_parts
    code = (
        "import sys, time\n"
        "from gateway.dev.localbackend import LlamaServer\n"
        f"s = LlamaServer(['-c', '512'], binary={str(binary)!r}, model={str(model)!r}).start()\n"
        "print(s.proc.pid, flush=True)\n"
        "time.sleep(120)\n"
    )
    parent = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    assert parent.stdout is not None
    child = int(parent.stdout.readline())
    os.kill(parent.pid, signal.SIGKILL)  # no chance to clean up
    parent.wait()
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        try:
            os.kill(child, 0)
        except ProcessLookupError:
            break
        try:
            os.waitpid(child, os.WNOHANG)
        except ChildProcessError:
            pass
        time.sleep(0.1)
    else:
        os.kill(child, signal.SIGKILL)
        raise AssertionError("llama-server outlived its parent")


async def test_abandoned_request_keeps_its_reservation_until_the_slot_is_free(
    default_server: LlamaServer,
) -> None:
    # A client gives up on a long non-streamed chat while another waits for the pool.
    # llama-server notices the closed connection only at its next poll (about 1 s), so
    # releasing the reservation at once let the waiting one overflow the shared pool.
    big = {"messages": [{"role": "user", "content": long_prompt(100)}], "max_tokens": 400,
           "ignore_eos": True}
    with GatewayThread({"url": default_server.url}) as gw:
        async with httpx.AsyncClient(timeout=300) as patient:
            async with httpx.AsyncClient(timeout=2.5) as impatient:
                first = asyncio.ensure_future(
                    impatient.post(gw.url + "/v1/chat/completions", json=big))
                await asyncio.sleep(0.3)
                second = asyncio.ensure_future(
                    patient.post(gw.url + "/v1/chat/completions", json=big))
                with pytest.raises(httpx.TimeoutException):
                    await first
                r = await second
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["completion_tokens"] == 400
        assert gw.metric("gateway_upstream_errors_total", kind="context_overflow") == 0
