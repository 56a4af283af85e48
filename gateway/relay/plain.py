"""The plain relay strategy: an answer relayed as the backend sends it,
:class:`PlainRelay`.

One attempt sends the request upstream (a stream, or a whole answer) and relays the
answer: JSON whole, after translating a backend's error into the request's error shape;
SSE or NDJSON event by event (:class:`gateway.relay.stream.StreamRelay`); either names
the served model in its ``model`` (:mod:`gateway.wire.naming`). A failure
before anything reached the client may be kept for failover
(:func:`gateway.relay.retry.keep_for_failover`), and an overflow of a whole answer under
the predictive policy for a restart; the response acts on either
(:meth:`gateway.relay.attempt.Attempt.next_step`).
"""

from __future__ import annotations

import asyncio
import logging

import httpx
from starlette.types import Send

from gateway.admission.lease import Lease
from gateway.backends.upstream import map_upstream_errors, never_reached, send_upstream
from gateway.errors import ClientDisconnected, GatewayError, ShuttingDown
from gateway.relay.parts import RelayParts
from gateway.relay.progress import begun
from gateway.relay.retry import MAX_OVERFLOW_RESTARTS, keep_for_failover
from gateway.relay.send import (
    Racer,
    Unraced,
    body_message,
    send_error,
    send_whole,
    unless_gone,
    usage_of,
)
from gateway.relay.stream import StreamRelay, close_after_drain
from gateway.relay.watcher import DisconnectWatcher
from gateway.wire.naming import rename_model
from gateway.wire.shapes import reshaped, sse_error_event

__all__ = ["PlainRelay"]

log = logging.getLogger(__name__)


