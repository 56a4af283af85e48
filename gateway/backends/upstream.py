"""The pooled upstream HTTP client and the one place where its errors are translated.

The client has httpx's API over the ``httpx-aiohttp`` transport: httpx's default
transport measured 2–13× slower under concurrency on this machine type (issue #2), while
keeping httpx's API lets tests inject ``httpx.MockTransport``.

**Connection reuse.** A server closes a keep-alive connection after it has been idle for
a while (llama-server: 5 s, cpp-httplib's ``CPPHTTPLIB_KEEPALIVE_TIMEOUT_SECOND``). A
request written onto a pooled connection the server is closing at that moment gets no
answer at all. So the pool drops idle connections sooner than the server does
(``backends[].keepalive_expiry_s``), and a request whose *reused* connection fails before
any response arrives, and at once (within :data:`RETRY_WINDOW_S` of being sent), is sent
once more on a new connection: a server closing an idle connection drops the request
unread (RFC 9112 §9.3.1 on retrying requests), while a connection that breaks later may
have carried a request the server was working on, which is never sent twice.
"""

from __future__ import annotations

import asyncio
import functools
import json
import logging
import time
import weakref
from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from http.cookiejar import CookieJar, DefaultCookiePolicy
from typing import Any

import aiohttp
import httpx
import orjson
from httpx_aiohttp import AiohttpTransport

from gateway.errors import UpstreamError, UpstreamKind, UpstreamTimeout, UpstreamUnavailable

__all__ = ["ReuseRetry", "build_client", "json_bytes", "map_upstream_errors",
           "send_upstream", "upstream_error_kind", "upstream_request"]

log = logging.getLogger(__name__)

RETRY_WINDOW_S = 0.5  # a reused connection closed sooner than this after the send

# Set by ReuseRetry around one request; the connector marks it when the request went
# out on a pooled connection.
_reused: ContextVar[list[bool] | None] = ContextVar("gateway_upstream_reused", default=None)


class _MarkingConnector(aiohttp.TCPConnector):
    """A TCP connector that notes, for :class:`ReuseRetry`, a request that goes out on a
    connection an earlier request used: the same protocol object comes back from the
    pool. (aiohttp's ``on_connection_reuseconn`` trace tells the same, but a trace
    config makes aiohttp build and send a trace event at every step of every request:
    3 % of the gateway's CPU time per request, measured on the SSE relay, issue 37.)"""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self._used: weakref.WeakSet[Any] = weakref.WeakSet()

    async def connect(self, *args: Any, **kwargs: Any) -> Any:  # (req, traces, timeout)
        conn = await super().connect(*args, **kwargs)
        protocol = conn.protocol
        if protocol is not None:
            if protocol in self._used:
                marks = _reused.get()
                if marks is not None:
                    marks.append(True)
            else:
                self._used.add(protocol)
        return conn


def _session(max_connections: int, keepalive_expiry_s: float | None) -> aiohttp.ClientSession:
    if keepalive_expiry_s is None:
        connector = _MarkingConnector(limit=max_connections, force_close=True)
    else:
        connector = _MarkingConnector(limit=max_connections,
                                      keepalive_timeout=keepalive_expiry_s)
    # No cookie jar: a cookie one client's request got back must never go out with the
    # next client's request.
    return aiohttp.ClientSession(connector=connector, cookie_jar=aiohttp.DummyCookieJar())


class ReuseRetry(httpx.AsyncBaseTransport):
    """A pooled transport that sends a request once more, on a new connection, when the
    pooled connection it went out on failed before any response arrived.

    :param pooled: the keep-alive transport.
    :param fresh: a transport that opens a new connection per request.
    """

    def __init__(self, pooled: httpx.AsyncBaseTransport, fresh: httpx.AsyncBaseTransport
                 ) -> None:
        self.pooled = pooled
        self.fresh = fresh
        self.retried = 0  # requests sent again after a reused connection failed

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        """Send ``request``; raises httpx transport errors as the transports do."""
        marks: list[bool] = []
        token = _reused.set(marks)
        sent = time.monotonic()
        try:
            return await self.pooled.handle_async_request(request)
        except httpx.TransportError as exc:
            quick = time.monotonic() - sent < RETRY_WINDOW_S
            if not (marks and quick and _dropped(exc) and _replayable(request)):
                raise
            self.retried += 1
            log.info("upstream %s closed a reused connection without answering; "
                     "sending again on a new one", request.url.host)
        finally:
            _reused.reset(token)
        return await self.fresh.handle_async_request(request)

    async def aclose(self) -> None:
        await self.pooled.aclose()
        await self.fresh.aclose()


def _dropped(exc: httpx.TransportError) -> bool:
    """The server closed or reset the connection without an answer (not a timeout, not
    a refused connection)."""
    cause = exc.__cause__
    return isinstance(cause, (aiohttp.ServerDisconnectedError, aiohttp.ClientOSError)) \
        and not isinstance(cause, aiohttp.ClientConnectorError)


def _replayable(request: httpx.Request) -> bool:
    try:
        request.content  # noqa: B018 - a body held in memory can be sent again
    except httpx.RequestNotRead:
        return False
    return True


