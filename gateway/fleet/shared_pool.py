"""Who grants a pool's requests when gateway processes share their backends' budgets
(``[state] backend = "redis"``): :class:`SharedPoolGrantor`.

With shared state, a backend grants a lease only through its shared queue
(:mod:`gateway.admission.shared`, :class:`~gateway.admission.pump.SharedPump`): an async
call to the grant script, which grants the head of that backend's queue (the request
that arrived first on any process) when it fits the sums of every process's leases. A
pool cannot grant synchronously against its members' local budgets, as
:class:`~gateway.fleet.pool.ModelQueue` does with memory state, so a pool request here
waits the way a lone backend's request does, on every backend of its pool at once:

* it is **placed** in the admission queue of each usable backend it was planned for
  (:meth:`gateway.admission.admission.Admission.admit`, with that backend's charge, its
  slot affinity and the request's class), best score first (:func:`shared_score`, from
  the shared figures each backend's account mirrors), so each holds a ticket in every
  one of those backends' shared queues, scored by its arrival time;
* the **first lease** any of them grants is its own; its other places are withdrawn at
  once, and a lease one of them granted meanwhile is given back;
* a backend marked down or draining is withdrawn from (it is not placed there, and a
  lease it grants is given back); the request is placed there again once it is usable.

What follows: no backend is ever reserved past its budget, whichever process admits
(every lease is the grant script's); a backend that frees room goes to the earliest
request, over every process, that could use it, the memory pool's rule; a request that
fits somewhere now is granted there by that backend's first grant call, the best
backend's call going first. When several backends fit it, each may grant it: the
first reply wins and the other lease is given back within the same call's round trip.

Bounds are each backend's: a request is refused (``QueueFull``) or shed when every
backend it waits on refused or shed it (each keeps ``max_queue`` waiting, as a lone
backend does); its wait is the pool's ``max_wait_s``.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from gateway.admission.lease import Lease
from gateway.admission.shared import SharedAccount
from gateway.admission.waitroom import Waiter
from gateway.backends.target import Target
from gateway.core import capacity
from gateway.core.capacity import Budget
from gateway.core.fairness import Party
from gateway.core.prefix import Prefix
from gateway.errors import QueueFull, QueueTimeout, Shed
from gateway.fleet.pool import AFFINITY_BONUS, Candidate, ModelQueue, PoolAsk

__all__ = ["SharedAsk", "SharedPoolGrantor", "fits_shared", "shared_score"]

_Grant = tuple[Candidate, Lease]


def shared_score(candidate: Candidate, affinity: str | None = None) -> float:
    """:func:`gateway.fleet.pool.score` on the shared figures: the fractions of the
    backend's KV capacity and slots left free after this request, by what every process
    holds there as this process last saw it (each grant reply and renewal brings them),
    plus :data:`~gateway.fleet.pool.AFFINITY_BONUS` for the backend ``affinity`` names.
    """
    stats, charge = candidate.backend.admission.stats(), candidate.charge
    tokens = stats.capacity_tokens - stats.reserved_tokens - charge.tokens
    slots = stats.slots - stats.busy_slots - charge.slots
    bonus = AFFINITY_BONUS if candidate.backend.name == affinity else 0.0
    return tokens / max(1, stats.capacity_tokens) + slots / max(1, stats.slots) + bonus


def fits_shared(candidate: Candidate) -> bool:
    """The request fits its backend now by the shared figures as last seen
    (:func:`gateway.core.capacity.fits` on them) and none waits there: its grant should
    come at once. Used only to name the routing decision (``fit`` or ``queued``)."""
    admission = candidate.backend.admission
    layout, stats = admission.layout, admission.stats()
    return (layout is not None and stats.queued == 0 and capacity.fits(
        layout, Budget(stats.reserved_tokens, stats.busy_slots), candidate.charge))


def _fits_reserved(candidate: Candidate) -> bool:
    """The request fits its backend on the shared reservations as last seen (whoever
    waits there)."""
    admission = candidate.backend.admission
    layout, stats = admission.layout, admission.stats()
    return layout is not None and capacity.fits(
        layout, Budget(stats.reserved_tokens, stats.busy_slots), candidate.charge)


@dataclass(eq=False)
class SharedAsk(PoolAsk):
    """A waiter of a shared pool and its places.

    :ivar places: backend (id) -> the candidate and the task waiting in its admission.
    :ivar refused: backends (ids) whose admission refused it (queue full, shed, ...).
    :ivar errors: why, in the order they came.
    """

    party: Party = field(default_factory=Party)
    front: bool = False
    max_wait_s: float = 0.0
    fitted: bool = False  # its best backend fitted it by the shared figures when it came
    spread: bool = False  # placed on every usable backend (not its best alone)
    places: dict[int, tuple[Candidate, asyncio.Task[Lease]]] = field(default_factory=dict)
    refused: set[int] = field(default_factory=set)
    errors: list[Exception] = field(default_factory=list)
    timer: asyncio.Task[None] | None = None  # spreads it after poll_s (see _place)


@dataclass(eq=False)
class SharedPoolGrantor:
    """The :class:`~gateway.fleet.pool.PoolGrantor` of a pool whose backends' budgets
    are shared with other gateway processes (see the module's docstring): a request
    always waits (there is no synchronous grant), and each backend it waits on keeps
    its own ``max_queue``.

    :param account: the shared budget of a member
        (:meth:`gateway.admission.shared.SharedStore.account`), whose figures are read
        anew before a request is placed; ``None``: scored on the figures last seen.
    :param poll_s: how long a request sent to its best backend alone (it fitted there
        by the shared figures) waits for that grant before it also queues on the
        others, seconds (``[state] poll_interval_s``).
    """

    account: Callable[[Target], SharedAccount] | None = None
    poll_s: float = 0.5

    def bind(self, queue: ModelQueue) -> None:
        """Each backend's queue keeps the bound, not the pool's room."""
        queue.room.max_queue = None

    def check_room(self, queue: ModelQueue, party: Party | None) -> None:
        """Raise at once when every usable backend's queue is full
        (:meth:`gateway.admission.admission.Admission.check_queue_room`).

        :raises QueueFull: no backend of the pool would let it wait.
        """
        now = queue.clock.now()
        usable = [b for b in queue.members if b.usable(now)]
        for backend in usable:
            try:
                backend.admission.check_queue_room(party)
            except QueueFull:
                continue
            return
        if usable:
            raise queue.full()

    def try_admit(self, queue: ModelQueue, candidates: Sequence[Candidate],
                  affinity: str | None, party: Party | None, prefix: Prefix | None
                  ) -> _Grant | None:
        """Always ``None``: the shared queues decide (:meth:`admit`)."""
        return None

    async def admit(self, queue: ModelQueue, candidates: Sequence[Candidate],
                    affinity: str | None, *, front: bool, party: Party | None,
                    prefix: Prefix | None) -> _Grant:
        """Wait in the queue of every usable backend of ``candidates`` for the first
        lease any grants; with ``front`` (a request coming back after a backend failed
        it), at the head of each.

        :raises QueueFull: every backend it waited on refused it (``Shed`` when one
            shed it for a request of a higher class).
        :raises QueueTimeout: the wait passed ``max_wait_s`` (or the class's).
        :raises GatewayError: as :meth:`gateway.admission.admission.Admission.admit`
            (``StateUnavailable`` when Redis cannot be reached), from every backend.
        """
        party = party or Party()
        max_wait = queue.max_wait_s if party.max_wait_s is None else party.max_wait_s
        if not front:  # (one coming back goes to the head of every queue at once)
            await self._refresh(queue, candidates)
        ask = SharedAsk(candidates, affinity, "failover" if front else "queued", prefix,
                        party=party, front=front, max_wait_s=max_wait)
        cost = candidates[0].charge.tokens if candidates else 0
        waiter = queue.room.join(ask, party, cost, front=front)
        try:
            self._place(queue, waiter)
            candidate, lease = await queue.room.wait(waiter, max_wait,
                                                     lambda: queue.timed_out(max_wait))
        finally:
            self._withdraw(ask)
        lease.waited_s = queue.clock.now() - waiter.since
        return candidate, lease

    async def _refresh(self, queue: ModelQueue, candidates: Sequence[Candidate]) -> None:
        """Read anew the shared figures of the usable backends of ``candidates`` (one
        call each, together), so that the request is scored and placed on what every
        process holds now. A failure is left to the admissions (they refuse, or grant
        alone under ``on_unavailable = "local"``)."""
        if self.account is None:
            return
        now, account = queue.clock.now(), self.account
        calls = [account(c.backend).refresh(c.backend.admission.layout)
                 for c in candidates
                 if c.backend.usable(now) and c.backend.admission.layout is not None]
        await asyncio.gather(*calls, return_exceptions=True)

    def wake(self, queue: ModelQueue) -> None:
        """Place every waiter on the backends of its that became usable, and withdraw
        it from those no longer usable (down, draining)."""
        for waiter in list(queue.room):
            self._place(queue, waiter)

    def failed(self, queue: ModelQueue, backend: Target) -> None:
        """Withdraw the waiters from ``backend`` at once (its tickets would hold its
        shared queue for nothing), through the queue's own wake (a retired queue
        stops listening once empty)."""
        queue.wake()

    def _place(self, queue: ModelQueue, waiter: Waiter[PoolAsk, _Grant]) -> None:
        """Withdraw ``waiter`` from its backends no longer usable; place it on its
        usable ones it is not waiting on and that did not refuse it, best score first:
        on its best alone while that one fits it by the shared figures (its grant
        should come at once), else on every one."""
        ask = waiter.request
        assert isinstance(ask, SharedAsk)
        now = queue.clock.now()
        for key, (candidate, task) in list(ask.places.items()):
            if not candidate.backend.usable(now):
                del ask.places[key]
                task.cancel()
        if ask.places and not ask.spread:
            (candidate, _), = ask.places.values()
            if _fits_reserved(candidate):
                return  # its grant is on its way
            ask.spread = True
        new = [c for c in ask.candidates if id(c.backend) not in ask.places
               and id(c.backend) not in ask.refused and c.backend.usable(now)]
        if not new:
            return
        new.sort(key=lambda c: shared_score(c, ask.affinity), reverse=True)  # stable
        if not ask.places and not ask.spread:
            ask.fitted = fits_shared(new[0])
            if ask.fitted:
                self._start(queue, waiter, new[0])
                ask.timer = asyncio.ensure_future(self._spread_later(queue, waiter))
                return
            ask.spread = True
        for candidate in new:
            self._start(queue, waiter, candidate)

    def _start(self, queue: ModelQueue, waiter: Waiter[PoolAsk, _Grant],
               candidate: Candidate) -> None:
        """Queue ``waiter`` in ``candidate``'s backend's admission (its shared queue)."""
        ask = waiter.request
        assert isinstance(ask, SharedAsk)
        backend = candidate.backend
        task = asyncio.ensure_future(backend.admission.admit(
            candidate.charge, front=ask.front, party=ask.party,
            prefer=backend.slot_for(ask.prefix)))
        ask.places[id(backend)] = (candidate, task)
        task.add_done_callback(lambda t: self._settled(queue, waiter, candidate, t))

    async def _spread_later(self, queue: ModelQueue, waiter: Waiter[PoolAsk, _Grant]
                            ) -> None:
        """After :attr:`poll_s`, place a waiter still waiting on its best backend alone
        on every usable one (another process took that room first)."""
        await queue.clock.sleep(self.poll_s)
        ask = waiter.request
        assert isinstance(ask, SharedAsk)
        if not waiter.future.done() and not ask.spread:
            ask.spread = True
            self._place(queue, waiter)

    def _settled(self, queue: ModelQueue, waiter: Waiter[PoolAsk, _Grant],
                 candidate: Candidate, task: asyncio.Task[Lease]) -> None:
        """One of ``waiter``'s places ended: take its lease (and withdraw the others),
        give it back (the waiter is served or gone, or the backend no longer usable),
        or note its refusal (and fail the waiter once no place is left)."""
        ask = waiter.request
        assert isinstance(ask, SharedAsk)
        backend, key = candidate.backend, id(candidate.backend)
        if key in ask.places and ask.places[key][1] is task:
            del ask.places[key]
        if task.cancelled():
            return
        exc = task.exception()
        if isinstance(exc, Exception):  # (a cancellation returned above)
            ask.refused.add(key)
            ask.errors.append(exc)
            if not ask.places and not waiter.future.done():
                ask.spread = True  # refused by its best: the others may take it
                self._place(queue, waiter)
            if not ask.places and not waiter.future.done():
                queue.room.fail(waiter, self._refusal(queue, ask))
            return
        lease, now = task.result(), queue.clock.now()
        if waiter.future.done() or not backend.usable(now):
            backend.admission.release(lease, served=False)
            return
        backend.probe_started(now)
        queue.routed(backend, self._reason(ask, backend))
        self._withdraw(ask)
        queue.room.grant(waiter, (candidate, lease))

    @staticmethod
    def _reason(ask: SharedAsk, backend: Target) -> str:
        """The routing decision's name (``gateway_route_decisions_total``)."""
        if ask.front:
            return "failover"
        if not ask.fitted:
            return "queued"
        return "affinity" if backend.name == ask.affinity else "fit"

    @staticmethod
    def _withdraw(ask: SharedAsk) -> None:
        """Leave every backend's queue (a lease granted meanwhile is given back)."""
        places = list(ask.places.values())
        ask.places.clear()
        if ask.timer is not None:
            ask.timer.cancel()
        for _, task in places:
            task.cancel()

    @staticmethod
    def _refusal(queue: ModelQueue, ask: SharedAsk) -> Exception:
        """The error of a waiter every place refused: a backend's own error, or the
        pool's words for a full queue, a shed place or a wait that ran out."""
        errors = ask.errors
        other = [e for e in errors if not isinstance(e, QueueFull | QueueTimeout)]
        if other:
            return other[0]
        if any(isinstance(e, QueueTimeout) for e in errors):
            return queue.timed_out(ask.max_wait_s)
        if any(isinstance(e, Shed) for e in errors):
            return queue.shed()
        return queue.full()
