"""What the read-only routes show of a backend and of a pool queue: pure functions over
the running objects, shared by ``/ready``, ``/admin/backends``, ``/status.json`` and the
pool queue gauges.

:func:`backend_facts` reads every figure of one backend once; each route's row is a
projection of it, in that route's key order (the JSON bodies keep their order).
Token figures are KV cells (tokens); times are seconds.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from gateway.admission.lease import AdmissionStats
from gateway.backends.target import Target
from gateway.fleet.pool import ModelQueue
from gateway.fleet.routers import router_facts
from gateway.wire.naming import served_name

__all__ = ["ADMIN_FIELDS", "READY_FIELDS", "STATUS_FIELDS", "admin_row", "backend_facts",
           "pool_gauge_rows", "pool_row", "ready_row", "slo_facts",
           "status_row"]

#: ``/ready``'s row (then ``down`` and ``draining``, only when true).
READY_FIELDS = ("ready", "kind", "model", "slots", "ctx_per_slot", "capacity_tokens",
                "kv_unified")
#: ``/admin/backends``' row.
ADMIN_FIELDS = ("name", "model", "model_id", "aliases", "kind", "url", "ready", "up", "draining",
                "failures", "down_for_s", "problem", "fallbacks", "slots", "ctx_per_slot",
                "capacity_tokens", "reserved_tokens", "inflight", "queued", "router")
#: ``/status.json``'s row (the caller adds ``rejections``).
STATUS_FIELDS = ("name", "model", "kind", "state", "ready", "up", "draining", "retiring",
                 "problem", "fallbacks", "down_for_s", "layout", "slots", "busy_slots",
                 "ctx_per_slot",
                 "pool_tokens", "capacity_tokens", "reserved_tokens", "live_tokens",
                 "inflight", "queued", "queue_capacity", "oldest_wait_s", "router", "slo")


def backend_facts(backend: Target, now: float, *, gateway_draining: bool = False,
                  retiring: bool = False) -> dict[str, Any]:
    """Every figure a view shows of ``backend`` at clock time ``now``.

    ``state`` is ``"not_ready"`` (unreachable, loading, or capacity not known;
    ``problem`` says why), ``"down"`` (marked down after a failed request, for
    ``down_for_s`` more seconds), ``"retiring"`` (removed by a reload, finishing its
    requests), ``"draining"`` (the backend or the whole gateway takes no new requests)
    or ``"up"``. ``layout`` is ``"unified"`` (one KV pool of ``pool_tokens`` cells
    shared by the slots), ``"per_slot"`` (each slot its own ``ctx_per_slot`` tokens) or
    ``None`` while unknown; ``kv_unified`` is the layout's, else the configured
    ``unified``. ``capacity_tokens``, ``reserved_tokens``, ``live_tokens``, ``slots``,
    ``busy_slots``, ``inflight``, ``queued`` and ``queue_capacity`` equal the
    ``/metrics`` gauges of the same backend; ``oldest_wait_s`` is how long the longest
    waiter of its own queue has waited. ``router`` is ``None`` but for a llama-server
    router (:func:`gateway.fleet.routers.router_facts`); ``slo`` is the latency model and
    SLO limit (:func:`slo_facts`).
    """
    stats, layout = backend.stats(), backend.admission.layout
    if retiring:  # whatever else it is: it takes no new requests and leaves soon
        state = "retiring"
    elif not backend.ready:
        state = "not_ready"
    elif not backend.up:
        state = "down"
    elif backend.draining or gateway_draining:
        state = "draining"
    else:
        state = "up"
    return {
        # The served model's name (a llama-server without --alias reports its -m path
        # as its id: the file name without .gguf here, as in answers); the id as the
        # backend reports it only in the admin row.
        "name": backend.name, "model": served_name(backend.model), "model_id": backend.model,
        "aliases": list(backend.settings.aliases),
        "kind": backend.kind, "url": backend.settings.url, "state": state,
        "ready": backend.ready, "up": backend.up, "draining": backend.draining,
        "retiring": retiring, "failures": backend.health.failures, "problem": backend.problem,
        "fallbacks": list(backend.fallbacks),
        "down_for_s": round(backend.health.down_for_s(now), 3),
        "layout": None if layout is None else "unified" if layout.unified else "per_slot",
        "kv_unified": layout.unified if layout else backend.settings.unified,
        "slots": stats.slots, "busy_slots": stats.busy_slots,
        "ctx_per_slot": stats.ctx_per_slot,
        "pool_tokens": None if layout is None else layout.pool_tokens,
        "capacity_tokens": stats.capacity_tokens, "reserved_tokens": stats.reserved_tokens,
        "live_tokens": stats.live_tokens, "inflight": stats.inflight,
        "queued": stats.queued, "queue_capacity": stats.queue_capacity,
        "oldest_wait_s": round(stats.oldest_wait_s, 3),
        "router": router_facts(backend),
        "slo": slo_facts(stats),
    }


def slo_facts(stats: AdmissionStats) -> dict[str, Any] | None:
    """The backend's latency model and SLO limit (:mod:`gateway.admission.slo`), the
    figures of the ``gateway_slo_*`` and ``gateway_latency_*`` gauges, or ``None`` when
    the admission has no guard::

        {"limit": int | None,        # gateway_slo_limit: sequences admitted at once
                                     # (None before the layout is known)
         "binding": bool,            # the SLO limit is below the memory limit and
                                     # applies now (SloGuard.binds)
         "itl_target_s": float | None,   # the tightest ITL p95 target in flight, seconds
         "itl_p95_s": {level: float},    # learned ITL p95 by slots busy ("1", "2", ...),
                                         # levels with their minimum of samples only
         "prefill_tokens_per_s": float | None}   # learned prefill rate, prompt tokens/s
    """
    slo = stats.slo
    if slo is None:
        return None
    table = {str(level): round(p95_s, 4) for level, p95_s in slo.learned_p95().items()}
    tps = slo.model.prefill_tps()
    return {"limit": slo.in_force(stats.slots), "binding": slo.binds(stats.slots),
            "itl_target_s": slo.target(), "itl_p95_s": table,
            "prefill_tokens_per_s": None if tps is None else round(tps, 1)}


def _pick(facts: dict[str, Any], fields: Iterable[str]) -> dict[str, Any]:
    return {key: facts[key] for key in fields}


def ready_row(backend: Target, now: float) -> dict[str, Any]:
    """``backend``'s row of ``/ready``: :data:`READY_FIELDS`, plus ``"down": true``
    while marked down and ``"draining": true`` while draining."""
    facts = backend_facts(backend, now)
    row = _pick(facts, READY_FIELDS)
    if not facts["up"]:
        row["down"] = True
    if facts["draining"]:
        row["draining"] = True
    return row


def admin_row(backend: Target, now: float) -> dict[str, Any]:
    """``backend``'s row of ``/admin/backends`` (:data:`ADMIN_FIELDS`)."""
    return _pick(backend_facts(backend, now), ADMIN_FIELDS)


