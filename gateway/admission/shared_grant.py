"""The grantor of a backend shared by several gateway processes (``[state] backend =
"redis"``): every request queues with a ticket in the shared queue, and the shared
queue's script grants them, in arrival order over every process
(:class:`~gateway.admission.pump.SharedPump`).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

from gateway.admission.grantor import Desk
from gateway.admission.lease import Lease
from gateway.admission.live import GROWTH_HORIZON_S, LiveAccounting
from gateway.admission.pump import QueuedAsk, SharedPump
from gateway.admission.shared import SharedAccount
from gateway.admission.shared_live import LiveFigures, SharedLive
from gateway.admission.waitroom import Waiter, Waitroom
from gateway.clock import Clock, MonotonicClock
from gateway.core.capacity import Budget, Charge
from gateway.core.fairness import Party

__all__ = ["SharedGrantor"]


class SharedGrantor:
    """Grants a backend's requests from the queue every process shares
    (:class:`~gateway.admission.grantor.Grantor`).

    :param account: the backend's budget shared with the other processes.
    :param clock: the injected time source (the pump's naps between polls); the
        admission's, a monotonic one by default.
    """

    def __init__(self, account: SharedAccount, clock: Clock | None = None) -> None:
        self.account = account
        self._clock = clock or MonotonicClock()
        self._pump: SharedPump | None = None

    @property
    def counted(self) -> Callable[[Waiter[QueuedAsk, Lease]], bool]:
        """Only a waiter the shared script has refused once counts against
        ``max_queue``: before that it is on its way to its first grant."""
        return _seen

    @property
    def busy_slots(self) -> Callable[[], int]:
        """The slots busy over every process, as the last shared reply gave them."""
        return lambda: self.account.busy_slots

    def bind(self, desk: Desk) -> None:
        """Build the pump that serves ``desk``'s queue from the shared one."""
        self._pump = SharedPump(
            self.account, desk.waitroom, desk.slots, desk.grant_layout,
            lambda c, waited_s, ids: desk.grant_lease(c, waited_s=waited_s, slot_ids=ids[1],
                                                      shared_id=ids[0]),
            self._clock, budget=lambda: desk.budget, max_queue=desk.max_queue,
            refusal=desk.refusal)

    def live(self, clock: Clock, *, predictive: bool, margin_tokens: int,
             active: Mapping[int, Lease]) -> LiveAccounting:
        """Live accounting that, under ``predictive``, publishes this process's leases
        and judges the pressure over every process's
        (:class:`~gateway.admission.shared_live.SharedLive`, one per backend)."""
        if not predictive:  # nothing is followed live: nothing to publish
            return LiveAccounting(clock, predictive=False, margin_tokens=margin_tokens,
                                  active=active)
        peers = SharedLive.of(self.account, horizon_s=GROWTH_HORIZON_S)
        live = LiveAccounting(clock, predictive=True, margin_tokens=margin_tokens,
                              peers=peers, active=active)
        store = self.account.store

        def figures() -> dict[str, LiveFigures]:
            """This process's leases on the backend, by lease id, to publish."""
            now = clock.now()
            return {lease.shared_id: live.figure_of(lease, now, store.score_ms(lease.granted_at))
                    for lease in list(active.values())
                    if lease.shared_id is not None and not lease.released}

        peers.bind(figures, lambda: live.pressure(self.account.layout), live.fastest,
                   margin_tokens)
        return live

    def arrive(self, desk: Desk, charge: Charge, party: Party | None, *, front: bool,
               prefer: int | None) -> None:
        """Never at once: the shared queue decides."""
        return None

    def fits_now(self, desk: Desk, charge: Charge, party: Party | None, waited_s: float,
                 cached: bool) -> bool:
        """Never: the shared queue decides."""
        return False

    def ticket(self) -> str:
        """A new id in the shared queue."""
        return self.account.store.new_id()

    def victim(self, room: Waitroom[QueuedAsk, Lease], party: Party) -> None:
        """None: the pump keeps the bound (:meth:`SharedPump._bound
        <gateway.admission.pump.SharedPump>`) once the script has judged the newcomer."""
        return None

    def wakes_on_join(self, desk: Desk, waiter: Waiter[QueuedAsk, Lease]) -> bool:
        """Always: its ticket goes to the script."""
        return True

    def wake(self, desk: Desk) -> None:
        """Run the pump."""
        assert self._pump is not None
        self._pump.stir()

    def released(self, lease: Lease) -> None:
        """Give the lease back in the shared state too."""
        if lease.shared_id is not None:
            self.account.release([lease.shared_id])

    def seen(self, budget: Budget, queued: int) -> tuple[Budget, int]:
        """What every process holds and how many wait over all of them, as last seen;
        this process's own while Redis cannot be reached."""
        if not self.account.store.up:
            return budget, queued
        return (Budget(self.account.reserved_tokens, self.account.busy_slots),
                max(queued, self.account.queued))

    async def close(self, seconds: float) -> None:
        """End the pump's run within ``seconds``."""
        if self._pump is not None:
            await self._pump.close(seconds)


def _seen(waiter: Waiter[QueuedAsk, Lease]) -> bool:
    return waiter.request.seen
