"""Every path the gateway serves, once: a table of frozen :class:`RouteSpec` entries.

One entry answers every question the gateway asks about a route (as starlette's ``Route``
carries path, endpoint and methods together): its name (the ``route`` label of
``gateway_requests_total`` and the name the pipeline, the relay and the backend kinds
use), its path and method, the API whose shape its answers and errors take (:class:`Api`),
the parser of its body, who may call it (:class:`Access`), whether its access line is
quiet, and what its body and answer are like (does it generate, does its usage sum its
items, which fields cap its output, can its stream be resumed). An entry's ``aliases`` are
the other paths it answers on (llama-server serves each OpenAI route with and without
``/v1``, ``tools/server/server.cpp``): an alias is its twin in every way, its ``route``
label included. A ``side`` entry is passed through to a backend unchanged, with no
admission (:mod:`gateway.http.side`).

Everything else is derived from :data:`ROUTES`: :data:`FORWARDED` and :data:`LABELS`,
the path sets of the access log (:data:`QUIET_PATHS`, :data:`PROBE_PATHS`), of the status
page (:data:`STATUS_PATHS`) and of the tenant gate (:data:`OPEN_PATHS`), the routes served
straight from the middleware (:data:`DIRECT`), the side routes (:data:`SIDE`), the list
a 404 names (:data:`SERVED`), a path's label (:func:`label_of`) and who may call a path
(:func:`access_of`). A new route is one entry here plus a parser in
:mod:`gateway.wire.validation`.

A data module, pure: it imports only :mod:`gateway.wire.validation`.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from enum import StrEnum
from typing import Any

from gateway.wire import validation as v
from gateway.wire.validation import ParsedRequest

__all__ = ["ADMIN_PREFIX", "BACKENDS_PREFIX", "BY_NAME", "BY_PATH", "DIRECT", "FORWARDED",
           "LABELS", "OPEN_PATHS", "PROBE_PATHS", "QUIET_PATHS", "ROUTES", "SERVED", "SIDE",
           "NO_CORS_PATHS", "SLOTS_PREFIX", "STATUS_PATHS", "Access", "Api", "Route", "RouteSpec",
           "access_of", "api_of", "label_of"]


class Api(StrEnum):
    """The API a route belongs to: the shape of its answers and of its errors
    (:mod:`gateway.wire.shapes`). A ``StrEnum``, so a member equals its value."""

    openai = "openai"  # {"error": {message, type, param, code}}; SSE data events
    anthropic = "anthropic"  # {"type": "error", "error": {type, message}}; named events
    ollama = "ollama"  # {"error": "message"}; NDJSON streams (Ollama's api/types.go)


class Access(StrEnum):
    """Who may call a route: the one vocabulary of access, checked by
    :func:`gateway.http.auth.authorize` (``tenant`` and ``scrape`` at the edge, before a
    body is read; ``admin`` and ``status`` by their endpoints once routed)."""

    open = "open"  # anyone: load balancer probes never need a key
    tenant = "tenant"  # a tenant's key, when tenants are configured
    scrape = "scrape"  # server.admin_key when set, unless server.metrics_public (/metrics)
    admin = "admin"  # server.admin_key as a bearer key; 404 without one (/admin/...)
    status = "status"  # server.admin_key when set, bearer or HTTP Basic (the status page)


class Route(StrEnum):
    """The route names: the ``route`` label of ``gateway_requests_total`` and the name
    the pipeline, the relay and the backend kinds (``route_paths``) use. A ``StrEnum``,
    so a member equals the string used before it existed."""

    chat = "chat"
    completions = "completions"
    responses = "responses"
    messages = "messages"
    embeddings = "embeddings"
    embedding = "embedding"  # llama-server's native /embedding (its answer has no usage)
    rerank = "rerank"
    infill = "infill"
    completion = "completion"  # llama-server's native /completion
    count_tokens = "count_tokens"
    ollama_chat = "ollama_chat"
    ollama_generate = "ollama_generate"
    models = "models"
    health = "health"
    ready = "ready"
    metrics = "metrics"
    status = "status"  # the status page and its JSON
    # Side routes, passed through to a backend with no admission (gateway.http.side).
    tokenize = "tokenize"
    detokenize = "detokenize"
    apply_template = "apply_template"
    input_tokens = "input_tokens"  # llama-server's chat and Responses input-token counts
    props = "props"
    slots = "slots"  # GET /slots, and the slot actions (POST /slots/{id}: refused)
    lora_adapters = "lora_adapters"
    tools = "tools"  # GET/POST /tools: llama-server's built-in tools and MCP servers
    backend_metrics = "backend_metrics"  # GET /backends/{name}/metrics
    other = "other"  # a path with no label of its own (Ollama's listing routes, 404s)


Parser = Callable[["RouteSpec", bytes], ParsedRequest]

# The fields llama-server reads as an output cap, whatever the route
# (tools/server/server-schema.cpp: n_predict, then max_completion_tokens, then max_tokens).
_OPENAI_CAPS = ("max_tokens", "max_completion_tokens", "n_predict")


@dataclass(frozen=True)
class RouteSpec:
    """One route of the gateway.

    :param name: the route's name (:class:`Route`); several paths may share one
        (``/status`` and ``/status.json``).
    :param path: the path it is served on.
    :param method: the HTTP method of its handler (others answer 405).
    :param api: the API whose answer and error shapes it uses.
    :param access: who may call it.
    :param parser: reads and validates its body (:mod:`gateway.wire.validation`);
        ``None`` for a route with no body the gateway reads.
    :param forwarded: a generation route, planned and forwarded under admission
        (:func:`gateway.request.plan.prepare_exchange`).
    :param quiet: its access line is DEBUG when it succeeds (scrapes, the status page).
    :param probe: its access line is always DEBUG (``/ready`` answers 503 while a
        backend is down; a load balancer probing it every second would fill the log).
    :param generates: it produces output tokens (embeddings and rerank do not: their
        bodies are forwarded unchanged and they have no output cap).
    :param sums_usage: its usage's ``prompt_tokens`` is the sum over its items (every
        input of an embeddings batch, every document of a rerank), not one prompt's.
    :param cap_field: the field its API reads as the output cap, where the charged cap
        is written (``max_tokens``; ``max_output_tokens`` on Responses, llama-server's
        ``n_predict`` on its native routes, ``options.num_predict`` on Ollama's).
    :param cap_keys: every body field the parser reads as the cap (they must agree).
    :param resumable: a stream the gateway can cancel and continue where it stopped
        (:mod:`gateway.wire.resume`), when the backend kind can (its
        ``resumable_routes``).
    :param chat: its prompt is a ``messages`` array of chat messages, counted and
        estimated as a chat (OpenAI's and Ollama's chat).
    :param count_as: the route a backend counts its prompt as
        (``BackendKind.count_prompt``): a completion-like route's prompts are counted
        as completions.
    :param openai_chunks: its stream is OpenAI's chat/completions chunks: usage is
        asked for with ``stream_options.include_usage``, comes once per choice of an
        ``n > 1`` stream (llama-server), and a usage-only chunk the client did not ask
        for is dropped; its plain chunks can be read without parsing them.
    :param exact_usage: the backend's reported ``prompt_tokens`` is the count the
        gateway asked it for, so a disagreement means a kept count went stale.
    :param predicts_output: its completion lengths feed the backend's output-length
        prediction (``record_completion``).
    :param native_tasks: llama-server's native stream, which ends each task
        (prompt × n) with a ``"stop": true`` chunk of its own.
    :param backend_kind: only backends of this kind serve it (Ollama's native API).
    :param prompt_field: the field an error names when a prompt given otherwise than as
        ``prompt`` is surely too long for a slot.
    :param aliases: the other paths the route answers on, each its twin in every way
        (parsed, counted, charged, relayed and labelled as :attr:`path`).
    :param side: passed through to the backend the request names, unchanged, with no
        admission and no KV charged (:mod:`gateway.http.side`); the backend kinds that
        serve it say so in their ``side_paths``.
    """

    name: Route
    path: str
    method: str = "POST"
    api: Api = Api.openai
    access: Access = Access.tenant
    parser: Parser | None = None
    forwarded: bool = False
    quiet: bool = False
    probe: bool = False
    generates: bool = True
    sums_usage: bool = False
    cap_field: str = "max_tokens"
    cap_keys: tuple[str, ...] = _OPENAI_CAPS
    resumable: bool = False
    chat: bool = False
    count_as: Route | None = None
    openai_chunks: bool = False
    exact_usage: bool = False
    predicts_output: bool = False
    native_tasks: bool = False
    backend_kind: str | None = None
    prompt_field: str = "input"
    aliases: tuple[str, ...] = ()
    side: bool = False

    @property
    def paths(self) -> tuple[str, ...]:
        """Every path the route answers on: :attr:`path`, then its :attr:`aliases`."""
        return (self.path, *self.aliases)

    def parse(self, raw: bytes) -> ParsedRequest:
        """Read and validate a body of this route (``raw``: the bytes, size-checked).

        :raises InvalidRequest: the body is not what the route takes (4xx, naming the
            field).
        :raises TypeError: the route has no parser (it reads no body).
        """
        if self.parser is None:
            raise TypeError(f"route {self.name} reads no body")
        return self.parser(self, raw)

    @property
    def counted_as(self) -> Route:
        """The route a backend counts this route's prompt as (:attr:`count_as`, else
        the route itself)."""
        return self.count_as or self.name


def _get(name: Route, path: str, **flags: Any) -> RouteSpec:
    return RouteSpec(name, path, method="GET", generates=False, **flags)


def _forwarded(name: Route, path: str, parser: Parser, **flags: Any) -> RouteSpec:
    return RouteSpec(name, path, parser=parser, forwarded=True, **flags)


def _side(name: Route, path: str, method: str = "POST", **flags: Any) -> RouteSpec:
    return RouteSpec(name, path, method=method, generates=False, side=True, **flags)


ROUTES: tuple[RouteSpec, ...] = (
    # Generation routes forwarded under admission (FORWARDED), in the order the 404
    # names them.
    # llama-server answers each under the aliases given (tools/server/server.cpp):
    # /completions is its native /completion, not /v1/completions; /embeddings its native
    # /embedding, not /v1/embeddings.
    _forwarded(Route.chat, "/v1/chat/completions", v.parse_chat, resumable=True, chat=True,
               openai_chunks=True, exact_usage=True, predicts_output=True,
               prompt_field="messages", aliases=("/chat/completions",)),
    _forwarded(Route.completions, "/v1/completions", v.parse_completions, resumable=True,
               openai_chunks=True, exact_usage=True, predicts_output=True),
    _forwarded(Route.responses, "/v1/responses", v.parse_responses,
               cap_field="max_output_tokens", cap_keys=("max_output_tokens", *_OPENAI_CAPS),
               exact_usage=True, predicts_output=True, aliases=("/responses",)),
    _forwarded(Route.messages, "/v1/messages", v.parse_messages, api=Api.anthropic,
               exact_usage=True, predicts_output=True, prompt_field="messages"),
    _forwarded(Route.embeddings, "/v1/embeddings", v.parse_embeddings, generates=False,
               sums_usage=True, cap_keys=()),
    _forwarded(Route.embedding, "/embedding", v.parse_embeddings, generates=False,
               sums_usage=True, cap_keys=(), count_as=Route.embeddings,
               aliases=("/embeddings",)),
    _forwarded(Route.rerank, "/v1/rerank", v.parse_rerank, generates=False, sums_usage=True,
               cap_keys=(), aliases=("/rerank", "/reranking", "/v1/reranking")),
    _forwarded(Route.infill, "/infill", v.parse_infill, cap_field="n_predict",
               cap_keys=("n_predict", "max_tokens", "max_completion_tokens"),
               native_tasks=True),
    _forwarded(Route.completion, "/completion", v.parse_completions, cap_field="n_predict",
               count_as=Route.completions, predicts_output=True, native_tasks=True,
               aliases=("/completions",)),
    RouteSpec(Route.count_tokens, "/v1/messages/count_tokens", api=Api.anthropic,
              parser=v.parse_messages, generates=False, prompt_field="messages"),
    # Ollama's native API (NDJSON streams; only Ollama backends serve it).
    _forwarded(Route.ollama_chat, "/api/chat", v.parse_ollama_chat, api=Api.ollama,
               chat=True, count_as=Route.chat, cap_field="options.num_predict",
               cap_keys=("options.num_predict",), predicts_output=True,
               backend_kind="ollama"),
    _forwarded(Route.ollama_generate, "/api/generate", v.parse_ollama_generate,
               api=Api.ollama, count_as=Route.completions, cap_field="options.num_predict",
               cap_keys=("options.num_predict",), predicts_output=True,
               backend_kind="ollama"),
    RouteSpec(Route.other, "/api/show", api=Api.ollama, generates=False,
              backend_kind="ollama"),
    _get(Route.models, "/v1/models"),
    _get(Route.health, "/health", access=Access.open, quiet=True, probe=True,
         aliases=("/v1/health",)),
    _get(Route.ready, "/ready", access=Access.open, quiet=True, probe=True),
    _get(Route.metrics, "/metrics", access=Access.scrape, quiet=True),
    _get(Route.status, "/status", access=Access.status, quiet=True),
    _get(Route.status, "/status.json", access=Access.status, quiet=True),
    # Ollama's listing routes, relayed to an Ollama backend.
    _get(Route.other, "/api/tags", api=Api.ollama, backend_kind="ollama"),
    _get(Route.other, "/api/version", api=Api.ollama, backend_kind="ollama"),
    _get(Route.other, "/api/ps", api=Api.ollama, backend_kind="ollama"),
    # llama-server's side routes (and vLLM's /tokenize, /detokenize), passed through to
    # the backend the body's "model" (a GET's ?model=) names: gateway.http.side.
    _side(Route.tokenize, "/tokenize"),
    _side(Route.detokenize, "/detokenize"),
    _side(Route.apply_template, "/apply-template"),
    _side(Route.input_tokens, "/v1/chat/completions/input_tokens",
          aliases=("/chat/completions/input_tokens",)),
    _side(Route.input_tokens, "/v1/responses/input_tokens",
          aliases=("/responses/input_tokens",)),
    _side(Route.props, "/props", "GET"),
    _side(Route.models, "/models", "GET"),  # the backend's own list (not /v1/models)
    _side(Route.lora_adapters, "/lora-adapters", "GET"),
    # Each slot's settings of the request it runs (and, on older builds, its prompt):
    # the admin key when one is set, as the status page, never a tenant's key alone.
    _side(Route.slots, "/slots", "GET", access=Access.status),
    # Listed by GET, run by POST (also registered, gateway.http.side); a llama-server
    # router answers it itself, for no model. Relayed only with server.relay_tools.
    _side(Route.tools, "/tools", "GET"),
)

#: The admin routes' common prefix: each checks ``server.admin_key`` itself.
ADMIN_PREFIX = "/admin/"

#: Each path's entry, its aliases' too.
BY_PATH: dict[str, RouteSpec] = {path: spec for spec in ROUTES for path in spec.paths}

#: ``GET /backends/{name}/metrics``: a backend's own /metrics, with scrape access.
BACKENDS_PREFIX = "/backends/"
#: ``POST /slots/{id}?action=...``: llama-server's slot actions (refused).
SLOTS_PREFIX = "/slots/"

#: The entries of the routes whose body the gateway reads, by name.
BY_NAME: dict[str, RouteSpec] = {spec.name: spec for spec in ROUTES if spec.parser}

#: Generation routes forwarded under admission (OpenAI's, Anthropic's and llama-server's
#: paths; Ollama's native ones are served apart): path → route name.
FORWARDED: dict[str, str] = {path: spec.name for spec in ROUTES for path in spec.paths
                             if spec.forwarded and spec.backend_kind is None}

#: Every path's ``route`` label in gateway_requests_total (another path's is ``other``;
#: an alias has its twin's).
LABELS: dict[str, str] = {path: spec.name for spec in ROUTES for path in spec.paths
                          if spec.name is not Route.other}

#: The routes the middleware serves itself, past the framework's routing (``POST``
#: path → route name): every forwarded one, under each of its paths.
DIRECT: dict[str, str] = {path: spec.name for spec in ROUTES for path in spec.paths
                          if spec.forwarded}

#: The side routes (:mod:`gateway.http.side`): path → entry.
SIDE: dict[str, RouteSpec] = {path: spec for spec in ROUTES for path in spec.paths
                              if spec.side}


def _paths(specs: Iterable[RouteSpec]) -> frozenset[str]:
    return frozenset(path for spec in specs for path in spec.paths)


#: Paths whose access lines are DEBUG when they succeed: probes, scrapes, the status page.
QUIET_PATHS = _paths(s for s in ROUTES if s.quiet)
#: Paths whose access lines are always DEBUG: the load balancer's probes.
PROBE_PATHS = _paths(s for s in ROUTES if s.probe)
#: The status page and its JSON.
STATUS_PATHS = _paths(s for s in ROUTES if s.name is Route.status)
#: Paths a browser holding the status page's credentials could read: never under CORS.
NO_CORS_PATHS = _paths(s for s in ROUTES if s.access is Access.status)
#: Paths that never need a key (probes).
OPEN_PATHS = _paths(s for s in ROUTES if s.access is Access.open)

#: What the gateway serves, as a 404 names it: ``"POST /v1/chat/completions, …, GET …"``.
SERVED = ", ".join([f"POST {p}" for s in ROUTES if s.method == "POST" for p in s.paths]
                   + [f"GET {p}" for s in ROUTES if s.method == "GET" for p in s.paths]
                   + [f"GET {BACKENDS_PREFIX}{{name}}/metrics"])


# The API of a path the table does not name, by its prefix (a 404 under /api/ is
# answered as Ollama answers, one under /v1/messages as Anthropic does).
_API_PREFIXES = (("/api/", Api.ollama), ("/v1/messages", Api.anthropic))


def api_of(path: str) -> Api:
    """The API whose shape a request on ``path`` is answered in: its entry's, else the
    one its prefix belongs to (Ollama's native API under ``/api/``, Anthropic's under
    ``/v1/messages``), else OpenAI's."""
    spec = BY_PATH.get(path)
    if spec is not None:
        return spec.api
    return next((api for prefix, api in _API_PREFIXES if path.startswith(prefix)),
                Api.openai)


def _backend_metrics(path: str) -> bool:
    return path.startswith(BACKENDS_PREFIX) and path.endswith("/metrics") \
        and path.count("/") == 3


def access_of(path: str) -> Access:
    """Who may call ``path``: its entry's :class:`Access`; :attr:`Access.admin` under
    :data:`ADMIN_PREFIX`; :attr:`Access.scrape` for a backend's metrics
    (``/backends/{name}/metrics``, as ``/metrics``); a tenant's key for any other path (an
    unknown one too, so that a client without a key learns nothing of what exists)."""
    spec = BY_PATH.get(path)
    if spec is not None:
        return spec.access
    if path.startswith(ADMIN_PREFIX):
        return Access.admin
    return Access.scrape if _backend_metrics(path) else Access.tenant


def label_of(path: str) -> str:
    """The ``route`` label of a request on ``path``: its entry's name (an alias's twin's),
    ``slots`` for a slot action, ``backend_metrics`` for a backend's metrics, else
    ``other``."""
    label = LABELS.get(path)
    if label is not None:
        return label
    if path.startswith(SLOTS_PREFIX):
        return Route.slots
    return Route.backend_metrics if _backend_metrics(path) else Route.other
