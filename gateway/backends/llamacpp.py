"""llama-server (``kind = "llama.cpp"``): ``shared/design/backends.md`` §1.

Discovery reads ``/props`` (slots, slot context) and ``/v1/models`` (``n_vocab``);
counting uses llama-server's own endpoints, so it is exact; ``/slots`` shows each slot's
running or last task, which :mod:`gateway.admission.slotwatch` uses to confirm that an abandoned
request has ended.
"""

from __future__ import annotations

import logging
import random
from collections.abc import Mapping
from typing import Any, ClassVar

import httpx

from gateway.admission.lease import Lease
from gateway.admission.slotwatch import SlotsUnsupported, SlotView, parse_slots
from gateway.backends.base import (
    Discovered,
    ExactCount,
    ManyModels,
    SideCalls,
    auth_problem,
    count_or_none,
    error_message,
    is_error_object,
    openai_body,
    other_error,
    seconds,
)
from gateway.backends.upstream import map_upstream_errors
from gateway.core.capacity import Charge
from gateway.core.prefix import digest
from gateway.errors import (
    BackendNotReady,
    GatewayError,
    InvalidRequest,
    UpstreamAuthFailed,
    UpstreamContextOverflow,
    UpstreamError,
    UpstreamKind,
)
from gateway.wire.builds import CHAT_COUNT, SURVEY, BuildReport, lacks, read_survey
from gateway.wire.events import decode_pace
from gateway.wire.routes import Route
from gateway.wire.validation import ParsedRequest

__all__ = ["CONTEXT_OVERFLOW_TEXT", "ROUTER_OWN_PATHS", "SIDE_PATHS", "LlamaCpp"]

log = logging.getLogger(__name__)

CONTEXT_OVERFLOW_TEXT = "Context size has been exceeded"
_TOO_LARGE = "is too large to process"
# llama-server's "no seed given": LLAMA_DEFAULT_SEED (0xFFFFFFFF) draws a random one; -1
# in JSON reads as the same value (tools/server/server-schema.cpp, common/common.h).
_RANDOM_SEED = 0xFFFFFFFF
SLOTS_TIMEOUT_S = 5.0  # a /slots answer comes between two decode steps
#: Tokens the calibration request decodes (LlamaCpp.calibrate): enough for a pace over
#: the decode steps, few enough to take a fraction of a second on a small model.
CALIBRATION_TOKENS = 16
#: The longest a calibration request may stay silent, seconds: on a server whose slots
#: are all busy with other clients it waits for one, and discovery waits for it.
CALIBRATION_TIMEOUT_S = 5.0
SURVEY_TIMEOUT_S = 5.0  # each survey request (gateway.wire.builds): no generation
# Routes whose body llama-server counts itself, and where (tools/server/server.cpp).
_COUNT_ROUTES: dict[str, str] = {Route.messages: "/v1/messages/count_tokens",
                 Route.count_tokens: "/v1/messages/count_tokens",
                 Route.responses: "/v1/responses/input_tokens"}
RERANK_SEPARATORS = 3  # format_prompt_rerank adds EOS, SEP and EOS around query and doc
INFILL_MARKERS = 3  # FIM prefix, suffix and middle tokens


# llama-server's side routes, each under its alias too (tools/server/server.cpp),
# passed through by gateway.http.side.
SIDE_PATHS = frozenset({
    "/tokenize", "/detokenize", "/apply-template", "/props", "/models", "/lora-adapters",
    "/slots", "/v1/chat/completions/input_tokens", "/chat/completions/input_tokens",
    "/v1/responses/input_tokens", "/responses/input_tokens", "/tools",
})
#: The side routes a llama-server router answers itself rather than for one model
#: (tools/server/server.cpp registers them on the router's own server): relayed to the
#: router as they came. (Its ``GET /models`` the gateway answers: gateway.http.endpoints.)
ROUTER_OWN_PATHS = frozenset({"/tools"})


