"""Live accounting of the leases in flight, for the ``predictive`` policy.

A tracked lease reports each token its answer generates
(:meth:`gateway.admission.admission.Admission.observe`). :class:`LiveAccounting` turns those
reports into what the pool holds now and may hold a decode step or two later, and from that
decides which tracked leases to preempt when the pool runs short. The choice itself is pure
(:func:`gateway.core.capacity.choose_victims`); this class keeps the decode rates observed
and the preemptions chosen.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Collection, Mapping
from dataclasses import replace

from gateway.admission.lease import Lease
from gateway.clock import Clock
from gateway.core import capacity
from gateway.core.capacity import Budget, Charge, Layout, LiveUse

__all__ = ["DEFAULT_DECODE_RATE", "GROWTH_HORIZON_S", "LiveAccounting"]

# How far ahead live use is projected, seconds: the gateway sees each token as its event
# arrives, and llama-server cancels a stream at its next write, so a victim's cells are
# free a decode step or two after the gateway decides; this covers those steps.
GROWTH_HORIZON_S = 0.25
DEFAULT_DECODE_RATE = 100.0  # tokens/s per sequence assumed before any is measured


class LiveAccounting:
    """What the leases in flight of one backend hold now, as observed.

    :param clock: injected time source.
    :param predictive: live accounting is on (otherwise every lease counts at its
        charge, and nothing is preempted).
    :param margin_tokens: tokens of a unified pool kept free under ``predictive``.
    """

    def __init__(self, clock: Clock, *, predictive: bool, margin_tokens: int) -> None:
        self._clock = clock
        self._predictive = predictive
        self._margin = margin_tokens
        self._decode_rates: deque[float] = deque(maxlen=32)  # tokens/s per sequence seen
        self.preemptions: dict[str, int] = {}  # preemptions chosen, by reason

    def observe(self, lease: Lease, generated: int) -> None:
        """Note that ``lease``'s request has generated ``generated`` tokens (per
        completion) so far."""
        if generated > 0 and lease.first_token_at is None:
            lease.first_token_at = self._clock.now()
        lease.generated = max(lease.generated, generated)

    def released(self, lease: Lease, now: float) -> None:
        """``lease`` was given back at clock time ``now``: keep its decode rate."""
        rate = self._rate_of(lease, now)
        if rate is not None:
            self._decode_rates.append(rate)

    def victims(self, layout: Layout | None, active: Mapping[int, Lease]) -> list[Lease]:
        """The tracked leases to preempt, least progress first, while live use plus the
        growth possible within :data:`GROWTH_HORIZON_S` would pass the pool less the
        margin (:func:`gateway.core.capacity.choose_victims`). None while the whole caps
        of everything in flight fit the pool: then nothing can overflow.

        :param active: the leases in flight, by a key of each.
        """
        if not self._predictive or layout is None or layout.pool_tokens is None:
            return []
        if sum(replace(lease.charge, predicted=None).tokens
               for lease in active.values()) <= layout.pool_tokens:
            return []  # even every whole cap fits: nothing can overflow
        now = self._clock.now()
        uses = []
        for key, lease in active.items():
            if lease.preempted is not None:
                continue  # already on its way out: its cells free within the horizon
            used, growth = self._use_of(lease, now)
            uses.append(LiveUse(key, used, growth, lease.earlier + lease.generated,
                                lease.preemptible and lease.tracked, lease.granted_at))
        return [active[key] for key in
                capacity.choose_victims(uses, layout.pool_tokens - self._margin)]

    def preempt(self, lease: Lease, reason: str) -> None:
        """Mark ``lease`` preempted for ``reason`` and tell its holder (``on_preempt``);
        the holder cancels its request and releases the lease. Once per lease, and never
        a lease that is not (or no longer) preemptible: an answer that has finished, or
        reached its cap, is left to end."""
        if lease.preempted is not None or lease.released or not lease.preemptible:
            return
        lease.preempted = reason
        self.preemptions[reason] = self.preemptions.get(reason, 0) + 1
        if lease.on_preempt is not None:
            lease.on_preempt(reason)

    def fits(self, layout: Layout, budget: Budget, active: Collection[Lease],
             charge: Charge) -> bool:
        """:func:`gateway.core.capacity.fits` against ``budget`` (what is reserved); under
        ``predictive``, a tracked lease of ``active`` counts as the larger of its charge
        and its live use plus growth, and a unified pool in use keeps the margin free."""
        if self._predictive and layout.pool_tokens is not None and active:
            now = self._clock.now()
            excess = 0
            for lease in active:
                used, growth = self._use_of(lease, now)
                excess += max(0, used + growth - lease.charge.tokens)
            budget = Budget(budget.reserved_tokens + excess + self._margin,
                            budget.busy_slots)
        return capacity.fits(layout, budget, charge)

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
            return lease.live_tokens, 0
        remaining = max(0, lease.charge.max_tokens - lease.generated)
        rate = self._rate_of(lease, now)
        if rate is None:
            rate = max(self._decode_rates, default=DEFAULT_DECODE_RATE)
        growth = min(remaining, math.ceil(rate * GROWTH_HORIZON_S) + 1)
        return lease.live_tokens, lease.charge.n * growth
