"""Several backends behind one gateway: model names, one queue per model, routing by fit.

**Names.** Each backend serves one model, named by ``backends[].model`` or else by the id
the backend reports (``GET /v1/models``), plus its ``aliases``. A request's ``model``
picks, in this order (:meth:`gateway.fleet.fleet.Fleet.resolve`):

1. the backend of that *name*, alone (pinning one server, as before pools existed);
2. every backend whose model or alias it is: the model's **pool**;
3. otherwise ``routing.default_model``'s pool; without one, the only model when every
   backend serves the same one (as a lone llama-server ignores the field); otherwise
   404 ``model_not_found``.

**Routing by fit.** A request is planned against each backend of its pool that is ready,
up and not draining (its charge follows each layout: a prompt too long for one slot size
may fit another's). It goes to a backend where that charge fits *now*; among several, to
the one with the best score (:func:`score`). When none fits, it waits in the pool's one
queue (:class:`ModelQueue`, in the order of :mod:`gateway.core.fairness`: FIFO while every
request has one tenant and class) and starts on whichever backend frees room first. A
backend a waiter ahead could use is never given to one behind it, so nothing starves;
a waiter behind may start on a backend no waiter ahead can use.

**Health.** A backend a request failed on before any byte reached the client is marked
down for a backoff (:meth:`gateway.backends.target.Target.request_failed`); once the backoff has
passed, one request probes it (half-open) and a success brings it back.
"""

from __future__ import annotations

import asyncio
import logging
from collections import OrderedDict
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from gateway.admission.lease import Lease
from gateway.admission.slo import late_backends
from gateway.admission.waitroom import Waiter, Waitroom, shed_error
from gateway.backends.target import Target
from gateway.clock import Clock
from gateway.core.capacity import Charge
from gateway.core.fairness import Party
from gateway.core.prefix import AFFINITY_PROMPT_CHARS, Prefix, digest
from gateway.errors import QueueFull, QueueTimeout

__all__ = ["AFFINITY_BONUS", "AdmitPath", "Candidate", "LocalPoolGrantor", "LoneBackend",
           "ModelQueue", "PoolGrantor", "affinity_key", "score"]

log = logging.getLogger(__name__)

# Conversations remembered per model for prefix affinity.
AFFINITY_ENTRIES = 4096

# Added to the score of the backend that served the conversation's prefix last: more than
# the 2.0 the other terms can reach, so affinity wins whenever that backend fits.
AFFINITY_BONUS = 3.0


@dataclass
class Candidate:
    """A request planned for one backend of its pool.

    :param backend: the backend.
    :param charge: what it reserves there (its cap follows that backend's slot size).
    :param body: the body to forward there.
    :param tag: the ``(param, value)`` that identifies it upstream, or ``None``.
    :param tracked: followed live under the predictive policy on this backend.
    """

    backend: Target
    charge: Charge
    body: dict[str, Any]
    tag: tuple[str, int] | None = None
    tracked: bool = False


def score(candidate: Candidate, affinity: str | None = None) -> float:
    """How good a backend is for a request that fits there now; higher is better.

    The sum of the fractions of its KV capacity and of its slots left free after this
    request (each 0-1), plus :data:`AFFINITY_BONUS` when it is the backend ``affinity``
    names (the one that served this conversation's prefix last). Ties go to the backend
    configured first.
    """
    tokens, slots = candidate.backend.admission.headroom(candidate.charge)
    bonus = AFFINITY_BONUS if candidate.backend.name == affinity else 0.0
    return tokens + slots + bonus


