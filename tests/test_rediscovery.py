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
    assert h.sample("gateway_slots_total", backend="local") == 2
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
    assert h.sample("gateway_slots_total", backend="local") == 4  # never above the server


async def test_config_narrows_what_the_backend_reports(harness_factory: Any) -> None:
    h = await harness_factory(slots=2, ctx_per_slot=1024)
    assert (h.backend.layout.slots, h.backend.layout.ctx_per_slot) == (2, 1024)


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
