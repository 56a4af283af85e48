"""How the relay obtains a request's lease: :class:`Admitter`.

The tenant's gate first (:meth:`gateway.admission.tenants.Tenant.enter`), then a lease
at once or after a wait in the backend's (or the pool's) queue, with queue progress when
the request asked for it (:mod:`gateway.relay.progress`). A refusal is answered here, in
the request's error shape, and counted in ``gateway_rejections_total``; a lease is
counted in ``gateway_queue_wait_seconds`` and described in the ``x-queue-*`` headers.
"""

from __future__ import annotations

import asyncio
from dataclasses import replace

from starlette.types import Send

from gateway.admission.lease import Lease
from gateway.admission.slo import spent
from gateway.clock import Clock
from gateway.errors import ClientDisconnected, GatewayError
from gateway.observe.metrics import GatewayMetrics
from gateway.relay.progress import queued
from gateway.relay.send import Started, refuse
from gateway.relay.watcher import DisconnectWatcher
from gateway.request.exchange import Exchange

__all__ = ["Admitter"]


class Admitter:
    """Obtains leases for request ``x``: its first (:meth:`obtain`) and, for a resumed
    answer, later ones at the head of the queue (:meth:`wait`).

    :ivar progress: the send that may open the stream early (queue progress, prefill
        progress), once :meth:`obtain` made it; ``None`` when the request did not ask.
    :ivar gated: the request is past its tenant's gate, and must :meth:`leave` it.
    """

    def __init__(self, x: Exchange, metrics: GatewayMetrics, clock: Clock) -> None:
        self.x = x
        self.metrics = metrics
        self.clock = clock
        self.progress: Started | None = None
        self.gated = False
        self.since = 0.0  # when obtain began (clock seconds): the tenant's gate, the queue

    def leave(self) -> None:
        """Leave the tenant's gate, if the request went through it."""
        if self.gated and self.x.tenant is not None:
            self.x.tenant.leave()

    async def obtain(self, watcher: DisconnectWatcher, send: Send
                     ) -> tuple[Lease | None, Send]:
        """Wait for a lease (with queue progress when asked), count the wait, and add
        the queue headers; or answer the refusal and return ``None``. Also returns the
        ``send`` to use from then on (wrapped once progress may start the stream)."""
        x, m, name = self.x, self.metrics, self.x.backend.name
        self.since = self.clock.now()
        if x.progress_s > 0:
            send = self.progress = Started(send, x.api)  # opens early: queue, prefill
        tenant, waiting, gate_s = x.tenant, False, 0.0
        try:
            if tenant is not None:
                # (no task and no race for a gate passed at once: every request's case
                # without a max_inflight)
                if not tenant.enter_now():
                    gate_s = await watcher.race(tenant.enter(x.party.max_wait_s or 0.0,
                                                             self.clock))
                self.gated = True
                if gate_s and x.party.max_wait_s is not None:  # the gate used some wait
                    x.party = replace(x.party, max_wait_s=max(0.001,
                                                              x.party.max_wait_s - gate_s))
            x.party = spent(x.party, self.clock.now() - x.started)  # (its TTFT deadline)
            lease = x.try_admit()
            if lease is None and tenant is not None:
                await tenant.begin_waiting(self.clock.now())
                waiting = True
            if lease is None and isinstance(send, Started):
                lease = await self.wait(watcher, send)
            elif lease is None:
                lease = await watcher.race(x.admit())
        except ClientDisconnected:
            x.reason = "client_disconnected"
            m.rejections.labels(name, x.reason, *x.who).inc()
            self._traced(None, x.reason)
            return None, send
        except GatewayError as exc:
            self._traced(None, exc.rejection_reason or "other")
            await refuse(send, exc, x, m, name)
            return None, send
        finally:
            if waiting and tenant is not None:
                tenant.stop_waiting()
        self._granted(lease, gate_s)
        self._traced(lease, "granted")
        return lease, send

    def _traced(self, lease: Lease | None, outcome: str) -> None:
        """The ``gateway.queue`` span of the request's wait, which ends now with
        ``outcome`` (``granted``, or the rejection reason), when it is traced."""
        x = self.x
        if x.trace is None:
            return
        x.trace.step("gateway.queue", self.clock.now() - self.since, {
            "gateway.queue.outcome": outcome, "gateway.backend": x.backend.name,
            "gateway.queue.wait_s": None if lease is None else lease.waited_s,
            "gateway.queue.predicted_wait_s": None if lease is None
            else lease.predicted_wait_s, "gateway.priority": x.party.priority})

    def _granted(self, lease: Lease, gate_s: float) -> None:
        """Count ``lease``'s wait (``gate_s`` seconds at the tenant's gate included) and
        describe it in the answer's headers."""
        x, m = self.x, self.metrics
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

    async def wait(self, watcher: DisconnectWatcher, send: Started, *,
                   front: bool = False, prefer: int | None = None) -> Lease:
        """Wait for a lease while telling the client where it stands: once the request
        is queued (a full queue or a doomed wait is still answered with its own
        status), the 200 and SSE headers go out, then ``: queued`` comments
        (:func:`gateway.relay.progress.queued`).

        ``front`` and ``prefer`` (a slot id) are passed to the backend's admission (a
        preempted request coming back, whose stream may have started already).

        :raises GatewayError: as :meth:`gateway.admission.admission.Admission.admit`.
        :raises ClientDisconnected: the client left while waiting.
        """
        x = self.x
        admit = asyncio.ensure_future(
            x.readmit(front=front, prefer=prefer) if front or prefer is not None
            else x.admit())
        await asyncio.sleep(0)  # admit refuses at once, or queues
        if admit.done():
            return admit.result()
        try:
            return await queued(admit, x, self.clock, watcher, send)
        except BaseException:
            admit.cancel()
            await asyncio.gather(admit, return_exceptions=True)
            raise
