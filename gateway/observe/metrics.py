"""Prometheus metrics, all owned by one :class:`GatewayMetrics` built on a given registry.

Gauges of queue depth, leases and KV reservation are read from each backend's
admission stats at scrape time by a collector, so they can never drift from the truth.
"""

from __future__ import annotations

import os
from bisect import bisect_left
from collections.abc import Callable, Iterable, Iterator, Sequence
from enum import StrEnum

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.multiprocess import MultiProcessCollector
from prometheus_client.registry import Collector

from gateway.admission.lease import AdmissionStats
from gateway.errors import RejectionReason, UpstreamKind

__all__ = ["GatewayMetrics", "PreemptionReason", "ResumeOutcome", "observe_all"]

_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)
_ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1.28, 2.5)
_WAIT_ERROR_BUCKETS = (-30, -10, -5, -2, -1, -0.5, -0.1, 0, 0.1, 0.5, 1, 2, 5, 10, 30)
_ERROR_BUCKETS = (-0.5, -0.2, -0.1, -0.05, -0.02, 0, 0.02, 0.05, 0.1, 0.2, 0.3, 0.5, 1.0)
_TOKEN_BUCKETS = (
    16, 64, 128, 256, 384, 512, 768, 1024, 1536, 2048, 3072, 4096, 6144, 8192, 12288, 16384,
    24576, 32768, 49152, 65536, 131072,
)

StatsSource = Callable[[], Iterable[tuple[str, AdmissionStats, bool]]]
# (model, requests waiting, max_queue, oldest wait in seconds) per shared pool queue.
PoolSource = Callable[[], Iterable[tuple[str, int, int, float]]]
# (member backend, model state, held, holds placed, learned load s or None) per model of
# a llama-server router (gateway.backends.router).
RouterSource = Callable[[], Iterable[tuple[str, str, bool, int, float | None]]]
#: The states of a router's model (status.value of its GET /models, "failed" for a load
#: that failed), each with its series of gateway_router_model_state.
ROUTER_STATES = ("unloaded", "loading", "loaded", "sleeping", "failed")


#: The gauges read from each backend's AdmissionStats at scrape time, labelled
#: ``backend``: name suffix -> (help, value).
_BACKEND_GAUGES: dict[str, tuple[str, Callable[[AdmissionStats], float]]] = {
    "queue_depth": ("Requests waiting in the admission queue.", lambda s: s.queued),
    "queue_capacity": ("Requests the admission queue holds at most "
                       "(admission.max_queue).", lambda s: s.queue_capacity),
    "queue_oldest_wait_seconds": ("How long the request waiting longest in the "
                                  "admission queue has waited so far.",
                                  lambda s: s.oldest_wait_s),
    "inflight_requests": ("Requests holding a lease (forwarded).", lambda s: s.inflight),
    "kv_reserved_tokens": (
        "KV tokens reserved by requests in flight (prompt + output cap, or under "
        "the predictive policy prompt + predicted output).",
        lambda s: s.reserved_tokens,
    ),
    "kv_live_tokens": (
        "KV tokens the requests in flight hold now: prompt + tokens generated so "
        "far for those followed live (predictive policy), the reservation for "
        "the others.",
        lambda s: s.live_tokens,
    ),
    "kv_capacity_tokens": (
        "KV tokens the backend can hold: the unified pool, or slots x ctx_per_slot.",
        lambda s: s.capacity_tokens,
    ),
    "slots": ("Slots of the backend (was gateway_slots_total, a gauge with a "
              "counter's suffix).", lambda s: s.slots),
    "slots_busy": ("Slots held by requests in flight.", lambda s: s.busy_slots),
    "backend_ctx_per_slot": ("Context of one slot, tokens.", lambda s: s.ctx_per_slot),
    "abandoned_reservations": (
        "Reservations of abandoned requests held until /slots shows them ended.",
        lambda s: s.abandoned_held,
    ),
}


