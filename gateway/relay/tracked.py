"""A request followed token by token, preempted before the pool overflows, and continued
where it stopped (the ``predictive`` policy on llama-server).

:class:`TrackedRelay` is the :class:`~gateway.relay.response.ProxyResponse` strategy for
the requests the pipeline marks ``tracked``. It:

1. always streams upstream, so that every token is seen as it is generated and reported
   to the admission (:meth:`~gateway.admission.admission.Admission.observe`): a client
   that asked for a whole answer gets one rebuilt from the events
   (:class:`~gateway.wire.resume.Reassembler`); one attempt is a
   :class:`~gateway.relay.follow.Follower`;
2. races each attempt against preemption: when the admission preempts the lease (the
   pool would run short), the upstream stream is closed, which makes llama-server
   cancel the task at its next write, and the lease is held until ``/slots`` shows the
   slot free (:mod:`gateway.admission.slotwatch`);
3. treats llama-server's "Context size has been exceeded." (an error event, or a 500)
   the same way: the backend has already ended the task;
4. notes either on the attempt (:attr:`~gateway.relay.attempt.Attempt.preempted`), so
   that its :meth:`~gateway.relay.attempt.Attempt.next_step` is ``RESUME``; then
   (:meth:`TrackedRelay.resume`) queues again at the head and sends the continuation
   (:class:`~gateway.wire.resume.Continuation`), up to :data:`MAX_RESUMES` times,
   relaying its events in the same client answer.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable
from dataclasses import replace
from typing import Any

from starlette.types import Send

from gateway.admission.lease import Lease
from gateway.errors import ClientDisconnected, GatewayError, UpstreamError
from gateway.relay.follow import OVERFLOW, ClientAnswer, Follower
from gateway.relay.inspect import TokenTimes
from gateway.relay.parts import RelayParts
from gateway.relay.watcher import DisconnectWatcher
from gateway.wire.resume import CAP_FIELDS, Continuation, Reassembler, answer_shape, resumable

__all__ = ["MAX_RESUMES", "RECOUNT_SLACK", "TrackedRelay"]

log = logging.getLogger(__name__)

MAX_RESUMES = 4  # continuations per request; after them it is no longer preempted
RECOUNT_SLACK = 16  # tokens added to prompt + generated when a recount is not possible


class TrackedRelay:
    """Runs each attempt of a tracked request, and resumes it when one is cut short (a
    :class:`gateway.relay.parts.Strategy`; see the module doc)."""

    def __init__(self, parts: RelayParts) -> None:
        self.parts = parts
        # Preemptions are counted under the backend the request was planned on.
        self.planned = parts.x.backend.name
        self.client: ClientAnswer | None = None  # from the first attempt on
        self.cont: Continuation | None = None
        self.first_body: dict[str, Any] = {}
        self.cap = 0
        self.times = TokenTimes()

    def _begin(self, send: Send) -> tuple[ClientAnswer, Continuation]:
        """Before the first attempt (once admission has bound the request's backend,
        body and charge): the client's answer and the continuation."""
        if self.client is None or self.cont is None:
            x = self.parts.x
            self.client = ClientAnswer(x, send)
            self.cont = Continuation(x.route, x.charge.prompt_tokens,
                                     restart=not resumable(x.route, x.body))
            self.first_body, self.cap = x.body, x.charge.max_tokens
        return self.client, self.cont

    async def attempt(self, watcher: DisconnectWatcher, send: Send, lease: Lease) -> None:
        """Run one attempt on ``lease`` and release it; a cut-short attempt keeps the
        reason (``pool_pressure``, or :data:`~gateway.relay.follow.OVERFLOW`) in
        :attr:`~gateway.relay.attempt.Attempt.preempted`."""
        x, tries = self.parts.x, self.parts.tries
        client, cont = self._begin(send)
        preempted = asyncio.Event()
        lease.tracked = True
        lease.earlier = cont.generated
        lease.preemptible = cont.faithful and cont.attempts < MAX_RESUMES
        lease.on_preempt = lambda reason: preempted.set()
        held_since = tries.start(lease)
        follower = Follower(self.parts, client, lease, cont, self.times, self.cap)
        reason: str | None = None
        try:
            reason = await watcher.race(self._until(preempted, lease, follower.run()))
        except ClientDisconnected:
            if not client.closed:  # (a client that closes at the end has not left early)
                x.status = 499
                log.info("client left %s request on backend %s; upstream closed", x.route,
                         x.backend.name)
        finally:
            lease.on_preempt = None
            tries.give_back(lease, held_since,
                            served=reason is None and 200 <= x.status < 400,
                            stream=True, quick=reason is not None)
        tries.now.preempted = reason
        if reason is not None and x.trace is not None:
            x.trace.event("gateway.preempted", **{"gateway.reason": reason,
                                                  "gateway.backend": x.backend.name})

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

    async def resume(self, watcher: DisconnectWatcher, send: Send) -> Lease | None:
        """After :attr:`~gateway.relay.attempt.NextStep.RESUME`: count the preemption,
        queue the continuation at the head (back on the same slot if it is free by
        then: llama-server still caches the prompt and the partial answer there, so
        little is computed again) and return its lease; or tell the client why it
        cannot go on and return ``None``."""
        x, attempt = self.parts.x, self.parts.tries.now
        client, cont = self._begin(send)
        reason, lease = attempt.preempted, attempt.lease
        if reason != OVERFLOW:  # an overflow's was counted with it (Follower)
            self.parts.metrics.preemptions.labels(self.planned, reason).inc()
        log.info("backend %s: %s request preempted (%s) after %d tokens; it resumes "
                 "at the head of the queue", self.planned, x.route, reason,
                 cont.total_tokens)
        slot = lease.slot_ids[0] if lease.slot_ids else None
        return await self._requeue(watcher, client, cont, slot)

    async def _requeue(self, watcher: DisconnectWatcher, client: ClientAnswer,
                       cont: Continuation, slot: int | None) -> Lease | None:
        x, m = self.parts.x, self.parts.metrics
        name = x.backend.name
        outcome = "continued" if cont.total_tokens and not cont.restart else "restarted"
        try:
            self._check_resumable(cont)
            if cont.restart:  # from the start: what the client would have got is dropped
                client.whole = Reassembler(x.route)
            try:
                body = cont.next_body(self.first_body, self.cap)
            except ValueError:
                raise UpstreamError(f"Backend {name!r} stopped this answer at its cap.") \
                    from None
            charge = await self._continuation_charge(body, self.cap - cont.generated)
            if x.tag is not None:  # a new tag: /slots must not take this attempt for the last
                body.pop(x.tag[0], None)
                x.tag = x.backend.dialect.tag_request(body)
            x.body, x.charge = body, charge
            progress = self.parts.admitter.progress
            if progress is not None and x.stream:  # it asked to hear where it stands
                lease = await self.parts.admitter.wait(watcher, progress, front=True,
                                                       prefer=slot)
            else:
                lease = await watcher.race(x.readmit(front=True, prefer=slot))
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
        if x.trace is not None:
            x.trace.event("gateway.resumed", **{"gateway.outcome": outcome})
        return lease

    def _check_resumable(self, cont: Continuation) -> None:
        """:raises UpstreamError: the answer was stopped too often, or it has reasoning
        (which a continuation cannot carry on faithfully)."""
        name = self.parts.x.backend.name
        if cont.attempts >= MAX_RESUMES:
            raise UpstreamError(f"Backend {name!r} had to stop this answer to make room "
                                f"{cont.attempts + 1} times; giving up.")
        if not cont.faithful:
            raise UpstreamError(f"Backend {name!r} had to stop this answer to make room, "
                                "and an answer with reasoning cannot be continued.")

    async def _continuation_charge(self, body: dict[str, Any], left: int) -> Any:
        """The charge of a continuation: its prompt counted again by the backend (the
        partial answer is now part of it), the cap left, a fresh prediction.

        :raises UpstreamError: the continuation no longer fits one slot.
        :raises GatewayError: the backend could not be reached to count it.
        """
        x = self.parts.x
        layout = x.backend.admission.layout
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
                       predicted=x.backend.lengths.predict(left, answer_shape(body)),
                       clamped=False)
