"""Live re-discovery: a backend restarted with other flags changes the gateway's model."""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import pytest

pytestmark = pytest.mark.anyio


async def test_layout_change_is_applied_logged_and_counted(
    harness_factory: Any, fake: Any, caplog: pytest.LogCaptureFixture
) -> None:
    h = await harness_factory()
    assert h.sample("gateway_kv_capacity_tokens", backend="local") == 2048
    fake.n_ctx, fake.slots = 4096, 2  # llama-server restarted with -c 4096 -np 2 --kv-unified
    with caplog.at_level(logging.WARNING):
        await h.backend.discover()
    assert h.sample("gateway_kv_capacity_tokens", backend="local") == 4096
    assert h.sample("gateway_slots", backend="local") == 2
    assert h.sample("gateway_backend_layout_changes_total", backend="local") == 1
    assert "4 slots x 2048" in caplog.text and "2 slots x 4096" in caplog.text
    await h.backend.discover()  # same values: no new change
    assert h.sample("gateway_backend_layout_changes_total", backend="local") == 1


async def test_config_disagreement_is_a_warning(
    harness_factory: Any, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.WARNING):
        h = await harness_factory(slots=8)
    assert "slots = 8" in caplog.text and "reports 4; using 4" in caplog.text
    assert h.sample("gateway_slots", backend="local") == 4  # never above the server


async def test_config_narrows_what_the_backend_reports(harness_factory: Any) -> None:
    h = await harness_factory(slots=2, ctx_per_slot=1024)
    assert (h.backend.admission.layout.slots, h.backend.admission.layout.ctx_per_slot) == (2, 1024)


async def test_upstream_error_triggers_rediscovery(harness: Any, fake: Any) -> None:
    fake.mode = "overflow"
    before = sum(q.url.path == "/props" for q in fake.requests)
    fake.n_ctx = 1024
    r = await harness.chat("hi", max_tokens=10)
    assert r.status_code == 503
    for _ in range(100):
        if harness.sample("gateway_backend_ctx_per_slot", backend="local") == 1024:
            break
        await asyncio.sleep(0.001)
    assert sum(q.url.path == "/props" for q in fake.requests) == before + 1
    assert harness.sample("gateway_backend_ctx_per_slot", backend="local") == 1024


async def test_overflow_shrinks_the_pool_model(harness_factory: Any, fake: Any) -> None:
    h = await harness_factory(pool_tokens=8192)
    fake.mode = "overflow"
    r = await h.chat("hi", max_tokens=10)
    assert r.status_code == 503
    assert h.sample("gateway_kv_capacity_tokens", backend="local") == 8192 - 819
    await h.backend.discover()  # re-discovery keeps the lowered pool
    assert h.sample("gateway_kv_capacity_tokens", backend="local") == 8192 - 819


async def test_a_pool_penalty_easing_off_keeps_what_the_slot_watch_holds() -> None:
    # Only a restarted server (other reported values) releases the reservations held for
    # abandoned requests; the pool model growing back after quiet minutes does not.
    import httpx

    from gateway.admission.slotwatch import Ticket
    from gateway.backends import Discovered
    from gateway.backends.target import PENALTY_RECOVERY_S, Target
    from gateway.config import AdmissionSettings, BackendSettings
    from gateway.core.capacity import Charge
    from tests.fakes import ManualClock

    class Quiet:
        unified_pool, stop_margin, counts_exactly = True, 1, True

        async def discover(self) -> Discovered:
            return Discovered(slots=4, ctx_per_slot=4096)

        async def read_slots(self) -> list[Any]:
            return []

        async def calibrate(self) -> float | None:
            return None

        async def survey(self) -> Any:
            from gateway.wire.builds import BuildReport
            return BuildReport()

    clock = ManualClock()
    target = Target(BackendSettings(name="b", pool_tokens=10_000), AdmissionSettings(),
                    httpx.AsyncClient(), clock, dialect=Quiet())  # type: ignore[arg-type]
    await target.discover()
    target.upstream_failed("context_overflow")
    assert target.admission.layout.pool_tokens == 9_000
    lease = target.admission.try_admit(Charge(100, 2000))
    target.slot_watch.hold(lease, Ticket(slot=lease.slot_ids[0], tasks=1, tag=None,
                                           n_predict=2000, since=clock.now()), served=False)
    clock.advance(PENALTY_RECOVERY_S + 1)
    await target.discover()
    assert target.admission.layout.pool_tokens == 9_500
    assert target.stats().reserved_tokens == 2100 and target.stats().abandoned_held == 1
    await target.close()
