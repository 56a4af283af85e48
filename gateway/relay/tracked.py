"""A request followed token by token, preempted before the pool overflows, and continued
where it stopped (the ``predictive`` policy on llama-server).

:class:`TrackedResponse` is a :class:`~gateway.relay.response.ProxyResponse` for the requests the
pipeline marks ``tracked``. It:

1. always streams upstream, so that every token is seen as it is generated and reported
   to the admission (:meth:`~gateway.admission.admission.Admission.observe`): a client that asked
   for a whole answer gets one rebuilt from the events
   (:class:`~gateway.wire.resume.Reassembler`);
2. races each attempt against preemption: when the admission preempts the lease (the
   pool would run short), the upstream stream is closed, which makes llama-server
   cancel the task at its next write, and the lease is held until ``/slots`` shows the
   slot free (:mod:`gateway.admission.slotwatch`);
3. treats llama-server's "Context size has been exceeded." (an error event, or a 500)
   the same way: the backend has already ended the task;
4. then queues again at the head and sends the continuation
   (:class:`~gateway.wire.resume.Continuation`), up to :data:`MAX_RESUMES` times, relaying
   its events in the same client stream.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Awaitable
from dataclasses import replace
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
from gateway.errors import ClientDisconnected, GatewayError, UpstreamError
from gateway.relay.attempt import forward_headers
from gateway.relay.inspect import TokenTimes
from gateway.relay.response import ProxyResponse
from gateway.relay.send import SSE_HEADERS, body_message, json_object
from gateway.relay.watcher import DisconnectWatcher
from gateway.wire.resume import CAP_FIELDS, Continuation, Reassembler
from gateway.wire.shapes import reshaped, sse_error_event
from gateway.wire.sse import EventSplitter, EventTooLarge, event_data

__all__ = ["MAX_RESUMES", "TrackedResponse"]

log = logging.getLogger(__name__)

MAX_RESUMES = 4  # continuations per request; after them it is no longer preempted
RECOUNT_SLACK = 16  # tokens added to prompt + generated when a recount is not possible
OVERFLOW = "overflow"  # the reason when the backend itself ran out of cells


class _Client:
    """What the client receives over the attempts: one SSE stream (the 200 sent once),
    or one whole JSON answer rebuilt at the end."""

    def __init__(self, owner: TrackedResponse, send: Send) -> None:
        self.owner = owner
        self.send = send
        self.stream = owner.x.stream
        self.started = False  # the 200 went out (streams)
        self.closed = False  # the answer is complete: finished, or failed with its error
        self.whole = Reassembler(owner.x.route)

    async def event(self, raw: bytes | None, obj: dict[str, Any]) -> None:
        """Relay one event: ``raw`` as received when it is unchanged, else ``obj``."""
        if not self.stream:
            self.whole.feed(obj)
            return
        await self.open()
        data = raw if raw is not None else (
            b"data: " + json.dumps(obj, separators=(",", ":")).encode() + b"\n\n")
        # Shielded: a preemption arriving meanwhile must not cut an event in half.
        await asyncio.shield(self.send(body_message(data)))

    async def open(self) -> None:
        """Send the 200 and the SSE headers, once."""
        if self.started:
            return
        self.started = True
        x = self.owner.x
        x.status = 200
        await self.send({"type": "http.response.start", "status": 200,
                         "headers": SSE_HEADERS + x.extra_headers})

    async def finish(self) -> None:
        """End the answer: ``[DONE]`` and the end of a stream, or the whole answer."""
        x = self.owner.x
        if self.stream:
            await self.open()
            await self.send(body_message(b"data: [DONE]\n\n"))
            self.closed = True
            await self.send({"type": "http.response.body", "body": b"", "more_body": False})
            return
        body = json.dumps(self.whole.answer(), separators=(",", ":")).encode()
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
            await self.owner._send_error(self.send, exc)
            return
        self.owner.x.status = self.owner.x.status or 200
        await self.send(body_message(sse_error_event(exc, self.owner.x.api)))
        await self.send({"type": "http.response.body", "body": b"", "more_body": False})


class TrackedResponse(ProxyResponse):
    """Admits, forwards and relays one tracked request, preempting and continuing it as
    the admission decides (see the module doc)."""

    async def _admit_and_forward(self, watcher: DisconnectWatcher, send: Send) -> None:
        x, m, name = self.x, self.metrics, self.x.backend.name
        lease, send = await self._obtain(watcher, send)
        if lease is None:
            return
        client = _Client(self, send)
        cont = Continuation(x.route, x.charge.prompt_tokens)
        first_body, cap = x.body, x.charge.max_tokens
        self._cap = cap
        state = TokenTimes()
        while True:
            reason = await self._try_once(watcher, client, lease, cont, state)
            if reason is None:
                return
            if reason != OVERFLOW:  # an overflow's was counted with it (_overflowed)
                m.preemptions.labels(name, reason).inc()
            log.info("backend %s: %s request preempted (%s) after %d tokens; it resumes "
                     "at the head of the queue", name, x.route, reason, cont.total_tokens)
            # Back on the same slot if it is free by then: llama-server still caches
            # the prompt and the partial answer there, so little is computed again.
            slot = lease.slot_ids[0] if lease.slot_ids else None
            lease = await self._resume(watcher, client, cont, first_body, cap, slot)
            if lease is None:
                return

    async def _resume(self, watcher: DisconnectWatcher, client: _Client, cont: Continuation,
                      first_body: dict[str, Any], cap: int, slot: int | None
                      ) -> Lease | None:
        """Queue the continuation at the head and wait for its lease; or tell the client
        why it cannot go on and return ``None``."""
        x, m, name = self.x, self.metrics, self.x.backend.name
        outcome = "continued" if cont.total_tokens else "restarted"
        try:
            if cont.attempts >= MAX_RESUMES:
                raise UpstreamError(f"Backend {name!r} had to stop this answer to make room "
                                    f"{cont.attempts + 1} times; giving up.")
            if not cont.faithful:
                raise UpstreamError(f"Backend {name!r} had to stop this answer to make room, "
                                    "and an answer with reasoning cannot be continued.")
            try:
                body = cont.next_body(first_body, cap)
            except ValueError:
                raise UpstreamError(f"Backend {name!r} stopped this answer at its cap.") \
                    from None
            charge = await self._continuation_charge(body, cap - cont.generated)
            if x.tag is not None:  # a new tag: /slots must not take this attempt for the last
                body.pop(x.tag[0], None)
                x.tag = x.backend.dialect.tag_request(body)
            x.body, x.charge = body, charge
            if self._progress is not None and x.stream:  # it asked to hear where it stands
                lease = await self._wait_with_progress(watcher, self._progress, front=True,
                                                       prefer=slot)
            else:
                lease = await watcher.race(x.backend.admit(charge, front=True, prefer=slot,
                                                           party=x.party))
        except ClientDisconnected:
            m.resumes.labels(name, "client_gone").inc()
            x.status = 499
            return None
        except GatewayError as exc:
            m.resumes.labels(name, "failed").inc()
            log.warning("backend %s: a preempted %s request could not resume: %s", name,
                        x.route, exc.message)
            await client.error(exc)
            return None
        m.resumes.labels(name, outcome).inc()
        return lease

    async def _continuation_charge(self, body: dict[str, Any], left: int) -> Any:
        """The charge of a continuation: its prompt counted again by the backend (the
        partial answer is now part of it), the cap left, a fresh prediction."""
        x = self.x
        layout = x.backend.layout
        counted = None
        try:
            counted = await x.backend.count_prompt(x.route, body)
        except GatewayError as exc:
            if exc.upstream_kind == "connect":
                raise
        if counted is None:
            counted = x.charge.prompt_tokens + x.charge.max_tokens - left + RECOUNT_SLACK
        if layout is not None:
            left = min(left, layout.usable_per_slot - counted)
        if left < 1:
            raise UpstreamError(f"Backend {x.backend.name!r} had to stop this answer to make "
                                "room, and its continuation no longer fits one slot.")
        for name in CAP_FIELDS:
            if name in body:
                body[name] = left
        return replace(x.charge, prompt_tokens=counted, max_tokens=left,
                       predicted=x.backend.predicted_output(left), clamped=False)

    async def _try_once(self, watcher: DisconnectWatcher, client: _Client, lease: Lease,
                       cont: Continuation, state: TokenTimes) -> str | None:
        """Run one attempt on ``lease`` and release it. Returns the reason it was cut
        short (``pool_pressure``, or :data:`OVERFLOW`), or ``None`` when the answer is
        over (served, failed, or the client left)."""
        x = self.x
        preempted = asyncio.Event()
        lease.tracked = True
        lease.earlier = cont.generated
        lease.preemptible = cont.faithful and cont.attempts < MAX_RESUMES
        lease.on_preempt = lambda reason: preempted.set()
        held_since = self._start_attempt(lease)
        reason: str | None = None
        try:
            reason = await watcher.race(self._until(
                preempted, lease, self._forward_tracked(client, lease, cont, state)))
        except ClientDisconnected:
            if not client.closed:  # (a client that closes at the end has not left early)
                x.status = 499
                log.info("client left %s request on backend %s; upstream closed", x.route,
                         x.backend.name)
        finally:
            lease.on_preempt = None
            self._give_back(lease, held_since, served=reason is None and 200 <= x.status < 400,
                            stream=True, quick=reason is not None)
        return reason

    @staticmethod
    async def _until(preempted: asyncio.Event, lease: Lease,
                     work: Awaitable[str | None]) -> str | None:
        """``work``'s result, or the lease's preemption reason if that comes first (the
        work is then cancelled, which closes the upstream stream)."""
        task = asyncio.ensure_future(work)
        flag = asyncio.ensure_future(preempted.wait())
        try:
            await asyncio.wait({task, flag}, return_when=asyncio.FIRST_COMPLETED)
            if task.done():
                return task.result()
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
            return lease.preempted
        finally:
            for pending in (task, flag):
                if not pending.done():
                    pending.cancel()
                    await asyncio.gather(pending, return_exceptions=True)

    def _upstream_body(self) -> dict[str, Any]:
        """The body sent: always a stream, with usage (a whole answer is rebuilt)."""
        body = dict(self.x.body)
        body["stream"] = True
        body["stream_options"] = {**(body.get("stream_options") or {}), "include_usage": True}
        return body

    async def _forward_tracked(self, client: _Client, lease: Lease, cont: Continuation,
                               state: TokenTimes) -> str | None:
        x, name = self.x, self.x.backend.name
        headers = forward_headers(x)
        headers.append((b"connection", b"close"))  # see ProxyResponse._upstream_request
        request = upstream_request(
            "POST", x.backend.route_url(x.route), headers=headers,
            content=json_bytes(x.backend.pin(self._upstream_body(), lease)),
            timeout=x.backend.timeout)
        try:
            with map_upstream_errors(name):
                self._sent_upstream()
                sending = asyncio.ensure_future(
                    send_upstream(self.client, request, stream=True))
                try:
                    resp = await self._begun(sending)
                except BaseException:
                    # Preempted (or the client left) before the answer began: the open
                    # request is handed on, so that the backend cannot start it unseen.
                    if not sending.done():
                        self._now.pending = sending
                    raise
        except GatewayError as exc:
            kind = self._broke(exc)
            self._upstream_error(name, kind)
            x.backend.upstream_failed(kind)
            if x.queue is not None:  # in a pool: marked down (no failover once followed)
                x.queue.wake_later(x.backend.request_failed(x.queue.down_initial_s,
                                                            x.queue.down_max_s))
            await client.error(exc)
            return None
        self._now.began(stream=True)
        if resp.status_code < 500:
            x.backend.request_served()  # a probe that succeeds brings the backend back
        try:
            if resp.status_code >= 400 or not resp.headers.get(
                    "content-type", "").startswith("text/event-stream"):
                return await self._refused(client, resp)
            return await self._relay_events(client, resp, lease, cont, state)
        finally:
            await resp.aclose()

    async def _refused(self, client: _Client, resp: httpx.Response) -> str | None:
        """An upstream answer that is not a stream: an overflow to resume from, or an
        error to pass on."""
        x, name = self.x, self.x.backend.name
        try:
            with map_upstream_errors(name):
                body = await resp.aread()
        except GatewayError as exc:
            self._upstream_error(name, self._broke(exc))
            await client.error(exc)
            return None
        self._now.finished()
        exc = x.backend.translate_error(resp.status_code, body,
                                        resp.headers.get("retry-after"))
        kind = exc.upstream_kind if exc is not None else None
        if kind == "context_overflow":
            self._overflowed(name)
            x.backend.upstream_failed(kind, live_tokens=self._live())
            return OVERFLOW
        if kind:
            self._upstream_error(name, kind)
            x.backend.upstream_failed(kind, live_tokens=self._live())
        if exc is None and not client.started and resp.status_code >= 400:
            # The backend's own refusal (a 4xx), passed on as the untracked path does.
            await self._send_whole(client.send, resp, reshaped(resp.status_code, body, x.api))
            return None
        await client.error(exc or UpstreamError(
            f"Backend {name!r} answered HTTP {resp.status_code} instead of a stream."))
        return None

    async def _relay_events(self, client: _Client, resp: httpx.Response, lease: Lease,
                            cont: Continuation, state: TokenTimes) -> str | None:
        x, name = self.x, self.x.backend.name
        admission = x.backend.admission
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
                            self._now.finished()
                            return await self._stream_error(client, obj)
                        before = cont.total_tokens
                        first_attempt = cont.attempts == 0
                        out = cont.rewrite(obj)
                        if cont.finished or cont.total_tokens >= self._cap:
                            lease.preemptible = False  # over: let it end
                        if cont.total_tokens > before:
                            self._token_seen(state)
                            lease.preemptible = lease.preemptible and cont.faithful
                            admission.observe(lease, cont.attempt_tokens)
                        if isinstance(obj.get("usage"), dict):
                            state.usage = obj["usage"]
                        if out is None or (obj.get("choices") == [] and "usage" in obj
                                           and x.stream and not x.client_wants_usage):
                            continue
                        await client.event(raw if first_attempt else None, out)
                    if done:
                        break
        except EventTooLarge as too_large:
            self._upstream_error(name, "stream_aborted")
            await client.error(UpstreamError(
                f"Backend {name!r} sent an event too large to relay: {too_large}."))
            return None
        except GatewayError as exc:
            self._upstream_error(name, self._broke(exc))
            await client.error(exc)
            return None
        self._now.finished()
        if not done:
            self._upstream_error(name, "stream_aborted")
            await client.error(UpstreamError(
                f"Backend {name!r} closed the stream before it finished."))
            return None
        self.usage.record(state.usage)
        await client.finish()
        return None

    def _overflowed(self, name: str) -> None:
        """Count an overflow the answer resumes from: its preemption first, then the
        upstream error, so that no scrape sees the error without the preemption that
        recovers it (the GatewayContextOverflow alert compares the two)."""
        self.metrics.preemptions.labels(name, OVERFLOW).inc()
        self._upstream_error(name, "context_overflow")

    def _live(self) -> int:
        """KV cells the gateway's requests on this backend hold now (live accounting)."""
        return self.x.backend.admission.stats().live_tokens

    async def _stream_error(self, client: _Client, obj: dict[str, Any]) -> str | None:
        """An error event: an overflow is resumed from; anything else ends the answer."""
        x, name = self.x, self.x.backend.name
        if x.backend.is_overflow_event(obj):
            self._overflowed(name)
            x.backend.upstream_failed("context_overflow", live_tokens=self._live())
            return OVERFLOW
        self._upstream_error(name, "stream_aborted")
        error = obj.get("error")
        message = error.get("message") if isinstance(error, dict) else str(error)
        await client.error(UpstreamError(f"Backend {name!r} failed the answer: {message}"))
        return None
