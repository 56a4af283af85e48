"""The build in use, as the build check sees it (issue 41), on the real llama-server:
the survey finds nothing missing, and idle slots' cached cells (``--cache-idle-slots``,
on by default with ``--cache-ram``) never count as used."""

from __future__ import annotations

import asyncio

import httpx
import pytest

from gateway.dev.localbackend import LlamaServer
from gateway.planner.probe import probe
from tests.integration.conftest import GatewayThread, long_prompt

pytestmark = [pytest.mark.llama, pytest.mark.anyio]


def test_the_build_in_use_lacks_nothing_the_gateway_reads(
        default_server: LlamaServer) -> None:
    with GatewayThread({"url": default_server.url}) as gw:
        (row,) = httpx.get(gw.url + "/status.json", timeout=10).json()["backends"]
    assert row["fallbacks"] == [] and row["ready"]
    found = probe(default_server.url)
    assert found["fallbacks"] == [] and found["problem"] is None


async def test_cells_idle_slots_keep_cached_do_not_hold_a_request_that_needs_them(
        default_server: LlamaServer) -> None:
    # Four answers on four slots leave about 1,800 of the pool's 2,048 cells cached in
    # idle slots. llama-server (--cache-idle-slots, its default) saves and clears them
    # when a new task arrives (llama.cpp issue #27361): a gate counting them as used
    # would hold the next request, which needs about 1,550 cells, for ever.
    with GatewayThread({"url": default_server.url}) as gw:
        async with httpx.AsyncClient(timeout=180) as client:
            fill = await asyncio.gather(*(client.post(gw.url + "/v1/chat/completions", json={
                "messages": [{"role": "user", "content": f"{i} " + long_prompt(30)}],
                "max_tokens": 16}) for i in range(4)))
            assert [r.status_code for r in fill] == [200] * 4
            held = sum(r.json()["usage"]["total_tokens"] for r in fill)
            assert held > 1700  # what the idle slots now keep
            big = await client.post(gw.url + "/v1/chat/completions", json={
                "messages": [{"role": "user", "content": "x " + long_prompt(100)}],
                "max_tokens": 100})
        assert big.status_code == 200, big.text
        assert big.json()["usage"]["prompt_tokens"] + 100 > 2048 - held
        assert gw.metric("gateway_upstream_errors_total") == 0
