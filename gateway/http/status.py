"""The live status page: ``GET /status`` (one HTML page, no build step, nothing fetched
from elsewhere) and ``GET /status.json`` (what the page shows, read again every
:data:`REFRESH_MS` milliseconds by the page itself).

The figures are those of ``/metrics``, read from the same sources at the moment of the
call: each backend's admission stats (:meth:`gateway.backends.target.Target.stats`) and the
``gateway_rejections_total`` counter; the rows are those of :mod:`gateway.http.views`.
The page and the JSON are guarded by ``server.admin_key`` when one is set (see
:func:`gateway.http.auth.status_authorized`), and open otherwise, as ``/metrics`` is.
"""

from __future__ import annotations

import base64
import functools
import hashlib
import re
import time
from collections import deque
from collections.abc import Iterator, Mapping
from importlib.resources import files

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import Counter

from gateway.clock import Clock
from gateway.fleet.state import GatewayState
from gateway.http.auth import STATUS_PATHS, Access, authorize
from gateway.http.views import pool_row, status_row

__all__ = ["GAUGES", "attainment", "RECENT_WINDOW_S", "REFRESH_MS", "STATUS_PATHS", "RejectionLog",
           "register_status", "status_html", "status_json", "status_page"]

#: A backend row's figure in /status.json -> the /metrics gauge (label ``backend``) that
#: gives the same number, read from the same source at the call.
GAUGES = {
    "slots": "gateway_slots", "busy_slots": "gateway_slots_busy",
    "ctx_per_slot": "gateway_backend_ctx_per_slot",
    "capacity_tokens": "gateway_kv_capacity_tokens",
    "reserved_tokens": "gateway_kv_reserved_tokens", "live_tokens": "gateway_kv_live_tokens",
    "inflight": "gateway_inflight_requests", "queued": "gateway_queue_depth",
    "queue_capacity": "gateway_queue_capacity",
}

REFRESH_MS = 1500  # how often the page reads /status.json, milliseconds
RECENT_WINDOW_S = 300.0  # "recent" rejections: those of about the last five minutes
SAMPLE_EVERY_S = 5.0  # at most one snapshot of the rejection counter per this, seconds

_INLINE = re.compile(rb"<(script|style)>(.*?)</\1>", re.DOTALL)


def status_page() -> bytes:
    """The page (UTF-8 HTML, a few KB), as packaged in ``gateway/http/static/status.html``;
    its ``data-refresh-ms`` is set to :data:`REFRESH_MS`."""
    page = files("gateway.http").joinpath("static/status.html").read_bytes()
    return page.replace(b'data-refresh-ms="1500"', f'data-refresh-ms="{REFRESH_MS}"'.encode())


@functools.cache
def _page() -> tuple[bytes, dict[str, str]]:
    """The page and the headers it is served with (read once per process)."""
    page = status_page()
    return page, {"cache-control": "no-store", "x-content-type-options": "nosniff",
                  "referrer-policy": "no-referrer",
                  "content-security-policy": _content_security_policy(page)}


def _content_security_policy(page: bytes) -> str:
    """A policy that lets the page run only its own inline script and style (by their
    SHA-256) and talk only to the gateway it came from."""
    hashes: dict[bytes, list[str]] = {b"script": [], b"style": []}
    for kind, body in _INLINE.findall(page):
        digest = base64.b64encode(hashlib.sha256(body).digest()).decode()
        hashes[kind].append(f"'sha256-{digest}'")
    script = " ".join(hashes[b"script"]) or "'none'"
    style = " ".join(hashes[b"style"]) or "'none'"
    return (f"default-src 'none'; script-src {script}; style-src {style}; "
            "connect-src 'self'; img-src 'self' data:; base-uri 'none'; "
            "form-action 'none'; frame-ancestors 'none'")


def _counts(counter: Counter) -> Iterator[tuple[dict[str, str], int]]:
    """Each labelled series of ``counter`` with its count, only those above zero (not
    the primed zeros)."""
    for family in counter.collect():
        for sample in family.samples:
            if sample.name.endswith("_total") and sample.value:
                yield sample.labels, int(sample.value)