def status_row(backend: Target, now: float, *, gateway_draining: bool = False,
               retiring: bool = False) -> dict[str, Any]:
    """``backend``'s row of ``/status.json`` (:data:`STATUS_FIELDS`; see
    :func:`backend_facts`); the caller adds its rejections."""
    return _pick(backend_facts(backend, now, gateway_draining=gateway_draining,
                               retiring=retiring), STATUS_FIELDS)


def pool_row(queue: ModelQueue, oldest_s: float) -> dict[str, Any]:
    """One shared queue's row of ``/status.json``: its model, its backends' names, the
    requests waiting there, its bound and its longest wait so far (seconds)."""
    return {"model": served_name(queue.model), "backends": [b.name for b in queue.members],
            "queued": queue.waiting, "queue_capacity": queue.max_queue,
            "oldest_wait_s": round(oldest_s, 3)}


def pool_gauge_rows(pools: Iterable[tuple[ModelQueue, float]]
                    ) -> list[tuple[str, int, int, float]]:
    """The pool queue gauges: one row per model with a shared queue, as (model,
    waiting, capacity, longest wait in seconds). A queue a reload retired adds its
    waiters to the model's row (its capacity is the live queue's)."""
    rows: dict[str, tuple[str, int, int, float]] = {}
    for queue, oldest in pools:
        _, waiting, capacity, longest = rows.get(queue.model, (queue.model, 0, 0, 0.0))
        rows[queue.model] = (queue.model, waiting + queue.waiting,
                             capacity if queue.retired else queue.max_queue,
                             max(longest, oldest))
    return list(rows.values())
