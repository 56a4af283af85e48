"""What every backend kind provides, and the helpers the kinds share.

A kind (llama-server, later Ollama and vLLM) is one class that satisfies
:class:`Dialect`: it knows its server's endpoints, how to read its capacity, how to
count a prompt as the server will, how to prepare the body it forwards and how to read
its errors. Everything the kinds share at run time (admission, liveness, the discovery
loop, the pool penalty, the slot watch) lives in :class:`gateway.backends.target.Target`.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar, Protocol

import httpx

from gateway.admission.lease import Lease
from gateway.admission.slotwatch import SlotsUnsupported, SlotView
from gateway.backends.upstream import json_bytes, send_upstream, upstream_request
from gateway.config import BackendSettings
from gateway.core.capacity import Charge
from gateway.errors import (
    BackendNotReady,
    ClientError,
    GatewayError,
    UpstreamAuthFailed,
    UpstreamError,
    UpstreamKind,
    UpstreamRefused,
    describe,
)
from gateway.wire.builds import BuildReport
from gateway.wire.validation import ParsedRequest

if TYPE_CHECKING:  # (types only: the router's code is the fleet's, gateway.fleet.routers)
    from gateway.backends.router import RouterHub
    from gateway.backends.target import Target

__all__ = ["Dialect", "Discovered", "ExactCount", "ManyModels", "RouterRole", "SideCalls",
           "WithoutSlots", "auth_problem", "count_or_none", "error_message",
           "is_error_object", "openai_body", "other_error", "seconds", "upstream_5xx"]

log = logging.getLogger(__name__)

# Side calls (discovery, counting, /slots) go through their own small pool per backend.
# llama-server's HTTP server keeps a worker thread per open connection, and it has
# n_parallel + 2 of them by default (tools/server/server.cpp); generations are bounded by
# the slots through admission, so slots + 2 connections never starve it, while a burst of
# counts over one big pool would park idle connections on every thread until keep-alive ends.
SIDE_CONNECTIONS = 2


@dataclass(frozen=True)
class Discovered:
    """What a backend says of itself over HTTP.

    :param slots: concurrent requests it runs (llama-server ``/props`` ``total_slots``).
    :param ctx_per_slot: tokens one request may use (llama-server
        ``default_generation_settings.n_ctx``).
    :param n_vocab: the model's vocabulary size, when known.
    :param pool_tokens: the KV pool the server reports itself (vLLM's cache size in
        tokens); ``None`` where no endpoint shows it (llama-server, Ollama).
    :param block_size: tokens per KV block (vLLM's ``block_size``; 1 for cells).
    :param preemptions: the server's running count of preempted requests (vLLM
        ``vllm:num_preemptions_total``), when it shows one.
    :param model_id: the id of the model it serves (the first in ``GET /v1/models``),
        when known: the name clients use for it unless ``backends[].model`` is set.
    :param fingerprint: a digest of what it shows of its model file, chat template and
        build, when it shows them (llama-server's ``/props``): when it changes, prompts
        may count otherwise.
    """

    slots: int
    ctx_per_slot: int
    n_vocab: int | None = None
    pool_tokens: int | None = None
    block_size: int = 1
    preemptions: int | None = None
    model_id: str | None = None
    fingerprint: str | None = None


@dataclass(frozen=True)
class ManyModels:
    """A discovery's answer when the server runs many models, each its own backend and
    loaded on demand: llama-server in router mode (``/props`` with ``role: router``,
    ``get_router_props`` in ``tools/server/server-models.cpp``). The target becomes the
    hub of those models; the fleet makes one member backend per model
    (:mod:`gateway.fleet.routers`).

    :param props: the server's ``/props`` answer.
    """

    props: dict[str, Any]


async def _one_model(target: Target, found: Discovered | ManyModels) -> Discovered | None:
    """:attr:`RouterRole.settle` outside a fleet: a server of one model is itself.

    :raises UpstreamError: the server runs many models (only a fleet keeps their
        members).
    """
    if isinstance(found, ManyModels):
        raise UpstreamError(f"Backend {target.name!r} runs many models (a llama-server "
                            "router): only the gateway's fleet serves one.")
    return found


@dataclass
class RouterRole:
    """A target's part in a server of many models (``target.router``): llama-server's
    router mode.

    :ivar hub: the target is a router's hub: its
        :class:`~gateway.backends.router.RouterHub` (it serves nothing itself; ``None``
        otherwise).
    :ivar parent: the target is a member, serving one model of a router: its hub target.
    :ivar model_id: a member's model id at the router.
    :ivar settle: what becomes of each discovery's answer: the layout in force, or
        ``None`` for a hub. The fleet sets it (:func:`gateway.fleet.routers.settle`:
        many models make the target a hub and keep its members); alone, a target serves
        one model.
    """

    hub: RouterHub | None = None
    parent: Target | None = None
    model_id: str | None = None
    settle: Callable[[Target, Discovered | ManyModels], Awaitable[Discovered | None]] = (
        _one_model)


class SideCalls:
    """The small calls a kind makes to its server: discovery, counting, ``/slots``.

    Every call carries the backend's API key (``backends[].api_key``) and the side
    timeout: these answer in milliseconds, so a backend silent for 30 s is treated as
    unable to answer.

    :param settings: the ``[[backends]]`` entry.
    :param client: a client with at most :data:`SIDE_CONNECTIONS` connections.
    """

    def __init__(self, settings: BackendSettings, client: httpx.AsyncClient) -> None:
        self.client = client
        self.configure(settings)

    def configure(self, settings: BackendSettings) -> None:
        """Use ``settings`` (the backend's entry, at start or after a reload)."""
        self.settings = settings
        self.timeout = httpx.Timeout(min(30.0, settings.read_timeout_s),
                                     connect=settings.connect_timeout_s)

    def url(self, path: str) -> str:
        """Absolute upstream URL for ``path``."""
        return self.settings.url + path

    def _timeout(self, timeout_s: float | None) -> httpx.Timeout:
        """The side timeout, or a shorter read timeout of ``timeout_s`` seconds."""
        if timeout_s is None:
            return self.timeout
        return httpx.Timeout(min(timeout_s, self.settings.read_timeout_s),
                             connect=self.settings.connect_timeout_s)

    async def get(self, path: str, *, timeout_s: float | None = None) -> httpx.Response:
        """``GET path``. Raises httpx transport errors (map them with
        :func:`gateway.backends.upstream.map_upstream_errors`).

        :param timeout_s: a shorter read timeout for this call (seconds).
        """
        return await send_upstream(self.client, upstream_request(
            "GET", self.url(path), headers=self.settings.auth_headers,
            timeout=self._timeout(timeout_s)))

    async def post(self, path: str, body: dict[str, Any], *,
                   timeout_s: float | None = None) -> httpx.Response:
        """``POST path`` with a JSON body. Raises httpx transport errors.

        :param timeout_s: a shorter read timeout for this call (seconds).
        """
        return await send_upstream(self.client, upstream_request(
            "POST", self.url(path), content=json_bytes(body),
            timeout=self._timeout(timeout_s),
            headers={"content-type": "application/json", **self.settings.auth_headers}))


class Dialect(Protocol):
    """What differs between kinds of backend server: the kind's dialect of the APIs.

    (Not :class:`gateway.config.BackendKind`, the enum that names a kind in the
    configuration; a :class:`~gateway.backends.target.Target` holds one dialect, as
    ``target.dialect``.)

    ``route_paths`` maps the gateway's route names (``chat``, ``completions``) to the
    upstream paths the kind serves them on. ``side_paths`` are the side routes it serves
    (:data:`gateway.wire.routes.SIDE`: ``/tokenize``, ``/props``, …), passed through on
    the same path with no admission; ``metrics_path`` is its own Prometheus endpoint,
    relayed at ``/backends/{name}/metrics`` (``None``: it has none).
    """

    settings: BackendSettings  # its entry of the configuration (a reload replaces it)
    kind: ClassVar[str]
    route_paths: ClassVar[Mapping[str, str]]
    side_paths: ClassVar[frozenset[str]]
    metrics_path: ClassVar[str | None]
    unified_pool: ClassVar[bool]  # its slots may share one KV pool (kv_unified applies)
    counts_exactly: ClassVar[bool]  # count_prompt is the server's own count
    stop_margin: ClassVar[int]  # tokens of the context a request cannot use (Layout)
    usage_covers_one_choice: ClassVar[bool]  # whole answers report one choice of n > 1
    # The server closes the connection after a streamed answer, whatever it announces
    # (llama-server does): the gateway asks for the close, so that the connection is
    # never pooled for a next request that would then fail.
    closes_streams: ClassVar[bool]
    # The server picks the model by the body's "model", and refuses a body without one
    # (Ollama, vLLM): the gateway names the backend's own when the client named none.
    needs_model: ClassVar[bool]
    unpinned_routes: ClassVar[frozenset[str]]  # routes whose requests cannot be pinned
    default_caps: ClassVar[Mapping[str, int]]  # the server's own cap for an uncapped route
    # Routes whose streams the gateway can cancel and continue where they stopped (the
    # "predictive" policy's preemption); empty where the server schedules optimistically
    # itself (vLLM) or has no shared pool (Ollama).
    resumable_routes: ClassVar[frozenset[str]]

    async def discover(self) -> Discovered | ManyModels:
        """Read the server's capacity, or find that it runs many models (each loaded on
        demand: :class:`ManyModels`). Raises :class:`GatewayError` when it cannot."""

    async def calibrate(self) -> float | None:
        """The server's decode pace, seconds per output token, from a short request of
        the gateway's own at the first discovery (``backends[].calibrate``), or
        ``None`` where the kind cannot tell it without loading a model. Never raises."""

    async def survey(self) -> BuildReport:
        """What this build of the server lacks of what the gateway reads, and what the
        gateway does instead (:mod:`gateway.wire.builds`), asked at the first discovery
        of a reachable server. Never raises."""

    async def count_prompt(self, route: str, body: dict[str, Any]) -> int | None:
        """Prompt tokens as the server counts them, or ``None`` to estimate."""
        ...

    def estimate_factor(self, model: str, margin: float) -> float:
        """The multiplier on a raw local estimate for ``model`` (``margin`` by default)."""
        ...

    def observe(self, model: str, raw_estimate: int, reported: int) -> bool:
        """Learn from a finished request's reported prompt count; True when it suggests
        the server truncated the prompt."""
        ...

    def check_request(self, req: ParsedRequest) -> None:
        """Refuse, with a ``ClientError``, what the server would refuse (before counting)."""
        ...

    def prepare_body(self, req: ParsedRequest, charge: Charge) -> dict[str, Any]:
        """The body to forward, with the charged cap in the server's cap fields."""
        ...

    def tag_request(self, body: dict[str, Any]) -> tuple[str, int] | None:
        """Mark ``body`` so that :meth:`read_slots` can recognise it; the tag or ``None``."""
        ...

    def pin(self, body: dict[str, Any], lease: Lease) -> dict[str, Any]:
        """``body`` as sent once admitted on ``lease`` (slot pinning, where supported)."""
        ...

    async def read_slots(self) -> list[SlotView]:
        """The server's slots; raises ``SlotsUnsupported`` where it shows none."""
        ...

    def translate_error(
        self, status: int, body: bytes, retry_after: str | None, *, retry_after_s: float
    ) -> GatewayError | None:
        """An upstream error answer as a gateway error, or ``None`` to relay it. The
        error's ``upstream_kind`` is its ``gateway_upstream_errors_total`` kind (``None``:
        not a failure of the backend, such as a client's mistake it refused)."""
        ...

    def is_overflow_event(self, data: dict[str, Any]) -> bool:
        """True when a streamed error event means the server ran out of KV cache."""
        ...


# The fields llama-server also reads as a cap on any route (besides the route's own
# RouteSpec.cap_field): every one the client sent gets the charged cap too, so that no
# field lets a request past its reservation.
_CAP_ALIASES = ("max_tokens", "max_completion_tokens", "n_predict", "max_output_tokens")


def openai_body(req: ParsedRequest, charge: Charge, aliases: tuple[str, ...]
                ) -> dict[str, Any]:
    """The body to forward: the client's, with the charged cap in the route's cap field
    (``max_tokens``; ``max_output_tokens`` on Responses, ``n_predict`` on llama-server's
    native routes) and in each of ``aliases`` the client used (so that no field gets a
    request past its reservation), and, on OpenAI chat and completion streams,
    ``stream_options.include_usage`` so that completion tokens are known. Embeddings and
    rerank bodies, which generate nothing, are sent unchanged."""
    body = dict(req.body)
    spec = req.spec
    if not spec.generates:
        return body
    if not spec.openai_chunks:  # Messages, Responses, llama-server's native routes
        for alias in _CAP_ALIASES:
            if alias in body:
                body[alias] = charge.max_tokens
        body[spec.cap_field] = charge.max_tokens
        return body
    body["max_tokens"] = charge.max_tokens
    for alias in aliases:
        if alias in body:
            body[alias] = charge.max_tokens
    if req.stream:
        options = dict(body.get("stream_options") or {})
        options["include_usage"] = True
        body["stream_options"] = options
    return body


class WithoutSlots:
    """The slot hooks of a kind whose server shows no slots (Ollama, vLLM): requests are
    neither tagged nor pinned, and an abandoned one is held ``disconnect_grace_s``, since
    these servers cancel a request when its client leaves."""

    name: str

    def tag_request(self, body: dict[str, Any]) -> tuple[str, int] | None:
        """``None``: there are no slots to find a request in."""
        return None

    @staticmethod
    def pin(body: dict[str, Any], lease: Lease) -> dict[str, Any]:
        """``body`` unchanged: the server places its own requests."""
        return body

    async def read_slots(self) -> list[SlotView]:
        """:raises SlotsUnsupported: always."""
        raise SlotsUnsupported(self.name)

    async def calibrate(self) -> float | None:
        """``None``: a request would load a model the server may have unloaded (Ollama),
        and these servers' answers carry no timings (vLLM)."""
        return None

    async def survey(self) -> BuildReport:
        """Nothing: these kinds' routes are not surveyed (their builds were not checked)."""
        return BuildReport()


class ExactCount:
    """The calibration hooks of a kind whose server counts prompts itself (llama-server,
    vLLM): a local estimate is used only when counting failed, with the configured margin,
    and a reported count is never taken for a truncation."""

    def estimate_factor(self, model: str, margin: float) -> float:
        """The multiplier on a local estimate: ``margin``."""
        return margin

    def observe(self, model: str, raw_estimate: int, reported: int) -> bool:
        """Nothing to calibrate; never a truncation."""
        return False


async def count_or_none(name: str, counting: Awaitable[int | None]) -> int | None:
    """Await a kind's counting call (run under :func:`gateway.backends.upstream.map_upstream_errors`
    inside it); ``None`` when the server could not count, so that the gateway estimates.

    :raises ClientError: the server refused the body as the client's mistake.
    :raises BackendNotReady: the server is loading or busy.
    :raises UpstreamAuthFailed: the server refused the gateway's API key.
    :raises UpstreamUnavailable: the server cannot be connected to (``connect``).
    """
    try:
        return await counting
    except (ClientError, BackendNotReady, UpstreamAuthFailed):
        raise
    except GatewayError as exc:
        if exc.upstream_kind is UpstreamKind.connect:
            raise
        log.info("backend %s could not count tokens: %s", name, describe(exc))
    except (ValueError, KeyError, TypeError) as exc:
        log.info("backend %s could not count tokens: %s", name, describe(exc))
    return None


def auth_problem(name: str, status: int, key_set: bool, server: str) -> str:
    """What to tell the operator when ``server`` refused the gateway's API key (401/403)."""
    given = "was refused" if key_set else "is needed and none is configured"
    return (f"Backend {name!r} answered HTTP {status}: an API key {given}. Set "
            f"backends[].api_key (or api_key_file) to the key {server} was started with "
            "(--api-key).")


def other_error(name: str, status: int, body: bytes, retry_after: str | None,
                auth_problem: str) -> GatewayError | None:
    """The error answers every OpenAI-style kind maps alike, once its own are handled:
    other 5xx → 502 (kind ``status_5xx``); 401/403 → 502 ``upstream_auth_failed`` naming
    the key to set (kind ``auth``); an empty or plain-text 4xx → ``upstream_refused``
    with its status (no kind: the backend refused the request, it did not fail); a 4xx
    with an ``{"error": {...}}`` object is relayed (``None``).
    """
    message = error_message(body)
    if status >= 500:
        return upstream_5xx(name, status, message)
    if status in (401, 403):  # the gateway's key: the client's is never forwarded
        log.error("%s", auth_problem)
        return UpstreamAuthFailed(auth_problem)
    if not is_error_object(body):
        shown = message.strip() or "no error message"
        return UpstreamRefused(
            f"Backend {name!r} refused the request with HTTP {status}: {shown}.",
            status_code=status, retry_after=retry_after)
    return None


def upstream_5xx(name: str, status: int, message: str) -> UpstreamError:
    """A backend's 5xx answer the gateway does not translate otherwise: a 502 of kind
    ``status_5xx`` (counted, logged and acted on under that one kind)."""
    return UpstreamError(f"Backend {name!r} failed with HTTP {status}: {message}",
                         kind=UpstreamKind.status_5xx)


def seconds(header: str | None) -> float | None:
    """A positive number of seconds from a header value such as ``Retry-After``."""
    try:
        value = float(header) if header is not None else None
    except ValueError:
        return None
    return value if value is not None and value > 0 else None


def is_error_object(body: bytes) -> bool:
    """True when ``body`` is JSON with an ``error`` object."""
    try:
        data = json.loads(body)
    except ValueError:
        return False
    return isinstance(data, dict) and isinstance(data.get("error"), dict)


def error_message(body: bytes) -> str:
    """The message of an error answer: ``error.message``, a string ``error``, or the
    first 500 bytes of the body."""
    try:
        data = json.loads(body)
    except ValueError:
        return body[:500].decode("utf-8", errors="replace")
    if isinstance(data, dict):
        err = data.get("error")
        if isinstance(err, dict) and "message" in err:
            return str(err["message"])
        if isinstance(err, str):
            return err
    return body[:500].decode("utf-8", errors="replace")
