"""vLLM (``kind = "vllm"``): ``shared/design/backends.md`` §3, from vLLM's sources.

* **Capacity, paged blocks.** vLLM keeps one pool of KV blocks for every running
  sequence. The pool is the ``kv_cache_size_tokens`` label of ``vllm:cache_config_info``
  in ``/metrics`` where vLLM exports it, else ``num_gpu_blocks × block_size`` from the
  same labels (:func:`parse_metrics`). A request holds ``ceil((prompt + cap) /
  block_size)`` blocks at its end, so the gateway reserves that many whole blocks
  (:class:`gateway.core.capacity.Layout` ``block_size``). vLLM itself admits on the first
  prefill chunk and preempts running requests when blocks run out (shared case P10),
  which is what the reservation prevents.
* **Limits.** ``max_model_len`` comes from ``GET /v1/models``, and vLLM refuses
  ``prompt + max_tokens > max_model_len`` with no token kept back
  (``tests/v1/e2e/test_context_length.py``: 2047 + 1 fits 2048): ``stop_margin`` 0.
  ``--max-num-seqs`` is shown nowhere: ``backends[].slots``, else vLLM's default.
  A missing cap is charged as vLLM defaults it: the room left (chat), at most 16 on
  ``/v1/completions`` (``completion/protocol.py``), within ``default_max_tokens``.
* **Counting.** ``POST /tokenize`` with ``messages`` (chat template applied) or
  ``prompt`` (``vllm/entrypoints/serve/tokenize/protocol.py``): exact.
* **Preemptions.** ``vllm:num_preemptions_total`` is read at every discovery; a rise
  while the gateway had work admitted shrinks the pool model
  (:meth:`gateway.backends.target.Target.discover`).
* **Its own queue limits.** With ``--max-num-queued-reqs`` (requests in flight, waiting
  or running, ``n`` counting ``n``) or ``--max-num-queued-tokens`` (prompt tokens of the
  requests still in prefill), vLLM refuses a request past either with 503 and
  ``{"error": {"message", "type": "Service Unavailable", "param": null, "code": 503}}``
  (``vllm/exceptions.py`` ``QueueOverflowError``, ``MaxQueuedTokensError``, raised by
  ``AsyncLLM.check_admission``, ``vllm/v1/engine/async_llm.py``; checked before the
  prompt is rendered, so a stream is refused before it starts). That 503 means "full
  now", not "failed": it becomes :class:`gateway.errors.BackendFull`, which the relay
  waits out on this backend or another of the model (:func:`gateway.relay.retry.requeue`)
  and which caps the backend's busy slots; it is never counted as an upstream error nor
  marks the backend down.
* **Errors.** ``{"error": {"message", "type", "param", "code"}}``: the context-length
  400s (every wording vLLM has used) become ``context_length_exceeded``; another 503
  (engine not ready) stays 503 with ``Retry-After``.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Mapping
from typing import Any, ClassVar

from prometheus_client.parser import text_string_to_metric_families

from gateway.backends.base import (
    Discovered,
    ExactCount,
    SideCalls,
    WithoutSlots,
    auth_problem,
    count_or_none,
    error_message,
    openai_body,
    other_error,
    seconds,
)
from gateway.backends.upstream import map_upstream_errors
from gateway.core.capacity import Charge
from gateway.errors import (
    BackendFull,
    BackendNotReady,
    ContextLengthExceeded,
    GatewayError,
    InvalidRequest,
    ModelNotFound,
    UpstreamAuthFailed,
    UpstreamError,
    UpstreamKind,
)
from gateway.wire.routes import Route
from gateway.wire.validation import ParsedRequest

__all__ = ["DEFAULT_BLOCK_SIZE", "DEFAULT_MAX_NUM_SEQS", "FULL_MESSAGES", "Vllm",
           "parse_metrics"]

log = logging.getLogger(__name__)

DEFAULT_MAX_NUM_SEQS = 256  # --max-num-seqs when unset (vllm/engine/arg_utils.py)
DEFAULT_BLOCK_SIZE = 16  # --block-size when unset on CUDA (vllm/config/cache.py)
# The wordings of vLLM's context-length 400 across versions (backends.md §3, §4.10).
_TOO_LONG = ("maximum context length", "context length is only", "maximum model length",
             "cannot be greater than max_model_len")
# vLLM's refusals for want of room (vllm/exceptions.py), by the cause they name.
FULL_MESSAGES = {
    "the engine is currently busy and cannot accept new requests": "queue_full",
    "reached its prefill token backlog limit": "prefill_backlog",
}
# /tokenize fields that change the count of a chat (the rest of a chat body is not read).
_CHAT_COUNT_FIELDS = ("model", "messages", "tools", "chat_template", "chat_template_kwargs",
                      "add_generation_prompt", "continue_final_message", "add_special_tokens",
                      "mm_processor_kwargs")


def parse_metrics(text: str) -> dict[str, int]:
    """What the gateway reads of vLLM's ``/metrics`` text (``vllm/v1/metrics/loggers.py``).

    ``vllm:cache_config_info`` is a gauge of 1 whose labels are the fields of vLLM's
    ``CacheConfig`` (``vllm/config/cache.py``): ``block_size``, ``num_gpu_blocks`` and,
    in newer versions, ``kv_cache_size_tokens``. With several engines (data parallel),
    each has its own pool and a request runs on one: the smallest is kept.
    ``vllm:num_preemptions_total`` is summed over its ``model_name``/``engine`` labels.

    :returns: any of ``block_size``, ``num_gpu_blocks``, ``kv_cache_size_tokens``,
        ``preemptions``.
    :raises ValueError: the text is not the Prometheus exposition format.
    """
    found: dict[str, int] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            name = sample.name
            if name == "vllm:cache_config_info":
                for key in ("block_size", "num_gpu_blocks", "kv_cache_size_tokens"):
                    value = sample.labels.get(key, "")
                    if value.isdigit() and int(value) > 0:
                        found[key] = min(found.get(key, int(value)), int(value))
            elif name == "vllm:num_preemptions_total" and math.isfinite(sample.value):
                found["preemptions"] = found.get("preemptions", 0) + int(sample.value)
    return found


class Vllm(WithoutSlots, ExactCount):
    """The vLLM dialect.

    :param settings: the ``[[backends]]`` entry.
    :param side: the backend's side-call channel.
    """

    kind: ClassVar[str] = "vllm"
    route_paths: ClassVar[Mapping[str, str]] = {
        Route.chat: "/v1/chat/completions", Route.completions: "/v1/completions",
    }
    # vLLM's own /tokenize and /detokenize (vllm/entrypoints/openai/api_server.py; its
    # bodies, not llama-server's), and its Prometheus /metrics.
    side_paths: ClassVar[frozenset[str]] = frozenset({"/tokenize", "/detokenize"})
    metrics_path: ClassVar[str | None] = "/metrics"
    unified_pool: ClassVar[bool] = True  # one block pool for every sequence
    default_slots: ClassVar[int] = DEFAULT_MAX_NUM_SEQS
    counts_exactly: ClassVar[bool] = True
    unpinned_routes: ClassVar[frozenset[str]] = frozenset()
    resumable_routes: ClassVar[frozenset[str]] = frozenset()
    usage_covers_one_choice: ClassVar[bool] = False  # completion_tokens sums every choice
    closes_streams: ClassVar[bool] = False  # uvicorn keeps the connection open
    needs_model: ClassVar[bool] = True  # 404 "The model `None` does not exist."
    stop_margin: ClassVar[int] = 0  # prompt + max_tokens <= max_model_len, strictly
    # vLLM's own cap when a request sets none, per route (None: the room left).
    default_caps: ClassVar[Mapping[str, int]] = {Route.completions: 16}

    def __init__(self, settings: Any, side: SideCalls) -> None:
        self.name = settings.name
        self.settings = settings
        self.side = side
        self.max_model_len: int | None = None
        self.metrics: dict[str, int] = {}  # the last /metrics read that succeeded

    # -- discovery ---------------------------------------------------------------------

    async def discover(self) -> Discovered:
        """``GET /v1/models`` (``max_model_len``; the smallest, if several models are
        served) and ``GET /metrics`` (pool, block size, preemptions).

        A ``/metrics`` that cannot be read leaves the pool to config (``pool_tokens``),
        else to one request's context.

        :raises BackendNotReady: ``/health`` or ``/v1/models`` answered 503 (the engine
            is dead or not ready; ``serve/instrumentator/health.py``).
        :raises UpstreamAuthFailed: 401/403, the gateway's ``api_key`` is missing or wrong.
        :raises UpstreamUnavailable: vLLM cannot be reached.
        :raises UpstreamError: ``/v1/models`` is not vLLM's shape.
        """
        with map_upstream_errors(self.name):
            health = await self.side.get("/health")
            resp = await self.side.get("/v1/models")
        if 503 in (health.status_code, resp.status_code):
            raise BackendNotReady(f"Backend {self.name!r} is not ready yet.")
        if resp.status_code in (401, 403):
            raise UpstreamAuthFailed(self._auth_problem(resp.status_code))
        try:
            lengths = [int(m["max_model_len"]) for m in resp.json()["data"]
                       if isinstance(m, dict) and m.get("max_model_len")]
            if resp.status_code != 200 or not lengths:
                raise ValueError("no model with max_model_len")
        except (ValueError, KeyError, TypeError) as exc:
            raise UpstreamError(
                f"Backend {self.name!r} answered /v1/models with HTTP {resp.status_code} "
                f"that is not vLLM's shape ({exc})."
            ) from exc
        self.max_model_len = min(lengths)
        metrics = await self._read_metrics()
        block = metrics.get("block_size") or DEFAULT_BLOCK_SIZE
        pool = metrics.get("kv_cache_size_tokens") or (
            metrics["num_gpu_blocks"] * block if "num_gpu_blocks" in metrics else None)
        return Discovered(
            slots=self.settings.slots or self.default_slots, ctx_per_slot=self.max_model_len,
            pool_tokens=pool, block_size=block, preemptions=metrics.get("preemptions"),
            model_id=_first_id(resp.json()["data"]),
        )

    async def _read_metrics(self) -> dict[str, int]:
        """``/metrics`` as :func:`parse_metrics` reads it; after a failed read, the last
        good one (a pool does not change without a restart, which ``/v1/models`` or a
        later read shows), else nothing (the pool then comes from config)."""
        try:
            with map_upstream_errors(self.name):
                resp = await self.side.get("/metrics")
            if resp.status_code != 200:
                raise ValueError(f"HTTP {resp.status_code}")
            self.metrics = parse_metrics(resp.text)
        except (GatewayError, ValueError, OverflowError) as exc:
            log.info("backend %s: /metrics unreadable (%s); keeping the last reading",
                     self.name, exc)
        return self.metrics

    def _auth_problem(self, status: int) -> str:
        return auth_problem(self.name, status, self.settings.api_key is not None, "vLLM")

    # -- requests ----------------------------------------------------------------------

    def check_request(self, req: ParsedRequest) -> None:
        """Nothing beyond validation: vLLM checks token ids itself."""

    def prepare_body(self, req: ParsedRequest, charge: Charge) -> dict[str, Any]:
        """The client's body with the charged cap in ``max_tokens`` (and in
        ``max_completion_tokens`` when the client used it, which vLLM reads first), and
        ``stream_options.include_usage`` on streams."""
        return openai_body(req, charge, ("max_completion_tokens",))

    # -- counting ----------------------------------------------------------------------

    async def count_prompt(self, route: str, body: dict[str, Any]) -> int | None:
        """Count the prompt exactly as vLLM will: ``POST /tokenize`` with the chat's
        ``messages`` (and what else changes the templated prompt) or the completion's
        ``prompt``; token-id prompts are counted directly.

        :returns: the count, or ``None`` (estimate instead) when vLLM cannot count.
        :raises InvalidRequest: vLLM refused the body as a client error (4xx); the
            generation would fail the same way.
        :raises ModelNotFound: vLLM serves no model of that name (404).
        :raises BackendNotReady: 503 or 429.
        :raises UpstreamAuthFailed: the gateway's API key was refused.
        :raises UpstreamUnavailable: vLLM cannot be connected to.
        """
        if route == Route.chat:
            query = {k: body[k] for k in _CHAT_COUNT_FIELDS if k in body}
            if "documents" in body:  # a chat's documents reach the template as a kwarg
                query["chat_template_kwargs"] = {**(body.get("chat_template_kwargs") or {}),
                                                 "documents": body["documents"]}
        else:
            prompt = body.get("prompt")
            if isinstance(prompt, list) and all(isinstance(t, int) for t in prompt):
                return len(prompt)
            if not isinstance(prompt, str):
                return None
            query = {k: body[k] for k in ("model", "add_special_tokens") if k in body}
            query["prompt"] = prompt
        return await count_or_none(self.name, self._tokenize(query))

    async def _tokenize(self, query: dict[str, Any]) -> int | None:
        with map_upstream_errors(self.name):
            resp = await self.side.post("/tokenize", query)
        if resp.status_code != 200:
            return self._refused(resp.status_code, resp.content)
        count = resp.json()["count"]
        if isinstance(count, int) and not isinstance(count, bool) and count >= 0:
            return count
        raise ValueError(f"count {count!r}")

    def _refused(self, status: int, body: bytes) -> int | None:
        """A failed ``/tokenize``: the client's mistake or an unready engine (raise), or
        a server that cannot count (``None``)."""
        if status in (429, 503):
            raise BackendNotReady(f"Backend {self.name!r} is busy or not ready (HTTP "
                                  f"{status}).")
        if status in (401, 403):
            raise UpstreamAuthFailed(self._auth_problem(status))
        message = error_message(body)
        if status == 404 and "does not exist" in message:
            raise ModelNotFound(f"Backend {self.name!r}: {message}", param="model")
        if status == 400 and any(t in message.lower() for t in _TOO_LONG):
            raise ContextLengthExceeded(f"Backend {self.name!r}: {message}")
        if 400 <= status < 500 and status not in (404, 405, 501):
            raise InvalidRequest(f"Backend {self.name!r} refused the request: {message}")
        log.info("backend %s could not count tokens: HTTP %d", self.name, status)
        return None

    # -- errors ------------------------------------------------------------------------

    def translate_error(
        self, status: int, body: bytes, retry_after: str | None, *, retry_after_s: float
    ) -> GatewayError | None:
        """Map a vLLM error answer to a gateway error, or ``None`` to relay it.

        400 naming the context length → ``context_length_exceeded``; 503 of a queue
        limit (:data:`FULL_MESSAGES`) → :class:`~gateway.errors.BackendFull` (no
        upstream kind); another 503 → 503 with the upstream's ``Retry-After`` (else the
        gateway's estimate); other 5xx → 502; 401/403 → 502 ``upstream_auth_failed``;
        empty or plain-text 4xx → ``upstream_refused``; other 4xx with an error object
        are relayed.
        """
        message = error_message(body)
        if status == 400 and any(t in message.lower() for t in _TOO_LONG):
            return ContextLengthExceeded(f"Backend {self.name!r}: {message}")
        if status == 503:
            wait = seconds(retry_after) or retry_after_s
            cause = next((c for text, c in FULL_MESSAGES.items()
                          if text in message.lower()), None)
            if cause is not None:
                return BackendFull(f"Backend {self.name!r} has no room now: {message}",
                                   cause=cause, retry_after_s=wait)
            return BackendNotReady(f"Backend {self.name!r} is unavailable: {message}",
                                   retry_after_s=wait, kind=UpstreamKind.status_5xx)
        return other_error(self.name, status, body, retry_after, self._auth_problem(status))

    def is_overflow_event(self, data: dict[str, Any]) -> bool:
        """False: vLLM preempts rather than failing when its blocks run out."""
        return False


def _first_id(models: list[Any]) -> str | None:
    """The ``id`` of the first model listed, when it is a non-empty string."""
    first = models[0] if models and isinstance(models[0], dict) else {}
    model_id = first.get("id")
    return model_id if isinstance(model_id, str) and model_id else None
