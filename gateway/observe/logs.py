"""Logging: one format for every line, the gateway's and uvicorn's, and one access line
per request that says what the gateway decided.

:func:`configure_logging` gives the root logger one stderr handler, as text or as JSON
(``server.log_format``), and routes uvicorn's loggers through it. uvicorn's own access
line is turned off (:func:`log_access` replaces it), and so are httpx's per-call INFO
lines, which say nothing the access line does not and cost time on every request.

The access line (logger ``gateway.access``) carries the fields of :data:`ACCESS_FIELDS`:
the request id, route, backend, tenant, status, the rejection reason, the prompt tokens
and where their count came from, the output cap charged, queue wait, TTFT and duration.
It never carries prompt or completion text, nor any key: those are not fields of it.
Probes are logged at DEBUG, and so are ``/metrics`` and the status page unless refused,
so that a scrape every few seconds does not bury the traffic.
"""

from __future__ import annotations

import json
import logging
import os
import re
from collections.abc import Iterable
from typing import Any

from pythonjsonlogger.core import RESERVED_ATTRS
from pythonjsonlogger.json import JsonFormatter

from gateway.config import ServerSettings
from gateway.observe.record import ACCESS_FIELDS
from gateway.wire import routes

__all__ = ["ACCESS_FIELDS", "QUIET_PATHS", "TextFormatter", "access_level", "configure_logging",
           "log_access", "request_id_of"]

access_log = logging.getLogger("gateway.access")


#: Paths whose access lines are DEBUG: load balancer probes, scrapes, the status page.
QUIET_PATHS = routes.QUIET_PATHS

_PROBES = routes.PROBE_PATHS

TEXT_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"

# A client's X-Request-Id is kept when it is short and plain (it goes into log lines and
# a response header); anything else is replaced by a new id.
_CLIENT_ID = re.compile(rb"[A-Za-z0-9._:@/+=-]{1,128}")
# A value written bare in the text format; others are quoted. No "=" (logfmt parsers
# such as Loki's stop at one inside a bare value), quotes, spaces or control characters.
_BARE = re.compile(r"[A-Za-z0-9._:@/+-]+")
_IN_MESSAGE = frozenset({"method", "path", "status"})  # the text line's message has them


def request_id_of(headers: Iterable[tuple[bytes, bytes]]) -> tuple[bytes, bytes]:
    """The request's id, and the id the backend is sent in ``X-Request-Id``.

    The request's id is its ``X-Request-Id`` header when that is 1-128 characters of
    ``[A-Za-z0-9._:@/+=-]``, else a new random one (32 hex digits). The backend's is
    the same when the gateway made it, and the client's with ``-`` and 8 random hex
    digits after it otherwise: vLLM takes the header as its engine's request id, which
    must be unique among the requests it holds, and a client may reuse its own
    (vllm-project/vllm ``_base_request_id``).
    """
    for name, value in headers:
        if name.lower() == b"x-request-id":
            if _CLIENT_ID.fullmatch(value):
                return value, value + b"-" + os.urandom(4).hex().encode()
            break
    made = os.urandom(16).hex().encode()
    return made, made


def _logfmt_value(value: Any) -> str:
    text = str(value)
    return text if _BARE.fullmatch(text) else json.dumps(text)  # quoted, \n escaped


class TextFormatter(logging.Formatter):
    """The text format: ``time LEVEL logger: message``; an access line's message is
    ``METHOD path status`` and the other fields of :data:`ACCESS_FIELDS` follow it as
    ``key=value`` (a value with spaces,
    quotes or control characters is quoted and escaped, so a line stays one line)."""

    def format(self, record: logging.LogRecord) -> str:
        line = super().format(record)
        if record.name != access_log.name:
            return line
        pairs = [f"{key}={_logfmt_value(value)}" for key in ACCESS_FIELDS
                 if key not in _IN_MESSAGE
                 and (value := getattr(record, key, None)) is not None]
        return f"{line} {' '.join(pairs)}"


# LogRecord attributes left out of a JSON line: the standard ones, and uvicorn's copy of
# its message with terminal colour codes.
_NOT_FIELDS = (*RESERVED_ATTRS, "taskName", "color_message")


def _json_formatter() -> logging.Formatter:
    return JsonFormatter("{asctime}{levelname}{name}{message}", style="{",
                         rename_fields={"asctime": "time", "levelname": "level",
                                        "name": "logger"},
                         reserved_attrs=_NOT_FIELDS)


def configure_logging(server: ServerSettings) -> None:
    """Set up logging for ``gateway serve`` from ``server.log_level``, ``log_format``
    and ``access_log``: one stderr handler on the root logger; uvicorn's loggers go
    through it and its access line is off; httpx's and httpcore's lines show only at
    ``debug``. Call once, before the server starts; uvicorn must then be given
    ``log_config=None`` so that it keeps this set-up."""
    handler = logging.StreamHandler()
    handler.setFormatter(_json_formatter() if server.log_format == "json"
                         else TextFormatter(TEXT_FORMAT))
    root = logging.getLogger()
    for old in list(root.handlers):
        root.removeHandler(old)
    root.addHandler(handler)
    level = server.log_level.upper()
    root.setLevel(level)
    for name in ("uvicorn", "uvicorn.error"):
        logger = logging.getLogger(name)
        logger.handlers.clear()
        logger.propagate = True
    logging.getLogger("uvicorn.access").disabled = True
    quiet = logging.DEBUG if server.log_level == "debug" else logging.WARNING
    for name in ("httpx", "httpcore"):
        logging.getLogger(name).setLevel(quiet)
    access_log.disabled = not server.access_log


def access_level(path: str, status: int) -> int | None:
    """The level of a request's access line, or ``None`` when it would not be written
    (``access_log = false``, or a DEBUG line below the level): INFO, or DEBUG for a path
    of :data:`QUIET_PATHS`: probes always (``/ready`` answers 503 while a backend is
    down, every few seconds), the others when answered below 400 (a refused admin key
    stays visible)."""
    quiet = path in _PROBES or (path in QUIET_PATHS and status < 400)
    level = logging.DEBUG if quiet else logging.INFO
    return level if access_log.isEnabledFor(level) else None


def log_access(fields: dict[str, Any], level: int | None = None) -> None:
    """Write one access line with ``fields`` (keys of :data:`ACCESS_FIELDS`) at
    ``level``, or at the level :func:`access_level` gives, if any. ``fields`` becomes
    the record's extra attributes (it is not copied: pass a dict of its own)."""
    if level is None:
        level = access_level(fields["path"], fields["status"])
    if level is not None:
        access_log.log(level, "%s %s %s", fields["method"], _logfmt_value(fields["path"]),
                       fields["status"], extra=fields)
