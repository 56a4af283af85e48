"""The pure layout and pool-penalty model of one backend (gateway.core.pool_model)."""

from __future__ import annotations

from dataclasses import dataclass

from gateway.core.capacity import Layout
from gateway.core.pool_model import (
    OVERFLOW_BURST_S,
    PENALTY_RECOVERY_S,
    Limits,
    PoolModel,
    describe,
    smaller,
)


@dataclass
class Seen:
    slots: int = 4
    ctx_per_slot: int = 4096
    pool_tokens: int | None = None
    block_size: int = 1
    preemptions: int | None = None


def test_smaller_takes_either_when_the_other_is_unknown() -> None:
    assert smaller(None, None) is None
    assert smaller(3, None) == 3 and smaller(None, 5) == 5 and smaller(8, 5) == 5


def test_config_narrows_what_the_server_reports() -> None:
    model = PoolModel()
    assert model.layout(Limits(), None) is None  # nothing known yet
    assert model.layout(Limits(slots=2, ctx_per_slot=1024), None) == Layout(
        2, 1024, pool_tokens=1024)
    assert model.layout(Limits(slots=8), Seen()) == Layout(4, 4096, pool_tokens=4096)
    assert model.layout(Limits(unified=False, stop_margin=0), Seen()) == Layout(
        4, 4096, stop_margin=0)


def test_the_pool_is_the_reported_or_configured_one_and_lowers_the_context() -> None:
    model = PoolModel()
    seen = Seen(pool_tokens=20_000, block_size=16, ctx_per_slot=32_000)
    assert model.layout(Limits(stop_margin=0), seen) == Layout(
        4, 20_000, pool_tokens=20_000, block_size=16, stop_margin=0)
    assert model.layout(Limits(pool_tokens=10_000), Seen()) == Layout(
        4, 4096, pool_tokens=10_000)


def test_an_overflow_takes_ten_percent_or_down_to_what_was_live() -> None:
    model = PoolModel()
    layout = model.layout(Limits(pool_tokens=10_000), Seen())
    assert model.shrink(layout, 0.0)
    assert model.penalty == 1_000
    assert model.layout(Limits(pool_tokens=10_000), Seen()).pool_tokens == 9_000
    model = PoolModel()
    assert model.shrink(layout, 0.0, live_tokens=6_000)
    assert model.penalty == 4_000


def test_a_burst_of_reports_is_one_overflow() -> None:
    model = PoolModel()
    layout = Layout(4, 1000, pool_tokens=8000)
    assert model.shrink(layout, 10.0, burst=True)
    assert not model.shrink(layout, 10.0 + OVERFLOW_BURST_S / 2, burst=True)
    assert model.shrink(layout, 10.0 + OVERFLOW_BURST_S, burst=True)
    assert model.penalty == 1600


def test_no_penalty_for_a_per_slot_pool_or_one_at_a_slot_already() -> None:
    model = PoolModel()
    assert not model.shrink(None, 0.0)
    assert not model.shrink(Layout(4, 1000), 0.0)
    assert not model.shrink(Layout(4, 1000, pool_tokens=1000), 0.0)
    assert model.penalty == 0


def test_the_penalty_never_takes_the_pool_below_one_slot() -> None:
    model = PoolModel(penalty=50_000)
    assert model.layout(Limits(pool_tokens=10_000), Seen()).pool_tokens == 4096


def test_quiet_minutes_halve_the_penalty_and_a_restart_clears_it() -> None:
    model = PoolModel(penalty=1000, penalized_at=0.0)
    assert not model.recover(PENALTY_RECOVERY_S - 1)
    assert model.recover(PENALTY_RECOVERY_S)
    assert model.penalty == 500 and model.penalized_at == PENALTY_RECOVERY_S
    assert not model.recover(PENALTY_RECOVERY_S + 1)  # the next halving is later
    model.restarted()
    assert model.penalty == 0 and not model.recover(10 * PENALTY_RECOVERY_S)


def test_preemptions_count_only_while_the_gateway_had_work() -> None:
    model = PoolModel()
    assert model.preempted(None, 3, inflight=1, admitted=1) == 0  # not shown before
    assert model.preempted(0, 0, inflight=0, admitted=0) == 0
    assert model.preempted(0, 2, inflight=0, admitted=0) == 0  # someone else's
    assert model.preempted(2, 5, inflight=1, admitted=1) == 3  # ours: in flight now
    assert model.preempted(5, 6, inflight=0, admitted=1) == 1  # busy at the last check
    assert model.preempted(6, 7, inflight=0, admitted=1) == 0  # idle at both, none granted
    assert model.preempted(7, 8, inflight=0, admitted=2) == 1  # one granted between
    assert model.preemptions_seen == 5


def test_describe() -> None:
    assert describe(None) == "unknown"
    assert describe(Layout(4, 4096, pool_tokens=16384)) == (
        "4 slots x 4096 tokens, unified pool 16384")
    assert describe(Layout(2, 1024)) == "2 slots x 1024 tokens, per-slot KV"
