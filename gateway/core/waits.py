"""How long a request will wait: Retry-After estimates and queue-wait predictions.

Pure and synchronous: the caller gives the clock time (``now``, seconds) and the state of
its queue (the layout, what is reserved, the leases in flight and the charges ahead). A
:class:`WaitPredictor` keeps only what it has observed: when served leases were released,
how long they were held, and the seconds held per token of output cap.
"""

from __future__ import annotations

import heapq
import statistics
from collections import deque
from collections.abc import Callable, Iterable, Sequence

from gateway.core import capacity
from gateway.core.capacity import Budget, Charge, Layout

__all__ = ["HISTORY", "MIN_HISTORY", "WaitPredictor"]

MIN_HISTORY = 8  # timed served leases before a queue wait is predicted
HISTORY = 64  # observations kept of each kind (releases, durations, seconds per cap token)


class WaitPredictor:
    """The observed pace of one backend, and the waits it predicts."""

    def __init__(self) -> None:
        self._releases: deque[float] = deque(maxlen=HISTORY)  # clock times, served only
        self._durations: deque[float] = deque(maxlen=HISTORY)  # seconds held
        self._per_cap_token: deque[float] = deque(maxlen=HISTORY)  # seconds / output cap

    @property
    def drained(self) -> bool:
        """Leases were released or timed: :meth:`retry_after_s` has more than its
        1 s guess to go by."""
        return len(self._releases) >= 2 or bool(self._durations)

    @property
    def timed(self) -> int:
        """Served leases timed with their charge (at most :data:`HISTORY`)."""
        return len(self._per_cap_token)

    def record_release(self, now: float) -> None:
        """A served lease was given back at clock time ``now`` (feeds the drain rate;
        only served ones, so that a burst of fast failures does not promise a short
        Retry-After)."""
        self._releases.append(now)

    def record_duration(self, seconds: float, charge: Charge | None = None) -> None:
        """Record how long a served lease was held (feeds :meth:`retry_after_s`) and, with
        its charge, the seconds per token of output cap (feeds :meth:`replay`)."""
        self._durations.append(seconds)
        if charge is not None:
            self._per_cap_token.append(seconds / max(1, charge.max_tokens))

    def retry_after_s(self, queued: int, slots: int) -> float:
        """Estimate when a request sent now could start, in seconds (1–60).

        From the observed drain rate (leases released per second over the last 64
        releases): (queued + 1) / rate. With no history, the mean lease duration seen
        times (queued + 1) over the backend's ``slots`` (1 when its layout is unknown),
        or 1 s.

        :param queued: requests waiting now.
        :param slots: the backend's slots.
        """
        ahead = queued + 1
        if len(self._releases) >= 2:
            span = self._releases[-1] - self._releases[0]
            if span > 0:
                rate = (len(self._releases) - 1) / span
                return min(60.0, max(1.0, ahead / rate))
        if self._durations:
            mean = sum(self._durations) / len(self._durations)
            return min(60.0, max(1.0, mean * ahead / slots))
        return 1.0

    def _pace(self, first_rate: float | None) -> float | None:
        """Seconds a lease holds per token of its cap: the median of the served leases'
        once :data:`MIN_HISTORY` are timed, else ``first_rate`` (if positive)."""
        if len(self._per_cap_token) >= MIN_HISTORY:
            return statistics.median(self._per_cap_token)
        return first_rate if first_rate is not None and first_rate > 0 else None

    def replay(self, layout: Layout | None, budget: Budget, now: float,
               in_flight: Iterable[tuple[float, Charge]],
               charges: Sequence[tuple[Charge, float | None]], *,
               first_rate: float | None = None) -> float | None:
        """When the last of ``charges`` starts if they start in order after the leases in
        flight, seconds from ``now``; ``None`` until :data:`MIN_HISTORY` served leases
        have been timed, while the layout is unknown, or when one can never fit.

        A replay of the queue on the capacity model: a lease holds its reservation for
        its output cap times the median seconds per cap token of the last 64 served
        leases (so a short request after long ones is not taken for long); each lease in
        flight is expected to end that long after it was granted (at once, if that is
        past); the charges, in order, each start at the first end after which they fit,
        unless that is after they would have timed out. Releases measured as a rate
        mislead when requests end together (a wave of four ends, then nothing for a
        whole generation); ends measured per lease do not.

        :param budget: what is reserved now.
        :param in_flight: each lease in flight as (clock time of its grant, its charge).
        :param charges: each with the clock time after which it would have left the queue
            (``None``: it stays); one replayed to start after that is left out, since it
            will time out holding nothing.
        :param first_rate: seconds per output token to use before :data:`MIN_HISTORY`
            served leases are timed (the decode pace learnt from the first streams'
            tokens, whole answers' timings or the calibration), so that a fresh gateway
            refuses a doomed request at arrival too (:func:`_holds`: only over answers
            of known length).
        """
        rate = self._pace(first_rate)  # seconds held per token of cap (or of output)
        in_flight = list(in_flight)
        hold = None if layout is None or rate is None else _holds(
            rate, len(self._per_cap_token) >= MIN_HISTORY,
            [*(c for _, c in in_flight), *(c for c, _ in charges)])
        if layout is None or hold is None:
            return None

        ends = [(max(now, granted_at + hold(charge)), i, charge)
                for i, (granted_at, charge) in enumerate(in_flight)]
        heapq.heapify(ends)
        t, order = now, len(ends)
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


def _holds(rate: float, learnt: bool, charges: Iterable[Charge]
           ) -> Callable[[Charge], float] | None:
    """How long a lease of each charge holds, seconds, at ``rate``: seconds per token of
    cap once ``learnt`` from served leases; before, a pace per output token (the first
    streams', the timings', the calibration's), which is not one per token of cap, since
    answers stop before their caps. Then a lease holds for its known length: the cap of
    one that runs to it (``to_cap``), else its predicted length; and with any of
    ``charges`` of unknown length, ``None``: nothing is predicted (found by the
    adversarial pass: a calibrated fresh gateway refused, as 31 s away, a request that
    started 0.3 s later)."""
    if learnt:
        return lambda charge: rate * max(1, charge.max_tokens)
    if not all(c.to_cap or c.predicted is not None for c in charges):
        return None
    return lambda charge: rate * max(1, charge.max_tokens if charge.to_cap or
                                     charge.predicted is None else charge.predicted)
