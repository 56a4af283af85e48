"""Ollama (``kind = "ollama"``): ``shared/design/backends.md`` §2, from Ollama's sources.

* **Capacity, per-slot.** Ollama launches llama-server with ``-c NumCtx×NumParallel -np
  NumParallel`` (``llm/llama_server.go``, ``server/sched.go``
  ``effectiveLlamaServerContext``), so every slot has its own context. The slot count is
  ``OLLAMA_NUM_PARALLEL`` (default 1, ``envconfig/config.go``), which no endpoint shows:
  ``backends[].slots``; a model Ollama runs one request at a time whatever it says (one
  without the ``completion`` capability, or of an architecture ``server/sched.go``
  ``load`` names) has one slot. A slot's context is ``/api/ps`` ``context_length`` of
  the loaded model (the runner's ``NumCtx``; the smallest, if several are loaded).
* **A model unloaded keeps its context.** After ``keep_alive`` (5 minutes by default)
  Ollama unloads the model and ``/api/ps`` is empty; the next request loads it again with
  the same context. The context learned while it was loaded is kept (:attr:`Ollama.contexts`),
  and before its first load a configured model's is read from ``POST /api/show``
  (:func:`shown_context`, Ollama's own choice of ``num_ctx``), so that a prompt too long
  for it is refused, not forwarded and silently cut. With neither, the configured
  ``ctx_per_slot``, else 4096 (Ollama's default below 23 GiB of VRAM,
  ``server/routes.go``).
* **Every model a request names** has its context known the same way, configured or
  not: its ``/api/show`` is read at its first request (:meth:`Ollama.count_prompt`),
  its ``/api/ps`` context kept across unloads, and a prompt over it refused
  (:meth:`Ollama.prepare_body`).
* **Counting.** Ollama has no tokenize endpoint: prompts are estimated
  (:mod:`gateway.request.tokens`), images at :data:`gateway.wire.validation.IMAGE_TOKENS`
  each on every route (``images`` natively, ``image_url`` parts on ``/v1``, which
  ``openai/openai.go`` turns into images; it refuses an ``input_audio`` part, or an
  http URL, with its own 400, which is relayed), and the estimate is calibrated per
  model from the ``prompt_eval_count`` of finished requests without media
  (:class:`Calibration`; what an image takes is the projector's, not the estimate's).
* **Never truncated silently.** Ollama drops the oldest messages of a chat that does not
  fit, and shifts a long completion prompt, and answers 200 (``server/prompt.go``,
  ``llm/llama_server.go``). The gateway refuses what its estimate puts over the slot,
  sends ``truncate: false`` on native requests, and counts a ``prompt_eval_count``
  far below its estimate as a suspected truncation.
* **Errors.** ``{"error": "..."}`` natively, ``{"error": {"message", "type"}}`` on
  ``/v1`` (``openai/openai.go``): "server busy … maximum pending requests exceeded"
  (503, ``server/sched.go``) and busy 500s become 503 + Retry-After; the over-length
  400s become ``context_length_exceeded``.
"""

from __future__ import annotations

import asyncio
import logging
import math
from collections import deque
from collections.abc import Mapping
from dataclasses import replace
from typing import Any, ClassVar

from gateway.backends.base import (
    Discovered,
    SideCalls,
    WithoutSlots,
    error_message,
    openai_body,
    seconds,
    upstream_5xx,
)
from gateway.backends.once import OnceAtATime
from gateway.backends.upstream import map_upstream_errors
from gateway.core.capacity import Charge
from gateway.errors import (
    BackendNotReady,
    ContextLengthExceeded,
    GatewayError,
    UpstreamError,
    UpstreamKind,
    UpstreamRefused,
)
from gateway.wire.routes import Api, Route
from gateway.wire.validation import ParsedRequest

__all__ = ["Calibration", "Ollama", "shown_context"]

log = logging.getLogger(__name__)

