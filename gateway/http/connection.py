"""Client connection limits that uvicorn does not enforce on its own.

uvicorn's h11 protocol (``uvicorn/protocols/http/h11_impl.py``, 0.3x-0.5x) times out a
connection only while it is idle *between* requests (``timeout_keep_alive``). A client
that opens a connection and sends nothing, or sends a request head one byte at a time
(slowloris), or stops in the middle of a body, holds a socket and a file descriptor for
as long as it likes. nginx bounds the same phases with ``client_header_timeout`` and
``client_body_timeout`` (60 s each by default).

:func:`guarded_protocol` returns an :class:`~uvicorn.protocols.http.h11_impl.H11Protocol`
subclass with two more timers:

* **head timeout** -- from a connection's first byte (or its opening) to the end of a
  request head: at most ``head_timeout_s`` seconds in all. Between requests on a
  keep-alive connection, uvicorn's own keep-alive timer applies until the next byte.
* **body idle timeout** -- while a request body is being received, at most
  ``body_idle_timeout_s`` seconds without a byte. A slow but steady upload is fine; a
  stalled one is cut (the handler sees a disconnect, counted as 499).

On either timeout the connection is closed without a response, as nginx does
(it logs 408 and closes).

It also caps the client connections open at once at ``max_open`` (twice
``server.max_connections``): a connection past that is closed as soon as it is accepted,
unanswered, so that the process never runs out of file descriptors, which would fail its
own upstream connections too (a backend marked down for the gateway's lack of
descriptors). Only the connections past the cap are closed, in the order they come.

This replaces uvicorn's ``limit_concurrency``, which the gateway does not set. uvicorn
checks that limit once per request head, against the connections open (and requests
running) at that moment, not against the requests let in before it. When 1,200 clients
connect at once with a limit of 1,000, all 1,200 connections are open before the first
head is parsed, so every request sees 1,200 connections, at least the limit, and gets
its plain-text 503 (``h11_impl.py``, ``handle_events``): all of them, not only the 200
past the limit. The gateway limits the *requests in hand* instead, in
:class:`~gateway.http.middleware.RequestAccounting`, which counts each as it passes and
refuses only those past ``server.max_connections``, in the API's error shape; idle
connections are bounded by the cap here and by the head and keep-alive timeouts.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

__all__ = ["guarded_protocol"]

log = logging.getLogger(__name__)


# A connection refused past the cap is logged at most this often (seconds), with how
# many were refused since the last line.
_REFUSED_LOG_EVERY_S = 10.0


class _GuardedH11Protocol(H11Protocol):
    head_timeout_s: float = 10.0
    body_idle_timeout_s: float = 30.0
    max_open: int | None = None  # client connections open at once; None: no cap
    _refused = 0  # connections closed past the cap since the last log line
    _refused_logged_at = float("-inf")

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._guard: asyncio.TimerHandle | None = None
        self._guarding: object = None  # the h11 state the timer is for

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        if self.max_open is not None and len(self.connections) > self.max_open:
            self._refuse()
            return
        self._rearm()

    def _refuse(self) -> None:
        """Close this connection, just accepted past :attr:`max_open`, unanswered."""
        self.transport.close()
        cls = type(self)
        cls._refused += 1
        now = time.monotonic()
        if now - cls._refused_logged_at >= _REFUSED_LOG_EVERY_S:
            log.warning("closed %d client connection(s) past the cap of %d open at once "
                        "(2 x server.max_connections)", cls._refused, self.max_open)
            cls._refused, cls._refused_logged_at = 0, now

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        self._rearm()

    def on_response_complete(self) -> None:
        # A pipelined request already buffered starts here, not in data_received. With
        # nothing buffered the connection is idle: uvicorn's keep-alive timer applies.
        super().on_response_complete()
        if self.conn.their_state is not h11.IDLE or self.conn.trailing_data[0]:
            self._rearm()

    def _disarm(self) -> None:
        if self._guard is not None:
            self._guard.cancel()
        self._guard = None
        self._guarding = None

    def _rearm(self) -> None:
        """Set the timer for the phase the client is in. A head keeps one deadline from
        its first byte; a body's deadline moves with every byte."""
        if self.transport.is_closing():
            self._disarm()
            return
        phase = self.conn.their_state
        if phase is h11.IDLE and (self.cycle is None or self.cycle.response_complete):
            if self._guarding is h11.IDLE:
                return
            self._disarm()
            self._guarding = h11.IDLE
            self._guard = self.loop.call_later(self.head_timeout_s, self._expired, "head")
        elif phase is h11.SEND_BODY:
            self._disarm()
            self._guarding = h11.SEND_BODY
            self._guard = self.loop.call_later(self.body_idle_timeout_s, self._expired, "body")
        else:
            self._disarm()

    def _expired(self, what: str) -> None:
        self._guard = None
        if self.transport.is_closing():
            return
        if what == "body" and self.flow.read_paused:
            # The handler is not reading yet; the client is not the one stalling.
            self._guard = self.loop.call_later(self.body_idle_timeout_s, self._expired, what)
            return
        if self.conn.their_state is not self._guarding:
            self._guarding = None
            return
        self._guarding = None
        limit = self.head_timeout_s if what == "head" else self.body_idle_timeout_s
        log.info("closing a client connection: no complete request %s within %g s (%s)",
                 what, limit, self.client)
        self.transport.close()


def guarded_protocol(head_timeout_s: float, body_idle_timeout_s: float,
                     max_open: int | None = None) -> type[H11Protocol]:
    """uvicorn's h11 protocol class with a head timeout, a body idle timeout and a cap on
    the connections open at once.

    :param head_timeout_s: the longest a client may take to send a request head, from
        its first byte (or from connecting), seconds.
    :param body_idle_timeout_s: the longest a client may pause while sending a request
        body, seconds.
    :param max_open: the most client connections open at once (of this server); one
        accepted past it is closed at once, unanswered. ``None``: no cap.
    :returns: a class to pass as ``uvicorn.Config(http=...)``.
    """
    return type("GuardedH11Protocol", (_GuardedH11Protocol,), {
        "head_timeout_s": head_timeout_s, "body_idle_timeout_s": body_idle_timeout_s,
        "max_open": max_open})
