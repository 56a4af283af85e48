"""Forward one admitted request upstream and relay the answer, holding its lease.

:class:`ProxyResponse` is an ASGI response. When called it:

1. waits for a lease in the backend's admission queue (leaving the queue, and
   forwarding nothing, if the client disconnects meanwhile);
2. sends the request upstream and relays the answer: JSON whole, SSE event by event;
3. releases the lease in ``finally`` whatever happened, and closes the upstream
   response so that llama-server cancels the task and frees the slot.

Until the status line is sent, failures become OpenAI-style JSON errors. After it, a
failure becomes one final ``data: {"error": …}`` event, and no ``[DONE]`` is invented.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Callable
from dataclasses import replace
from typing import Any

import httpx
from starlette.responses import Response
from starlette.types import Receive, Scope, Send

from gateway.admission.lease import Lease
from gateway.admission.slotwatch import Ticket
from gateway.backends.upstream import (
    map_upstream_errors,
    never_reached,
    send_upstream,
)
from gateway.clock import Clock, wait
from gateway.errors import (
    ClientDisconnected,
    GatewayError,
    ShuttingDown,
    UpstreamError,
    describe,
)
from gateway.fleet.tasks import TaskSet
from gateway.observe.metrics import GatewayMetrics
from gateway.observe.record import record_of
from gateway.relay.attempt import (
    Attempt,
    NextStep,
    ticket_for,
    upstream_request_for,
)
from gateway.relay.inspect import StreamInspector, TokenTimes
from gateway.relay.send import (
    SSE_HEADERS,
    Started,
    Unraced,
    body_message,
    failure_kind,
    unless_gone,
    usage_of,
)
from gateway.relay.usage import UsageBook
from gateway.relay.watcher import DisconnectWatcher
from gateway.request.exchange import Exchange
from gateway.wire.shapes import (
    error_messages,
    ndjson_error_line,
    reshaped,
    sse_error_event,
)
from gateway.wire.sse import EventSplitter, EventTooLarge

__all__ = ["ProxyResponse"]

log = logging.getLogger(__name__)

# Upstream response headers relayed on whole (non-SSE) answers.
_PASS_RESPONSE_HEADERS = ("retry-after", "retry-after-ms", "x-should-retry")
# Times a whole answer failed by an overflow is sent again (predictive policy).
MAX_OVERFLOW_RESTARTS = 2
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


class ProxyResponse(Response):
    """ASGI response that admits, forwards and relays one request (see module doc)."""

    def __init__(
        self, exchange: Exchange, *, client: httpx.AsyncClient, metrics: GatewayMetrics,
        clock: Clock, cut: asyncio.Event | None = None, tasks: TaskSet | None = None,
    ) -> None:
        self.x = exchange
        self.client = client
        self.metrics = metrics
        self.clock = clock
        self.cut = cut  # set when the gateway's drain runs out of time
        self.tasks = TaskSet() if tasks is None else tasks  # the app's background tasks
        # Once a relayed stream has sent its 200: how to write its final error event.
        self._stream_final: Callable[[GatewayError], bytes] | None = None
        self._attempt: Attempt | None = None  # the upstream try under way, or the last
        self._progress: Started | None = None  # the send that may open the stream early
        self._restarts = 0
        self._gated = False  # past the tenant's gate (gateway.admission.tenants.Tenant.enter)
        self._forwarded = False  # some attempt went upstream
        self.usage = UsageBook(exchange, metrics, clock)  # the tokens it used
        self._itl: Any = None  # gateway_itl_seconds for the backend named _itl_of
        self._itl_of: str | None = None
        self._tail: AsyncIterator[bytes] | None = None  # a whole stream's unread rest
        self.background = None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        watcher = DisconnectWatcher(receive, self.cut)
        watcher.start()
        x = self.x
        failed = False  # an unexpected error: the middleware answers 500 if it can
        try:
            await self._admit_and_forward(watcher, send)
        except Exception:
            failed = True
            raise
        finally:
            await watcher.stop()
            if self._gated and x.tenant is not None:
                x.tenant.leave()
            self.usage.settle(self._forwarded)
            # gateway.http.middleware counts the request with this status (499: client left),
            # under the backend that took it (in a pool, known once admitted).
            record = record_of(scope)
            if x.status or not failed:
                record.final_status = x.status or 499
            record.backend = x.backend.name
            record.queue_wait_s, record.ttft_s = x.queue_wait_s, x.ttft_s
            record.forwarded = self._forwarded
            record.upstream_error = x.upstream_error
            if x.reason is not None:
                record.reason = x.reason
            self.metrics.duration.labels(x.backend.name).observe(self.clock.now() - x.started)

    async def _send_error(self, send: Send, exc: GatewayError) -> None:
        start, body = error_messages(exc, self.x.api)
        self.x.status = exc.status_code
        await send(start)
        await send(body)

    async def _wait_with_progress(self, watcher: DisconnectWatcher, send: Started, *,
                                  front: bool = False, prefer: int | None = None) -> Lease:
        """Wait for a lease while telling the client where it stands: once the request
        is queued (a full queue or a doomed wait is still answered with its own status),
        the 200 and SSE headers go out, then ``: queued position=N eta_s=M`` every
        ``progress_s`` (an SSE comment, which clients ignore and proxies count as
        traffic). What follows goes through ``send`` (:class:`gateway.relay.send.Started`).

        ``front`` and ``prefer`` are passed to the admission (a preempted request coming
        back, whose stream may have started already).

        :raises GatewayError: as :meth:`Admission.admit`.
        :raises ClientDisconnected: the client left while waiting.
        """
        x = self.x
        admit = asyncio.ensure_future(
            x.backend.admit(x.charge, front=front, prefer=prefer, party=x.party)
            if front or prefer
            is not None else x.admit())
        await asyncio.sleep(0)  # admit refuses at once, or queues
        if admit.done():
            return admit.result()
        try:
            if send.can_open:
                await send.open(SSE_HEADERS + x.extra_headers)
            while True:
                try:  # the lease, or the next progress comment's time
                    return await watcher.race(wait(self.clock, admit, x.progress_s))
                except TimeoutError:
                    pass
                where = x.queue_progress()
                if where is not None and send.streaming:
                    eta = "" if where[1] is None else f" eta_s={where[1]:.0f}"
                    await send.raw(body_message(
                        f": queued position={where[0]}{eta}\n\n".encode()))
        except BaseException:
            admit.cancel()
            await asyncio.gather(admit, return_exceptions=True)
            raise

    async def _obtain(self, watcher: DisconnectWatcher, send: Send
                      ) -> tuple[Lease | None, Send]:
        """Wait for a lease (with queue progress when asked), count the wait, and add the
        queue headers; or answer the refusal and return ``None``. Also returns the
        ``send`` to use from then on (wrapped once progress has started the stream)."""
        x, m, name = self.x, self.metrics, self.x.backend.name
        if x.progress_s > 0:
            send = self._progress = Started(send, x.api)  # opens early: queue, prefill
        tenant, waiting, gate_s = x.tenant, False, 0.0
        try:
            if tenant is not None:
                gate_s = await watcher.race(tenant.enter(x.party.max_wait_s or 0.0,
                                                         self.clock))
                self._gated = True
                if gate_s and x.party.max_wait_s is not None:  # the gate used some wait
                    x.party = replace(x.party, max_wait_s=max(0.001,
                                                              x.party.max_wait_s - gate_s))
            lease = x.try_admit()
            if lease is None and tenant is not None:
                tenant.start_waiting(self.clock.now())
                waiting = True
            if lease is None and isinstance(send, Started):
                lease = await self._wait_with_progress(watcher, send)
            elif lease is None:
                lease = await watcher.race(x.admit())
        except ClientDisconnected:
            x.reason = "client_disconnected"
            m.rejections.labels(name, x.reason, *x.who).inc()
            return None, send
        except GatewayError as exc:
            x.reason = exc.rejection_reason or "other"
            m.rejections.labels(name, x.reason, *x.who).inc()
            await self._send_error(send, exc)
            return None, send
        finally:
            if waiting and tenant is not None:
                tenant.stop_waiting()
        name = x.backend.name  # the backend the lease is on
        lease.waited_s += gate_s
        x.queue_wait_s = lease.waited_s
        m.queue_wait.labels(name, *x.who).observe(lease.waited_s)
        x.extra_headers.append((b"x-queue-wait-ms", str(round(lease.waited_s * 1000)).encode()))
        if lease.predicted_wait_s is not None:
            m.queue_wait_prediction_error.labels(name).observe(
                lease.waited_s - lease.predicted_wait_s)
            x.extra_headers.append((b"x-queue-predicted-wait-ms",
                                    str(round(lease.predicted_wait_s * 1000)).encode()))
        return lease, send

    async def _begun(self, sending: asyncio.Future[httpx.Response]) -> httpx.Response:
        """Wait for the upstream answer to begin. llama-server sends a stream's headers
        with its first token, so a long prefill sends nothing for minutes; a stream that
        asked for progress gets its 200 (unless a response already started) and
        ``: processing prompt`` every ``progress_s`` meanwhile (shared case P13).
        Cancelling this wait leaves ``sending`` running."""
        x, progress = self.x, self._progress
        while True:
            done, _ = await asyncio.wait({sending}, timeout=x.progress_s or None)
            if done:
                return sending.result()
            if progress is None:
                continue
            try:
                if progress.can_open:
                    await progress.open(SSE_HEADERS + x.extra_headers)
                if progress.streaming:
                    await progress.raw(body_message(b": processing prompt\n\n"))
            except OSError:
                pass  # the client has gone; the caller notices

    async def _admit_and_forward(self, watcher: DisconnectWatcher, send: Send) -> None:
        x, m = self.x, self.metrics
        lease, send = await self._obtain(watcher, send)
        while lease is not None:
            await self._hold(watcher, send, lease)
            assert self._attempt is not None
            step = self._attempt.next_step()
            if step is NextStep.FAIL_OVER:
                lease = await self._fail_over(watcher, send)
                continue
            if step is NextStep.STOP:
                return
            name = x.backend.name
            # The backend overflowed and failed this whole answer before any of it was
            # sent (predictive policy): the same request again, at the head of the queue.
            m.preemptions.labels(name, "overflow").inc()
            try:
                lease = await watcher.race(x.backend.admit(x.charge, front=True,
                                                           party=x.party))
            except ClientDisconnected:
                m.resumes.labels(name, "client_gone").inc()
                x.status = 499
                return
            except GatewayError as exc:
                m.resumes.labels(name, "failed").inc()
                await self._send_error(send, exc)
                return
            m.resumes.labels(name, "restarted").inc()

    def _fails_over(self, exc: GatewayError) -> bool:
        """The backend failed the request before answering (``exc``): in a pool, mark it
        down; and keep ``exc`` to try another backend instead of answering it, when the
        request has one and nothing has reached the client yet."""
        x, progress = self.x, self._progress
        if x.queue is None:
            return False
        down = x.backend.request_failed(x.queue.down_initial_s, x.queue.down_max_s)
        x.queue.wake_later(down)
        if not x.may_fail_over or (progress is not None and not progress.can_open):
            return False
        log.warning("backend %s failed a %s request before answering (%s); down for "
                    "%.0f s, trying another backend of %s", x.backend.name, x.route,
                    describe(exc), down, x.queue.model)
        assert self._attempt is not None
        self._attempt.failed = exc
        return True

    async def _fail_over(self, watcher: DisconnectWatcher, send: Send) -> Lease | None:
        """The backend failed the request before any byte reached the client (it is
        marked down): admit the request on another backend of its model, ahead of the
        queue; or answer the refusal."""
        x, m = self.x, self.metrics
        assert x.queue is not None
        failed = x.backend
        x.candidates = [c for c in x.candidates if c.backend is not failed]
        m.failovers.labels(x.queue.model).inc()
        try:
            return await watcher.race(x.admit(front=True))
        except ClientDisconnected:
            x.status = 499
        except GatewayError as refused:
            x.reason = refused.rejection_reason or "other"
            m.rejections.labels(failed.name, x.reason, *x.who).inc()
            await self._send_error(send, refused)
        return None

    async def _hold(self, watcher: DisconnectWatcher, send: Send, lease: Lease) -> None:
        """Forward and relay on ``lease``, and give it back whatever happens."""
        x, name = self.x, self.x.backend.name
        held_since = self._start_attempt(lease)
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
            self._give_back(lease, held_since, served=200 <= x.status < 400,
                            stream=x.stream)

    async def _cut_off(self, send: Send, exc: ShuttingDown) -> None:
        """The drain ran out of time with this request in hand (its upstream request is
        closed by now): end a started stream with a final error event, or answer 503."""
        x = self.x
        x.upstream_error = "shutting_down"  # for the access line: cut by the drain
        log.info("drain timeout: cut a %s request on backend %s", x.route, x.backend.name)
        try:
            if self._stream_final is not None:
                await send(body_message(self._stream_final(exc)))
                await send({"type": "http.response.body", "body": b"", "more_body": False})
            elif self._progress is not None and self._progress.streaming:
                await send(body_message(sse_error_event(exc, x.api)))
                await send({"type": "http.response.body", "body": b"", "more_body": False})
            else:
                await self._send_error(send, exc)
        except OSError:
            pass  # the client is gone too

    def _start_attempt(self, lease: Lease) -> float:
        """Begin a new :class:`~gateway.relay.attempt.Attempt` on ``lease`` (the last
        one's upstream state is forgotten); returns the clock time it starts (for
        :meth:`_give_back`)."""
        self._attempt = Attempt(lease, self.clock.now())
        self.x.backend.remember_slot(self.x.prefix, lease)  # what its slot will cache
        return self._attempt.started

    def _give_back(self, lease: Lease, held_since: float, *, served: bool, stream: bool,
                   quick: bool = False) -> None:
        """Release ``lease`` after an attempt that began at ``held_since``: at once when
        the backend is known to be done with the request, else through the slot watch.

        :param stream: the upstream request was a stream (its headers mean "started").
        :param quick: the gateway cut the stream itself to make room: read ``/slots``
            soon (:data:`gateway.admission.slotwatch.QUICK_POLL_S`).
        """
        x = self.x
        if served:
            x.backend.record_duration(self.clock.now() - held_since, x.charge)
        attempt = self._attempt
        if attempt is not None and attempt.abandoned:
            # The gateway left before the backend finished (client gone, timeout,
            # preemption). The backend may go on using the slot's cells for a while: keep
            # the reservation until it is seen to end (gateway.admission.slotwatch). An upstream
            # request still waiting for its answer is handed on open, so that the backend
            # cannot drop it unseen and start it later.
            x.backend.release_abandoned(
                lease, self._ticket(lease), served=served, pending=attempt.pending,
                stream=stream, launched=attempt.launched, quick=quick,
            )
        else:
            x.backend.release(lease, served=served)

    @property
    def _now(self) -> Attempt:
        """The attempt under way (there is one from :meth:`_start_attempt` on)."""
        assert self._attempt is not None
        return self._attempt

    def _sent_upstream(self) -> None:
        """The attempt's request is going upstream now."""
        self._now.sent()
        self._forwarded = True

    def _upstream_error(self, backend: str, kind: str) -> None:
        """Count a failure of ``backend`` in ``gateway_upstream_errors_total`` under
        ``kind``, and keep the kind for the request's access line."""
        self.metrics.upstream_errors.labels(backend, kind).inc()
        self.x.upstream_error = kind

    def _broke(self, exc: GatewayError) -> str:
        """Note an upstream failure; return its ``gateway_upstream_errors_total`` kind.

        A refused connection reached nothing. A connection the backend broke under an
        unpinned request ends that request too (nothing else can be learnt of it:
        ``/slots`` cannot tell its tasks apart); a timeout may leave it running.
        """
        kind = failure_kind(exc)
        attempt = self._attempt
        unpinned = attempt is not None and not attempt.lease.pinned
        if attempt is not None and (kind == "connect" or (unpinned and kind != "timeout")):
            attempt.finished()
        return kind

    def _ticket(self, lease: Lease) -> Ticket:
        return ticket_for(self.x, lease, self.clock.now())

    def _upstream_request(self) -> httpx.Request:
        lease = None if self._attempt is None else self._attempt.lease
        return upstream_request_for(self.x, lease)

    async def _forward(self, watcher: DisconnectWatcher, send: Send) -> None:
        x, name = self.x, self.x.backend.name
        try:
            with map_upstream_errors(name):
                request = self._upstream_request()
                self._sent_upstream()
                sending = asyncio.ensure_future(
                    send_upstream(self.client, request, stream=True))
                try:
                    resp = await watcher.race(self._begun(sending))
                except BaseException:
                    if not sending.done():
                        self._now.pending = sending  # handed on open (see _hold)
                    raise
        except GatewayError as exc:
            kind = self._broke(exc)
            self._upstream_error(name, kind)
            x.backend.upstream_failed(kind)
            if not (never_reached(exc) and self._fails_over(exc)):
                await self._send_error(send, exc)
            return
        # llama-server sends a stream's headers with its first result and a whole answer
        # all at once: either way the task has started, or ended.
        self._now.began(stream=x.stream)
        try:
            ctype = resp.headers.get("content-type", "")
            ndjson = ctype.startswith("application/x-ndjson")
            streaming = x.stream and resp.status_code < 400 and (
                ctype.startswith("text/event-stream") or ndjson)
            if resp.status_code < 500 and not streaming:
                x.backend.request_served()  # a stream: once its first event comes
            if streaming:
                await watcher.race(self._relay_stream(send, resp, ndjson=ndjson))
            else:
                await self._relay_whole(watcher, send, resp)
        finally:
            if self._tail is not None:
                close_after_drain(self._tail, resp, self.tasks)
            else:
                await resp.aclose()

    async def _read_all(self, watcher: DisconnectWatcher, resp: httpx.Response) -> bytes:
        """Read the whole upstream body. Counts and re-raises upstream failures."""
        try:
            with map_upstream_errors(self.x.backend.name):
                body = await watcher.race(resp.aread())
                self._now.finished()
                return body
        except GatewayError as exc:
            kind = self._broke(exc)
            self._upstream_error(self.x.backend.name, kind)
            raise

    async def _relay_whole(
        self, watcher: DisconnectWatcher, send: Send, resp: httpx.Response
    ) -> None:
        """Read a whole answer, translate backend errors, record usage, and send it."""
        x = self.x
        try:
            body = await self._read_all(watcher, resp)
        except GatewayError as failed:
            await self._send_error(send, failed)
            return
        if resp.status_code >= 400:
            exc = x.backend.translate_error(
                resp.status_code, body, resp.headers.get("retry-after")
            )
            if exc is not None:
                kind = exc.upstream_kind
                if kind:
                    self._upstream_error(x.backend.name, kind)
                    x.backend.upstream_failed(kind)
                if (kind == "context_overflow" and x.backend.predictive
                        and self._restarts < MAX_OVERFLOW_RESTARTS):
                    self._restarts += 1
                    self._now.restart = True  # nothing was sent: try it whole again
                    return
                if (resp.status_code >= 500 and kind != "context_overflow"
                        and self._fails_over(exc)):
                    return
                await self._send_error(send, exc)
                return
            if x.api in ("openai", "anthropic"):
                body = reshaped(resp.status_code, body, x.api)
        else:
            usage, reasons = await usage_of(x.route, body)
            self.usage.record(self.usage.all_choices(usage, reasons))
        await self._send_whole(send, resp, body)

    async def _send_whole(self, send: Send, resp: httpx.Response, body: bytes) -> None:
        ctype = resp.headers.get("content-type", "application/json").encode()
        headers = [(b"content-type", ctype), (b"content-length", str(len(body)).encode())]
        for name in _PASS_RESPONSE_HEADERS:
            if name in resp.headers:
                headers.append((name.encode(), resp.headers[name].encode()))
        retry_after = resp.headers.get("retry-after", "")
        if "retry-after-ms" not in resp.headers and retry_after.isdigit():
            headers.append((b"retry-after-ms", str(int(retry_after) * 1000).encode()))
        self.x.status = resp.status_code
        await send({
            "type": "http.response.start", "status": resp.status_code,
            "headers": headers + self.x.extra_headers,
        })
        await send({"type": "http.response.body", "body": body})

    async def _relay_stream(self, send: Send, resp: httpx.Response, *, ndjson: bool = False
                            ) -> None:
        """Relay an SSE stream (or, ``ndjson``, Ollama's newline-delimited JSON) event by
        event; a failure after the start becomes one final error event or line."""
        x, name = self.x, self.x.backend.name
        x.status = resp.status_code
        headers = _NDJSON_HEADERS if ndjson else SSE_HEADERS
        start = {"type": "http.response.start", "status": resp.status_code,
                 "headers": headers + x.extra_headers}
        opened = False  # the 200 goes out with the first event, so that a backend dying
        # before it can still be failed over (nothing has reached the client)

        async def emit(data: bytes) -> None:
            nonlocal opened
            if not opened:
                opened = True
                x.backend.request_served()
                self._stream_final = final
                await send(start)
            await send(body_message(data))

        async def failed(exc: GatewayError) -> bool:
            """Before the first event: fail over, or answer ``exc`` with its own status
            (nothing has reached the client, so it need not be a 200 and an event)."""
            if opened:
                return False
            x.status = 0
            if not self._fails_over(exc):
                await self._send_error(send, exc)
            return True

        splitter = EventSplitter(lines=ndjson)
        state = StreamInspector(x.spec, x.api, x.charge.n, x.client_wants_usage,
                                x.backend.is_overflow_event, ndjson=ndjson)
        times = TokenTimes()

        def final(exc: GatewayError) -> bytes:
            return ndjson_error_line(exc) if ndjson else sse_error_event(exc, x.api)
        chunks = resp.aiter_raw()
        try:
            with map_upstream_errors(name):
                async for chunk in chunks:
                    # The events of one upstream read go out in one write: one ASGI
                    # message and one socket write, not one per event.
                    out = [relayed for raw in splitter.feed(chunk)
                           if (relayed := self._inspected(raw, state, times)) is not None]
                    if out:
                        await emit(out[0] if len(out) == 1 else b"".join(out))
                    if state.whole:
                        # The last event is relayed: the answer is whole. A client that
                        # closes now (the OpenAI SDK does, at [DONE]) has not left early.
                        break
        except EventTooLarge as too_large:
            self._upstream_error(name, "stream_aborted")
            await emit(final(UpstreamError(
                f"Backend {name!r} sent an event too large to relay: {too_large}.")))
        except GatewayError as exc:
            self._upstream_error(name, self._broke(exc))
            if await failed(exc):
                return
            await emit(final(exc))
        else:
            self._now.finished()
            if not state.done and not state.errored:
                self._upstream_error(name, "stream_aborted")
                exc2 = UpstreamError(f"Backend {name!r} closed the stream before it finished.")
                if await failed(exc2):
                    return
                await emit(final(exc2))
        if not opened:
            opened = True
            await send(start)
        self.usage.record(state.stream_usage(x.backend.dialect.usage_covers_one_choice))
        await send({"type": "http.response.body", "body": b"", "more_body": False})
        if state.whole and not x.backend.dialect.closes_streams:
            self._tail = chunks  # read to its end in the background, to pool the connection

    def _inspected(self, raw: bytes, inspector: StreamInspector, times: TokenTimes
                   ) -> bytes | None:
        """Feed one event to ``inspector`` and act on what it showed (TTFT and ITL for
        output, the upstream error's count); return what to relay, or ``None``."""
        relayed, token, error = inspector.feed(raw)
        if token:
            self._token_seen(times)
        if error is not None:
            backend = self.x.backend
            self._upstream_error(backend.name, error)
            if error == "context_overflow":
                backend.upstream_failed(error)
        return relayed

    def _token_seen(self, state: TokenTimes) -> None:
        self.usage.streamed += 1
        if not self.x.stream:
            # A whole answer followed token by token upstream (the predictive policy):
            # its client sees no first token, so no TTFT or ITL, as under strict.
            return
        now = self.clock.now()
        if state.last_token is None:
            ttft = now - self.x.started
            if self.x.ttft_s is None:  # a resumed answer's first token is not its first
                self.x.ttft_s = ttft
            self.metrics.ttft.labels(self.x.backend.name).observe(ttft)
        else:
            name = self.x.backend.name
            if self._itl_of != name:  # the labelled child, looked up once per backend
                self._itl, self._itl_of = self.metrics.itl.labels(name), name
            self._itl.observe(now - state.last_token)
        state.last_token = now