class RejectionLog:
    """``gateway_rejections_total`` summed by (backend, reason) over tenants and
    priorities, and what it rose by recently.

    "Recently" is measured against snapshots of the totals taken when the status is
    read (at most one per ``sample_every_s`` seconds; the first when the log is made,
    with every count at 0): the baseline is the newest snapshot at least ``window_s``
    seconds old, else the first. While the page is open that covers ``window_s`` to
    ``window_s + sample_every_s`` seconds; after nobody looked for a while it covers
    more, and :meth:`read` says how much.

    :param counter: the ``gateway_rejections`` counter (labels backend, reason, tenant,
        priority).
    :param clock: time source, seconds.
    """

    def __init__(self, counter: Counter, clock: Clock, *, window_s: float = RECENT_WINDOW_S,
                 sample_every_s: float = SAMPLE_EVERY_S) -> None:
        self._counter = counter
        self._clock = clock
        self._window_s = window_s
        self._every_s = sample_every_s
        self._samples: deque[tuple[float, dict[tuple[str, str], int]]] = deque(
            [(clock.now(), {})])

    def totals(self) -> dict[tuple[str, str], int]:
        """Rejections since start by (backend, reason); ``backend`` is ``"none"`` for
        those refused before a backend was chosen."""
        found: dict[tuple[str, str], int] = {}
        for labels, n in _counts(self._counter):
            key = (labels["backend"], labels["reason"])
            found[key] = found.get(key, 0) + n
        return found

    def read(self) -> tuple[dict[tuple[str, str], int], dict[tuple[str, str], int], float]:
        """(totals since start, the rise since the baseline, how many seconds back the
        baseline is); only counts above zero are given in the rise."""
        now, totals = self._clock.now(), self.totals()
        gap = now - self._samples[-1][0] > self._window_s  # nobody read for a while
        if now - self._samples[-1][0] >= self._every_s:
            self._samples.append((now, totals))
        while len(self._samples) > 1 and self._samples[1][0] <= now - self._window_s:
            self._samples.popleft()
        since, base = self._samples[0]
        recent = {k: v - base.get(k, 0) for k, v in totals.items() if v > base.get(k, 0)}
        if gap:
            # A reading after a gap longer than the window: it alone covers the gap;
            # the next ones count from it, up to the window again.
            while len(self._samples) > 1:
                self._samples.popleft()
        return totals, recent, now - since


def _by_reason(counts: Mapping[tuple[str, str], int], backend: str) -> dict[str, int]:
    return {reason: n for (b, reason), n in sorted(counts.items()) if b == backend}


def _elsewhere(counts: Mapping[tuple[str, str], int], shown: set[str]) -> dict[str, int]:
    """Counts by reason of the rejections no backend row shows: those refused before a
    backend was chosen (``backend="none"``) and those of backends a reload removed."""
    found: dict[str, int] = {}
    for (backend, reason), n in sorted(counts.items()):
        if backend not in shown:
            found[reason] = found.get(reason, 0) + n
    return found


def attainment(counter: Counter) -> dict[str, dict[str, dict[str, dict[str, int]]]]:
    """``gateway_slo_requests_total`` as ``{backend: {priority: {"ttft" | "itl": {"met":
    n, "missed": n}}}}``: the streamed requests of classes with latency targets that met
    or missed them since start (:meth:`gateway.relay.usage.UsageBook.attained` counts them);
    only counts above zero are given."""
    found: dict[str, dict[str, dict[str, dict[str, int]]]] = {}
    for labels, n in _counts(counter):
        by_target = found.setdefault(labels["backend"], {}).setdefault(
            labels["priority"], {}).setdefault(labels["target"], {})
        by_target[labels["outcome"]] = n
    return found


