"""Live accounting of the leases in flight, for the ``predictive`` policy.

A tracked lease reports each token its answer generates
(:meth:`gateway.admission.admission.Admission.observe`). :class:`LiveAccounting` turns those
reports into what the pool holds now and may hold a decode step or two later, and from that
decides which tracked leases to preempt when the pool runs short. The choice itself is pure
(:func:`gateway.core.capacity.choose_victims`); this class keeps the decode rates observed
and the preemptions chosen.

The other gateway processes that may share the backend are its :class:`Peers`: none
(:class:`Alone`), or, with ``[state] backend = "redis"``, every process's published
figures (:class:`~gateway.admission.shared_live.SharedLive`, wired by
:class:`~gateway.admission.shared_grant.SharedGrantor`), over which each process preempts
only its own victims, chosen on the same figures in the same order.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Collection, Mapping
from dataclasses import replace
from typing import Protocol

from gateway.admission.lease import Lease
from gateway.admission.shared_live import (
    KEPT,
    PREEMPTED,
    PREEMPTIBLE,
    LiveFigures,
    LiveRule,
    live_reserved,
)
from gateway.clock import Clock
from gateway.core import capacity
from gateway.core.capacity import Budget, Charge, Layout, LiveUse

__all__ = ["DEFAULT_DECODE_RATE", "GROWTH_HORIZON_S", "Alone", "LiveAccounting", "Peers"]

# How far ahead live use is projected, seconds: the gateway sees each token as its event
# arrives, and llama-server cancels a stream at its next write, so a victim's cells are
# free a decode step or two after the gateway decides; this covers those steps.
GROWTH_HORIZON_S = 0.25
_HORIZON_MS = int(GROWTH_HORIZON_S * 1000)
DEFAULT_DECODE_RATE = 100.0  # tokens/s per sequence assumed before any is measured


class Peers(Protocol):
    """The other gateway processes on the backend, as live accounting sees them."""

    def kick(self) -> None:
        """A lease was granted or advanced: publish this process's figures (when due)."""
        ...

    def others(self, now: float) -> tuple[list[LiveUse], int | None]:
        """Their leases as :func:`~gateway.core.capacity.choose_victims` takes them, and
        the sum of their whole caps (``None``: one is not known)."""
        ...

    def rank(self, progress: int, granted_at: float) -> tuple[int, float]:
        """(progress, since) a lease of this process with ``progress`` tokens, granted at
        clock time ``granted_at``, is ordered by among the victims."""
        ...


class Alone:
    """No other process: nothing to publish, nobody else's leases; victims go least
    progress first."""

    def kick(self) -> None:
        """Nothing to publish."""

    def others(self, now: float) -> tuple[list[LiveUse], int]:
        """None, holding nothing."""
        return [], 0

    def rank(self, progress: int, granted_at: float) -> tuple[int, float]:
        """Its own progress and grant time."""
        return progress, granted_at


