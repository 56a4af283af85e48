"""The steps after an attempt that did not answer: marking its backend down, failing over
to another backend, waiting for room after a full backend's refusal, restarting at the
head of the queue.

:meth:`gateway.relay.attempt.Attempt.next_step` decides which (resuming a preempted
answer is the tracked strategy's: :meth:`gateway.relay.tracked.TrackedRelay.resume`);
the functions here carry the step out and return the next lease, or ``None`` once the
client has been answered.
"""

from __future__ import annotations

import logging
from dataclasses import replace

from starlette.types import Send

from gateway.admission.lease import Lease
from gateway.errors import BackendFull, ClientDisconnected, GatewayError, QueueTimeout, describe
from gateway.relay.parts import RelayParts
from gateway.relay.send import refuse, send_error
from gateway.relay.watcher import DisconnectWatcher
from gateway.request.exchange import Exchange

__all__ = ["FULL_BACKOFF_MAX_S", "FULL_BACKOFF_S", "MAX_OVERFLOW_RESTARTS", "fail_over",
           "hold_for_room", "keep_for_failover", "mark_down", "requeue", "restart"]

log = logging.getLogger(__name__)

#: Times a whole answer failed by an overflow is sent again (predictive policy).
MAX_OVERFLOW_RESTARTS = 2
#: Seconds a request waits before it is admitted again after its second refusal for want
#: of room (the first waits only for room: the backend's busy cap holds it until one of
#: the others ends there); doubled at each further refusal, at most FULL_BACKOFF_MAX_S.
FULL_BACKOFF_S = 0.25
FULL_BACKOFF_MAX_S = 4.0


def mark_down(x: Exchange) -> float | None:
    """``x``'s backend failed it before answering: in a pool, mark the backend down for
    the pool's backoff (:meth:`gateway.backends.target.Target.request_failed`) and have
    the pool's queue look again once it has passed, when nothing else would wake its
    waiters. Returns the seconds it is down, or ``None`` for a lone backend (not marked:
    there is no other to route to)."""
    return x.admit_path.backend_failed(x.backend)


def keep_for_failover(parts: RelayParts, exc: GatewayError) -> bool:
    """The backend failed the request before answering (``exc``): mark it down
    (:func:`mark_down`); and keep ``exc`` on the current attempt, to try another
    backend instead of answering it, when the request has one and nothing has reached
    the client yet. Returns whether it was kept.

    A backend that only had no room (:class:`~gateway.errors.BackendFull`) did not fail:
    it is not marked down, and the request is kept to wait for room
    (:func:`hold_for_room`)."""
    if isinstance(exc, BackendFull):
        return hold_for_room(parts, exc)
    x, progress = parts.x, parts.admitter.progress
    down = mark_down(x)
    if down is None:
        return False
    if not x.may_fail_over or (progress is not None and not progress.can_open):
        return False
    assert x.queue is not None
    log.warning("backend %s failed a %s request before answering (%s); down for "
                "%.0f s, trying another backend of %s", x.backend.name, x.route,
                describe(exc), down, x.queue.model)
    parts.tries.now.failed = exc
    return True


def hold_for_room(parts: RelayParts, exc: BackendFull) -> bool:
    """The backend refused the request for want of room now (``exc``, by a limit of its
    own): learn a bound (its slots kept busy at once are capped to what the gateway's
    other requests held there: :meth:`gateway.backends.sizing.Sizing.full`), count it in
    ``gateway_backend_full_total``, and keep ``exc`` on the current attempt so that the
    request waits for room (:func:`requeue`). Never marks the backend down, nor counts an
    upstream error. Returns True (kept)."""
    x, tries = parts.x, parts.tries
    backend = x.backend
    busy = backend.admission.stats().busy_slots
    cap = backend.sizing.full(backend.discovered, busy, x.charge.slots, exc.cause)
    parts.metrics.backend_full.labels(backend.name, exc.cause).inc()
    tries.full_refusals += 1
    log.info("backend %s had no room for a %s request (%s, refusal %d; at most %d busy "
             "there now); it waits for room", backend.name, x.route, exc.cause,
             tries.full_refusals, cap)
    tries.now.full = exc
    return True


