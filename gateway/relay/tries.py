"""The upstream tries of one request, as the relay keeps them: :class:`Tries`.

Both relays (:mod:`gateway.relay.plain`, :mod:`gateway.relay.tracked`) run a request as
one or more :class:`~gateway.relay.attempt.Attempt` objects, one per lease. What they
share about them is here: starting one, noting that it went upstream, counting how it
failed, and giving its lease back (at once, or through the slot watch when the backend
may still be working on it).
"""

from __future__ import annotations

import httpx

from gateway.admission.lease import Lease
from gateway.clock import Clock
from gateway.errors import GatewayError
from gateway.observe.metrics import GatewayMetrics
from gateway.observe.tracing import OPERATIONS
from gateway.relay.attempt import Attempt, ticket_for, upstream_request_for
from gateway.relay.send import failure_kind
from gateway.request.exchange import Exchange
from gateway.wire.naming import served_name

__all__ = ["Tries"]


class Tries:
    """The attempts of request ``x`` (only the last is kept) and what they did.

    :ivar current: the upstream try under way, or the last one (``None`` before the
        first).
    :ivar forwarded: some attempt went upstream.
    :ivar sends: attempts that went upstream.
    :ivar full_refusals: times a backend refused it for want of room
        (:func:`gateway.relay.retry.hold_for_room`).
    :ivar full_deadline: after such a refusal, the clock time (seconds) past which it
        waits no more (:func:`gateway.relay.retry.requeue`).
    """

    def __init__(self, x: Exchange, metrics: GatewayMetrics, clock: Clock) -> None:
        self.x = x
        self.metrics = metrics
        self.clock = clock
        self.current: Attempt | None = None
        self.forwarded = False
        self.sends = 0
        self.full_refusals = 0
        self.full_deadline: float | None = None

    @property
    def charged(self) -> bool:
        """Some attempt went upstream and was not refused for want of room: the tenant
        is charged the request's tokens. A refusal for want of room ran nothing (vLLM
        refuses before it renders the prompt), so a request that had only those costs
        its tenant nothing, as one the gateway's own queue timed out."""
        return self.sends > self.full_refusals

    @property
    def now(self) -> Attempt:
        """The attempt under way (there is one from :meth:`start` on).

        :raises AssertionError: before the first attempt.
        """
        assert self.current is not None
        return self.current

    def start(self, lease: Lease) -> float:
        """Begin a new attempt on ``lease`` (the last one's upstream state is
        forgotten), noting what its slot will cache; returns the clock time it starts,
        seconds (for :meth:`give_back`)."""
        self.current = Attempt(lease, self.clock.now())
        # (the SLO limit and prefill deferral read it)
        self.x.backend.admission.slo.set_itl_target(lease, self.x.party.itl_target_s)
        self.x.backend.remember_slot(self.x.prefix, lease)
        return self.current.started

    def sent(self) -> None:
        """The attempt's request is going upstream now."""
        self.now.sent()
        self.forwarded = True
        self.sends += 1

    def upstream_request(self) -> httpx.Request:
        """The request the current attempt sends (pinned to its lease's slot); when
        traced, it carries its attempt span's context (:mod:`gateway.observe.tracing`)."""
        lease = None if self.current is None else self.current.lease
        return self.traced(upstream_request_for(self.x, lease))

    def traced(self, request: httpx.Request) -> httpx.Request:
        """``request``, the current attempt's, with its attempt span begun and its
        context in its headers when the request is traced (:mod:`gateway.observe.tracing`)."""
        x = self.x
        if x.trace is not None:
            request.headers.update({k.decode(): v.decode() for k, v in x.trace.attempt_begins(
                OPERATIONS.get(x.route, x.route), served_name(x.backend.model), x.backend.name,
                str(request.url), x.charge.max_tokens, x.stream)})
        return request

    def upstream_error(self, kind: str) -> None:
        """Count a failure of the request's backend in
        ``gateway_upstream_errors_total`` under ``kind``, and keep the kind for the
        request's access line."""
        self.metrics.upstream_errors.labels(self.x.backend.name, kind).inc()
        self.x.upstream_error = kind

    def broke(self, exc: GatewayError) -> str:
        """Note a transport failure ``exc`` of the current attempt; return its
        ``gateway_upstream_errors_total`` kind (not counted here).

        A refused connection reached nothing. A connection the backend broke under an
        unpinned request ends that request too (nothing else can be learnt of it:
        ``/slots`` cannot tell its tasks apart); a timeout may leave it running.
        """
        kind = failure_kind(exc)
        attempt = self.current
        unpinned = attempt is not None and not attempt.lease.pinned
        if attempt is not None and (kind == "connect" or (unpinned and kind != "timeout")):
            attempt.finished()
        return kind

    def _outcome(self) -> str | None:
        """How the current attempt ended short, for its trace: the failure's kind,
        ``backend_full``, ``overflow``, or the request's last upstream error (``None``:
        none). A preemption is known only after the attempt is given back: it is an
        event on the request's span (:mod:`gateway.relay.tracked`)."""
        a = self.current
        if a is None:
            return None
        if a.failed is not None:
            return failure_kind(a.failed)
        return ("backend_full" if a.full is not None else "overflow" if a.restart
                else self.x.upstream_error)

    def give_back(self, lease: Lease, held_since: float, *, served: bool, stream: bool,
                  quick: bool = False) -> None:
        """Release ``lease`` after an attempt that began at ``held_since``: at once when
        the backend is known to be done with the request, else through the slot watch.

        :param served: the attempt answered (its duration feeds the backend's record).
        :param stream: the upstream request was a stream (its headers mean "started").
        :param quick: the gateway cut the stream itself to make room: read ``/slots``
            soon (:data:`gateway.admission.slotwatch.QUICK_POLL_S`).
        """
        x = self.x
        if x.trace is not None:
            x.trace.attempt_ends(x.status, self._outcome())
        if served:
            x.backend.admission.record_duration(self.clock.now() - held_since, x.charge)
        attempt = self.current
        if attempt is not None and attempt.abandoned:
            # The gateway left before the backend finished (client gone, timeout,
            # preemption). The backend may go on using the slot's cells for a while:
            # keep the reservation until it is seen to end (gateway.admission.slotwatch).
            # An upstream request still waiting for its answer is handed on open, so
            # that the backend cannot drop it unseen and start it later.
            x.backend.slot_watch.hold(
                lease, ticket_for(x, lease, self.clock.now()), served=served,
                pending=attempt.pending, stream=stream, launched=attempt.launched,
                quick=quick,
            )
        else:
            x.backend.admission.release(lease, served=served)
