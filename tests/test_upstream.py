"""Translation of upstream transport errors, with the real aiohttp transport."""

from __future__ import annotations

import asyncio
import socket

import httpx
import pytest

from gateway.backends.upstream import build_client, map_upstream_errors
from gateway.errors import UpstreamError, UpstreamTimeout, UpstreamUnavailable

pytestmark = pytest.mark.anyio


def closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


async def test_refused_connection_is_502_not_504() -> None:
    client = build_client()
    try:
        with pytest.raises(UpstreamUnavailable):
            with map_upstream_errors("b"):
                await client.get(f"http://127.0.0.1:{closed_port()}/", timeout=2)
    finally:
        await client.aclose()


async def test_silent_server_is_a_timeout() -> None:
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen()
        port = server.getsockname()[1]
        client = build_client()
        try:
            with pytest.raises(UpstreamTimeout):
                with map_upstream_errors("b"):
                    await client.get(f"http://127.0.0.1:{port}/", timeout=httpx.Timeout(0.3))
        finally:
            await client.aclose()


@pytest.mark.parametrize("exc,expected", [
    (httpx.ConnectError("x"), UpstreamUnavailable),
    (httpx.ReadTimeout("x"), UpstreamTimeout),
    (httpx.RemoteProtocolError("x"), UpstreamError),
])
def test_plain_httpx_errors(exc: Exception, expected: type) -> None:
    with pytest.raises(expected):
        with map_upstream_errors("b"):
            raise exc


async def test_generation_requests_never_wait_for_a_pooled_connection() -> None:
    """Admission bounds the requests in flight; the pool must not add a hidden queue:
    300 requests held open by the upstream are all in flight at once (the old pool
    limit was 256)."""
    from aiohttp import web

    release = asyncio.Event()
    inside = 0
    peak = 0

    async def handler(request: web.Request) -> web.Response:
        nonlocal inside, peak
        inside += 1
        peak = max(peak, inside)
        await release.wait()
        inside -= 1
        return web.json_response({"ok": True})

    app = web.Application()
    app.router.add_post("/v1/chat/completions", handler)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    client = build_client()
    try:
        calls = [asyncio.ensure_future(client.post(
            f"http://127.0.0.1:{port}/v1/chat/completions", json={}, timeout=30))
            for _ in range(300)]
        for _ in range(500):
            if inside >= 300:
                break
            await asyncio.sleep(0.02)
        assert inside == 300, inside
        release.set()
        assert all(r.status_code == 200 for r in await asyncio.gather(*calls))
    finally:
        await client.aclose()
        await runner.cleanup()
