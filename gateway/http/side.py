"""llama-server's side routes, passed through; its routes the gateway refuses, and why.

A *side route* (:data:`gateway.wire.routes.SIDE`: ``/tokenize``, ``/detokenize``,
``/apply-template``, the input-token counts, ``GET /props``, ``GET /models``,
``GET /lora-adapters``, ``GET /slots``) generates nothing and holds no slot, so it is
relayed to a backend as it came, with no admission and no KV charged. It still needs the
tenant's key when tenants are configured (checked at the edge, as every API route), and
it goes through its own bounded client (:class:`SideRoutes`): at most
:data:`SIDE_CONNECTIONS` connections, the backend's side timeout
(:data:`SIDE_TIMEOUT_S` at most) and answers of at most :data:`MAX_ANSWER_BYTES`.

**Which backend.** The one the body's ``model`` names (a ``GET``'s ``?model=``), as a
generation would go; a backend's own name picks that backend. Naming none is fine while
one model is served. A backend whose kind does not serve the path (its dialect's
``side_paths``) answers 404 naming the backend and its kind; vLLM serves its own
``/tokenize`` and ``/detokenize`` (with vLLM's bodies), Ollama none of these.

**What is refused, on purpose** (each a documented difference, ``docs/differences.md``):

* the slot actions ``POST /slots/{id}?action=save|restore|erase`` (403): the gateway
  places requests on slots and keeps what each slot's KV cache holds in its books (slot
  pinning, prefix affinity, the slot watch); a restore or an erase would change a slot
  behind them, and a save would race the request placed there next;
* ``POST /props`` and ``POST /lora-adapters`` (403): they change the server for every
  client of the gateway at once; so do a router's ``POST``/``DELETE /models`` (download,
  delete) and ``POST /models/load``, ``/models/unload`` (the gateway loads and unloads
  the router's models itself, under ``--models-max``);
* ``/cors-proxy`` (403): llama-server's experimental proxy fetches any URL a client names;
  through a gateway it would be an open proxy on the backend's network;
* ``GET``/``POST /tools`` (403) unless ``server.relay_tools``: llama-server's built-in
  tools and MCP servers run commands on the backend's machine for whoever calls them;
  relayed, they go to the router itself in router mode;
* Vertex AI's ``POST /predict`` and the web UI at ``GET /`` (404): ``/predict`` runs up
  to 128 requests of any route inside one request, which one admission cannot bound, and
  the web UI is llama-server's own page and assets.

**The backend's metrics.** ``GET /backends/{name}/metrics`` relays the backend's own
``/metrics`` (its dialect's ``metrics_path``) with its headers (llama-server's
``Process-Start-Time-Unix``), with the access of the gateway's own ``/metrics``.
"""

from __future__ import annotations

import httpx
import orjson
from fastapi import FastAPI, Request
from fastapi.responses import Response

from gateway.backends.target import Target
from gateway.backends.upstream import (
    build_client,
    map_upstream_errors,
    send_upstream,
    upstream_request,
)
from gateway.errors import (
    NotRelayed,
    RouteNotFound,
    ShuttingDown,
    UpstreamError,
)
from gateway.fleet.routers import side_backend, side_call
from gateway.fleet.state import GatewayState
from gateway.http.auth import authorize
from gateway.observe.record import record_of
from gateway.request.plan import read_body
from gateway.wire.routes import BY_PATH, SIDE, Access, Route

__all__ = ["MAX_ANSWER_BYTES", "SIDE_CONNECTIONS", "SIDE_TIMEOUT_S", "SideRoutes",
           "register_side_routes"]

SIDE_CONNECTIONS = 4  # connections of the side-route client, all backends together
SIDE_TIMEOUT_S = 30.0  # the longest a side route waits for its answer, seconds
MAX_ANSWER_BYTES = 16 * 1024 * 1024  # a side route's answer, at most (bytes)

