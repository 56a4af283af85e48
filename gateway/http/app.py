"""Application factory: wires settings, backends, metrics and routes together.

Nothing is created at import time. ``create_app(settings)`` builds one app; tests pass
their own ``http_client`` (over ``httpx.MockTransport``), ``registry`` and ``clock``.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator
from typing import Any

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import Response
from prometheus_client import CollectorRegistry

from gateway.admission.tenants import Tenants, check_admin_key
from gateway.backends import SIDE_CONNECTIONS
from gateway.backends.target import Target
from gateway.backends.upstream import build_client
from gateway.clock import Clock, MonotonicClock
from gateway.config import AdmissionSettings, BackendSettings, Settings
from gateway.errors import GatewayError
from gateway.fleet.state import GatewayState
from gateway.http.connection import guarded_protocol
from gateway.http.endpoints import register_routes
from gateway.http.middleware import RequestAccounting, count_rejection
from gateway.http.status import register_status
from gateway.observe.metrics import GatewayMetrics
from gateway.observe.record import record_of
from gateway.relay.response import stop_drains
from gateway.wire.routes import Access, access_of
from gateway.wire.shapes import render, shape_of

__all__ = ["GatewayState", "create_app", "uvicorn_options"]

log = logging.getLogger(__name__)


# The largest request head h11 buffers (bytes). Above the middleware's own limit
# (MAX_HEADER_BYTES, 16 KiB), so that a head between the two gets the gateway's 431 in
# the OpenAI shape; a larger one gets h11's plain 400 and its connection is closed.
MAX_HEAD_BYTES = 64 * 1024


def uvicorn_options(settings: Settings | None = None) -> dict[str, Any]:
    """How uvicorn serves the gateway, shared by ``gateway serve``, ``make run`` and the
    tests: every client-facing limit is set here, none is left at uvicorn's default.

    * HTTP/1.1 by h11, with the head and body timeouts of :mod:`gateway.http.connection`.
      h11 frames a response by the client's HTTP version, so an HTTP/1.0 client gets a
      close-delimited stream; uvicorn's httptools protocol always adds
      ``Transfer-Encoding: chunked`` to a body of unknown length, which an HTTP/1.0
      client cannot read (``uvicorn/protocols/http/httptools_impl.py``).
    * Request heads up to :data:`MAX_HEAD_BYTES` (``h11_max_incomplete_event_size``).
    * Idle client connections kept ``server.keepalive_timeout_s`` seconds.
    * At most ``server.max_connections`` client connections (``limit_concurrency``).
    """
    server = (settings or Settings()).server
    return {
        "http": guarded_protocol(server.head_timeout_s, server.body_idle_timeout_s),
        "h11_max_incomplete_event_size": MAX_HEAD_BYTES,
        "limit_concurrency": server.max_connections,
        "timeout_graceful_shutdown": 5,
        "timeout_keep_alive": server.keepalive_timeout_s,
    }


def create_app(
    settings: Settings,
    *,
    http_client: httpx.AsyncClient | None = None,
    registry: CollectorRegistry | None = None,
    clock: Clock | None = None,
    discover: bool = True,
) -> FastAPI:
    """Build the gateway ASGI app.

    :param settings: the loaded configuration.
    :param http_client: upstream client; defaults to :func:`gateway.backends.upstream.build_client`.
        The app closes it on shutdown only when it created it.
    :param registry: Prometheus registry; defaults to a fresh one.
    :param clock: time source; defaults to the monotonic clock.
    :param discover: run background capacity discovery during the app's lifespan.
    """
    owns_client = http_client is None
    clock = clock or MonotonicClock()

    def make_target(entry: BackendSettings, admission: AdmissionSettings) -> Target:
        # No pool limit: admission bounds the generation requests (one per lease).
        gen = http_client or build_client(keepalive_expiry_s=entry.keepalive_expiry_s)
        side = http_client or build_client(max_connections=SIDE_CONNECTIONS,
                                           keepalive_expiry_s=entry.keepalive_expiry_s)
        target = Target(entry, admission, side, clock, client=gen)
        if owns_client:
            target.owned_clients = [gen, side]
        return target

    backends = {b.name: make_target(b, settings.admission) for b in settings.backends}
    client = http_client or next(iter(backends.values())).client
    state = GatewayState(settings, client, clock, backends)
    state.make_target = make_target
    def pool_rows() -> list[tuple[str, int, int, float]]:
        """One row per model with a shared queue; a queue a reload retired adds its
        waiters to the model's row (its capacity is the live queue's)."""
        rows: dict[str, tuple[str, int, int, float]] = {}
        for queue, oldest in state.pool_queues():
            _, waiting, capacity, longest = rows.get(queue.model, (queue.model, 0, 0, 0.0))
            rows[queue.model] = (queue.model, waiting + queue.waiting,
                                 capacity if queue.retired else queue.max_queue,
                                 max(longest, oldest))
        return list(rows.values())

    state.metrics = GatewayMetrics(registry or CollectorRegistry(), state.stats, pool_rows)
    state.tenants = Tenants(settings)
    state.prime_metrics()

    def authenticate(scope: Any) -> None:
        """Who the request is for (before its body is read): probes, the admin routes
        and the status page pass (those check the admin key themselves, never a
        tenant's); ``/metrics`` needs the admin key when one is set, unless
        ``server.metrics_public``; every other path needs a tenant's key when tenants
        are configured (:meth:`Tenants.authenticate`)."""
        access = access_of(scope["path"])
        if access in (Access.open, Access.admin):
            return
        server = state.settings.server
        if access is Access.scrape:
            if server.admin_key is not None and not server.metrics_public:
                check_admin_key(scope["headers"], server.admin_key.get_secret_value(),
                                "/metrics (server.admin_key is set) needs")
            return
        tenant = state.tenants.authenticate(scope["headers"])
        record = record_of(scope)
        record.tenant, record.priority = tenant, tenant.priority

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        state.discovering = discover
        for backend in backends.values():
            state.start_discovery(backend)
        try:
            yield
        finally:
            for task in (*state.tasks, *state._retirements):
                task.cancel()
            await asyncio.gather(*state.tasks, *state._retirements, return_exceptions=True)
            await stop_drains()
            for backend in (*state.backends.values(), *state.retiring):
                await backend.close()
                for owned in backend.owned_clients:
                    await owned.aclose()

    app = FastAPI(
        title="LLM admission gateway", lifespan=lifespan, docs_url=None, redoc_url=None,
        openapi_url=None, redirect_slashes=False,
    )
    app.state.gateway = state
    direct = register_routes(app, state)
    register_status(app, state)
    app.add_middleware(RequestAccounting, metrics=state.metrics,
                       keepalive_timeout_s=settings.server.keepalive_timeout_s,
                       authenticate=authenticate, routes=direct)

    @app.exception_handler(GatewayError)
    async def _render(request: Request, exc: GatewayError) -> Response:
        count_rejection(state.metrics, record_of(request.scope), exc)
        status, headers, body = render(exc, shape_of(request.url.path))
        raw = {k.decode(): v.decode() for k, v in headers if k != b"content-length"}
        return Response(body, status, headers=raw)

    return app
