"""Who grants a backend's requests: this process alone, or the queue every gateway process
shares in Redis.

The choice is made once, where a backend's admission is built
(:mod:`gateway.backends.target`): :class:`LocalGrantor`, or
:class:`~gateway.admission.pump.SharedGrantor` over the backend's
:class:`~gateway.admission.shared.SharedAccount`. The admission
(:class:`~gateway.admission.admission.Admission`, the :class:`Desk` here) keeps what a
request may take (the budget, the slot map, the latency limit, the deferral) and calls its
grantor at each step of a request's way; it never asks which grantor it has. A third
state store is a third implementation of :class:`Grantor`.

The steps, in a request's order: :meth:`Grantor.arrive` (granted at once, or queue),
:meth:`~Grantor.ticket` and :meth:`~Grantor.victim` (joining the queue),
:meth:`~Grantor.wakes_on_join`, :meth:`~Grantor.wake` (after every change that may make
room), :meth:`~Grantor.released`, and at shutdown :meth:`~Grantor.close`.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Protocol

from gateway.admission.lease import Lease
from gateway.admission.live import LiveAccounting
from gateway.admission.pump import QueuedAsk
from gateway.admission.slo import SloGuard
from gateway.admission.waitroom import Waiter, Waitroom
from gateway.clock import Clock
from gateway.core import capacity
from gateway.core.capacity import Budget, Charge, Layout
from gateway.core.fairness import Party
from gateway.core.slots import SlotMap

__all__ = ["Desk", "Grantor", "LocalGrantor"]


class Desk(Protocol):
    """What a grantor grants from: one backend's admission, which decides what fits."""

    @property
    def waitroom(self) -> Waitroom[QueuedAsk, Lease]:
        """The backend's waiting requests."""
        ...

    @property
    def slots(self) -> SlotMap:
        """Which slot each pinned lease holds."""
        ...

    @property
    def budget(self) -> Budget:
        """What this process holds on the backend."""
        ...

    @property
    def max_queue(self) -> int:
        """Most requests allowed to wait."""
        ...

    def grant_layout(self) -> Layout | None:
        """The layout grants are judged against (under the latency limit), ``None``
        while the backend's is unknown."""
        ...

    def grant_lease(self, charge: Charge, *, waited_s: float, slot_ids: tuple[int, ...],
                    shared_id: str | None = None) -> Lease:
        """Reserve ``charge`` on ``slot_ids`` and return its lease, known as
        ``shared_id`` beyond this process."""
        ...

    @property
    def layout(self) -> Layout | None:
        """The backend's layout, ``None`` while unknown."""
        ...

    @property
    def slo(self) -> SloGuard:
        """The latency targets' guard (its deferral holds prefills back)."""
        ...

    @property
    def clock(self) -> Clock:
        """The injected time source."""
        ...

    def fits(self, layout: Layout, charge: Charge, party: Party | None = None) -> bool:
        """``charge`` fits what is held now, under the latency limit for ``party``."""
        ...

    def refusal(self, fresh: bool) -> Exception:
        """The error of a waiter past the queue bound: ``fresh`` (queue full), or shed."""
        ...


class Grantor(Protocol):
    """Who grants one backend's requests (see the module's docstring)."""

    @property
    def counted(self) -> Callable[[Waiter[QueuedAsk, Lease]], bool] | None:
        """Which waiters count against ``max_queue`` (``None``: every one)."""
        ...

    @property
    def busy_slots(self) -> Callable[[], int] | None:
        """The slots busy on the backend over every process that shares it (``None``:
        this process's own are all)."""
        ...

    def bind(self, desk: Desk) -> None:
        """Attach to the admission it grants for (once, when it is built)."""
        ...

    def live(self, clock: Clock, *, predictive: bool, margin_tokens: int,
             active: Mapping[int, Lease]) -> LiveAccounting:
        """The live accounting of the backend's leases (the ``predictive`` policy)."""
        ...

    def arrive(self, desk: Desk, charge: Charge, party: Party | None, *, front: bool,
               prefer: int | None) -> Lease | None:
        """A lease at once, or ``None``: the request queues. (``party`` ``None``: a
        request of no class, which every latency limit holds.)"""
        ...

    def fits_now(self, desk: Desk, charge: Charge, party: Party | None, waited_s: float,
                 cached: bool) -> bool:
        """:meth:`arrive` would grant ``charge`` now."""
        ...

    def ticket(self) -> str | None:
        """The id a request joining the queue is known by beyond this process."""
        ...

    def victim(self, room: Waitroom[QueuedAsk, Lease], party: Party
               ) -> Waiter[QueuedAsk, Lease] | None:
        """The waiter to shed for a request of ``party`` joining a full queue."""
        ...

    def wakes_on_join(self, desk: Desk, waiter: Waiter[QueuedAsk, Lease]) -> bool:
        """Serve the queue at once after ``waiter`` joined it."""
        ...

    def wake(self, desk: Desk) -> None:
        """Something may have made room: grant who can be granted."""
        ...

    def released(self, lease: Lease) -> None:
        """``lease`` was given back."""
        ...

    def seen(self, budget: Budget, queued: int) -> tuple[Budget, int]:
        """What the backend holds and how many wait, for the stats: over every process
        that shares it, given this process's."""
        ...

    async def close(self, seconds: float) -> None:
        """Shutdown: end the grantor's own work within ``seconds``."""
        ...