# Response headers not relayed: the connection's own, the body's framing (the answer is
# sent whole), and CORS (the gateway's own setting: gateway.http.app).
_DROPPED = frozenset({"connection", "keep-alive", "transfer-encoding", "content-length",
                      "content-encoding", "server", "date", "set-cookie"})


class SideRoutes:
    """The client of the side routes and the relay of one call.

    :param client: an upstream client (:func:`gateway.backends.upstream.build_client`
        with :data:`SIDE_CONNECTIONS`, or the tests' client).
    :param owned: the client was made here, and :meth:`aclose` closes it.
    :param max_answer_bytes: the largest answer relayed (bytes); a larger one is 502.
    """

    def __init__(self, client: httpx.AsyncClient, *, owned: bool = False,
                 max_answer_bytes: int = MAX_ANSWER_BYTES) -> None:
        self.client = client
        self.owned = owned
        self.max_answer_bytes = max_answer_bytes

    @classmethod
    def build(cls, http_client: httpx.AsyncClient | None) -> SideRoutes:
        """On ``http_client`` when given (tests), else on a client of its own."""
        if http_client is not None:
            return cls(http_client)
        return cls(build_client(max_connections=SIDE_CONNECTIONS), owned=True)

    async def aclose(self) -> None:
        """Close the client, if it is this object's own."""
        if self.owned:
            await self.client.aclose()

    async def relay(self, backend: Target, method: str, path_qs: str, body: bytes,
                    upstream_id: bytes) -> Response:
        """Send ``method path_qs`` (path and query string) with ``body`` to ``backend``
        and answer as it answered: its status, body and headers (but those of
        ``_DROPPED``). A 401, or a 403 other than llama-server's ``feature_disabled``
        (a route its flags leave off, ``tools/server/server.cpp``), is the backend
        refusing the gateway's key.

        :raises UpstreamTimeout: no answer within the side timeout (504).
        :raises UpstreamUnavailable: the backend cannot be reached (502).
        :raises UpstreamError: the connection broke, or the answer is larger than
            ``max_answer_bytes`` (502).
        """
        settings = backend.settings
        timeout = httpx.Timeout(min(SIDE_TIMEOUT_S, settings.read_timeout_s),
                                connect=settings.connect_timeout_s)
        headers = {"x-request-id": upstream_id.decode("latin-1"), **settings.auth_headers}
        if body:
            headers["content-type"] = "application/json"
        request = upstream_request(method, backend.url(path_qs), headers=headers,
                                   content=body or None, timeout=timeout)
        with map_upstream_errors(backend.name):
            resp = await send_upstream(self.client, request, stream=True)
            try:
                data = await self._read(backend, resp)
            finally:
                await resp.aclose()
        if resp.status_code == 401 or (resp.status_code == 403
                                       and b'"feature_disabled"' not in data):
            raise UpstreamError(f"Backend {backend.name!r} refused the gateway's own key "
                                f"(HTTP {resp.status_code}): set backends[].api_key to the "
                                "key the backend expects.")
        kept = {k: v for k, v in resp.headers.items()
                if k.lower() not in _DROPPED and not k.lower().startswith("access-control-")}
        return Response(data, resp.status_code, headers=kept)

    async def _read(self, backend: Target, resp: httpx.Response) -> bytes:
        chunks: list[bytes] = []
        size = 0
        async for chunk in resp.aiter_bytes():
            size += len(chunk)
            if size > self.max_answer_bytes:
                raise UpstreamError(f"Backend {backend.name!r} answered with more than "
                                    f"{self.max_answer_bytes:,} bytes; the gateway relays "
                                    "side routes up to that size.")
            chunks.append(chunk)
        return b"".join(chunks)


def _state(request: Request) -> GatewayState:
    return request.app.state.gateway


