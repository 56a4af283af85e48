"""The pure wait predictions: Retry-After from the drain rate, and the queue replay."""

from __future__ import annotations

import pytest

from gateway.core.capacity import Budget, Charge, Layout, reserve
from gateway.core.waits import MIN_HISTORY, WaitPredictor

LAYOUT = Layout(slots=2, ctx_per_slot=1024, pool_tokens=1024)
HALF = Charge(250, 250)  # 500 tokens: two fit the pool


def test_retry_after_is_one_second_without_history() -> None:
    assert WaitPredictor().retry_after_s(queued=5, slots=2) == 1.0


def test_retry_after_follows_the_drain_rate() -> None:
    waits = WaitPredictor()
    for t in (0.0, 1.0, 2.0):  # one release a second
        waits.record_release(t)
    assert waits.retry_after_s(queued=4, slots=2) == pytest.approx(5.0)
    assert waits.retry_after_s(queued=100, slots=2) == 60.0  # capped
    assert waits.retry_after_s(queued=0, slots=2) == 1.0  # at least 1 s


def test_retry_after_uses_the_mean_duration_until_the_rate_is_known() -> None:
    waits = WaitPredictor()
    waits.record_duration(4.0)
    waits.record_duration(8.0)  # mean 6 s
    assert waits.retry_after_s(queued=1, slots=3) == pytest.approx(4.0)  # 6 * 2 / 3
    waits.record_release(10.0)
    waits.record_release(10.0)  # no span yet: still the durations
    assert waits.retry_after_s(queued=1, slots=3) == pytest.approx(4.0)


def _timed(n: int = MIN_HISTORY) -> WaitPredictor:
    waits = WaitPredictor()
    for _ in range(n):
        waits.record_duration(1.0, HALF)  # 1 s for a 250-token cap
    return waits


def test_no_prediction_before_enough_history_or_a_layout() -> None:
    assert _timed(MIN_HISTORY - 1).replay(LAYOUT, Budget(), 0.0, [], [(HALF, None)]) is None
    assert _timed().replay(None, Budget(), 0.0, [], [(HALF, None)]) is None
    assert _timed().timed == MIN_HISTORY


def test_the_replay_starts_each_charge_at_the_first_end_it_fits_after() -> None:
    waits = _timed()
    budget = reserve(reserve(Budget(), HALF), HALF)  # two in flight, granted at t=0
    in_flight = [(0.0, HALF), (0.0, HALF)]
    now = 0.25
    assert waits.replay(LAYOUT, Budget(), now, [], [(HALF, None)]) == 0.0  # fits now
    assert waits.replay(LAYOUT, budget, now, in_flight, [(HALF, None)]) == pytest.approx(0.75)
    two_ahead = [(HALF, None), (HALF, None), (HALF, None)]
    assert waits.replay(LAYOUT, budget, now, in_flight, two_ahead) == pytest.approx(1.75)
    assert waits.replay(LAYOUT, budget, now, in_flight, [(Charge(2000, 100), None)]) is None


def test_a_waiter_that_will_time_out_first_is_left_out_of_the_replay() -> None:
    waits = _timed()
    budget = reserve(reserve(Budget(), HALF), HALF)
    in_flight = [(0.0, HALF), (0.0, HALF)]
    # The two ahead leave the queue at t=0.5, before the leases end (t=1): they hold nothing.
    ahead = [(HALF, 0.5), (HALF, 0.5), (HALF, None)]
    assert waits.replay(LAYOUT, budget, 0.0, in_flight, ahead) == pytest.approx(1.0)
