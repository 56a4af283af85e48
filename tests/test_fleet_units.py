"""The fleet's parts without an app: the reload diff (gateway.fleet.reload.plan_reload:
settings in, actions out, nothing changed), the app's task set (gateway.fleet.tasks),
Fleet.mark_failed and Fleet.usable, and the pool gauge rows (gateway.http.views)."""

from __future__ import annotations

import asyncio
from typing import Any

import httpx
import pytest

from gateway.backends.target import Target
from gateway.config import Settings, load_settings
from gateway.errors import ReloadRefused
from gateway.fleet.reload import Action, plan_reload
from gateway.fleet.tasks import TaskSet
from tests.fakes import ManualClock


def settings(*backends: dict[str, Any], **sections: Any) -> Settings:
    return load_settings(backends=[{"url": f"http://{b['name']}:8080", **b} for b in backends],
                         **sections)


def targets(running: Settings) -> dict[str, Target]:
    client = httpx.AsyncClient()
    return {b.name: Target(b, running.admission, client, ManualClock())
            for b in running.backends}


def test_each_backend_gets_one_action_in_order() -> None:
    running = settings({"name": "a"}, {"name": "b"}, {"name": "c"}, {"name": "d"})
    new = settings({"name": "e"}, {"name": "b", "read_timeout_s": 99},
                   {"name": "c", "url": "http://elsewhere:8080"}, {"name": "a"})
    plan = plan_reload(running, new, targets(running))
    assert [(a.action, a.name) for a in plan.backends] == [
        (Action.add, "e"), (Action.reconfigure, "b"), (Action.replace, "c"),
        (Action.keep, "a"), (Action.remove, "d")]
    assert plan.changes == ["added backend e", "changed backend b", "changed backend c",
                            "removed backend d"]
    assert not plan.routing and not plan.tenants and plan.moved == ()


def test_other_sections_are_reported_and_the_address_is_kept() -> None:
    running = settings({"name": "a"}, server={"port": 8000})
    new = settings({"name": "a"}, server={"port": 9000},
                   routing={"failover": False},
                   tenants=[{"name": "t", "key_hashes": ["0" * 64]}])
    plan = plan_reload(running, new, targets(running))
    assert plan.settings.server == running.server  # the listening address stays
    assert plan.settings.routing.failover is False
    assert plan.changes == ["routing settings", "tenants", "not applied: server.port (the "
                            "listening address changes only at a restart)"]
    plan = plan_reload(new, running, targets(new))  # the last tenant goes
    assert "no tenants left: the gateway is open to anyone" in plan.changes


@pytest.mark.parametrize(("section", "value", "named"), [
    ("admission", {"max_queue": 3}, "[admission]"),
    ("server", {"drain_timeout_s": 1.0}, "[server]"),
])
def test_what_needs_a_restart_is_refused(section: str, value: dict[str, Any],
                                         named: str) -> None:
    running = settings({"name": "a"})
    with pytest.raises(ReloadRefused, match=named.replace("[", r"\[")):
        plan_reload(running, settings({"name": "a"}, **{section: value}), targets(running))


@pytest.mark.anyio
async def test_a_task_set_holds_its_tasks_until_they_end_and_cancels_the_rest() -> None:
    tasks = TaskSet()
    done, cancelled = asyncio.Event(), []

    async def quick() -> None:
        done.set()

    async def forever() -> None:
        try:
            await asyncio.Event().wait()
        finally:
            cancelled.append(True)

    tasks.spawn(quick())
    tasks.spawn(forever())
    await done.wait()
    await asyncio.sleep(0)
    assert len(tasks) == 1  # the quick one left
    await tasks.cancel_all()
    assert cancelled == [True] and len(tasks) == 0


