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

* the gateway pins it to a slot it holds (``id_slot``, the lease's first slot id), so no
  other request of the gateway can take that slot meanwhile;
* it carries a tag: a random ``seed`` when the client set none (sampling is as random as
  llama-server's own default seed), and its ``n_predict``, the cap the gateway charged.
  ``/slots`` shows both under ``params`` for the running or the last task of each slot
  (``server_slot::to_json`` in ``tools/server/server-context.cpp``).

:func:`where_is` is the pure decision; :class:`SlotWatch` polls and releases.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from enum import StrEnum
from typing import Any

from gateway.admission import Admission, Clock, Lease
from gateway.errors import GatewayError, UpstreamUnavailable

__all__ = [
    "Seen",
    "SlotView",
    "SlotWatch",
    "SlotsUnsupported",
    "Ticket",
    "parse_slots",
    "where_is",
]

log = logging.getLogger(__name__)

POLL_INTERVAL_S = 0.25  # how often /slots is read while a reservation waits on it


class SlotsUnsupported(Exception):
    """Raised when the backend does not serve ``GET /slots`` (llama-server ``--no-slots``)."""


@dataclass(frozen=True)
class SlotView:
    """One entry of llama-server's ``GET /slots``.

    :param id: the slot id.
    :param processing: ``is_processing``.
    :param seed: ``params.seed`` of the running task, or of the last one when idle.
    :param n_predict: ``params.n_predict`` of that task (tokens).
    """

    id: int
    processing: bool
    seed: int | None = None
    n_predict: int | None = None


@dataclass(frozen=True)
class Ticket:
    """What identifies an abandoned request on the backend.

    :param slot: the pinned slot id (``id_slot`` sent upstream), or ``None`` for a batch
        of prompts, which llama-server spreads over slots of its choosing.
    :param tasks: upstream tasks the request started (prompts × ``n``).
    :param seed: the seed tag the gateway added, or ``None`` when the client chose its
        own seed (then only ``n_predict`` and the pinned slot identify it).
    :param n_predict: the cap charged and sent upstream (tokens).
    :param since: when it was abandoned, seconds on the injected clock.
    """

    slot: int | None
    tasks: int
    seed: int | None
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
        params = entry.get("params") if isinstance(entry.get("params"), dict) else {}
        seed, n_predict = params.get("seed"), params.get("n_predict")
        views.append(SlotView(
            id=entry["id"], processing=bool(entry.get("is_processing")),
            seed=seed if isinstance(seed, int) else None,
            n_predict=n_predict if isinstance(n_predict, int) else None,
        ))
    return views


def _matches(ticket: Ticket, view: SlotView) -> bool:
    if view.n_predict != ticket.n_predict:
        return False
    return ticket.seed is None or view.seed == ticket.seed


def where_is(ticket: Ticket, slots: list[SlotView]) -> Seen:
    """Decide from one ``/slots`` reading whether an abandoned request has ended.

    Running when any slot processes a task carrying its tag. Otherwise, for a pinned
    request, finished when its slot's last task carries the tag (or the slot no longer
    exists: the backend restarted smaller), unseen when it carries another. For a batch,
    finished once as many idle slots carry the tag as it started tasks.
    """
    mine = [view for view in slots if _matches(ticket, view)]
    if any(view.processing for view in mine):
        return Seen.running
    if ticket.slot is not None:
        pinned = next((view for view in slots if view.id == ticket.slot), None)
        if pinned is None:
            return Seen.finished
        return Seen.finished if pinned in mine else Seen.unseen
    return Seen.finished if len(mine) >= ticket.tasks else Seen.unseen


@dataclass
class _Held:
    lease: Lease
    ticket: Ticket
    served: bool


class SlotWatch:
    """Keeps abandoned reservations until ``/slots`` shows their requests ended.

    :param name: backend name, for logs.
    :param fetch: reads the backend's slots; raises :class:`SlotsUnsupported` when the
        endpoint is off, :class:`~gateway.errors.UpstreamUnavailable` when the backend
        cannot be reached, another :class:`~gateway.errors.GatewayError` otherwise.
    :param admission: where reservations are released.
    :param clock: injected time source.
    :param unseen_timeout_s: longest hold of a request ``/slots`` never shows (seconds);
        then it is released with a warning.
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
        self.supported = True  # cleared once the backend says it has no /slots

    @property
    def waiting(self) -> int:
        """Reservations held until their request is seen to end."""
        return len(self._held)

    def hold(self, lease: Lease, ticket: Ticket, *, served: bool) -> None:
        """Release ``lease`` once the request behind ``ticket`` has left the backend."""
        if not self.supported:
            self._admission.release_later(lease, self._grace_s, served=served)
            return
        self._held.append(_Held(lease, ticket, served))
        if self._task is None or self._task.done():
            self._task = asyncio.ensure_future(self._run())

    async def close(self) -> None:
        """Stop polling and release everything held (shutdown)."""
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        self._release_all()

    def _release_all(self) -> None:
        for held in self._held:
            self._admission.release(held.lease, served=held.served)
        self._held.clear()

    async def _run(self) -> None:
        while self._held:
            await self._clock.sleep(POLL_INTERVAL_S)
            try:
                await self._poll()
            except Exception:  # never strand a reservation: keep polling
                log.exception("backend %s: checking /slots failed", self.name)

    async def _poll(self) -> None:
        try:
            slots = await self._fetch()
        except SlotsUnsupported:
            log.warning(
                "backend %s has no /slots (started with --no-slots?); abandoned requests "
                "keep their reservation for disconnect_grace_s = %g s instead of until "
                "their slot is seen free", self.name, self._grace_s,
            )
            self.supported = False
            self._held, held = [], self._held
            for h in held:
                self._admission.release_later(h.lease, self._grace_s, served=h.served)
            return
        except UpstreamUnavailable:
            log.info("backend %s is unreachable; its abandoned requests are gone", self.name)
            self._release_all()
            return
        except GatewayError as exc:
            log.debug("backend %s: /slots failed: %s", self.name, exc.message)
            slots = None
        now = self._clock.now()
        for held in list(self._held):
            seen = where_is(held.ticket, slots) if slots is not None else Seen.unseen
            late = now - held.ticket.since >= self._unseen_timeout_s
            if seen is Seen.finished or (seen is Seen.unseen and late):
                if seen is Seen.unseen:
                    log.warning(
                        "backend %s: an abandoned request (slot %s) never showed in /slots "
                        "within %g s; releasing its reservation", self.name,
                        held.ticket.slot, self._unseen_timeout_s,
                    )
                self._held.remove(held)
                self._admission.release(held.lease, served=held.served)
