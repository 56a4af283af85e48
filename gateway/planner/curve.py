"""``gateway plan --users N ... --from-metrics URL``: what latency that many users will
see, read from the curve a running gateway has learnt (``docs/latency.md``).

The gateway exports, per backend, the ITL p95 it learnt with ``level`` slots busy
(``gateway_latency_itl_p95_seconds{backend,level}``) and its prefill throughput
(``gateway_latency_prefill_tokens_per_second{backend}``). For a plan whose slots are busy
``n`` at once at the p95 of the users' load, the ITL p95 they see is the learned one at
level ``n``; the TTFT of a turn that does not wait for a slot is its prompt over the
prefill rate plus one decode step at that level.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from prometheus_client.parser import text_string_to_metric_families

__all__ = ["Curve", "expected", "parse_curves"]


@dataclass
class Curve:
    """One backend's learned latency, as its gateway exported it.

    :param itl_p95_s: level (slots busy) -> ITL p95, seconds.
    :param prefill_tps: prompt tokens per second, or ``None`` when not learnt.
    """

    itl_p95_s: dict[int, float] = field(default_factory=dict)
    prefill_tps: float | None = None


def parse_curves(text: str) -> dict[str, Curve]:
    """Each backend's :class:`Curve` from a gateway's ``/metrics`` text (backends with
    nothing learnt are left out).

    :raises ValueError: the text is not the Prometheus exposition format.
    """
    curves: dict[str, Curve] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            backend = s.labels.get("backend")
            if backend is None:
                continue
            if s.name == "gateway_latency_itl_p95_seconds" and s.labels.get("level", "").isdigit():
                curves.setdefault(backend, Curve()).itl_p95_s[int(s.labels["level"])] = s.value
            elif s.name == "gateway_latency_prefill_tokens_per_second" and s.value > 0:
                curves.setdefault(backend, Curve()).prefill_tps = s.value
    return curves


def expected(curve: Curve, level: int, prompt_tokens: int | None) -> dict[str, Any]:
    """The latency ``level`` busy slots get on ``curve``.

    The learned level itself, else the nearest learned level above it (what the backend
    did with more streams: an upper bound), else the highest below it (a lower bound,
    flagged ``"at_least": True``).

    :returns: ``{"level", "from_level", "itl_p95_s", "at_least", "ttft_s"}``; the ITL is
        ``None`` when nothing was learnt, the TTFT (prompt over the prefill rate plus one
        step, no queue wait) ``None`` without a prompt size or a prefill rate.
    """
    above = sorted(n for n in curve.itl_p95_s if n >= level)
    below = sorted(n for n in curve.itl_p95_s if n < level)
    source = above[0] if above else (below[-1] if below else None)
    itl = None if source is None else curve.itl_p95_s[source]
    ttft = None
    if prompt_tokens is not None and curve.prefill_tps:
        ttft = prompt_tokens / curve.prefill_tps + (itl or 0.0)
    return {"level": level, "from_level": source, "itl_p95_s": itl,
            "at_least": source is not None and source < level, "ttft_s": ttft}