def register_status(app: FastAPI, state: GatewayState) -> None:
    """Add ``GET /status`` and ``GET /status.json`` to ``app``, with the app's
    :class:`RejectionLog` (``app.state.rejections``).

    ``/status.json`` is::

        {"generated_at": float,       # Unix time of the reading, seconds
         "draining": bool,            # the gateway is stopping
         "refresh_ms": int,           # how often the page reads this, milliseconds
         "recent_window_s": float,    # how far back "recent" counts go, seconds
         "backends": [status_row(...) + {"rejections": {"total": {reason: n},
                                                        "recent": {reason: n}}}],
                    # its "slo" (views.slo_facts) gains "attainment": {priority:
                    # {"ttft" | "itl": {"met": n, "missed": n}}} (see attainment())
         "retiring": [status_row(..., retiring=True) + {"rejections": empty}],
         "pools": [{"model": str, "backends": [str], "queued": int,
                    "queue_capacity": int, "oldest_wait_s": float}],
         "unassigned_rejections": {"total": {...}, "recent": {...}},
         "state": {"backend": "memory" | "redis",
                   # with "redis" only:
                   "up": bool,                # Redis answered its last call
                   "process": str,            # this process's id (host:pid:random)
                   "processes": [str]}}       # every live gateway process's id

    ``backends`` are the configured backends, the ones ``/metrics`` shows; ``retiring``
    those a reload removed or replaced that still finish requests (a replaced one has
    the name of its successor). ``pools`` lists the shared queues of models served by
    several backends (their requests wait there, not in a backend's own queue);
    ``unassigned_rejections`` the rejections no backend row shows: counted with
    ``backend="none"`` (refused before a backend was chosen) or on a removed backend.
    The rows are :func:`gateway.http.views.status_row` and
    :func:`gateway.http.views.pool_row`. Authentication:
    :func:`gateway.http.auth.status_authorized` when ``server.admin_key`` is set.
    """
    app.state.rejections = RejectionLog(state.metrics.rejections, state.clock)
    app.add_api_route("/status", status_html, methods=["GET"])
    app.add_api_route("/status.json", status_json, methods=["GET"])


async def status_html(request: Request) -> Response:
    """``GET /status``: the page (the 401 that makes a browser ask for the key is
    raised by :func:`gateway.http.auth.authorize`, rendered by the app's error handler)."""
    authorize(request.app.state.gateway, request.scope, Access.status)
    page, headers = _page()
    return Response(page, media_type="text/html; charset=utf-8", headers=headers)


def _state_row(state: GatewayState) -> dict[str, object]:
    """Where admission state lives, and with Redis, who shares it
    (:meth:`gateway.admission.state.StateStore.status_row`)."""
    return state.store.status_row()


async def status_json(request: Request) -> Response:
    """``GET /status.json`` (see :func:`register_status`)."""
    state: GatewayState = request.app.state.gateway
    authorize(state, request.scope, Access.status)
    now, fleet = state.clock.now(), state.fleet
    totals, recent, span = request.app.state.rejections.read()
    attained = attainment(state.metrics.slo_requests)
    rows = []
    for backend in fleet.backends.values():
        row = status_row(backend, now, gateway_draining=state.draining)
        row["rejections"] = {"total": _by_reason(totals, backend.name),
                             "recent": _by_reason(recent, backend.name)}
        if row["slo"] is not None:
            row["slo"]["attainment"] = attained.get(backend.name, {})
        rows.append(row)
    # Removed or replaced by a reload and still finishing requests: not in /metrics
    # (a replaced backend's new target has the same name), and their rejections and
    # attainment cannot be told from the new target's.
    retiring = []
    for backend in fleet.retiring:
        row = status_row(backend, now, gateway_draining=state.draining, retiring=True)
        row["rejections"] = {"total": {}, "recent": {}}
        if row["slo"] is not None:
            row["slo"]["attainment"] = {}
        retiring.append(row)
    shown = {backend.name for backend in fleet.backends.values()}
    return JSONResponse({
        "generated_at": round(time.time(), 3), "draining": state.draining,
        "refresh_ms": REFRESH_MS, "recent_window_s": round(span, 3),
        "backends": rows, "retiring": retiring,
        "pools": [pool_row(queue, oldest) for queue, oldest in fleet.pool_queues()],
        "unassigned_rejections": {"total": _elsewhere(totals, shown),
                                  "recent": _elsewhere(recent, shown)},
        "state": _state_row(state),
    }, headers={"cache-control": "no-store"})