async def requeue(parts: RelayParts, watcher: DisconnectWatcher, send: Send
                  ) -> Lease | None:
    """After :attr:`~gateway.relay.attempt.NextStep.REQUEUE`: admit the request again,
    ahead of the queue, on whichever backend of its model has room first (the one that
    refused it included, once room frees there), after :data:`FULL_BACKOFF_S` doubled
    per refusal from the second on; all within its queue wait (the class's
    ``max_queue_wait_s``, else ``admission.max_queue_wait_s``) counted from its arrival.
    Past that, it is answered 503 ``queue_timeout`` with ``Retry-After``, as a wait in
    the gateway's own queue is; or the refusal of the new wait is answered."""
    x, m, clock, tries = parts.x, parts.metrics, parts.clock, parts.tries
    full = tries.now.full
    assert full is not None
    refusals = tries.full_refusals
    delay = 0.0 if refusals < 2 else min(FULL_BACKOFF_MAX_S,
                                         FULL_BACKOFF_S * 2 ** (refusals - 2))
    if tries.full_deadline is None:  # the first refusal: the wait is counted from arrival
        tries.full_deadline = x.started + (
            x.party.max_wait_s if x.party.max_wait_s is not None else x.admit_path.max_wait_s)
    limit = tries.full_deadline - x.started
    left = tries.full_deadline - clock.now()
    try:
        if left <= delay:
            raise QueueTimeout(
                f"Backend {x.backend.name!r} had no room for the request ({full.cause}, "
                f"{refusals} refusals) and no backend of its model took it within its "
                f"queue wait of {limit:g} s; retry after the Retry-After delay.",
                retry_after_s=full.retry_after_s)
        if delay:
            paused = x.backend
            paused.pausing += 1  # work in hand for a drain, though it holds no lease
            try:
                await watcher.race(clock.sleep(delay))
            finally:
                paused.pausing -= 1
        x.party = replace(x.party, max_wait_s=left - delay)
        return await watcher.race(x.admit(front=True))
    except ClientDisconnected:
        x.status = 499
    except GatewayError as refused:
        await refuse(send, refused, x, m, x.backend.name)
    return None


async def fail_over(parts: RelayParts, watcher: DisconnectWatcher, send: Send
                    ) -> Lease | None:
    """After :attr:`~gateway.relay.attempt.NextStep.FAIL_OVER`: admit the request on
    another backend of its model, ahead of the queue; or answer the refusal."""
    x, m = parts.x, parts.metrics
    assert x.queue is not None
    failed = x.backend
    x.candidates = [c for c in x.candidates if c.backend is not failed]
    m.failovers.labels(x.queue.model).inc()
    if x.trace is not None:
        x.trace.event("gateway.failover", **{"gateway.backend": failed.name})
    try:
        return await watcher.race(x.admit(front=True))
    except ClientDisconnected:
        x.status = 499
    except GatewayError as refused:
        await refuse(send, refused, x, m, failed.name)
    return None


async def restart(parts: RelayParts, watcher: DisconnectWatcher, send: Send
                  ) -> Lease | None:
    """After :attr:`~gateway.relay.attempt.NextStep.RESTART`: the backend overflowed and
    failed this whole answer before any of it was sent (predictive policy), so the same
    request queues again at the head; or the client is told why it cannot."""
    x, m = parts.x, parts.metrics
    name = x.backend.name
    m.preemptions.labels(name, "overflow").inc()
    if x.trace is not None:
        x.trace.event("gateway.preempted", **{"gateway.reason": "overflow",
                                              "gateway.backend": name})
    try:
        lease = await watcher.race(x.readmit(front=True))
    except ClientDisconnected:
        m.resumes.labels(name, "client_gone").inc()
        x.status = 499
        return None
    except GatewayError as exc:
        m.resumes.labels(name, "failed").inc()
        await send_error(send, exc, x)
        return None
    m.resumes.labels(name, "restarted").inc()
    if x.trace is not None:
        x.trace.event("gateway.resumed", **{"gateway.outcome": "restarted"})
    return lease