class AdmitPath(Protocol):
    """The way to a lease for a planned request, whether its model is one backend
    (:class:`LoneBackend`) or a pool (:class:`ModelQueue`): callers ask it and never
    branch on which it is.

    A request is planned as ``candidates``, one :class:`Candidate` per backend it may
    run on (one for a lone backend); a grant names the candidate it went to.
    """

    @property
    def failover(self) -> bool:
        """Another backend may take a request its backend failed before any byte."""
        ...

    @property
    def max_wait_s(self) -> float:
        """The longest a request waits here unless its class says otherwise, seconds."""
        ...

    def check_room(self, party: Party | None = None) -> None:
        """Raise at once when a new request could only queue and the queue is full.

        :raises QueueFull: as :meth:`ModelQueue.check_room`.
        """
        ...

    def try_admit(self, candidates: Sequence[Candidate], affinity: str | None = None,
                  party: Party | None = None, prefix: Prefix | None = None
                  ) -> tuple[Candidate, Lease] | None:
        """A lease now, or ``None`` (see :meth:`ModelQueue.try_admit`)."""
        ...

    async def admit(self, candidates: Sequence[Candidate], affinity: str | None = None,
                    *, front: bool = False, party: Party | None = None,
                    prefix: Prefix | None = None) -> tuple[Candidate, Lease]:
        """Wait for a lease (see :meth:`ModelQueue.admit`).

        :raises GatewayError: as :meth:`gateway.admission.admission.Admission.admit`.
        """
        ...

    def backend_failed(self, backend: Target) -> float | None:
        """A request failed on ``backend`` before answering: mark it down where another
        backend could take its requests, and look at the queue again when it may be
        used. Returns the seconds it is down, or ``None`` (not marked)."""
        ...

    def position(self, candidates: Sequence[Candidate]) -> int | None:
        """1-based place in the queue of the request planned as ``candidates`` (``None``:
        it is not waiting)."""
        ...

    def progress(self, candidates: Sequence[Candidate]) -> tuple[int, float | None] | None:
        """While it waits: its place (1 = next) and the predicted seconds to its start
        (``None`` when not predicted); ``None`` when it is not waiting."""
        ...

    def remember(self, key: str | None, backend: str) -> None:
        """Note that ``backend`` now serves the conversation prefix ``key``."""
        ...


@dataclass(eq=False)
class LoneBackend:
    """The :class:`AdmitPath` of a model served by one backend: its own admission queue.

    The request is planned as one candidate, on ``backend``; its slot affinity
    (``prefix``) picks the slot to prefer there. Affinity between backends means nothing
    here, and no other backend may take a failed request.
    """

    backend: Target
    failover: bool = False
    max_wait_s: float = 30.0  # admission.max_queue_wait_s, as the backend's queue has it

    def check_room(self, party: Party | None = None) -> None:
        """Raise ``QueueFull`` at once when a new request could only queue
        (:meth:`gateway.admission.admission.Admission.check_queue_room`)."""
        self.backend.admission.check_queue_room(party)

    def try_admit(self, candidates: Sequence[Candidate], affinity: str | None = None,
                  party: Party | None = None, prefix: Prefix | None = None
                  ) -> tuple[Candidate, Lease] | None:
        """A lease now on the backend, or ``None`` (refused while others wait there)."""
        candidate = self._one(candidates)
        lease = self.backend.admission.try_admit(
            candidate.charge, party=party, prefer=self.backend.slot_for(prefix))
        return None if lease is None else (candidate, lease)

    async def admit(self, candidates: Sequence[Candidate], affinity: str | None = None,
                    *, front: bool = False, party: Party | None = None,
                    prefix: Prefix | None = None) -> tuple[Candidate, Lease]:
        """Wait for a lease in the backend's queue (with ``front``, at its head).

        :raises GatewayError: as :meth:`gateway.admission.admission.Admission.admit`.
        """
        candidate = self._one(candidates)
        lease = await self.backend.admission.admit(
            candidate.charge, front=front, party=party, prefer=self.backend.slot_for(prefix))
        return candidate, lease

    def backend_failed(self, backend: Target) -> float | None:
        """Not marked: there is no other backend to route its requests to."""
        return None

    def position(self, candidates: Sequence[Candidate]) -> int | None:
        """1-based place in the backend's queue (``None``: not waiting)."""
        return self.backend.admission.queue_position(self._one(candidates).charge)

    def progress(self, candidates: Sequence[Candidate]) -> tuple[int, float | None] | None:
        """Its place in the backend's queue and its predicted wait, seconds."""
        charge, admission = self._one(candidates).charge, self.backend.admission
        position = admission.queue_position(charge)
        return None if position is None else (position, admission.eta_s(charge))

    def remember(self, key: str | None, backend: str) -> None:
        """Nothing to remember: there is no other backend to prefer."""

    def _one(self, candidates: Sequence[Candidate]) -> Candidate:
        if len(candidates) != 1 or candidates[0].backend is not self.backend:
            raise ValueError("a lone backend's request is planned as one candidate, on "
                             f"that backend ({self.backend.name!r}); got {len(candidates)}")
        return candidates[0]


