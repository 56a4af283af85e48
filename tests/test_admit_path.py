"""One way to a lease (gateway.fleet.pool.AdmitPath): a lone backend (LoneBackend) and a pool's
queue (ModelQueue) answer the same calls, so a caller never branches on which it has."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

import httpx
import pytest

from gateway.backends.target import Target
from gateway.config import AdmissionSettings, BackendSettings
from gateway.core.capacity import Charge, Layout
from gateway.core.fairness import Party
from gateway.errors import QueueFull, QueueTimeout
from gateway.fleet.pool import AdmitPath, Candidate, LoneBackend, ModelQueue
from tests.fakes import ManualClock

pytestmark = pytest.mark.anyio

BIG = Charge(700, 300)  # 1000 tokens: one at a time on a 1024-token pool


def big() -> Charge:
    """A charge of its own (a waiting request is found by its very charge)."""
    return Charge(700, 300)


def _target(clock: ManualClock, max_queue: int = 2) -> Target:
    side = httpx.AsyncClient(transport=httpx.MockTransport(lambda r: httpx.Response(500)))
    target = Target(BackendSettings(name="b", model="m"),
                    AdmissionSettings(max_queue=max_queue, max_queue_wait_s=10.0), side,
                    clock=clock)
    target.admission.set_layout(Layout(2, 1024, pool_tokens=1024))
    target.reachable = True
    return target


def _lone(target: Target, clock: ManualClock) -> AdmitPath:
    return LoneBackend(target)


def _pool(target: Target, clock: ManualClock) -> AdmitPath:
    return ModelQueue([target], max_queue=2, max_wait_s=10.0, clock=clock, failover=False)


PATHS = pytest.mark.parametrize("build", [_lone, _pool], ids=["lone", "pool"])


async def settle() -> None:
    for _ in range(5):
        await asyncio.sleep(0)


@PATHS
async def test_either_path_grants_queues_reports_the_place_and_refuses_when_full(
        build: Callable[[Target, ManualClock], AdmitPath]) -> None:
    clock = ManualClock()
    target = _target(clock)
    path = build(target, clock)
    plans = [[Candidate(target, big(), {})] for _ in range(4)]
    got = path.try_admit(plans[0])
    assert got is not None and got[0] is plans[0][0]
    assert path.try_admit(plans[1]) is None  # no room
    waiting = [asyncio.ensure_future(path.admit(plan)) for plan in plans[1:3]]
    await settle()
    assert path.position(plans[2]) == 2 and path.position(plans[0]) is None
    progress = path.progress(plans[1])
    assert progress is not None and progress[0] == 1
    with pytest.raises(QueueFull):
        path.check_room(Party())
    with pytest.raises(QueueFull):
        await path.admit(plans[3])
    clock.advance(2.0)
    target.admission.release(got[1], served=True)
    await settle()
    candidate, lease = await waiting[0]
    assert candidate is plans[1][0] and lease.waited_s == pytest.approx(2.0)
    assert not path.failover
    path.remember("conversation", "b")  # harmless on either
    clock.advance(10.0)
    await settle()
    with pytest.raises(QueueTimeout):
        await waiting[1]
    target.admission.release(lease, served=True)


async def test_a_lone_backend_takes_only_a_plan_on_itself() -> None:
    clock = ManualClock()
    target, other = _target(clock), _target(clock)
    lone = LoneBackend(target)
    with pytest.raises(ValueError, match="one candidate"):
        lone.try_admit([Candidate(other, BIG, {})])
    with pytest.raises(ValueError, match="one candidate"):
        lone.try_admit([])
