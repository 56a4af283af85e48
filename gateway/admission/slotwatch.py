"""Holding an abandoned request's reservation until its backend slot is really free.

When the gateway stops reading an upstream answer early (the client left, or the read
timed out), llama-server does not stop at once. A non-streamed request is only cancelled
when its HTTP thread notices the closed connection, and that thread only looks after one
second without a result for *any* task: ``server_response::recv_with_timeout`` waits on a
condition variable that every task's result wakes (``tools/server/server-queue.cpp``).
Under load it never looks, so the request decodes to its cap while its client is gone
(issue 15 measured 18–23 s). A stream is cancelled at its next write, but not during its
prefill. Either way a fixed grace can release the reservation while the cells are used.

So the reservation is released only once llama-server's ``GET /slots`` shows that the
request has ended. Two things make a request recognisable there:

* the gateway pins it to a slot it holds (``id_slot``, the lease's first slot id,
  overwriting any the client sent), so no other request of the gateway can take that
  slot meanwhile;
* it carries a tag: a random ``n_discard``, which llama-server reads only for a context
  shift, and a request inside its reservation never shifts (prompt + cap ≤ S − 1); if
  the client set ``n_discard`` itself, a random ``seed`` instead, when the client set
  none. ``/slots`` shows both, and ``n_predict`` (the cap the gateway charged), under
  ``params`` for the running or the last task of each slot (``server_slot::to_json`` in
  ``tools/server/server-context.cpp``).

Whether the request has started matters, and an idle slot cannot tell "not started yet"
from "already over": llama-server may still be building a grammar from a ``json_schema``
in its HTTP thread for seconds, or hold the task in its queue behind a long decode step.
So an abandoned request whose answer has not begun stays connected upstream (the gateway
keeps the request open and discards what comes): llama-server then cannot drop it
unseen, and the gateway closes it once ``/slots`` shows it running, or releases at once
if its whole answer arrives first. A stream whose headers came has started (llama-server
sends them with its first result). A request the gateway could not tag is finished only
once it was seen running on its slot and then not. Only a request whose connection broke
before it was seen (an upstream timeout or error) can stay unseen. It is released once a
reading begun :data:`BROKEN_IDLE_S` after the break shows where it would run idle (its
pinned slot; every slot, for a batch): llama-server starts a task at once on an idle
slot, so by then it is over, or never came, or is still being prepared for longer than
any grammar seen here (:func:`idle_for`). Else (its slot stays busy with others' work)
it is released after the confirm timeout. Before this, four upstream connections
broken in a row kept a whole idle pool reserved for the confirm timeout, two minutes
(found by the adversarial pass).

Polls are :data:`POLL_INTERVAL_S` apart, more than llama-server's one-second wait: every
``/slots`` answer wakes every waiting HTTP thread, and polling faster would stop a lone
abandoned request's thread from ever timing out and noticing its closed connection.

:func:`where_is` is the pure decision; :class:`SlotWatch` polls and releases.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from enum import StrEnum
from typing import Any

import httpx

from gateway.admission.admission import Admission
from gateway.admission.lease import Lease
from gateway.clock import Clock
from gateway.errors import GatewayError, UpstreamUnavailable
from gateway.tasks import cancel_bounded, not_cancelled

__all__ = [
    "BROKEN_IDLE_S",
    "Seen",
    "SlotView",
    "SlotWatch",
    "SlotsUnsupported",
    "Ticket",
    "idle_for",
    "parse_slots",
    "where_is",
]

log = logging.getLogger(__name__)

POLL_INTERVAL_S = 1.5  # how often /slots is read while a reservation waits on it
#: Seconds after a connection broke unseen from which an idle slot where its request
#: would run means it is not coming (:func:`idle_for`): more than llama-server takes to
#: turn a large ``json_schema`` into a grammar in its HTTP thread before the task exists.
BROKEN_IDLE_S = 10.0
# The first read after the gateway cancelled a running stream to make room (preemption):
# llama-server ends it at its next write, and its continuation waits for this release.
QUICK_POLL_S = 0.2
UNSUPPORTED_RETRY_S = 60.0  # how long a "no /slots" answer is believed
TAG_FIELDS = ("n_discard", "seed")  # the params a tag may use, in order of preference


class SlotsUnsupported(Exception):
    """Raised when the backend does not serve ``GET /slots`` (llama-server ``--no-slots``)."""


@dataclass(frozen=True)
class SlotView:
    """One entry of llama-server's ``GET /slots``.

    :param id: the slot id.
    :param processing: ``is_processing``.
    :param params: the integer ``params`` of the running task, or of the last one when
        idle, among ``n_predict`` (tokens) and :data:`TAG_FIELDS`.
    """

    id: int
    processing: bool
    params: tuple[tuple[str, int], ...] = ()

    def param(self, name: str) -> int | None:
        """The value of one integer param, or ``None`` when absent."""
        return dict(self.params).get(name)


@dataclass(frozen=True)
class Ticket:
    """What identifies an abandoned request on the backend.

    :param slot: the pinned slot id (``id_slot`` sent upstream), or ``None`` for a batch
        of prompts, which llama-server spreads over slots of its choosing.
    :param tasks: upstream tasks the request started (prompts × ``n``).
    :param tag: ``(param name, value)`` the gateway added to the body, or ``None`` when
        the client had set both tag fields itself.
    :param n_predict: the cap charged and sent upstream (tokens).
    :param since: when it was abandoned, seconds on the injected clock.
    """

    slot: int | None
    tasks: int
    tag: tuple[str, int] | None
    n_predict: int
    since: float


class Seen(StrEnum):
    """Where an abandoned request stands, as far as ``/slots`` shows."""

    running = "running"  # a slot processes it: its cells are in use
    finished = "finished"  # its slot(s) show it ended: the reservation can go
    unseen = "unseen"  # no trace of it: still queued inside the backend, or never arrived


def parse_slots(data: Any) -> list[SlotView]:
    """Read ``GET /slots`` JSON (an array of slot objects).

    :raises ValueError: the body is not an array of objects with integer ``id``s.
    """
    if not isinstance(data, list):
        raise ValueError("/slots did not answer an array")
    views = []
    for entry in data:
        if not isinstance(entry, dict) or not isinstance(entry.get("id"), int):
            raise ValueError("/slots entry without an integer id")
        given = entry.get("params")
        params: dict[str, Any] = given if isinstance(given, dict) else {}
        ints = tuple((name, params[name]) for name in ("n_predict", *TAG_FIELDS)
                     if isinstance(params.get(name), int))
        views.append(SlotView(id=entry["id"], processing=bool(entry.get("is_processing")),
                              params=ints))
    return views


def _matches(ticket: Ticket, view: SlotView) -> bool:
    if ticket.tag is None or view.param("n_predict") != ticket.n_predict:
        return False
    name, value = ticket.tag
    return view.param(name) == value


def where_is(ticket: Ticket, slots: list[SlotView], *, seen_running: bool = False) -> Seen:
    """Decide from one ``/slots`` reading whether an abandoned request has ended.

    Tagged: running when any slot processes a task carrying the tag; else, pinned,
    finished when its slot's last task carries it (or carries another, once the request
    was seen running), unseen otherwise; a batch is finished once as many idle slots
    carry the tag as it started tasks.
    Untagged (pinned): running while its slot processes a task with its cap; finished
    once ``seen_running`` was true and the slot is idle. A pinned slot that no longer
    exists (the backend restarted smaller) means finished.
    """
    pinned = None
    if ticket.slot is not None:
        pinned = next((view for view in slots if view.id == ticket.slot), None)
        if pinned is None:
            return Seen.finished
    if ticket.tag is None:
        if pinned is None:
            return Seen.unseen
        if pinned.processing and pinned.param("n_predict") == ticket.n_predict:
            return Seen.running
        return Seen.finished if seen_running and not pinned.processing else Seen.unseen
    mine = [view for view in slots if _matches(ticket, view)]
    if any(view.processing for view in mine):
        return Seen.running
    if pinned is not None:
        # A request that started on its slot and is no longer its last task has ended.
        return Seen.finished if pinned in mine or seen_running else Seen.unseen
    return Seen.finished if len(mine) >= ticket.tasks else Seen.unseen


def idle_for(ticket: Ticket, slots: list[SlotView]) -> bool:
    """Whether nothing of ``ticket``'s could be running or waiting to run: its pinned
    slot is idle, or, for a batch (on slots llama-server picks), every slot is. A task
    for an idle slot starts at once (llama-server defers a task only while its slot, or
    every slot, is busy: ``server_context::process_single_task``), so after a break
    (:data:`BROKEN_IDLE_S`) this means the request is over or never came."""
    if ticket.slot is None:
        return all(not view.processing for view in slots)
    return any(view.id == ticket.slot and not view.processing for view in slots)


@dataclass
class _Held:
    lease: Lease
    ticket: Ticket
    served: bool
    seen_running: bool = False  # the request has started on the backend
    follow: asyncio.Task[None] | None = None  # the open upstream request, followed


class SlotWatch:
    """Keeps abandoned reservations until ``/slots`` shows their requests ended.

    :param name: backend name, for logs.
    :param fetch: reads the backend's slots; raises :class:`SlotsUnsupported` when the
        endpoint is off, :class:`~gateway.errors.UpstreamUnavailable` when the backend
        cannot be reached, another :class:`~gateway.errors.GatewayError` otherwise.
    :param admission: where reservations are released.
    :param clock: injected time source.
    :param unseen_timeout_s: longest hold of a request ``/slots`` does not show running
        (seconds); then it is released with a warning.
    :param fallback_grace_s: hold used when the backend has no ``/slots`` (seconds).
    """

    def __init__(
        self, name: str, fetch: Callable[[], Awaitable[list[SlotView]]], admission: Admission,
        clock: Clock, *, unseen_timeout_s: float, fallback_grace_s: float,
    ) -> None:
        self.name = name
        self._fetch = fetch
        self._admission = admission
        self._clock = clock
        self._unseen_timeout_s = unseen_timeout_s
        self._grace_s = fallback_grace_s
        self._held: list[_Held] = []
        self._task: asyncio.Task[None] | None = None
        self._waiting_long = False  # the poll task sleeps its long interval now
        self._quick_next = False  # a quick read was asked for while one could not start
        self._unsupported_at: float | None = None  # when the backend said it has no /slots

    @property
    def supported(self) -> bool:
        """False for :data:`UNSUPPORTED_RETRY_S` after the backend answered that it has
        no ``/slots``; then it is asked again (it may have been restarted with them)."""
        at = self._unsupported_at
        return at is None or self._clock.now() - at >= UNSUPPORTED_RETRY_S

    @property
    def waiting(self) -> int:
        """Reservations held until their request is seen to end."""
        return len(self._held)

    def hold(
        self, lease: Lease, ticket: Ticket, *, served: bool,
        pending: asyncio.Future[httpx.Response] | None = None, stream: bool = False,
        launched: bool = False, quick: bool = False,
    ) -> None:
        """Release ``lease`` once the request behind ``ticket`` has left the backend.

        :param pending: the upstream request, still waiting for its answer's headers;
            it is followed (and closed once ``/slots`` shows the request running).
        :param stream: the upstream request is a stream (its headers mean "started").
        :param launched: the request is known to have started.
        :param quick: read ``/slots`` after :data:`QUICK_POLL_S` rather than
            :data:`POLL_INTERVAL_S` (a preempted stream, whose continuation waits).
            Always so with ``pending``: the backend goes on generating for nobody
            until the read that sees the request running closes it (llama-server then
            stops it within its one-second poll of the connection, as when its own
            client leaves).
        """
        if not self.supported:
            self._fall_back(lease, served, pending)
            return
        quick = quick or pending is not None
        held = _Held(lease, ticket, served, seen_running=launched)
        if pending is not None:
            held.follow = asyncio.ensure_future(self._follow(held, pending, stream))
        self._held.append(held)
        running = self._task is not None and not self._task.done()
        if quick and running:
            if self._waiting_long:  # only a long wait is cut short, never a read
                assert self._task is not None
                self._task.cancel()
                running = False
            else:  # reading now, or a quick read is due already: read again soon after
                self._quick_next = True
        if not running:
            self._task = asyncio.ensure_future(
                self._run(QUICK_POLL_S if quick else POLL_INTERVAL_S))

    async def _follow(self, held: _Held, pending: asyncio.Future[httpx.Response],
                      stream: bool) -> None:
        """Wait for the open upstream request's headers: a whole answer means the
        request is over (release now); a stream's means it has started (close it)."""
        try:
            resp = await pending
        except asyncio.CancelledError:
            pending.cancel()
            raise
        except Exception:  # the connection broke: whether it started is unknown
            return
        try:
            if not stream:
                await resp.aread()
        except Exception:
            pass
        finally:
            await resp.aclose()
        if stream:
            held.seen_running = True
        else:
            self._release(held)

    def _fall_back(self, lease: Lease, served: bool, upstream: asyncio.Future[Any] | None
                   ) -> None:
        """No /slots: close any open upstream request and release after the grace."""
        if upstream is not None:
            upstream.cancel()
        self._admission.release_later(lease, self._grace_s, served=served)

    def _release(self, held: _Held) -> None:
        if held in self._held:
            self._held.remove(held)
        if held.follow is not None and not held.follow.done():
            held.follow.cancel()
        self._admission.release(held.lease, served=held.served)

    async def close(self) -> None:
        """Stop polling and release everything held (shutdown)."""
        if self._task is not None:  # (bounded: a poll that ignores it is logged)
            await cancel_bounded([self._task], f"backend {self.name}'s slot watch", 2.0)
        self.release_all()

    def release_all(self) -> None:
        """Release everything held (the backend restarted, or is gone)."""
        for held in list(self._held):
            self._release(held)

    async def _run(self, first_s: float = POLL_INTERVAL_S) -> None:
        wait = first_s
        while not_cancelled() and self._held:
            self._waiting_long = wait >= POLL_INTERVAL_S
            try:
                await self._clock.sleep(wait)
            finally:
                self._waiting_long = False
            try:
                await self._poll()
            except Exception:  # never strand a reservation: keep polling
                log.exception("backend %s: checking /slots failed", self.name)
            wait = QUICK_POLL_S if self._quick_next else POLL_INTERVAL_S
            self._quick_next = False

    async def _poll(self) -> None:
        asked = self._clock.now()  # (the reading shows the backend from this time on)
        try:
            slots = await self._fetch()
        except SlotsUnsupported:
            log.warning(
                "backend %s has no /slots (started with --no-slots?); abandoned requests "
                "keep their reservation for disconnect_grace_s = %g s instead of until "
                "their slot is seen free", self.name, self._grace_s,
            )
            self._unsupported_at = self._clock.now()
            self._held, unsupported = [], self._held
            for h in unsupported:
                self._fall_back(h.lease, h.served, h.follow)
            return
        except UpstreamUnavailable:
            log.info("backend %s is unreachable; its abandoned requests are gone", self.name)
            self.release_all()
            return
        except GatewayError as exc:
            log.debug("backend %s: /slots failed: %s", self.name, exc.message)
            slots = None
        now = self._clock.now()
        for held in list(self._held):
            seen = Seen.unseen
            if slots is not None:
                seen = where_is(held.ticket, slots, seen_running=held.seen_running)
            if seen is Seen.running:
                held.seen_running = True
                if held.follow is not None and not held.follow.done():
                    held.follow.cancel()  # close it: llama-server may now stop it early
            if seen is Seen.finished:
                self._release(held)
                continue
            open_upstream = held.follow is not None and not held.follow.done()
            late = now - held.ticket.since >= self._unseen_timeout_s
            # A pinned request seen running is followed on its slot; anything else that
            # stays unseen (never seen, or a batch on slots llama-server chose) times out.
            followed = held.seen_running and held.ticket.slot is not None
            if seen is not Seen.unseen or open_upstream or followed:
                continue
            if late:
                log.warning(
                    "backend %s: an abandoned request (slot %s) was not seen in /slots "
                    "within %g s of its connection breaking; releasing its reservation",
                    self.name, held.ticket.slot, self._unseen_timeout_s,
                )
                self._release(held)
            elif (slots is not None and asked - held.ticket.since >= BROKEN_IDLE_S
                    and idle_for(held.ticket, slots)):
                log.info("backend %s: an abandoned request (slot %s) was not seen in "
                         "/slots and its slot has been idle %g s after its connection "
                         "broke; releasing its reservation", self.name,
                         held.ticket.slot, BROKEN_IDLE_S)
                self._release(held)
