"""Two real llama-servers with different layouts behind one gateway (issue 9): an
overload that would overflow either alone is served with no upstream 500 on both; and
killing one mid-run loses only the requests that had already streamed from it."""

from __future__ import annotations

import asyncio
import json
import threading
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from gateway.dev.localbackend import LlamaServer
from tests.integration.conftest import GatewayThread, long_prompt

pytestmark = [pytest.mark.llama]

# A: 4 slots sharing 2048 cells (llama-server's default layout); B: 2 slots sharing 3072.
# One thread each: two servers of two threads on two cores would spin against each other.
LAYOUT_A = ["-c", "2048", "-t", "1"]
LAYOUT_B = ["-c", "3072", "-np", "2", "--kv-unified", "-t", "1"]
CHAT = "/v1/chat/completions"


@pytest.fixture
def servers(llama_parts: tuple[Any, Any]) -> Iterator[tuple[LlamaServer, LlamaServer]]:
    binary, model = llama_parts
    a = LlamaServer(LAYOUT_A, binary=binary, model=model)
    b = LlamaServer(LAYOUT_B, binary=binary, model=model)
    with a.running(), b.running():
        yield a, b


def fleet(a: LlamaServer, b: LlamaServer) -> GatewayThread:
    return GatewayThread([{"name": "a", "url": a.url, "model": "gemma"},
                          {"name": "b", "url": b.url, "model": "gemma"}])


def bodies(count: int, *, stream: bool) -> list[dict[str, Any]]:
    # ~400 prompt tokens + 100 output: 8 of them need ~4,000 cells, more than either pool.
    return [{"model": "gemma", "stream": stream, "max_tokens": 100, "temperature": 0,
             "messages": [{"role": "user", "content": f"Story {i}. " + long_prompt(40)}]}
            for i in range(count)]


@pytest.mark.timeout(900)
def test_an_overload_either_alone_would_overflow_is_served_by_both(
        servers: tuple[LlamaServer, LlamaServer]) -> None:
    a, b = servers
    with fleet(a, b) as gw:
        async def run() -> list[httpx.Response]:
            async with httpx.AsyncClient(timeout=600) as client:
                return await asyncio.gather(*(client.post(gw.url + CHAT, json=body)
                                              for body in bodies(8, stream=False)))

        answers = asyncio.run(run())
        assert [r.status_code for r in answers] == [200] * 8, [r.text for r in answers]
        assert all(r.json()["usage"]["completion_tokens"] > 0 for r in answers)
        used = {name: gw.metric("gateway_route_decisions_total", model="gemma",
                                backend=name, reason="fit")
                + gw.metric("gateway_route_decisions_total", model="gemma", backend=name,
                            reason="queued") for name in ("a", "b")}
        assert used["a"] > 0 and used["b"] > 0, used
        for name in ("a", "b"):
            assert gw.metric("gateway_upstream_errors_total", backend=name,
                             kind="context_overflow") == 0
            assert gw.metric("gateway_upstream_errors_total", backend=name,
                             kind="status_5xx") == 0
    for server in servers:
        assert "exceeded" not in server.log().lower()


@pytest.mark.timeout(900)
def test_killing_one_loses_only_what_had_streamed_from_it(
        servers: tuple[LlamaServer, LlamaServer]) -> None:
    a, b = servers
    with fleet(a, b) as gw:
        results: list[dict[str, Any]] = []

        async def one(client: httpx.AsyncClient, body: dict[str, Any]) -> None:
            events, error = 0, None
            async with client.stream("POST", gw.url + CHAT, json=body) as resp:
                status = resp.status_code
                async for line in resp.aiter_lines():
                    if not line.startswith("data: {"):
                        continue
                    event = json.loads(line[6:])
                    if "error" in event:
                        error = event["error"]
                    else:
                        events += 1
            results.append({"status": status, "events": events, "error": error})

        async def run() -> None:
            async with httpx.AsyncClient(timeout=600) as client:
                await asyncio.gather(*(one(client, body) for body in bodies(8, stream=True)))

        def kill_a_once_it_streams() -> None:
            deadline = time.monotonic() + 300
            while time.monotonic() < deadline:
                if gw.metric("gateway_inflight_requests", backend="a") > 0 and \
                        gw.metric("gateway_ttft_seconds_count", backend="a") > 0:
                    break
                time.sleep(0.2)
            assert a.proc is not None
            a.proc.kill()

        killer = threading.Thread(target=kill_a_once_it_streams)
        killer.start()
        asyncio.run(run())
        killer.join()
        failed = [r for r in results if r["error"] is not None or r["status"] != 200]
        served = [r for r in results if r not in failed]
        assert len(results) == 8
        assert failed, "the kill came after every request had ended"
        # Only requests that had streamed from a may fail: each failure had events
        # relayed before its final error event.
        assert all(r["status"] == 200 and r["events"] > 0 for r in failed), failed
        assert all(r["events"] > 0 for r in served)
        # Afterwards the survivor takes everything.
        r = httpx.post(gw.url + CHAT, json=bodies(1, stream=False)[0], timeout=600)
        assert r.status_code == 200, r.text
        assert gw.metric("gateway_upstream_errors_total", backend="b",
                         kind="context_overflow") == 0
