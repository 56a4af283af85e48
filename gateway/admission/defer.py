"""Prefill deferral (issue 26, item 4): one backend's hold on a request whose prefill
would stall the streams with an ITL target decoding there.

llama-server computes a new prompt inside the decode steps of the slots already
generating (tools/server/server-context.cpp: each step's batch takes one token of every
generating slot, then fills up to ``n_batch`` with prompt tokens), so every stream
beside a long prefill waits for it: a 300-word prompt on the 2-core test machine paused
every stream for over a second (``docs/benchmarks.md``, "Latency targets"). While such
streams decode here, a request whose predicted prefill (its prompt over the learned
prefill throughput) is longer than the tightest of their ITL targets is held back
(:func:`gateway.core.latency.prefill_hold_s`):

* for at most ``admission.prefill_defer_s`` seconds since it came to admission, and never
  past its TTFT slack (its deadline less its predicted TTFT if it started now);
* only when those streams are predicted to end within that time (their output cap left
  at the learned decode pace): one let go while they still decode stalls them anyway,
  so holding it would only make it later (measured on llama-server: with a bound alone,
  the hold moved the stall and lengthened TTFT p95 by 32-41 %);
* not at all when it goes to a slot that caches its prefix (only its new part is
  computed), nor when it comes back to the front of the queue (preempted or failed over);
* a stream counts from its first token (one still in its own prefill loses nothing);
* it waits at the head of the queue and holds those behind it, as a request that does
  not fit does, so the order is kept; the queue is looked at again when the hold runs
  out, or at once when a lease ends.

In a pool (:mod:`gateway.fleet.pool`), a backend that holds a request offers it no room,
so it goes to another with room where no targeted stream decodes. Under ``[state]
backend = "redis"`` the shared queue's script grants in arrival order over every process,
and nothing is held.
"""

from __future__ import annotations

import asyncio
import math
import weakref
from collections.abc import Callable
from typing import TYPE_CHECKING

from gateway.admission.lease import InFlight, Lease
from gateway.admission.pump import QueuedAsk
from gateway.admission.waitroom import Waiter
from gateway.clock import Clock
from gateway.core.capacity import Charge
from gateway.core.fairness import Party
from gateway.core.latency import HOLD_RECHECK_S, prefill_hold_s, tightest

if TYPE_CHECKING:
    from gateway.admission.slo import SloGuard

__all__ = ["PrefillDeferral"]