class Calibrated:
    """llama-server's calibration (:meth:`~gateway.backends.base.Dialect.calibrate`)
    and build survey (:meth:`~gateway.backends.base.Dialect.survey`)."""

    name: str
    side: SideCalls
    settings: Any
    input_tokens_route: bool

    async def calibrate(self) -> float | None:
        """Two completions of :data:`CALIBRATION_TOKENS` tokens after a few words
        (``ignore_eos``, no prompt cache), through the server's own ``/completion``: the
        lower of their ``timings.predicted_per_token_ms`` over 1000, seconds per token
        (measured: a fresh server's first answer decoded 7x slower than the next,
        while it allocates its compute graphs); ``None`` when both fail or show no
        timings (each within :data:`CALIBRATION_TIMEOUT_S`; nothing raised)."""
        body = {"prompt": "Count from one to twenty: one, two,", "n_predict": CALIBRATION_TOKENS,
                "ignore_eos": True, "temperature": 0, "cache_prompt": False}
        paces = []
        for _ in range(2):
            try:
                with map_upstream_errors(self.name):
                    resp = await self.side.post("/completion", body,
                                                timeout_s=CALIBRATION_TIMEOUT_S)
                pace = decode_pace(resp.json()) if resp.status_code == 200 else None
            except (GatewayError, ValueError):
                pace = None
            if pace is not None:
                paces.append(pace)
        return min(paces, default=None)

    async def survey(self) -> BuildReport:
        """Send :data:`~gateway.wire.builds.SURVEY` (within :data:`SURVEY_TIMEOUT_S`
        each) and read the statuses; a route the build lacks is not asked again
        (chat counting goes straight to ``/apply-template``). Nothing is asked with
        ``backends[].survey`` off."""
        if not self.settings.survey:
            return BuildReport()
        status: dict[str, int | None] = {}
        for _, path, body in SURVEY:
            try:
                with map_upstream_errors(self.name):
                    resp = await (self.side.get(path, timeout_s=SURVEY_TIMEOUT_S)
                                  if body is None else
                                  self.side.post(path, body, timeout_s=SURVEY_TIMEOUT_S))
                status[path] = resp.status_code
            except GatewayError:
                status[path] = None
        report = read_survey(status)
        if lacks(status, CHAT_COUNT):
            self.input_tokens_route = False
        return report


