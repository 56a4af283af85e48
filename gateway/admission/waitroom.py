"""The one waiting room: requests waiting their turn, each for a grant of some kind.

A :class:`Waitroom` keeps its waiters in the order of :class:`~gateway.core.fairness.FairQueue`
(FIFO while every waiter has the same tenant and class) and gives each a future. Its user
decides *when* a waiter is granted and *what* it gets (a backend's lease, a pool's
backend and lease, a place past a tenant's gate); the room does the rest the same way
for all three:

* **deadlines**: :meth:`Waitroom.wait` awaits the future for at most the waiter's time
  on the injected clock (:meth:`gateway.clock.Clock.wait`);
* **shedding**: when the room is full, a newcomer takes the place of the newest waiter
  of the lowest class below its own (:meth:`Waitroom.victim_for`), or is refused;
* **abandonment**: a waiter that leaves (timed out, cancelled, refused) is taken out and
  its user told (``on_leave``: the head may have been the blocker); one cancelled after
  it was granted gives back what it got (``give_back``), as anyio's ``CapacityLimiter``
  does, so nothing granted is lost;
* **drain**: :meth:`Waitroom.refuse_waiting` fails every waiter with one error.

Its users: :class:`gateway.admission.admission.Admission` (a backend's queue),
:class:`gateway.fleet.pool.ModelQueue` (a pool's queue over several backends) and the
tenant gate (:meth:`gateway.admission.tenants.Tenant.enter`).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Generic, TypeVar

from gateway.clock import Clock, wait
from gateway.core.fairness import FairQueue, Party
from gateway.errors import QueueFull, Shed

__all__ = ["Waiter", "Waitroom", "shed_error"]

R = TypeVar("R")  # what a waiter asks for (its user's record of the request)
G = TypeVar("G")  # what it is granted


def shed_error(message: str, retry_after_s: float) -> Shed:
    """The 503 a waiter gets when a request of a higher class takes its place."""
    return Shed(f"{message} A request of a higher class needed its place in the full "
                "queue; retry after the Retry-After delay.", retry_after_s=retry_after_s)


def _nothing() -> None:
    return None


@dataclass(eq=False)
class Waiter(Generic[R, G]):
    """One request waiting in a :class:`Waitroom`.

    :param request: what it asks for, as its user records it.
    :param party: its tenant, class and class wait limit.
    :param since: clock time it started waiting, seconds.
    :param future: resolved with its grant, or failed with why it may not wait.
    """

    request: R
    party: Party
    since: float
    future: asyncio.Future[G]

    def deadline(self, default_wait_s: float) -> float:
        """The clock time after which it leaves the room: its class's wait limit, else
        ``default_wait_s`` (seconds), after it came."""
        wait = self.party.max_wait_s
        return self.since + (default_wait_s if wait is None else wait)

    @property
    def granted(self) -> bool:
        """Its future holds a grant (not an error, not cancelled)."""
        fut = self.future
        return fut.done() and not fut.cancelled() and fut.exception() is None


class Waitroom(Generic[R, G]):
    """Waiters in fair order, each with a future of its grant.

    :param clock: the injected time source (arrival times, deadlines, ageing).
    :param age_s: priority ageing, seconds per class (:class:`FairQueue`).
    :param max_queue: most waiters (0: never wait); ``None`` for no bound.
    :param full: builds the error refusing a newcomer when the room is full.
    :param give_back: returns a grant that its waiter no longer wants (it was cancelled
        as it was granted).
    :param on_leave: called after a waiter left without a grant (the ones behind it may
        be served now).
    :param counted: which waiters count against ``max_queue`` (default: all). A shared
        queue counts only those its grant script has seen and not granted: the others
        are on their way to their first grant, not waiting.
    """

    def __init__(self, clock: Clock, *, age_s: float = 30.0, max_queue: int | None = None,
                 full: Callable[[], Exception] | None = None,
                 give_back: Callable[[G], None], on_leave: Callable[[], None] = _nothing,
                 counted: Callable[[Waiter[R, G]], bool] | None = None) -> None:
        self._clock = clock
        self._queue: FairQueue[Waiter[R, G]] = FairQueue(age_s)
        self.max_queue = max_queue
        self._full = full or self._default_full
        self._give_back = give_back
        self._on_leave = on_leave
        self._counted = counted

    def __len__(self) -> int:
        return len(self._queue)

    def __bool__(self) -> bool:
        return bool(self._queue)

    def __iter__(self) -> Iterator[Waiter[R, G]]:
        """The waiters in arrival order (those come back to the front first)."""
        return iter(self._queue)

    # -- order ----------------------------------------------------------------------------

    def head(self) -> Waiter[R, G] | None:
        """The waiter to serve next, or ``None`` when none waits."""
        return self._queue.head(self._clock.now())

    def order(self) -> list[Waiter[R, G]]:
        """Every waiter, in the order they would be served."""
        return self._queue.order(self._clock.now())

    def ahead_of(self, party: Party, cost: int) -> list[Waiter[R, G]]:
        """The waiters that would be served before a request of ``party`` reserving
        ``cost`` KV tokens, were it to arrive now."""
        return self._queue.ahead_of(party, cost, self._clock.now())

    def position(self, match: Callable[[R], bool]) -> int | None:
        """1-based place in the serving order of the first waiter whose request
        ``match`` accepts; ``None`` when none does."""
        for i, waiter in enumerate(self.order(), 1):
            if match(waiter.request):
                return i
        return None

    def oldest_wait_s(self) -> float:
        """How long the waiter here longest has waited so far, seconds (0.0 when none
        waits)."""
        now = self._clock.now()
        return max((now - waiter.since for waiter in self._queue), default=0.0)

    def charge(self, party: Party, cost: int) -> None:
        """Note a request of ``party`` granted ``cost`` KV tokens without waiting (its
        tenant's fair share advances, :meth:`FairQueue.charge`)."""
        self._queue.charge(party, cost)

    # -- room -----------------------------------------------------------------------------

    def check_room(self, party: Party | None = None) -> None:
        """Raise at once when a newcomer could only wait and the room is full.

        :raises Exception: what ``full`` builds (a :class:`QueueFull`): ``max_queue``
            waiters are here already (and at least one is), none of a class lower than
            ``party``'s (which it would shed).
        """
        if (self._waiting() and self._is_full()
                and self._queue.shed_for(party or Party()) is None):
            raise self._full()

    def victim_for(self, party: Party) -> Waiter[R, G] | None:
        """The waiter a newcomer of ``party`` must shed to wait here (``None``: there is
        room). Nothing is changed: shed it with :meth:`fail`.

        :raises Exception: what ``full`` builds: the room is full and every waiter's
            class is as high as ``party``'s.
        """
        if not self._is_full():
            return None
        victim = self._queue.shed_for(party)
        if victim is None:
            raise self._full()
        return victim

    def _waiting(self) -> int:
        """The waiters that count against ``max_queue``."""
        counted = self._counted
        if counted is None:
            return len(self._queue)
        return sum(1 for waiter in self._queue if counted(waiter))

    def _is_full(self) -> bool:
        return self.max_queue is not None and self._waiting() >= self.max_queue

    def _default_full(self) -> Exception:
        return QueueFull(f"The queue is full ({self.max_queue} waiting); retry after the "
                         "Retry-After delay.", retry_after_s=1.0)

    # -- waiters --------------------------------------------------------------------------

    def join(self, request: R, party: Party, cost: int = 0, *,
             front: bool = False) -> Waiter[R, G]:
        """A new waiter for ``request`` (it reserves ``cost`` KV tokens once granted);
        with ``front``, with those come back to the head (which neither the bound nor
        the others waiting hold back). It waits from now."""
        now = self._clock.now()
        waiter: Waiter[R, G] = Waiter(request, party, now,
                                      asyncio.get_running_loop().create_future())
        self._queue.push(waiter, party, cost, now, front=front)
        return waiter

    def grant(self, waiter: Waiter[R, G], value: G) -> None:
        """Serve ``waiter`` with ``value`` (its tenant is charged its cost)."""
        self._queue.take(waiter)
        waiter.future.set_result(value)

    def fail(self, waiter: Waiter[R, G], exc: Exception) -> None:
        """Take ``waiter`` out and fail its wait with ``exc`` (it was shed, or can never
        be served)."""
        self._queue.remove(waiter)
        if not waiter.future.done():
            waiter.future.set_exception(exc)

    def refuse_waiting(self, exc: Exception) -> None:
        """Fail every waiter with ``exc`` (the gateway is stopping)."""
        for waiter in list(self._queue):
            self.fail(waiter, exc)

    async def wait(self, waiter: Waiter[R, G], timeout_s: float,
                   timed_out: Callable[[], Exception]) -> G:
        """Wait until ``waiter`` is served, for at most ``timeout_s`` seconds.

        :returns: its grant.
        :raises Exception: ``timed_out()`` (built while the waiter is still counted
            here) once the time has passed; or what :meth:`fail` or
            :meth:`refuse_waiting` gave it.

        However it ends without a grant (timed out, failed, cancelled) the waiter leaves
        (:meth:`_abandon`); a grant that came as it was being cancelled is given back.
        """
        try:
            return await wait(self._clock, waiter.future, timeout_s)
        except TimeoutError:
            if waiter.future.done():  # its own error, not the deadline
                self._abandon(waiter)
                raise
            exc = timed_out()
        except BaseException:
            self._abandon(waiter)
            raise
        self._abandon(waiter)
        raise exc

    def _abandon(self, waiter: Waiter[R, G]) -> None:
        """``waiter`` leaves without taking its grant: give back one it got meanwhile;
        else take it out and tell the user (the head may have been the blocker)."""
        if waiter.granted:
            self._give_back(waiter.future.result())
            return
        self._queue.remove(waiter)
        waiter.future.cancel()
        self._on_leave()