class LocalGrantor:
    """This process alone reserves on the backend: a request is judged on arrival and
    the queue is served here, in order, whenever room may have been made."""

    counted = None
    busy_slots = None

    def bind(self, desk: Desk) -> None:
        """Nothing to attach."""

    def live(self, clock: Clock, *, predictive: bool, margin_tokens: int,
             active: Mapping[int, Lease]) -> LiveAccounting:
        """Live accounting of this process's leases alone."""
        return LiveAccounting(clock, predictive=predictive, margin_tokens=margin_tokens,
                              active=active)

    def arrive(self, desk: Desk, charge: Charge, party: Party | None, *, front: bool,
               prefer: int | None) -> Lease | None:
        """Granted at once when nobody waits (unless ``front``: a preempted request
        coming back goes before them), it fits, and its prefill is not held back; a
        request that is not ``front`` is first checked against its TTFT deadline.

        :raises SloUnattainable: its first token would come after its deadline.
        """
        layout = desk.layout
        if layout is None or (desk.waitroom and not front) or not desk.fits(
                layout, charge, party):
            return None
        who = party or Party()
        if not front:  # (a preempted request coming back is never refused nor held)
            desk.slo.check_ttft(charge, who, 0.0)
            if desk.slo.defer.hold_s(charge, who, 0.0, cached=prefer is not None):
                return None
        desk.waitroom.charge(who, charge.tokens)
        return desk.grant_lease(charge, waited_s=0.0, slot_ids=_slots(desk, charge, prefer))

    def fits_now(self, desk: Desk, charge: Charge, party: Party | None, waited_s: float,
                 cached: bool) -> bool:
        """Nobody waits, it fits, and (given its ``party``) its prefill is not held."""
        layout = desk.layout
        return (layout is not None and not desk.waitroom
                and capacity.fits_alone(layout, charge) and desk.fits(layout, charge, party)
                and not (party and desk.slo.defer.hold_s(charge, party, waited_s,
                                                         cached=cached)))

    def ticket(self) -> None:
        """Known here only."""
        return None

    def victim(self, room: Waitroom[QueuedAsk, Lease], party: Party
               ) -> Waiter[QueuedAsk, Lease] | None:
        """The newest waiter of the lowest class below ``party``'s, when full."""
        return room.victim_for(party)

    def wakes_on_join(self, desk: Desk, waiter: Waiter[QueuedAsk, Lease]) -> bool:
        """When it goes first and fits: it may pass waiters that wait for room it does
        not need."""
        layout = desk.layout
        return (desk.waitroom.head() is waiter and layout is not None
                and desk.fits(layout, waiter.request.charge, waiter.party))

    def wake(self, desk: Desk) -> None:
        """Grant the waiters, in order, while the first fits and its prefill is not
        held back."""
        layout = desk.layout
        if layout is None:
            return
        room, now = desk.waitroom, desk.clock.now()
        while (waiter := room.head()) is not None and desk.fits(
                layout, waiter.request.charge, waiter.party) and not desk.slo.defer.holds(waiter):
            ask = waiter.request
            lease = desk.grant_lease(ask.charge, waited_s=now - waiter.since,
                                     slot_ids=_slots(desk, ask.charge, ask.prefer))
            lease.predicted_wait_s = ask.predicted
            room.grant(waiter, lease)

    def released(self, lease: Lease) -> None:
        """Nothing beyond this process to tell."""

    def seen(self, budget: Budget, queued: int) -> tuple[Budget, int]:
        """This process's own."""
        return budget, queued

    async def close(self, seconds: float) -> None:
        """Nothing of its own runs."""


def _slots(desk: Desk, charge: Charge, prefer: int | None) -> tuple[int, ...]:
    """The slots a lease granted here takes (:meth:`SlotMap.choose
    <gateway.core.slots.SlotMap.choose>`): ``prefer`` when it is free."""
    return desk.slots.choose(charge.pinnable, charge.slots, prefer)