def _model_of(request: Request, body: bytes) -> object:
    """The model a side call names: the JSON body's ``model``, else ``?model=``."""
    if body:
        try:
            parsed = orjson.loads(body)
        except orjson.JSONDecodeError:
            parsed = None  # the backend answers a body it cannot read itself
        if isinstance(parsed, dict) and parsed.get("model") is not None:
            return parsed["model"]
    return request.query_params.get("model")


def _serving(backend: Target, method: str, path: str) -> Target:
    if path not in backend.dialect.side_paths:
        raise RouteNotFound(f"{method} {path} is a llama-server route; backend "
                            f"{backend.name!r} is of kind {backend.kind}, which does not "
                            "serve it.")
    return backend


def _side_backend(state: GatewayState, model: object, path: str) -> Target:
    """The backend a side call goes to: the one ``model`` names (:meth:`Fleet.pick`),
    or a llama-server router's hub for what it answers itself
    (:func:`gateway.fleet.routers.side_backend`).

    :raises ModelNotFound: ``model`` is not served here (404).
    :raises RouteNotFound: as :meth:`Fleet.pick`.
    """
    fleet = state.fleet
    return side_backend(fleet.backends.values(), lambda: fleet.pick(model), model is not None,
                        path)


async def side_route(request: Request) -> Response:
    """A side route (:data:`gateway.wire.routes.SIDE`), relayed to the backend the
    request names (see the module docstring).

    :raises ShuttingDown: the gateway drains (503), as for the generation routes.
    :raises Unauthorized: ``GET /slots`` without ``server.admin_key`` when one is set.
    :raises NotRelayed: ``GET /slots`` with tenants configured and no admin key, or
        ``/tools`` without ``server.relay_tools`` (403).
    :raises PayloadTooLarge: a body over ``server.max_body_bytes`` (413).
    :raises UpstreamError: the backend refused the gateway's key (401/403 become 502).
    :raises RouteNotFound: the backend's kind does not serve the path (404).
    :raises ModelNotFound: the model named is not served here (404).
    """
    state = _state(request)
    if state.draining:
        raise ShuttingDown("The gateway is shutting down; retry after the Retry-After "
                           "delay.", retry_after_s=1.0)
    if BY_PATH[request.url.path].access is Access.status:
        if state.settings.tenants and state.settings.server.admin_key is None:
            raise NotRelayed("GET /slots shows the settings (and on some llama-server "
                             "builds the prompts) of every tenant's requests: with tenants "
                             "configured it needs server.admin_key.")
        authorize(state, request.scope, Access.status)
    path = request.url.path
    if BY_PATH[path].name is Route.tools and not state.settings.server.relay_tools:
        raise NotRelayed(
            f"The gateway does not relay {request.method} {path}: it runs llama-server's "
            "built-in tools and MCP servers (commands on the backend's machine) for "
            "whoever calls it. Set server.relay_tools = true to relay it.")
    body = await read_body(request, state.settings.server.max_body_bytes) \
        if request.method == "POST" else b""
    backend = _serving(_side_backend(state, _model_of(request, body), path),
                       request.method, path)
    record = record_of(request.scope)
    record.backend = backend.name
    query = request.url.query
    target = path + (f"?{query}" if query else "")
    target, body = side_call(backend, request.method, target, body)  # (a router's model)
    return await request.app.state.side_routes.relay(
        backend, request.method, target, body, record.upstream_id)


async def backend_metrics(request: Request, name: str) -> Response:
    """``GET /backends/{name}/metrics``: the backend's own Prometheus endpoint, relayed
    with its headers (access checked at the edge, as ``/metrics``).

    :raises RouteNotFound: no backend of that name, or its kind has no metrics (404).
    """
    state = _state(request)
    backend = state.fleet.backends.get(name)
    if backend is None:
        raise RouteNotFound(f"No backend named {name!r}; the backends are "
                            f"{', '.join(state.fleet.backends)}.")
    path = backend.dialect.metrics_path
    if path is None:
        raise RouteNotFound(f"Backend {name!r} is of kind {backend.kind}, which has no "
                            "metrics endpoint of its own.")
    record = record_of(request.scope)
    record.backend = backend.name
    return await request.app.state.side_routes.relay(
        backend, "GET", path, b"", record.upstream_id)


