"""One attempt of a tracked request, followed token by token: :class:`Follower`; and the
one answer its client receives over all attempts: :class:`ClientAnswer`.

The tracked strategy (:mod:`gateway.relay.tracked`) runs a :class:`Follower` per attempt.
It always streams upstream (with usage), rewrites each event through the request's
:class:`~gateway.wire.resume.Continuation` (a continuation's events read as the one
answer's), reports the tokens to the admission
(:meth:`gateway.admission.admission.Admission.observe`), and tells an overflow (an error
event, or a 500, that llama-server sends when it runs out of cells: the task is already
ended) from any other failure: the first is resumed from, the others end the answer.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

import httpx
from starlette.types import Send

from gateway.admission.lease import Lease
from gateway.backends.upstream import (
    json_bytes,
    map_upstream_errors,
    send_upstream,
    upstream_request,
)
from gateway.errors import GatewayError, UpstreamError
from gateway.relay.attempt import forward_headers
from gateway.relay.inspect import TokenTimes
from gateway.relay.parts import RelayParts
from gateway.relay.progress import begun
from gateway.relay.retry import mark_down
from gateway.relay.send import SSE_HEADERS, body_message, json_object, send_error, send_whole
from gateway.request.exchange import Exchange
from gateway.wire.naming import EventRenamer, rename_model
from gateway.wire.resume import Continuation, Reassembler
from gateway.wire.shapes import reshaped, sse_error_event
from gateway.wire.sse import EventSplitter, EventTooLarge, event_data

__all__ = ["OVERFLOW", "ClientAnswer", "Follower"]

OVERFLOW = "overflow"  # the reason when the backend itself ran out of cells


class ClientAnswer:
    """What the client of request ``x`` receives over the attempts: one SSE stream (the
    200 sent once), or one whole JSON answer rebuilt at the end
    (:class:`~gateway.wire.resume.Reassembler`).

    :ivar started: the 200 went out (streams).
    :ivar closed: the answer is complete: finished, or failed with its error.
    """

    def __init__(self, x: Exchange, send: Send) -> None:
        self.x = x
        self.send = send
        self.stream = x.stream
        self.started = False
        self.closed = False
        self.whole = Reassembler(x.route)
        # The served model's name, not the backend's, in each event (None: kept).
        self._rename = None if x.answer_model is None else EventRenamer(x.answer_model)

    async def event(self, raw: bytes | None, obj: dict[str, Any]) -> None:
        """Relay one event: ``raw`` as received when it is unchanged, else ``obj``."""
        if not self.stream:
            self.whole.feed(obj)
            return
        await self.open()
        data = raw if raw is not None else (
            b"data: " + json.dumps(obj, separators=(",", ":")).encode() + b"\n\n")
        if self._rename is not None:
            data = self._rename(data)
        # Shielded: a preemption arriving meanwhile must not cut an event in half.
        await asyncio.shield(self.send(body_message(data)))

    async def open(self) -> None:
        """Send the 200 and the SSE headers, once."""
        if self.started:
            return
        self.started = True
        self.x.status = 200
        await self.send({"type": "http.response.start", "status": 200,
                         "headers": SSE_HEADERS + self.x.extra_headers})

    async def finish(self) -> None:
        """End the answer: ``[DONE]`` and the end of a stream, or the whole answer."""
        x = self.x
        if self.stream:
            await self.open()
            await self.send(body_message(b"data: [DONE]\n\n"))
            self.closed = True
            await self.send({"type": "http.response.body", "body": b"", "more_body": False})
            return
        body = json.dumps(self.whole.answer(), separators=(",", ":")).encode()
        if x.answer_model is not None:
            body = rename_model(body, x.answer_model)
        x.status = 200
        await self.send({"type": "http.response.start", "status": 200, "headers": [
            (b"content-type", b"application/json; charset=utf-8"),  # as llama-server's
            (b"content-length", str(len(body)).encode()), *x.extra_headers]})
        self.closed = True
        await self.send({"type": "http.response.body", "body": body})

    async def error(self, exc: GatewayError) -> None:
        """Fail the answer: a JSON error before the 200, a final error event after it."""
        self.closed = True
        if not self.started:
            await send_error(self.send, exc, self.x)
            return
        self.x.status = self.x.status or 200
        await self.send(body_message(sse_error_event(exc, self.x.api)))
        await self.send({"type": "http.response.body", "body": b"", "more_body": False})


class Follower:
    """Sends the current attempt of a tracked request on ``lease`` and follows its
    answer into ``client`` (see the module doc).

    :param cont: the request's continuation (its tokens so far, over the attempts).
    :param times: when its last output token came (TTFT, ITL) and the usage seen.
    :param cap: the request's output cap, tokens: the answer is over at it.
    """

    def __init__(self, parts: RelayParts, client: ClientAnswer, lease: Lease,
                 cont: Continuation, times: TokenTimes, cap: int) -> None:
        self.parts = parts
        self.client = client
        self.lease = lease
        self.cont = cont
        self.times = times
        self.cap = cap

    def _upstream_body(self) -> dict[str, Any]:
        """The body sent: always a stream, with usage (a whole answer is rebuilt)."""
        body = dict(self.parts.x.body)
        body["stream"] = True
        body["stream_options"] = {**(body.get("stream_options") or {}), "include_usage": True}
        return body

    async def run(self) -> str | None:
        """Send the attempt and follow its answer. Returns :data:`OVERFLOW` when the
        backend ran out of cells under it (it is resumed from), else ``None``: the
        answer is over (whole, or failed with its error told to the client)."""
        parts, client = self.parts, self.client
        x, tries = parts.x, parts.tries
        name = x.backend.name
        headers = forward_headers(x)
        headers.append((b"connection", b"close"))  # see attempt.upstream_request_for
        request = tries.traced(upstream_request(
            "POST", x.backend.route_url(x.route), headers=headers,
            content=json_bytes(x.backend.dialect.pin(self._upstream_body(), self.lease)),
            timeout=x.backend.timeout))
        try:
            with map_upstream_errors(name):
                tries.sent()
                sending = asyncio.ensure_future(
                    send_upstream(parts.client, request, stream=True))
                try:
                    resp = await begun(sending, x, parts.admitter.progress)
                except BaseException:
                    # Preempted (or the client left) before the answer began: the open
                    # request is handed on, so that the backend cannot start it unseen.
                    if not sending.done():
                        tries.now.pending = sending
                    raise
        except GatewayError as exc:
            kind = tries.broke(exc)
            tries.upstream_error(kind)
            x.backend.upstream_failed(kind)
            mark_down(x)  # in a pool: marked down (no failover once followed)
            await client.error(exc)
            return None
        tries.now.began(stream=True)
        if resp.status_code < 500:
            x.backend.health.request_served()  # a probe that succeeds brings the backend back
        try:
            if resp.status_code >= 400 or not resp.headers.get(
                    "content-type", "").startswith("text/event-stream"):
                return await self._refused(resp)
            return await self._relay_events(resp)
        finally:
            await resp.aclose()

    async def _refused(self, resp: httpx.Response) -> str | None:
        """An upstream answer that is not a stream: an overflow to resume from, or an
        error to pass on."""
        x, tries, client = self.parts.x, self.parts.tries, self.client
        name = x.backend.name
        try:
            with map_upstream_errors(name):
                body = await resp.aread()
        except GatewayError as exc:
            tries.upstream_error(tries.broke(exc))
            await client.error(exc)
            return None
        tries.now.finished()
        translated = x.backend.translate_error(resp.status_code, body,
                                               resp.headers.get("retry-after"))
        kind = translated.upstream_kind if translated is not None else None
        if kind == "context_overflow":
            self._overflowed()
            x.backend.upstream_failed(kind, live_tokens=self._live())
            return OVERFLOW
        if kind:
            tries.upstream_error(kind)
            x.backend.upstream_failed(kind, live_tokens=self._live())
        if translated is None and not client.started and resp.status_code >= 400:
            # The backend's own refusal (a 4xx), passed on as the untracked path does.
            await send_whole(client.send, resp, reshaped(resp.status_code, body, x.api), x)
            return None
        await client.error(translated or UpstreamError(
            f"Backend {name!r} answered HTTP {resp.status_code} instead of a stream."))
        return None

    async def _relay_events(self, resp: httpx.Response) -> str | None:
        tries, client = self.parts.tries, self.client
        name = self.parts.x.backend.name
        splitter = EventSplitter()
        done = False
        try:
            with map_upstream_errors(name):
                async for chunk in resp.aiter_raw():
                    for raw in splitter.feed(chunk):
                        data = event_data(raw)
                        if data is None:
                            continue
                        if data.strip() == "[DONE]":
                            done = True
                            continue
                        obj = json_object(data)
                        if obj is None:
                            continue
                        if "error" in obj:
                            tries.now.finished()
                            return await self._stream_error(obj)
                        await self._event(raw, obj)
                    if done:
                        break
        except EventTooLarge as too_large:
            tries.upstream_error("stream_aborted")
            await client.error(UpstreamError(
                f"Backend {name!r} sent an event too large to relay: {too_large}."))
            return None
        except GatewayError as exc:
            tries.upstream_error(tries.broke(exc))
            await client.error(exc)
            return None
        tries.now.finished()
        if not done:
            tries.upstream_error("stream_aborted")
            await client.error(UpstreamError(
                f"Backend {name!r} closed the stream before it finished."))
            return None
        self.parts.usage.record(self.times.usage, [self.cont.finish_reason])
        await client.finish()
        return None

    async def _event(self, raw: bytes, obj: dict[str, Any]) -> None:
        """One event of the answer: its tokens counted and reported to the admission,
        then relayed (as received on the first attempt, rewritten on a continuation)."""
        x, cont, lease = self.parts.x, self.cont, self.lease
        before = cont.total_tokens
        first_attempt = cont.attempts == 0
        out = cont.rewrite(obj)
        if cont.finished or cont.total_tokens >= self.cap:
            lease.preemptible = False  # over: let it end
        if cont.total_tokens > before:
            self.parts.usage.token_seen(self.times, lease, first=lease.first_token_at is None)
            lease.preemptible = lease.preemptible and cont.faithful
            x.backend.admission.observe(lease, cont.attempt_tokens)
        if isinstance(obj.get("usage"), dict):
            self.times.usage = obj["usage"]
        if out is None or (obj.get("choices") == [] and "usage" in obj
                           and x.stream and not x.client_wants_usage):
            return
        await self.client.event(raw if first_attempt else None, out)

    def _overflowed(self) -> None:
        """Count an overflow the answer resumes from: its preemption first, then the
        upstream error, so that no scrape sees the error without the preemption that
        recovers it (the GatewayContextOverflow alert compares the two)."""
        self.parts.metrics.preemptions.labels(self.parts.x.backend.name, OVERFLOW).inc()
        self.parts.tries.upstream_error("context_overflow")

    def _live(self) -> int:
        """KV cells the gateway's requests on this backend hold now (live accounting)."""
        return self.parts.x.backend.admission.stats().live_tokens

    async def _stream_error(self, obj: dict[str, Any]) -> str | None:
        """An error event: an overflow is resumed from; anything else ends the answer."""
        x = self.parts.x
        name = x.backend.name
        if x.backend.dialect.is_overflow_event(obj):
            self._overflowed()
            x.backend.upstream_failed("context_overflow", live_tokens=self._live())
            return OVERFLOW
        self.parts.tries.upstream_error("stream_aborted")
        error = obj.get("error")
        message = error.get("message") if isinstance(error, dict) else str(error)
        await self.client.error(UpstreamError(f"Backend {name!r} failed the answer: {message}"))
        return None