@dataclass(eq=False)
class PoolAsk:
    """What a waiter of a pool's queue asks for."""

    candidates: Sequence[Candidate]
    affinity: str | None = None
    reason: str = "queued"  # for gateway_route_decisions_total
    prefix: Prefix | None = None  # what its prompt holds (slot affinity)
    # The backends (ids) where it would start after its TTFT deadline: never its own.
    late: frozenset[int] = frozenset()

    def usable(self) -> list[Candidate]:
        """Its candidates on the backends it may start on (not :attr:`late` ones)."""
        return [c for c in self.candidates if id(c.backend) not in self.late]


_Grant = tuple[Candidate, Lease]


class PoolGrantor(Protocol):
    """Who grants the requests of a pool's queue: this process alone
    (:class:`LocalPoolGrantor`, judging each member's budget synchronously), or the
    queues every gateway process shares
    (:class:`~gateway.fleet.shared_pool.SharedPoolGrantor`). Chosen once, where the app
    is built (:func:`gateway.http.app.create_app`); the :class:`ModelQueue` keeps what
    is the pool's (its waiting room, affinity, bounds, timers) and hands each step of a
    request to its grantor, never asking which it has. A third state store is a third
    implementation of this protocol.
    """

    def bind(self, queue: ModelQueue) -> None:
        """Attach to ``queue`` (once, when it is built)."""
        ...

    def check_room(self, queue: ModelQueue, party: Party | None) -> None:
        """As :meth:`ModelQueue.check_room`.

        :raises QueueFull: no backend of the pool would let the request wait.
        """
        ...

    def try_admit(self, queue: ModelQueue, candidates: Sequence[Candidate],
                  affinity: str | None, party: Party | None, prefix: Prefix | None
                  ) -> tuple[Candidate, Lease] | None:
        """As :meth:`ModelQueue.try_admit`."""
        ...

    async def admit(self, queue: ModelQueue, candidates: Sequence[Candidate],
                    affinity: str | None, *, front: bool, party: Party | None,
                    prefix: Prefix | None) -> tuple[Candidate, Lease]:
        """As :meth:`ModelQueue.admit`.

        :raises GatewayError: as :meth:`ModelQueue.admit`.
        """
        ...

    def wake(self, queue: ModelQueue) -> None:
        """Something may have made room on a member: start who can start."""
        ...

    def failed(self, queue: ModelQueue, backend: Target) -> None:
        """``backend`` was just marked down after a failed request."""
        ...


