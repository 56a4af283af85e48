"""One backend at run time: the aggregate of its parts, and its discovery loop.

A :class:`Target` holds, as documented public parts:

* ``target.dialect``: the kind-specific :class:`~gateway.backends.base.Dialect`
  (endpoints, counting, the body forwarded, errors read);
* ``target.admission``: its :class:`~gateway.admission.admission.Admission` (queue,
  leases, layout);
* ``target.health``: its :class:`~gateway.core.health.Health` (failures and backoff);
* ``target.pool``: its :class:`~gateway.core.pool_model.PoolModel` (the pool penalty);
* ``target.discovery``: its :class:`~gateway.backends.discovery.DiscoveryLoop` (when
  the capacity is read);
* ``target.sizing``: its :class:`~gateway.backends.sizing.Sizing` (the layout kept from
  settings, discovery and the pool penalty);
* ``target.slot_watch``, ``target.counts`` and ``target.lengths``;
* ``target.router``: its :class:`~gateway.backends.base.RouterRole` in a server of many
  models (llama-server's router mode): ``router.hub`` when the target is a router's hub
  (serving nothing itself), ``router.parent`` when it is the member target of one of its
  models; what its discoveries become is the fleet's (:mod:`gateway.fleet.routers`).

Callers use those parts directly (``target.admission.admit(...)``,
``target.dialect.pin(...)``, ``target.health.request_served()``,
``target.slot_watch.hold(...)``, ``target.lengths.predict(...)``): a method here adds
something of the target's own (its clock, its settings, its URL, rediscovery), never only
passes a call on.
"""

from __future__ import annotations

import logging
from dataclasses import replace
from functools import partial
from typing import Any

import httpx

from gateway.admission.admission import Admission
from gateway.admission.grantor import Grantor
from gateway.admission.lease import AdmissionStats, Lease
from gateway.admission.shared_marks import BackendMarks, Values, with_values
from gateway.admission.slotwatch import SlotWatch
from gateway.admission.state import LOCAL_STATE, StateStore
from gateway.backends import Dialect, Discovered, SideCalls, kind_class
from gateway.backends.base import RouterRole
from gateway.backends.countcache import CountCache
from gateway.backends.discovery import RETRY_DISCOVERY_S, DiscoveryLoop
from gateway.backends.once import OnceAtATime
from gateway.backends.sizing import Sizing, limits
from gateway.clock import Clock, MonotonicClock
from gateway.config import AdmissionPolicy, AdmissionSettings, BackendSettings
from gateway.core.capacity import Charge, Layout
from gateway.core.health import Health
from gateway.core.pool_model import (
    OVERFLOW_BURST_S,
    PENALTY_RECOVERY_S,
    PoolModel,
)
from gateway.core.predict import CompletionLengths
from gateway.core.prefix import Prefix
from gateway.core.slots import PromptIndex
from gateway.errors import GatewayError, InvalidRequest, UpstreamError, UpstreamUnavailable
from gateway.wire.naming import served_name
from gateway.wire.validation import ParsedRequest

__all__ = ["OVERFLOW_BURST_S", "PENALTY_RECOVERY_S", "PREEMPTION_WATCH_S",
           "RETRY_DISCOVERY_S", "Target", "upstream_body"]

log = logging.getLogger(__name__)

#: Said when nothing answers on llama-server's default port, old or announced: b11434
#: prints "server default port will be changed to :9931 in a future release" (llama.cpp
#: PR #26508).
_PORT_HINT = (" (llama-server listens on port 8080 by default; newer builds will listen "
              "on 9931: backends[].url must name the port it prints at start)")

PREEMPTION_WATCH_S = 5.0  # discovery interval at most, where the server counts preemptions


def _admission(settings: AdmissionSettings, layout: Layout | None, clock: Clock, *,
               predictive: bool, grantor: Grantor) -> Admission:
    """A backend's admission with the queue bounds and policy of ``[admission]``."""
    admission = Admission(
        layout,
        max_queue=settings.max_queue,
        max_wait_s=settings.max_queue_wait_s,
        clock=clock,
        reject_doomed=settings.reject_predicted_timeouts,
        predictive=predictive,
        preempt_margin_tokens=settings.preempt_margin_tokens,
        age_s=settings.priority_age_s,
        grantor=grantor,
    )
    admission.slo.defer.defer_s = settings.prefill_defer_s
    return admission


