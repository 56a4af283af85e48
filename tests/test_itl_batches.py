"""A stream's inter-token gaps are handed on in batches (gateway/relay/usage.py, issue 37)
and still learnt under the slots busy when each came: a batch ends when that changes
(found by the adversarial pass), when it is full or old, and at the attempt's end."""

from __future__ import annotations

from types import SimpleNamespace as NS
from typing import Any

from prometheus_client import CollectorRegistry

from gateway.admission.slo import SloGuard
from gateway.observe.metrics import GatewayMetrics
from gateway.relay.inspect import TokenTimes
from gateway.relay.usage import GAPS_AGE_S, GAPS_BATCH, UsageBook


def book_on(slots_busy: int) -> tuple[UsageBook, Any, Any, SloGuard, GatewayMetrics]:
    clock = NS(t=0.0)
    clock.now = lambda: clock.t
    active = NS(slots=slots_busy)
    slo = SloGuard(clock, active=active, waiting=lambda: 0, wake=lambda: None)
    backend = NS(name="local", admission=NS(slo=slo, layout=None))
    x = NS(backend=backend, stream=True, started=0.0, ttft_s=None, trace=None,
           charge=NS(n=1), party=NS(itl_target_s=None))
    metrics = GatewayMetrics(CollectorRegistry(), lambda: [])
    return UsageBook(x, metrics, clock), clock, active, slo, metrics


def learnt(slo: SloGuard) -> dict[int, int]:
    return {level: h.samples for level, h in slo.model.levels.items()}


def itl_count(metrics: GatewayMetrics) -> float:
    value = metrics.registry.get_sample_value("gateway_itl_seconds_count",
                                              {"backend": "local"})
    return 0.0 if value is None else value


def test_gaps_are_learnt_under_the_level_they_came_at() -> None:
    book, clock, active, slo, _ = book_on(2)
    times = TokenTimes()
    for i in range(41):  # 40 gaps of 2 ms with 2 slots busy
        clock.t = 1.0 + i * 0.002
        book.token_seen(times, now=clock.t)
    active.slots = 1  # another stream's lease is released
    clock.t += 0.03
    book.token_seen(times, now=clock.t)
    book.flush_gaps()
    assert learnt(slo) == {2: 40, 1: 1}


def test_a_batch_is_handed_on_when_full_when_old_and_at_the_end() -> None:
    book, clock, _, slo, metrics = book_on(1)
    times = TokenTimes()
    book.token_seen(times, now=0.0)  # the first token: its TTFT, no gap
    for i in range(1, GAPS_BATCH + 1):
        book.token_seen(times, now=i * 0.001)
    assert itl_count(metrics) == GAPS_BATCH and learnt(slo) == {1: GAPS_BATCH}
    book.token_seen(times, now=1.0)  # one gap kept ...
    assert itl_count(metrics) == GAPS_BATCH
    book.token_seen(times, now=1.0 + GAPS_AGE_S)  # ... handed on once it is old
    assert itl_count(metrics) == GAPS_BATCH + 2
    book.token_seen(times, now=1.2)
    book.flush_gaps()  # the attempt's end
    assert itl_count(metrics) == GAPS_BATCH + 3 and learnt(slo) == {1: GAPS_BATCH + 3}
    book.flush_gaps()  # nothing kept: nothing more
    assert itl_count(metrics) == GAPS_BATCH + 3