class PlainRelay:
    """Runs each attempt of a request that is not tracked (a
    :class:`gateway.relay.parts.Strategy`)."""

    def __init__(self, parts: RelayParts) -> None:
        self.parts = parts
        self.restarts = 0  # whole answers sent again after an overflow
        self.stream: StreamRelay | None = None  # the last attempt's stream relay

    async def attempt(self, watcher: DisconnectWatcher, send: Send, lease: Lease) -> None:
        """Forward and relay on ``lease``, and give it back whatever happens."""
        x, tries = self.parts.x, self.parts.tries
        name = x.backend.name
        held_since = tries.start(lease)
        try:
            if lease.pinned:
                await self._forward(watcher, send)
            else:
                # llama-server placed this request's tasks itself, so /slots cannot show
                # which are its own once a later request reuses a slot: it is read to its
                # end even if the client leaves, and released then.
                await self._forward(Unraced(), unless_gone(send, watcher))
                if watcher.disconnected.is_set():
                    x.status = 499
        except ClientDisconnected:
            x.status = 499  # nginx's "client closed request", even if a 200 had started
            log.info("client left %s request on backend %s; upstream closed", x.route, name)
        except ShuttingDown as cut:
            await self._cut_off(send, cut)
        finally:
            tries.give_back(lease, held_since, served=200 <= x.status < 400,
                            stream=x.stream)

    async def resume(self, watcher: DisconnectWatcher, send: Send) -> Lease | None:
        """Never asked: a plain attempt is not preempted, so it never resumes."""
        return None

    async def _cut_off(self, send: Send, exc: ShuttingDown) -> None:
        """The drain ran out of time with this request in hand (its upstream request is
        closed by now): end a started stream with a final error event, or answer 503."""
        x, progress = self.parts.x, self.parts.admitter.progress
        x.upstream_error = "shutting_down"  # for the access line: cut by the drain
        log.info("drain timeout: cut a %s request on backend %s", x.route, x.backend.name)
        try:
            if self.stream is not None and self.stream.emitted:
                await send(body_message(self.stream.final(exc)))
                await send({"type": "http.response.body", "body": b"", "more_body": False})
            elif progress is not None and progress.streaming:
                await send(body_message(sse_error_event(exc, x.api)))
                await send({"type": "http.response.body", "body": b"", "more_body": False})
            else:
                await send_error(send, exc, x)
        except OSError:
            pass  # the client is gone too

    async def _forward(self, watcher: Racer, send: Send) -> None:
        parts = self.parts
        x, tries = parts.x, parts.tries
        name = x.backend.name
        try:
            with map_upstream_errors(name):
                request = tries.upstream_request()
                tries.sent()
                sending = asyncio.ensure_future(
                    send_upstream(parts.client, request, stream=True))
                progress = parts.admitter.progress
                # Without queue progress the wait is the sending itself: raced as it is,
                # with no task of its own (issue 37), and handed on if it is left.
                waiting = sending if progress is None else begun(sending, x, progress)
                try:
                    resp = await watcher.race(waiting, cancel=progress is not None)
                except BaseException:
                    if not sending.done():
                        tries.now.pending = sending  # handed on open (see attempt)
                    raise
        except GatewayError as exc:
            kind = tries.broke(exc)
            tries.upstream_error(kind)
            x.backend.upstream_failed(kind)
            if not (never_reached(exc) and keep_for_failover(parts, exc)):
                await send_error(send, exc, x)
            return
        # llama-server sends a stream's headers with its first result and a whole answer
        # all at once: either way the task has started, or ended.
        tries.now.began(stream=x.stream)
        stream = None
        try:
            ctype = resp.headers.get("content-type", "")
            ndjson = ctype.startswith("application/x-ndjson")
            streaming = x.stream and resp.status_code < 400 and (
                ctype.startswith("text/event-stream") or ndjson)
            if resp.status_code < 500 and not streaming:
                x.backend.health.request_served()  # a stream: once its first event comes
            if streaming:
                stream = self.stream = StreamRelay(parts, send, resp, ndjson=ndjson)
                await watcher.race(stream.run())
            else:
                await self._relay_whole(watcher, send, resp)
        finally:
            if stream is not None and stream.tail is not None:
                close_after_drain(stream.tail, resp, parts.tasks)
            else:
                await resp.aclose()

    async def _read_all(self, watcher: Racer, resp: httpx.Response) -> bytes:
        """Read the whole upstream body. Counts and re-raises upstream failures."""
        tries = self.parts.tries
        try:
            with map_upstream_errors(self.parts.x.backend.name):
                body = await watcher.race(resp.aread())
                tries.now.finished()
                return body
        except GatewayError as exc:
            tries.upstream_error(tries.broke(exc))
            raise

    async def _relay_whole(self, watcher: Racer, send: Send,
                           resp: httpx.Response) -> None:
        """Read a whole answer, translate backend errors, record usage, and send it."""
        parts = self.parts
        x = parts.x
        try:
            body = await self._read_all(watcher, resp)
        except GatewayError as failed:
            await send_error(send, failed, x)
            return
        if resp.status_code >= 400:
            exc = x.backend.translate_error(
                resp.status_code, body, resp.headers.get("retry-after")
            )
            if exc is not None:
                kind = exc.upstream_kind
                if kind:
                    parts.tries.upstream_error(kind)
                    x.backend.upstream_failed(kind)
                if (kind == "context_overflow" and x.backend.predictive
                        and self.restarts < MAX_OVERFLOW_RESTARTS):
                    self.restarts += 1
                    parts.tries.now.restart = True  # nothing was sent: try it whole again
                    return
                if (resp.status_code >= 500 and kind != "context_overflow"
                        and keep_for_failover(parts, exc)):
                    return
                await send_error(send, exc, x)
                return
            if x.api in ("openai", "anthropic"):
                body = reshaped(resp.status_code, body, x.api)
        else:
            usage, reasons, pace = await usage_of(x.route, body)
            parts.usage.record(parts.usage.all_choices(usage, reasons), reasons)
            if resp.status_code == 200:
                parts.usage.paced(parts.tries.current, usage, pace)
            if x.answer_model is not None:  # the served model's name, not the backend's
                body = rename_model(body, x.answer_model)
        await send_whole(send, resp, body, x)