class LlamaCpp(Calibrated, ExactCount):
    """The llama-server dialect.

    It is larger than the layering issue's class size (about 320 lines, 180 statements;
    ``tests/test_relay_layout.py`` holds it there) because a backend kind is one file and
    one class: discovery from ``/props``, the request check, pinning with ``id_slot``,
    ``/slots``, exact counting on four endpoints (chat template, completion, infill,
    plain tokenize) and the error bodies of this server. Each method is short.

    :param settings: the ``[[backends]]`` entry.
    :param side: the backend's side-call channel.
    """

    kind: ClassVar[str] = "llama.cpp"
    route_paths: ClassVar[Mapping[str, str]] = {
        Route.chat: "/v1/chat/completions", Route.completions: "/v1/completions",
        Route.responses: "/v1/responses", Route.messages: "/v1/messages",
        Route.count_tokens: "/v1/messages/count_tokens", Route.embeddings: "/v1/embeddings",
        Route.rerank: "/v1/rerank", Route.infill: "/infill", Route.completion: "/completion",
        Route.embedding: "/embedding",
    }
    side_paths: ClassVar[frozenset[str]] = SIDE_PATHS
    metrics_path: ClassVar[str | None] = "/metrics"  # with --metrics; else its 501
    unified_pool: ClassVar[bool] = True  # -np unset, or --kv-unified
    default_slots: ClassVar[int | None] = None  # always discovered from /props
    counts_exactly: ClassVar[bool] = True
    # Routes whose requests llama-server does not let the gateway place: /v1/messages
    # drops id_slot (and n_discard) when it converts the body (measured on the build in
    # use), so those leases are unpinned, like batches.
    unpinned_routes: ClassVar[frozenset[str]] = frozenset({Route.messages})
    resumable_routes: ClassVar[frozenset[str]] = frozenset({Route.chat, Route.completions})
    usage_covers_one_choice: ClassVar[bool] = True  # a whole n > 1 answer reports one choice
    # cpp-httplib ends a chunked answer's connection while announcing keep-alive: measured
    closes_streams: ClassVar[bool] = True  # (the next request on it gets no answer)
    needs_model: ClassVar[bool] = False  # one model (a router's member names its own)
    stop_margin: ClassVar[int] = 1  # generation stops at n_ctx - 1
    default_caps: ClassVar[Mapping[str, int]] = {}  # no cap of its own: the gateway's default

    def __init__(self, settings: Any, side: SideCalls) -> None:
        self.name = settings.name
        self.settings = settings
        self.side = side
        self.n_vocab: int | None = None  # /v1/models meta.n_vocab, once read
        self.model_id: str | None = None  # /v1/models id, once read
        self.input_tokens_route = True  # cleared when the build lacks it (404)
        self._rng = random.Random()

    # -- discovery ---------------------------------------------------------------------

    async def discover(self) -> Discovered | ManyModels:
        """Read ``/props`` (and ``/v1/models`` once, for ``n_vocab``); a router's
        ``/props`` (``role: router``) is :class:`~gateway.backends.base.ManyModels`.

        :raises BackendNotReady: 503, the model is loading.
        :raises UpstreamAuthFailed: 401/403, the gateway's ``api_key`` is missing or wrong.
        :raises UpstreamUnavailable: the server cannot be reached.
        :raises UpstreamError: an answer that is not llama-server's ``/props``.
        """
        with map_upstream_errors(self.name):
            resp = await self.side.get("/props")
        if resp.status_code == 503:
            raise BackendNotReady(f"Backend {self.name!r} is loading its model.")
        if resp.status_code in (401, 403):
            raise UpstreamAuthFailed(self._auth_problem(resp.status_code))
        try:
            props = resp.json()
            if isinstance(props, dict) and props.get("role") == "router":
                return ManyModels(props)
            slots = int(props["total_slots"])
            ctx = int(props["default_generation_settings"]["n_ctx"])
        except (ValueError, KeyError, TypeError) as exc:
            raise UpstreamError(
                f"Backend {self.name!r} answered /props with HTTP {resp.status_code} "
                "that is not llama-server's shape."
            ) from exc
        if self.n_vocab is None or self.model_id is None:
            await self._read_model()
        shown = [props.get(k) for k in ("model_path", "chat_template", "build_info")]
        return Discovered(slots=slots, ctx_per_slot=ctx, n_vocab=self.n_vocab,
                          model_id=self.model_id,
                          fingerprint=digest(shown) if any(shown) else None)

    async def _read_model(self) -> None:
        """``id`` and ``meta.n_vocab`` of the model in ``GET /v1/models``, where shown."""
        try:
            with map_upstream_errors(self.name):
                resp = await self.side.get("/v1/models")
            model = resp.json()["data"][0]
        except (GatewayError, ValueError, KeyError, IndexError, TypeError):
            return
        if not isinstance(model, dict):
            return
        n_vocab = (model.get("meta") or {}).get("n_vocab")
        if isinstance(n_vocab, int) and not isinstance(n_vocab, bool) and n_vocab > 0:
            self.n_vocab = n_vocab
        if isinstance(model.get("id"), str) and model["id"]:
            self.model_id = model["id"]

    def _auth_problem(self, status: int) -> str:
        return auth_problem(self.name, status, self.settings.api_key is not None, "llama-server")

    # -- requests ----------------------------------------------------------------------

    def check_request(self, req: ParsedRequest) -> None:
        """Refuse token-id prompts with ids outside the model's vocabulary, as
        llama-server would (``server_tokens::validate``, ``tools/server/server-common.cpp``).

        :raises InvalidRequest: an id is ``>= n_vocab`` (when the vocabulary is known).
        """
        if self.n_vocab is None:
            return
        for prompt in req.prompts:
            ids = [t for t in prompt if isinstance(t, int)] if isinstance(prompt, tuple) else []
            if ids and max(ids) >= self.n_vocab:
                raise InvalidRequest(
                    f"prompt token id {max(ids)} is outside the model's vocabulary of "
                    f"{self.n_vocab} tokens.", param="prompt",
                )

    def prepare_body(self, req: ParsedRequest, charge: Charge) -> dict[str, Any]:
        """The client's body with the charged cap in ``max_tokens`` and in
        ``max_completion_tokens``/``n_predict`` when the client used them (llama-server
        reads ``n_predict`` over ``max_tokens``, ``tools/server/server-schema.cpp``), and
        ``stream_options.include_usage`` on streams."""
        return openai_body(req, charge, ("max_completion_tokens", "n_predict"))

    def tag_request(self, body: dict[str, Any]) -> tuple[str, int] | None:
        """Tag ``body`` so that the request can be recognised in ``GET /slots``, and
        return the tag as ``(param, value)`` (:mod:`gateway.admission.slotwatch`).

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
    def pin(body: dict[str, Any], lease: Lease) -> dict[str, Any]:
        """``body`` with ``id_slot`` set to the lease's first slot; a client's own
        ``id_slot`` is overwritten (the gateway assigns the slots).

        llama-server runs a task on the slot it names, or defers it until that slot is
        free (``get_available_slot``/``process_single_task`` in ``server-context.cpp``).
        An unpinned lease (a batch of prompts, whose tasks would all read the same
        ``id_slot`` and run one after another, or any lease while a batch is in flight)
        loses any ``id_slot``.
        """
        if not lease.pinned:
            return {k: v for k, v in body.items() if k != "id_slot"}
        return {**body, "id_slot": lease.slot_ids[0]}

    async def read_slots(self) -> list[SlotView]:
        """Read ``GET /slots`` (``tools/server/server-context.cpp``, ``get_slots``).

        :raises SlotsUnsupported: the server answers 501 (started with ``--no-slots``)
            or 404 (a build without the endpoint).
        :raises UpstreamUnavailable: the backend cannot be connected to.
        :raises UpstreamError: any other failure or an answer of the wrong shape.
        """
        with map_upstream_errors(self.name):
            # A server shutting down can take a /slots request and never answer it.
            resp = await self.side.get("/slots", timeout_s=SLOTS_TIMEOUT_S)
        if resp.status_code in (404, 501):
            raise SlotsUnsupported(self.name)
        try:
            if resp.status_code != 200:
                raise ValueError(f"HTTP {resp.status_code}")
            return parse_slots(resp.json())
        except ValueError as exc:
            raise UpstreamError(f"Backend {self.name!r} answered /slots oddly: {exc}") from exc

    # -- counting ----------------------------------------------------------------------

    async def count_prompt(self, route: str, body: dict[str, Any]) -> int | None:
        """Count the prompt tokens exactly as llama-server will, or ``None`` if it cannot.

        Chat: ``POST /v1/chat/completions/input_tokens`` (template applied); on builds
        without it (404), ``POST /apply-template`` then ``POST /tokenize``. Completions:
        ``POST /tokenize`` with ``add_special`` and ``parse_special``, as the completion
        path tokenizes (``server-context.cpp``), a prompt of ids mixed with texts included.
        Token-id prompts are counted directly.

        :raises InvalidRequest: the backend refused the body (a 4xx, or a 500 with an error
            message: llama-server answers 500 for a request it cannot parse or template,
            such as an image for a text-only model); the generation would fail the same way.
        :raises BackendNotReady: the backend is loading.
        :raises UpstreamAuthFailed: the backend refused the gateway's API key.
        :raises UpstreamUnavailable: the backend cannot be connected to.
        """
        return await count_or_none(self.name, self._count(route, body))

    async def _count(self, route: str, body: dict[str, Any]) -> int | None:
        with map_upstream_errors(self.name):
            if route == Route.chat:
                return await self._count_chat(body)
            if route in _COUNT_ROUTES:
                return await self._count_by(_COUNT_ROUTES[route], body)
            if route == Route.infill:
                return await self._count_infill(body)
            counted = await self._count_completion(body.get("prompt"))
            if counted is not None and route == Route.rerank:
                counted += RERANK_SEPARATORS
            return counted

    async def _count_by(self, path: str, body: dict[str, Any]) -> int | None:
        """A route's own counting endpoint: ``{"input_tokens": N}``."""
        resp = await self.side.post(path, body)
        if resp.status_code != 200:
            return self._refused(resp)
        return int(resp.json()["input_tokens"])

    async def _count_infill(self, body: dict[str, Any]) -> int | None:
        """The pieces of an infill prompt, each tokenized, plus its special tokens:
        ``format_prompt_infill`` (``tools/server/server-common.cpp``) joins the extra
        context chunks (each with a file separator and its name), the prefix, the suffix
        and the prompt with the FIM prefix, suffix and middle tokens, and may trim the
        prefix and suffix to fit the batch, so this errs high."""
        total = 1 + INFILL_MARKERS  # BOS, and the FIM markers
        for key in ("input_prefix", "input_suffix", "prompt"):
            if body.get(key):
                total += await self._tokenize_plain(str(body[key]))
        for chunk in body.get("input_extra") or []:
            text = f"{chunk.get('filename', '')}\n{chunk.get('text', '')}"
            total += await self._tokenize_plain(text) + 1  # and a file separator
        return total

    async def _tokenize_plain(self, text: str) -> int:
        resp = await self.side.post("/tokenize", {"content": text, "add_special": False,
                                                  "parse_special": False})
        if resp.status_code != 200:
            self._refused(resp)
            raise ValueError(f"/tokenize answered HTTP {resp.status_code}")
        return len(resp.json()["tokens"])

    async def _count_chat(self, body: dict[str, Any]) -> int | None:
        if self.input_tokens_route:
            resp = await self.side.post("/v1/chat/completions/input_tokens", body)
            if resp.status_code == 200:
                return int(resp.json()["input_tokens"])
            if resp.status_code != 404:
                return self._refused(resp)
            self.input_tokens_route = False
        resp = await self.side.post("/apply-template", body)
        if resp.status_code != 200:
            return self._refused(resp)
        return await self._tokenize(resp.json()["prompt"])

    def _refused(self, resp: httpx.Response) -> int | None:
        """Classify a failed counting call: the client's mistake (raise), loading
        (raise), or a backend that cannot count (a count of ``None``: estimate)."""
        status = resp.status_code
        if status == 503:
            raise BackendNotReady(f"Backend {self.name!r} is loading.")
        if status in (401, 403):
            log.error("%s", self._auth_problem(status))
            raise UpstreamAuthFailed(self._auth_problem(status))
        message = error_message(resp.content)
        client_fault = 400 <= status < 500 and status not in (404, 405, 501)
        if client_fault or (status == 500 and is_error_object(resp.content)):
            raise InvalidRequest(f"Backend {self.name!r} refused the request: {message}")
        return None

    async def _count_completion(self, prompt: Any) -> int | None:
        if isinstance(prompt, list) and prompt and all(isinstance(t, int) for t in prompt):
            return len(prompt)
        if isinstance(prompt, (str, list)):  # a text, or ids mixed with texts
            return await self._tokenize(prompt)
        return None

    async def _tokenize(self, text: str | list[int | str]) -> int | None:
        """``POST /tokenize``: ``content`` is a text or a mixed array of ids and texts,
        tokenized as the completion path does (``tokenize_mixed``, BOS before a leading
        text only)."""
        resp = await self.side.post(
            "/tokenize", {"content": text, "add_special": True, "parse_special": True}
        )
        if resp.status_code != 200:
            return self._refused(resp)
        return len(resp.json()["tokens"])

    # -- errors ------------------------------------------------------------------------

    def translate_error(
        self, status: int, body: bytes, retry_after: str | None, *, retry_after_s: float
    ) -> GatewayError | None:
        """Map an upstream error answer to a gateway error, or ``None`` to relay it.

        :param retry_after: the upstream ``Retry-After`` header, if any (seconds); it is
            kept on the 503 the gateway answers.
        :param retry_after_s: the gateway's own estimate, for an overflow (seconds).
        :returns: the error (its ``upstream_kind`` the ``gateway_upstream_errors_total``
            kind, ``None`` for the client's mistakes), or ``None``.

        500 "Context size has been exceeded." becomes a retryable 503 (the KV model was
        wrong); 503 (model loading) stays a 503 with Retry-After; 501 (a feature the
        server lacks: embeddings without ``--embeddings``, infill without FIM tokens) is
        relayed; other 5xx become 502.
        401/403 (the gateway's API key) become 502 ``upstream_auth_failed`` naming the key
        to set. Other 4xx answers are relayed when they carry an ``{"error": {...}}``
        object (put in the OpenAI shape by the proxy), and become ``upstream_refused``
        (status kept) when empty or plain text.
        """
        message = error_message(body)
        if status >= 500 and CONTEXT_OVERFLOW_TEXT in message:
            return UpstreamContextOverflow(
                f"Backend {self.name!r} ran out of KV cache ({message.strip()}); "
                "the gateway's model of its pool was too large. Retry later.",
                retry_after_s=retry_after_s,
            )
        if status == 503:
            wait = seconds(retry_after) or 1.0  # llama-server's 503 means "loading"
            return BackendNotReady(f"Backend {self.name!r} is unavailable: {message}",
                                   retry_after_s=wait, kind=UpstreamKind.status_5xx)
        if status == 500 and _TOO_LARGE in message:
            # An embedding input over the physical batch (tools/server/server-context.cpp):
            # the same request can never succeed, so it is the client's to change.
            return InvalidRequest(f"Backend {self.name!r}: {message.strip()} Shorten the "
                                  "input.", param="input")
        if status == 501 and is_error_object(body):
            return None  # a feature this server lacks (--embeddings, FIM tokens): relayed
        return other_error(self.name, status, body, retry_after, self._auth_problem(status))

    def is_overflow_event(self, data: dict[str, Any]) -> bool:
        """True when an SSE ``data`` object is llama-server's mid-stream overflow error."""
        err = data.get("error")
        return isinstance(err, dict) and CONTEXT_OVERFLOW_TEXT in str(err.get("message", ""))
