"""HTTP routes: the OpenAI-compatible endpoints, health, readiness and metrics."""

from __future__ import annotations

import asyncio
import json
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Receive, Scope, Send

from gateway.admission.tenants import check_admin_key
from gateway.backends.target import Target
from gateway.backends.upstream import map_upstream_errors
from gateway.errors import RouteNotFound
from gateway.fleet.reload import reload_config
from gateway.fleet.state import GatewayState
from gateway.relay.response import ProxyResponse
from gateway.relay.tracked import TrackedResponse
from gateway.request.plan import count_prompt, prepare_exchange, read_body, require_ready
from gateway.wire.routes import FORWARDED
from gateway.wire.validation import check_content_type, parse_route_body

__all__ = ["MODELS_TIMEOUT_S", "register_routes"]

MODELS_TIMEOUT_S = 5.0  # GET /v1/models waits this long for each backend's list


def register_routes(app: FastAPI, state: GatewayState) -> dict[str, ASGIApp]:
    """Attach every route of the gateway to ``app``, and return the generation routes
    as plain ASGI callables (``POST`` path → callable), for
    :class:`~gateway.http.middleware.RequestAccounting` to serve without the framework's
    routing layers. The same routes stay registered on ``app``, which answers their
    other methods (405)."""

    async def handle(request: Request, route: str) -> Response:
        exchange = await prepare_exchange(state, request, route)
        kind = TrackedResponse if exchange.tracked else ProxyResponse
        return kind(exchange, client=exchange.backend.client, metrics=state.metrics,
                    clock=state.clock, cut=state.cut)

    def direct(route: str) -> ASGIApp:
        async def serve(scope: Scope, receive: Receive, send: Send) -> None:
            response = await handle(Request(scope, receive), route)
            await response(scope, receive, send)
        return serve

    @app.post("/api/chat")
    async def ollama_chat(request: Request) -> Response:
        return await handle(request, "ollama_chat")

    @app.post("/api/generate")
    async def ollama_generate(request: Request) -> Response:
        return await handle(request, "ollama_generate")

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
        backend = state.fleet.pick(model, "ollama")
        with map_upstream_errors(backend.name):
            resp = await backend.side_client.request(
                request.method, backend.url(request.url.path), content=body or None,
                headers={"content-type": "application/json",
                         **backend.settings.auth_headers},
                timeout=backend.timeout)
        request.state.backend = backend.name
        return Response(resp.content, resp.status_code,
                        media_type=resp.headers.get("content-type", "application/json"))

    for path in ("/api/tags", "/api/version", "/api/ps"):
        app.add_api_route(path, passthrough, methods=["GET"])
    app.add_api_route("/api/show", passthrough, methods=["POST"])

    def forward(route: str) -> Any:
        async def endpoint(request: Request) -> Response:
            return await handle(request, route)
        return endpoint

    for path, route in FORWARDED.items():
        app.add_api_route(path, forward(route), methods=["POST"])
    served_directly = {path: direct(route) for path, route in
                       (*FORWARDED.items(), ("/api/chat", "ollama_chat"),
                        ("/api/generate", "ollama_generate"))}

    @app.post("/v1/messages/count_tokens")
    async def count_tokens(request: Request) -> Response:
        """Anthropic's token count, answered from the backend's exact count of the body
        (no generation is forwarded, no slot is taken)."""
        request.state.route = "count_tokens"
        check_content_type(request.headers.get("content-type"),
                           request.headers.get("content-encoding"))
        req = parse_route_body("count_tokens", await read_body(
            request, state.settings.server.max_body_bytes))
        backend = state.fleet.pick(req.body.get("model"), route="count_tokens")
        request.state.backend = backend.name
        require_ready(backend)
        counted, _raw, _forget = await count_prompt(state, backend, req)
        return JSONResponse({"input_tokens": counted})

    @app.get("/v1/models")
    async def models() -> Response:
        """Each model once: a backend with ``model`` configured is listed under that name
        (its own entry renamed, for the metadata); one without, as it lists itself.
        Backends are asked at once, each for at most :data:`MODELS_TIMEOUT_S`; one that
        does not answer lists nothing."""
        async def listed(backend: Target) -> list[dict[str, Any]]:
            try:
                resp = await backend.side_client.get(
                    backend.url("/v1/models"), headers=backend.settings.auth_headers,
                    timeout=min(MODELS_TIMEOUT_S, backend.settings.read_timeout_s))
                return [e for e in resp.json().get("data", []) if isinstance(e, dict)]
            except Exception:  # an unreachable or odd backend lists nothing
                return []

        backends = list(state.fleet.backends.values())
        answers = await asyncio.gather(*(listed(b) for b in backends))
        data: list[Any] = []
        seen: set[Any] = set()
        for backend, entries in zip(backends, answers, strict=True):
            configured = backend.settings.model
            if configured is not None:
                if configured in seen or not entries:
                    continue
                entry = {k: v for k, v in entries[0].items() if k != "aliases"}
                entry["id"] = configured  # the backend's own id and aliases do not route
                if backend.settings.aliases:
                    entry["aliases"] = list(backend.settings.aliases)
                entries = [entry]
            for entry in entries:
                if entry.get("id") not in seen:
                    seen.add(entry.get("id"))
                    data.append(entry)
        return JSONResponse({"object": "list", "data": data})

    @app.get("/health")
    async def health() -> Response:
        return JSONResponse({"status": "ok"})

    @app.get("/ready")
    async def ready() -> Response:
        """200 while every model has a backend that can take a request (ready, up and
        not draining) and the gateway is not draining; 503 otherwise. Load balancers
        read the status; the body shows each backend."""
        rows = {}
        for name, b in state.fleet.backends.items():
            stats, layout = b.stats(), b.layout
            rows[name] = {
                "ready": b.ready, "kind": b.kind, "model": b.model, "slots": stats.slots,
                "ctx_per_slot": stats.ctx_per_slot, "capacity_tokens": stats.capacity_tokens,
                "kv_unified": layout.unified if layout else b.settings.unified,
            }
            if not b.up:
                rows[name]["down"] = True
            if b.draining:
                rows[name]["draining"] = True
        now = state.clock.now()
        models = state.fleet.models()
        serving = {m: any(b.usable(now) for b in members) for m, members in models.items()}
        ok = all(serving.values()) and not state.draining
        body: dict[str, Any] = {"ready": ok, "backends": rows}
        if len(models) > 1 or not ok:
            body["models"] = serving
        if state.draining:
            body["draining"] = True
        return JSONResponse(body, 200 if ok else 503)

    def admin(request: Request) -> None:
        """Let the call through only with ``Authorization: Bearer <server.admin_key>``;
        without a configured key the admin routes do not exist (404)."""
        key = state.settings.server.admin_key
        if key is None:
            raise RouteNotFound(f"{request.method} {request.url.path}: Not Found (the "
                                "admin routes exist when server.admin_key is set).")
        check_admin_key(request.headers.raw, key.get_secret_value(),
                        "The admin routes need")

    def backend_view(b: Target) -> dict[str, Any]:
        stats, now = b.stats(), state.clock.now()
        return {
            "name": b.name, "model": b.model, "aliases": list(b.settings.aliases),
            "kind": b.kind, "url": b.settings.url, "ready": b.ready, "up": b.up,
            "draining": b.draining, "failures": b.health.failures,
            "down_for_s": round(b.health.down_for_s(now), 3),
            "problem": b.problem, "slots": stats.slots, "ctx_per_slot": stats.ctx_per_slot,
            "capacity_tokens": stats.capacity_tokens,
            "reserved_tokens": stats.reserved_tokens, "inflight": stats.inflight,
            "queued": stats.queued,
        }

    @app.get("/admin/backends")
    async def admin_backends(request: Request) -> Response:
        admin(request)
        return JSONResponse({
            "backends": [backend_view(b) for b in state.fleet.backends.values()],
            "retiring": [backend_view(b) for b in state.fleet.retiring],
            "models": {m: [b.name for b in bs] for m, bs in state.fleet.models().items()},
        })

    async def set_draining(request: Request, name: str, draining: bool) -> Response:
        admin(request)
        backend = state.fleet.backends.get(name)
        if backend is None:
            raise RouteNotFound(f"No backend named {name!r}; see GET /admin/backends.")
        backend.set_draining(draining)
        return JSONResponse(backend_view(backend))

    @app.post("/admin/backends/{name}/drain")
    async def drain(request: Request, name: str) -> Response:
        return await set_draining(request, name, True)

    @app.post("/admin/backends/{name}/undrain")
    async def undrain(request: Request, name: str) -> Response:
        return await set_draining(request, name, False)

    @app.post("/admin/reload")
    async def reload(request: Request) -> Response:
        admin(request)
        return JSONResponse({"reloaded": await reload_config(state)})

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(generate_latest(state.metrics.registry), media_type=CONTENT_TYPE_LATEST)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException) -> Response:
        served = ", ".join(["POST " + p for p in (*FORWARDED, "/v1/messages/count_tokens",
                                                   "/api/chat", "/api/generate", "/api/show")]
                           + ["GET /v1/models", "GET /health", "GET /ready", "GET /metrics",
                              "GET /status", "GET /status.json", "GET /api/tags",
                              "GET /api/version", "GET /api/ps"])
        raise RouteNotFound(f"{request.method} {request.url.path}: {exc.detail}. The gateway "
                            f"serves {served}.", status_code=exc.status_code)

    return served_directly
