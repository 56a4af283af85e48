"""The plain relay of one upstream stream, event by event: :class:`StreamRelay`.

An SSE stream (or Ollama's NDJSON lines) is split into events
(:class:`gateway.wire.sse.EventSplitter`), each read by a
:class:`~gateway.relay.inspect.StreamInspector`, and relayed as it came. The 200 goes
out with the first event, so that a backend dying before it can still be failed over
(nothing has reached the client). A failure after it becomes one final error event (or
line), and no ``[DONE]`` is invented. A stream that ended whole has its unread tail
drained in the background (:func:`close_after_drain`), so that its connection is reused.
The ``model`` of the events relayed is the served model's name
(:class:`gateway.wire.naming.EventRenamer`), set in the bytes of each event. An OpenAI
stream's token chunks alike but for their text are read and renamed by a splice of the
last one (:class:`gateway.wire.splice.TokenSplice`).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Callable
from functools import partial

import httpx
from starlette.types import Message, Send

from gateway.backends.upstream import map_upstream_errors
from gateway.errors import GatewayError, UpstreamError
from gateway.fleet.tasks import TaskSet
from gateway.relay.inspect import Inspected, StreamInspector, TokenTimes
from gateway.relay.parts import RelayParts
from gateway.relay.retry import keep_for_failover
from gateway.relay.send import SSE_HEADERS, body_message, send_error
from gateway.wire.naming import EventRenamer
from gateway.wire.shapes import ndjson_error_line, sse_error_event
from gateway.wire.splice import TokenSplice
from gateway.wire.sse import EventSplitter, EventTooLarge

__all__ = ["STREAM_DRAIN_S", "StreamRelay", "close_after_drain"]

log = logging.getLogger(__name__)

STREAM_DRAIN_S = 0.25  # how long a finished stream's tail is read for connection reuse
_NDJSON_HEADERS = [(b"content-type", b"application/x-ndjson"), (b"x-accel-buffering", b"no")]


def close_after_drain(chunks: AsyncIterator[bytes], resp: httpx.Response,
                      tasks: TaskSet) -> None:
    """Close ``resp``, a finished stream, once what is left of it (its chunked-encoding
    terminator, often not yet arrived) is read, for at most :data:`STREAM_DRAIN_S`
    seconds, so that its connection goes back to the pool. A stream closed with unread
    bytes closes its connection (aiohttp's ``ClientResponse.release``), and every later
    request then pays a new TCP connection: a tenth of the relay's CPU time in ``make
    bench``. Runs in the background: the answer is over, its lease is given back at
    once, and the client's request is not held. The drain is a task of ``tasks`` (the
    app's: cancelled at shutdown, before the clients close). Not used for a server that
    closes the connection after a stream anyway (``closes_streams``)."""
    async def drain() -> None:
        try:
            async with asyncio.timeout(STREAM_DRAIN_S):
                async for _ in chunks:
                    pass
        except Exception as exc:  # a timeout, a broken or closed connection (aiohttp
            # raises a bare RuntimeError when its session closes): the connection is
            # closed instead of reused, and nothing is lost, the answer being whole
            log.debug("a finished stream's tail was not read: %r", exc)
        finally:
            await resp.aclose()

    tasks.spawn(drain())


def _kept(raw: bytes) -> bytes:
    return raw


class StreamRelay:
    """Relays the upstream stream ``resp`` of the current attempt to ``send``.

    :param ndjson: the stream is NDJSON lines (Ollama's native API), not SSE.
    :ivar emitted: an event went out (after it, a failure is one final event:
        :meth:`final`).
    :ivar tail: the unread rest of a stream that ended whole, for
        :func:`close_after_drain`; ``None`` otherwise.
    """

    def __init__(self, parts: RelayParts, send: Send, resp: httpx.Response, *,
                 ndjson: bool) -> None:
        self.parts = parts
        self.send = send
        self.resp = resp
        self.ndjson = ndjson
        self.opened = False  # the response start went out
        self.emitted = False
        self.tail: AsyncIterator[bytes] | None = None
        headers = _NDJSON_HEADERS if ndjson else SSE_HEADERS
        self.start: Message = {"type": "http.response.start", "status": resp.status_code,
                               "headers": headers + parts.x.extra_headers}

    def final(self, exc: GatewayError) -> bytes:
        """The last event (or line) of a stream that failed with ``exc``."""
        return ndjson_error_line(exc) if self.ndjson else sse_error_event(exc, self.parts.x.api)

    async def run(self) -> None:
        """Relay the stream to its end, or to its failure; record its usage.

        :raises ClientDisconnected: only through the caller's race (sends to a gone
            client raise ``OSError`` there).
        """
        x, tries = self.parts.x, self.parts.tries
        name = x.backend.name
        x.status = self.resp.status_code
        splitter = EventSplitter(lines=self.ndjson)
        state = StreamInspector(x.spec, x.api, x.charge.n, x.client_wants_usage,
                                x.backend.dialect.is_overflow_event, ndjson=self.ndjson)
        chunks = self.resp.aiter_raw()
        # Each event's "model" set to the served name (gateway.wire.naming), or kept.
        named = x.answer_model
        relayed = partial(self._relayed, state.reader(), TokenTimes(),
                          _kept if named is None else EventRenamer(named),
                          TokenSplice() if x.spec.openai_chunks and not self.ndjson
                          else None)
        try:
            with map_upstream_errors(name):
                async for chunk in chunks:
                    # The events of one upstream read go out in one write: one ASGI
                    # message and one socket write, not one per event.
                    out = relayed(splitter.feed(chunk))
                    if out:
                        await self._emit(out[0] if len(out) == 1 else b"".join(out))
                    if state.whole:
                        # The last event is relayed: the answer is whole. A client that
                        # closes now (the OpenAI SDK does, at [DONE]) has not left early.
                        break
        except EventTooLarge as too_large:
            tries.upstream_error("stream_aborted")
            await self._emit(self.final(UpstreamError(
                f"Backend {name!r} sent an event too large to relay: {too_large}.")))
        except GatewayError as exc:
            tries.upstream_error(tries.broke(exc))
            if await self._failed(exc):
                return
            await self._emit(self.final(exc))
        else:
            tries.now.finished()
            if not state.done and not state.errored:
                tries.upstream_error("stream_aborted")
                cut = UpstreamError(f"Backend {name!r} closed the stream before it finished.")
                if await self._failed(cut):
                    return
                await self._emit(self.final(cut))
        await self._end(state, chunks)

    async def _end(self, state: StreamInspector, chunks: AsyncIterator[bytes]) -> None:
        x = self.parts.x
        if not self.opened:
            self.opened = True
            await self.send(self.start)
        self.parts.usage.record(state.stream_usage(x.backend.dialect.usage_covers_one_choice),
                                state.finish_reasons)
        await self.send({"type": "http.response.body", "body": b"", "more_body": False})
        if state.whole and not x.backend.dialect.closes_streams:
            self.tail = chunks  # read to its end in the background, to pool the connection

    async def _emit(self, data: bytes) -> None:
        if not self.opened:
            self.opened = True
            self.parts.x.backend.health.request_served()
            self.emitted = True
            await self.send(self.start)
        await self.send(body_message(data))

    async def _failed(self, exc: GatewayError) -> bool:
        """Before the first event: fail over, or answer ``exc`` with its own status
        (nothing has reached the client, so it need not be a 200 and an event)."""
        if self.opened:
            return False
        x = self.parts.x
        x.status = 0
        if not keep_for_failover(self.parts, exc):
            await send_error(self.send, exc, x)
        return True

    def _relayed(self, read: Callable[[bytes], Inspected], times: TokenTimes,
                 rename: Callable[[bytes], bytes], splice: TokenSplice | None,
                 events: list[bytes]) -> list[bytes]:
        """What to relay of ``events`` (each read by the stream's inspector, ``read``),
        each renamed on its own (one that is not JSON, a comment with a stray bracket or
        quote, cannot hide the next one's model); acting on what they showed: TTFT and
        ITL for output (``times``), the upstream error's count. A token chunk alike
        but for its text to the last one ``splice`` learnt is read and renamed by it
        (the inspector would find output and nothing else in it). One call per upstream
        read, with no call per event but the reading, the token's timing and the
        renaming (the SSE relay's every event: issue 37)."""
        out = []
        parts = self.parts
        usage = parts.usage
        lease = parts.tries.now.lease
        now = None  # read once for the tokens of this read, which arrived together
        for raw in events:
            spliced = None if splice is None else splice(raw)
            if spliced is not None:
                if now is None:
                    now = usage.clock.now()
                usage.token_seen(times, lease, first=times.last_token is None, now=now)
                out.append(spliced)
                continue
            relayed, token, error = read(raw)
            if token:
                if now is None:
                    now = usage.clock.now()
                usage.token_seen(times, lease, first=times.last_token is None, now=now)
            if error is not None:
                parts.tries.upstream_error(error)
                if error == "context_overflow":
                    parts.x.backend.upstream_failed(error)
            if relayed is not None:
                renamed = rename(relayed)
                out.append(renamed)
                if token and splice is not None and relayed is raw:
                    splice.learn(raw, renamed)
        return out
