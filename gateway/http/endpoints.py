"""HTTP routes: the OpenAI-compatible endpoints, health, readiness, metrics and admin
(llama-server's side routes are in :mod:`gateway.http.side`).

Each endpoint is a module-level function that reads the app's
:class:`~gateway.fleet.state.GatewayState` from ``request.app.state.gateway``;
:func:`register_routes` attaches them to an app. The generation routes are also served
as one plain ASGI callable (:func:`serve_direct`), which
:class:`~gateway.http.middleware.RequestAccounting` calls without the framework's routing
layers.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Receive, Scope, Send

from gateway.backends.upstream import map_upstream_errors
from gateway.errors import RouteNotFound
from gateway.fleet.reload import reload_config
from gateway.fleet.routers import (
    configured_model,
    family,
    has_routers,
    listed_models,
    listing,
)
from gateway.fleet.state import GatewayState
from gateway.http.auth import Access, authorize
from gateway.http.side import register_side_routes, side_route
from gateway.http.views import admin_row, ready_row
from gateway.observe.record import record_of
from gateway.relay.response import ProxyResponse
from gateway.request.plan import count_prompt, prepare_exchange, read_body, require_ready
from gateway.wire.naming import served_name
from gateway.wire.routes import BY_NAME, DIRECT, ROUTES, SERVED, Route
from gateway.wire.validation import check_content_type

__all__ = ["GENERATION_ROUTES", "register_routes", "serve_direct"]

#: ``POST`` path -> route name of every generation route (forwarded under admission).
GENERATION_ROUTES = DIRECT


def _state(request: Request) -> GatewayState:
    return request.app.state.gateway


async def handle(request: Request, route: str) -> Response:
    """Plan a generation request of ``route`` and the response that admits, forwards
    and relays it (:func:`gateway.request.plan.prepare_exchange`)."""
    state = _state(request)
    exchange = await prepare_exchange(state, request, route)
    return ProxyResponse(exchange, client=exchange.backend.client, metrics=state.metrics,
                         clock=state.clock, cut=state.cut, tasks=state.tasks)


async def generate(request: Request) -> Response:
    """``POST`` on a generation route (:data:`GENERATION_ROUTES`), through the router."""
    return await handle(request, GENERATION_ROUTES[request.scope["path"]])


async def serve_direct(scope: Scope, receive: Receive, send: Send) -> None:
    """A generation route as a plain ASGI app (the middleware's direct path)."""
    response = await handle(Request(scope, receive), GENERATION_ROUTES[scope["path"]])
    await response(scope, receive, send)


async def passthrough(request: Request) -> Response:
    """Ollama's listing routes, relayed unchanged to the first Ollama backend (or the
    one a ``model`` names), so that Ollama-aware clients and UIs can list models."""
    body = await request.body() if request.method == "POST" else b""
    model = None
    if body:
        try:
            model = json.loads(body).get("model")
        except (ValueError, AttributeError):
            model = None
    backend = _state(request).fleet.pick(model, "ollama")
    with map_upstream_errors(backend.name):
        resp = await backend.side_client.request(
            request.method, backend.url(request.url.path), content=body or None,
            headers={"content-type": "application/json", **backend.settings.auth_headers},
            timeout=backend.timeout)
    record_of(request.scope).backend = backend.name
    return Response(resp.content, resp.status_code,
                    media_type=resp.headers.get("content-type", "application/json"))


async def count_tokens(request: Request) -> Response:
    """Anthropic's token count, answered from the backend's exact count of the body
    (no generation is forwarded, no slot is taken)."""
    state = _state(request)
    record_of(request.scope).route = "count_tokens"
    check_content_type(request.headers.get("content-type"),
                       request.headers.get("content-encoding"))
    req = BY_NAME[Route.count_tokens].parse(await read_body(
        request, state.settings.server.max_body_bytes))
    backend = state.fleet.pick(req.body.get("model"), route="count_tokens")
    record_of(request.scope).backend = backend.name
    require_ready(backend)
    counted, _raw, _forget = await count_prompt(state, backend, req)
    return JSONResponse({"input_tokens": counted})


async def router_models(request: Request) -> Response:
    """``GET /models``: relayed as a side route, but in front of a llama-server router
    answered as :func:`models`. The router's own ``/models`` lists each child's command
    line (model paths), and sent to one model (``?model=ID``) it is not found."""
    if has_routers(_state(request).fleet.backends.values()):
        return await models(request)
    return await side_route(request)


async def models(request: Request) -> Response:
    """Each model once: a backend with ``model`` configured is listed under that name
    (its own entry renamed, for the metadata); one without, as it lists itself, but for
    an id that is a file path (llama-server's ``-m`` without ``--alias``), listed by its
    file name as answers name it (:func:`gateway.wire.naming.served_name`) unless
    ``routing.answer_model = "backend"``.
    Backends are asked at once, each for at most
    :data:`~gateway.fleet.routers.MODELS_TIMEOUT_S`; one that
    does not answer lists nothing. A llama-server router's models are listed once, by
    its hub, each with ``status.value`` (``unloaded``, ``loading``, ``loaded``,
    ``sleeping``); ``?reload=1`` has a router re-read its presets and models directory
    first, as its own ``GET /models?reload=1`` does."""
    state = _state(request)
    backends = listing(state.fleet.backends.values())
    reload = bool(request.query_params.get("reload"))  # any value, as server-models.cpp
    answers = await asyncio.gather(*(listed_models(b, reload) for b in backends))
    renamed = state.settings.routing.answer_model != "backend"
    data: list[Any] = []
    seen: set[Any] = set()
    for backend, entries in zip(backends, answers, strict=True):
        configured = configured_model(backend)  # (its role once its list came back)
        if configured is not None:
            if configured in seen or not entries:
                continue
            entry = {k: v for k, v in entries[0].items() if k != "aliases"}
            entry["id"] = configured  # the backend's own id and aliases do not route
            if backend.settings.aliases:
                entry["aliases"] = list(backend.settings.aliases)
            entries = [entry]
        for entry in entries:
            if renamed and isinstance(entry.get("id"), str):
                entry = {**entry, "id": served_name(entry["id"])}
            if entry.get("id") not in seen:
                seen.add(entry.get("id"))
                data.append(entry)
    return JSONResponse({"object": "list", "data": data})


async def health(request: Request) -> Response:
    """``GET /health``: the process answers."""
    return JSONResponse({"status": "ok"})


async def ready(request: Request) -> Response:
    """200 while there is a model and every model has a backend that can take a request
    (ready, up and not draining) and the gateway is not draining; 503 otherwise. Load
    balancers read the status; the body shows each backend
    (:func:`gateway.http.views.ready_row`) and, with shared state, whether Redis
    answered the last call (``state.up``). A Redis that cannot be reached does not turn
    it 503: every replica shares that Redis, and a balancer left with no ready replica
    answers with errors of its own, where the gateway answers 503 ``state_unavailable``
    with ``Retry-After``."""
    state = _state(request)
    fleet, now = state.fleet, state.clock.now()
    rows = {name: ready_row(b, now) for name, b in fleet.backends.items()}
    served = fleet.models()
    serving = {served_name(m): any(b.usable(now) for b in members)
               for m, members in served.items()}
    # No model at all (a llama-server router whose /models cannot be read, or lists
    # none) is not ready: nothing would be served.
    ok = bool(serving) and all(serving.values()) and not state.draining
    body: dict[str, Any] = {"ready": ok, "backends": rows}
    if len(served) > 1 or not ok:
        body["models"] = serving
    if state.draining:
        body["draining"] = True
    body.update(state.store.ready_fields())  # shown, not judged: see the docstring
    return JSONResponse(body, 200 if ok else 503)


async def admin_backends(request: Request) -> Response:
    """``GET /admin/backends``: every backend's row (:func:`gateway.http.views.admin_row`),
    those retiring, and the backends of each model."""
    state = _state(request)
    authorize(state, request.scope, Access.admin)
    fleet, now = state.fleet, state.clock.now()
    return JSONResponse({
        "backends": [admin_row(b, now) for b in fleet.backends.values()],
        "retiring": [admin_row(b, now) for b in fleet.retiring],
        "models": {m: [b.name for b in bs] for m, bs in fleet.models().items()},
    })


async def _set_draining(request: Request, name: str, draining: bool) -> Response:
    state = _state(request)
    authorize(state, request.scope, Access.admin)
    backend = state.fleet.backends.get(name)
    if backend is None:
        raise RouteNotFound(f"No backend named {name!r}; see GET /admin/backends.")
    for each in family(backend):  # a llama-server router: its models' backends too
        each.set_draining(draining)
    return JSONResponse(admin_row(backend, state.clock.now()))


async def drain(request: Request, name: str) -> Response:
    """``POST /admin/backends/{name}/drain``: the backend takes no new requests (a
    llama-server router's entry: none of its models does)."""
    return await _set_draining(request, name, True)


async def undrain(request: Request, name: str) -> Response:
    """``POST /admin/backends/{name}/undrain``: the backend takes requests again."""
    return await _set_draining(request, name, False)


async def reload(request: Request) -> Response:
    """``POST /admin/reload``: read the configuration file again
    (:func:`gateway.fleet.reload.reload_config`)."""
    state = _state(request)
    authorize(state, request.scope, Access.admin)
    return JSONResponse({"reloaded": await reload_config(state)})


async def metrics(request: Request) -> Response:
    """``GET /metrics`` in the Prometheus text format (access checked at the edge)."""
    registry = _state(request).metrics.scrape_registry()
    return Response(generate_latest(registry), media_type=CONTENT_TYPE_LATEST)


async def not_served(request: Request, exc: StarletteHTTPException) -> Response:
    """A path or method the gateway does not serve (404, 405): raised as a
    :class:`~gateway.errors.RouteNotFound` that lists what it serves."""
    raise RouteNotFound(f"{request.method} {request.url.path}: {exc.detail}. The gateway "
                        f"serves {SERVED}.", status_code=exc.status_code,
                        allow=(exc.headers or {}).get("Allow"))


#: The handler of each route of the table (gateway.wire.routes.ROUTES) the gateway
#: answers itself, by the route's name; forwarded routes are :func:`generate`'s, an
#: Ollama backend's listings :func:`passthrough`'s, side routes gateway.http.side's and
#: the status page gateway.http.status's.
_OWN = {Route.count_tokens: count_tokens, Route.models: models, Route.health: health,
        Route.ready: ready, Route.metrics: metrics}


def register_routes(app: FastAPI) -> dict[str, ASGIApp]:
    """Attach every route of the gateway to ``app``, and return the generation routes
    as plain ASGI callables (``POST`` path → callable), for
    :class:`~gateway.http.middleware.RequestAccounting` to serve without the framework's
    routing layers. The same routes stay registered on ``app``, which answers their
    other methods (405)."""
    for spec in ROUTES:  # the table's routes but the side ones and the status page's
        handler = (generate if spec.forwarded else passthrough if spec.backend_kind
                   else None if spec.side else _OWN.get(spec.name))
        if handler is None:
            continue
        # The gateway's own GET routes (probes, listings, the scrape) answer HEAD as GET
        # without the body, as llama-server's /health does (a load balancer's check
        # written for it may use HEAD).
        own_get = spec.method == "GET" and spec.name in _OWN
        methods = [spec.method, "HEAD"] if own_get else [spec.method]
        for path in spec.paths:
            app.add_api_route(path, handler, methods=methods)
    app.add_api_route("/admin/backends", admin_backends, methods=["GET"])
    app.add_api_route("/admin/backends/{name:path}/drain", drain, methods=["POST"])
    app.add_api_route("/admin/backends/{name:path}/undrain", undrain, methods=["POST"])
    app.add_api_route("/admin/reload", reload, methods=["POST"])
    app.add_api_route("/models", router_models, methods=["GET", "HEAD"])  # before SIDE's
    register_side_routes(app)
    app.add_exception_handler(StarletteHTTPException, not_served)  # type: ignore[arg-type]
    return dict.fromkeys(GENERATION_ROUTES, serve_direct)
