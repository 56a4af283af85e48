"""Async admission queue over the pure capacity model.

A request asks for a :class:`Lease` on a backend with its :class:`~gateway.capacity.Charge`.
It gets one at once when nobody is waiting and the charge fits; otherwise it waits in a
strict FIFO queue (a charge that does not fit blocks the ones behind it, so no request
starves behind later, smaller ones). The queue is bounded by ``max_queue`` and each wait by
``max_wait_s``. A lease is given back with :meth:`Admission.release`, or by leaving
``async with admission.lease(charge)``; both are idempotent.

Modelled on anyio's ``CapacityLimiter``: a waiter cancelled after it was granted a lease
gives it back and wakes the next one.
"""

from __future__ import annotations

import asyncio
import heapq
import math
import statistics
import time
from collections import deque
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field, replace
from typing import Protocol

from gateway import capacity
from gateway.capacity import Budget, Charge, Layout, LiveUse
from gateway.errors import (
    BackendNotReady,
    ContextLengthExceeded,
    QueueFull,
    QueueTimeout,
    QueueWaitPredicted,
)

__all__ = ["GROWTH_HORIZON_S", "MIN_HISTORY", "Admission", "AdmissionStats", "Clock", "Lease",
           "MonotonicClock"]

MIN_HISTORY = 8  # timed served leases before a queue wait is predicted
# How far ahead live use is projected, seconds: the gateway sees each token as its event
# arrives, and llama-server cancels a stream at its next write, so a victim's cells are
# free a decode step or two after the gateway decides; this covers those steps.
GROWTH_HORIZON_S = 0.25
DEFAULT_DECODE_RATE = 100.0  # tokens/s per sequence assumed before any is measured


class Clock(Protocol):
    """Time source for queue timeouts and drain-rate estimates (seconds)."""

    def now(self) -> float: ...

    async def sleep(self, seconds: float) -> None: ...


class MonotonicClock:
    """The real clock: ``time.monotonic`` and ``asyncio.sleep``."""

    def now(self) -> float:
        return time.monotonic()

    async def sleep(self, seconds: float) -> None:
        await asyncio.sleep(seconds)


@dataclass
class Lease:
    """A granted reservation.

    :param waited_s: time spent queued, seconds.
    :param slot_ids: the backend slot ids this lease holds in the gateway's slot map
        (``n`` of them when that many were free; fewer only after a layout change), or
        none for an unpinned lease. The first is sent upstream as llama-server's
        ``id_slot``, so that the gateway knows which slot to watch when it must confirm
        that a request has ended.
    """

    charge: Charge
    waited_s: float = 0.0
    released: bool = False
    slot_ids: tuple[int, ...] = ()
    predicted_wait_s: float | None = None  # the wait predicted when it queued
    granted_at: float = 0.0  # clock time of the grant
    # Live accounting (the ``predictive`` policy): a tracked lease reports each token
    # generated (:meth:`Admission.observe`), and may be preempted when the pool runs short.
    tracked: bool = False
    preemptible: bool = False
    generated: int = 0  # tokens generated so far, per completion
    first_token_at: float | None = None
    preempted: str | None = None  # the reason, once the gateway chose to preempt it
    on_preempt: Callable[[str], None] | None = None

    @property
    def pinned(self) -> bool:
        """The lease holds known slots (its request is sent with ``id_slot``)."""
        return bool(self.slot_ids)

    @property
    def used_tokens(self) -> int:
        """KV cells this request holds now: n × (prompt + generated)."""
        return self.charge.n * (self.charge.prompt_tokens + self.generated)


@dataclass(frozen=True)
class AdmissionStats:
    """A snapshot for metrics: queue length, leases, and reserved vs capacity (tokens)."""

    queued: int
    inflight: int
    reserved_tokens: int
    busy_slots: int
    capacity_tokens: int
    slots: int
    ctx_per_slot: int
    layout_changes: int = 0
    admitted: int = 0  # leases granted since start
    abandoned_held: int = 0  # filled in by the backend: held until /slots shows them ended
    preemptions: int = 0  # filled in by the backend: server preemptions it caused
    live_tokens: int = 0  # KV cells the leases in flight hold now, as observed