async def slot_action(request: Request, id_slot: str) -> Response:
    """``POST /slots/{id}?action=...``: refused (see the module docstring).

    :raises NotRelayed: always (403).
    """
    action = request.query_params.get("action", "")
    raise NotRelayed(
        f"The gateway does not relay slot actions (POST /slots/{id_slot}?action={action}): "
        "it places requests on slots and keeps what each slot's KV cache holds, and a "
        "save, restore or erase would change or race a slot behind its books. Send slot "
        "actions to the backend itself, with no traffic through the gateway on it.")


async def changes_server(request: Request) -> Response:
    """``POST /props``, ``POST /lora-adapters``: refused.

    :raises NotRelayed: always (403).
    """
    raise NotRelayed(
        f"The gateway does not relay POST {request.url.path}: it changes the backend's "
        "settings for every client of the gateway at once. Send it to the backend "
        f"itself; GET {request.url.path} is relayed.")


async def manages_models(request: Request) -> Response:
    """A router's ``POST``/``DELETE /models`` (download, delete) and ``POST /models/load``,
    ``/models/unload``: refused.

    :raises NotRelayed: always (403).
    """
    raise NotRelayed(
        f"The gateway does not relay {request.method} {request.url.path}: it changes a "
        "llama-server router's models for every client of the gateway, and the gateway "
        "loads and unloads them itself as requests need them (under --models-max). Send "
        "it to the router itself; GET /models is relayed.")


async def cors_proxy(request: Request) -> Response:
    """``/cors-proxy``: refused.

    :raises NotRelayed: always (403).
    """
    raise NotRelayed(
        "The gateway does not relay llama-server's /cors-proxy: it fetches any URL a "
        "client names, which through a gateway makes an open proxy on the backend's "
        "network.")


async def not_relayed(request: Request) -> Response:
    """Vertex AI's ``POST /predict`` and the web UI's ``GET /``: not served.

    :raises RouteNotFound: always (404), naming the reason.
    """
    why = ("Vertex AI's predict route runs up to 128 requests of any route inside one "
           "request, which the gateway cannot admit as one; send each instance to its "
           "route instead" if request.url.path == "/predict" else
           "llama-server's web UI is its own page and assets, not relayed; open it on "
           "the backend itself")
    raise RouteNotFound(f"{request.method} {request.url.path} is not served by the "
                        f"gateway: {why}.")


def register_side_routes(app: FastAPI) -> None:
    """Attach the side routes, the backend metrics and the refused routes to ``app``."""
    for path, spec in SIDE.items():
        # llama-server's HTTP library answers HEAD on its GET routes (uptime checks use it)
        methods = [spec.method, "HEAD"] if spec.method == "GET" else [spec.method]
        if spec.name is Route.tools:
            methods.append("POST")  # GET /tools lists the tools, POST /tools runs one
        app.add_api_route(path, side_route, methods=methods)
    app.add_api_route("/props", changes_server, methods=["POST"])
    app.add_api_route("/models", manages_models, methods=["POST", "DELETE"])
    app.add_api_route("/models/load", manages_models, methods=["POST"])
    app.add_api_route("/models/unload", manages_models, methods=["POST"])
    app.add_api_route("/lora-adapters", changes_server, methods=["POST"])
    app.add_api_route("/slots/{id_slot}", slot_action, methods=["POST"])
    app.add_api_route("/cors-proxy", cors_proxy, methods=["GET", "POST"])
    app.add_api_route("/predict", not_relayed, methods=["POST"])
    app.add_api_route("/", not_relayed, methods=["GET"])
    app.add_api_route("/backends/{name}/metrics", backend_metrics, methods=["GET", "HEAD"])
