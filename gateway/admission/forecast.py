"""Wait forecasts of one backend's queue: Retry-After, a new request's predicted wait,
and a waiting request's place and time to start.

:class:`WaitForecast` reads the queue (:class:`~gateway.admission.waitroom.Waitroom`)
and what is in flight, and asks the pure :class:`~gateway.core.waits.WaitPredictor` to
replay them on the capacity model. It changes nothing.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

from gateway.admission.lease import Lease
from gateway.admission.pump import QueuedAsk
from gateway.admission.waitroom import Waiter, Waitroom
from gateway.clock import Clock
from gateway.core.capacity import Budget, Charge, Layout
from gateway.core.fairness import Party
from gateway.core.waits import WaitPredictor

__all__ = ["InFlight", "WaitForecast"]

#: What is reserved on the backend now: its layout, its budget and the leases in flight.
InFlight = Callable[[], tuple[Layout | None, Budget, Iterable[Lease]]]


class WaitForecast:
    """Forecasts over one admission's queue.

    :param room: the admission's waiting room.
    :param waits: the served leases' timings (:class:`~gateway.core.waits.WaitPredictor`).
    :param in_flight: what is reserved now (see :data:`InFlight`).
    :param max_wait_s: the queue's wait bound now, seconds (a waiter's deadline without a
        class limit).
    :param clock: the injected time source.
    :param first_rate: seconds per output token to replay with before served leases are
        timed (the learned ITL at the busy slots,
        :meth:`~gateway.admission.slo.SloGuard.seconds_per_token`), or ``None`` then.

    :ivar startup_s: seconds before the backend can start any request (0.0 by default;
        a llama-server router's model that is loading or not loaded sets its predicted
        load, :meth:`~gateway.backends.router_gate.ModelsMaxGate.load_wait_s`): added to
        every forecast, since nothing starts before it.
    """

    def __init__(self, room: Waitroom[QueuedAsk, Lease], waits: WaitPredictor,
                 in_flight: InFlight, max_wait_s: Callable[[], float], clock: Clock,
                 first_rate: Callable[[], float | None] | None = None) -> None:
        self._first_rate = first_rate
        self._room = room
        self.waits = waits
        self._in_flight = in_flight
        self._max_wait_s = max_wait_s
        self._clock = clock
        self.startup_s: Callable[[], float] = lambda: 0.0

    def retry_after_s(self, charge: Charge | None = None) -> float:
        """Estimate when a request sent now could start, in seconds (1–60)
        (:meth:`gateway.core.waits.WaitPredictor.retry_after_s` over this queue).

        Before any served lease was timed, that says 1 s; with ``charge`` (the request
        answered), the replay of it after the leases in flight is taken instead, when
        it predicts (found by the fresh-user pass: a chat that timed out after 6 s behind
        a stream decoding for 16 s more was told to retry after 1 s)."""
        layout = self._in_flight()[0]
        if charge is not None and not self.waits.drained:
            predicted = self._replay([(charge, None)])
            if predicted is not None:
                return min(60.0, max(1.0, predicted))
        return min(60.0, self.startup_s() + self.waits.retry_after_s(
            len(self._room), layout.slots if layout else 1))

    def predict_wait_s(self, charge: Charge, party: Party | None = None) -> float | None:
        """How long ``charge`` would wait if it queued now, seconds; ``None`` until
        :data:`~gateway.core.waits.MIN_HISTORY` served leases have been timed (or when it
        can never fit).

        A replay of the queue on the capacity model
        (:meth:`gateway.core.waits.WaitPredictor.replay`): the requests ahead, then this
        one, each start at the first end of a lease after which they fit. The requests
        ahead are those :class:`~gateway.core.fairness.FairQueue` would admit before one
        of ``party`` (every waiter, when all share one tenant and class).
        """
        ahead = self._room.ahead_of(party or Party(), charge.tokens)
        return self._replay([*self._deadlines(ahead), (charge, None)])

    def queue_position(self, charge: Charge) -> int | None:
        """1 for the head of the queue; ``None`` when ``charge`` (this very object) is
        not waiting."""
        return self._room.position(lambda ask: ask.charge is charge)

    def eta_s(self, charge: Charge) -> float | None:
        """Seconds until the waiting ``charge`` is predicted to start (as
        :meth:`predict_wait_s`, with only the requests ahead of it); ``None`` when it is
        not waiting."""
        position = self.queue_position(charge)
        if position is None:
            return None
        ahead = self._room.order()[:position - 1]
        return self._replay([*self._deadlines(ahead), (charge, None)])

    def _deadlines(self, waiters: list[Waiter[QueuedAsk, Lease]]
                   ) -> list[tuple[Charge, float | None]]:
        return [(w.request.charge, w.deadline(self._max_wait_s())) for w in waiters]

    def _replay(self, charges: list[tuple[Charge, float | None]]) -> float | None:
        layout, budget, leases = self._in_flight()
        in_flight = [(lease.granted_at, lease.charge) for lease in leases]
        first = None if self._first_rate is None else self._first_rate()
        startup = self.startup_s()
        wait = self.waits.replay(layout, budget, self._clock.now() + startup, in_flight,
                                 charges, first_rate=first)
        return startup + wait if wait is not None else startup or None