def test_pool_gauge_rows_merge_a_retired_queue_into_its_model() -> None:
    from gateway.fleet.pool import ModelQueue
    from gateway.http.views import pool_gauge_rows

    clock = ManualClock()
    live = ModelQueue([], max_queue=8, max_wait_s=1.0, clock=clock, model="m")
    old = ModelQueue([], max_queue=2, max_wait_s=1.0, clock=clock, model="m", retired=True)
    other = ModelQueue([], max_queue=4, max_wait_s=1.0, clock=clock, model="n")
    assert pool_gauge_rows([(live, 1.5), (old, 3.0), (other, 0.0)]) == [
        ("m", 0, 8, 3.0), ("n", 0, 4, 0.0)]


@pytest.mark.anyio
async def test_mark_failed_backs_off_per_routing_and_wakes_the_pool_later() -> None:
    from gateway.backends import Discovered
    from gateway.errors import BackendNotReady
    from gateway.fleet.fleet import Fleet

    class Quiet:
        unified_pool, stop_margin, counts_exactly = True, 1, True
        route_paths: dict[str, str] = {"chat": "/v1/chat/completions"}

        async def discover(self) -> Discovered:
            return Discovered(slots=1, ctx_per_slot=1024)

        async def read_slots(self) -> list[Any]:
            return []

        async def calibrate(self) -> float | None:
            return None

        async def survey(self) -> Any:
            from gateway.wire.builds import BuildReport
            return BuildReport()

    running = settings({"name": "a", "model": "m"}, {"name": "b", "model": "m"},
                       routing={"down_initial_s": 2.0, "down_max_s": 3.0})
    clock = ManualClock()
    client = httpx.AsyncClient()
    backends = {b.name: Target(b, running.admission, client, clock,
                               dialect=Quiet())  # type: ignore[arg-type]
                for b in running.backends}
    for backend in backends.values():
        await backend.discover()
    fleet = Fleet(backends, clock=clock, admission=running.admission,
                  routing=running.routing, make_target=lambda e, a: backends[e.name],
                  tasks=TaskSet())
    members = fleet.resolve("m")
    queue = fleet.queue_for(members)
    assert queue is not None and fleet.queue_for(members) is queue  # one per pool
    woken: list[float] = []
    queue.wake_later = woken.append  # type: ignore[method-assign]
    assert fleet.mark_failed(backends["a"], queue) == 2.0
    assert fleet.mark_failed(backends["a"]) == 3.0  # doubled, at most down_max_s
    assert woken == [2.0]
    assert fleet.usable(members) == [backends["b"]]
    fleet.mark_failed(backends["b"])
    with pytest.raises(BackendNotReady, match="a: down after a failure, for 3 s more"):
        fleet.usable(members)
    clock.advance(3.0)
    assert fleet.usable(members) == members


class _Woken:
    """A pool grantor that only counts the queue's wake-ups."""

    def __init__(self) -> None:
        self.wakes = 0

    def bind(self, queue: Any) -> None:
        pass

    def wake(self, queue: Any) -> None:
        self.wakes += 1


@pytest.mark.anyio
async def test_a_pool_looks_again_after_a_backoff_on_its_own_clock_until_closed() -> None:
    """wake_later waits on the queue's injected clock (it was the event loop's timer, on
    real time whatever the clock), in a named task the queue owns: close ends it."""
    from gateway.fleet.pool import ModelQueue

    clock, woken = ManualClock(), _Woken()
    queue = ModelQueue([], max_queue=4, max_wait_s=60.0, clock=clock, model="m",
                       grantor=woken)  # type: ignore[arg-type]
    queue.wake_later(5.0)
    await asyncio.sleep(0)
    assert [t.get_name() for t in queue._timers] == ["pool 'm': wake in 5 s"]
    clock.advance(4.9)
    await asyncio.sleep(0.01)
    assert woken.wakes == 0
    clock.advance(0.2)
    await asyncio.sleep(0.01)
    assert woken.wakes == 1 and not queue._timers
    queue.wake_later(5.0)
    await asyncio.sleep(0)
    queue.close()
    await asyncio.sleep(0.01)
    clock.advance(10.0)
    await asyncio.sleep(0.01)
    assert woken.wakes == 1 and not queue._timers
