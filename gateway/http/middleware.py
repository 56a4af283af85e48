"""The outermost layer of every request: header bounds, one count per request, and an
OpenAI-shaped 500 for anything that escapes the handlers.

:class:`RequestAccounting` is a pure ASGI middleware. It

* refuses requests with more than :data:`MAX_HEADERS` headers or more than
  :data:`MAX_HEADER_BYTES` bytes of them (431), before any route runs;
* runs the ``authenticate`` hook (:func:`gateway.http.auth.authenticate`): a request
  without a valid key gets its 401 here, within the gateway's first microseconds, before
  its body is read;
* counts each HTTP request exactly once in ``gateway_requests_total`` with the status
  it ended with: the status sent, a status a handler recorded after the response had
  started (:attr:`AccessRecord.final_status`: 499 when a streaming client left), or
  499 when nothing was sent because the client went away;
* turns a client that disconnects while its body is read into a quiet 499, and any
  other unhandled exception into a logged 500 in the OpenAI error shape;
* gives each request an id (its ``X-Request-Id`` when plain, else a new one), returned
  in the ``x-request-id`` response header, and sent upstream in the same header made
  unique (:attr:`AccessRecord.upstream_id`, bytes: see
  :func:`gateway.observe.logs.request_id_of`), and writes its one access line
  (:func:`gateway.observe.logs.log_access`) from the request's one
  :class:`~gateway.observe.record.AccessRecord`, which it creates and stores in the scope
  and the handlers fill in;
* refuses a request past ``max_in_flight`` requests in hand (``server.max_connections``)
  with 503 ``too_many_connections`` in its API's shape, with ``Retry-After``, counted as
  a rejection: it counts each request as it passes, after the header bounds and the key
  (so a refusal carries its tenant), before any await, so exactly the first
  ``max_in_flight`` of a burst are served and only the rest refused. Probes
  (``/health``, ``/ready``) and ``/metrics`` are neither counted nor refused: they answer
  at once, and a busy process must not look dead to its orchestrator. Why here and not
  uvicorn's ``limit_concurrency``: :mod:`gateway.http.connection`;
* serves the generation routes itself (``routes``: ``POST`` path → ASGI callable),
  without the web framework's routing, dependency and exception layers, which cost
  about a fifth of a forwarded request's CPU time (``py-spy`` over ``make bench``). A
  :class:`GatewayError` those raise before their response starts is rendered here.

:class:`CorsOnApi` answers CORS as llama-server does (``server.cors_origins``), with
starlette's ``CORSMiddleware``; it sits outside :class:`RequestAccounting`, so that its
headers go on every answer of the API routes, the direct path's streams and the errors
rendered here included, and a preflight is answered before any key is asked for (a
browser sends none with it).
"""

from __future__ import annotations

import functools
import logging
import time
from collections.abc import Callable, Mapping

from starlette.middleware.cors import CORSMiddleware
from starlette.requests import ClientDisconnect
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from gateway.errors import GatewayError, HeadersTooLarge, TooManyConnections
from gateway.observe.logs import access_level, log_access, request_id_of
from gateway.observe.metrics import GatewayMetrics
from gateway.observe.record import SCOPE_KEY, AccessRecord
from gateway.observe.tracing import Tracing
from gateway.wire.routes import (
    ADMIN_PREFIX,
    NO_CORS_PATHS,
    PROBE_PATHS,
    ROUTES,
    Route,
    label_of,
)
from gateway.wire.shapes import error_messages, shape_of

__all__ = ["CORS_METHODS", "LOCALHOST_ORIGINS", "CorsOnApi", "MAX_HEADERS", "MAX_HEADER_BYTES",
           "RequestAccounting", "TitleCaseHeaders", "count_rejection", "route_of",
           "title_case"]

log = logging.getLogger(__name__)

MAX_HEADERS = 64  # llama-server (cpp-httplib) itself refuses more than 100
MAX_HEADER_BYTES = 16 * 1024  # names + values, all headers together

# Paths outside the in-flight limit: the orchestrator's probes and the scrape.
_UNLIMITED = PROBE_PATHS | {s.path for s in ROUTES if s.name is Route.metrics}


def route_of(path: str) -> str:
    """The ``route`` label of a request path (``other`` for unknown paths; an alias's is
    its twin's): :func:`gateway.wire.routes.label_of`."""
    return label_of(path)


def count_rejection(metrics: GatewayMetrics, record: AccessRecord, exc: GatewayError) -> None:
    """Count ``exc`` in ``gateway_rejections_total`` if it is a rejection, labelled from
    the request's record (backend, tenant and priority, once known), and note its reason
    there for the access line."""
    if exc.rejection_reason:
        record.reason = exc.rejection_reason
        metrics.rejections.labels(record.backend or "none", exc.rejection_reason,
                                  record.tenant_name, record.priority or "none").inc()


class _InternalError(GatewayError):
    status_code = 500
    code = "internal_error"


