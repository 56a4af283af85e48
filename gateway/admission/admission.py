"""Async admission queue over the pure capacity model.

A request asks for a :class:`~gateway.admission.lease.Lease` on a backend with its
:class:`~gateway.core.capacity.Charge`. It gets one at once when nobody is waiting and the
charge fits; otherwise it waits in a strict FIFO queue (a charge that does not fit blocks
the ones behind it, so no request starves behind later, smaller ones). The queue is bounded
by ``max_queue`` and each wait by ``max_wait_s``. A lease is given back with
:meth:`Admission.release` (idempotent), in the relay's ``finally``.

Modelled on anyio's ``CapacityLimiter``: a waiter cancelled after it was granted a lease
gives it back and wakes the next one (:class:`gateway.admission.waitroom.Waitroom`). The
pure parts live in ``core/``: the slot map (:class:`gateway.core.slots.SlotMap`) and the
wait predictions (:class:`gateway.core.waits.WaitPredictor`). Who grants (this process
alone, or the queue every gateway process shares) is the admission's grantor
(:mod:`gateway.admission.grantor`), chosen once by whoever builds it.
"""

from __future__ import annotations

import math
from collections.abc import Callable

from gateway.admission.forecast import WaitForecast
from gateway.admission.grantor import Grantor, LocalGrantor
from gateway.admission.lease import AdmissionStats, InFlight, Lease
from gateway.admission.live import GROWTH_HORIZON_S
from gateway.admission.pump import QueuedAsk
from gateway.admission.shared import CLOSE_S
from gateway.admission.slo import SloGuard
from gateway.admission.waitroom import Waitroom, shed_error
from gateway.clock import Clock, MonotonicClock
from gateway.core import capacity
from gateway.core.capacity import Budget, Charge, Layout
from gateway.core.fairness import Party
from gateway.core.slots import SlotMap
from gateway.core.waits import MIN_HISTORY, WaitPredictor
from gateway.errors import (
    BackendNotReady,
    ContextLengthExceeded,
    QueueFull,
    QueueTimeout,
    QueueWaitPredicted,
)
from gateway.tasks import TaskSet, cancel_bounded

__all__ = ["GROWTH_HORIZON_S", "MIN_HISTORY", "Admission"]


def _no_longer_fits(layout: Layout, charge: Charge) -> ContextLengthExceeded:
    """The 400 of a queued request whose backend's layout shrank below it."""
    return ContextLengthExceeded(
        "The backend's capacity changed while this request was queued and it no longer "
        f"fits one slot ({layout.ctx_per_slot} tokens).",
        n_prompt_tokens=charge.prompt_tokens, n_ctx=layout.ctx_per_slot)


def _never_fits(layout: Layout, charge: Charge) -> ContextLengthExceeded:
    """The 400 of a charge planned against a layout that changed meanwhile."""
    return ContextLengthExceeded(
        f"This request needs {charge.prompt_tokens + charge.max_tokens} tokens "
        f"(prompt {charge.prompt_tokens} + max_tokens {charge.max_tokens}) x n "
        f"{charge.n}, but the backend's layout changed while it was being counted "
        f"and is now {layout.slots} slots of {layout.ctx_per_slot} tokens "
        f"(at most {layout.usable_per_slot} usable per slot, "
        f"{layout.capacity_tokens} in all). Lower max_tokens or shorten the prompt.",
        n_prompt_tokens=charge.prompt_tokens, n_ctx=layout.ctx_per_slot)


def _doomed(predicted: float, max_wait: float) -> QueueWaitPredicted:
    """The 503 of a request whose predicted wait is longer than it may wait."""
    return QueueWaitPredicted(
        f"The queue ahead of this request needs about {math.ceil(predicted)} s to drain "
        f"at the backend's recent pace, longer than the {max_wait:g} s a "
        "request may wait; retry after the Retry-After delay.", retry_after_s=predicted)