@dataclass(eq=False)
class ModelQueue:
    """One queue for the backends of one model (ordered by :class:`FairQueue`).

    Each member's own admission queue is left to requests that must come back to that
    backend (a preempted answer resuming where its prefix is cached); those go first, as
    :meth:`gateway.admission.admission.Admission.try_admit` refuses others while they wait.

    :param members: the pool's backends; each calls :meth:`wake` when it frees room.
    :param max_queue: most requests allowed to wait; 0 means never wait.
    :param max_wait_s: longest wait, seconds.
    :param clock: injected time source.
    :param age_s: priority ageing, seconds per class (:class:`FairQueue`).
    :param grantor: who grants its requests (:class:`PoolGrantor`): by default this
        process alone (:class:`LocalPoolGrantor`).
    """

    members: Sequence[Target]
    max_queue: int
    max_wait_s: float
    clock: Clock
    model: str = ""
    failover: bool = True  # routing.failover
    down_initial_s: float = 1.0  # routing.down_initial_s
    down_max_s: float = 30.0  # routing.down_max_s
    # Called with (backend name, reason) for each request routed (metrics).
    on_route: Callable[[str, str], None] | None = None
    retired: bool = False  # replaced by a reload; serves only those waiting here
    age_s: float = 30.0
    grantor: PoolGrantor = field(default_factory=lambda: LocalPoolGrantor())
    room: Waitroom[PoolAsk, _Grant] = field(init=False)
    _timers: set[asyncio.Task[None]] = field(default_factory=set)  # wake_later's
    # Conversation prefix key -> the backend that served it last, least recent first.
    _affinity: OrderedDict[str, str] = field(default_factory=OrderedDict)

    def affinity_for(self, key: str | None) -> str | None:
        """The backend that served the conversation prefix ``key`` last, if any."""
        return None if key is None else self._affinity.get(key)

    def remember(self, key: str | None, backend: str) -> None:
        """Note that ``backend`` now serves the conversation prefix ``key`` (the most
        recent :data:`AFFINITY_ENTRIES` keys are kept)."""
        if key is None:
            return
        self._affinity[key] = backend
        self._affinity.move_to_end(key)
        while len(self._affinity) > AFFINITY_ENTRIES:
            self._affinity.popitem(last=False)

    def __post_init__(self) -> None:
        self.room = Waitroom(self.clock, age_s=self.age_s, max_queue=self.max_queue,
                             full=self.full, give_back=self._give_back, on_leave=self.wake)
        self.grantor.bind(self)
        for backend in self.members:
            backend.admission.add_listener(self.wake)

    @property
    def waiting(self) -> int:
        """Requests waiting in this queue."""
        return len(self.room)

    def oldest_wait_s(self) -> float:
        """How long the request waiting longest here has waited so far, seconds (0.0
        when none waits)."""
        return self.room.oldest_wait_s()

    def retire(self) -> None:
        """A reload replaced this queue: new requests go to another. The requests
        waiting here stay, and start on the backends of theirs still taking requests;
        once none waits, the queue stops listening to its backends."""
        self.retired = True
        self.wake()

    def refuse_waiting(self, exc: Exception) -> None:
        """Fail every request waiting here with ``exc`` (the gateway is stopping)."""
        self.room.refuse_waiting(exc)

    def check_room(self, party: Party | None = None) -> None:
        """Raise at once when a new request could only queue and the queue is full.

        :raises QueueFull: ``max_queue`` requests wait already (and at least one does),
            none of a class lower than ``party``'s (which it would shed); with shared
            state, every usable member's own queue is full.
        """
        self.grantor.check_room(self, party)

    def position(self, candidates: Sequence[Candidate]) -> int | None:
        """1-based place in the queue of the request planned as ``candidates``."""
        return self.room.position(lambda ask: ask.candidates is candidates)

    def progress(self, candidates: Sequence[Candidate]) -> tuple[int, float | None] | None:
        """Its place in the queue while it waits; a pool predicts no wait (``None``)."""
        position = self.position(candidates)
        return None if position is None else (position, None)

    def try_admit(self, candidates: Sequence[Candidate], affinity: str | None = None,
                  party: Party | None = None, prefix: Prefix | None = None
                  ) -> tuple[Candidate, Lease] | None:
        """A lease now on the best backend where the request fits, or ``None`` (always,
        with shared state: the shared queues decide). ``prefix`` picks the slot there
        whose cached prompt the request continues.

        :raises SloUnattainable: it would start late on every usable backend.
        """
        return self.grantor.try_admit(self, candidates, affinity, party, prefix)

    async def admit(self, candidates: Sequence[Candidate], affinity: str | None = None,
                    *, front: bool = False, party: Party | None = None,
                    prefix: Prefix | None = None) -> tuple[Candidate, Lease]:
        """Wait, in the order of :class:`FairQueue`, for room on any backend of the
        pool; with ``front``, at the head of the queue (a request coming back after a
        backend failed it), where neither the queue bound nor others waiting hold it
        back. When the queue is full, the newest waiter of the lowest class below
        ``party``'s is shed to make room; with none, this request is refused.

        :raises QueueFull: ``max_queue`` requests already wait (at once).
        :raises QueueTimeout: the wait passed ``max_wait_s`` (or the class's).
        :raises SloUnattainable: as :meth:`try_admit` (at once).
        :raises GatewayError: with shared state, as
            :meth:`gateway.admission.admission.Admission.admit` from every backend.
        """
        return await self.grantor.admit(self, candidates, affinity, front=front,
                                        party=party, prefix=prefix)

    def wake(self) -> None:
        """Start the waiters that can start now (:meth:`PoolGrantor.wake`); once a
        retired queue is empty, stop listening to its backends."""
        if self.retired and not self.room:
            for backend in self.members:
                backend.admission.remove_listener(self.wake)
            return
        self.grantor.wake(self)

    def backend_failed(self, backend: Target) -> float:
        """Mark ``backend`` down for the pool's backoff
        (:meth:`gateway.backends.target.Target.request_failed`) and look at the queue again
        once it has passed, when nothing else would wake its waiters.

        :returns: how long it is down, seconds.
        """
        down = backend.request_failed(self.down_initial_s, self.down_max_s)
        self.wake_later(down)
        self.grantor.failed(self, backend)
        return down

    def wake_later(self, delay_s: float) -> None:
        """Look at the queue again in ``delay_s`` seconds of its clock (when a backend
        marked down may take requests again: nothing else would wake the waiters then),
        in a named task the queue owns (:meth:`close` ends it)."""
        task = asyncio.get_running_loop().create_task(
            self._wake_after(delay_s), name=f"pool {self.model!r}: wake in {delay_s:g} s")
        self._timers.add(task)
        task.add_done_callback(self._timers.discard)

    async def _wake_after(self, delay_s: float) -> None:
        await self.clock.sleep(delay_s)
        self.wake()

    def close(self) -> None:
        """End the queue's timers (shutdown, or a retired queue dropped once empty)."""
        for task in list(self._timers):
            task.cancel()

    def retry_after_s(self) -> float:
        """The soonest any member expects room, seconds (1-60)."""
        return min((b.admission.retry_after_s() for b in self.members), default=1.0)

    def routed(self, backend: Target, reason: str) -> None:
        """A request of this queue was granted on ``backend`` for ``reason``
        (``gateway_route_decisions_total``)."""
        if self.on_route is not None:
            self.on_route(backend.name, reason)

    @staticmethod
    def _give_back(got: _Grant) -> None:
        """Release a lease granted to a waiter as it was leaving."""
        candidate, lease = got
        candidate.backend.admission.release(lease, served=False)

    def timed_out(self, max_wait_s: float) -> QueueTimeout:
        """The 503 of a request that waited ``max_wait_s`` seconds here in vain."""
        return QueueTimeout(
            f"The request waited {max_wait_s:g} s in the queue without room on "
            "any backend of its model; retry after the Retry-After delay.",
            retry_after_s=self.retry_after_s())

    def full(self) -> QueueFull:
        """The 503 of a request refused at a full queue."""
        return QueueFull(
            f"The queue for this model is full ({self.max_queue} waiting); retry after "
            "the Retry-After delay.", retry_after_s=self.retry_after_s())

    def shed(self) -> QueueFull:
        """The 503 of a waiter shed for a request of a higher class."""
        return shed_error(f"The queue for this model is full ({self.max_queue} waiting).",
                          self.retry_after_s())


