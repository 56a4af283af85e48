"""The gateway's exception hierarchy.

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
        │   ├── BackendFull           503 backend_full (no room there now: waited out)
        │   ├── TooManyConnections    503 too_many_connections (server.max_connections)
        │   └── UpstreamContextOverflow 503 upstream_context_overflow
        ├── UpstreamUnavailable       502 (connect failure)
        ├── UpstreamTimeout           504
        └── UpstreamError             502 (the backend answered a 5xx)
            └── UpstreamAuthFailed    502 (the backend refused the gateway's API key)

No I/O here, and no format: each exception carries its status, type, code and message;
:mod:`gateway.wire.shapes` renders it in the shape of the route's API, in one place.

Two vocabularies are types here, so that producers and the metrics cannot spell them
apart: :class:`UpstreamKind` (how a backend failed: ``gateway_upstream_errors_total
{kind}``), set on the exception when it is raised, and :class:`RejectionReason` (why the
gateway answered a request itself: ``gateway_rejections_total{reason}``).
"""

from __future__ import annotations

from enum import StrEnum
from typing import ClassVar

__all__ = [
    "RejectionReason",
    "UpstreamKind",
    "BackendFull",
    "BackendNotReady",
    "describe",
    "ClientDisconnected",
    "ClientError",
    "ContextLengthExceeded",
    "GatewayError",
    "InvalidRequest",
    "ModelNotFound",
    "ReloadRefused",
    "Unauthorized",
    "Forbidden",
    "NotRelayed",
    "RateLimited",
    "Shed",
    "Overloaded",
    "PayloadTooLarge",
    "QueueFull",
    "QueueTimeout",
    "QueueWaitPredicted",
    "ServiceError",
    "StateUnavailable",
    "TooManyConnections",
    "HeadersTooLarge",
    "UnsupportedMediaType",
    "UpstreamRefused",
    "UpstreamContextOverflow",
    "UpstreamAuthFailed",
    "UpstreamError",
    "UpstreamTimeout",
    "UpstreamUnavailable",
    "RouteNotFound",
]


class UpstreamKind(StrEnum):
    """How a backend failed: the ``kind`` label of ``gateway_upstream_errors_total``,
    the access line's ``upstream_error``, and what a backend's health reacts to. A
    ``StrEnum``, so a member equals its label value."""

    connect = "connect"  # the connection was refused or timed out while connecting
    timeout = "timeout"  # no answer within the read timeout
    status_5xx = "status_5xx"  # the backend answered with a 5xx (or its busy 503)
    context_overflow = "context_overflow"  # llama-server ran out of KV cache
    stream_aborted = "stream_aborted"  # the connection broke, or an odd answer
    auth = "auth"  # the backend refused the gateway's API key (401/403)


class RejectionReason(StrEnum):
    """Why the gateway answered a request itself, without forwarding it: the ``reason``
    label of ``gateway_rejections_total`` and the access line's ``reason``."""

    invalid_request = "invalid_request"  # a client mistake (4xx)
    context_length_exceeded = "context_length_exceeded"  # never fits a slot
    unauthorized = "unauthorized"  # no valid key
    forbidden = "forbidden"  # a priority class above the tenant's
    tokens_per_minute = "tokens_per_minute"  # a tenant's quotas (429)
    max_queued = "max_queued"
    max_inflight = "max_inflight"
    queue_full = "queue_full"  # the admission queue is full
    shed = "shed"  # dropped from a full queue for a higher class
    queue_timeout = "queue_timeout"  # waited longer than max_queue_wait_s
    queue_wait_predicted = "queue_wait_predicted"  # would wait longer, refused at once
    slo_unattainable = "slo_unattainable"  # its first token would come after its deadline
    backend_unavailable = "backend_unavailable"  # not ready, or cannot be reached
    shutting_down = "shutting_down"  # the gateway drains before it stops
    state_unavailable = "state_unavailable"  # the shared admission state cannot be reached
    too_many_connections = "too_many_connections"  # server.max_connections in hand already