class Admission:
    """Admission for one backend, in the order of :mod:`gateway.core.fairness` (FIFO while
    every request has the same tenant and class).

    :param layout: the backend's KV layout, or ``None`` while it is not known yet
        (every admit then raises :class:`BackendNotReady`).
    :param max_queue: most requests allowed to wait; 0 means never wait.
    :param max_wait_s: longest wait in the queue, seconds.
    :param reject_doomed: refuse at once a request whose predicted wait
        (:meth:`predict_wait_s`) is longer than ``max_wait_s``.
    :param clock: injected time source.
    :param predictive: live accounting is on: a tracked lease counts as the larger of
        its charge and its observed use plus growth, new work must leave
        ``preempt_margin_tokens`` of the pool free, and tracked leases are preempted
        (least progress first) when use plus growth would pass the pool less the margin.
    :param preempt_margin_tokens: tokens of a unified pool kept free under
        ``predictive``.
    :param age_s: priority ageing, seconds per class (:class:`FairQueue`).
    :param grantor: who grants (:mod:`gateway.admission.grantor`): this process alone
        (:class:`~gateway.admission.grantor.LocalGrantor`, the default), or the queue
        every gateway process shares
        (:class:`~gateway.admission.shared_grant.SharedGrantor`), where every request
        queues and is granted in arrival order over all processes; the local budget is
        then this process's part of the backend's.

    It is the one admission API of a backend that the target, the relay and the slot
    watch call, each a few lines over its part: ``Waitroom``, ``SlotMap``,
    ``WaitForecast``, ``LiveAccounting``, ``SloGuard`` and its ``Grantor``; to the
    grantor it is the :class:`~gateway.admission.grantor.Desk`.
    It stays over the size the layering issue aims at (about 410 lines): that API is
    public and kept whole. Its own part is what fits; who grants is the grantor's.
    """

    def __init__(
        self,
        layout: Layout | None,
        *,
        max_queue: int,
        max_wait_s: float,
        clock: Clock | None = None,
        reject_doomed: bool = False,
        predictive: bool = False,
        preempt_margin_tokens: int = 32,
        age_s: float = 30.0,
        grantor: Grantor | None = None,
    ) -> None:
        self._layout = layout
        self._max_queue = max_queue
        self._max_wait_s = max_wait_s
        self._reject_doomed = reject_doomed
        self._clock = clock or MonotonicClock()
        self._active = InFlight()  # leases in flight, by id
        self._grantor = chosen = grantor or LocalGrantor()
        self._live = chosen.live(self._clock, predictive=predictive,
                                  margin_tokens=preempt_margin_tokens, active=self._active)
        self._budget = Budget()
        self._layout_changes = 0
        self._inflight = 0
        self._admitted = 0
        self._room: Waitroom[QueuedAsk, Lease] = Waitroom(
            self._clock, age_s=age_s, max_queue=max_queue, full=self._queue_full,
            give_back=self.release, on_leave=self._wake, counted=chosen.counted)
        self.slo = SloGuard(self._clock, active=self._active, waiting=lambda: len(self._room),
                            wake=self._wake, shared_busy=chosen.busy_slots)  # (admission.slo)
        self.slo.defer.max_wait_s = max_wait_s
        self.forecast = WaitForecast(
            self._room, WaitPredictor(),
            lambda: (self.slo.limited(self._layout), self._budget, self._active.values()),
            lambda: self._max_wait_s,
            self._clock, first_rate=self.slo.seconds_per_token)
        self._delayed = TaskSet("admission")  # release_later's
        #: Which slot each pinned lease holds, least recently used free first.
        self.slots = SlotMap(layout.slots if layout else 0)
        # Called after every change that may make room (a release, a new layout, a
        # waiter leaving): the model queue of a fleet (gateway.fleet.pool) listens.
        self._listeners: list[Callable[[], None]] = []
        chosen.bind(self)

    def add_listener(self, listener: Callable[[], None]) -> None:
        """Call ``listener()`` whenever room may have been made on this backend, after
        this admission's own queue has been served."""
        self._listeners.append(listener)

    def remove_listener(self, listener: Callable[[], None]) -> None:
        """Stop calling ``listener`` (a model queue no longer in use)."""
        if listener in self._listeners:
            self._listeners.remove(listener)

    def notify(self) -> None:
        """Serve this queue and call the listeners, as after a release (when something
        outside the budget changed: a backend drained or undrained)."""
        self._wake()

    def fits_now(self, charge: Charge, party: Party | None = None, waited_s: float = 0.0,
                 cached: bool = False) -> bool:
        """True when ``charge`` would be granted now by :meth:`try_admit`: no one waits,
        it fits, and, given its ``party``, its prefill is not held back (``slo.defer``)."""
        return self._grantor.fits_now(self, charge, party, waited_s, cached)

    def headroom(self, charge: Charge) -> tuple[float, float]:
        """What would be left after granting ``charge``, as fractions of the backend:
        (free KV tokens / capacity tokens, free slots / slots). For routing scores."""
        layout = self._require_layout()
        tokens = layout.capacity_tokens - self._budget.reserved_tokens - charge.tokens
        slots = layout.slots - self._budget.busy_slots - charge.slots
        return (tokens / max(1, layout.capacity_tokens), slots / max(1, layout.slots))

    @property
    def layout(self) -> Layout | None:
        """The layout admissions are checked against."""
        return self._layout

    def set_layout(self, layout: Layout | None) -> None:
        """Replace the layout (after discovery). Leases in flight keep their charge.

        Waiters that can never fit the new layout are failed with
        :class:`ContextLengthExceeded`; the rest are re-examined at once.
        """
        if self._layout is not None and layout != self._layout:
            self._layout_changes += 1
        self._layout = layout
        self.slots.resize(layout.slots if layout else 0)
        if layout is not None:
            for waiter in list(self._room):
                if not capacity.fits_alone(layout, waiter.request.charge):
                    self._room.fail(waiter, _no_longer_fits(layout, waiter.request.charge))
        self._wake()

    def refuse_waiting(self, exc: Exception) -> None:
        """Fail every request waiting in the queue with ``exc`` (the gateway is
        stopping)."""
        self._room.refuse_waiting(exc)

    def stats(self) -> AdmissionStats:
        """Return a snapshot of queue and budget."""
        layout = self._layout
        budget, queued = self._grantor.seen(self._budget, len(self._room))
        return AdmissionStats(
            queued=queued,
            inflight=self._inflight,
            reserved_tokens=budget.reserved_tokens,
            busy_slots=budget.busy_slots,
            capacity_tokens=layout.capacity_tokens if layout else 0,
            slots=layout.slots if layout else 0,
            ctx_per_slot=layout.ctx_per_slot if layout else 0,
            layout_changes=self._layout_changes,
            admitted=self._admitted,
            live_tokens=sum(lease.live_tokens for lease in self._active.values()),
            queue_capacity=self._max_queue,
            oldest_wait_s=self.oldest_wait_s() if self._room else 0.0, slo=self.slo,
        )

    def oldest_wait_s(self) -> float:
        """Seconds the request waiting longest here has waited so far (0.0: none)."""
        return self._room.oldest_wait_s()

    # -- waits and Retry-After (gateway.core.waits) ---------------------------------------

    def retry_after_s(self, charge: Charge | None = None) -> float:
        """When a request sent now (``charge``, if known) could start, seconds (1–60)
        (:meth:`WaitForecast.retry_after_s`)."""
        return self.forecast.retry_after_s(charge)

    def record_duration(self, seconds: float, charge: Charge | None = None) -> None:
        """Record how long a served lease was held (feeds :meth:`retry_after_s`) and, with
        its charge, the seconds per token of output cap (feeds :meth:`predict_wait_s`)."""
        self.forecast.waits.record_duration(seconds, charge)

    def predict_wait_s(self, charge: Charge, party: Party | None = None) -> float | None:
        """How long ``charge`` would wait if it queued now, seconds, or ``None``
        (:meth:`WaitForecast.predict_wait_s`)."""
        return self.forecast.predict_wait_s(charge, party)

    def queue_position(self, charge: Charge) -> int | None:
        """1 for the head of the queue; ``None`` when ``charge`` (this very object) is
        not waiting."""
        return self.forecast.queue_position(charge)

    def eta_s(self, charge: Charge) -> float | None:
        """Seconds until the waiting ``charge`` is predicted to start
        (:meth:`WaitForecast.eta_s`)."""
        return self.forecast.eta_s(charge)

    # -- the queue (gateway.admission.waitroom) -------------------------------------------

    def check_queue_room(self, party: Party | None = None) -> None:
        """Raise at once when a new request could only queue and the queue is full.

        With others waiting, a new request always queues, whatever its size.

        :raises QueueFull: ``max_queue`` requests wait already (and at least one does),
            none of a class lower than ``party``'s (which it would shed).
        """
        self._room.check_room(party)

    def _queue_full(self) -> QueueFull:
        return QueueFull(
            f"The queue for this backend is full ({self._max_queue} waiting); "
            "retry after the Retry-After delay.",
            retry_after_s=self.retry_after_s(),
        )

    def refusal(self, fresh: bool) -> Exception:
        """(:class:`~gateway.admission.grantor.Desk`) The error of a waiter past
        ``max_queue``: queue full for a ``fresh`` one, else shed."""
        return self._queue_full() if fresh else shed_error(
            f"The queue for this backend is full ({self._max_queue} waiting).",
            self.retry_after_s())

    def try_admit(self, charge: Charge, *, front: bool = False,
                  prefer: int | None = None, party: Party | None = None) -> Lease | None:
        """Grant a lease now, or return ``None``: refuses while others wait (fairness),
        unless ``front`` (a preempted request coming back, which goes before them).

        :raises BackendNotReady: the layout is not known yet.
        :raises ContextLengthExceeded: the charge can never fit the current layout (it
            was planned against a layout that changed meanwhile); nothing waits for it.
        :raises SloUnattainable: its first token would come after its deadline
            (:meth:`SloGuard.check_ttft <gateway.admission.slo.SloGuard.check_ttft>`).
        """
        layout = self._require_layout()
        if not capacity.fits_alone(layout, charge):
            raise _never_fits(layout, charge)
        self.slo.expect(party)  # (its ITL target binds from now)
        return self._grantor.arrive(self, charge, party, front=front, prefer=prefer)

    async def admit(self, charge: Charge, *, front: bool = False,
                    prefer: int | None = None, party: Party | None = None) -> Lease:
        """Wait for a lease in the order of :class:`FairQueue`; with ``front``, at the
        head of the queue (a preempted request resuming: neither the queue bound nor a
        predicted wait refuses it); ``prefer`` names the slot to take if it is free then
        (where the backend still caches the request's prefix). ``party`` gives the
        request's tenant, class and class wait limit.

        When the queue is full, the newest waiter of the lowest class below ``party``'s
        is shed (:class:`~gateway.errors.Shed`) to make room; with none, this request is
        refused.

        :raises BackendNotReady: the layout is not known yet.
        :raises QueueFull: ``max_queue`` requests already wait (immediately).
        :raises QueueTimeout: the wait passed ``max_wait_s`` (or the class's).
        :raises ContextLengthExceeded: the charge does not fit the current layout (at
            once), or the layout changed while it waited and it no longer fits.
        """
        party = party or Party()
        lease = self.try_admit(charge, front=front, prefer=prefer, party=party)
        if lease is not None:
            return lease
        max_wait = self._max_wait_s if party.max_wait_s is None else party.max_wait_s
        victim = None if front else self._grantor.victim(self._room, party)
        predicted = None if front else (0.0 if self.slo.defer.was_held(charge)  # (held:
                                        else self.predict_wait_s(charge, party))  # in time)
        if self._reject_doomed and predicted is not None and predicted > max_wait:
            raise _doomed(predicted, max_wait)
        if not front:
            self.slo.check_ttft(charge, party, predicted)
        if victim is not None:
            self._room.fail(victim, self.refusal(fresh=False))
        waiter = self._room.join(
            QueuedAsk(charge, predicted, prefer, self._grantor.ticket(), front), party,
            charge.tokens, front=front)
        if self._grantor.wakes_on_join(self, waiter):
            self._wake()
        return await self._room.wait(waiter, max_wait, lambda: QueueTimeout(
            f"The request waited {max_wait:g} s in the queue without room on "
            "the backend; retry after the Retry-After delay.",
            retry_after_s=self.retry_after_s(charge)))

    def release(self, lease: Lease, *, served: bool = True) -> None:
        """Give a lease back and wake waiters that now fit. Idempotent.

        :param served: the request was served; only these feed the drain-rate estimate,
            so that a burst of fast failures does not promise a short Retry-After.
        """
        if lease.released:
            return
        lease.released = True
        now = self._clock.now()
        self.slots.release(lease.slot_ids)
        self._budget = capacity.release(self._budget, lease.charge)
        self._inflight -= 1
        self._active.pop(id(lease), None)
        self._live.released(lease, now)
        if served:
            self.forecast.waits.record_release(now)
        self._grantor.released(lease)
        self._wake()

    async def close(self) -> None:
        """Shutdown: end the delayed releases (each releases its lease as it ends) and
        the deferral's wakes, then the grantor's own work (a shared pump), within
        :data:`CLOSE_S` s each."""
        await cancel_bounded([*self._delayed, *self.slo.defer.timers], "admission", CLOSE_S)
        await self._grantor.close(CLOSE_S)  # last: the releases above stir it

    def release_later(self, lease: Lease, delay_s: float, *, served: bool = True) -> None:
        """Release ``lease`` after ``delay_s`` seconds (on the injected clock), in the
        background. It is released even if that wait is cancelled (shutdown)."""

        async def later() -> None:
            try:
                await self._clock.sleep(delay_s)
            finally:
                self.release(lease, served=served)

        self._delayed.spawn(later())

    @property
    def held_slots(self) -> frozenset[int]:
        """Slot ids held by leases in flight (abandoned ones awaiting release included)."""
        return self.slots.held

    def _require_layout(self) -> Layout:
        if self._layout is None:
            raise BackendNotReady(
                "The backend's capacity is not known yet (it is unreachable or still "
                "loading); retry after the Retry-After delay.", retry_after_s=1.0)
        return self._layout

    def grant_lease(self, charge: Charge, *, waited_s: float, slot_ids: tuple[int, ...],
                    shared_id: str | None = None) -> Lease:
        """(:class:`~gateway.admission.grantor.Desk`) Reserve ``charge`` on ``slot_ids``
        (``()``: unpinned; see :meth:`SlotMap.take <gateway.core.slots.SlotMap.take>`)
        and return its lease, known as ``shared_id`` beyond this process."""
        self._budget = capacity.reserve(self._budget, charge)
        self._inflight += 1
        self._admitted += 1
        lease = Lease(charge, waited_s=waited_s, slot_ids=self.slots.take(slot_ids),
                      granted_at=self._clock.now(), shared_id=shared_id)
        self._active[id(lease)] = lease
        return lease

    def _wake(self) -> None:
        self._grantor.wake(self)
        for listener in self._listeners:
            listener()

    # -- what the grantor reads (gateway.admission.grantor.Desk) --------------------------

    @property
    def waitroom(self) -> Waitroom[QueuedAsk, Lease]:
        """The backend's waiting requests."""
        return self._room

    @property
    def budget(self) -> Budget:
        """What this process holds on the backend."""
        return self._budget

    @property
    def max_queue(self) -> int:
        """Most requests allowed to wait."""
        return self._max_queue

    @property
    def clock(self) -> Clock:
        """The injected time source."""
        return self._clock

    def grant_layout(self) -> Layout | None:
        """The layout grants are judged against: the backend's, under the latency limit."""
        return self.slo.limited(self._layout)

    # -- live accounting (the predictive policy, gateway.admission.live) --------------

    @property
    def preemptions(self) -> dict[str, int]:
        """Preemptions chosen, by reason."""
        return self._live.preemptions

    def observe(self, lease: Lease, generated: int) -> None:
        """Note that ``lease``'s request has generated ``generated`` tokens (per
        completion) so far, and preempt tracked leases if the pool would run short.
        Ignored for a released lease."""
        if lease.released:
            return
        self._live.observe(lease, generated)
        self.check_pressure()

    def check_pressure(self) -> list[Lease]:
        """Preempt tracked leases, least progress first, while live use plus the growth
        possible within :data:`GROWTH_HORIZON_S` would pass the pool less the margin
        (:meth:`gateway.admission.live.LiveAccounting.victims`); each victim's
        ``on_preempt`` is called with the reason ``"pool_pressure"``.

        :returns: the leases preempted now.
        """
        victims = self._live.victims(self._layout, self._active)
        for lease in victims:
            self.preempt(lease, "pool_pressure")
        return victims

    def preempt(self, lease: Lease, reason: str) -> None:
        """Mark ``lease`` preempted for ``reason`` and tell its holder (see
        :meth:`gateway.admission.live.LiveAccounting.preempt`)."""
        self._live.preempt(lease, reason)

    def fits(self, layout: Layout, charge: Charge, party: Party | None = None) -> bool:
        """:func:`gateway.core.capacity.fits` against what is reserved, the leases in flight
        as live accounting counts them, under :meth:`SloGuard.limited` for ``party``."""
        return self._live.fits(self.slo.limited(layout, party), self._budget,
                               self._active.values(), charge)
