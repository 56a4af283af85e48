"""The steps after an attempt that did not answer: marking its backend down, failing over
to another backend, restarting at the head of the queue.

:meth:`gateway.relay.attempt.Attempt.next_step` decides which (resuming a preempted
answer is the tracked strategy's: :meth:`gateway.relay.tracked.TrackedRelay.resume`);
the functions here carry the step out and return the next lease, or ``None`` once the
client has been answered.
"""

from __future__ import annotations

import logging

from starlette.types import Send

from gateway.admission.lease import Lease
from gateway.errors import ClientDisconnected, GatewayError, describe
from gateway.relay.parts import RelayParts
from gateway.relay.send import send_error
from gateway.relay.watcher import DisconnectWatcher
from gateway.request.exchange import Exchange

__all__ = ["MAX_OVERFLOW_RESTARTS", "fail_over", "keep_for_failover", "mark_down",
           "restart"]

log = logging.getLogger(__name__)

#: Times a whole answer failed by an overflow is sent again (predictive policy).
MAX_OVERFLOW_RESTARTS = 2


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
    the client yet. Returns whether it was kept."""
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


async def fail_over(parts: RelayParts, watcher: DisconnectWatcher, send: Send
                    ) -> Lease | None:
    """After :attr:`~gateway.relay.attempt.NextStep.FAIL_OVER`: admit the request on
    another backend of its model, ahead of the queue; or answer the refusal."""
    x, m = parts.x, parts.metrics
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
        await send_error(send, refused, x)
    return None


async def restart(parts: RelayParts, watcher: DisconnectWatcher, send: Send
                  ) -> Lease | None:
    """After :attr:`~gateway.relay.attempt.NextStep.RESTART`: the backend overflowed and
    failed this whole answer before any of it was sent (predictive policy), so the same
    request queues again at the head; or the client is told why it cannot."""
    x, m = parts.x, parts.metrics
    name = x.backend.name
    m.preemptions.labels(name, "overflow").inc()
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
    return lease
