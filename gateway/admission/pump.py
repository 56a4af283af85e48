"""The shared queue's side of one backend's admission (``[state] backend = "redis"``).

When several gateway processes share a backend, every request of this process queues in
its :class:`~gateway.admission.waitroom.Waitroom` with a ticket in the shared queue
(:mod:`gateway.admission.shared`), and :class:`SharedPump` grants them: it sends the
tickets to the shared queue's script, grants locally those it granted, and waits for a
notification (or ``poll_interval_s``) while the others wait.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass

from gateway.admission.lease import Lease
from gateway.admission.shared import Ask as SharedAsk
from gateway.admission.shared import SharedAccount
from gateway.admission.waitroom import Waiter, Waitroom
from gateway.clock import Clock, wait
from gateway.core.capacity import Budget, Charge, Layout
from gateway.core.slots import SlotMap
from gateway.errors import StateUnavailable
from gateway.tasks import cancel_bounded, not_cancelled

__all__ = ["QueuedAsk", "SharedPump"]


@dataclass(eq=False)
class QueuedAsk:
    """What a waiter of a backend's queue asks for."""

    charge: Charge
    predicted: float | None = None  # the wait predicted when it queued
    prefer: int | None = None  # the slot to take if it is free
    ticket: str | None = None  # its id in the shared queue (shared state only)
    front: bool = False
    # A grant call saw it and did not grant it, so it waits (and counts against
    # max_queue); before that it is only on its way to its first grant.
    seen: bool = False


#: Grants a lease locally on slots the shared script chose:
#: ``grant(charge, waited_s, (lease id, slot ids))``.
Grant = Callable[[Charge, float, tuple[str, tuple[int, ...]]], Lease]