class Target:
    """A configured backend.

    :param settings: the ``[[backends]]`` entry.
    :param admission_settings: queue bounds shared by all backends.
    :param side_client: client for discovery, counting and ``/slots`` calls.
    :param clock: time source for admission, discovery and the slot watch.
    :param dialect: the kind's dialect; built from ``settings.kind`` when omitted.
    :param client: client for the forwarded requests (``side_client`` when omitted).
    :param store: where admission state lives (its grantor and marks come from there):
        a :class:`~gateway.admission.state.StateStore`, this process's memory by default.

    Its public parts, which callers use directly:

    :ivar dialect: the kind's :class:`~gateway.backends.base.Dialect` (route paths,
        counting, the body forwarded, errors read, capabilities as class variables).
    :ivar admission: its :class:`~gateway.admission.admission.Admission` (queue, leases,
        layout, live accounting; listeners woken when room frees).
    :ivar health: its :class:`~gateway.core.health.Health` (failures in a row, backoff);
        with shared state a :class:`~gateway.admission.shared_marks.SharedHealth`, kept
        in step with every gateway process by ``marks`` (``None`` without).
    :ivar pool: its :class:`~gateway.core.pool_model.PoolModel` (the pool penalty and the
        preemptions counted).
    :ivar slot_watch: the :class:`~gateway.admission.slotwatch.SlotWatch` holding the
        leases of abandoned requests until the server shows they ended.
    :ivar counts: exact prompt counts already answered
        (:class:`~gateway.backends.countcache.CountCache`).
    :ivar lengths: served completion lengths, for the predictive policy
        (:class:`~gateway.core.predict.CompletionLengths`).
    :ivar discovery: its :class:`~gateway.backends.discovery.DiscoveryLoop` (when
        :meth:`discover` runs: ``discovery.run()`` forever, ``discovery.request()`` soon).
    :ivar sizing: the :class:`~gateway.backends.sizing.Sizing` that keeps the admission
        layout from the settings, discovery and the pool penalty.
    """

    def __init__(
        self,
        settings: BackendSettings,
        admission_settings: AdmissionSettings,
        side_client: httpx.AsyncClient,
        clock: Clock | None = None,
        dialect: Dialect | None = None,
        client: httpx.AsyncClient | None = None,
        store: StateStore = LOCAL_STATE,
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
        self.fallbacks: tuple[str, ...] = ()  # what this build lacks (gateway.wire.builds)
        # The pool penalty learnt from overflows and preemptions, and the layout it gives.
        self.pool = PoolModel()
        # Health as routing sees it (gateway/fleet/pool.py): after a failed request the
        # backend is skipped until ``health.down_until``; the next request after that is
        # the half-open probe, and a success brings it back. Shared, as the layout
        # discovered, by every gateway process with [state] backend = "redis".
        self.marks = _marks(self, store)
        self.health: Health = Health() if self.marks is None else self.marks.health
        # The prompt each slot last held, for slot affinity (gateway.core.slots).
        self._prompts = PromptIndex()
        self.draining = False  # takes no new requests; those in flight finish
        self.pausing, self.router = 0, RouterRole()  # refused ones pausing; router mode role
        self.owned_clients: list[httpx.AsyncClient] = []  # closed when it is retired
        # The predictive policy needs a server whose answers the gateway can cancel and
        # continue (llama-server); other kinds are charged as under strict.
        self._predictive = (admission_settings.policy is AdmissionPolicy.predictive
                            and bool(self.dialect.resumable_routes))
        # Exact counts answered, reused for the same prompt (none for a kind that estimates)
        self.counts = CountCache(admission_settings.count_cache_entries
                                 if self.dialect.counts_exactly else 0)
        self.counting: OnceAtATime[int | None] = OnceAtATime()  # counts being asked
        self.lengths = CompletionLengths(admission_settings.predict_quantile,
                                         admission_settings.predict_min_history)
        self.admission = _admission(admission_settings,
                                    self.pool.layout(limits(settings, self.dialect), None),
                                    self.clock, predictive=self._predictive,
                                    grantor=store.grantor(self.name, settings.url, self.clock))
        self.slot_watch = SlotWatch(
            self.name, self.dialect.read_slots, self.admission, self.clock,
            unseen_timeout_s=admission_settings.abandon_confirm_timeout_s,
            fallback_grace_s=admission_settings.disconnect_grace_s,
        )
        self.discovery = DiscoveryLoop(self.name, self.discover,
                                       partial(_next_discovery_s, self), self.clock)
        self.sizing = Sizing(self.name, settings, self.dialect, self.pool, self.admission,
                             self.slot_watch, self.clock, self.counts)

    # -- addressing --------------------------------------------------------------------

    @property
    def timeout(self) -> httpx.Timeout:
        """Per-request timeout: connect, and longest silence while reading (seconds)."""
        return httpx.Timeout(self.settings.read_timeout_s, connect=self.settings.connect_timeout_s)

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
        """The model, its name in answers (:func:`gateway.wire.naming.served_name`) and
        its aliases: every name that reaches this backend's model."""
        return frozenset((self.model, served_name(self.model), *self.settings.aliases))

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
        layout settings apply from now on, the layout at the next discovery (asked for now)."""
        self.settings = entry
        self.dialect.settings = entry
        self.sizing.configure(entry)
        self.counts.clear()
        side = getattr(self.dialect, "side", None)
        if isinstance(side, SideCalls):
            side.configure(entry)
        self.discovery.request()

    def set_draining(self, draining: bool) -> None:
        """Stop (or start again) giving this backend new requests; those it holds
        finish either way."""
        self.draining = draining
        self.admission.notify()  # a model queue may start its waiters elsewhere, or here

    def probe_started(self, now: float) -> None:
        """A request was sent here. After failures (half-open), it is the probe: others skip
        this backend until it succeeds or fails, or for the connect timeout (and a second)."""
        self.health.probe_started(now, self.settings.connect_timeout_s + 1.0)

    # -- state -------------------------------------------------------------------------

    @property
    def ready(self) -> bool:
        """True once it answered and its layout is known (a router's hub: once it answered)."""
        return self.reachable and (self.router.hub is not None or self.admission.layout is not None)

    @property
    def predictive(self) -> bool:
        """Requests on this backend are charged predicted lengths, followed live and
        preempted before the pool overflows: the ``predictive`` policy, on a kind that
        can continue answers, with a unified pool."""
        layout = self.admission.layout
        return self._predictive and layout is not None and layout.unified

    def stats(self) -> AdmissionStats:
        """Queue, reservation and slot-watch figures, for metrics."""
        return replace(self.admission.stats(), abandoned_held=self.slot_watch.waiting,
                       preemptions=self.pool.preemptions_seen, up=self.up)

    # -- admission ---------------------------------------------------------------------

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

    # -- requests ----------------------------------------------------------------------

    async def count_prompt(self, route: str, body: dict[str, Any]) -> int | None:
        """Prompt tokens as the backend counts them (under the model id it serves), or
        ``None`` to estimate.

        :raises GatewayError: as the dialect's ``count_prompt``; an unreachable backend is
            also marked down and re-discovered, so the next requests get 503 at once."""
        try:
            return await self.dialect.count_prompt(route, upstream_body(self, body))
        except GatewayError as exc:
            if exc.upstream_kind == "connect":
                self.reachable = False
                self.discovery.request()
            raise

    def prepare(self, req: ParsedRequest, charge: Charge
                ) -> tuple[dict[str, Any], tuple[str, int] | None]:
        """The body to forward and the tag that identifies it upstream."""
        body = self.dialect.prepare_body(req, charge)
        return body, self.dialect.tag_request(body)

    def translate_error(self, status: int, body: bytes, retry_after: str | None
                        ) -> GatewayError | None:
        """An upstream error answer as a gateway error (see the dialect); its
        ``upstream_kind`` (``None``: not a failure of the backend) is the one place its
        classification is kept."""
        return self.dialect.translate_error(status, body, retry_after,
                                            retry_after_s=self.admission.retry_after_s())

    # -- discovery ---------------------------------------------------------------------

    async def discover(self) -> Layout | None:
        """Read the backend's capacity and update the admission layout. A failure is
        kept in :attr:`problem` for the 503 that requests get meanwhile.

        :returns: the layout in force afterwards (``None`` while unknown).
        :raises GatewayError: as the dialect's ``discover``.
        """
        try:  # many models (a llama-server router): the fleet's hub, None here
            found = await self.router.settle(self, await self.dialect.discover())
            if found is not None and not self.reachable:
                await _survey(self)
        except GatewayError as failed:
            hinted, self.reachable = _hinted(failed, self.settings.url), False
            self.problem = hinted.message
            if hinted is failed:
                raise
            raise hinted from failed
        if found is None:
            return None
        was_reachable, self.reachable, self.problem = self.reachable, True, None
        if self.marks is not None:  # the newest layout any gateway process published
            found = await self.marks.layout.agree(found)
        return await _take_calibrated(self, found, fresh=not was_reachable)

    def take(self, found: Discovered, *, fresh: bool = False) -> Layout | None:
        """Use ``found``, a discovery's answer (``fresh``: the first since the backend
        was unreachable): :meth:`Sizing.take <gateway.backends.sizing.Sizing.take>`."""
        layout = self.sizing.take(self.discovered, found, fresh=fresh)
        self.discovered = found
        return layout

    def upstream_failed(self, kind: str, *, live_tokens: int | None = None) -> None:
        """React to an upstream failure of ``kind`` (a gateway_upstream_errors_total kind):
        re-read capacity; after a context overflow, also shrink the unified pool model.

        :param live_tokens: the cells the gateway's requests held when the overflow was
            reported (live accounting), when known.
        """
        if kind == "context_overflow":
            self.sizing.shrink(self.discovered, live_tokens, burst=True)
        self.discovery.request()

    async def close(self) -> None:
        """Stop background work and release what the slot watch holds (shutdown)."""
        await self.discovery.close()
        await self.slot_watch.close()
        if self.marks is not None:
            self.marks.detach()


def _next_discovery_s(target: Target, found: Layout | None) -> float:
    """Seconds to ``target``'s next discovery: ``discovery_interval_s``, at most
    :data:`PREEMPTION_WATCH_S` where the server counts its preemptions."""
    delay = target.settings.discovery_interval_s
    if found is not None and target.discovered and target.discovered.preemptions is not None:
        delay = min(delay, PREEMPTION_WATCH_S)
    return delay


def _hinted(exc: GatewayError, url: str) -> GatewayError:
    """``exc``; or, when nothing answers on one of llama-server's default ports (8080,
    or 9931 as announced), a copy that says the other exists."""
    if isinstance(exc, UpstreamUnavailable) and httpx.URL(url).port in (8080, 9931):
        return UpstreamUnavailable(exc.message + _PORT_HINT)
    return exc


async def _survey(target: Target) -> None:
    """Ask ``target``'s dialect what this build lacks (:meth:`Dialect.survey
    <gateway.backends.base.Dialect.survey>`), at the first discovery of a reachable
    server: each fallback is logged once, at warning, and kept in ``target.fallbacks``.

    :raises UpstreamError: the build lacks what the gateway cannot do without.
    """
    report = await target.dialect.survey()
    if report.problem is not None:  # logged by the discovery loop, as not ready
        raise UpstreamError(f"Backend {target.name!r}: {report.problem}.")
    for line in report.fallbacks:
        if line not in target.fallbacks:
            log.warning("backend %s: %s", target.name, line)
    target.fallbacks = report.fallbacks


async def _take_calibrated(target: Target, found: Discovered, *, fresh: bool
                           ) -> Layout | None:
    """:meth:`Target.take` ``found``; at the first discovery of a reachable server
    (``fresh``), first ask its dialect for the decode pace (``backends[].calibrate``;
    :meth:`Dialect.calibrate <gateway.backends.base.Dialect.calibrate>`) and give it to
    the latency model (:attr:`~gateway.admission.slo.SloGuard.calibration_s`): the wait
    prediction of a gateway that has served nothing yet. Before the layout is taken, so
    that a request admitted once the backend is ready finds it. A server seen again after
    it was unreachable (a restart, perhaps another build or model) is asked again.
    Returns the layout in force."""
    if fresh and target.settings.calibrate:  # before the layout: /ready waits for it
        pace = await target.dialect.calibrate()
        if pace is not None:
            log.info("backend %s decodes %.1f ms a token (calibration)", target.name,
                     pace * 1000)
            target.admission.slo.calibration_s = pace
    return target.take(found, fresh=fresh)


def _marks(target: Target, store: StateStore) -> BackendMarks | None:
    """``target``'s health marks and layout as every gateway process shares them
    (:mod:`gateway.admission.shared_marks`), or ``None`` where this process alone keeps
    them (:meth:`gateway.admission.state.StateStore.marks`)."""
    def adopt(values: Values) -> None:  # another process published a newer layout
        if target.discovered is not None:
            target.take(with_values(target.discovered, values))
    return store.marks(target.name, target.settings.url,
                       lambda: target.settings.connect_timeout_s + 1.0,
                       lambda: target.admission.notify(), adopt)


def upstream_body(target: Target, body: dict[str, Any]) -> dict[str, Any]:
    """``body`` with ``model`` set to the id ``target`` serves, when the client named the
    model by the gateway's name or an alias of it: vLLM answers 404 to a name it does not
    serve (its ``/tokenize`` too); or named none, where the server needs one
    (``dialect.needs_model``: Ollama and vLLM answer 404). Other names (a LoRA
    adapter's, say) pass unchanged; the body is not copied when nothing changes.

    :raises InvalidRequest: no model is named, the server needs one, and the backend's
        is not known (an Ollama backend serving whichever model each request names).
    """
    served = target.discovered.model_id if target.discovered is not None else None
    asked = body.get("model")
    if asked is None and target.dialect.needs_model:
        if not target.model_known:
            raise InvalidRequest(
                f"Backend {target.name!r} serves each request the model it names, and "
                "this request names none: set \"model\" (GET /v1/models lists them).",
                param="model")
        return {**body, "model": served or target.model}
    if served and isinstance(asked, str) and asked != served and asked in target.model_names:
        return {**body, "model": served}
    return body
