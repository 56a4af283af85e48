"""One upstream try of a request, with its phase explicit, and what to do after it.

A request admitted on a lease is sent upstream at least once; an :class:`Attempt` is one
such try on one lease. Its :class:`AttemptState` says how far the backend got with it,
which decides how its lease is given back: at once when the backend is known to be done
with the request (or never saw it), else through the slot watch
(:mod:`gateway.admission.slotwatch`), which holds the reservation until ``/slots`` shows
the backend's task ended. Every transition is a method here, so the phase is written in
one place:

    NOT_SENT --sent()--> SENT --began(stream)--> LAUNCHED --finished()--> DONE
                           |    (a whole answer: DONE at once)              ^
                           +--------------------finished()------------------+

After the try, :meth:`Attempt.next_step` answers the one retry question of both relays
(:class:`NextStep`): fail over to another backend, wait for room (the backend was full),
restart at the head of the queue, resume a preempted answer where it stopped, or stop. The response
(:class:`gateway.relay.response.ProxyResponse`) acts on the answer; the steps themselves
are in :mod:`gateway.relay.retry` and, for resuming, :mod:`gateway.relay.tracked`.
"""

from __future__ import annotations

import asyncio
import enum
from dataclasses import dataclass

import httpx

from gateway.admission.lease import Lease
from gateway.admission.slotwatch import Ticket
from gateway.backends.upstream import json_bytes, upstream_request
from gateway.errors import BackendFull, GatewayError
from gateway.request.exchange import Exchange

__all__ = ["Attempt", "AttemptState", "NextStep", "forward_headers", "ticket_for",
           "upstream_request_for"]

# Client request headers forwarded upstream; every other one is dropped (cookies, the
# client's own Authorization, hop-by-hop headers, and X-Conversation-Id, which makes
# llama-server keep generating after a disconnect: shared/design/backends.md §1.5).
# The client's X-Request-Id is not among them: the backend gets the gateway's id of the
# request (Exchange.request_id) instead.
_FORWARD_REQUEST_HEADERS = {
    b"accept", b"user-agent", b"x-correlation-id", b"traceparent", b"tracestate",
}


class AttemptState(enum.Enum):
    """How far the backend got with one upstream try."""

    #: Nothing went upstream yet: the lease can be given back at once.
    NOT_SENT = "not_sent"
    #: The request went upstream; no answer has begun (a long prefill sends nothing).
    SENT = "sent"
    #: A stream's headers came: the backend's task is running.
    LAUNCHED = "launched"
    #: The backend is known to have finished with the request (a whole answer read, a
    #: stream ended, or a connection that never reached it).
    DONE = "done"


class NextStep(enum.Enum):
    """What the relay does once an attempt has ended."""

    #: The answer (or its error) went to the client: nothing more.
    STOP = "stop"
    #: The backend failed before any byte reached the client: admit the request on
    #: another backend of its model, ahead of the queue.
    FAIL_OVER = "fail_over"
    #: The backend refused it for want of room now (its own queue limits, not a
    #: failure): admit it again, ahead of the queue, on whichever backend of its model
    #: has room first, this one included, within its queue wait.
    REQUEUE = "requeue"
    #: The backend overflowed its KV pool and failed the whole answer before any of it
    #: was sent (predictive policy): the same request again, at the head of the queue.
    RESTART = "restart"
    #: The admission preempted a tracked answer (the pool would run short), or the
    #: backend ran out of cells under it: queue its continuation at the head and go on
    #: in the same client answer (:mod:`gateway.relay.tracked`).
    RESUME = "resume"