class GatewayError(Exception):
    """Base of every error the gateway answers itself.

    Class attributes give the HTTP status, the OpenAI ``error.type`` and ``error.code``.
    ``param`` names the offending request field, when there is one.

    :param kind: how the backend failed, when this error is a backend's failure
        (:attr:`upstream_kind`); by default the class's own (``None``: not a failure of
        the backend). Set at construction, by whoever read the failure, so that the
        count, the access line and the log all read the same value.
    """

    status_code: ClassVar[int] = 500
    error_type: ClassVar[str] = "server_error"
    code: ClassVar[str | None] = None
    # Label for gateway_rejections_total{reason}; None means it is not a rejection.
    rejection_reason: ClassVar[RejectionReason | None] = None
    # Label for gateway_upstream_errors_total{kind} when the backend failed this way (a
    # class default; an instance may carry its own, given at construction).
    upstream_kind: UpstreamKind | None = None

    def __init__(self, message: str, *, param: str | None = None,
                 kind: UpstreamKind | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.param = param
        #: Fields the error object carries besides message, type, param and code.
        self.details: dict[str, int] = {}
        if kind is not None:
            self.upstream_kind = kind


class ClientError(GatewayError):
    """Raised for a client mistake: 4xx, never forwarded upstream."""

    status_code = 400
    error_type = "invalid_request_error"
    rejection_reason: ClassVar[RejectionReason | None] = RejectionReason.invalid_request


class InvalidRequest(ClientError):
    """Raised when the body is not JSON, has wrong types, or misses required fields."""

    code = "invalid_request"


class ContextLengthExceeded(ClientError):
    """Raised when a request can never fit one slot of the backend (HTTP 400).

    Rendered as llama-server renders its own (``tools/server/server-common.cpp``,
    ``ERROR_TYPE_EXCEED_CONTEXT_SIZE``): ``type`` ``exceed_context_size_error``, with the
    prompt's tokens and the slot's context as ``n_prompt_tokens`` and ``n_ctx`` when
    known, so that clients written for llama-server recognise it; ``code`` stays
    OpenAI's ``context_length_exceeded``.

    :param n_prompt_tokens: the prompt's tokens (a lower bound where it was not counted).
    :param n_ctx: the tokens one slot holds (llama-server's per-slot ``n_ctx``).
    """

    error_type = "exceed_context_size_error"
    code = "context_length_exceeded"
    rejection_reason = RejectionReason.context_length_exceeded

    def __init__(self, message: str, *, param: str | None = None,
                 kind: UpstreamKind | None = None, n_prompt_tokens: int | None = None,
                 n_ctx: int | None = None) -> None:
        super().__init__(message, param=param, kind=kind)
        self.details = {k: v for k, v in (("n_prompt_tokens", n_prompt_tokens),
                                          ("n_ctx", n_ctx)) if v is not None}


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
    """Raised for an unknown path (404) or a method the path does not take (405).

    :param allow: for a 405, the methods the path takes (its ``Allow`` header, which
        RFC 9110 section 15.5.6 requires of a 405).
    """

    status_code = 404
    code = "not_found"
    rejection_reason = None

    def __init__(self, message: str, *, status_code: int = 404,
                 allow: str | None = None) -> None:
        super().__init__(message)
        self.allow = allow
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
    """A retryable 503. ``retry_after_s`` (seconds, float) becomes ``Retry-After``;
    ``kind`` as for :class:`GatewayError` (a backend's busy or loading 503 is
    ``status_5xx``)."""

    status_code = 503
    error_type = "server_error"

    def __init__(self, message: str, *, retry_after_s: float = 1.0,
                 kind: UpstreamKind | None = None) -> None:
        super().__init__(message, kind=kind)
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
    rejection_reason = RejectionReason.unauthorized

    def __init__(self, message: str, *, challenge: str | None = None) -> None:
        super().__init__(message)
        self.challenge = challenge


class Forbidden(ClientError):
    """Raised when a tenant asks for a priority class above its own (HTTP 403)."""

    status_code = 403
    error_type = "permission_error"
    code = "priority_not_allowed"
    rejection_reason = RejectionReason.forbidden


class NotRelayed(ClientError):
    """Raised for a backend route the gateway refuses to relay on purpose (HTTP 403): one
    that would change the backend behind the gateway's books (llama-server's slot
    actions, ``POST /props``, ``POST /lora-adapters``) or is an open proxy
    (``/cors-proxy``). The message says why and what to do instead."""

    status_code = 403
    error_type = "permission_error"
    code = "not_relayed"


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

    def __init__(self, message: str, *, reason: RejectionReason | str,
                 retry_after_s: float | None, headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.rejection_reason = RejectionReason(reason)  # type: ignore[misc]
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
    rejection_reason = RejectionReason.queue_full


class Shed(QueueFull):
    """Raised for a waiting request dropped from a full queue to make room for one of a
    higher priority class (``queue_full``; ``gateway_rejections_total{reason="shed"}``)."""

    rejection_reason = RejectionReason.shed


class QueueTimeout(Overloaded):
    """Raised when a request waited longer than ``max_queue_wait_s`` in the queue."""

    code = "queue_timeout"
    rejection_reason = RejectionReason.queue_timeout


class QueueWaitPredicted(Overloaded):
    """Raised at arrival when the predicted queue wait is longer than
    ``max_queue_wait_s``: the request is refused at once rather than after the wait."""

    code = "queue_wait_too_long"
    rejection_reason = RejectionReason.queue_wait_predicted


class SloUnattainable(Overloaded):
    """Raised at arrival when a request's predicted time to first token is past its
    deadline (its ``x-gateway-slo-ttft-ms`` header, else its class's ``ttft_p95_s``):
    refused at once rather than served late (:mod:`gateway.admission.slo`). The error
    object carries ``predicted_ttft_ms`` and ``deadline_ms``.

    :param predicted_s: the predicted TTFT, seconds.
    :param deadline_s: the deadline it misses, seconds.
    """

    code = "slo_unattainable"
    rejection_reason = RejectionReason.slo_unattainable

    def __init__(self, message: str, *, retry_after_s: float, predicted_s: float,
                 deadline_s: float) -> None:
        super().__init__(message, retry_after_s=retry_after_s)
        self.details = {"predicted_ttft_ms": round(predicted_s * 1000),
                        "deadline_ms": round(deadline_s * 1000)}


class BackendNotReady(Overloaded):
    """Raised when the backend's capacity is not known yet (not reachable, or loading)."""

    code = "backend_unavailable"
    rejection_reason = RejectionReason.backend_unavailable


class BackendFull(Overloaded):
    """Raised when a backend refused a request for want of room now, by limits of its
    own (vLLM's 503 once ``--max-num-queued-reqs`` or ``--max-num-queued-tokens`` is
    reached). Not a failure of the backend: no upstream kind, never marked down. The
    relay waits for room, on that backend or another of the model, within the request's
    queue wait (:func:`gateway.relay.retry.requeue`), and the backend's admitted slots
    are capped (:meth:`gateway.core.pool_model.PoolModel.full`).

    :param cause: which limit: ``queue_full`` (requests in flight) or
        ``prefill_backlog`` (prompt tokens waiting for prefill); the ``cause`` label of
        ``gateway_backend_full_total``.
    """

    code = "backend_full"

    def __init__(self, message: str, *, cause: str, retry_after_s: float = 1.0) -> None:
        super().__init__(message, retry_after_s=retry_after_s)
        self.cause = cause


class StateUnavailable(Overloaded):
    """Raised when admission state is shared between gateway processes (``[state]
    backend = "redis"``) and the store cannot be reached: the gateway refuses rather than
    admit without knowing what the other processes hold (``gateway/admission/shared.py``).
    """

    code = "state_unavailable"
    rejection_reason = RejectionReason.state_unavailable


class TooManyConnections(Overloaded):
    """Raised for a request that arrives while its process already has
    ``server.max_connections`` requests in hand (:mod:`gateway.http.middleware`): refused
    before it is read, whatever its backend (HTTP 503, ``Retry-After``)."""

    code = "too_many_connections"
    rejection_reason = RejectionReason.too_many_connections


class ShuttingDown(Overloaded):
    """Raised for a request that arrives (or waits in the queue) while the gateway drains
    before it stops (SIGTERM): retry on another instance, or after the restart."""

    code = "shutting_down"
    rejection_reason = RejectionReason.shutting_down


class UpstreamContextOverflow(Overloaded):
    """Raised when llama-server answers 500 "Context size has been exceeded.".

    That answer means the gateway's model of the backend's KV pool was wrong
    (``shared/design/backends.md`` §1.3); it is retryable, so it becomes a 503.
    """

    code = "upstream_context_overflow"
    upstream_kind = UpstreamKind.context_overflow


class UpstreamUnavailable(ServiceError):
    """Raised when the backend cannot be connected to (HTTP 502)."""

    status_code = 502
    code = "upstream_unavailable"
    rejection_reason = RejectionReason.backend_unavailable  # before forwarding
    upstream_kind = UpstreamKind.connect


class UpstreamTimeout(ServiceError):
    """Raised when the backend did not answer within the read timeout (HTTP 504)."""

    status_code = 504
    code = "upstream_timeout"
    upstream_kind = UpstreamKind.timeout


class UpstreamError(ServiceError):
    """Raised when the backend answered with a 5xx the gateway does not translate (502,
    raised with ``kind=UpstreamKind.status_5xx``), or when the connection broke after
    the request was sent (the class's kind, ``stream_aborted``)."""

    status_code = 502
    code = "upstream_error"
    upstream_kind = UpstreamKind.stream_aborted


class UpstreamAuthFailed(UpstreamError):
    """Raised when the backend answers 401/403: the gateway's ``api_key`` is missing or
    wrong (a configuration problem, not the client's)."""

    code = "upstream_auth_failed"
    upstream_kind = UpstreamKind.auth


class ClientDisconnected(Exception):
    """Raised inside the gateway when the client went away; nothing is sent back."""


def describe(exc: BaseException) -> str:
    """``exc`` named without its message, for a log line: its class, and its error code,
    upstream kind and HTTP status when it has them. A backend's error message may quote
    the prompt or the answer (llama-server's "Failed to parse input at pos N: ..."), and
    the gateway writes neither to its log."""
    parts = [type(exc).__name__]
    for attr in ("code", "upstream_kind", "status_code"):
        value = getattr(exc, attr, None)
        if value is not None and str(value) not in parts:
            parts.append(str(value))
    return " ".join(parts)
