"""``--models-max`` of a llama-server router, as the gateway keeps it: which loaded
model makes way when another must load, and how long loads take.

What the router does itself (``tools/server/server-models.cpp``): a request for a model
that is not running joins the router's queue (``server_lru_sched::join``, one entry per
model, so one load per model at a time); the head of the queue loads once fewer than
``--models-max`` children run (``try_claim``); while queued requests outnumber the free
places, the router unloads the least recently used model that is *idle*, with no
request in flight and none queued for it (``tick``, ``pick_victim``). It never unloads
a busy model: the load waits until one is idle, and a model kept busy (requests that
keep arriving) would keep it waiting for ever.

So the gateway, which admits every request the router runs, does the rest
(:class:`ModelsMaxGate`). A request for a model that is not running waits in the gateway
before its count (the first call that reaches the router, and so the one that would
start the load) until the model has its *turn*: a free place (none taken by a load the
gateway let through and the router has not shown running yet), or a loaded model with
no work in the gateway, which the router then unloads. (Sent at once, a count for
another model would have the router unload a model between its own count and its
generation, and load it again right after.) And when a model waits to load, every
place is taken and every
loaded model is busy, it *holds* the least recently used loaded model (one that has run
at least :data:`MIN_RESIDENCY_S`, or its own load time): a lease of all its slots, taken
at the head of its queue, so that it takes no new request, its requests in flight end,
the router unloads it and the waiting model loads. The hold is let go once the model is
unloaded (its requests queued meanwhile are then admitted, and load it again in turn),
or when nothing waits to load any more. An evicted model's leases are never given back
early: the router unloads only a model with no request in flight, and the hold waits for
every lease of it to end. Each hold is logged and counted
(``gateway_router_holds_total``) and shown while it lasts
(``gateway_router_model_held``, the status page).

Load times are measured from a model's first ``loading`` (or first want) to ``loaded``
in ``/models``. What is left of a load (:meth:`ModelsMaxGate.load_wait_s`) gives a model
not loaded its Retry-After and starts every wait forecast of its queue
(:attr:`gateway.admission.forecast.WaitForecast.startup_s`).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections import Counter
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from gateway.admission.lease import Lease
from gateway.clock import Clock, wait
from gateway.core.capacity import Charge
from gateway.core.models_max import (
    UNLISTED,
    Resident,
    Turn,
    needs_turn,
    released,
    turn,
    victims,
    wanting,
)
from gateway.errors import GatewayError, QueueTimeout
from gateway.tasks import not_cancelled

if TYPE_CHECKING:
    from gateway.backends.router import ModelEntry, RouterHub
    from gateway.backends.target import Target

__all__ = ["FIRST_LOAD_S", "MIN_RESIDENCY_S", "POLL_S", "WANT_S", "ModelsMaxGate",
           "remaining_load_s"]

log = logging.getLogger(__name__)

POLL_S = 0.5  # /models is read this often while a load is pending or a hold lasts
WANT_S = 2.0  # a request planned on a model this recently still wants it (counting, queue)
MIN_RESIDENCY_S = 5.0  # a model loaded this recently is not held (least: its load time)
#: A load's predicted time before any load of the router was timed, seconds: a guess
#: between the project's small model from the page cache (under 2 s measured here) and
#: a 7-8B Q4 GGUF read from disk (tens of seconds).
FIRST_LOAD_S = 5.0
_GONE = Resident(UNLISTED, running=False)  # a model neither listed nor a member


@dataclass
class _Hold:
    """A hold on ``victim`` (a member target) so that ``wanted`` can load."""

    victim: str
    wanted: str
    member: Target
    task: asyncio.Task[None] | None = None
    lease: Lease | None = None
    released: bool = False


def remaining_load_s(learned: float | None, others: list[float], elapsed_s: float
                     ) -> float:
    """Seconds a model's load has left, predicted: its own learned load time, else the
    mean of the router's other models' (one disk, one build), else
    :data:`FIRST_LOAD_S`, less the ``elapsed_s`` it has run; a load past that
    prediction is due at any moment (:data:`POLL_S`, when ``/models`` is read next).

    :param learned: this model's learned load time, seconds, or ``None``.
    :param others: the learned load times of the router's models, seconds.
    :param elapsed_s: seconds since the load started (or was first wanted).
    """
    guess = learned if learned is not None else (
        sum(others) / len(others) if others else FIRST_LOAD_S)
    return max(POLL_S, guess - elapsed_s)


async def _all_slots(hold: _Hold, charge: Charge) -> Lease | None:
    """A lease of every slot of the held model, at the head of its queue, for as long as
    it takes (a hold is not bounded by the queue's wait: placed again each
    ``max_queue_wait_s``, it was logged and counted again each time); ``None`` when the
    hold was let go meanwhile or admission refused it otherwise."""
    while not hold.released:
        try:
            return await hold.member.admission.admit(charge, front=True)
        except QueueTimeout:
            continue
        except GatewayError:
            return None
    return None


class ModelsMaxGate:
    """Holds a busy loaded model so that the router can unload it for a model that
    waits to load (see the module), and learns each model's load time.

    :param hub: the router's :class:`~gateway.backends.router.RouterHub` (its
        ``entries``, ``members`` and ``max_instances``).
    :param clock: the injected clock.
    :param full_pass: one discovery of the hub (``/models`` read, then :meth:`rebalance`);
        run every :data:`POLL_S` while a load is pending or a hold lasts.

    :ivar holds: the holds in force, by held model id.
    :ivar holds_placed: holds placed so far, by held model id.
    :ivar load_s: each model's learned load time, seconds.
    """

    def __init__(self, hub: RouterHub, clock: Clock,
                 full_pass: Callable[[], Awaitable[Any]]) -> None:
        self.hub = hub
        self.clock = clock
        self._full_pass = full_pass
        self.holds: dict[str, _Hold] = {}
        self.holds_placed: Counter[str] = Counter()
        self.load_s: dict[str, float] = {}
        self._want_since: dict[str, float] = {}  # not running, wanted since
        self._loading_since: dict[str, float] = {}
        self._loaded_at: dict[str, float] = {}
        self._used: dict[str, float] = {}  # a request last planned on it
        self._counting: Counter[str] = Counter()
        self._waiting: Counter[str] = Counter()  # requests waiting for the model's turn
        self._sent: dict[str, float] = {}  # turns given, until the model shows running
        self._changed: asyncio.Future[None] | None = None  # done at the next rebalance
        self._poll: asyncio.Task[None] | None = None

    # -- what the requests tell ---------------------------------------------------------

    def used(self, model_id: str) -> None:
        """A request was planned on ``model_id`` (its body prepared)."""
        self._used[model_id] = self.clock.now()
        self.wanted(model_id)

    def counting(self, model_id: str, step: int) -> None:
        """A count on ``model_id`` starts (``step`` 1) or ends (-1)."""
        self._counting[model_id] += step
        if step > 0:
            self.wanted(model_id)

    def wanted(self, model_id: str) -> None:
        """A request wants ``model_id``: when it is not running, its load is pending
        (timed from now, and the hub is read every :data:`POLL_S` until it runs)."""
        entry = self.hub.entries.get(model_id)
        if entry is not None and entry.running:
            return
        self._want_since.setdefault(model_id, self.clock.now())
        self._start_poll()

    async def turn(self, model_id: str, timeout_s: float) -> None:
        """Wait until requests for ``model_id`` may reach the router (see the module):
        at once when it runs, there is no ``--models-max`` or it has a place; else until
        a place frees or a loaded model has no work left in the gateway (a hold makes
        one), checked at each read of the hub; at most ``timeout_s`` seconds, after which
        the request goes on and waits at the router instead."""
        deadline = self.clock.now() + timeout_s
        self.wanted(model_id)
        while not self._may_send(model_id):
            left = deadline - self.clock.now()
            if left <= 0:
                self._sent[model_id] = self.clock.now()
                return
            if self._changed is None or self._changed.done():
                self._changed = asyncio.get_running_loop().create_future()
            self._waiting[model_id] += 1
            try:
                await wait(self.clock, self._changed, left)
            except TimeoutError:
                pass
            finally:
                self._waiting[model_id] -= 1

    def _may_send(self, model_id: str) -> bool:
        """``model_id`` runs, or has its turn now (which takes a place until it runs):
        :func:`gateway.core.models_max.turn`."""
        hub, now = self.hub, self.clock.now()
        entry = hub.entries.get(model_id)
        if entry is None or not needs_turn(entry.status, entry.running, hub.max_instances,
                                           model_id in self._sent):
            return True  # (every count of a running model: no snapshot of the others)
        decided = turn(model_id, self._snapshot(now), hub.max_instances, self._sent)
        if decided is Turn.TURN:
            self._sent[model_id] = now
        return decided is not Turn.WAIT

    def _snapshot(self, now: float) -> dict[str, Resident]:
        """Every model of the router as the gate sees it now: the members first (in
        their order), then the other models ``/models`` lists."""
        hub, out = self.hub, {}
        for model_id in [*hub.members, *(i for i in hub.entries if i not in hub.members)]:
            entry = hub.entries.get(model_id)
            out[model_id] = Resident(
                UNLISTED if entry is None else entry.status,
                entry is not None and entry.running, busy=self._busy(model_id, now),
                member=model_id in hub.members, granted=self._granted(model_id),
                settled=self._settled(model_id, now), used_at=self._used.get(model_id, 0.0))
        return out

    def _granted(self, model_id: str) -> bool:
        """A hold on ``model_id`` has all its slots: it takes no request, runs none."""
        hold = self.holds.get(model_id)
        return hold is not None and hold.lease is not None

    # -- what /models tells -------------------------------------------------------------

    def observe(self, before: dict[str, ModelEntry], after: dict[str, ModelEntry]) -> None:
        """A new ``/models`` read (``after``; ``before`` the previous one): note loads
        starting and ending, and learn their times (the mean of the last two)."""
        now = self.clock.now()
        for model_id, entry in after.items():
            old = before.get(model_id)
            if entry.status == "loading":
                self._loading_since.setdefault(model_id, now)
            elif entry.status == "loaded" and old is not None and old.status != "loaded":
                self._loaded_at[model_id] = now  # (loaded before the first read: settled)
                # From its first "loading" seen, else from the turn the gateway gave
                # it (a load shorter than a poll), never from the wait for that turn.
                start = self._loading_since.pop(model_id, None) or self._sent.get(
                    model_id, self._want_since.get(model_id))
                if start is not None and old.status != "sleeping":
                    sample = now - start
                    last = self.load_s.get(model_id)
                    self.load_s[model_id] = sample if last is None else (last + sample) / 2
            if entry.running:
                self._sent.pop(model_id, None)  # its turn is over: it holds its place
            if entry.running and entry.status != "loading":
                self._want_since.pop(model_id, None)
            elif not entry.running:
                self._loading_since.pop(model_id, None)

    def load_wait_s(self, model_id: str) -> float:
        """Seconds until ``model_id`` is predicted to have loaded (0.0 when it is
        loaded or not listed): :func:`remaining_load_s` of its load (or wake) under way
        or wanted, timed from its first ``loading``, else from the turn the gateway gave
        it (without ``--models-max``, from its first want)."""
        entry = self.hub.entries.get(model_id)
        if entry is None or entry.status == "loaded":
            return 0.0
        # A turn still awaited is no part of the load (without --models-max, none is).
        since = self._loading_since.get(model_id) or self._sent.get(model_id) or (
            self._want_since.get(model_id) if self.hub.max_instances <= 0 else None)
        return remaining_load_s(self.load_s.get(model_id), list(self.load_s.values()),
                                0.0 if since is None else self.clock.now() - since)

    def retry_after_s(self, model_id: str) -> float:
        """Seconds until ``model_id`` could serve (1–60): :meth:`load_wait_s`."""
        return min(60.0, max(1.0, self.load_wait_s(model_id)))

    @property
    def active(self) -> bool:
        """A load is pending or under way, or a hold lasts: the hub is polled."""
        return bool(self.holds or self._want_since or self._loading_since)

    # -- holds --------------------------------------------------------------------------

    def _own(self, model_id: str) -> tuple[int, int]:
        """The hold's own lease on ``model_id``: (in flight, queued), 0 or 1 each."""
        hold = self.holds.get(model_id)
        if hold is None or hold.released:
            return 0, 0
        return (1, 0) if hold.lease is not None else (0, 1)

    def _busy(self, model_id: str, now: float) -> bool:
        """The gateway has work on ``model_id``: a request in flight or queued (the
        hold's own lease aside), a count under way or waiting for its turn, or one
        planned under :data:`WANT_S` ago."""
        member = self.hub.members.get(model_id)
        if member is None:
            return False
        stats = member.admission.stats()
        held, queued = self._own(model_id)
        return (stats.inflight - held > 0 or stats.queued - queued > 0
                or self._counting[model_id] > 0 or self._waiting[model_id] > 0
                or now - self._used.get(model_id, -1e9) < WANT_S)

    def _settled(self, model_id: str, now: float) -> bool:
        """Loaded for at least :data:`MIN_RESIDENCY_S` (or its own load time)."""
        floor = max(MIN_RESIDENCY_S, self.load_s.get(model_id, 0.0))
        return now - self._loaded_at.get(model_id, -1e9) >= floor

    def rebalance(self) -> None:
        """After a ``/models`` read: let go of holds no longer needed (the held model was
        unloaded, or nothing waits to load), and hold the least recently used loaded
        models while the models waiting to load outnumber the places that are free or
        will free (idle loaded models the router unloads itself, and held ones): the
        decisions of :mod:`gateway.core.models_max`."""
        now = self.clock.now()
        models = self._snapshot(now)
        waiting = wanting(models)
        for model_id in list(self._want_since):
            if model_id not in waiting and not models.get(model_id, _GONE).running and (
                    now - self._want_since[model_id] > WANT_S):
                del self._want_since[model_id]  # its requests went away
        for model_id in list(self._sent):  # a turn given and never used
            if not models.get(model_id, _GONE).running and not self._busy(model_id, now):
                del self._sent[model_id]
        for victim in released(list(self.holds), models, waiting):
            self._release(victim)
        try:
            for victim in victims(models, waiting, self.hub.max_instances, set(self.holds)):
                self._hold(victim, waiting[0])
        finally:
            self._poke()

    def _poke(self) -> None:
        """Have the requests waiting for a turn look again (after a read, a hold)."""
        if self._changed is not None and not self._changed.done():
            self._changed.set_result(None)

    def _hold(self, victim: str, wanted: str) -> None:
        member = self.hub.members[victim]
        layout = member.admission.layout
        if layout is None:
            return
        hold = _Hold(victim, wanted, member)
        self.holds[victim] = hold
        self.holds_placed[victim] += 1
        log.warning("router %s: model %s waits to load, --models-max %d models run and "
                    "every one is busy; %s takes no new request until its requests end "
                    "and the router unloads it", self.hub.name, wanted,
                    self.hub.max_instances, victim)
        charge = Charge(0, 1, n=layout.slots, pinnable=False)
        hold.task = asyncio.ensure_future(self._take(hold, charge))

    async def _take(self, hold: _Hold, charge: Charge) -> None:
        """Wait for every slot of the held model (:func:`_all_slots`)."""
        lease = await _all_slots(hold, charge)
        if lease is None:  # the layout changed, say: the next rebalance decides
            if self.holds.get(hold.victim) is hold:
                del self.holds[hold.victim]
            return
        if hold.released:
            hold.member.admission.release(lease, served=False)
        else:
            hold.lease = lease
            self._poke()  # the held model runs nothing now: a waiting one may go

    def _release(self, victim: str) -> None:
        hold = self.holds.pop(victim)
        hold.released = True
        if hold.lease is not None:
            hold.member.admission.release(hold.lease, served=False)
        elif hold.task is not None:
            hold.task.cancel()
        log.info("router %s: %s takes requests again", self.hub.name, victim)

    # -- polling ------------------------------------------------------------------------

    def _start_poll(self) -> None:
        if self._poll is not None and not self._poll.done():
            return
        try:
            self._poll = asyncio.get_running_loop().create_task(self._polling())
        except RuntimeError:  # no event loop (a synchronous caller): the next read will do
            self._poll = None

    async def _polling(self) -> None:
        """Read the hub every :data:`POLL_S` while :attr:`active`."""
        while not_cancelled():
            await self.clock.sleep(POLL_S)
            with contextlib.suppress(Exception):  # the hub's discovery logs its failures
                await self._full_pass()
            if not self.active:
                return

    async def close(self) -> None:
        """Stop polling and let go of every hold."""
        if self._poll is not None:
            self._poll.cancel()
            await asyncio.gather(self._poll, return_exceptions=True)
        for victim in list(self.holds):
            self._release(victim)
