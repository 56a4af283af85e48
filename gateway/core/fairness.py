"""Who is admitted next: priority classes with ageing, and fair shares of KV tokens.

Pure and synchronous (no I/O, no clock of its own: every call is given ``now``). The
admission queues (:class:`gateway.admission.admission.Admission` for one backend,
:class:`gateway.fleet.pool.ModelQueue` for a pool) keep their waiters in a :class:`FairQueue`
and serve them in the order it gives. Its rule:

1. Requests coming back to the head (``front``: a preempted answer resuming, a request
   failed over) go first, in the order they came back.
2. Then the highest **effective class**. A request's class has a rank (0 for the highest
   of ``[[classes]]``); it competes one rank higher for every ``age_s`` seconds it has
   waited, down to 0. A batch request that has waited ``age_s`` competes as interactive,
   so no class starves however busy the classes above it are.
3. Within an effective class, the tenant with the least **virtual time**: the KV tokens
   admitted for it (each request's reservation, ``Charge.tokens``) divided by its
   weight. A tenant that starts waiting is first brought up to the least virtual time
   of the tenants already waiting (or, when none waits, to the largest any tenant has
   reached), so time spent idle earns no credit; a tenant served more than the others
   keeps its lead (after start-time fair queueing, Goyal, Vin and Cheng, SIGCOMM 1996).
   Two tenants that both wait are thus served KV tokens in proportion to their
   weights, within one reservation of each other; a tenant's first request waits behind
   at most one request of a tenant already waiting.
4. Then, among one tenant's requests of one class, the earliest **due time** first: a
   request's arrival plus its TTFT deadline (``x-gateway-slo-ttft-ms``), or plus its
   longest queue wait when it has none (so that requests without a deadline are never
   passed for ever); ties, and a class whose requests carry no deadlines, in arrival
   order (first-in, first-out).

A waiter that does not fit yet keeps its place: the queues do not let later waiters past
it on the backends it could use (head-of-line), so the order above is the admission order.
"""

from __future__ import annotations

import heapq
import itertools
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Generic, TypeVar

__all__ = ["ANONYMOUS", "FairQueue", "Party"]

ANONYMOUS = "anonymous"  # the tenant of every request when no tenant is configured

T = TypeVar("T")


@dataclass(frozen=True)
class Party:
    """Who a request is for, as the queues see it.

    :param tenant: the tenant's name (:data:`ANONYMOUS` on an open gateway).
    :param rank: its class's rank, 0 for the highest class.
    :param priority: the class's name (for metrics labels).
    :param weight: the tenant's share weight (> 0).
    :param max_wait_s: the longest it may wait in the queue, seconds, or ``None`` for the
        queue's own limit.
    :param ttft_target_s: its class's TTFT p95 target, seconds (``None``: none);
        ``itl_target_s`` its class's ITL p95 target, seconds (``docs/latency.md``).
    :param ttft_deadline_s: the request's own TTFT deadline, seconds after its arrival
        (:func:`gateway.wire.slo.parse_ttft_deadline`), or ``None``.
    :param serve_late: its class serves a request predicted to miss its TTFT deadline
        rather than refuse it (``late = "serve"``).
    :param ttft_spent_s: seconds since its arrival spent before its admission (reading,
        counting, its tenant's gate): they count towards its TTFT deadline.
    """

    tenant: str = ANONYMOUS
    rank: int = 0
    priority: str = "default"
    weight: float = 1.0
    max_wait_s: float | None = None
    ttft_target_s: float | None = None
    itl_target_s: float | None = None
    ttft_deadline_s: float | None = None
    serve_late: bool = False
    ttft_spent_s: float = 0.0


@dataclass(eq=False)
class _Entry(Generic[T]):
    item: T
    party: Party
    cost: int  # KV tokens its admission will charge
    since: float  # clock time it started waiting, seconds
    seq: int
    due: float = float("inf")  # since + its TTFT deadline (or its longest wait), seconds


