"""Every rendering of an error, per API shape, in one place (sans I/O).

A :class:`~gateway.errors.GatewayError` answered before the response has started becomes
a JSON body with its headers (:func:`render`, :func:`error_messages`); after an SSE stream
has started, a final event (:func:`sse_error_event`); after an NDJSON stream has started, a
final line (:func:`ndjson_error_line`). A backend's own error answer is put in the route's
shape by :func:`reshape_upstream_error` and :func:`reshaped`.

Shapes: ``"openai"`` (``{"error": {message, type, param, code}}``), ``"anthropic"``
(``{"type": "error", "error": {type, message}}``, on ``/v1/messages``) and ``"ollama"``
(``{"error": "message"}``, as Ollama's native API answers, ``api/types.go``
``StatusError``).
"""

from __future__ import annotations

import json
import math
from typing import Any

from gateway.errors import (
    ClientError,
    GatewayError,
    Overloaded,
    RateLimited,
    RouteNotFound,
    Unauthorized,
    UpstreamRefused,
)
from gateway.wire.routes import Api, api_of

__all__ = ["anthropic_body", "error_body", "error_headers", "error_messages",
           "ndjson_error_line", "render", "reshape_upstream_error", "reshaped", "shape_of",
           "sse_error_event", "sse_error_prefix"]

Message = dict[str, Any]


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
            **exc.details,
        }
    }


def error_headers(exc: GatewayError) -> dict[str, str]:
    """Return the extra headers for an error: ``Retry-After`` (whole seconds, 1–60) and
    ``retry-after-ms`` on 503s, following what the official OpenAI SDKs read
    (``shared/cases/public.md``, appendix); ``x-should-retry: false`` on 4xx, an
    :class:`Unauthorized`'s ``WWW-Authenticate`` challenge, and a 405's ``Allow``.
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
    if isinstance(exc, RouteNotFound) and exc.allow is not None:
        return {"x-should-retry": "false", "Allow": exc.allow}
    if isinstance(exc, ClientError) and exc.status_code not in (408, 409, 429):
        return {"x-should-retry": "false"}
    return {}


#: llama-server's type for a prompt past the context, kept: clients match on it.
_EXCEEDED = "exceed_context_size_error"
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
        "type": kind if kind in _OPENAI_TYPES or kind == _EXCEEDED else
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


def shape_of(path: str) -> Api:
    """The error shape of a request path: its route's API in the route table
    (:func:`gateway.wire.routes.api_of`: Ollama's native API under ``/api/``,
    Anthropic's under ``/v1/messages``, else OpenAI's)."""
    return api_of(path)


def ndjson_error_line(exc: GatewayError) -> bytes:
    """The final line of an Ollama NDJSON stream that failed: ``{"error": "..."}``."""
    return json.dumps({"error": exc.message}, separators=(",", ":")).encode() + b"\n"


def sse_error_event(exc: GatewayError, shape: str = "openai") -> bytes:
    """Return the final SSE event for an error after a stream has started: ``data: {...}``
    (Anthropic's: ``event: error`` with its error object)."""
    payload = anthropic_body(exc) if shape == "anthropic" else error_body(exc)
    return (sse_error_prefix(shape) + b"data: " + json.dumps(payload, separators=(",", ":"))
            .encode() + b"\n\n")


def sse_error_prefix(shape: str) -> bytes:
    """What precedes ``data:`` in a final SSE error event of ``shape``: Anthropic's
    clients read the event's name (``event: error``), OpenAI's only its data."""
    return b"event: error\n" if shape == "anthropic" else b""


def error_messages(exc: GatewayError, shape: str = "openai") -> tuple[Message, Message]:
    """The two ASGI messages of a JSON error response (``shape``: see :func:`render`)."""
    status, headers, body = render(exc, shape)
    return (
        {"type": "http.response.start", "status": status, "headers": headers},
        {"type": "http.response.body", "body": body},
    )


def reshaped(status: int, body: bytes, api: str = "openai") -> bytes:
    """An upstream ``{"error": {...}}`` answer re-encoded in the route's shape: OpenAI's,
    or Anthropic's ``{"type": "error", "error": {type, message}}`` (an answer already in
    that shape is kept)."""
    try:
        data = json.loads(body)
    except ValueError:
        return body
    if not isinstance(data, dict) or not isinstance(data.get("error"), dict):
        return body
    if api == "anthropic":
        if data.get("type") == "error":
            return body
        message = str(data["error"].get("message") or f"The backend answered HTTP {status}.")
        return json.dumps(anthropic_body(UpstreamRefused(message, status_code=status)),
                          separators=(",", ":")).encode()
    data["error"] = reshape_upstream_error(status, data["error"])
    return json.dumps(data, separators=(",", ":")).encode()