@dataclass
class _Waiter:
    charge: Charge
    future: asyncio.Future[Lease]
    since: float = field(default=0.0)
    predicted: float | None = None
    prefer: int | None = None  # the slot to take if it is free


class Admission:
    """FIFO admission for one backend.

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
    ) -> None:
        self._layout = layout
        self._predictive = predictive
        self._margin = preempt_margin_tokens
        self._decode_rates: deque[float] = deque(maxlen=32)  # tokens/s per sequence seen
        self.preemptions: dict[str, int] = {}  # preemptions chosen, by reason
        self._max_queue = max_queue
        self._max_wait_s = max_wait_s
        self._reject_doomed = reject_doomed
        self._clock = clock or MonotonicClock()
        self._budget = Budget()
        self._layout_changes = 0
        self._inflight = 0
        self._admitted = 0
        self._queue: deque[_Waiter] = deque()
        self._releases: deque[float] = deque(maxlen=64)
        self._active: dict[int, Lease] = {}  # leases in flight, by id
        self._durations: deque[float] = deque(maxlen=64)
        self._per_cap_token: deque[float] = deque(maxlen=64)  # seconds held / output cap
        self._delayed: set[asyncio.Task[None]] = set()
        self._held_slots: set[int] = set()
        self._unpinned = 0  # unpinned leases in flight: their slots are llama-server's pick
        # Free slot ids, least recently used first (never-used ones in index order).
        self._free: deque[int] = deque(range(layout.slots if layout else 0))

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
        count = layout.slots if layout else 0
        kept = [i for i in self._free if i < count]
        self._free = deque(kept + [i for i in range(count)
                                   if i not in self._held_slots and i not in kept])
        if layout is not None:
            for waiter in list(self._queue):
                if not capacity.fits_alone(layout, waiter.charge):
                    self._queue.remove(waiter)
                    waiter.future.set_exception(
                        ContextLengthExceeded(
                            "The backend's capacity changed while this request was queued "
                            f"and it no longer fits one slot ({layout.ctx_per_slot} tokens)."
                        )
                    )
        self._wake()

    def stats(self) -> AdmissionStats:
        """Return a snapshot of queue and budget."""
        layout = self._layout
        return AdmissionStats(
            queued=len(self._queue),
            inflight=self._inflight,
            reserved_tokens=self._budget.reserved_tokens,
            busy_slots=self._budget.busy_slots,
            capacity_tokens=layout.capacity_tokens if layout else 0,
            slots=layout.slots if layout else 0,
            ctx_per_slot=layout.ctx_per_slot if layout else 0,
            layout_changes=self._layout_changes,
            admitted=self._admitted,
            live_tokens=sum(lease.used_tokens if lease.tracked else lease.charge.tokens
                            for lease in self._active.values()),
        )

    def retry_after_s(self) -> float:
        """Estimate when a request sent now could start, in seconds (1–60).

        From the observed drain rate (leases released per second over the last 64
        releases): (queued + 1) / rate. With no history, the mean lease duration seen,
        or 1 s.
        """
        ahead = len(self._queue) + 1
        if len(self._releases) >= 2:
            span = self._releases[-1] - self._releases[0]
            if span > 0:
                rate = (len(self._releases) - 1) / span
                return min(60.0, max(1.0, ahead / rate))
        if self._durations:
            mean = sum(self._durations) / len(self._durations)
            slots = self._layout.slots if self._layout else 1
            return min(60.0, max(1.0, mean * ahead / slots))
        return 1.0

    def predict_wait_s(self, charge: Charge) -> float | None:
        """How long ``charge`` would wait if it queued now, seconds; ``None`` until
        :data:`MIN_HISTORY` served leases have been timed (or when it can never fit).

        A replay of the queue on the capacity model: a lease holds its reservation for
        its output cap times the median seconds per cap token of the last 64 served
        leases (so a short request after long ones is not taken for long); each lease in
        flight is expected to end that long after it was granted (at once, if that is
        past); the requests ahead, in FIFO order, then this one, each start at the first
        end after which they fit, unless that is after they would have timed out.
        Releases measured as a rate mislead when requests end together (a wave of four
        ends, then nothing for a whole generation); ends measured per lease do not.
        """
        return self._replay([*((w.charge, w.since + self._max_wait_s) for w in self._queue),
                             (charge, None)])

    def queue_position(self, charge: Charge) -> int | None:
        """1 for the head of the queue; ``None`` when ``charge`` (this very object) is
        not waiting."""
        for i, waiter in enumerate(self._queue):
            if waiter.charge is charge:
                return i + 1
        return None

    def eta_s(self, charge: Charge) -> float | None:
        """Seconds until the waiting ``charge`` is predicted to start (as
        :meth:`predict_wait_s`, with only the requests ahead of it)."""
        position = self.queue_position(charge)
        if position is None:
            return None
        ahead = list(self._queue)[:position]
        return self._replay([*((w.charge, w.since + self._max_wait_s) for w in ahead[:-1]),
                             (charge, None)])

    def _replay(self, charges: list[tuple[Charge, float | None]]) -> float | None:
        """When the last of ``charges`` starts if they start in order after the leases in
        flight (see :meth:`predict_wait_s`), seconds from now. Each comes with the clock
        time after which it would have left the queue (``None``: it stays); one replayed
        to start after that is left out, since it will time out holding nothing."""
        layout = self._layout
        if layout is None or len(self._per_cap_token) < MIN_HISTORY:
            return None
        rate = statistics.median(self._per_cap_token)  # seconds held per token of cap

        def hold(charge: Charge) -> float:
            return rate * max(1, charge.max_tokens)

        now = self._clock.now()
        ends = [(max(now, lease.granted_at + hold(lease.charge)), i, lease.charge)
                for i, lease in enumerate(self._active.values())]
        heapq.heapify(ends)
        budget, t, order = self._budget, now, len(ends)
        for ahead, deadline in charges:
            if not capacity.fits_alone(layout, ahead):
                return None
            start, freed, popped = t, budget, []
            while not capacity.fits(layout, freed, ahead):
                if not ends:
                    return None
                end, _, done = heapq.heappop(ends)
                popped.append((end, _, done))
                start = max(start, end)
                freed = capacity.release(freed, done)
            if deadline is not None and start > deadline:
                for item in popped:  # it times out: it frees nothing and holds nothing
                    heapq.heappush(ends, item)
                continue
            t, budget = start, capacity.reserve(freed, ahead)
            order += 1
            heapq.heappush(ends, (t + hold(ahead), order, ahead))
        return t - now

    def check_queue_room(self) -> None:
        """Raise at once when a new request could only queue and the queue is full.

        With others waiting, a new request always queues (FIFO), whatever its size.

        :raises QueueFull: ``max_queue`` requests wait already (and at least one does).
        """
        if self._queue and len(self._queue) >= self._max_queue:
            raise self._queue_full()

    def _queue_full(self) -> QueueFull:
        return QueueFull(
            f"The queue for this backend is full ({self._max_queue} waiting); "
            "retry after the Retry-After delay.",
            retry_after_s=self.retry_after_s(),
        )

    def try_admit(self, charge: Charge, *, front: bool = False,
                  prefer: int | None = None) -> Lease | None:
        """Grant a lease now, or return ``None``: refuses while others wait (fairness),
        unless ``front`` (a preempted request coming back, which goes before them).

        :raises BackendNotReady: the layout is not known yet.
        :raises ContextLengthExceeded: the charge can never fit the current layout (it
            was planned against a layout that changed meanwhile); nothing waits for it.
        """
        layout = self._require_layout()
        if not capacity.fits_alone(layout, charge):
            raise ContextLengthExceeded(
                f"This request needs {charge.prompt_tokens + charge.max_tokens} tokens "
                f"(prompt {charge.prompt_tokens} + max_tokens {charge.max_tokens}) x n "
                f"{charge.n}, but the backend's layout changed while it was being counted "
                f"and is now {layout.slots} slots of {layout.ctx_per_slot} tokens "
                f"(at most {layout.usable_per_slot} usable per slot, "
                f"{layout.capacity_tokens} in all). Lower max_tokens or shorten the prompt."
            )
        if (self._queue and not front) or not self._fits(layout, charge):
            return None
        return self._grant(charge, waited_s=0.0, prefer=prefer)

    async def admit(self, charge: Charge, *, front: bool = False,
                    prefer: int | None = None) -> Lease:
        """Wait for a lease in FIFO order; with ``front``, at the head of the queue (a
        preempted request resuming: neither the queue bound nor a predicted wait
        refuses it); ``prefer`` names the slot to take if it is free then (where the
        backend still caches the request's prefix).

        :raises BackendNotReady: the layout is not known yet.
        :raises QueueFull: ``max_queue`` requests already wait (immediately).
        :raises QueueTimeout: the wait passed ``max_wait_s``.
        :raises ContextLengthExceeded: the charge does not fit the current layout (at
            once), or the layout changed while it waited and it no longer fits.
        """
        lease = self.try_admit(charge, front=front, prefer=prefer)
        if lease is not None:
            return lease
        if len(self._queue) >= self._max_queue and not front:
            raise self._queue_full()
        predicted = None if front else self.predict_wait_s(charge)
        if self._reject_doomed and predicted is not None and predicted > self._max_wait_s:
            raise QueueWaitPredicted(
                f"The queue ahead of this request needs about {predicted:.0f} s to drain "
                f"at the backend's recent pace, longer than the {self._max_wait_s:g} s a "
                "request may wait; retry after the Retry-After delay.",
                retry_after_s=predicted)
        loop = asyncio.get_running_loop()
        waiter = _Waiter(charge, loop.create_future(), since=self._clock.now(),
                         predicted=predicted, prefer=prefer)
        if front:
            self._queue.appendleft(waiter)
        else:
            self._queue.append(waiter)
        timer = asyncio.ensure_future(self._clock.sleep(self._max_wait_s))
        try:
            await asyncio.wait({waiter.future, timer}, return_when=asyncio.FIRST_COMPLETED)
            if waiter.future.done():
                return waiter.future.result()
            raise QueueTimeout(
                f"The request waited {self._max_wait_s:g} s in the queue without room on "
                "the backend; retry after the Retry-After delay.",
                retry_after_s=self.retry_after_s(),
            )
        except BaseException:
            self._abandon(waiter)
            raise
        finally:
            timer.cancel()

    @asynccontextmanager
    async def lease(self, charge: Charge) -> AsyncIterator[Lease]:
        """``async with`` form of :meth:`admit`; releases in ``finally``."""
        granted = await self.admit(charge)
        try:
            yield granted
        finally:
            self.release(granted)

    def release(self, lease: Lease, *, served: bool = True) -> None:
        """Give a lease back and wake waiters that now fit. Idempotent.

        :param served: the request was served; only these feed the drain-rate estimate,
            so that a burst of fast failures does not promise a short Retry-After.
        """
        if lease.released:
            return
        lease.released = True
        now = self._clock.now()
        if not lease.pinned:
            self._unpinned -= 1
        for slot in lease.slot_ids:
            self._held_slots.discard(slot)
            if slot < (self._layout.slots if self._layout else 0):
                self._free.append(slot)  # held slots are never in _free
        self._budget = capacity.release(self._budget, lease.charge)
        self._inflight -= 1
        self._active.pop(id(lease), None)
        rate = self._rate_of(lease, now)
        if rate is not None:
            self._decode_rates.append(rate)
        if served:
            self._releases.append(now)
        self._wake()

    def release_later(self, lease: Lease, delay_s: float, *, served: bool = True) -> None:
        """Release ``lease`` after ``delay_s`` seconds (on the injected clock), in the
        background. It is released even if that wait is cancelled (shutdown)."""

        async def later() -> None:
            try:
                await self._clock.sleep(delay_s)
            finally:
                self.release(lease, served=served)

        task = asyncio.ensure_future(later())
        self._delayed.add(task)
        task.add_done_callback(self._delayed.discard)

    def record_duration(self, seconds: float, charge: Charge | None = None) -> None:
        """Record how long a served lease was held (feeds :meth:`retry_after_s`) and, with
        its charge, the seconds per token of output cap (feeds :meth:`predict_wait_s`)."""
        self._durations.append(seconds)
        if charge is not None:
            self._per_cap_token.append(seconds / max(1, charge.max_tokens))

    @property
    def held_slots(self) -> frozenset[int]:
        """Slot ids held by leases in flight (abandoned ones awaiting release included)."""
        return frozenset(self._held_slots)

    def _pick_slots(self, charge: Charge, prefer: int | None = None) -> tuple[int, ...]:
        """Slot ids for a new lease, chosen as llama-server will place its tasks, or none.

        The first (the ``id_slot`` sent) is the least recently used free slot; the
        others, for ``n > 1``, are the lowest-numbered free ones, which is where
        llama-server puts a request's extra completions (``get_free_slots`` in
        ``server-context.cpp``). A batch of prompts is not pinned, and while any
        unpinned lease is in flight no lease is: llama-server places those tasks itself,
        so the gateway's map of which slot is free would be wrong.
        """
        if not charge.pinnable or self._unpinned:
            self._unpinned += 1
            return ()
        if not self._free:
            self._unpinned += 1
            return ()
        if prefer is not None and prefer in self._free:
            self._free.remove(prefer)
            first = prefer
        else:
            first = self._free.popleft()
        rest: list[int] = []
        if charge.slots > 1:
            rest = sorted(self._free)[:charge.slots - 1]
            for slot in rest:
                self._free.remove(slot)
        chosen = (first, *rest)
        self._held_slots.update(chosen)
        return chosen

    def _require_layout(self) -> Layout:
        if self._layout is None:
            raise BackendNotReady(
                "The backend's capacity is not known yet (it is unreachable or still "
                "loading); retry after the Retry-After delay.",
                retry_after_s=1.0,
            )
        return self._layout

    def _grant(self, charge: Charge, *, waited_s: float, prefer: int | None = None) -> Lease:
        self._budget = capacity.reserve(self._budget, charge)
        self._inflight += 1
        self._admitted += 1
        lease = Lease(charge, waited_s=waited_s, slot_ids=self._pick_slots(charge, prefer),
                      granted_at=self._clock.now())
        self._active[id(lease)] = lease
        return lease

    def _abandon(self, waiter: _Waiter) -> None:
        fut = waiter.future
        if fut.done() and not fut.cancelled() and fut.exception() is None:
            self.release(fut.result())  # granted while we were leaving: give it back
            return
        if waiter in self._queue:
            self._queue.remove(waiter)
        fut.cancel()
        self._wake()  # the head may have been the blocker

    def _wake(self) -> None:
        layout = self._layout
        if layout is None:
            return
        now = self._clock.now()
        while self._queue and self._fits(layout, self._queue[0].charge):
            waiter = self._queue.popleft()
            lease = self._grant(waiter.charge, waited_s=now - waiter.since,
                                prefer=waiter.prefer)
            lease.predicted_wait_s = waiter.predicted
            waiter.future.set_result(lease)

    # -- live accounting (the predictive policy) -----------------------------------------

    def observe(self, lease: Lease, generated: int) -> None:
        """Note that ``lease``'s request has generated ``generated`` tokens (per
        completion) so far, and preempt tracked leases if the pool would run short.
        Ignored for a released lease."""
        if lease.released:
            return
        if generated > 0 and lease.first_token_at is None:
            lease.first_token_at = self._clock.now()
        lease.generated = max(lease.generated, generated)
        self.check_pressure()

    def check_pressure(self) -> list[Lease]:
        """Preempt tracked leases, least progress first, while live use plus the growth
        possible within :data:`GROWTH_HORIZON_S` would pass the pool less the margin
        (:func:`gateway.capacity.choose_victims`); each victim's ``on_preempt`` is
        called with the reason ``"pool_pressure"``. Nothing is preempted while the
        whole caps of everything in flight fit the pool: then nothing can overflow.

        :returns: the leases preempted now.
        """
        layout = self._layout
        if not self._predictive or layout is None or layout.pool_tokens is None:
            return []
        if sum(replace(lease.charge, predicted=None).tokens
               for lease in self._active.values()) <= layout.pool_tokens:
            return []  # even every whole cap fits: nothing can overflow
        now = self._clock.now()
        uses = []
        for key, lease in self._active.items():
            if lease.preempted is not None:
                continue  # already on its way out: its cells free within the horizon
            used, growth = self._use_of(lease, now)
            uses.append(LiveUse(key, used, growth, lease.generated,
                                lease.preemptible and lease.tracked, lease.granted_at))
        victims = [self._active[key] for key in
                   capacity.choose_victims(uses, layout.pool_tokens - self._margin)]
        for lease in victims:
            self.preempt(lease, "pool_pressure")
        return victims

    def preempt(self, lease: Lease, reason: str) -> None:
        """Mark ``lease`` preempted for ``reason`` and tell its holder (``on_preempt``);
        the holder cancels its request and releases the lease. Once per lease."""
        if lease.preempted is not None or lease.released:
            return
        lease.preempted = reason
        self.preemptions[reason] = self.preemptions.get(reason, 0) + 1
        if lease.on_preempt is not None:
            lease.on_preempt(reason)

    def _rate_of(self, lease: Lease, now: float) -> float | None:
        """A tracked lease's decode rate, tokens/s per sequence, once it has two tokens."""
        if lease.first_token_at is None or lease.generated < 2:
            return None
        elapsed = now - lease.first_token_at
        return (lease.generated - 1) / elapsed if elapsed > 0 else None

    def _use_of(self, lease: Lease, now: float) -> tuple[int, int]:
        """(cells held now, cells it may add within the horizon) of one lease in flight.
        An untracked lease is taken at its charge and does not grow past it."""
        if not lease.tracked:
            return lease.charge.tokens, 0
        remaining = max(0, lease.charge.max_tokens - lease.generated)
        rate = self._rate_of(lease, now)
        if rate is None:
            rate = max(self._decode_rates, default=DEFAULT_DECODE_RATE)
        growth = min(remaining, math.ceil(rate * GROWTH_HORIZON_S) + 1)
        return lease.used_tokens, lease.charge.n * growth

    def _fits(self, layout: Layout, charge: Charge) -> bool:
        """:func:`gateway.capacity.fits` against what is reserved; under ``predictive``,
        a tracked lease counts as the larger of its charge and its live use plus growth,
        and a unified pool in use keeps ``preempt_margin_tokens`` free."""
        budget = self._budget
        if self._predictive and layout.pool_tokens is not None and self._active:
            now = self._clock.now()
            excess = 0
            for lease in self._active.values():
                used, growth = self._use_of(lease, now)
                excess += max(0, used + growth - lease.charge.tokens)
            budget = Budget(budget.reserved_tokens + excess + self._margin,
                            budget.busy_slots)
        return capacity.fits(layout, budget, charge)
