"""Application factory: wires settings, backends, metrics and routes together.

Nothing is created at import time. ``create_app(settings)`` builds one app; tests pass
their own ``http_client`` (over ``httpx.MockTransport``), ``registry`` and ``clock``.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import AsyncIterator, Callable
from typing import Any

import anyio.to_thread
import httpx
from fastapi import FastAPI, Request
from fastapi.responses import Response
from prometheus_client import CollectorRegistry

from gateway.admission.shared import SharedStore
from gateway.admission.shared_state import RedisState
from gateway.admission.state import LOCAL_STATE, StateStore
from gateway.admission.tenants import Tenants
from gateway.backends import SIDE_CONNECTIONS
from gateway.backends.target import Target
from gateway.backends.upstream import build_client
from gateway.clock import Clock, MonotonicClock
from gateway.config import (
    AdmissionSettings,
    BackendSettings,
    Settings,
    StateBackend,
    StateSettings,
)
from gateway.errors import GatewayError
from gateway.fleet.fleet import Fleet, MakeTarget
from gateway.fleet.pool import LocalPoolGrantor, PoolGrantor
from gateway.fleet.routers import router_rows
from gateway.fleet.shared_pool import SharedPoolGrantor
from gateway.fleet.state import GatewayState
from gateway.fleet.tasks import TaskSet
from gateway.http.auth import authenticate
from gateway.http.connection import guarded_protocol
from gateway.http.endpoints import register_routes
from gateway.http.middleware import (
    CorsOnApi,
    RequestAccounting,
    TitleCaseHeaders,
    count_rejection,
)
from gateway.http.side import SideRoutes
from gateway.http.status import register_status
from gateway.http.views import pool_gauge_rows
from gateway.observe.metrics import GatewayMetrics
from gateway.observe.record import record_of
from gateway.observe.tracing import Tracing, tracing_from_env
from gateway.wire.shapes import render, shape_of

__all__ = ["GatewayState", "create_app", "shutdown", "uvicorn_options"]

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
    * At most 2 × ``server.max_connections`` client connections open at once, and a listen
      backlog that holds a burst of ``server.max_connections`` (at least uvicorn's 2,048;
      the kernel caps it at ``net.core.somaxconn``).
    * No ``limit_concurrency``: past it uvicorn refuses every request of a burst, not only
      those past the limit (:mod:`gateway.http.connection`). The app's middleware limits
      the requests in hand to ``server.max_connections`` instead (see :func:`create_app`).
    """
    server = (settings or Settings()).server
    return {
        "http": guarded_protocol(server.head_timeout_s, server.body_idle_timeout_s,
                                 max_open=2 * server.max_connections),
        "h11_max_incomplete_event_size": MAX_HEAD_BYTES,
        "limit_concurrency": None,
        "backlog": max(2048, server.max_connections),
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
    redis_client: Any = None,
    tracing: Tracing | None = None,
) -> FastAPI:
    """Build the gateway ASGI app.

    The parts are built in order, each whole: the backends and the :class:`Fleet`, the
    metrics (which read the fleet's figures at scrape time), the tenants, then the
    :class:`GatewayState` holding them (``app.state.gateway``).

    :param settings: the loaded configuration.
    :param http_client: upstream client; defaults to :func:`gateway.backends.upstream.build_client`.
        The app closes it on shutdown only when it created it.
    :param registry: Prometheus registry; defaults to a fresh one.
    :param clock: time source; defaults to the monotonic clock.
    :param discover: run background capacity discovery during the app's lifespan.
    :param redis_client: with ``[state] backend = "redis"``, the Redis client of the
        shared state (a ``redis.asyncio.Redis``); by default one on ``state.redis_url``.
    :param tracing: the requests' traces; by default as the OpenTelemetry environment
        variables ask (:func:`gateway.observe.tracing.tracing_from_env`: off unless set).

    :raises ConfigError: those variables ask for an exporter the gateway does not have.
    """
    state = _build_state(settings, http_client, registry or CollectorRegistry(),
                         clock or MonotonicClock(), discover, redis_client)
    app = FastAPI(
        title="LLM admission gateway", lifespan=_lifespan, docs_url=None, redoc_url=None,
        openapi_url=None, redirect_slashes=False,
    )
    app.state.gateway = state
    app.state.tracing = tracing = tracing or tracing_from_env()
    app.state.side_routes = SideRoutes.build(http_client)
    direct = register_routes(app)
    register_status(app, state)
    app.add_middleware(RequestAccounting, metrics=state.metrics,
                       keepalive_timeout_s=settings.server.keepalive_timeout_s,
                       authenticate=authenticate, routes=direct,
                       max_in_flight=settings.server.max_connections, tracing=tracing)
    if settings.server.cors_origins:  # outside the accounting: see CorsOnApi
        app.add_middleware(CorsOnApi, origins=settings.server.cors_origins)
        app.add_middleware(TitleCaseHeaders)  # outermost: the names CORS adds too
    app.add_exception_handler(GatewayError, _render)  # type: ignore[arg-type]
    return app