@dataclass(eq=False)
class Attempt:
    """One upstream try of a request on ``lease``.

    :param lease: the admission lease the try runs on (its slot pins the request).
    :param started: when the try began, seconds on the injected clock.
    :param pending: an upstream send still waiting for its answer when the gateway left
        it (handed to the slot watch, which closes it only once the backend shows the
        task, so that the backend cannot drop it unseen and start it later).
    :param failed: the backend failed the request before answering, and the relay keeps
        this error to try another backend instead of answering it.
    :param full: the backend refused the request for want of room
        (:class:`~gateway.errors.BackendFull`), kept to wait for room instead of
        answering it.
    :param restart: the backend overflowed and failed the whole answer unsent.
    :param preempted: why a tracked try was cut short to be resumed
        (``pool_pressure``, ``overflow``), or ``None``.
    """

    lease: Lease
    started: float
    state: AttemptState = AttemptState.NOT_SENT
    pending: asyncio.Future[httpx.Response] | None = None
    failed: GatewayError | None = None
    full: BackendFull | None = None
    restart: bool = False
    preempted: str | None = None

    def sent(self) -> None:
        """The request is going upstream now."""
        self.state = AttemptState.SENT

    def began(self, *, stream: bool) -> None:
        """The upstream answer began: a stream's task is running, a whole answer is
        complete (llama-server sends a stream's headers with its first result, a whole
        answer all at once)."""
        if self.state is not AttemptState.DONE:
            self.state = AttemptState.LAUNCHED if stream else AttemptState.DONE

    def finished(self) -> None:
        """The backend is known to be done with the request."""
        self.state = AttemptState.DONE

    @property
    def abandoned(self) -> bool:
        """The request went upstream and the backend may still be working on it (the
        client left, a timeout, a preemption): its reservation must wait for the slot
        watch."""
        return self.state in (AttemptState.SENT, AttemptState.LAUNCHED)

    @property
    def launched(self) -> bool:
        """The backend's task is known to have started."""
        return self.state is AttemptState.LAUNCHED

    def next_step(self) -> NextStep:
        """The retry decision once the try has ended: fail over, wait for room,
        resume, restart, or stop (in that order: another backend rather than this one
        again)."""
        if self.failed is not None:
            return NextStep.FAIL_OVER
        if self.full is not None:
            return NextStep.REQUEUE
        if self.preempted is not None:
            return NextStep.RESUME
        return NextStep.RESTART if self.restart else NextStep.STOP


def forward_headers(x: Exchange) -> list[tuple[bytes, bytes]]:
    """The headers of ``x``'s upstream request: the client headers passed on, the JSON
    content type, the request's id (unique per request:
    :func:`gateway.observe.logs.request_id_of`) and the backend's key."""
    headers = [(k, v) for k, v in x.headers if k.lower() in _FORWARD_REQUEST_HEADERS]
    headers.append((b"content-type", b"application/json"))
    if x.request_id is not None:
        headers.append((b"x-request-id", x.request_id))
    headers += [(k.encode(), v.encode()) for k, v in x.backend.settings.auth_headers.items()]
    return headers


def upstream_request_for(x: Exchange, lease: Lease | None) -> httpx.Request:
    """``x``'s upstream request, its body pinned to ``lease``'s slot (when it has one)."""
    headers = forward_headers(x)
    if x.stream and x.backend.dialect.closes_streams:
        # The server closes the connection after a chunked answer despite announcing
        # keep-alive; reusing that pooled connection would fail the next request.
        headers.append((b"connection", b"close"))
    body = x.body if lease is None else x.backend.dialect.pin(x.body, lease)
    return upstream_request("POST", x.backend.route_url(x.route), headers=headers,
                            content=json_bytes(body), timeout=x.backend.timeout)


def ticket_for(x: Exchange, lease: Lease, now: float) -> Ticket:
    """What the slot watch needs to find ``x``'s abandoned task on the backend (its slot
    when pinned, its tasks, its tag and output cap; ``now``: seconds on the clock)."""
    return Ticket(slot=lease.slot_ids[0] if lease.pinned else None, tasks=x.charge.n,
                  tag=x.tag, n_predict=x.charge.max_tokens, since=now)
