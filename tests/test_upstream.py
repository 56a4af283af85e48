"""Translation of upstream transport errors, with the real aiohttp transport."""

from __future__ import annotations

import socket

import httpx
import pytest

from gateway.errors import UpstreamError, UpstreamTimeout, UpstreamUnavailable
from gateway.upstream import build_client, map_upstream_errors

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
