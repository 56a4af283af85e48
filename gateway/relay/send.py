"""The small pieces the proxy relays with: ASGI send wrappers, the two ways a whole
answer goes out (an error, an upstream answer with its headers), and the parsing of whole
answers off the event loop."""

from __future__ import annotations

import json
from collections.abc import Awaitable
from typing import TYPE_CHECKING, Any, Protocol, TypeVar

import anyio.to_thread
import orjson
from starlette.types import Message, Send

from gateway.errors import GatewayError
from gateway.relay.watcher import DisconnectWatcher
from gateway.request.exchange import Exchange
from gateway.wire.events import decode_pace, usage_of_whole
from gateway.wire.shapes import error_messages, sse_error_prefix

if TYPE_CHECKING:
    import httpx

    from gateway.observe.metrics import GatewayMetrics

__all__ = ["SSE_HEADERS", "THREAD_PARSE_BYTES", "Racer", "Started", "Unraced", "body_message",
           "failure_kind", "json_object", "refuse", "send_error", "send_whole",
           "unless_gone", "usage_of"]

T = TypeVar("T")


#: The response headers of a relayed SSE stream (no caching; nginx must not buffer it,
#: shared case P06).
SSE_HEADERS = [
    (b"content-type", b"text/event-stream"),
    (b"cache-control", b"no-cache"),
    (b"x-accel-buffering", b"no"),
]


# Upstream response headers relayed on whole (non-SSE) answers.
_PASS_RESPONSE_HEADERS = ("retry-after", "retry-after-ms", "x-should-retry")


def body_message(chunk: bytes) -> Message:
    """An ASGI body message that keeps the response open."""
    return {"type": "http.response.body", "body": chunk, "more_body": True}


async def send_error(send: Send, exc: GatewayError, x: Exchange) -> None:
    """Answer ``exc`` in the error shape of ``x``'s API (a JSON body with its own
    status), and note that status on ``x``."""
    start, body = error_messages(exc, x.api)
    x.status = exc.status_code
    await send(start)
    await send(body)


async def refuse(send: Send, exc: GatewayError, x: Exchange, metrics: GatewayMetrics,
                 backend: str) -> None:
    """Refuse ``x`` with ``exc`` once it reached the relay: note the rejection reason for
    its access line (``other`` for an error that is not a rejection), count it in
    ``gateway_rejections_total`` under ``backend``, and answer it (:func:`send_error`)."""
    x.reason = exc.rejection_reason or "other"
    metrics.rejections.labels(backend, x.reason, *x.who).inc()
    await send_error(send, exc, x)


async def send_whole(send: Send, resp: httpx.Response, body: bytes, x: Exchange) -> None:
    """Send ``body`` as the whole answer, with ``resp``'s status, content type and
    retry headers (``retry-after-ms`` derived from a ``retry-after`` in seconds), and
    ``x``'s own headers; note the status on ``x``."""
    ctype = resp.headers.get("content-type", "application/json").encode()
    headers = [(b"content-type", ctype), (b"content-length", str(len(body)).encode())]
    for name in _PASS_RESPONSE_HEADERS:
        if name in resp.headers:
            headers.append((name.encode(), resp.headers[name].encode()))
    retry_after = resp.headers.get("retry-after", "")
    if "retry-after-ms" not in resp.headers and retry_after.isdigit():
        headers.append((b"retry-after-ms", str(int(retry_after) * 1000).encode()))
    x.status = resp.status_code
    await send({
        "type": "http.response.start", "status": resp.status_code,
        "headers": headers + x.extra_headers,
    })
    await send({"type": "http.response.body", "body": body})


def failure_kind(exc: GatewayError) -> str:
    """Label for gateway_upstream_errors_total{kind} of a transport failure."""
    return exc.upstream_kind or "stream_aborted"


THREAD_PARSE_BYTES = 256 * 1024