class LiveAccounting:
    """What the leases in flight of one backend hold now, as observed.

    :param clock: injected time source.
    :param predictive: live accounting is on (otherwise every lease counts at its
        charge, and nothing is preempted).
    :param margin_tokens: tokens of a unified pool kept free under ``predictive``.
    :param peers: the other processes on the backend (:class:`Alone` by default).
    :param active: the admission's leases in flight, by a key of each (read when
        publishing and when the others' figures arrive).
    """

    def __init__(self, clock: Clock, *, predictive: bool, margin_tokens: int,
                 peers: Peers | None = None,
                 active: Mapping[int, Lease] | None = None) -> None:
        self._clock = clock
        self._predictive = predictive
        self._margin = margin_tokens
        self._decode_rates: deque[float] = deque(maxlen=32)  # tokens/s per sequence seen
        self.preemptions: dict[str, int] = {}  # preemptions chosen, by reason
        self.active: Mapping[int, Lease] = {} if active is None else active
        self.peers: Peers = peers or Alone()

    def observe(self, lease: Lease, generated: int) -> None:
        """Note that ``lease``'s request has generated ``generated`` tokens (per
        completion) so far."""
        if generated > 0 and lease.first_token_at is None:
            lease.first_token_at = self._clock.now()
        lease.generated = max(lease.generated, generated)
        self.peers.kick()

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

        The other processes' leases count too (:meth:`Peers.others`), and the leases are
        ordered as the peers rank them (:meth:`Peers.rank`); only this process's are
        returned.

        :param active: the leases in flight, by a key of each.
        """
        if not self._predictive or layout is None or layout.pool_tokens is None:
            return []
        now = self._clock.now()
        mine = {key: lease for key, lease in active.items() if lease.preempted is None}
        if not any(self.can_free(lease) for lease in mine.values()):
            return []  # nothing of this process's could be chosen
        others, caps = self.peers.others(now)
        if caps is not None and caps + sum(replace(lease.charge, predicted=None).tokens
                                           for lease in active.values()) <= layout.pool_tokens:
            return []  # even every whole cap fits: nothing can overflow
        uses = [self._live_use(key, lease, now) for key, lease in mine.items()]
        chosen = capacity.choose_victims(uses + others, layout.pool_tokens - self._margin)
        return [active[key] for key in chosen if key in active]

    def _live_use(self, key: int, lease: Lease, now: float) -> LiveUse:
        """One lease of this process as :func:`~gateway.core.capacity.choose_victims`
        takes it, ranked by the peers (:meth:`Peers.rank`)."""
        used, growth = self._use_of(lease, now)
        progress, since = self.peers.rank(lease.earlier + lease.generated, lease.granted_at)
        return LiveUse(key, used, growth, progress, self.can_free(lease), since)

    @staticmethod
    def can_free(lease: Lease) -> bool:
        """``lease`` may be chosen as a victim: it is tracked, preemptible, and its
        answer has begun in this attempt. llama-server cancels a stream at its next
        write, and writes nothing during a prefill (``shared/design/backends.md`` §1.5,
        :mod:`gateway.admission.slotwatch`), so a request still in its prefill would keep
        its cells for the rest of that prefill, far past the growth horizon: cancelling
        it would free nothing in time while the streams it spared kept growing."""
        return lease.preemptible and lease.tracked and lease.first_token_at is not None

    def pressure(self, layout: Layout | None) -> None:
        """The others' figures arrived: preempt this process's victims on ``layout``."""
        for lease in self.victims(layout, self.active):
            self.preempt(lease, "pool_pressure")

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
        and its live use plus growth, and a unified pool in use keeps the margin free
        (:func:`~gateway.admission.shared_live.live_reserved`, which the shared grant
        script applies too)."""
        if self._predictive and layout.pool_tokens is not None and active:
            now = self._clock.now()
            leases, figures = {}, {}
            for i, lease in enumerate(active):
                leases[str(i)] = (lease.charge.tokens, lease.charge.n)
                figures[str(i)] = self.figure_of(lease, now)
            reserved = live_reserved(budget.reserved_tokens, leases, figures, 0,
                                     LiveRule(self._margin, _HORIZON_MS, 0))
            budget = Budget(reserved, budget.busy_slots)
        return capacity.fits(layout, budget, charge)

    def _rate_of(self, lease: Lease, now: float) -> float | None:
        """A tracked lease's decode rate, tokens/s per sequence, once it has two tokens."""
        if lease.first_token_at is None or lease.generated < 2:
            return None
        elapsed = now - lease.first_token_at
        return (lease.generated - 1) / elapsed if elapsed > 0 else None

    def fastest(self) -> float:
        """The fastest decode rate seen, tokens/s per sequence (the default before any)."""
        return max(self._decode_rates, default=DEFAULT_DECODE_RATE)

    def figure_of(self, lease: Lease, now: float, since_ms: int = 0) -> LiveFigures:
        """What ``lease`` holds now (``at`` 0). An untracked lease is its whole charge and
        does not grow past it."""
        progress = lease.earlier + lease.generated
        state = PREEMPTED if lease.preempted is not None else (
            PREEMPTIBLE if self.can_free(lease) else KEPT)
        if not lease.tracked:
            return LiveFigures(lease.charge.tokens, 0, 0, progress, state, since_ms)
        rate = self._rate_of(lease, now)
        if rate is None:
            rate = self.fastest()
        return LiveFigures(lease.used_tokens, max(0, lease.charge.max_tokens - lease.generated),
                           round(rate * 1000), progress, state, since_ms)

    def _use_of(self, lease: Lease, now: float) -> tuple[int, int]:
        """(cells held now, cells it may add within the horizon) of one lease in flight
        (:meth:`LiveFigures.growth <gateway.admission.shared_live.LiveFigures.growth>`)."""
        fig = self.figure_of(lease, now)
        return fig.used, fig.growth(lease.charge.n, _HORIZON_MS)