def _check_headers(headers: list[tuple[bytes, bytes]]) -> None:
    """Refuse a request with too many headers, or too many bytes of them.

    :raises HeadersTooLarge: more than :data:`MAX_HEADERS` headers, or more than
        :data:`MAX_HEADER_BYTES` bytes of names and values in all.
    """
    size = sum(len(k) + len(v) for k, v in headers)
    if len(headers) > MAX_HEADERS or size > MAX_HEADER_BYTES:
        raise HeadersTooLarge(
            f"The request has {len(headers)} headers of {size} bytes in all; the "
            f"gateway accepts at most {MAX_HEADERS} headers and {MAX_HEADER_BYTES} "
            "bytes. Drop cookies and other headers the API does not need."
        )


class RequestAccounting:
    """ASGI middleware; see the module docstring.

    :param app: the wrapped ASGI app.
    :param metrics: where ``gateway_requests_total`` lives.
    :param keepalive_timeout_s: announced on every response as ``Keep-Alive: timeout=N``
        (seconds), so that client pools know how long an idle connection stays open.
    :param authenticate: called with each HTTP scope before the app; raises a
        :class:`GatewayError` (401) to refuse it, and may set the request record's
        ``tenant`` (an object with a ``name``) and ``priority`` for the labels.
    :param routes: ``POST`` paths served by their own ASGI callable instead of ``app``.
    :param max_in_flight: the most requests in hand at once (``server.max_connections``);
        the next gets 503 :class:`~gateway.errors.TooManyConnections`. ``None``: no limit.
    :param tracing: the requests' traces (:mod:`gateway.observe.tracing`): each request
        but the probes, the scrape and the admin and status pages gets one when on.
    """

    def __init__(self, app: ASGIApp, metrics: GatewayMetrics,
                 keepalive_timeout_s: int | None = None,
                 authenticate: Callable[[Scope], None] | None = None,
                 routes: Mapping[str, ASGIApp] | None = None,
                 max_in_flight: int | None = None, tracing: Tracing | None = None) -> None:
        self.app = app
        self.tracing = tracing if tracing is not None and tracing.on else None
        self.metrics = metrics
        self.authenticate = authenticate
        self.routes = routes or {}
        self.max_in_flight = max_in_flight
        self.in_flight = 0  # requests past the limit's check and not yet ended
        self.keep_alive = (None if keepalive_timeout_s is None else
                           (b"keep-alive", f"timeout={keepalive_timeout_s}".encode()))

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        request_id, upstream_id = request_id_of(scope["headers"])
        record = AccessRecord(request_id=request_id, upstream_id=upstream_id,
                              method=scope["method"], path=scope["path"])
        scope.setdefault("state", {})[SCOPE_KEY] = record
        if self.tracing is not None:
            self._trace(scope, record, self.tracing)

        async def tracking_send(message: Message) -> None:
            if message["type"] == "http.response.start":
                record.status = message["status"]
                headers = message.get("headers", [])
                closing = any(k.lower() == b"connection" and v.lower() == b"close"
                              for k, v in headers)
                added = [(b"x-request-id", request_id)]
                if self.keep_alive is not None and not closing:
                    added.append(self.keep_alive)
                # Title-Case names, as llama-server sends them (see TitleCaseHeaders):
                # done here, on the one message that has headers, rather than by one
                # more layer that every relayed event passes through.
                message = {**message, "headers": [(title_case(k), v)
                                                  for k, v in (*headers, *added)]}
            await send(message)

        counted = False
        try:
            _check_headers(scope["headers"])
            if self.authenticate is not None:
                self.authenticate(scope)
            if self.max_in_flight is not None and scope["path"] not in _UNLIMITED:
                self._enter(self.max_in_flight)
                counted = True
            direct = self.routes.get(scope["path"]) if scope["method"] == "POST" else None
            await (direct or self.app)(scope, receive, tracking_send)
        except GatewayError as exc:
            count_rejection(self.metrics, record, exc)
            if not record.status:
                for message in error_messages(exc, shape_of(scope["path"])):
                    await tracking_send(message)
        except ClientDisconnect:
            log.info("client left while sending its body (%s)", scope.get("path"))
        except Exception:
            log.exception("unhandled error on %s %s", scope.get("method"), scope.get("path"))
            if not record.status:
                for message in error_messages(_InternalError(
                    "The gateway failed on this request; the error is in its log."
                ), shape_of(scope["path"])):
                    await tracking_send(message)
        finally:
            if counted:
                self.in_flight -= 1
            self._ended(scope["path"], record)

    def _ended(self, path: str, record: AccessRecord) -> None:
        """The request has ended: end its trace, count it, write its access line."""
        record.duration_s = time.monotonic() - record.began
        if record.trace is not None:
            record.trace.end(record.counted_status, record.reason, record.backend,
                             record.request_id.decode("latin-1"))
        route = route_of(path)
        self.metrics.requests.labels(*record.labels(route)).inc()
        level = access_level(path, record.counted_status)
        if level is not None:  # the line's fields are gathered only when written
            log_access(record.line(route), level)

    @staticmethod
    def _trace(scope: Scope, record: AccessRecord, tracing: Tracing) -> None:
        """Begin the request's trace, unless it is a probe, the scrape, or an admin or
        status page."""
        path = scope["path"]
        if path in _UNLIMITED or path.startswith((ADMIN_PREFIX, "/status")):
            return
        known = route_of(path) != "other"
        record.trace = tracing.begin(scope["method"], path, path if known else None,
                                     scope["headers"])
        if record.trace is not None:
            record.trace_id = record.trace.trace_id

    def _enter(self, limit: int) -> None:
        """Count one more request in hand, or refuse it when ``limit`` are already."""
        if self.in_flight >= limit:
            raise TooManyConnections(
                f"This gateway process already has {self.in_flight:,} requests in hand, "
                f"its limit (server.max_connections = {limit:,}); retry after the "
                "Retry-After delay.")
        self.in_flight += 1


