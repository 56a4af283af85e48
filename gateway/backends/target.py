"""One backend at run time: the aggregate of its parts, and its discovery loop.

A :class:`Target` holds, as documented public parts:

* ``target.dialect``: the kind-specific :class:`~gateway.backends.base.Dialect`
  (endpoints, counting, the body forwarded, errors read);
* ``target.admission``: its :class:`~gateway.admission.admission.Admission` (queue,
  leases, layout);
* ``target.health``: its :class:`~gateway.core.health.Health` (failures and backoff);
* ``target.pool``: its :class:`~gateway.core.pool_model.PoolModel` (the pool penalty);
* ``target.slot_watch``, ``target.counts`` and ``target.lengths``.

Callers use those parts directly; the few methods that only pass a call on remain for
the relay and the request planner until they are moved to the parts.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import replace
from typing import Any

import httpx

from gateway.admission.admission import Admission
from gateway.admission.lease import AdmissionStats, Lease
from gateway.admission.shared import SharedAccount
from gateway.admission.slotwatch import SlotWatch, Ticket
from gateway.backends import Dialect, Discovered, SideCalls, kind_class
from gateway.backends.countcache import CountCache
from gateway.clock import Clock, MonotonicClock
from gateway.config import AdmissionPolicy, AdmissionSettings, BackendSettings
from gateway.core.capacity import Charge, Layout
from gateway.core.fairness import Party
from gateway.core.health import Health
from gateway.core.pool_model import (
    OVERFLOW_BURST_S,
    PENALTY_RECOVERY_S,
    Limits,
    PoolModel,
    describe,
)
from gateway.core.predict import CompletionLengths
from gateway.core.prefix import Prefix
from gateway.core.slots import PromptIndex
from gateway.errors import GatewayError
from gateway.wire.validation import ParsedRequest

__all__ = ["OVERFLOW_BURST_S", "PENALTY_RECOVERY_S", "PREEMPTION_WATCH_S",
           "RETRY_DISCOVERY_S", "Target"]

log = logging.getLogger(__name__)

RETRY_DISCOVERY_S = 1.0  # delay between discovery attempts while the backend is down
PREEMPTION_WATCH_S = 5.0  # discovery interval at most, where the server counts preemptions


class Target:
    """A configured backend.

    :param settings: the ``[[backends]]`` entry.
    :param admission_settings: queue bounds shared by all backends.
    :param side_client: client for discovery, counting and ``/slots`` calls.
    :param clock: time source for admission, discovery and the slot watch.
    :param dialect: the kind's dialect; built from ``settings.kind`` when omitted.
    :param client: client for the forwarded requests (``side_client`` when omitted).

    Its public parts, which callers use directly:

    :ivar dialect: the kind's :class:`~gateway.backends.base.Dialect` (route paths,
        counting, the body forwarded, errors read, capabilities as class variables).
    :ivar admission: its :class:`~gateway.admission.admission.Admission` (queue, leases,
        layout, live accounting; listeners woken when room frees).
    :ivar health: its :class:`~gateway.core.health.Health` (failures in a row, backoff).
    :ivar pool: its :class:`~gateway.core.pool_model.PoolModel` (the pool penalty and the
        preemptions counted).
    :ivar slot_watch: the :class:`~gateway.admission.slotwatch.SlotWatch` holding the
        leases of abandoned requests until the server shows they ended.
    :ivar counts: exact prompt counts already answered
        (:class:`~gateway.backends.countcache.CountCache`).
    :ivar lengths: served completion lengths, for the predictive policy
        (:class:`~gateway.core.predict.CompletionLengths`).
    """

    def __init__(
        self,
        settings: BackendSettings,
        admission_settings: AdmissionSettings,
        side_client: httpx.AsyncClient,
        clock: Clock | None = None,
        dialect: Dialect | None = None,
        client: httpx.AsyncClient | None = None,
        shared: SharedAccount | None = None,
    ) -> None:
        self.settings = settings
        self.client = client or side_client
        # Bounded (SIDE_CONNECTIONS): for calls no lease bounds, as model listings.
        self.side_client = side_client
        self.name = settings.name
        self.kind = settings.kind.value
        self.dialect: Dialect = dialect or kind_class(self.kind)(  # type: ignore[call-arg]
            settings, SideCalls(settings, side_client))
        self.clock = clock or MonotonicClock()
        self.reachable = False
        self.discovered: Discovered | None = None
        self.problem: str | None = None  # why the last discovery failed
        # The pool penalty learnt from overflows and preemptions, and the layout it gives.
        self.pool = PoolModel()
        self._rediscovery: asyncio.Task[None] | None = None
        # Health as routing sees it (gateway/fleet/pool.py): after a failed request the
        # backend is skipped until ``health.down_until``; the next request after that is
        # the half-open probe, and a success brings it back.
        self.health = Health()
        # The prompt each slot last held, for slot affinity (gateway.core.slots).
        self._prompts = PromptIndex()
        self.draining = False  # takes no new requests; those in flight finish
        self.owned_clients: list[httpx.AsyncClient] = []  # closed when it is retired
        # The predictive policy needs a server whose answers the gateway can cancel and
        # continue (llama-server); other kinds are charged as under strict.
        self._predictive = (admission_settings.policy is AdmissionPolicy.predictive
                            and bool(self.dialect.resumable_routes))
        # Exact counts already answered, reused for the same prompt (none are kept for a
        # kind that only estimates).
        self.counts = CountCache(admission_settings.count_cache_entries
                                 if self.dialect.counts_exactly else 0)
        self.lengths = CompletionLengths(admission_settings.predict_quantile,
                                         admission_settings.predict_min_history)
        self.admission = Admission(
            self._configured_layout(None),
            max_queue=admission_settings.max_queue,
            max_wait_s=admission_settings.max_queue_wait_s,
            clock=self.clock,
            reject_doomed=admission_settings.reject_predicted_timeouts,
            predictive=self._predictive,
            preempt_margin_tokens=admission_settings.preempt_margin_tokens,
            age_s=admission_settings.priority_age_s,
            shared=shared,
        )
        self.slot_watch = SlotWatch(
            self.name, self.dialect.read_slots, self.admission, self.clock,
            unseen_timeout_s=admission_settings.abandon_confirm_timeout_s,
            fallback_grace_s=admission_settings.disconnect_grace_s,
        )

    # -- addressing --------------------------------------------------------------------

    @property
    def timeout(self) -> httpx.Timeout:
        """Per-request timeout: connect, and longest silence while reading (seconds)."""
        s = self.settings
        return httpx.Timeout(s.read_timeout_s, connect=s.connect_timeout_s)

    def url(self, path: str) -> str:
        """Absolute upstream URL for ``path``."""
        return self.settings.url + path

    def route_url(self, route: str) -> str:
        """Absolute upstream URL of gateway route ``route`` (``chat``, ``completions``)."""
        return self.url(self.dialect.route_paths[route])

    # -- names and health ---------------------------------------------------------------

    @property
    def model(self) -> str:
        """The model clients name to reach this backend: ``backends[].model``, else the
        id the backend reports, else (until it is known) the backend's name."""
        if self.settings.model is not None:
            return self.settings.model
        if self.discovered is not None and self.discovered.model_id:
            return self.discovered.model_id
        return self.name

    @property
    def model_known(self) -> bool:
        """The model is configured, or the backend has reported it."""
        return self.settings.model is not None or bool(
            self.discovered is not None and self.discovered.model_id)

    @property
    def model_names(self) -> frozenset[str]:
        """Every name that reaches this backend's model: the model and its aliases."""
        return frozenset((self.model, *self.settings.aliases))

    @property
    def up(self) -> bool:
        """Not marked down by a recent failure (see :meth:`request_failed`)."""
        return self.health.usable(self.clock.now())

    def usable(self, now: float) -> bool:
        """New requests may go here at ``now``: ready, not draining, and up (or due a
        probe, :meth:`gateway.core.health.Health.usable`)."""
        return self.ready and not self.draining and self.health.usable(now)

    def request_failed(self, initial_s: float, max_s: float) -> float:
        """A request failed here before any byte reached its client (refused, timed
        out, or a 5xx): skip this backend for ``initial_s`` seconds, doubled for each
        failure in a row, at most ``max_s`` (:meth:`Health.request_failed` at the
        clock's now). Returns the time it is down, seconds."""
        return self.health.request_failed(self.clock.now(), initial_s, max_s)

    def same_server(self, entry: BackendSettings) -> bool:
        """``entry`` describes the server this backend talks to (same URL and kind, and
        connection settings this backend's clients were built with): a reload can apply
        it in place (:meth:`reconfigure`)."""
        old = self.settings
        return (entry.url, entry.kind, entry.keepalive_expiry_s) == (
            old.url, old.kind, old.keepalive_expiry_s)

    def reconfigure(self, entry: BackendSettings) -> None:
        """Take ``entry`` (a reload; :meth:`same_server` is true) without losing the
        reservations, queue, slot map and health of the server: names, timeouts, key and
        layout settings apply from now on, the layout at the next discovery (asked for
        now)."""
        self.settings = entry
        self.dialect.settings = entry  # type: ignore[misc]
        self.counts.clear()
        side = getattr(self.dialect, "side", None)
        if isinstance(side, SideCalls):
            side.configure(entry)
        self.request_rediscovery()

    def set_draining(self, draining: bool) -> None:
        """Stop (or start again) giving this backend new requests; those it holds
        finish either way."""
        self.draining = draining
        self.admission.notify()  # a model queue may start its waiters elsewhere, or here

    def probe_started(self, now: float) -> None:
        """A request was sent here. After failures (half-open), it is the probe: others
        skip this backend until it succeeds or fails, or for the connect timeout (and a
        second)."""
        self.health.probe_started(now, self.settings.connect_timeout_s + 1.0)

    def request_served(self) -> None:
        """A request got an answer from this backend: it is up."""
        self.health.request_served()

    # -- state -------------------------------------------------------------------------

    @property
    def ready(self) -> bool:
        """True once the backend answered and its layout is known."""
        return self.reachable and self.admission.layout is not None

    @property
    def layout(self) -> Layout | None:
        """The layout admissions are checked against."""
        return self.admission.layout

    @property
    def predictive(self) -> bool:
        """Requests on this backend are charged predicted lengths, followed live and
        preempted before the pool overflows: the ``predictive`` policy, on a kind that
        can continue answers, with a unified pool."""
        layout = self.admission.layout
        return self._predictive and layout is not None and layout.unified

    def predicted_output(self, cap: int) -> int | None:
        """Output tokens to charge a tracked request with cap ``cap`` (see
        :class:`gateway.core.predict.CompletionLengths`), or ``None`` to charge the cap."""
        return self.lengths.predict(cap)

    def record_completion(self, tokens: int) -> None:
        """Note a served answer's completion length (tokens per choice)."""
        self.lengths.record(tokens)

    def stats(self) -> AdmissionStats:
        """Queue, reservation and slot-watch figures, for metrics."""
        return replace(self.admission.stats(), abandoned_held=self.slot_watch.waiting,
                       preemptions=self.pool.preemptions_seen, up=self.up)

    # -- admission ---------------------------------------------------------------------

    def check_queue_room(self, party: Party | None = None) -> None:
        """Raise ``QueueFull`` at once when a new request could only queue."""
        self.admission.check_queue_room(party)

    def try_admit(self, charge: Charge, party: Party | None = None,
                  prefer: int | None = None) -> Lease | None:
        """A lease now, or ``None`` (see :meth:`Admission.try_admit`)."""
        return self.admission.try_admit(charge, party=party, prefer=prefer)

    def slot_for(self, prefix: Prefix | None) -> int | None:
        """The free slot whose last prompt this request continues (``prefix`` extends
        it), the longest such if several (the least recently used of equals), or
        ``None``. llama-server keeps each slot's last prompt (``cache_prompt``), so a
        later turn pinned there (``id_slot``) computes only what is new; a slot another
        conversation has used since is not chosen. Looked up by each shorter prefix of
        the request (one dict lookup per message), not by scanning the slots."""
        return self._prompts.slot_for(prefix, self.admission.slots)

    def remember_slot(self, prefix: Prefix | None, lease: Lease) -> None:
        """Note what the slot a pinned ``lease`` holds will have cached: this request's
        prompt (``None``: unknown, so nothing continues there)."""
        if lease.pinned:
            self._prompts.remember(lease.slot_ids[0], prefix)

    async def admit(self, charge: Charge, *, front: bool = False,
                    prefer: int | None = None, party: Party | None = None) -> Lease:
        """Wait for a lease (see :meth:`Admission.admit`)."""
        return await self.admission.admit(charge, front=front, prefer=prefer, party=party)

    def release(self, lease: Lease, *, served: bool) -> None:
        """Give a lease back at once."""
        self.admission.release(lease, served=served)

    def record_duration(self, seconds: float, charge: Charge) -> None:
        """How long a served lease was held (feeds Retry-After estimates)."""
        self.admission.record_duration(seconds, charge)

    def queue_progress(self, charge: Charge) -> tuple[int, float | None] | None:
        """A waiting charge's queue position (1 = next) and predicted seconds to start,
        or ``None`` when it is not waiting."""
        position = self.admission.queue_position(charge)
        if position is None:
            return None
        return position, self.admission.eta_s(charge)

    def release_abandoned(
        self, lease: Lease, ticket: Ticket, *, served: bool,
        pending: asyncio.Task[httpx.Response] | None = None, stream: bool = False,
        launched: bool = False, quick: bool = False,
    ) -> None:
        """Keep ``lease`` until the backend shows the abandoned request ended (see
        :meth:`gateway.admission.slotwatch.SlotWatch.hold`)."""
        self.slot_watch.hold(lease, ticket, served=served, pending=pending, stream=stream,
                             launched=launched, quick=quick)

    # -- requests ----------------------------------------------------------------------

    def check_request(self, req: ParsedRequest) -> None:
        """Refuse what the backend would refuse (see the dialect)."""
        self.dialect.check_request(req)

    async def count_prompt(self, route: str, body: dict[str, Any]) -> int | None:
        """Prompt tokens as the backend counts them, or ``None`` to estimate.

        :raises GatewayError: as the dialect's ``count_prompt``; an unreachable backend is
            also marked down and re-discovered, so the next requests get 503 at once.
        """
        try:
            return await self.dialect.count_prompt(route, body)
        except GatewayError as exc:
            if exc.upstream_kind == "connect":
                self.reachable = False
                self.request_rediscovery()
            raise

    def prepare(self, req: ParsedRequest, charge: Charge
                ) -> tuple[dict[str, Any], tuple[str, int] | None]:
        """The body to forward and the tag that identifies it upstream."""
        body = self.dialect.prepare_body(req, charge)
        return body, self.dialect.tag_request(body)

    def pin(self, body: dict[str, Any], lease: Lease) -> dict[str, Any]:
        """``body`` as sent once admitted on ``lease``."""
        return self.dialect.pin(body, lease)

    def translate_error(self, status: int, body: bytes, retry_after: str | None
                        ) -> GatewayError | None:
        """An upstream error answer as a gateway error (see the dialect); its
        ``upstream_kind`` (``None``: not a failure of the backend) is the one place its
        classification is kept."""
        return self.dialect.translate_error(status, body, retry_after,
                                            retry_after_s=self.admission.retry_after_s())

    def is_overflow_event(self, data: dict[str, Any]) -> bool:
        """True when a streamed error event means the backend ran out of KV cache."""
        return self.dialect.is_overflow_event(data)

    # -- discovery ---------------------------------------------------------------------

    @property
    def limits(self) -> Limits:
        """The configured numbers the layout starts from (``[[backends]]`` and the
        kind's pool sharing and stop margin)."""
        s = self.settings
        return Limits(s.slots, s.ctx_per_slot, s.pool_tokens,
                      unified=s.unified and self.dialect.unified_pool,
                      stop_margin=self.dialect.stop_margin)

    def _configured_layout(self, found: Discovered | None) -> Layout | None:
        """The layout from config and discovery, less the pool penalty
        (:meth:`gateway.core.pool_model.PoolModel.layout`)."""
        return self.pool.layout(self.limits, found)

    async def discover(self) -> Layout | None:
        """Read the backend's capacity and update the admission layout. A failure is
        kept in :attr:`problem` for the 503 that requests get meanwhile.

        :returns: the layout in force afterwards (``None`` while unknown).
        :raises GatewayError: as the dialect's ``discover``.
        """
        try:
            found = await self.dialect.discover()
        except GatewayError as exc:
            self.reachable = False
            self.problem = exc.message
            raise
        was_reachable, self.reachable, self.problem = self.reachable, True, None
        self._warn_disagreement(found)
        restarted = self.discovered is not None and (
            found.slots, found.ctx_per_slot, found.pool_tokens) != (
            self.discovered.slots, self.discovered.ctx_per_slot, self.discovered.pool_tokens)
        if not was_reachable or restarted or self.discovered is None or (
                found.model_id, found.n_vocab, found.fingerprint) != (
                self.discovered.model_id, self.discovered.n_vocab,
                self.discovered.fingerprint):
            # The server may have come back with another model or template: its counts
            # are asked again.
            self.counts.clear()
        if restarted:
            self.pool.restarted()  # what was learnt of the old server is moot
        self._recover_pool()
        self._check_preemptions(found)
        self.discovered = found
        layout = self._configured_layout(found)
        old = self.admission.layout
        if layout != old:
            log.log(logging.WARNING if restarted else logging.INFO,
                    "backend %s layout changed: %s -> %s", self.name, describe(old),
                    describe(layout))
            if restarted:
                # The server reports other values: a restarted server, which runs nothing
                # of the old one. (A pool penalty easing off is not a restart: what the
                # slot watch holds still runs.)
                self.slot_watch.release_all()
            self.admission.set_layout(layout)
        return layout

    async def run_discovery(self) -> None:
        """Discover the capacity forever: every second until known, then every
        ``discovery_interval_s`` (on the injected clock); at least every
        :data:`PREEMPTION_WATCH_S` where the server counts its preemptions."""
        failing = False
        while True:
            try:
                found = await self.discover()
                delay = self.settings.discovery_interval_s
                if found is not None and self.discovered and (
                        self.discovered.preemptions is not None):
                    delay = min(delay, PREEMPTION_WATCH_S)
                if failing:
                    log.info("backend %s is reachable again", self.name)
                failing = False
            except GatewayError as exc:
                log.log(logging.DEBUG if failing else logging.WARNING,
                        "backend %s not ready: %s", self.name, exc.message)
                failing, delay = True, RETRY_DISCOVERY_S
            except Exception:  # never let discovery die
                log.exception("discovery of backend %s failed", self.name)
                delay = RETRY_DISCOVERY_S
            await self.clock.sleep(delay)

    def request_rediscovery(self) -> None:
        """Re-read capacity soon (after an upstream error); at most one read at a time."""
        if self._rediscovery is None or self._rediscovery.done():
            self._rediscovery = asyncio.ensure_future(self._rediscover())

    async def _rediscover(self) -> None:
        """Re-read capacity, every second until the backend answers again."""
        while True:
            try:
                await self.discover()
                return
            except GatewayError as exc:
                log.debug("backend %s re-discovery failed: %s", self.name, exc.message)
            await self.clock.sleep(RETRY_DISCOVERY_S)

    def upstream_failed(self, kind: str, *, live_tokens: int | None = None) -> None:
        """React to an upstream failure of ``kind`` (a gateway_upstream_errors_total kind):
        re-read capacity; after a context overflow, also shrink the unified pool model.

        :param live_tokens: the cells the gateway's requests held when the overflow was
            reported (live accounting), when known.
        """
        if kind == "context_overflow":
            self._shrink_pool(live_tokens, burst=True)
        self.request_rediscovery()

    def _shrink_pool(self, live_tokens: int | None = None, *, burst: bool = False) -> None:
        """The backend overflowed its pool (or preempted): shrink the pool model
        (:meth:`gateway.core.pool_model.PoolModel.shrink`) and apply the smaller layout."""
        layout = self.admission.layout
        if not self.pool.shrink(layout, self.clock.now(), live_tokens, burst=burst):
            return
        assert layout is not None
        smaller = self._configured_layout(self.discovered)
        log.warning("backend %s overflowed its KV pool; pool model %d -> %s tokens", self.name,
                    layout.pool_tokens, smaller.pool_tokens if smaller else None)
        self.admission.set_layout(smaller)

    def _recover_pool(self) -> None:
        """Halve the pool penalty after quiet minutes
        (:meth:`gateway.core.pool_model.PoolModel.recover`)."""
        if self.pool.recover(self.clock.now()):
            log.info("backend %s: no overflow for %.0f s; pool penalty now %d tokens",
                     self.name, PENALTY_RECOVERY_S, self.pool.penalty)

    def _check_preemptions(self, found: Discovered) -> None:
        """A rise in the server's preemption count while the gateway had requests in
        flight means its model of the pool let in more than the server holds (vLLM
        preempts and recomputes rather than failing): counted like an overflow, and the
        pool model shrinks (``shared/cases/public.md`` P10)."""
        stats = self.admission.stats()
        seen = self.pool.preempted(self.discovered.preemptions if self.discovered else None,
                                   found.preemptions, inflight=stats.inflight,
                                   admitted=stats.admitted)
        if seen:
            log.warning("backend %s preempted %d requests while the gateway admitted work; "
                        "its pool model is too large", self.name, seen)
            self._shrink_pool()

    def _warn_disagreement(self, found: Discovered) -> None:
        s = self.settings
        for key, configured, seen in (
            ("slots", s.slots, found.slots),
            ("ctx_per_slot", s.ctx_per_slot, found.ctx_per_slot),
        ):
            if configured is not None and configured != seen and self.discovered != found:
                log.warning(
                    "backend %s: config says %s = %d but the backend reports %d; using %d",
                    self.name, key, configured, seen, min(configured, seen),
                )

    async def close(self) -> None:
        """Stop background work and release what the slot watch holds (shutdown)."""
        if self._rediscovery is not None:
            self._rediscovery.cancel()
            await asyncio.gather(self._rediscovery, return_exceptions=True)
        await self.slot_watch.close()

