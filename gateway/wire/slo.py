"""A request's own TTFT deadline, from its headers (sans I/O).

A client may ask for a tighter time to first token than its class's target with the
header ``x-gateway-slo-ttft-ms: 800`` (milliseconds from the gateway's receipt of the
request to the first token). Clients written for the llm-d router work unchanged: its
endpoint picker reads ``x-slo-ttft-ms`` (the ``slodeadline`` ordering and SLO-aware
routing of the Gateway API inference extension), and ``x-llm-d-slo-ttft-ms`` is
accepted as well. With several of them, the tightest wins.

The parsed value is carried on the request's :class:`~gateway.core.fairness.Party`
(``ttft_deadline_s``); admission refuses at arrival a request predicted to miss it
(:meth:`gateway.admission.slo.SloGuard.check_ttft`).
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable

from gateway.errors import InvalidRequest

__all__ = ["MAX_TTFT_MS", "SLO_TTFT_HEADERS", "parse_ttft_deadline"]

#: The headers a TTFT deadline is read from, in milliseconds.
SLO_TTFT_HEADERS: tuple[bytes, ...] = (b"x-gateway-slo-ttft-ms", b"x-slo-ttft-ms",
                                       b"x-llm-d-slo-ttft-ms")
#: The largest deadline accepted: one day, in milliseconds (longer is not a deadline).
MAX_TTFT_MS = 86_400_000
# A plain decimal number: no sign, exponent, "inf", "nan", hex or underscores.
_NUMBER = re.compile(rb"\d+(?:\.\d+)?|\.\d+")


def parse_ttft_deadline(headers: Iterable[tuple[bytes, bytes]]) -> float | None:
    """The tightest TTFT deadline the request's headers ask for, in **seconds**, or
    ``None`` when none of :data:`SLO_TTFT_HEADERS` is present (or all are empty).

    :param headers: the raw ASGI headers (names lowercase, as ASGI gives them).
    :raises InvalidRequest: a value that is not a plain decimal number of milliseconds
        greater than 0 and at most :data:`MAX_TTFT_MS` (HTTP 400, ``param`` the header).
    """
    tightest: float | None = None
    for name, raw in headers:
        if name not in SLO_TTFT_HEADERS:
            continue
        value = raw.strip()
        if not value:
            continue  # an empty header asks for nothing, as an empty x-priority
        shown = name.decode("latin-1")
        if not _NUMBER.fullmatch(value):
            raise InvalidRequest(
                f"{shown} must be a number of milliseconds (e.g. 800), not "
                f"{value[:32].decode('latin-1')!r}.", param=shown)
        ms = float(value)
        if not (0 < ms <= MAX_TTFT_MS) or not math.isfinite(ms):
            raise InvalidRequest(
                f"{shown} must be more than 0 and at most {MAX_TTFT_MS} milliseconds.",
                param=shown)
        seconds = ms / 1000.0
        tightest = seconds if tightest is None else min(tightest, seconds)
    return tightest
