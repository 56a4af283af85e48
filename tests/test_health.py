"""The pure circuit breaker of one backend (gateway.core.health.Health)."""

from __future__ import annotations

from gateway.core.health import Health


def test_a_new_backend_is_usable() -> None:
    health = Health()
    assert health.usable(0.0) and health.failures == 0 and health.down_for_s(0.0) == 0.0


def test_failures_in_a_row_double_the_backoff_up_to_the_cap() -> None:
    health = Health()
    assert [health.request_failed(100.0, 1.0, 5.0) for _ in range(4)] == [1.0, 2.0, 4.0, 5.0]
    assert health.failures == 4 and health.down_until == 105.0
    assert not health.usable(104.9) and health.usable(105.0)
    assert health.down_for_s(103.0) == 2.0 and health.down_for_s(200.0) == 0.0


def test_a_success_clears_the_failures() -> None:
    health = Health()
    health.request_failed(10.0, 1.0, 30.0)
    health.request_served()
    assert health == Health()
    assert health.request_failed(20.0, 1.0, 30.0) == 1.0  # the backoff starts again


def test_the_probe_holds_others_off_only_after_the_backoff() -> None:
    health = Health()
    health.probe_started(0.0, 6.0)
    assert health.usable(0.0)  # healthy: a request sent is no probe
    health.request_failed(0.0, 2.0, 30.0)
    health.probe_started(1.0, 6.0)  # still down: nothing changes
    assert health.down_until == 2.0
    health.probe_started(3.0, 6.0)  # the half-open probe
    assert not health.usable(8.9) and health.usable(9.0)
