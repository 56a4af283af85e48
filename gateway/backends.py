"""Backend kinds: how to discover capacity, count prompt tokens and read errors.

Only llama-server (``kind = "llama.cpp"``) is implemented. A new kind provides the same
methods as :class:`LlamaCppBackend`; the proxy and admission code do not change.
"""

from __future__ import annotations

import asyncio
import json
import logging
import random
from dataclasses import dataclass
from typing import Any

import httpx

from gateway.admission import Admission, Clock, Lease, MonotonicClock
from gateway.capacity import Layout
from gateway.config import AdmissionSettings, BackendSettings
from gateway.errors import (
    BackendNotReady,
    GatewayError,
    InvalidRequest,
    UpstreamAuthFailed,
    UpstreamContextOverflow,
    UpstreamError,
    UpstreamRefused,
    UpstreamUnavailable,
)
from gateway.slotwatch import SlotsUnsupported, SlotView, SlotWatch, Ticket, parse_slots
from gateway.upstream import map_upstream_errors

__all__ = ["Backend", "Discovered", "LlamaCppBackend", "build_backend"]

log = logging.getLogger(__name__)

CONTEXT_OVERFLOW_TEXT = "Context size has been exceeded"
# llama-server's "no seed given": LLAMA_DEFAULT_SEED (0xFFFFFFFF) draws a random one; -1
# in JSON reads as the same value (tools/server/server-schema.cpp, common/common.h).
_RANDOM_SEED = 0xFFFFFFFF

# Side calls (discovery, counting) go through their own small pool (SIDE_CONNECTIONS).
# llama-server's HTTP server keeps a worker thread per open connection, and it has
# n_parallel + 2 of them by default (tools/server/server.cpp); generations are bounded by
# the slots through admission, so slots + 2 connections never starve it, while a burst of
# counts over one big pool would park idle connections on every thread until keep-alive ends.
SIDE_CONNECTIONS = 2

# Route name -> upstream path (OpenAI-compatible in llama-server, tools/server/server.cpp).
ROUTE_PATHS = {"chat": "/v1/chat/completions", "completions": "/v1/completions"}


@dataclass(frozen=True)
class Discovered:
    """What the backend says of itself over HTTP.

    :param slots: ``/props`` ``total_slots``.
    :param ctx_per_slot: ``/props`` ``default_generation_settings.n_ctx`` (tokens).
    """

    slots: int
    ctx_per_slot: int