def _slo_families(rows: list[tuple[str, AdmissionStats, bool]]) -> Iterator[Metric]:
    """Each backend's latency model and SLO limit (:mod:`gateway.admission.slo`)."""
    limit = GaugeMetricFamily(
        "gateway_slo_limit", "Sequences admitted at once under the latency targets: the SLO "
        "limit while it binds, else the memory limit (slots, or a learnt busy cap); absent "
        "before the layout is known.",
        labels=["backend"])
    target = GaugeMetricFamily(
        "gateway_slo_itl_target_seconds", "The tightest ITL p95 target of the requests in "
        "flight (absent when none has one).", labels=["backend"])
    p95 = GaugeMetricFamily(
        "gateway_latency_itl_p95_seconds", "Learned ITL p95 with `level` slots busy (absent "
        "until the level has its minimum of samples).", labels=["backend", "level"])
    samples = GaugeMetricFamily(
        "gateway_latency_itl_samples", "ITL samples learned with `level` slots busy "
        "(since the level was last cleared by a probe).", labels=["backend", "level"])
    prefill = GaugeMetricFamily(
        "gateway_latency_prefill_tokens_per_second", "Learned prefill throughput, prompt "
        "tokens per second (absent until learned).", labels=["backend"])
    deferred = CounterMetricFamily(
        "gateway_prefill_deferred", "Requests this backend held back because their prefill "
        "would have stalled its streams with an ITL target (admission.prefill_defer_s); in "
        "a pool, also those it sent to another backend so.", labels=["backend"])
    for name, stats, _ready in rows:
        slo = stats.slo
        if slo is None:
            continue
        if (in_force := slo.in_force(stats.slots)) is not None:  # (none before a layout)
            limit.add_metric([name], float(in_force))
        if (tightest := slo.target()) is not None:
            target.add_metric([name], tightest)
        for row in slo.model.table():
            samples.add_metric([name, str(row.level)], float(row.samples))
        for level, p95_s in slo.learned_p95().items():
            p95.add_metric([name, str(level)], p95_s)
        if (tps := slo.model.prefill_tps()) is not None:
            prefill.add_metric([name], tps)
        deferred.add_metric([name], float(slo.defer.deferred))
    yield from (limit, target, p95, samples, prefill, deferred)


class _AdmissionCollector(Collector):
    def __init__(self, source: StatsSource, pools: PoolSource | None = None) -> None:
        self._source = source
        self._pools = pools

    def collect(self) -> Iterator[Metric]:
        rows = list(self._source())
        for suffix, (doc, get) in _BACKEND_GAUGES.items():
            fam = GaugeMetricFamily(f"gateway_{suffix}", doc, labels=["backend"])
            for name, stats, _ready in rows:
                fam.add_metric([name], float(get(stats)))
            yield fam
        ready = GaugeMetricFamily(
            "gateway_backend_ready", "1 when the backend is reachable and its capacity known.",
            labels=["backend"],
        )
        for name, _stats, is_ready in rows:
            ready.add_metric([name], 1.0 if is_ready else 0.0)
        yield ready
        up = GaugeMetricFamily(
            "gateway_backend_up", "1 when the backend is ready and not marked down after "
            "a failed request (it takes new requests unless draining).",
            labels=["backend"],
        )
        for name, stats, is_ready in rows:
            up.add_metric([name], 1.0 if is_ready and stats.up else 0.0)
        yield up
        changes = CounterMetricFamily(
            "gateway_backend_layout_changes",
            "Times re-discovery found a different slot/KV layout on the backend.",
            labels=["backend"],
        )
        for name, stats, _ready in rows:
            changes.add_metric([name], float(stats.layout_changes))
        yield changes
        preempted = CounterMetricFamily(
            "gateway_backend_preemptions",
            "Requests the backend preempted (vLLM vllm:num_preemptions_total) while the "
            "gateway had work admitted; each rise shrinks the pool model.",
            labels=["backend"],
        )
        for name, stats, _ready in rows:
            preempted.add_metric([name], float(stats.preemptions))
        yield preempted
        yield from _slo_families(rows)
        yield from self._pool_families()

    def _pool_families(self) -> Iterator[Metric]:
        """The shared queues of models served by several backends (gateway.fleet.pool): their
        requests wait there, not in a backend's queue."""
        pools = list(self._pools()) if self._pools is not None else []
        for suffix, doc, index in (
            ("depth", "Requests waiting in the shared queue of a pool of backends.", 1),
            ("capacity", "Requests the pool's shared queue holds at most "
                         "(admission.max_queue).", 2),
            ("oldest_wait_seconds", "How long the request waiting longest in the pool's "
                                    "shared queue has waited so far.", 3),
        ):
            fam = GaugeMetricFamily(f"gateway_pool_queue_{suffix}", doc, labels=["model"])
            for row in pools:
                fam.add_metric([row[0]], float(row[index]))
            yield fam