class PrefillDeferral:
    """One backend's prefill deferral (see the module).

    :param guard: the backend's :class:`~gateway.admission.slo.SloGuard` (its learned
        prefill throughput and TTFT prediction).
    :param clock: injected time source.
    :param active: the admission's leases in flight, by key (read, never changed).
    :param wake: serves the admission's queue (called when a hold runs out).
    :param defer_s: the longest hold, seconds (``admission.prefill_defer_s``; 0: off).
    :ivar max_wait_s: the queue's wait limit, seconds (``admission.max_queue_wait_s``):
        a hold ends :data:`~gateway.core.latency.HOLD_RECHECK_S` before the request's
        own limit (its class's, else this), so that it never times out held.
    :ivar deferred: requests held back so far, each counted once
        (``gateway_prefill_deferred_total``).
    """

    def __init__(self, guard: SloGuard, clock: Clock, *, active: InFlight,
                 wake: Callable[[], None], defer_s: float = 0.0) -> None:
        self._guard = guard
        self._clock = clock
        self._active = active
        self._wake = wake
        self.defer_s = defer_s
        self.max_wait_s = math.inf
        self.deferred = 0
        # id of a held request's charge -> (a weak reference to it, when first held); the
        # reference tells a new charge at a reused address from the one held
        self._held: dict[int, tuple[weakref.ref[Charge], float]] = {}
        self._due: float | None = None  # clock time the pending wake fires
        self._timers: set[asyncio.Task[None]] = set()

    def decoding_target(self) -> float | None:
        """The tightest ITL p95 target of the leases in flight that have their first
        token (their streams decode now), seconds, or ``None``."""
        return tightest(lease.itl_target_s for lease in self._active.targeted.values()
                        if lease.itl_target_s is not None and lease.first_token_at is not None)

    def streams_left_s(self, target_s: float) -> float:
        """Seconds until the last targeted stream decoding here is predicted to end: the
        output cap it has left (its ``max_tokens`` less the tokens seen, per choice)
        at the learned decode pace of the slots busy now
        (:meth:`SloGuard.seconds_per_token
        <gateway.admission.slo.SloGuard.seconds_per_token>`), or at ``target_s`` a token
        before that pace is learnt. The cap is an upper bound: a stream that stops
        sooner ends the hold sooner, by its release."""
        pace = self._guard.seconds_per_token() or target_s
        left = 0
        for lease in self._active.targeted.values():
            if lease.itl_target_s is not None and lease.first_token_at is not None:
                seen = max(lease.generated, lease.streamed // max(1, lease.charge.n))
                left = max(left, lease.charge.max_tokens - seen)
        return left * pace

    def hold_s(self, charge: Charge, party: Party, waited_s: float, *,
               cached: bool = False) -> float:
        """Seconds more ``charge`` is held back, 0.0 when it may start now. While it is
        held, the queue is woken when the hold runs out (the caller asks again then,
        with the seconds it has waited).

        :param party: its class and TTFT deadline (the hold never passes its slack).
        :param waited_s: seconds since it came to admission.
        :param cached: it goes to a slot that caches its prefix: never held.

        ``charge`` (this very object, as it is queued) identifies the request, so that
        :attr:`deferred` counts it once.
        """
        if cached or not self.defer_s > 0:
            return 0.0
        target = self.decoding_target()
        if target is None:
            return 0.0
        slack = self._guard.slack_s(charge, party)
        limit = (self.max_wait_s if party.max_wait_s is None else party.max_wait_s
                 ) - HOLD_RECHECK_S  # (both count from its arrival)
        left = prefill_hold_s(prompt_tokens=charge.prompt_tokens,
                              prefill_tps=self._guard.model.prefill_tps(),
                              itl_target_s=target, defer_s=min(self.defer_s, limit),
                              waited_s=waited_s, slack_s=slack,
                              streams_left_s=self.streams_left_s(target))
        if left > 0:
            self._count(charge)
            self._wake_in(left)
        return left

    def holds(self, waiter: Waiter[QueuedAsk, Lease]) -> bool:
        """The waiter at the head of the admission's queue is held back (:meth:`hold_s`,
        counted from when it joined the queue); never one back at the front."""
        ask = waiter.request
        return not ask.front and self.hold_s(ask.charge, waiter.party,
                                             self._clock.now() - waiter.since,
                                             cached=ask.prefer is not None) > 0

    def was_held(self, charge: Charge) -> bool:
        """``charge`` (this very object) was held back lately. A request held at
        arrival waits for its hold, not for room, and its hold is within its TTFT
        slack: its predicted queue wait is then 0, not the replay of the queue (which
        refused it as late, found by the fresh-user pass)."""
        seen = self._held.get(id(charge))
        return seen is not None and seen[0]() is charge

    def _count(self, charge: Charge) -> None:
        now = self._clock.now()
        for old, (ref, at) in list(self._held.items()):  # (a hold lasts defer_s at most)
            if ref() is None or now - at > 2 * self.defer_s + 1.0:
                del self._held[old]
        seen = self._held.get(id(charge))
        if seen is None or seen[0]() is not charge:
            self._held[id(charge)] = (weakref.ref(charge), now)
            self.deferred += 1

    @property
    def timers(self) -> tuple[asyncio.Task[None], ...]:
        """The wakes scheduled and not yet due (their owner's close cancels them)."""
        return tuple(self._timers)

    def _wake_in(self, seconds: float) -> None:
        """Serve the queue ``seconds`` from now, unless a wake is due sooner."""
        due = self._clock.now() + seconds
        if self._due is not None and self._due <= due:
            return
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:  # no loop: nothing waits to be woken
            return
        self._due = due

        async def later() -> None:
            await self._clock.sleep(seconds)
            if self._due == due:
                self._due = None
            self._wake()
        task = loop.create_task(later())
        self._timers.add(task)
        task.add_done_callback(self._timers.discard)