async def usage_of(route: str, body: bytes) -> tuple[Any, list[Any], float | None]:
    """The token counts of a whole answer of ``route`` (or ``None``), each choice's
    ``finish_reason`` (:func:`gateway.wire.events.usage_of_whole`) and the decode pace it
    reports, seconds per token (:func:`gateway.wire.events.decode_pace`). Large bodies
    (logprobs can make them megabytes) are parsed in a worker thread so the event loop
    keeps serving."""

    def parse() -> tuple[Any, list[Any], float | None]:
        try:
            data = json.loads(body)
            return (*usage_of_whole(route, data), decode_pace(data))
        except (ValueError, AttributeError, RecursionError):
            return None, [], None

    if len(body) > THREAD_PARSE_BYTES:
        return await anyio.to_thread.run_sync(parse)
    return parse()


class Started:
    """``send`` for a stream that may send its 200 and SSE headers before admission
    (queue progress). Until :meth:`open`, messages pass unchanged. After it, a later
    response start is dropped, a stream's events pass, and a whole JSON answer (an
    error) becomes one final SSE error event, the same object in the route's error
    shape."""

    def __init__(self, send: Send, api: str) -> None:
        self.raw = send
        self.api = api
        self.opened = False
        self._passing = False
        self._started = False  # a response start passed through before any open()
        self._buffer = bytearray()

    async def open(self, headers: list[tuple[bytes, bytes]]) -> None:
        """Send the 200 and ``headers`` now."""
        await self.raw({"type": "http.response.start", "status": 200, "headers": headers})
        self.opened = True

    @property
    def can_open(self) -> bool:
        """No response has started yet: :meth:`open` may send the 200."""
        return not self.opened and not self._started

    @property
    def streaming(self) -> bool:
        """An SSE 200 has gone out: comments may be sent with :attr:`raw`."""
        return self.opened or (self._started and self._passing)

    async def __call__(self, message: Message) -> None:
        if not self.opened:
            if message["type"] == "http.response.start":
                headers = dict(message.get("headers") or [])
                self._started = True
                self._passing = message["status"] < 400 and headers.get(
                    b"content-type", b"").startswith(b"text/event-stream")
            await self.raw(message)
            return
        if message["type"] == "http.response.start":
            headers = dict(message.get("headers") or [])
            ctype = headers.get(b"content-type", b"")
            self._passing = message["status"] < 400 and ctype.startswith(b"text/event-stream")
            return
        if self._passing or message["type"] != "http.response.body":
            await self.raw(message)
            return
        self._buffer += message.get("body", b"")
        if message.get("more_body"):
            return
        prefix = sse_error_prefix(self.api)
        payload = bytes(self._buffer).strip() or b'{"error":{"message":"upstream error"}}'
        await self.raw(body_message(prefix + b"data: " + payload + b"\n\n"))
        await self.raw({"type": "http.response.body", "body": b"", "more_body": False})


class Racer(Protocol):
    """What a relay step needs of its watcher: ``race`` awaits ``work``, or raises
    :class:`~gateway.errors.ClientDisconnected` when the client goes first
    (:class:`~gateway.relay.watcher.DisconnectWatcher`; :class:`Unraced` never does)."""

    async def race(self, work: Awaitable[T], *, cancel: bool = True) -> T: ...


class Unraced:
    """A stand-in for :class:`DisconnectWatcher` that never interrupts the work."""

    async def race(self, work: Awaitable[T], *, cancel: bool = True) -> T:
        return await work


def unless_gone(send: Send, watcher: DisconnectWatcher) -> Send:
    """``send`` that drops messages once the client has gone."""

    async def guarded(message: Message) -> None:
        if not watcher.disconnected.is_set():
            try:
                await send(message)
            except OSError:
                pass

    return guarded


def json_object(text: str | bytes) -> dict[str, Any] | None:
    """``text`` parsed as a JSON object, or ``None`` when it is not one. Used on every
    streamed event, so parsed by orjson, several times faster than the standard library
    on small objects; what orjson refuses (NaN, Infinity, integers beyond 64 bits) is
    read by the standard library, as before."""
    try:
        obj = orjson.loads(text)
    except ValueError:  # orjson.JSONDecodeError is one
        try:  # what only the standard library reads (NaN, Infinity, huge numbers)
            obj = json.loads(text)
        except (ValueError, RecursionError):
            return None
    return obj if isinstance(obj, dict) else None
