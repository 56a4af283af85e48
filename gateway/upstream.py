"""The pooled upstream HTTP client and the one place where its errors are translated.

The client has httpx's API over the ``httpx-aiohttp`` transport: httpx's default
transport measured 2–13× slower under concurrency on this machine type (issue #2), while
keeping httpx's API lets tests inject ``httpx.MockTransport``.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from contextlib import contextmanager

import aiohttp
import httpx
from httpx_aiohttp import AiohttpTransport

from gateway.errors import UpstreamError, UpstreamTimeout, UpstreamUnavailable

__all__ = ["build_client", "map_upstream_errors", "upstream_error_kind"]


def build_client(*, max_connections: int = 256) -> httpx.AsyncClient:
    """Return the shared upstream client (aiohttp transport, pooled keep-alive).

    Timeouts are set per request from each backend's settings.
    """
    limits = httpx.Limits(max_connections=max_connections, max_keepalive_connections=64)
    return httpx.AsyncClient(transport=AiohttpTransport(limits=limits), timeout=None)


def _is_timeout(exc: BaseException) -> bool:
    # httpx-aiohttp maps every aiohttp ClientConnectionError (a refused connection too)
    # to httpx.ConnectTimeout, so look at the cause to tell a refusal from a timeout.
    cause = exc.__cause__
    if isinstance(cause, aiohttp.ClientError):
        return isinstance(cause, (aiohttp.ServerTimeoutError, asyncio.TimeoutError))
    return isinstance(exc, httpx.TimeoutException)


def upstream_error_kind(exc: BaseException) -> str:
    """Classify a transport error: ``"timeout"``, ``"connect"`` or ``"other"`` (the
    connection broke after the request was sent)."""
    if _is_timeout(exc):
        return "timeout"
    cause = exc.__cause__
    if isinstance(cause, aiohttp.ClientError):
        return "connect" if isinstance(cause, aiohttp.ClientConnectorError) else "other"
    if isinstance(exc, (httpx.ConnectError, httpx.ConnectTimeout)):
        return "connect"
    return "other"


@contextmanager
def map_upstream_errors(backend: str) -> Iterator[None]:
    """Translate httpx transport errors raised inside the block into gateway errors.

    :raises UpstreamTimeout: the backend did not answer in time (504).
    :raises UpstreamUnavailable: the backend could not be connected to (502).
    :raises UpstreamError: the connection broke before a response arrived (502).
    """
    try:
        yield
    except httpx.TransportError as exc:
        kind = upstream_error_kind(exc)
        if kind == "timeout":
            raise UpstreamTimeout(f"Backend {backend!r} did not answer in time.") from exc
        if kind == "connect":
            raise UpstreamUnavailable(
                f"Backend {backend!r} cannot be reached: {exc or type(exc).__name__}."
            ) from exc
        raise UpstreamError(
            f"The connection to backend {backend!r} failed: {exc or type(exc).__name__}."
        ) from exc
