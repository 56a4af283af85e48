"""Ollama (``kind = "ollama"``): ``shared/design/backends.md`` §2, from Ollama's sources.

* **Capacity, per-slot.** Ollama launches llama-server with ``-c NumCtx×NumParallel -np
  NumParallel`` (``llm/llama_server.go``), so every slot has its own context. The slot
  count is ``OLLAMA_NUM_PARALLEL``, which no endpoint shows: ``backends[].slots``
  (default 1, Ollama's own default). A slot's context is ``/api/ps`` ``context_length``
  of the loaded model (the smallest, if several are loaded); with nothing loaded, the
  configured ``ctx_per_slot``, else 4096 (Ollama's default below 23 GiB of VRAM,
  ``server/routes.go``).
* **Counting.** Ollama has no tokenize endpoint: prompts are estimated
  (:mod:`gateway.request.tokens`) and the estimate is calibrated per model from the
  ``prompt_eval_count`` of finished requests (:class:`Calibration`).
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

import logging
import math
from collections import deque
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

__all__ = ["Calibration", "Ollama"]

log = logging.getLogger(__name__)

DEFAULT_NUM_CTX = 4096
SUSPECT_MIN_TOKENS = 64  # shorter estimates are never taken for a truncation
_TOO_LONG = ("longer than the context length", "exceeds the context length")
# Ollama versions whose prompt_eval_count leaves out the prompt tokens found in its cache.
UNDERCOUNTING_VERSIONS = frozenset({"0.30.0"})
_BUSY = ("server busy", "maximum pending requests", "no slots")


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
    route_paths: ClassVar[dict[str, str]] = {
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
    stop_margin: ClassVar[int] = 1  # generation stops at n_ctx - 1
    default_caps: ClassVar[dict[str, int]] = {}  # no cap of its own: the gateway's default

    def __init__(self, settings: Any, side: SideCalls) -> None:
        self.name = settings.name
        self.settings = settings
        self.side = side
        self.calibration = Calibration()
        self.loaded: dict[str, int] = {}  # loaded model -> context_length (/api/ps)
        self.context_length = settings.ctx_per_slot or DEFAULT_NUM_CTX  # a slot's, tokens
        self.num_ctx_overridden = 0  # client num_ctx values replaced by the loaded one
        self.version: str | None = None  # as /api/version gives it

    async def discover(self) -> Discovered:
        """``GET /api/version`` (liveness) and ``GET /api/ps`` (loaded models' contexts).

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
            self.loaded = {m["name"]: int(m["context_length"]) for m in models
                           if isinstance(m, dict) and m.get("context_length")}
        except (ValueError, KeyError, TypeError, AttributeError) as exc:
            raise UpstreamError(f"Backend {self.name!r} does not answer like Ollama: {exc}"
                                ) from exc
        # A configured context is the operator's choice among the loaded models (an
        # embedding model of 512 tokens may sit beside the chat model): it stands.
        ctx = self.settings.ctx_per_slot or (min(self.loaded.values()) if self.loaded
                                             else DEFAULT_NUM_CTX)
        self.context_length = ctx
        return Discovered(slots=self.settings.slots or self.default_slots, ctx_per_slot=ctx)

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
        """``None``: Ollama cannot count; the gateway estimates."""
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