def build_client(*, max_connections: int = 0, keepalive_expiry_s: float = 2.0
                 ) -> httpx.AsyncClient:
    """Return an upstream client (aiohttp transport, pooled keep-alive, one retry of a
    request whose reused connection was closed under it; see the module docstring).

    :param max_connections: most connections open at once; 0, the default, sets no
        bound. A backend's generation requests each hold a lease, so admission already
        bounds them by the backend's slots: a pool limit below that would be a second,
        hidden queue, in no metric and under no ``max_queue_wait_s``.

    :param keepalive_expiry_s: idle time after which a pooled connection is closed,
        seconds; below the backend's own keep-alive timeout.

    Timeouts are set per request from each backend's settings.
    """
    pooled = AiohttpTransport(client=lambda: _session(max_connections, keepalive_expiry_s))
    fresh = AiohttpTransport(client=lambda: _session(max_connections, None))
    # A jar that accepts no cookie (no domain is allowed): as the aiohttp sessions, the
    # client must not send one client's cookie with another's request.
    refuse_all = CookieJar(policy=DefaultCookiePolicy(allowed_domains=[]))
    return httpx.AsyncClient(transport=ReuseRetry(pooled, fresh), timeout=None,
                             cookies=refuse_all)


def json_bytes(body: Any) -> bytes:
    """``body`` as compact UTF-8 JSON (orjson; the standard library for what orjson
    refuses, such as integers beyond 64 bits)."""
    try:
        return orjson.dumps(body)
    except TypeError:  # orjson.JSONEncodeError is one
        return json.dumps(body, ensure_ascii=False, separators=(",", ":")).encode()


@functools.lru_cache(maxsize=256)
def _parsed(url: str) -> httpx.URL:
    """``url`` parsed, once: httpx parses a string URL in Python (about 15 us here) for
    every request, and copies a parsed one in under 1 us (issue 37: 2.5 % of the
    gateway's CPU time over SSE streams in ``make bench``, under py-spy). A backend's
    few route URLs are asked again and again; the bound keeps side routes' query
    strings from piling up."""
    return httpx.URL(url)


def upstream_request(method: str, url: str, *, headers: Any = None,
                     content: bytes | None = None, timeout: httpx.Timeout) -> httpx.Request:
    """An upstream request, with ``timeout`` (seconds) as its transport reads it.

    :param headers: a list of (name, value) pairs or a mapping; ``Host`` and
        ``Content-Length`` are added.
    """
    return httpx.Request(method, _parsed(url), headers=headers, content=content,
                         extensions={"timeout": timeout.as_dict()})


async def send_upstream(client: httpx.AsyncClient, request: httpx.Request, *,
                        stream: bool = False) -> httpx.Response:
    """Send ``request`` on ``client``'s transport; with ``stream`` the body is left to be
    read (close the response), else it is read.

    httpx's client layers around the transport (redirects, auth flows, the cookie jar,
    merging defaults into each request) took about a fifth of the gateway's CPU time per
    request in ``make bench``, and the gateway needs none of them: it follows no upstream
    redirect, sets its own headers, and must keep no cookies from one client's request
    for the next. What ``AsyncClient.send`` does besides is done here: the response
    knows its request, and a transport error names it.

    :raises httpx.TransportError: as the transport raises it.
    """
    transport = client._transport_for_url(request.url)
    try:
        response = await transport.handle_async_request(request)
    except httpx.TransportError as exc:
        exc.request = request
        raise
    response.request = request
    if not stream:
        try:
            await response.aread()
        finally:
            await response.aclose()
    return response


def _is_timeout(exc: BaseException) -> bool:
    # httpx-aiohttp maps every aiohttp ClientConnectionError (a refused connection too)
    # to httpx.ConnectTimeout, so look at the cause to tell a refusal from a timeout.
    cause = exc.__cause__
    if isinstance(cause, aiohttp.ClientError):
        return isinstance(cause, (aiohttp.ServerTimeoutError, asyncio.TimeoutError))
    return isinstance(exc, httpx.TimeoutException)


def upstream_error_kind(exc: BaseException) -> UpstreamKind:
    """Classify a transport error: ``timeout``, ``connect`` or ``stream_aborted`` (the
    connection broke after the request was sent)."""
    if _is_timeout(exc):
        return UpstreamKind.timeout
    cause = exc.__cause__
    if isinstance(cause, aiohttp.ClientError):
        return (UpstreamKind.connect if isinstance(cause, aiohttp.ClientConnectorError)
                else UpstreamKind.stream_aborted)
    if isinstance(exc, (httpx.ConnectError, httpx.ConnectTimeout)):
        return UpstreamKind.connect
    return UpstreamKind.stream_aborted


def never_reached(exc: BaseException) -> bool:
    """True when ``exc`` (a gateway error or a transport error, through its causes)
    means the request never reached the backend: the connection was refused or timed
    out while connecting. Such a request can be sent to another backend as it is.

    Read from the transport errors under ``exc``, not from its :class:`UpstreamKind`:
    a connection that timed out while connecting is counted as ``timeout`` but never
    reached the backend either."""
    seen: BaseException | None = exc
    while seen is not None:
        if isinstance(seen, (httpx.ConnectError, httpx.ConnectTimeout,
                             aiohttp.ClientConnectorError, aiohttp.ConnectionTimeoutError)):
            if isinstance(seen, httpx.ConnectTimeout) and isinstance(
                    seen.__cause__, aiohttp.ClientError):
                seen = seen.__cause__  # httpx-aiohttp's label for any connection error
                continue
            return True
        seen = seen.__cause__
    return False


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
        if kind is UpstreamKind.timeout:
            raise UpstreamTimeout(f"Backend {backend!r} did not answer in time.") from exc
        if kind is UpstreamKind.connect:
            raise UpstreamUnavailable(
                f"Backend {backend!r} cannot be reached: {exc or type(exc).__name__}."
            ) from exc
        raise UpstreamError(
            f"The connection to backend {backend!r} failed: {exc or type(exc).__name__}."
        ) from exc
