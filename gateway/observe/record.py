"""One request's facts, written once where they become known and read by the access line
and the request counter: the :class:`AccessRecord`.

The outer middleware (:class:`gateway.http.middleware.RequestAccounting`) creates it when
a request arrives and stores it once in the ASGI scope, under :data:`SCOPE_KEY` of
``scope["state"]``. Authentication, the planner, the endpoints and the relay write its
typed attributes (:func:`record_of`); nothing else carries a request's facts through the
scope. When the response has ended, the middleware counts the request and writes the access
line from it (:meth:`AccessRecord.line`).

The access line's fields (:data:`ACCESS_FIELDS`) are derived from the record's own fields:
each field that appears in the line says so, and under which name, in its metadata.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field, fields
from typing import TYPE_CHECKING, Any

from starlette.types import Scope

if TYPE_CHECKING:
    from gateway.observe.tracing import RequestTrace

__all__ = ["ACCESS_FIELDS", "SCOPE_KEY", "AccessRecord", "record_of"]

#: Where the record lives in ``scope["state"]``.
SCOPE_KEY = "gateway.record"


def _line(name: str | None = None, *, ms: bool = False) -> dict[str, Any]:
    """Metadata of a field written in the access line, under ``name`` (its own name by
    default); ``ms``: a time in seconds written in milliseconds."""
    return {"line": name, "ms": ms}


@dataclass(slots=True, eq=False)
class AccessRecord:
    """What happened to one HTTP request, as far as it got.

    The fields marked for the line come first, in the order the text format writes them.
    Times are seconds on the monotonic clock (``duration_s``, ``queue_wait_s``,
    ``ttft_s``), written in milliseconds; token counts are tokens. A field the request
    never reached stays ``None`` (left out of the text line, ``null`` in JSON).

    :param request_id: the request's id, returned in ``x-request-id`` (bytes as sent).
    :param upstream_id: the id sent to the backend in ``X-Request-Id`` (the request's own,
        made unique when the client chose it: :func:`gateway.observe.logs.request_id_of`).
    :param route: the route label, once a handler named it (else derived from the path).
    :param backend: the backend that took the request (in a pool, known at admission).
    :param tenant: the authenticated tenant (an object with a ``name``), if any.
    :param status: the HTTP status the response started with (0: none sent yet).
    :param final_status: the status recorded after the response had started (499: a
        streaming client left; a stream's 200 otherwise), which the request is counted as.
    :param reason: the rejection reason (a ``gateway_rejections_total`` label).
    :param upstream_error: the backend's last failure during the request (a
        ``gateway_upstream_errors_total`` kind, or ``shutting_down``).
    :param prompt_tokens: the prompt tokens charged; ``count_source`` where they came
        from (``backend``, ``cache``, ``estimate``); ``max_tokens`` the output cap charged.
    :param forwarded: the request reached the backend (so ``upstream_id`` is logged).
    :param priority: the tenant's priority class (a metric label).
    :param trace: the request's trace (:mod:`gateway.observe.tracing`), ``None`` when
        tracing is off; ``trace_id`` its id, for the line.
    """

    request_id: bytes = field(default=b"", metadata=_line())
    upstream_id: bytes = field(default=b"", metadata=_line("upstream_request_id"))
    method: str = field(default="", metadata=_line())
    path: str = field(default="", metadata=_line())
    route: str | None = field(default=None, metadata=_line())
    backend: str | None = field(default=None, metadata=_line())
    tenant: Any = field(default=None, metadata=_line())
    final_status: int | None = field(default=None, metadata=_line("status"))
    reason: str | None = field(default=None, metadata=_line())
    upstream_error: str | None = field(default=None, metadata=_line())
    prompt_tokens: int | None = field(default=None, metadata=_line())
    count_source: str | None = field(default=None, metadata=_line())
    max_tokens: int | None = field(default=None, metadata=_line())
    queue_wait_s: float | None = field(default=None, metadata=_line("queue_wait_ms", ms=True))
    ttft_s: float | None = field(default=None, metadata=_line("ttft_ms", ms=True))
    duration_s: float | None = field(default=None, metadata=_line("duration_ms", ms=True))
    trace_id: str | None = field(default=None, metadata=_line())
    # Not in the line:
    status: int = 0
    priority: str | None = None
    forwarded: bool = False
    began: float = field(default_factory=time.monotonic)
    trace: RequestTrace | None = None

    @property
    def counted_status(self) -> int:
        """The status the request is counted and logged with: one recorded after the
        response started, else the one sent, else 499 (nothing was sent: the client
        went away)."""
        return self.final_status or self.status or 499

    @property
    def tenant_name(self) -> str:
        """The ``tenant`` label: the tenant's name, or ``none``."""
        return getattr(self.tenant, "name", "none")

    def labels(self, default_route: str) -> tuple[str, str, str, str, str]:
        """``gateway_requests_total``'s labels: backend, route (``default_route`` when no
        handler named it), status, tenant, priority."""
        return (self.backend or "none", self.route or default_route, str(self.counted_status),
                self.tenant_name, self.priority or "none")

    def line(self, default_route: str) -> dict[str, Any]:
        """The access line's fields, keyed as :data:`ACCESS_FIELDS`, in its order."""
        values: dict[str, Any] = {
            "request_id": self.request_id.decode(),
            "upstream_request_id": self.upstream_id.decode()
            if self.forwarded and self.upstream_id != self.request_id else None,
            "route": self.route or default_route,
            "backend": self.backend or "none",
            "tenant": self.tenant_name,
            "status": self.counted_status,
        }
        for f in fields(self):
            name = f.metadata.get("line") or (f.name if "line" in f.metadata else None)
            if name is None or name in values:
                continue
            value = getattr(self, f.name)
            values[name] = (None if value is None else round(value * 1000, 1)) \
                if f.metadata["ms"] else value
        return {name: values[name] for name in ACCESS_FIELDS}


#: The access line's fields, in the order the text format writes them: derived from
#: :class:`AccessRecord`'s fields.
ACCESS_FIELDS: tuple[str, ...] = tuple(
    f.metadata["line"] or f.name for f in fields(AccessRecord) if "line" in f.metadata)


def record_of(scope: Scope) -> AccessRecord:
    """The request's record in ``scope`` (created there if the request did not come
    through the middleware, as in tests that call an ASGI handler directly)."""
    state = scope.setdefault("state", {})
    record = state.get(SCOPE_KEY)
    if record is None:
        record = state[SCOPE_KEY] = AccessRecord(method=scope.get("method", ""),
                                                 path=scope.get("path", ""))
    return record