@dataclass
class FairQueue(Generic[T]):
    """Waiters in the order of the module's rule. Items are compared by identity.

    :param age_s: seconds of waiting that raise a request one class (> 0).
    """

    age_s: float = 30.0
    _front: deque[_Entry[T]] = field(default_factory=deque)
    # One FIFO lane per (tenant, rank).
    _lanes: dict[tuple[str, int], deque[_Entry[T]]] = field(default_factory=dict)
    _where: dict[int, _Entry[T]] = field(default_factory=dict)  # id(item) -> entry
    _waiting: dict[str, int] = field(default_factory=dict)  # waiters per tenant
    _vtime: dict[str, float] = field(default_factory=dict)  # tenant -> virtual time
    _clock_v: float = 0.0  # the largest virtual time any tenant has reached
    _seq: itertools.count[int] = field(default_factory=itertools.count)

    def __len__(self) -> int:
        return len(self._where)

    def __bool__(self) -> bool:
        return bool(self._where)

    def __contains__(self, item: object) -> bool:
        return id(item) in self._where

    def push(self, item: T, party: Party, cost: int, now: float, *,
             front: bool = False) -> None:
        """Add a waiter. ``cost`` is the KV tokens its admission will charge; ``now`` the
        clock time (seconds); ``front`` puts it with the requests coming back."""
        entry = _Entry(item, party, cost, now, next(self._seq))
        if not self._waiting.get(party.tenant):  # it starts waiting: no idle credit
            self._vtime[party.tenant] = self._joining(party.tenant)
        self._waiting[party.tenant] = self._waiting.get(party.tenant, 0) + 1
        self._where[id(item)] = entry
        if front:
            self._front.append(entry)
            return
        limit = party.ttft_deadline_s if party.ttft_deadline_s is not None else party.max_wait_s
        entry.due = now + limit if limit is not None else float("inf")
        lane = self._lanes.setdefault((party.tenant, party.rank), deque())
        place = len(lane)
        while place and lane[place - 1].due > entry.due:  # earliest due first, else FIFO
            place -= 1
        lane.insert(place, entry)

    def remove(self, item: T) -> bool:
        """Take a waiter out (admitted elsewhere, timed out, gone); False if absent."""
        entry = self._where.pop(id(item), None)
        if entry is None:
            return False
        if entry in self._front:
            self._front.remove(entry)
        else:
            key = (entry.party.tenant, entry.party.rank)
            lane = self._lanes[key]
            lane.remove(entry)
            if not lane:
                del self._lanes[key]
        self._waiting[entry.party.tenant] -= 1
        return True

    def charge(self, party: Party, cost: int) -> None:
        """Note that a request of ``party`` was admitted without waiting, with a
        reservation of ``cost`` KV tokens: its tenant's virtual time advances by
        ``cost / weight`` from at least the last admitted request's."""
        own = self._vtime.get(party.tenant, 0.0)
        self._advance(party, cost, own if self._waiting.get(party.tenant) else
                      self._joining(party.tenant))

    def take(self, item: T) -> None:
        """Remove the waiter ``item`` because it was admitted, charging its tenant its
        cost (from the tenant's own virtual time: it waited for its turn)."""
        entry = self._where[id(item)]
        start = self._vtime.get(entry.party.tenant, 0.0)
        self.remove(item)
        self._advance(entry.party, entry.cost, start)

    def _joining(self, tenant: str) -> float:
        """The virtual time of ``tenant`` as it starts waiting (see the module doc)."""
        waiting = [self._vtime[t] for t, n in self._waiting.items() if n and t != tenant]
        base = min(waiting) if waiting else self._clock_v
        return max(self._vtime.get(tenant, 0.0), base)

    def _advance(self, party: Party, cost: int, start: float) -> None:
        finish = start + cost / party.weight
        self._clock_v = max(self._clock_v, finish)
        self._vtime[party.tenant] = finish

    def since(self, item: T) -> float:
        """When ``item`` started waiting (clock seconds)."""
        return self._where[id(item)].since

    def party(self, item: T) -> Party:
        """The party ``item`` was pushed with."""
        return self._where[id(item)].party

    def head(self, now: float) -> T | None:
        """The waiter to admit next, or ``None`` when none waits."""
        for item in self._ordered(now):
            return item
        return None

    def order(self, now: float) -> list[T]:
        """Every waiter, in the order they would be admitted if each were admitted in
        turn (the virtual times advancing as they would)."""
        return list(self._ordered(now))

    def arrival_order(self) -> list[T]:
        """Every waiter, in the order they arrived (front ones first)."""
        rest = sorted((e for lane in self._lanes.values() for e in lane), key=lambda e: e.seq)
        return [e.item for e in (*self._front, *rest)]

    def ahead_of(self, party: Party, cost: int, now: float) -> list[T]:
        """The waiters that would be admitted before a request of ``party`` and ``cost``
        arriving now (used to predict its wait)."""
        probe = object()
        saved = dict(self._vtime)
        self.push(probe, party, cost, now)  # type: ignore[arg-type]
        try:
            ahead: list[T] = []
            for item in self._ordered(now):
                if item is probe:
                    return ahead
                ahead.append(item)
            return ahead
        finally:
            self.remove(probe)  # type: ignore[arg-type]
            self._vtime = saved

    def shed_for(self, party: Party) -> T | None:
        """The waiter to drop so that a request of ``party`` may queue when the queue is
        full: the newest of the lowest class below ``party``'s, or ``None`` when every
        waiter's class is as high as its (then the newcomer is refused instead)."""
        lowest: _Entry[T] | None = None
        for lane in self._lanes.values():
            last = lane[-1]
            if last.party.rank <= party.rank:
                continue
            if lowest is None or (last.party.rank, last.seq) > (lowest.party.rank, lowest.seq):
                lowest = last
        return None if lowest is None else lowest.item

    def effective_rank(self, entry: _Entry[T], now: float) -> int:
        """``entry``'s class rank less one per ``age_s`` waited, at least 0."""
        return max(0, entry.party.rank - int(max(0.0, now - entry.since) // self.age_s))

    def _lane_rank(self, lane: deque[_Entry[T]], i: int, now: float) -> int:
        """The effective rank of a lane from its ``i``-th entry on: that of the longest
        waiting of them (a request due sooner may stand before an older one, which must
        not age more slowly for it)."""
        oldest = min(range(i, len(lane)), key=lambda j: lane[j].since)
        return self.effective_rank(lane[oldest], now)

    def _ordered(self, now: float) -> Iterator[T]:
        for entry in self._front:
            yield entry.item
        vtime = dict(self._vtime)
        heap: list[tuple[int, float, int, int, deque[_Entry[T]]]] = []
        for lane in self._lanes.values():
            head = lane[0]
            heapq.heappush(heap, (self._lane_rank(lane, 0, now),
                                  vtime[head.party.tenant], head.seq, 0, lane))
        # A lane's entries after its head; the tuple carries the index in the lane.
        while heap:
            _rank, _v, _seq, i, lane = heapq.heappop(heap)
            entry = lane[i]
            yield entry.item
            tenant = entry.party.tenant
            vtime[tenant] += entry.cost / entry.party.weight
            # A tenant's other lanes now come later: refresh their keys lazily.
            for k, (r, _v, s, j, other) in enumerate(heap):
                if other[j].party.tenant == tenant:
                    heap[k] = (r, vtime[tenant], s, j, other)
            heapq.heapify(heap)
            if i + 1 < len(lane):
                nxt = lane[i + 1]
                heapq.heappush(heap, (self._lane_rank(lane, i + 1, now), vtime[tenant],
                                      nxt.seq, i + 1, lane))

    def __iter__(self) -> Iterator[T]:
        return iter(self.arrival_order())