class LocalPoolGrantor:
    """This process alone reserves on the pool's backends: a request is granted
    synchronously on the best member where it fits now, else waits in the pool's one
    queue, served in order whenever a member frees room (see the module's docstring)."""

    def bind(self, queue: ModelQueue) -> None:
        """Nothing to attach: the pool's room keeps its ``max_queue``."""

    def check_room(self, queue: ModelQueue, party: Party | None) -> None:
        """The pool's room is full (:meth:`Waitroom.check_room`).

        :raises QueueFull: as :meth:`ModelQueue.check_room`.
        """
        queue.room.check_room(party)

    def try_admit(self, queue: ModelQueue, candidates: Sequence[Candidate],
                  affinity: str | None, party: Party | None, prefix: Prefix | None
                  ) -> tuple[Candidate, Lease] | None:
        """A lease now on the best backend where the request fits, or ``None``. A
        backend that a request waiting ahead of it could use is not given to it, nor one
        where it would start after its TTFT deadline even now (:func:`late_backends`).

        :raises SloUnattainable: it would start late on every usable backend.
        """
        party = party or Party()
        cost = candidates[0].charge.tokens if candidates else 0
        ahead = queue.room.ahead_of(party, cost) if queue.room else []
        blocked = self._blocked(ahead) | self._late(queue, candidates, party)
        got = self._grant(queue, [c for c in candidates if id(c.backend) not in blocked],
                          affinity, prefix=prefix, hold=(party, 0.0))
        if got is not None:
            queue.room.charge(party, got[0].charge.tokens)
        return got

    async def admit(self, queue: ModelQueue, candidates: Sequence[Candidate],
                    affinity: str | None, *, front: bool, party: Party | None,
                    prefix: Prefix | None) -> tuple[Candidate, Lease]:
        """As :meth:`ModelQueue.admit`: granted at once, else joins the pool's room.

        :raises GatewayError: as :meth:`ModelQueue.admit`.
        """
        party = party or Party()
        late: frozenset[int] = frozenset()
        if front:
            got = self._grant(queue, candidates, affinity, "failover", prefix)
            if got is not None:
                queue.room.charge(party, got[0].charge.tokens)
        else:
            got = self.try_admit(queue, candidates, affinity, party, prefix)
            late = self._late(queue, candidates, party)
        if got is not None:
            return got
        victim = None if front else queue.room.victim_for(party)
        if victim is not None:
            queue.room.fail(victim, queue.shed())
        max_wait = queue.max_wait_s if party.max_wait_s is None else party.max_wait_s
        cost = candidates[0].charge.tokens if candidates else 0
        waiter = queue.room.join(
            PoolAsk(candidates, affinity, "failover" if front else "queued", prefix, late),
            party, cost, front=front)
        queue.wake()  # it may go before waiters that wait for room it does not need
        candidate, lease = await queue.room.wait(waiter, max_wait,
                                                 lambda: queue.timed_out(max_wait))
        lease.waited_s = queue.clock.now() - waiter.since
        return candidate, lease

    def wake(self, queue: ModelQueue) -> None:
        """Start waiters in the queue's order. A waiter that fits nowhere yet keeps
        every backend it could use from the waiters behind it, which may still start on
        backends it cannot use: nothing starves, and no backend idles behind a head that
        waits for another one."""
        blocked: set[int] = set()
        for waiter in queue.room.order():
            ask = waiter.request
            allowed = [c for c in ask.usable() if id(c.backend) not in blocked]
            hold = None if ask.reason == "failover" else (
                waiter.party, queue.clock.now() - waiter.since)
            got = (self._grant(queue, allowed, ask.affinity, ask.reason, ask.prefix, hold)
                   if allowed else None)
            if got is None:
                blocked.update(id(c.backend) for c in ask.usable())
                if len(blocked) >= len(queue.members):
                    return
                continue
            queue.room.grant(waiter, got)

    def failed(self, queue: ModelQueue, backend: Target) -> None:
        """Nothing more: the queue looks again once the backoff has passed."""

    @staticmethod
    def _blocked(ahead: Iterable[Waiter[PoolAsk, _Grant]]) -> set[int]:
        """The backends (ids) the waiters ``ahead`` could use."""
        return {id(c.backend) for waiter in ahead for c in waiter.request.usable()}

    @staticmethod
    def _late(queue: ModelQueue, candidates: Sequence[Candidate], party: Party
              ) -> frozenset[int]:
        """The backends (ids) where the request would start late even now
        (:func:`gateway.admission.slo.late_backends`, over the usable ones).

        :raises SloUnattainable: that is every usable one.
        """
        now = queue.clock.now()
        return late_backends({id(c.backend): (c.backend.admission.slo, c.charge)
                              for c in candidates if c.backend.usable(now)}, party)

    @staticmethod
    def _grant(queue: ModelQueue, candidates: Iterable[Candidate], affinity: str | None,
               reason: str | None = None, prefix: Prefix | None = None,
               hold: tuple[Party, float] | None = None) -> tuple[Candidate, Lease] | None:
        """A lease on the best backend of ``candidates`` where the request fits now, or
        ``None``. With ``hold`` (its party and the seconds it has waited), a backend
        where its prefill is held back (:meth:`SloGuard.hold_s
        <gateway.admission.slo.SloGuard.hold_s>`: targeted streams decode there) offers
        no room, so it goes where none would stall; without, nothing holds it (a request
        coming back after a failure)."""
        now = queue.clock.now()
        fitting = [c for c in candidates if c.backend.usable(now) and (
            c.backend.admission.fits_now(c.charge) if hold is None
            else c.backend.admission.fits_now(c.charge, hold[0], hold[1],
                                              cached=c.backend.slot_for(prefix) is not None))]
        if not fitting:
            return None
        best = max(fitting, key=lambda c: score(c, affinity))  # first of equals wins
        # front: fits_now judged its room and its hold already (the pool's own queue
        # is what it waited in; none waits in the backend's).
        lease = best.backend.admission.try_admit(best.charge, front=True,
                                                 prefer=best.backend.slot_for(prefix))
        if lease is None:  # fits_now said yes; a race is impossible on one loop
            return None
        best.backend.probe_started(now)
        queue.routed(best.backend, reason or (
            "affinity" if best.backend.name == affinity else "fit"))
        return best, lease


def affinity_key(body: dict[str, Any]) -> str | None:
    """A key for the conversation a request continues, or ``None`` when it has none.

    Chat-shaped bodies: the messages up to and including the first user message (the
    system prompt and the opening question), which every later turn repeats. Prompt
    bodies: the first :data:`AFFINITY_PROMPT_CHARS` characters of the prompt. llama-server
    keeps each slot's last prompt (``cache_prompt``), so a later turn sent to the same
    backend reuses that prefix instead of computing it again.
    """
    messages = body.get("messages") or body.get("input")
    if isinstance(messages, list) and messages:
        head = []
        for message in messages:
            head.append(message)
            if isinstance(message, dict) and message.get("role") == "user":
                break
        seed: Any = [body.get("system"), head]
    elif isinstance(body.get("prompt"), str):
        seed = body["prompt"][:AFFINITY_PROMPT_CHARS]
    else:
        return None
    return digest(seed, 16)