class LlamaCppBackend:
    """A llama-server backend (``shared/design/backends.md`` §1).

    :param settings: the ``[[backends]]`` entry.
    :param admission_settings: queue bounds shared by all backends.
    :param client: the shared upstream client (generations).
    :param clock: time source for the admission queue.
    :param side_client: client for discovery and counting calls, with at most
        ``SIDE_CONNECTIONS`` connections; defaults to ``client``.
    """

    kind = "llama.cpp"

    def __init__(
        self,
        settings: BackendSettings,
        admission_settings: AdmissionSettings,
        client: httpx.AsyncClient,
        clock: Clock | None = None,
        side_client: httpx.AsyncClient | None = None,
    ) -> None:
        self.settings = settings
        self.name = settings.name
        self.client = client
        self.side_client = side_client or client
        self.reachable = False
        self.discovered: Discovered | None = None
        self._input_tokens_route = True  # cleared when the build lacks it (404)
        self._rediscovery: asyncio.Task[None] | None = None
        self._pool_penalty = 0  # tokens taken off the unified pool after overflows
        self._rng = random.Random()
        self.n_vocab: int | None = None  # /v1/models meta.n_vocab, once read
        self.problem: str | None = None  # why the last discovery failed
        self.clock = clock or MonotonicClock()
        self.admission = Admission(
            self._configured_layout(None),
            max_queue=admission_settings.max_queue,
            max_wait_s=admission_settings.max_queue_wait_s,
            clock=self.clock,
        )
        self.slot_watch = SlotWatch(
            self.name, self.read_slots, self.admission, self.clock,
            unseen_timeout_s=admission_settings.abandon_confirm_timeout_s,
            fallback_grace_s=admission_settings.disconnect_grace_s,
        )

    @property
    def timeout(self) -> httpx.Timeout:
        """Per-request timeout: connect, and longest silence while reading (seconds)."""
        s = self.settings
        return httpx.Timeout(s.read_timeout_s, connect=s.connect_timeout_s)

    @property
    def side_timeout(self) -> httpx.Timeout:
        """Timeout of discovery and counting calls: these answer in milliseconds, so a
        backend silent for 30 s is treated as unable to answer (seconds)."""
        return httpx.Timeout(min(30.0, self.settings.read_timeout_s),
                             connect=self.settings.connect_timeout_s)

    def tag_request(self, body: dict[str, Any]) -> tuple[str, int] | None:
        """Tag ``body`` so that the request can be recognised in ``GET /slots``, and
        return the tag as ``(param, value)`` (:mod:`gateway.slotwatch`).

        The tag is a random ``n_discard``: llama-server reads it only for a context
        shift (``server-context.cpp``, clamped there), and a request inside its
        reservation never reaches the end of its slot. If the client set ``n_discard``,
        a random ``seed`` instead, when the client set none (``-1`` and 0xFFFFFFFF mean
        "random" to llama-server too). ``None`` when the client set both.
        """
        if "n_discard" not in body:
            name, value = "n_discard", self._rng.randrange(1, 2**31 - 1)
        elif body.get("seed") in (None, -1, _RANDOM_SEED):
            name, value = "seed", self._rng.randrange(_RANDOM_SEED)
        else:
            return None
        body[name] = value
        return name, value

    @staticmethod
    def pin(body: dict[str, Any], lease: Lease, prompts: int) -> dict[str, Any]:
        """``body`` with ``id_slot`` set to the lease's first slot, for a single prompt;
        a client's own ``id_slot`` is overwritten (the gateway assigns the slots).

        llama-server runs a task on the slot it names, or defers it until that slot is
        free (``get_available_slot``/``process_single_task`` in ``server-context.cpp``).
        A batch of prompts is not pinned, and loses any ``id_slot``: every task of a
        batch reads the same one, so they would run one after another.
        """
        if prompts > 1 or not lease.slot_ids:
            return {k: v for k, v in body.items() if k != "id_slot"}
        return {**body, "id_slot": lease.slot_ids[0]}

    def release_abandoned(self, lease: Lease, ticket: Ticket, *, served: bool) -> None:
        """Keep ``lease`` until ``GET /slots`` shows the abandoned request ended."""
        self.slot_watch.hold(lease, ticket, served=served)

    async def read_slots(self) -> list[SlotView]:
        """Read ``GET /slots`` (``tools/server/server-context.cpp``, ``get_slots``).

        :raises SlotsUnsupported: the server answers 501 (started with ``--no-slots``)
            or 404 (a build without the endpoint).
        :raises UpstreamUnavailable: the backend cannot be connected to.
        :raises UpstreamError: any other failure or an answer of the wrong shape.
        """
        with map_upstream_errors(self.name):
            resp = await self.side_get("/slots")
        if resp.status_code in (404, 501):
            raise SlotsUnsupported(self.name)
        try:
            if resp.status_code != 200:
                raise ValueError(f"HTTP {resp.status_code}")
            return parse_slots(resp.json())
        except ValueError as exc:
            raise UpstreamError(f"Backend {self.name!r} answered /slots oddly: {exc}") from exc

    async def side_get(self, path: str) -> httpx.Response:
        """``GET path`` on the side pool, with the backend's API key when configured."""
        return await self.side_client.get(self.url(path), timeout=self.side_timeout,
                                          headers=self.settings.auth_headers)

    def url(self, path: str) -> str:
        """Absolute upstream URL for ``path``."""
        return self.settings.url + path

    @property
    def ready(self) -> bool:
        """True once the backend answered and its layout is known."""
        return self.reachable and self.admission.layout is not None

    def _configured_layout(self, found: Discovered | None) -> Layout | None:
        """Config wins over discovery for each value (config is the operator's word)."""
        s = self.settings
        slots = s.slots or (found.slots if found else None)
        ctx = s.ctx_per_slot or (found.ctx_per_slot if found else None)
        if slots is None or ctx is None:
            return None
        if not s.kv_unified:
            return Layout(slots, ctx)
        pool = max(ctx, (s.pool_tokens or ctx) - self._pool_penalty)
        return Layout(slots, ctx, pool_tokens=pool)

    def upstream_failed(self, kind: str) -> None:
        """React to an upstream failure of ``kind`` (a gateway_upstream_errors_total kind):
        re-read capacity; after a context overflow, also shrink the unified pool model."""
        if kind == "context_overflow":
            self._shrink_pool()
        self.request_rediscovery()

    def _shrink_pool(self) -> None:
        """The backend overflowed its pool, so the model of P was too large: take 10 % off
        (never below one slot's context; ``shared/design/backends.md`` §4.10)."""
        layout = self.admission.layout
        if layout is None or layout.pool_tokens is None:
            return
        if layout.pool_tokens <= layout.ctx_per_slot:
            return
        self._pool_penalty += max(1, layout.pool_tokens // 10)
        smaller = self._configured_layout(self.discovered)
        log.warning("backend %s overflowed its KV pool; pool model %d -> %s tokens", self.name,
                    layout.pool_tokens, smaller.pool_tokens if smaller else None)
        self.admission.set_layout(smaller)

    async def discover(self) -> Layout | None:
        """Read ``/props`` and update the admission layout. The failure, if any, is kept
        in :attr:`problem` for the 503 that requests get meanwhile.

        :returns: the layout in force afterwards (``None`` while unknown).
        :raises GatewayError: the backend is unreachable, loading (503), refused the
            gateway's API key, or answered something that is not llama-server's
            ``/props``.
        """
        try:
            layout = await self._discover()
        except GatewayError as exc:
            self.problem = exc.message
            raise
        self.problem = None
        return layout

    async def _discover(self) -> Layout | None:
        try:
            with map_upstream_errors(self.name):
                resp = await self.side_get("/props")
        except GatewayError:
            self.reachable = False
            raise
        if resp.status_code == 503:
            self.reachable = False
            raise BackendNotReady(f"Backend {self.name!r} is loading its model.")
        if resp.status_code in (401, 403):
            self.reachable = False
            raise UpstreamAuthFailed(self._auth_problem(resp.status_code))
        try:
            props = resp.json()
            found = Discovered(
                slots=int(props["total_slots"]),
                ctx_per_slot=int(props["default_generation_settings"]["n_ctx"]),
            )
        except (ValueError, KeyError, TypeError) as exc:
            self.reachable = False
            raise UpstreamError(
                f"Backend {self.name!r} answered /props with HTTP {resp.status_code} "
                "that is not llama-server's shape."
            ) from exc
        self.reachable = True
        self._warn_disagreement(found)
        self.discovered = found
        if self.n_vocab is None:
            self.n_vocab = await self._read_n_vocab()
        layout = self._configured_layout(found)
        old = self.admission.layout
        if layout != old:
            log.log(
                logging.WARNING if old is not None else logging.INFO,
                "backend %s layout changed: %s -> %s", self.name, _describe(old), _describe(layout),
            )
            self.admission.set_layout(layout)
        return layout

    async def _read_n_vocab(self) -> int | None:
        """``meta.n_vocab`` of the model in ``GET /v1/models``, or ``None``."""
        try:
            with map_upstream_errors(self.name):
                resp = await self.side_get("/v1/models")
            n_vocab = resp.json()["data"][0]["meta"]["n_vocab"]
        except (GatewayError, ValueError, KeyError, IndexError, TypeError):
            return None
        return n_vocab if isinstance(n_vocab, int) and n_vocab > 0 else None

    def check_token_ids(self, prompts: tuple[str | tuple[int, ...], ...]) -> None:
        """Refuse token-id prompts with ids outside the model's vocabulary, as
        llama-server would (``server_tokens::validate``, ``tools/server/server-common.cpp``).

        :raises InvalidRequest: an id is ``>= n_vocab`` (when the vocabulary is known).
        """
        if self.n_vocab is None:
            return
        for prompt in prompts:
            if isinstance(prompt, tuple) and prompt and max(prompt) >= self.n_vocab:
                raise InvalidRequest(
                    f"prompt token id {max(prompt)} is outside the model's vocabulary of "
                    f"{self.n_vocab} tokens.", param="prompt",
                )

    def _auth_problem(self, status: int) -> str:
        given = "was refused" if self.settings.api_key else "is needed and none is configured"
        return (f"Backend {self.name!r} answered HTTP {status}: an API key {given}. "
                "Set backends[].api_key (or api_key_file) to the key llama-server was "
                "started with (--api-key).")

    def request_rediscovery(self) -> None:
        """Re-read capacity soon (after an upstream error); at most one read at a time."""
        if self._rediscovery is None or self._rediscovery.done():
            self._rediscovery = asyncio.ensure_future(self._rediscover())

    async def _rediscover(self) -> None:
        """Re-read capacity, every second until the backend answers again."""
        while True:
            try:
                await self.discover()
                return
            except GatewayError as exc:
                log.debug("backend %s re-discovery failed: %s", self.name, exc.message)
            await asyncio.sleep(1.0)

    def _warn_disagreement(self, found: Discovered) -> None:
        s = self.settings
        for key, configured, seen in (
            ("slots", s.slots, found.slots),
            ("ctx_per_slot", s.ctx_per_slot, found.ctx_per_slot),
        ):
            if configured is not None and configured != seen and self.discovered != found:
                log.warning(
                    "backend %s: config says %s = %d but the backend reports %d; using config",
                    self.name, key, configured, seen,
                )

    async def count_prompt(self, route: str, body: dict[str, Any]) -> int | None:
        """Count the prompt tokens exactly as llama-server will, or ``None`` if it cannot.

        Chat: ``POST /v1/chat/completions/input_tokens`` (template applied); on builds
        without it (404), ``POST /apply-template`` then ``POST /tokenize``. Completions:
        ``POST /tokenize`` with ``add_special`` and ``parse_special``, as the completion
        path tokenizes (``server-context.cpp``). Token-id prompts are counted directly.

        :raises InvalidRequest: the backend refused the body (a 4xx, or a 500 with an error
            message: llama-server answers 500 for a request it cannot parse or template,
            such as an image for a text-only model); the generation would fail the same way.
        :raises BackendNotReady: the backend is loading.
        :raises UpstreamUnavailable: the backend cannot be connected to (a re-discovery is
            started, so the next requests get 503 until it answers again).
        """
        try:
            with map_upstream_errors(self.name):
                if route == "chat":
                    return await self._count_chat(body)
                return await self._count_completion(body.get("prompt"))
        except (InvalidRequest, BackendNotReady, UpstreamAuthFailed):
            raise
        except UpstreamUnavailable:
            self.reachable = False
            self.request_rediscovery()
            raise
        except (GatewayError, ValueError, KeyError, TypeError) as exc:
            log.info("backend %s could not count tokens: %s", self.name, exc)
            return None

    async def _count_chat(self, body: dict[str, Any]) -> int | None:
        if self._input_tokens_route:
            resp = await self._side_post("/v1/chat/completions/input_tokens", body)
            if resp.status_code == 200:
                return int(resp.json()["input_tokens"])
            if resp.status_code != 404:
                return self._refused(resp)
            self._input_tokens_route = False
        resp = await self._side_post("/apply-template", body)
        if resp.status_code != 200:
            return self._refused(resp)
        return await self._tokenize(resp.json()["prompt"])

    async def _side_post(self, path: str, body: dict[str, Any]) -> httpx.Response:
        return await self.side_client.post(
            self.url(path), json=body, timeout=self.side_timeout,
            headers=self.settings.auth_headers,
        )

    def _refused(self, resp: httpx.Response) -> None:
        """Classify a failed counting call: the client's mistake (raise), loading
        (raise), or a backend that just cannot count (``None``: estimate instead)."""
        status = resp.status_code
        if status == 503:
            raise BackendNotReady(f"Backend {self.name!r} is loading.")
        if status in (401, 403):
            log.error("%s", self._auth_problem(status))
            raise UpstreamAuthFailed(self._auth_problem(status))
        message = _error_message(resp.content)
        client_fault = 400 <= status < 500 and status not in (404, 405, 501)
        if client_fault or (status == 500 and _is_error_object(resp.content)):
            raise InvalidRequest(f"Backend {self.name!r} refused the request: {message}")
        return None

    async def _count_completion(self, prompt: Any) -> int | None:
        if isinstance(prompt, list) and prompt and all(isinstance(t, int) for t in prompt):
            return len(prompt)
        if isinstance(prompt, str):
            return await self._tokenize(prompt)
        return None

    async def _tokenize(self, text: str) -> int | None:
        resp = await self._side_post(
            "/tokenize", {"content": text, "add_special": True, "parse_special": True}
        )
        if resp.status_code != 200:
            return self._refused(resp)
        return len(resp.json()["tokens"])

    def translate_error(
        self, status: int, body: bytes, retry_after: str | None = None
    ) -> tuple[GatewayError | None, str]:
        """Map an upstream error answer to a gateway error, or ``None`` to pass it on.

        :param retry_after: the upstream ``Retry-After`` header, if any (seconds); it is
            kept on the 503 the gateway answers.

        :returns: (error or None, kind label for ``gateway_upstream_errors_total``).
        500 "Context size has been exceeded." becomes a retryable 503 (the KV model was
        wrong); 503 (model loading) stays a 503 with Retry-After; other 5xx become 502.
        401/403 (the gateway's API key) become 502 ``upstream_error`` naming the key to
        set. Other 4xx answers pass through unchanged when they carry an OpenAI-style
        ``{"error": {...}}`` object, and are put in that shape (status kept) when empty
        or plain text.
        """
        message = _error_message(body)
        if status >= 500 and CONTEXT_OVERFLOW_TEXT in message:
            return (
                UpstreamContextOverflow(
                    f"Backend {self.name!r} ran out of KV cache ({message.strip()}); "
                    "the gateway's model of its pool was too large. Retry later.",
                    retry_after_s=self.admission.retry_after_s(),
                ),
                "context_overflow",
            )
        if status == 503:
            wait = _seconds(retry_after) or 1.0  # llama-server's 503 means "loading"
            return (
                BackendNotReady(f"Backend {self.name!r} is unavailable: {message}",
                                retry_after_s=wait),
                "status_5xx",
            )
        if status >= 500:
            return (
                UpstreamError(f"Backend {self.name!r} failed with HTTP {status}: {message}"),
                "status_5xx",
            )
        if status in (401, 403):  # the gateway's key, not the client's (the client's
            # Authorization header is never forwarded)
            log.error("%s", self._auth_problem(status))
            return UpstreamAuthFailed(self._auth_problem(status)), "auth"
        if not _is_error_object(body):
            shown = message.strip() or "no error message"
            return UpstreamRefused(
                f"Backend {self.name!r} refused the request with HTTP {status}: {shown}.",
                status_code=status, retry_after=retry_after,
            ), ""
        return None, ""

    def is_overflow_event(self, data: dict[str, Any]) -> bool:
        """True when an SSE ``data`` object is llama-server's mid-stream overflow error."""
        err = data.get("error")
        return isinstance(err, dict) and CONTEXT_OVERFLOW_TEXT in str(err.get("message", ""))


def _describe(layout: Layout | None) -> str:
    if layout is None:
        return "unknown"
    kind = f"unified pool {layout.pool_tokens}" if layout.unified else "per-slot KV"
    return f"{layout.slots} slots x {layout.ctx_per_slot} tokens, {kind}"


def _seconds(header: str | None) -> float | None:
    try:
        value = float(header) if header is not None else None
    except ValueError:
        return None
    return value if value is not None and value > 0 else None


def _is_error_object(body: bytes) -> bool:
    try:
        data = json.loads(body)
    except ValueError:
        return False
    return isinstance(data, dict) and isinstance(data.get("error"), dict)


def _error_message(body: bytes) -> str:
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


Backend = LlamaCppBackend


def build_backend(
    settings: BackendSettings,
    admission_settings: AdmissionSettings,
    client: httpx.AsyncClient,
    clock: Clock | None = None,
    side_client: httpx.AsyncClient | None = None,
) -> Backend:
    """Return the backend object for ``settings.kind``."""
    return LlamaCppBackend(settings, admission_settings, client, clock, side_client)
