"""``gateway plan --from-metrics URL``: size slots from the traffic a gateway has seen.

Reads the token histograms a running gateway exports (``gateway_prompt_tokens``,
``gateway_completion_tokens`` and ``gateway_request_tokens`` = prompt + completion per
request), estimates their quantiles the way Prometheus' ``histogram_quantile`` does
(linear interpolation inside the bucket), and recommends a context per slot of
p95(prompt + completion) × (1 + margin), rounded up to llama.cpp's multiple of 256, and
the slot count that the backend's current KV capacity holds at that context.
"""

from __future__ import annotations

import math
from collections import defaultdict
from typing import Any

from prometheus_client.parser import text_string_to_metric_families

from gateway.planner.planning import pad

__all__ = ["histogram_quantile", "read_histograms", "recommend", "render_sizing"]

QUANTILES = (0.5, 0.95, 0.99)
HISTOGRAMS = ("gateway_prompt_tokens", "gateway_completion_tokens", "gateway_request_tokens")


def histogram_quantile(q: float, buckets: list[tuple[float, float]]) -> float | None:
    """Quantile ``q`` from cumulative ``(upper bound, count)`` buckets, sorted, ending +Inf.

    Linear interpolation within the bucket, as Prometheus does; a quantile in the +Inf
    bucket returns the largest finite bound. ``None`` when there are no observations.
    """
    if not buckets or buckets[-1][1] == 0:
        return None
    rank = q * buckets[-1][1]
    prev_bound, prev_count = 0.0, 0.0
    for bound, count in buckets:
        if count >= rank:
            if math.isinf(bound):
                return prev_bound
            if count == prev_count:
                return bound
            return prev_bound + (bound - prev_bound) * (rank - prev_count) / (count - prev_count)
        prev_bound, prev_count = bound, count
    return prev_bound


def read_histograms(text: str) -> dict[str, dict[str, Any]]:
    """Per backend: the token histograms' buckets and counts, and KV capacity gauges."""
    out: dict[str, dict[str, Any]] = defaultdict(lambda: {"buckets": defaultdict(list)})
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            backend = s.labels.get("backend")
            if backend is None:
                continue
            if s.name.endswith("_bucket") and s.name[: -len("_bucket")] in HISTOGRAMS:
                out[backend]["buckets"][s.name[: -len("_bucket")]].append(
                    (float(s.labels["le"]), s.value))
            elif s.name.endswith("_count") and s.name[: -len("_count")] in HISTOGRAMS:
                out[backend][s.name] = s.value
            elif s.name in ("gateway_kv_capacity_tokens", "gateway_slots",
                            "gateway_backend_ctx_per_slot"):
                out[backend][s.name] = s.value
            elif s.name == "gateway_slots_total":  # its name before it was renamed
                out[backend].setdefault("gateway_slots", s.value)
    for data in out.values():
        for name in data["buckets"]:
            data["buckets"][name].sort()
    return dict(out)


def recommend(text: str, *, margin: float = 0.1) -> dict[str, Any]:
    """Quantiles per backend and the recommended ``ctx_per_slot`` and ``slots``.

    :param text: a gateway's ``/metrics`` text.
    :param margin: safety margin over the p95 of prompt + completion (0.1 = 10 %).
    :raises ValueError: no token histogram with observations in the text.
    """
    result: dict[str, Any] = {}
    for backend, data in read_histograms(text).items():
        quantiles = {
            name: {f"p{round(q * 100)}": histogram_quantile(q, data["buckets"].get(name, []))
                   for q in QUANTILES}
            for name in HISTOGRAMS
        }
        total_p95 = quantiles["gateway_request_tokens"]["p95"]
        if total_p95 is None:
            continue
        ctx = pad(math.ceil(total_p95 * (1 + margin)), 256)
        capacity = data.get("gateway_kv_capacity_tokens")
        result[backend] = {
            "requests": data.get("gateway_request_tokens_count", 0),
            "quantiles": {name.removeprefix("gateway_"): v for name, v in quantiles.items()},
            "margin": margin,
            "recommended_ctx_per_slot": ctx,
            "kv_capacity_tokens": capacity,
            "current_slots": data.get("gateway_slots"),
            "current_ctx_per_slot": data.get("gateway_backend_ctx_per_slot"),
            "recommended_slots": max(1, int(capacity // ctx)) if capacity else None,
        }
    if not result:
        raise ValueError("no gateway_request_tokens observations in these metrics yet")
    return result


def render_sizing(result: dict[str, Any]) -> str:
    """The recommendation as text."""
    lines = []
    for backend, r in result.items():
        lines.append(f"backend {backend}: {int(r['requests'])} requests")
        lines.append(f"  {'tokens':<12} {'p50':>8} {'p95':>8} {'p99':>8}")
        for name, qs in r["quantiles"].items():
            row = "".join(f" {'-' if v is None else f'{v:,.0f}':>8}" for v in qs.values())
            lines.append(f"  {name.removesuffix('_tokens'):<12}{row}")
        lines.append(
            f"  recommended ctx_per_slot {r['recommended_ctx_per_slot']} "
            f"(p95 of prompt + completion, +{r['margin']:.0%}, rounded up to 256)")
        if r["recommended_slots"]:
            slots, ctx = int(r["current_slots"] or 0), int(r["current_ctx_per_slot"] or 0)
            capacity = int(r["kv_capacity_tokens"])
            now = (f"{slots} slots sharing a {capacity}-token pool" if capacity < slots * ctx
                   else f"{slots} x {ctx}")
            lines.append(
                f"  recommended slots {r['recommended_slots']} (KV capacity {capacity} tokens"
                f" / {r['recommended_ctx_per_slot']}, so that every slot holds a p95 request "
                f"at once); now {now}")
            lines.append(
                f"  llama-server -c {r['recommended_slots'] * r['recommended_ctx_per_slot']} "
                f"-np {r['recommended_slots']} --no-kv-unified")
    return "\n".join(lines)