def _build_state(settings: Settings, http_client: httpx.AsyncClient | None,
                 registry: CollectorRegistry, clock: Clock, discover: bool,
                 redis_client: Any) -> GatewayState:
    """The gateway's state, each part built whole, in order (see :func:`create_app`)."""
    metrics: GatewayMetrics | None = None
    store, pool_grantor, state_up = _state_store(
        settings.state, clock, redis_client, lambda: metrics)
    make_target = _target_factory(http_client, clock, store)
    backends = {b.name: make_target(b, settings.admission) for b in settings.backends}
    tasks = TaskSet()
    fleet = Fleet(backends, clock=clock, admission=settings.admission,
                  routing=settings.routing, make_target=make_target, tasks=tasks,
                  discover=discover, store=store, pool_grantor=pool_grantor)
    metrics = GatewayMetrics(registry, fleet.stats,
                             lambda: pool_gauge_rows(fleet.pool_queues()),
                             state_up=state_up,
                             router_source=lambda: router_rows(fleet.backends.values()))
    client = http_client or next(iter(backends.values())).client
    state = GatewayState(settings, client, clock, fleet,
                         Tenants(settings, quota_for=store.tenant), metrics, tasks,
                         store=store)
    state.prime_metrics()
    return state


def _state_store(settings: StateSettings, clock: Clock, redis_client: Any,
                 metrics: Callable[[], GatewayMetrics | None]
                 ) -> tuple[StateStore, Callable[[], PoolGrantor], Callable[[], bool] | None]:
    """The one choice of where admission state lives (``[state] backend``): the
    :class:`~gateway.admission.state.StateStore`, what grants a pool's queue, and the
    ``gateway_state_up`` reading (``None``: memory state has none). ``metrics`` returns
    the app's metrics once built (the store reports its calls to them)."""
    if settings.backend is not StateBackend.redis:
        return LOCAL_STATE, LocalPoolGrantor, None

    def on_op(*args: Any) -> None:
        if (m := metrics()) is not None:
            m.state_op(*args)

    def on_expired(count: int, why: str) -> None:
        if (m := metrics()) is not None:
            m.state_expired(count, why)

    shared = SharedStore(settings, clock=clock, client=redis_client, on_op=on_op,
                         on_expired=on_expired)
    store = RedisState(shared)
    def pool_grantor() -> PoolGrantor:  # over the members' budgets, as their admissions
        return SharedPoolGrantor(lambda b: store.account(b.name, b.settings.url),
                                 settings.poll_interval_s)
    return store, pool_grantor, lambda: shared.up


def _target_factory(http_client: httpx.AsyncClient | None, clock: Clock,
                    store: StateStore) -> MakeTarget:
    """How the app builds a backend from its settings (at start and on reloads): on
    ``http_client`` when one is given, else on clients of its own, closed when it is
    retired or at shutdown."""
    def make_target(entry: BackendSettings, admission: AdmissionSettings) -> Target:
        # No pool limit: admission bounds the generation requests (one per lease).
        gen = http_client or build_client(keepalive_expiry_s=entry.keepalive_expiry_s)
        side = http_client or build_client(max_connections=SIDE_CONNECTIONS,
                                           keepalive_expiry_s=entry.keepalive_expiry_s)
        target = Target(entry, admission, side, clock, client=gen, store=store)
        if http_client is None:
            target.owned_clients = [gen, side]
        return target
    return make_target


@contextlib.asynccontextmanager
async def _lifespan(app: FastAPI) -> AsyncIterator[None]:
    """Start the backends' discovery loops; at shutdown, cancel the app's background
    tasks and the streams' tails still being read, then close every backend and the
    side routes' client."""
    state: GatewayState = app.state.gateway
    await state.store.start()
    state.fleet.start()
    try:
        yield
    finally:
        await shutdown(app)


async def shutdown(app: FastAPI) -> None:
    """Stop everything ``app`` (from :func:`create_app`) runs in the background: cancel
    its tasks (discovery, retirements, streams' tails) and wait for them, close every
    backend (its re-reads and slot watches), the side routes' client and the shared
    state. Its lifespan ends with this; a test that drives the app without a lifespan
    calls it itself."""
    state: GatewayState = app.state.gateway
    try:
        await state.tasks.cancel_all()
        await state.fleet.close()
        await app.state.side_routes.aclose()
    finally:  # this process's leases in Redis are given back whatever failed above
        await state.store.close()
        tracing: Tracing = app.state.tracing
        if tracing.on:  # the spans still buffered go out, from a thread (the wire waits)
            await anyio.to_thread.run_sync(tracing.shutdown)


async def _render(request: Request, exc: GatewayError) -> Response:
    """The app's one handler of a :class:`GatewayError` raised before a response began:
    counted as a rejection and rendered in the route's API shape."""
    count_rejection(request.app.state.gateway.metrics,
                    record_of(request.scope), exc)
    status, headers, body = render(exc, shape_of(request.url.path))
    raw = {k.decode(): v.decode() for k, v in headers if k != b"content-length"}
    return Response(body, status, headers=raw)