DEFAULT_NUM_CTX = 4096
#: Seconds a request for a model not seen before waits for its ``/api/show`` (Ollama
#: reads the model file's header; a large one on a slow disk may take longer: the
#: request then goes on the layout's context, and discovery learns the model's).
SHOW_ON_REQUEST_S = 5.0
_UNKNOWN_CTX = 1 << 40  # a default context no model has: "not known"
SUSPECT_MIN_TOKENS = 64  # shorter estimates are never taken for a truncation
_TOO_LONG = ("longer than the context length", "exceeds the context length")
# Ollama versions whose prompt_eval_count leaves out the prompt tokens found in its cache.
UNDERCOUNTING_VERSIONS = frozenset({"0.30.0"})
_BUSY = ("server busy", "maximum pending requests", "no slots")
# Ollama's own bounds on the num_ctx it loads a model with (server/sched.go getRunner):
MIN_NUM_CTX = 4
MIN_VISION_NUM_CTX = 2048  # "multimodal models require at least 2048 context"
# Architectures Ollama loads with num_parallel 1 whatever OLLAMA_NUM_PARALLEL says
# (server/sched.go load; ollama/ollama#4165).
SINGLE_PARALLEL_FAMILIES = frozenset({
    "mllama", "qwen3vl", "qwen3vlmoe", "qwen35", "qwen35moe", "qwen3next", "lfm2",
    "lfm2moe", "nemotron_h", "nemotron_h_moe", "nemotron_h_omni"})


def shown_context(show: dict[str, Any], default: int = DEFAULT_NUM_CTX
                  ) -> tuple[int, bool]:
    """The context one slot of a model will have once Ollama loads it, and whether it
    runs one request at a time, from its ``POST /api/show`` answer (``api/types.go``
    ``ShowResponse``).

    Ollama's choice (``server/routes.go`` ``modelOptions``, ``server/sched.go``
    ``getRunner`` and ``effectiveContext``, ``llm/server.go``): the Modelfile's
    ``num_ctx`` (the ``parameters`` text, one ``name value`` per line), else the
    server's default (``OLLAMA_CONTEXT_LENGTH``, else a tier of its VRAM: ``default``
    here, tokens); at least :data:`MIN_NUM_CTX`, at least :data:`MIN_VISION_NUM_CTX`
    for a model with the ``vision`` capability; at most the model's trained context
    (``model_info`` ``<general.architecture>.context_length``). One at a time: a model
    whose capabilities lack ``completion`` (an embedding model) or whose family is in
    :data:`SINGLE_PARALLEL_FAMILIES` (``server/sched.go`` ``load``).

    :param show: the decoded answer.
    :param default: the server's default context, tokens.
    :returns: (context per slot in tokens, one request at a time).
    :raises ValueError: ``show`` is not an object.
    """
    if not isinstance(show, dict):
        raise ValueError("/api/show did not answer an object")
    ctx = default
    for line in str(show.get("parameters") or "").splitlines():
        name, _, value = line.strip().partition(" ")
        if name == "num_ctx" and value.strip().isdigit():
            ctx = int(value.strip())
    capabilities = show.get("capabilities")
    capabilities = capabilities if isinstance(capabilities, list) else []
    ctx = max(ctx, MIN_NUM_CTX)
    if "vision" in capabilities:
        ctx = max(ctx, MIN_VISION_NUM_CTX)
    info = show.get("model_info")
    info = info if isinstance(info, dict) else {}
    trained = info.get(f"{info.get('general.architecture')}.context_length")
    if isinstance(trained, int) and not isinstance(trained, bool) and 0 < trained < ctx:
        ctx = trained
    details = show.get("details")
    family = details.get("family") if isinstance(details, dict) else None
    single = (bool(capabilities) and "completion" not in capabilities) or (
        isinstance(family, str) and family in SINGLE_PARALLEL_FAMILIES)
    return ctx, single


def _tagged(name: str) -> str:
    """A model name with its tag (``llama3.2`` is ``llama3.2:latest``), as ``/api/ps``
    names models (``types/model/name.go`` ``DisplayShortest``)."""
    return name if ":" in name.rsplit("/", 1)[-1] else name + ":latest"


class Calibration:
    """Per-model ratio of the backend's prompt count to the gateway's raw estimate.

    Until :data:`MIN_SAMPLES` requests have been seen, the configured
    ``estimate_margin`` is used. After, the factor is the 99th percentile of the last
    :data:`WINDOW` ratios plus 2 %, never below 1: a high quantile, so that the charge
    stays above the truth for nearly every request, rather than the mean.
    """

    MIN_SAMPLES = 20
    WINDOW = 200

    def __init__(self) -> None:
        self._ratios: dict[str, deque[float]] = {}

    def factor(self, model: str, margin: float) -> float:
        """The multiplier on the raw estimate for ``model``; ``margin`` until calibrated."""
        ratios = self._ratios.get(model)
        if ratios is None or len(ratios) < self.MIN_SAMPLES:
            return margin
        ordered = sorted(ratios)
        high = ordered[min(len(ordered) - 1, math.ceil(0.99 * len(ordered)) - 1)]
        return max(1.0, high * 1.02)

    def observe(self, model: str, raw_estimate: int, reported: int) -> None:
        """Record one finished request: the raw estimate and the backend's count."""
        if raw_estimate > 0 and reported > 0:
            self._ratios.setdefault(model, deque(maxlen=self.WINDOW)).append(
                reported / raw_estimate)