class SharedPump:
    """Serves one backend's waiters from the shared queue, in arrival order over every
    process.

    :param shared: the backend's budget shared with the other processes.
    :param room: the admission's waiting room (the waiters with a ticket are served).
    :param slots: the admission's slot map (its free order is sent to the script).
    :param layout: the admission's current layout (``None``: unknown, nothing granted).
    :param grant: reserves locally what the script granted.
    :param clock: the injected time source (its naps between polls).
    :param max_queue: the admission's bound on waiting requests, kept by :meth:`_bound`.
    :param refusal: the error of a waiter past ``max_queue``: ``refusal(True)`` for one
        just refused its first grant (queue full), ``refusal(False)`` for one shed.
    :param budget: what this process holds on the backend: with ``[state] on_unavailable
        = "local"``, while Redis cannot be reached, waiters are granted against
        ``1/N`` of the backend (:meth:`_grant_alone`).
    """

    def __init__(self, shared: SharedAccount, room: Waitroom[QueuedAsk, Lease],
                 slots: SlotMap, layout: Callable[[], Layout | None], grant: Grant,
                 clock: Clock, budget: Callable[[], Budget] | None = None,
                 max_queue: int | None = None,
                 refusal: Callable[[bool], Exception] | None = None) -> None:
        self.shared = shared
        self._budget = budget
        self._max_queue = max_queue
        self._refusal = refusal
        self._room = room
        self._slots = slots
        self._layout = layout
        self._grant = grant
        self._clock = clock
        self._task: asyncio.Task[None] | None = None
        self._closed = False  # by close(): no run starts any more
        self._stirred = asyncio.Event()
        shared.bind(self.tickets, self.stir)

    def tickets(self) -> list[tuple[str, int]]:
        """The waiting tickets here and their queue scores (the heartbeat republishes
        them)."""
        return [(w.request.ticket, self._score(w)) for w in self._room.order()
                if w.request.ticket is not None]

    def stir(self) -> None:
        """Something may have changed in the shared queue: run the pump (or let the one
        running look again at once)."""
        self._stirred.set()
        if not self._closed and (self._task is None or self._task.done()):
            try:
                self._task = asyncio.get_running_loop().create_task(self._run())
            except RuntimeError:  # no loop running: nothing can be waiting
                self._task = None

    async def close(self, seconds: float) -> None:
        """Shutdown: end the run under way (within ``seconds``) and start none after."""
        self._closed = True
        await cancel_bounded([] if self._task is None else [self._task], "shared pump",
                             seconds)

    def _score(self, waiter: Waiter[QueuedAsk, Lease]) -> int:
        return 0 if waiter.request.front else self.shared.store.score_ms(waiter.since)

    async def _run(self) -> None:
        """Send the tickets to :meth:`SharedAccount.grant
        <gateway.admission.shared.SharedAccount.grant>`, grant those it granted, and nap
        while the others wait. Runs while any waits here (and once more after, to
        withdraw the tickets of those who left). When Redis cannot be reached, every
        waiter here gets :class:`~gateway.errors.StateUnavailable`."""
        settings = self.shared.store.settings
        sent = True
        while not_cancelled() and (self._room or sent):
            self._stirred.clear()
            layout = self._layout()
            if layout is None:  # set_layout stirs it
                return
            waiters = list(self._room.order())
            asks = [SharedAsk(w.request.ticket, self._score(w), w.request.charge,
                              w.request.prefer)
                    for w in waiters if w.request.ticket is not None]
            try:
                reply = await self.shared.grant(layout, asks, order=self._slots.free)
            except StateUnavailable as exc:
                if settings.on_unavailable == "local" and self._budget is not None:
                    sent = False  # nothing to withdraw now; the heartbeat heals later
                    self._grant_alone(layout)
                    if self._room:
                        await self._nap(settings.poll_interval_s)
                    continue
                for waiter in list(self._room):  # those who came during the call too
                    self._room.fail(waiter, exc)
                return
            sent = bool(asks)
            self._hand_out(waiters, reply.granted)
            if not reply.resyncing:  # (while Redis resyncs, nothing was judged)
                self._bound([w for w in waiters if not w.future.done()
                             and not w.request.seen and w.request.ticket is not None])
            if self._room and not reply.granted and not self._stirred.is_set():
                # While Redis resyncs after a restart, look again each renewal.
                await self._nap(settings.renew_interval_s if reply.resyncing
                                else settings.poll_interval_s)

    def _hand_out(self, waiters: list[Waiter[QueuedAsk, Lease]],
                  granted: dict[str, tuple[int, ...]]) -> None:
        """Grant the waiters whose tickets the script granted (slot ids by ticket); give
        back at once the grants of those who left while the call ran."""
        now = self._clock.now()
        for waiter in waiters:
            ask = waiter.request
            ids = granted.get(ask.ticket or "")
            if ids is None:
                continue
            if waiter.future.done():  # it left while the call ran
                self.shared.release([ask.ticket or ""])
                continue
            lease = self._grant(ask.charge, now - waiter.since, (ask.ticket or "", ids))
            lease.predicted_wait_s = ask.predicted
            self._room.grant(waiter, lease)

    def _bound(self, fresh: list[Waiter[QueuedAsk, Lease]]) -> None:
        """``fresh`` waiters were just refused a grant, so they wait now. Keep
        ``max_queue`` waiting, the first in serving order (lower classes and the newest
        go first); a fresh one past it is refused (queue full), as one that found the
        queue full in one process, and an older one past it is shed. Requests coming
        back to the front are never refused."""
        for waiter in fresh:
            waiter.request.seen = True
        if self._max_queue is None or self._refusal is None:
            return
        waiting = [w for w in self._room.order()
                   if w.request.seen and not w.request.front]
        for waiter in waiting[self._max_queue:]:
            self._room.fail(waiter, self._refusal(waiter in fresh))

    def _grant_alone(self, layout: Layout) -> None:
        """Redis cannot be reached and ``[state] on_unavailable = "local"``: grant the
        waiters here, in order, while this process's own reservations fit its part of
        the backend, ``1/N`` of its tokens and slots, N being the most processes seen
        alive (or ``[state] replicas``, when larger). Each lease is recorded as this
        process's, so the heartbeat publishes it when Redis is back. The risk, which the
        operator accepts: a process started during the outage, or a split larger than
        the one seen, overflows the backend."""
        assert self._budget is not None
        store = self.shared.store
        parts = max(1, store.settings.replicas, len(store.processes))
        tokens, slots = layout.capacity_tokens // parts, max(1, layout.slots // parts)
        if layout.busy_cap is not None:  # this process's SLO limit, split as the slots
            slots = min(slots, max(1, layout.busy_cap // parts))
        now = self._clock.now()
        while (waiter := self._room.head()) is not None:
            ask, budget = waiter.request, self._budget()
            c = ask.charge
            if (budget.reserved_tokens + c.tokens > tokens
                    or budget.busy_slots + c.slots > slots):
                return
            ids = self._slots.choose(c.pinnable, c.slots, ask.prefer)
            lease = self._grant(c, now - waiter.since, (ask.ticket or "", ids))
            lease.predicted_wait_s = ask.predicted
            self.shared.hold_alone(ask.ticket or "", c, ids)
            self._room.grant(waiter, lease)

    async def _nap(self, seconds: float) -> None:
        """Wait until stirred, or ``seconds`` at most."""
        stirred = asyncio.ensure_future(self._stirred.wait())
        try:
            await wait(self._clock, stirred, seconds)
        except TimeoutError:
            pass
        finally:
            stirred.cancel()