#: The methods a preflight allows: llama-server's ``--cors-methods`` default.
CORS_METHODS = ("GET", "POST", "DELETE", "OPTIONS")
#: ``server.cors_origins = ["localhost"]``, as llama-server's ``--cors-origins localhost``
#: (its default once server tools or MCP servers are on): an origin whose host is
#: localhost, 127.0.0.1 or ::1, over http or https, any port (``origin_is_localhost``
#: and ``common_http_parse_url``, ``tools/server/server-http.cpp``).
LOCALHOST_ORIGINS = r"https?://(localhost|127\.0\.0\.1|\[::1\])(:[0-9]+)?"


class TitleCaseHeaders:
    """Sends every response header name in Title-Case (``Access-Control-Allow-Origin``,
    ``Content-Type``), as llama-server's HTTP library writes them, where the ASGI stack
    lowercases them. Names are case-insensitive in HTTP, but clients that read them from
    a plain dictionary (llama.cpp's own test suite among them) look for llama-server's
    spelling. :class:`RequestAccounting` sends its app's answers so; this layer, outermost,
    is only added over :class:`CorsOnApi`, which adds names and answers preflights
    outside the accounting.

    :param app: the wrapped ASGI app.
    """

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return

        async def titled(message: Message) -> None:
            if message["type"] == "http.response.start":
                message["headers"] = [(title_case(k), v)
                                      for k, v in message.get("headers", ())]
            await send(message)

        await self.app(scope, receive, titled)


@functools.lru_cache(maxsize=256)
def title_case(name: bytes) -> bytes:
    """``b"access-control-allow-origin"`` as ``b"Access-Control-Allow-Origin"`` (kept for
    the names seen: every answer sends the same few)."""
    return b"-".join(part[:1].upper() + part[1:].lower() for part in name.split(b"-"))


class CorsOnApi:
    """CORS on every path but the status page and ``/admin``: starlette's
    ``CORSMiddleware`` set as llama-server's defaults (``--cors-origins``,
    ``--cors-methods``, ``--cors-headers``, ``--cors-credentials``,
    ``tools/server/server-http.cpp``): the origins given (``"*"``: any, echoed back
    because credentials are allowed; ``"localhost"``: any origin on this machine,
    :data:`LOCALHOST_ORIGINS`), :data:`CORS_METHODS`, any request header (starlette
    echoes the headers a preflight asks for, where llama-server answers ``*``; ``*`` is
    no wildcard for a credentialed request and never covers ``Authorization``), and
    credentials allowed.

    The status page and ``/admin`` never get CORS headers: a browser may hold the status
    page's HTTP Basic credentials, which any allowed origin could then use.

    :param app: the wrapped ASGI app (:class:`RequestAccounting` and all inside it).
    :param origins: ``server.cors_origins``, not empty.
    """

    def __init__(self, app: ASGIApp, origins: list[str]) -> None:
        self.app = app
        local = "localhost" in origins  # llama-server's special value: see LOCALHOST_ORIGINS
        self.cors = CORSMiddleware(app, allow_origins=[o for o in origins if o != "localhost"],
                                   allow_origin_regex=LOCALHOST_ORIGINS if local else None,
                                   allow_methods=CORS_METHODS, allow_headers=["*"],
                                   allow_credentials=True)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        path = scope.get("path", "")
        if scope["type"] != "http" or path in NO_CORS_PATHS or path.startswith(ADMIN_PREFIX):
            await self.app(scope, receive, send)
            return
        headers = dict(scope.get("headers") or ()) if scope["method"] == "OPTIONS" else {}
        origin = headers.get(b"origin")
        if (origin is not None and b"access-control-request-method" in headers
                and not self.cors.is_allowed_origin(origin.decode("latin-1"))):
            # A preflight from an origin not allowed: 200 with no CORS headers, as
            # llama-server answers it (starlette's is a 400); the browser refuses either.
            await send({"type": "http.response.start", "status": 200,
                        "headers": [(b"content-length", b"0"), (b"vary", b"Origin")]})
            await send({"type": "http.response.body", "body": b""})
            return
        await self.cors(scope, receive, send)
