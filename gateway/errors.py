"""The gateway's exception hierarchy and its OpenAI-style JSON rendering.

Tree::

    GatewayError
    ├── ClientError (4xx, never forwarded, never retried by SDKs)
    │   ├── InvalidRequest            400 invalid_request
    │   ├── ContextLengthExceeded     400 context_length_exceeded
    │   ├── PayloadTooLarge           413
    │   ├── UnsupportedMediaType      415
    │   ├── HeadersTooLarge           431
    │   ├── Unauthorized              401 invalid_api_key
    │   ├── Forbidden                 403 (a class above the tenant's)
    │   ├── RateLimited               429 rate_limit_exceeded (carries Retry-After)
    │   └── UpstreamRefused           4xx kept from the backend, body put in shape
    └── ServiceError (5xx)
        ├── Overloaded                503 (carries Retry-After)
        │   ├── QueueFull             503 queue_full
    │   │   └── Shed              503 queue_full, reason shed (a higher class took its place)
        │   ├── QueueTimeout          503 queue_timeout
        │   ├── BackendNotReady       503 backend_unavailable
        │   └── UpstreamContextOverflow 503 upstream_context_overflow
        ├── UpstreamUnavailable       502 (connect failure)
        ├── UpstreamTimeout           504
        └── UpstreamError             502 (the backend answered a 5xx)
            └── UpstreamAuthFailed    502 (the backend refused the gateway's API key)

No module here does I/O. :func:`error_body` and :func:`error_headers` give the body and
headers; the ASGI code sends them. Every error the gateway answers goes through these two.
"""

from __future__ import annotations

import json
import math
from typing import Any, ClassVar

__all__ = [
    "anthropic_body",
    "BackendNotReady",
    "ClientDisconnected",
    "ClientError",
    "ContextLengthExceeded",
    "GatewayError",
    "InvalidRequest",
    "ModelNotFound",
    "ReloadRefused",
    "Unauthorized",
    "Forbidden",
    "RateLimited",
    "Shed",
    "Overloaded",
    "PayloadTooLarge",
    "QueueFull",
    "QueueTimeout",
    "QueueWaitPredicted",
    "ServiceError",
    "HeadersTooLarge",
    "UnsupportedMediaType",
    "UpstreamRefused",
    "UpstreamContextOverflow",
    "UpstreamAuthFailed",
    "UpstreamError",
    "UpstreamTimeout",
    "UpstreamUnavailable",
    "RouteNotFound",
    "error_body",
    "ndjson_error_line",
    "render",
    "shape_of",
    "reshape_upstream_error",
    "error_headers",
    "sse_error_event",
]