class Ollama(WithoutSlots):
    """The Ollama dialect.

    :param settings: the ``[[backends]]`` entry.
    :param side: the backend's side-call channel.
    """

    kind: ClassVar[str] = "ollama"
    route_paths: ClassVar[Mapping[str, str]] = {
        Route.chat: "/v1/chat/completions", Route.completions: "/v1/completions",
        Route.ollama_chat: "/api/chat", Route.ollama_generate: "/api/generate",
    }
    # None of llama-server's side routes; its own listing routes (/api/tags, /api/show,
    # ...) are relayed apart (gateway.http.endpoints.passthrough). No /metrics.
    side_paths: ClassVar[frozenset[str]] = frozenset()
    metrics_path: ClassVar[str | None] = None
    unified_pool: ClassVar[bool] = False
    default_slots: ClassVar[int] = 1
    counts_exactly: ClassVar[bool] = False
    unpinned_routes: ClassVar[frozenset[str]] = frozenset()
    resumable_routes: ClassVar[frozenset[str]] = frozenset()
    usage_covers_one_choice: ClassVar[bool] = False
    closes_streams: ClassVar[bool] = False  # Go's net/http keeps the connection open
    needs_model: ClassVar[bool] = True  # 404 model "" not found (server/routes.go)
    stop_margin: ClassVar[int] = 1  # generation stops at n_ctx - 1
    default_caps: ClassVar[Mapping[str, int]] = {}  # no cap of its own: the gateway's default

    def __init__(self, settings: Any, side: SideCalls) -> None:
        self.name = settings.name
        self.settings = settings
        self.side = side
        self.calibration = Calibration()
        self.loaded: dict[str, int] = {}  # loaded model -> context_length (/api/ps)
        # Every model's context as last seen loaded (/api/ps) or, before its first load,
        # as /api/show gives it; kept across unloads. Keys are tagged names.
        self.contexts: dict[str, int] = {}
        self.single: set[str] = set()  # models Ollama runs one request at a time
        self._shown: set[str] = set()  # models whose /api/show was read
        self._asked: set[str] = set()  # models a request named, /api/show asked for once
        self._shows: OnceAtATime[None] = OnceAtATime()  # /api/show calls running
        self._resting = 0  # the smallest loaded context, when models were last loaded
        self.context_length = settings.ctx_per_slot or DEFAULT_NUM_CTX  # a slot's, tokens
        self.num_ctx_overridden = 0  # client num_ctx values replaced by the loaded one
        self.version: str | None = None  # as /api/version gives it

    async def discover(self) -> Discovered:
        """``GET /api/version`` (liveness), ``GET /api/ps`` (loaded models' contexts) and,
        once, ``POST /api/show`` of the configured model (its context before it is
        first loaded, and whether Ollama runs it one request at a time).

        The layout's context: ``ctx_per_slot`` when configured; else the configured
        model's context (loaded now, or as last seen loaded, or as shown); else the
        smallest loaded context, or while nothing is loaded the one in force when models
        were last loaded; else 4096.

        :raises UpstreamUnavailable: Ollama cannot be reached.
        :raises UpstreamError: it answered something that is not Ollama's.
        """
        with map_upstream_errors(self.name):
            version = await self.side.get("/api/version")
            ps = await self.side.get("/api/ps")
        try:
            answer = version.json() if version.status_code == 200 else {}
            if "version" not in answer:
                raise ValueError(f"/api/version answered HTTP {version.status_code}")
            self._note_version(str(answer["version"]))
            models = ps.json().get("models") or []
            self.loaded = {_tagged(str(m["name"])): int(m["context_length"])
                           for m in models
                           if isinstance(m, dict) and m.get("context_length")}
        except (ValueError, KeyError, TypeError, AttributeError) as exc:
            raise UpstreamError(f"Backend {self.name!r} does not answer like Ollama: {exc}"
                                ) from exc
        self.contexts.update(self.loaded)  # what a model is loaded with, it comes back with
        if self.loaded:
            self._resting = min(self.loaded.values())
        model = self.settings.model
        if model is not None and _tagged(model) not in self._shown:
            await self._show(_tagged(model))
        # A configured context is the operator's choice among the loaded models (an
        # embedding model of 512 tokens may sit beside the chat model): it stands.
        self.context_length = self.settings.ctx_per_slot or self._context(model)
        slots = self.settings.slots or self.default_slots
        if model is not None and _tagged(model) in self.single:
            slots = 1  # Ollama loads it with num_parallel 1 (server/sched.go load)
        return Discovered(slots=slots, ctx_per_slot=self.context_length)

    def _context(self, model: str | None) -> int:
        """A slot's context, tokens, when none is configured (see :meth:`discover`)."""
        if model is not None:
            return self.contexts.get(_tagged(model), DEFAULT_NUM_CTX)
        if self.loaded:
            return min(self.loaded.values())
        return self._resting or DEFAULT_NUM_CTX

    async def _show(self, model: str, default: int | None = DEFAULT_NUM_CTX) -> None:
        """Read ``model``'s ``POST /api/show`` (:func:`shown_context`) once: its context
        until it is seen loaded, and whether it runs one request at a time. An answer
        that cannot be read, a refusal (404: the model is not pulled) or no answer in
        time (Ollama reading a large model's file) leaves both to the defaults, and it
        is asked again at the next discovery: ``/api/version`` and ``/api/ps`` have
        answered, so the backend is ready on what they say. Never raises.

        :param default: the server's default context, tokens, for a Modelfile without
            ``num_ctx``; ``None``: unknown (``OLLAMA_CONTEXT_LENGTH`` may say more than
            4096), so such a model's context is left to be seen loaded, unless its
            trained context bounds it."""
        try:
            with map_upstream_errors(self.name):
                resp = await self.side.post("/api/show", {"model": model})
            if resp.status_code != 200:
                raise ValueError(f"HTTP {resp.status_code}: {error_message(resp.content)}")
            ctx, single = shown_context(resp.json(), default or _UNKNOWN_CTX)
            if ctx >= _UNKNOWN_CTX:
                raise ValueError("no num_ctx in its Modelfile, nor a trained context")
        except (GatewayError, ValueError) as exc:
            log.info("backend %s: /api/show of %s unreadable (%s); its context is "
                     "learnt once it is loaded", self.name, model,
                     exc.message if isinstance(exc, GatewayError) else exc)
            return
        self._shown.add(model)
        self.contexts.setdefault(model, ctx)  # once seen loaded, /api/ps is the truth
        if single:
            self.single.add(model)
        log.info("backend %s: model %s has a context of %d tokens%s (/api/show)",
                 self.name, model, self.contexts[model],
                 ", one request at a time" if single else "")

    def _note_version(self, version: str) -> None:
        """Keep Ollama's version; warn once about one whose ``prompt_eval_count`` leaves
        out cached prompt tokens (0.30.0: the llama-server timings' ``prompt_n`` alone,
        ``llm/llama_server.go``; 0.30.1 adds ``cache_n``, ollama/ollama#16428), which
        makes a cached conversation look truncated and skews the calibration."""
        if version != self.version and version in UNDERCOUNTING_VERSIONS:
            log.warning("backend %s: Ollama %s counts only uncached prompt tokens in "
                        "prompt_eval_count; prompts that hit its cache will look truncated "
                        "and skew the estimate calibration. Use 0.30.1 or later.",
                        self.name, version)
        self.version = version

    async def count_prompt(self, route: str, body: dict[str, Any]) -> int | None:
        """``None``: Ollama cannot count; the gateway estimates. The first request for a
        model whose context is not known yet (one the configuration does not name,
        never seen loaded) has that model's ``POST /api/show`` read first, once, within
        :data:`SHOW_ON_REQUEST_S` (:meth:`prepare_body` checks its prompt against it)."""
        model = body.get("model")
        if isinstance(model, str) and model:
            tagged = _tagged(model)
            if tagged not in self.contexts and tagged not in self._asked:
                # Requests for it meanwhile wait for the same answer, not past it.
                try:
                    await asyncio.wait_for(self._shows.run(
                        tagged.encode(), lambda: self._show(tagged, default=None)),
                        SHOW_ON_REQUEST_S)
                except TimeoutError:
                    pass
                self._asked.add(tagged)  # (discovery asks again for the configured one)
        return None

    def estimate_factor(self, model: str, margin: float) -> float:
        """The multiplier on the raw local estimate for ``model`` (see :class:`Calibration`)."""
        return self.calibration.factor(model, margin)

    def check_request(self, req: ParsedRequest) -> None:
        """Nothing beyond validation: Ollama checks token ids itself."""

    def prepare_body(self, req: ParsedRequest, charge: Charge) -> dict[str, Any]:
        """The body with the charged cap: ``max_tokens`` on ``/v1`` (Ollama maps it to
        ``num_predict``, ``openai/openai.go``), ``options.num_predict`` natively, with
        ``truncate: false`` so that Ollama refuses rather than drops what does not fit
        (``api/types.go``, since v0.12.4). A client's ``options.num_ctx`` is replaced by
        the loaded context."""
        charge = self._within_model(req, charge)
        if req.api == Api.ollama:
            body = dict(req.body)
            options = dict(body.get("options") or {})
            options["num_predict"] = charge.max_tokens
            if "num_ctx" in options:
                # Another num_ctx makes Ollama reload the model with that context
                # (server/sched.go), which the layout admissions are checked against
                # would no longer describe: the loaded context is kept.
                options["num_ctx"] = self.context_length
                self.num_ctx_overridden += 1
            body["options"] = options
            body["truncate"] = False
            return body
        return openai_body(req, charge, ("max_completion_tokens",))

    def _within_model(self, req: ParsedRequest, charge: Charge) -> Charge:
        """``charge`` within the context of the model ``req`` names, when that one is
        known (seen loaded in ``/api/ps``, or shown by ``/api/show``, kept across
        unloads) and smaller than the layout's slot (the configured model's, or the
        smallest loaded): Ollama serves many models, each loaded with its own context,
        and would silently cut a prompt over it. The cap is lowered to the room left.

        :raises ContextLengthExceeded: the prompt leaves no room for one output token.
        """
        model = req.body.get("model")
        ctx = self.contexts.get(_tagged(model)) if isinstance(model, str) and model else None
        if ctx is None or ctx >= self.context_length:
            return charge
        room = ctx - self.stop_margin - charge.prompt_tokens
        if room < 1:
            raise ContextLengthExceeded(
                f"This request's prompt has about {charge.prompt_tokens} tokens, but model "
                f"{model!r} on backend {self.name!r} runs with a context of {ctx} tokens; "
                "Ollama would silently drop the start of it. Shorten the prompt.",
                n_prompt_tokens=charge.prompt_tokens, n_ctx=ctx)
        return charge if charge.max_tokens <= room else replace(charge, max_tokens=room)

    def translate_error(
        self, status: int, body: bytes, retry_after: str | None, *, retry_after_s: float
    ) -> GatewayError | None:
        """Map an Ollama error answer (either shape) to a gateway error, or ``None``.

        503 "server busy …" and 500s that say busy or "no slots" → 503 with Retry-After;
        400 "… longer than the context length …" / "… exceeds the context length" →
        400 ``context_length_exceeded``; other 5xx → 502; empty or plain-text 4xx →
        ``upstream_refused``; 4xx with an error (object or string) is relayed.
        """
        message = error_message(body)
        lowered = message.lower()
        if status == 503 or (status >= 500 and any(b in lowered for b in _BUSY)):
            wait = seconds(retry_after) or retry_after_s
            return BackendNotReady(f"Backend {self.name!r} is busy: {message}",
                                   retry_after_s=wait, kind=UpstreamKind.status_5xx)
        if status >= 500:
            return upstream_5xx(self.name, status, message)
        if status == 400 and any(t in lowered for t in _TOO_LONG):
            return ContextLengthExceeded(f"Backend {self.name!r}: {message}")
        if not message.strip() or not body.lstrip().startswith(b"{"):
            return UpstreamRefused(
                f"Backend {self.name!r} refused the request with HTTP {status}: "
                f"{message.strip() or 'no error message'}.",
                status_code=status, retry_after=retry_after)
        return None

    def is_overflow_event(self, data: dict[str, Any]) -> bool:
        """False: Ollama's slots are private, so it has no shared pool to overflow."""
        return False

    def observe(self, model: str, raw_estimate: int, reported: int) -> bool:
        """Calibrate on a finished request; True when ``reported`` is so far below the
        raw estimate (under half, for estimates of at least ``SUSPECT_MIN_TOKENS``) that
        Ollama probably truncated the prompt."""
        # Short prompts are mostly template allowance, which varies by model.
        suspected = raw_estimate >= SUSPECT_MIN_TOKENS and reported * 2 < raw_estimate
        if suspected:
            log.warning("backend %s: model %s counted %d prompt tokens where the gateway "
                        "estimated %d; the prompt was probably truncated", self.name,
                        model, reported, raw_estimate)
        else:
            self.calibration.observe(model, raw_estimate, reported)
        return suspected