class _RouterCollector(Collector):
    """The models of llama-server routers, read at scrape time (``backend`` is the
    model's member backend, ``<router>/<model>``)."""

    def __init__(self, source: RouterSource) -> None:
        self._source = source

    def collect(self) -> Iterator[Metric]:
        rows = list(self._source())
        state = GaugeMetricFamily(
            "gateway_router_model_state", "1 for the state a llama-server router shows "
            "for the model (GET /models status.value; failed: its last load failed).",
            labels=["backend", "state"])
        held = GaugeMetricFamily(
            "gateway_router_model_held", "1 while the model takes no new request so that "
            "the router can unload it for another model waiting to load (--models-max "
            "reached, every loaded model busy).", labels=["backend"])
        holds = CounterMetricFamily(
            "gateway_router_holds", "Times the model was held for another model's load "
            "(a load that had to unload a model with requests in flight or queued).",
            labels=["backend"])
        load = GaugeMetricFamily(
            "gateway_router_model_load_seconds", "The model's learned load time (its "
            "loading to loaded in the router's /models).", labels=["backend"])
        for name, now, is_held, placed, load_s in rows:
            for value in ROUTER_STATES:
                state.add_metric([name, value], 1.0 if now == value else 0.0)
            held.add_metric([name], 1.0 if is_held else 0.0)
            holds.add_metric([name], float(placed))
            if load_s is not None:
                load.add_metric([name], load_s)
        yield from (state, held, holds, load)


class _StateCollector(Collector):
    """``gateway_state_up``, read at scrape time."""

    def __init__(self, up: Callable[[], bool]) -> None:
        self._up = up

    def collect(self) -> Iterator[Metric]:
        family = GaugeMetricFamily(
            "gateway_state_up", "1 when the shared admission state (Redis) answered its "
            "last call; 0 while it cannot be reached (requests get 503 state_unavailable).")
        family.add_metric([], 1.0 if self._up() else 0.0)
        yield family


class PreemptionReason(StrEnum):
    """The ``reason`` of ``gateway_preemptions_total``."""

    pool_pressure = "pool_pressure"  # before the pool would overflow (predictive policy)
    overflow = "overflow"  # after the backend reported an overflow


class ResumeOutcome(StrEnum):
    """The ``outcome`` of ``gateway_resumes_total``: what became of a preempted stream."""

    continued = "continued"  # it went on where it stopped
    restarted = "restarted"  # it was sent again from its head
    failed = "failed"  # it could not be continued
    client_gone = "client_gone"  # its client left meanwhile


#: The rejection reasons given a zero series per backend and party (GatewayMetrics.prime,
#: which primes every member of UpstreamKind, PreemptionReason and ResumeOutcome too).
QUEUE_REJECTIONS = (RejectionReason.queue_full, RejectionReason.queue_timeout,
                    RejectionReason.queue_wait_predicted)


def observe_all(histogram: Histogram, amounts: Sequence[float]) -> None:
    """Observe each of ``amounts`` in ``histogram`` (one labelled child), as its
    ``observe`` would one by one, in one pass: each bucket touched and the sum are
    incremented once, where ``observe`` takes two locks a sample (about 1.5 us; the SSE
    relay observes every token's gap, issue 37). Works on the child's values, which are
    prometheus_client's multiprocess-aware ones under ``gateway serve --workers N`` too;
    a histogram without them (another version's layout) is observed one by one.
    """
    bounds = getattr(histogram, "_upper_bounds", None)
    buckets = getattr(histogram, "_buckets", None)
    total = getattr(histogram, "_sum", None)
    if bounds is None or buckets is None or total is None or len(bounds) != len(buckets):
        for amount in amounts:
            histogram.observe(amount)
        return
    counts = [0] * len(bounds)
    for amount in amounts:  # the first bucket whose bound is at least the amount
        counts[bisect_left(bounds, amount)] += 1
    for bucket, count in zip(buckets, counts, strict=True):
        if count:
            bucket.inc(count)
    total.inc(sum(amounts))