class GatewayError(Exception):
    """Base of every error the gateway answers itself.

    Class attributes give the HTTP status, the OpenAI ``error.type`` and ``error.code``.
    ``param`` names the offending request field, when there is one.
    """

    status_code: ClassVar[int] = 500
    error_type: ClassVar[str] = "server_error"
    code: ClassVar[str | None] = None
    # Label for gateway_rejections_total{reason}; None means it is not a rejection.
    rejection_reason: ClassVar[str | None] = None
    # Label for gateway_upstream_errors_total{kind} when the backend failed this way.
    upstream_kind: ClassVar[str | None] = None

    def __init__(self, message: str, *, param: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.param = param


class ClientError(GatewayError):
    """Raised for a client mistake: 4xx, never forwarded upstream."""

    status_code = 400
    error_type = "invalid_request_error"
    rejection_reason = "invalid_request"


class InvalidRequest(ClientError):
    """Raised when the body is not JSON, has wrong types, or misses required fields."""

    code = "invalid_request"


class ContextLengthExceeded(ClientError):
    """Raised when a request can never fit one slot of the backend (HTTP 400)."""

    code = "context_length_exceeded"
    rejection_reason = "context_length_exceeded"


class PayloadTooLarge(ClientError):
    """Raised when the body is larger than ``server.max_body_bytes`` (HTTP 413)."""

    status_code = 413
    code = "payload_too_large"


class UnsupportedMediaType(ClientError):
    """Raised when the request's Content-Type is not application/json (HTTP 415)."""

    status_code = 415
    code = "unsupported_media_type"


class ModelNotFound(ClientError):
    """Raised when no configured backend serves a model of the requested name, or the
    backend itself says so while counting (HTTP 404); the request is never queued."""

    status_code = 404
    error_type = "not_found_error"
    code = "model_not_found"


class RouteNotFound(ClientError):
    """Raised for an unknown path (404) or a method the path does not take (405)."""

    status_code = 404
    code = "not_found"
    rejection_reason = None

    def __init__(self, message: str, *, status_code: int = 404) -> None:
        super().__init__(message)
        if status_code == 405:
            self.status_code = 405  # type: ignore[misc]
            self.code = "method_not_allowed"  # type: ignore[misc]


class HeadersTooLarge(ClientError):
    """Raised when the request headers exceed the gateway's bounds (HTTP 431)."""

    status_code = 431
    code = "request_header_fields_too_large"


class UpstreamRefused(ClientError):
    """Raised when the backend refused a request with a 4xx whose body is not an OpenAI
    error object (empty or plain text). The status is kept; the body is put in shape."""

    code = "upstream_refused"
    rejection_reason = None  # it was forwarded

    def __init__(self, message: str, *, status_code: int, retry_after: str | None = None
                 ) -> None:
        super().__init__(message)
        self.status_code = status_code  # type: ignore[misc]
        self.retry_after = retry_after  # the backend's Retry-After header, kept as sent


class ServiceError(GatewayError):
    """A 5xx: the gateway or the backend cannot serve the request now."""


class Overloaded(ServiceError):
    """A retryable 503. ``retry_after_s`` (seconds, float) becomes ``Retry-After``."""

    status_code = 503
    error_type = "server_error"

    def __init__(self, message: str, *, retry_after_s: float = 1.0) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s


class Unauthorized(ClientError):
    """Raised when a request lacks a valid key: a tenant's (when tenants are configured)
    or, on the admin routes, ``/metrics`` and the status page, ``server.admin_key``.

    :param challenge: a ``WWW-Authenticate`` value to send with the 401 (the status
        page's ``Basic realm=...``, so that a browser asks for the key).
    """

    status_code = 401
    error_type = "authentication_error"
    code = "invalid_api_key"
    rejection_reason = "unauthorized"

    def __init__(self, message: str, *, challenge: str | None = None) -> None:
        super().__init__(message)
        self.challenge = challenge


class Forbidden(ClientError):
    """Raised when a tenant asks for a priority class above its own (HTTP 403)."""

    status_code = 403
    error_type = "permission_error"
    code = "priority_not_allowed"
    rejection_reason = "forbidden"


class RateLimited(ClientError):
    """Raised when a tenant is over one of its quotas (HTTP 429, never forwarded and
    never charged against capacity).

    :param reason: the quota, for ``gateway_rejections_total{reason}``:
        ``tokens_per_minute``, ``max_queued`` or ``max_inflight``.
    :param retry_after_s: when a retry may pass, seconds (``Retry-After``); ``None``
        when it never can (no ``Retry-After``).
    :param headers: extra headers, such as OpenAI's ``x-ratelimit-*-tokens``.
    """

    status_code = 429
    error_type = "rate_limit_error"
    code = "rate_limit_exceeded"

    def __init__(self, message: str, *, reason: str, retry_after_s: float | None,
                 headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.rejection_reason = reason  # type: ignore[misc]
        self.retry_after_s = retry_after_s
        self.headers = headers or {}


class ReloadRefused(ClientError):
    """Raised when a configuration reload is refused; the running one stays."""

    status_code = 409
    code = "reload_refused"
    rejection_reason = None


class QueueFull(Overloaded):
    """Raised when the admission queue already holds ``max_queue`` requests."""

    code = "queue_full"
    rejection_reason = "queue_full"


class Shed(QueueFull):
    """Raised for a waiting request dropped from a full queue to make room for one of a
    higher priority class (``queue_full``; ``gateway_rejections_total{reason="shed"}``)."""

    rejection_reason = "shed"


class QueueTimeout(Overloaded):
    """Raised when a request waited longer than ``max_queue_wait_s`` in the queue."""

    code = "queue_timeout"
    rejection_reason = "queue_timeout"


class QueueWaitPredicted(Overloaded):
    """Raised at arrival when the predicted queue wait is longer than
    ``max_queue_wait_s``: the request is refused at once rather than after the wait."""

    code = "queue_wait_too_long"
    rejection_reason = "queue_wait_predicted"


class BackendNotReady(Overloaded):
    """Raised when the backend's capacity is not known yet (not reachable, or loading)."""

    code = "backend_unavailable"
    rejection_reason = "backend_unavailable"


class ShuttingDown(Overloaded):
    """Raised for a request that arrives (or waits in the queue) while the gateway drains
    before it stops (SIGTERM): retry on another instance, or after the restart."""

    code = "shutting_down"
    rejection_reason = "shutting_down"


class UpstreamContextOverflow(Overloaded):
    """Raised when llama-server answers 500 "Context size has been exceeded.".

    That answer means the gateway's model of the backend's KV pool was wrong
    (``shared/design/backends.md`` §1.3); it is retryable, so it becomes a 503.
    """

    code = "upstream_context_overflow"
    upstream_kind = "context_overflow"


class UpstreamUnavailable(ServiceError):
    """Raised when the backend cannot be connected to (HTTP 502)."""

    status_code = 502
    code = "upstream_unavailable"
    rejection_reason = "backend_unavailable"  # when it happens before forwarding
    upstream_kind = "connect"


class UpstreamTimeout(ServiceError):
    """Raised when the backend did not answer within the read timeout (HTTP 504)."""

    status_code = 504
    code = "upstream_timeout"
    upstream_kind = "timeout"


class UpstreamError(ServiceError):
    """Raised when the backend answered with a 5xx the gateway does not translate (502)."""

    status_code = 502
    code = "upstream_error"
    upstream_kind = "stream_aborted"  # the connection broke, or an odd answer


class UpstreamAuthFailed(UpstreamError):
    """Raised when the backend answers 401/403: the gateway's ``api_key`` is missing or
    wrong (a configuration problem, not the client's)."""

    code = "upstream_auth_failed"
    upstream_kind = "auth"


class ClientDisconnected(Exception):
    """Raised inside the gateway when the client went away; nothing is sent back."""


# Anthropic's error types by status (docs.anthropic.com, "Errors"): the shape Anthropic
# clients parse on /v1/messages.
_ANTHROPIC_TYPES = {400: "invalid_request_error", 401: "authentication_error",
                    403: "permission_error", 404: "not_found_error", 413: "request_too_large",
                    429: "rate_limit_error", 503: "overloaded_error", 504: "timeout_error"}


def anthropic_body(exc: GatewayError) -> dict[str, Any]:
    """The Anthropic error object ``{"type": "error", "error": {type, message}}``."""
    kind = _ANTHROPIC_TYPES.get(exc.status_code) or (
        "invalid_request_error" if exc.status_code < 500 else "api_error")
    return {"type": "error", "error": {"type": kind, "message": exc.message}}


def error_body(exc: GatewayError) -> dict[str, Any]:
    """Return the OpenAI error object ``{"error": {message, type, param, code}}``."""
    return {
        "error": {
            "message": exc.message,
            "type": exc.error_type,
            "param": exc.param,
            "code": exc.code,
        }
    }


def error_headers(exc: GatewayError) -> dict[str, str]:
    """Return the extra headers for an error: ``Retry-After`` (whole seconds, 1–60) and
    ``retry-after-ms`` on 503s, following what the official OpenAI SDKs read
    (``shared/cases/public.md``, appendix); ``x-should-retry: false`` on 4xx, and an
    :class:`Unauthorized`'s ``WWW-Authenticate`` challenge.
    """
    if isinstance(exc, Overloaded):
        seconds = min(60.0, max(1.0, exc.retry_after_s))
        return {"Retry-After": str(math.ceil(seconds)), "retry-after-ms": str(int(seconds * 1000))}
    if isinstance(exc, RateLimited):  # the window's own time, not capped at 60 s
        if exc.retry_after_s is None:
            return dict(exc.headers)
        seconds = max(0.001, exc.retry_after_s)
        return {"Retry-After": str(max(1, math.ceil(seconds))),
                "retry-after-ms": str(math.ceil(seconds * 1000)), **exc.headers}
    if isinstance(exc, UpstreamRefused) and exc.retry_after is not None:
        headers = {"Retry-After": exc.retry_after}
        if exc.retry_after.isdigit():
            headers["retry-after-ms"] = str(int(exc.retry_after) * 1000)
        return headers
    if isinstance(exc, Unauthorized) and exc.challenge is not None:
        return {"x-should-retry": "false", "WWW-Authenticate": exc.challenge}
    if isinstance(exc, ClientError) and exc.status_code not in (408, 409, 429):
        return {"x-should-retry": "false"}
    return {}


_OPENAI_TYPES = {"invalid_request_error", "authentication_error", "permission_error",
                 "not_found_error", "rate_limit_error", "server_error"}
# Backends' own error types that have an OpenAI code: llama-server's
# (tools/server/server-common.cpp) and vLLM's exception names
# (vllm/entrypoints/openai/engine/protocol.py, ErrorInfo.type).
_CODES = {"exceed_context_size_error": "context_length_exceeded",
          "BadRequestError": "invalid_request", "Bad Request": "invalid_request",
          "NotFoundError": "not_found", "InternalServerError": "server_error",
          "Service Unavailable": "backend_unavailable"}


def reshape_upstream_error(status: int, err: dict[str, Any]) -> dict[str, Any]:
    """Put a backend's ``{"error": {...}}`` object in the OpenAI shape.

    llama-server answers ``{"code": 400, "message", "type"}`` with a numeric ``code``
    and its own types (``exceed_context_size_error``, ``not_supported_error``, …). The
    result has ``message``, ``type`` (an OpenAI type), ``param`` and a string ``code``
    (``context_length_exceeded`` for llama-server's over-length error, else the
    backend's own type); other fields (``n_prompt_tokens``, ``n_ctx``) are kept.
    """
    kind = err.get("type") if isinstance(err.get("type"), str) else None
    code = err.get("code")
    if not isinstance(code, str):
        code = _CODES.get(kind or "") or (kind if kind not in _OPENAI_TYPES else None)
    out = {k: v for k, v in err.items() if k not in ("message", "type", "param", "code")}
    out.update({
        "message": str(err.get("message") or f"The backend answered HTTP {status}."),
        "type": kind if kind in _OPENAI_TYPES else
        ("invalid_request_error" if status < 500 else "server_error"),
        "param": err.get("param") if isinstance(err.get("param"), str) else None,
        "code": code,
    })
    return out


def render(exc: GatewayError, shape: str = "openai"
           ) -> tuple[int, list[tuple[bytes, bytes]], bytes]:
    """The one rendering of an error answer: status, raw headers and the JSON body.

    :param shape: ``"openai"`` (``{"error": {message, type, param, code}}``),
        ``"anthropic"`` (``{"type": "error", "error": {type, message}}``, on
        ``/v1/messages``), or ``"ollama"`` (``{"error": "message"}``, as Ollama's native
        API answers, ``api/types.go`` ``StatusError``).

    Every error the gateway answers before a response has started goes through here
    (after that, :func:`sse_error_event` or :func:`ndjson_error_line`).
    """
    payload = ({"error": exc.message} if shape == "ollama" else
               anthropic_body(exc) if shape == "anthropic" else error_body(exc))
    body = json.dumps(payload, separators=(",", ":")).encode()
    headers = [(b"content-type", b"application/json")]
    headers += [(k.lower().encode(), v.encode()) for k, v in error_headers(exc).items()]
    headers.append((b"content-length", str(len(body)).encode()))
    return exc.status_code, headers, body


def shape_of(path: str) -> str:
    """The error shape of a request path: Ollama's native API under ``/api/``,
    Anthropic's under ``/v1/messages``."""
    if path.startswith("/api/"):
        return "ollama"
    return "anthropic" if path.startswith("/v1/messages") else "openai"


def ndjson_error_line(exc: GatewayError) -> bytes:
    """The final line of an Ollama NDJSON stream that failed: ``{"error": "..."}``."""
    return json.dumps({"error": exc.message}, separators=(",", ":")).encode() + b"\n"


def sse_error_event(exc: GatewayError, shape: str = "openai") -> bytes:
    """Return the final SSE event for an error after a stream has started: ``data: {...}``
    (Anthropic's: ``event: error`` with its error object)."""
    if shape == "anthropic":
        return (b"event: error\ndata: " + json.dumps(anthropic_body(exc), separators=(",", ":"))
                .encode() + b"\n\n")
    return b"data: " + json.dumps(error_body(exc), separators=(",", ":")).encode() + b"\n\n"
