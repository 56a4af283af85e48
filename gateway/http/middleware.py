"""The outermost layer of every request: header bounds, one count per request, and an
OpenAI-shaped 500 for anything that escapes the handlers.

:class:`RequestAccounting` is a pure ASGI middleware. It

* refuses requests with more than :data:`MAX_HEADERS` headers or more than
  :data:`MAX_HEADER_BYTES` bytes of them (431), before any route runs;
* runs the ``authenticate`` hook (:mod:`gateway.admission.tenants`): a request without a valid key
  gets its 401 here, within the gateway's first microseconds, before its body is read;
* counts each HTTP request exactly once in ``gateway_requests_total`` with the status
  it ended with: the status sent, a status a handler recorded after the response had
  started (``scope["state"]["final_status"]``: 499 when a streaming client left), or
  499 when nothing was sent because the client went away;
* turns a client that disconnects while its body is read into a quiet 499, and any
  other unhandled exception into a logged 500 in the OpenAI error shape;
* gives each request an id (its ``X-Request-Id`` when plain, else a new one), returned
  in the ``x-request-id`` response header, and sent upstream in the same header made
  unique (``scope["state"]["upstream_request_id"]``, bytes: see
  :func:`gateway.observe.logs.request_id_of`), and writes its one access line
  (:func:`gateway.observe.logs.log_access`) from what the handlers left in ``scope["state"]``;
* serves the generation routes itself (``routes``: ``POST`` path → ASGI callable),
  without the web framework's routing, dependency and exception layers, which cost
  about a fifth of a forwarded request's CPU time (``py-spy`` over ``make bench``). A
  :class:`GatewayError` those raise before their response starts is rendered here.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping, MutableMapping
from typing import Any

from starlette.requests import ClientDisconnect
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from gateway.errors import GatewayError, HeadersTooLarge
from gateway.observe.logs import access_level, log_access, request_id_of
from gateway.observe.metrics import GatewayMetrics
from gateway.wire.routes import LABELS
from gateway.wire.shapes import error_messages, shape_of

__all__ = ["MAX_HEADERS", "MAX_HEADER_BYTES", "RequestAccounting", "count_rejection",
           "route_of"]

log = logging.getLogger(__name__)

MAX_HEADERS = 64  # llama-server (cpp-httplib) itself refuses more than 100
MAX_HEADER_BYTES = 16 * 1024  # names + values, all headers together



def route_of(path: str) -> str:
    """The ``route`` label of a request path (``other`` for unknown paths)."""
    return LABELS.get(path, "other")


def count_rejection(metrics: GatewayMetrics, state: MutableMapping[str, Any],
                    exc: GatewayError) -> None:
    """Count ``exc`` in ``gateway_rejections_total`` if it is a rejection, labelled from
    the request's ``scope["state"]`` (backend, tenant and priority, once known), and
    note its reason there for the access line."""
    if exc.rejection_reason:
        state["reason"] = exc.rejection_reason
        tenant = state.get("tenant")
        metrics.rejections.labels(state.get("backend", "none"), exc.rejection_reason,
                                  getattr(tenant, "name", "none"),
                                  state.get("priority") or "none").inc()


class _InternalError(GatewayError):
    status_code = 500
    code = "internal_error"


class RequestAccounting:
    """ASGI middleware; see the module docstring.

    :param app: the wrapped ASGI app.
    :param metrics: where ``gateway_requests_total`` lives.
    :param keepalive_timeout_s: announced on every response as ``Keep-Alive: timeout=N``
        (seconds), so that client pools know how long an idle connection stays open.
    :param authenticate: called with each HTTP scope before the app; raises a
        :class:`GatewayError` (401) to refuse it, and may put ``tenant`` (an object
        with a ``name``) and ``priority`` into ``scope["state"]`` for the labels.
    :param routes: ``POST`` paths served by their own ASGI callable instead of ``app``.
    """

    def __init__(self, app: ASGIApp, metrics: GatewayMetrics,
                 keepalive_timeout_s: int | None = None,
                 authenticate: Callable[[Scope], None] | None = None,
                 routes: Mapping[str, ASGIApp] | None = None) -> None:
        self.app = app
        self.metrics = metrics
        self.authenticate = authenticate
        self.routes = routes or {}
        self.keep_alive = (None if keepalive_timeout_s is None else
                           (b"keep-alive", f"timeout={keepalive_timeout_s}".encode()))

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        state: dict[str, Any] = scope.setdefault("state", {})
        status = 0
        began = time.monotonic()
        request_id, upstream_id = request_id_of(scope["headers"])
        state["upstream_request_id"] = upstream_id

        async def tracking_send(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
                headers = message.get("headers", [])
                closing = any(k.lower() == b"connection" and v.lower() == b"close"
                              for k, v in headers)
                added = [(b"x-request-id", request_id)]
                if self.keep_alive is not None and not closing:
                    added.append(self.keep_alive)
                message = {**message, "headers": [*headers, *added]}
            await send(message)

        try:
            headers = scope["headers"]
            size = sum(len(k) + len(v) for k, v in headers)
            if len(headers) > MAX_HEADERS or size > MAX_HEADER_BYTES:
                raise HeadersTooLarge(
                    f"The request has {len(headers)} headers of {size} bytes in all; the "
                    f"gateway accepts at most {MAX_HEADERS} headers and {MAX_HEADER_BYTES} "
                    "bytes. Drop cookies and other headers the API does not need."
                )
            if self.authenticate is not None:
                self.authenticate(scope)
            direct = self.routes.get(scope["path"]) if scope["method"] == "POST" else None
            await (direct or self.app)(scope, receive, tracking_send)
        except GatewayError as exc:
            count_rejection(self.metrics, state, exc)
            if not status:
                for message in error_messages(exc, shape_of(scope["path"])):
                    await tracking_send(message)
        except ClientDisconnect:
            log.info("client left while sending its body (%s)", scope.get("path"))
        except Exception:
            log.exception("unhandled error on %s %s", scope.get("method"), scope.get("path"))
            if not status:
                for message in error_messages(_InternalError(
                    "The gateway failed on this request; the error is in its log."
                ), shape_of(scope["path"])):
                    await tracking_send(message)
        finally:
            final = state.get("final_status") or status or 499
            tenant = getattr(state.get("tenant"), "name", "none")
            backend, route = state.get("backend", "none"), (state.get("route")
                                                            or route_of(scope["path"]))
            self.metrics.requests.labels(backend, route, str(final), tenant,
                                         state.get("priority") or "none").inc()
            level = access_level(scope["path"], final)
            if level is not None:  # the line's fields are gathered only when written
                log_access({
                    "request_id": request_id.decode(),
                    "upstream_request_id": upstream_id.decode() if state.get("forwarded")
                    and upstream_id != request_id else None,
                    "method": scope["method"], "path": scope["path"], "route": route,
                    "backend": backend, "tenant": tenant, "status": final,
                    "reason": state.get("reason"),
                    "upstream_error": state.get("upstream_error"),
                    "prompt_tokens": state.get("prompt_tokens"),
                    "count_source": state.get("count_source"),
                    "max_tokens": state.get("max_tokens"),
                    "queue_wait_ms": _ms(state.get("queue_wait_s")),
                    "ttft_ms": _ms(state.get("ttft_s")),
                    "duration_ms": _ms(time.monotonic() - began),
                }, level)


def _ms(seconds: float | None) -> float | None:
    return None if seconds is None else round(seconds * 1000, 1)