class GatewayMetrics:
    """Every metric of the gateway, registered on ``registry``.

    :param registry: where to register (tests pass a fresh ``CollectorRegistry``).
    :param stats_source: returns ``(backend name, AdmissionStats, ready)`` per backend,
        read at scrape time.
    :param pool_source: returns ``(model, waiting, max_queue, oldest wait s)`` per shared
        pool queue, read at scrape time.
    :param state_up: with shared admission state (``[state] backend = "redis"``), returns
        whether the store answered its last call (``gateway_state_up``); ``None``: the
        state is this process's own and the state metrics are not exported.
    :param router_source: returns each llama-server router model's (member backend,
        state, held, holds placed, learned load seconds), read at scrape time.
    :raises ValueError: a metric name is already registered on ``registry``.
    """

    def __init__(self, registry: CollectorRegistry, stats_source: StatsSource,
                 pool_source: PoolSource | None = None,
                 state_up: Callable[[], bool] | None = None,
                 router_source: RouterSource | None = None) -> None:
        self.registry = registry
        # Read at scrape time from this process (gauges of the admission state).
        self._live: list[Collector] = [_AdmissionCollector(stats_source, pool_source)]
        if router_source is not None:
            self._live.append(_RouterCollector(router_source))
        self._scrape: CollectorRegistry | None = None
        self._register_state(registry, state_up)
        self._register_answers(registry)
        self._register_timings(registry)
        self._register_tokens(registry)
        self._register_scheduling(registry)
        for collector in self._live:
            registry.register(collector)

    def _register_state(self, registry: CollectorRegistry,
                        state_up: Callable[[], bool] | None) -> None:
        """The shared state's calls, latency and expiries, and its ``gateway_state_up``
        collector (only with ``state_up``; else the attributes are ``None``)."""
        self.state_ops: Counter | None = None
        self.state_latency: Histogram | None = None
        self.state_expiries: Counter | None = None
        if state_up is None:
            return
        self.state_ops = Counter(
            "gateway_state_ops", "Calls to the shared admission state (Redis), by op "
            "(grant, renew, release, close, tenant, live, health, layout, ...) and "
            "outcome (ok, error).",
            ["op", "outcome"], registry=registry)
        self.state_latency = Histogram(
            "gateway_state_latency_seconds", "Time of one call to the shared admission "
            "state, seconds.", ["op"], registry=registry,
            buckets=(0.0005, 0.001, 0.002, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1.0))
        self.state_expiries = Counter(
            "gateway_state_lease_expiries", "Leases and queued requests of other "
            "gateway processes dropped because their owner stopped renewing (died): "
            "reason owner_lost; renewed_late when this process renewed too late and "
            "found its own leases taken for dead.", ["reason"], registry=registry)
        self.state_expiries.labels("owner_lost")
        self.state_expiries.labels("renewed_late")
        for op in ("grant", "renew", "release"):
            for outcome in ("ok", "error"):
                self.state_ops.labels(op, outcome)
        self._live.append(_StateCollector(state_up))

    def _register_answers(self, registry: CollectorRegistry) -> None:
        """What became of requests: statuses, the gateway's own answers, backend
        failures, where counts came from, max_tokens defaults and clamps."""
        self.requests = Counter(
            "gateway_requests", "Requests answered, by final HTTP status (tenant and "
            "priority \"none\" before they are known, as for a 401).",
            ["backend", "route", "code", "tenant", "priority"], registry=registry,
        )
        self.rejections = Counter(
            "gateway_rejections", "Requests the gateway answered itself without forwarding.",
            ["backend", "reason", "tenant", "priority"], registry=registry,
        )
        self.upstream_errors = Counter(
            "gateway_upstream_errors", "Failures of the backend, by kind.",
            ["backend", "kind"], registry=registry,
        )
        self.token_count_source = Counter(
            "gateway_token_count_source",
            "Where prompt counts came from: backend (exact), cache (exact, kept from an "
            "earlier count of the same prompt) or estimate.",
            ["backend", "source"], registry=registry,
        )
        self.default_max_tokens_applied = Counter(
            "gateway_default_max_tokens_applied",
            "Requests without max_tokens that were charged the configured default.",
            ["backend"], registry=registry,
        )
        self.max_tokens_clamped = Counter(
            "gateway_max_tokens_clamped", "Requests whose max_tokens was lowered to fit a slot.",
            ["backend"], registry=registry,
        )
        self.client_retries = Counter(
            "gateway_client_retries",
            "Requests that clients marked as retries (x-stainless-retry-count > 0).",
            ["attempt"], registry=registry,
        )

    def _register_timings(self, registry: CollectorRegistry) -> None:
        """Waits and latencies, seconds."""
        self.queue_wait = Histogram(
            "gateway_queue_wait_seconds", "Time from arrival to admission (a tenant's "
            "gate included).",
            ["backend", "tenant", "priority"], buckets=_LATENCY_BUCKETS, registry=registry,
        )
        self.queue_wait_prediction_error = Histogram(
            "gateway_queue_wait_prediction_error_seconds",
            "Real queue wait minus the wait predicted at arrival, for requests that queued "
            "(positive: waited longer than predicted).",
            ["backend"], buckets=_WAIT_ERROR_BUCKETS, registry=registry,
        )
        self.ttft = Histogram(
            "gateway_ttft_seconds", "Time from arrival to the first generated token.",
            ["backend"], buckets=_LATENCY_BUCKETS, registry=registry,
        )
        self.itl = Histogram(
            "gateway_itl_seconds", "Time between generated tokens of a stream.",
            ["backend"], buckets=_ITL_BUCKETS, registry=registry,
        )
        self.slo_requests = Counter(
            "gateway_slo_requests", "Streamed requests of a class with a latency target, by "
            "whether they met it: target ttft (the first token by the request's deadline or "
            "the class's ttft_p95_s) or itl (at most 5% of its gaps over itl_p95_s, i.e. "
            "its own ITL p95 within the target); outcome met or missed.",
            ["backend", "priority", "target", "outcome"], registry=registry,
        )
        self.duration = Histogram(
            "gateway_request_duration_seconds", "Time from arrival to the end of the response.",
            ["backend"], buckets=_LATENCY_BUCKETS, registry=registry,
        )

    def _register_tokens(self, registry: CollectorRegistry) -> None:
        """Tokens per request and per tenant, and the quality of the prompt estimates."""
        self.prompt_tokens = Histogram(
            "gateway_prompt_tokens", "Prompt tokens per request (backend usage when given).",
            ["backend", "tenant", "priority"], buckets=_TOKEN_BUCKETS, registry=registry,
        )
        self.completion_tokens = Histogram(
            "gateway_completion_tokens", "Completion tokens per request (backend usage).",
            ["backend", "tenant", "priority"], buckets=_TOKEN_BUCKETS, registry=registry,
        )
        self.request_tokens = Histogram(
            "gateway_request_tokens",
            "KV tokens a request really used: prompt + completion (backend usage).",
            ["backend", "tenant", "priority"], buckets=_TOKEN_BUCKETS, registry=registry,
        )
        self.estimate_error = Histogram(
            "gateway_prompt_estimate_error_ratio",
            "Relative error of a local prompt estimate against the backend's count: "
            "(charged - reported) / reported; negative means under-counted.",
            ["backend"], buckets=_ERROR_BUCKETS, registry=registry,
        )
        self.suspected_truncations = Counter(
            "gateway_suspected_truncations",
            "Requests whose reported prompt count was under half the gateway's estimate "
            "(the backend probably dropped part of the prompt).",
            ["backend"], registry=registry,
        )
        self.tenant_tokens = Counter(
            "gateway_tenant_tokens",
            "Tokens served per tenant, as its tokens_per_minute counts them: kind=prompt "
            "(the gateway's count) or completion (the backend's usage).",
            ["tenant", "kind"], registry=registry,
        )

    def _register_scheduling(self, registry: CollectorRegistry) -> None:
        """Preemptions, resumes, routing decisions and failovers."""
        self.preemptions = Counter(
            "gateway_preemptions",
            "Requests the gateway cut short to resume later (predictive policy): "
            "reason=pool_pressure before the pool would overflow, reason=overflow after "
            "the backend ran out of KV cells.",
            ["backend", "reason"], registry=registry,
        )
        self.resumes = Counter(
            "gateway_resumes",
            "Continuations of preempted requests: outcome=continued (the partial answer "
            "carried over), restarted (sent again from the start: nothing generated yet, or a "
            "structured whole answer whose tokens were dropped), failed (the client got an "
            "error instead), client_gone (the client left while it waited).",
            ["backend", "outcome"], registry=registry,
        )
        self.route_decisions = Counter(
            "gateway_route_decisions",
            "Requests routed within a model's pool of backends, by why that backend: fit "
            "(the most room left of those it fits now), affinity (it served the "
            "conversation's prefix last), queued (it freed room first for a waiting "
            "request), failover (after another backend failed the request).",
            ["model", "backend", "reason"], registry=registry,
        )
        self.failovers = Counter(
            "gateway_failovers",
            "Requests sent to another backend of their model after one failed before any "
            "byte reached the client.",
            ["model"], registry=registry,
        )
        self.backend_full = Counter(
            "gateway_backend_full",
            "Requests a backend refused for want of room by limits of its own (vLLM's "
            "503): cause=queue_full (--max-num-queued-reqs) or prefill_backlog "
            "(--max-num-queued-tokens); each waited for room, there or on another "
            "backend, and was never counted as an upstream error.",
            ["backend", "cause"], registry=registry,
        )

    def scrape_registry(self) -> CollectorRegistry:
        """The registry ``/metrics`` renders: :attr:`registry`, or, under
        ``gateway serve --workers N`` (``PROMETHEUS_MULTIPROC_DIR`` set), the counters and
        histograms of every worker summed by prometheus_client's ``MultiProcessCollector``
        plus this worker's gauges, which read the shared state and so are the same in
        every worker."""
        path = os.environ.get("PROMETHEUS_MULTIPROC_DIR")
        if not path:
            return self.registry
        if self._scrape is None:
            scrape = CollectorRegistry(auto_describe=False)
            MultiProcessCollector(scrape, path=path)
            for collector in self._live:
                scrape.register(collector)
            self._scrape = scrape
        return self._scrape

    def state_op(self, op: str, outcome: str, seconds: float) -> None:
        """Count one call to the shared state
        (:class:`gateway.admission.shared.SharedStore`), and its time in seconds."""
        if self.state_ops is not None and self.state_latency is not None:
            self.state_ops.labels(op, outcome).inc()
            self.state_latency.labels(op).observe(seconds)

    def state_expired(self, count: int, reason: str) -> None:
        """Count lease expiries: ``owner_lost``, leases and tickets of dead processes
        dropped by the shared state; ``renewed_late``, once each time this process found
        its own leases had been taken for dead (``count`` 0 counts one)."""
        if self.state_expiries is not None:
            self.state_expiries.labels(reason).inc(count or 1)

    def prime(self, backends: Iterable[str], parties: Iterable[tuple[str, str]]) -> None:
        """Create, at zero, the counter series the alert rules and the dashboard take
        ``increase()`` of: upstream errors by kind, preemptions by reason and resumes by
        outcome for each backend, and the queue's refusals for each backend and
        ``(tenant, priority)`` in ``parties`` (each tenant's own class). A series that
        appears only with its first event at 1 has no earlier sample, so Prometheus
        would never see that first rise (a first context overflow, say).

        :param backends: backend names.
        :param parties: ``(tenant, priority)`` label pairs.
        """
        parties = list(parties)
        for backend in backends:
            for kind in UpstreamKind:
                self.upstream_errors.labels(backend, kind)
            for preemption in PreemptionReason:
                self.preemptions.labels(backend, preemption)
            for outcome in ResumeOutcome:
                self.resumes.labels(backend, outcome)
            for reason in QUEUE_REJECTIONS:
                for tenant, priority in parties:
                    self.rejections.labels(backend, reason, tenant, priority)
