"""Several backends behind one gateway (gateway/fleet/pool.py): model names and pools, routing
by fit, one queue per model, and its no-starvation and no-overcommit properties.

The upstreams are fake llama-servers (tests/fakes.py), one per host, behind one mock
transport.
"""

from __future__ import annotations

import asyncio
import json
import re
from collections.abc import AsyncIterator
from typing import Any

import httpx
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from prometheus_client import CollectorRegistry

from gateway.admission.lease import Lease
from gateway.backends.target import Target
from gateway.config import load_settings
from gateway.core.capacity import Charge, Layout
from gateway.fleet.pool import Candidate, ModelQueue
from gateway.http.app import create_app, shutdown
from tests.conftest import closed_at_test_end, closed_now, sample_sum
from tests.fakes import FakeLlamaServer, ManualClock

pytestmark = pytest.mark.anyio
CHAT = "/v1/chat/completions"


class Fleet:
    """The gateway over several fake llama-servers, one per backend name."""

    def __init__(self, fakes: dict[str, FakeLlamaServer], backends: list[dict[str, Any]],
                 **sections: Any) -> None:
        self.fakes = fakes
        self.refused: set[str] = set()  # backends whose generation calls are refused

        async def route(request: httpx.Request) -> httpx.Response:
            host = request.url.host
            if host in self.refused and request.url.path in (CHAT, "/v1/completions"):
                raise httpx.ConnectError("connection refused", request=request)
            return await fakes[host].handle(request)

        entries = [{"url": f"http://{b['name']}:8080", **b} for b in backends]
        clock = sections.pop("clock", None)
        self.settings = load_settings(admission={"disconnect_grace_s": 0.0,
                                                 **sections.pop("admission", {})},
                                      backends=entries, **sections)
        self.app = create_app(self.settings, http_client=httpx.AsyncClient(
            transport=httpx.MockTransport(route)), registry=CollectorRegistry(),
            discover=False, clock=clock)
        self.state = self.app.state.gateway
        self.client = httpx.AsyncClient(transport=httpx.ASGITransport(app=self.app),
                                        base_url="http://gateway")
        closed_at_test_end(self.aclose)

    async def aclose(self) -> None:
        """Close the client, then stop the app as its lifespan would."""
        closed_now(self.aclose)
        await self.client.aclose()
        await shutdown(self.app)

    async def discover(self) -> None:
        for backend in self.state.fleet.backends.values():
            await backend.discover()

    async def chat(self, content: str = "hello there", **extra: Any) -> httpx.Response:
        body = {"messages": [{"role": "user", "content": content}], **extra}
        return await self.client.post(CHAT, json=body)

    def served_by(self) -> dict[str, int]:
        return {name: len(fake.generations) for name, fake in self.fakes.items()}


async def served(fleet: Fleet, total: int, timeout_s: float = 10.0) -> dict[str, int]:
    """Wait until ``total`` generations reached the backends (on a loaded machine the
    gateway may take longer than a fixed sleep); returns who served how many."""
    for _ in range(int(timeout_s / 0.005)):
        if sum(fleet.served_by().values()) >= total:
            break
        await asyncio.sleep(0.005)
    await asyncio.sleep(0.02)  # and no more than that arrive
    return fleet.served_by()


@pytest.fixture
async def make_fleet() -> AsyncIterator[Any]:
    built: list[Fleet] = []

    async def build(fakes: dict[str, FakeLlamaServer], backends: list[dict[str, Any]],
                    **sections: Any) -> Fleet:
        fleet = Fleet(fakes, backends, **sections)
        await fleet.discover()
        built.append(fleet)
        return fleet

    yield build
    for fleet in built:
        await fleet.aclose()


async def test_a_pool_spreads_requests_by_fit(make_fleet: Any) -> None:
    hold = asyncio.Event()
    fakes = {"a": FakeLlamaServer(slots=1, hold=hold), "b": FakeLlamaServer(slots=1, hold=hold)}
    fleet = await make_fleet(fakes, [{"name": "a", "model": "m"}, {"name": "b", "model": "m"}])
    first = asyncio.ensure_future(fleet.chat(model="m", max_tokens=5))
    second = asyncio.ensure_future(fleet.chat(model="m", max_tokens=5))
    assert await served(fleet, 2) == {"a": 1, "b": 1}  # one each: each had one free slot
    hold.set()
    assert (await first).status_code == 200 and (await second).status_code == 200


async def test_the_emptier_backend_is_chosen(make_fleet: Any) -> None:
    hold = asyncio.Event()
    fakes = {"a": FakeLlamaServer(slots=4, hold=hold), "b": FakeLlamaServer(slots=4, hold=hold)}
    fleet = await make_fleet(fakes, [{"name": "a", "model": "m"}, {"name": "b", "model": "m"}])
    tasks = [asyncio.ensure_future(fleet.chat(f"question {i}", model="m", max_tokens=100))
             for i in range(6)]  # six conversations
    assert await served(fleet, 6) == {"a": 3, "b": 3}  # each goes where most is left
    hold.set()
    assert all(r.status_code == 200 for r in await asyncio.gather(*tasks))


async def test_one_queue_per_model_starts_on_whichever_frees_first(make_fleet: Any) -> None:
    holds = {"a": asyncio.Event(), "b": asyncio.Event()}
    fakes = {n: FakeLlamaServer(slots=1, hold=holds[n]) for n in holds}
    fleet = await make_fleet(fakes, [{"name": "a", "model": "m"}, {"name": "b", "model": "m"}])
    running = [asyncio.ensure_future(fleet.chat(model="m", max_tokens=5)) for _ in range(2)]
    assert await served(fleet, 2) == {"a": 1, "b": 1}
    waiting = asyncio.ensure_future(fleet.chat(model="m", max_tokens=5))
    queue = next(iter(fleet.state.fleet._queues.values()))
    for _ in range(2000):
        if queue.waiting:
            break
        await asyncio.sleep(0.005)
    assert queue.waiting == 1 and fleet.served_by() == {"a": 1, "b": 1}
    # the wait shows in the pool's gauges, not in either backend's own queue
    metrics = (await fleet.client.get("/metrics")).text
    assert 'gateway_pool_queue_depth{model="m"} 1.0' in metrics
    assert 'gateway_pool_queue_capacity{model="m"} 64.0' in metrics
    oldest = re.search(r'gateway_pool_queue_oldest_wait_seconds\{model="m"\} (\S+)', metrics)
    assert oldest is not None and float(oldest.group(1)) > 0
    assert 'gateway_queue_depth{backend="a"} 0.0' in metrics
    holds["b"].set()  # b frees its slot first: the waiter starts there
    r = await waiting
    assert r.status_code == 200 and fleet.served_by() == {"a": 1, "b": 2}
    metrics = (await fleet.client.get("/metrics")).text
    assert 'gateway_pool_queue_depth{model="m"} 0.0' in metrics
    assert 'gateway_pool_queue_oldest_wait_seconds{model="m"} 0.0' in metrics
    holds["a"].set()
    assert all(r.status_code == 200 for r in await asyncio.gather(*running))


async def test_a_prompt_too_long_for_one_backend_goes_to_the_other(make_fleet: Any) -> None:
    fakes = {"small": FakeLlamaServer(n_ctx=256), "big": FakeLlamaServer(n_ctx=4096)}
    fleet = await make_fleet(fakes, [{"name": "small", "model": "m"},
                                     {"name": "big", "model": "m"}])
    r = await fleet.chat("word " * 400, model="m", max_tokens=50)
    assert r.status_code == 200, r.text
    assert fleet.served_by() == {"small": 0, "big": 1}
    r = await fleet.chat("word " * 5000, model="m", max_tokens=50)  # fits neither
    assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded"
    assert "4096" in r.json()["error"]["message"]  # the refusal of the largest slot


async def test_models_are_resolved_by_name_alias_and_default(make_fleet: Any) -> None:
    fakes = {n: FakeLlamaServer() for n in ("a", "b", "c")}
    fleet = await make_fleet(fakes, [
        {"name": "a", "model": "llama", "aliases": ["llama-8b"]},
        {"name": "b", "model": "llama"}, {"name": "c", "model": "qwen"}])
    assert (await fleet.chat(model="qwen", max_tokens=3)).status_code == 200
    assert fleet.served_by()["c"] == 1
    assert (await fleet.chat(model="llama-8b", max_tokens=3)).status_code == 200
    assert fleet.served_by()["c"] == 1 and fleet.served_by()["a"] == 1
    assert (await fleet.chat(model="b", max_tokens=3)).status_code == 200  # a backend name
    assert fleet.served_by()["b"] == 1
    for body_model in ("gpt-4o", None):
        extra = {} if body_model is None else {"model": body_model}
        r = await fleet.chat(max_tokens=3, **extra)
        assert r.status_code == 404, r.text
        error = r.json()["error"]
        assert error["code"] == "model_not_found" and "llama, qwen" in error["message"]
        assert ("names no model" in error["message"]) == (body_model is None)
    assert sum(fleet.served_by().values()) == 3  # nothing forwarded for those


async def test_a_default_model_takes_unknown_names(make_fleet: Any) -> None:
    fakes = {n: FakeLlamaServer() for n in ("a", "c")}
    fleet = await make_fleet(fakes, [{"name": "a", "model": "llama"},
                                     {"name": "c", "model": "qwen"}],
                             routing={"default_model": "qwen"})
    assert (await fleet.chat(model="gpt-4o", max_tokens=3)).status_code == 200
    assert fleet.served_by() == {"a": 0, "c": 1}


async def test_one_model_takes_any_name(make_fleet: Any) -> None:
    """Backends without a configured model take the id they report ("fake.gguf" here):
    one model in all, so any name reaches it, as a lone llama-server ignores the field."""
    fakes = {n: FakeLlamaServer() for n in ("a", "b")}
    fleet = await make_fleet(fakes, [{"name": "a"}, {"name": "b"}])
    assert {b.model for b in fleet.state.fleet.backends.values()} == {"fake.gguf"}
    assert (await fleet.chat(model="whatever", max_tokens=3)).status_code == 200


@pytest.mark.parametrize(("backends", "routing", "message"), [
    ([{"name": "a", "model": "m", "aliases": ["b"]}, {"name": "b", "url": "http://b:1"}],
     {}, "names both"),
    ([{"name": "a", "model": "m", "aliases": ["x"]},
      {"name": "b", "url": "http://b:1", "model": "n", "aliases": ["x"]}], {}, "two models"),
    ([{"name": "a"}, {"name": "b"}], {}, "share the url"),
    ([{"name": "a", "aliases": ["x"]}], {}, "aliases need a model"),
    ([{"name": "a", "model": "m"}], {"default_model": "zz"}, "default_model"),
])
def test_ambiguous_names_are_refused_at_load(backends: list[dict[str, Any]],
                                            routing: dict[str, Any], message: str) -> None:
    from gateway.config import ConfigError

    with pytest.raises(ConfigError, match=message):
        load_settings(backends=backends, routing=routing)


# -- the model queue's properties ------------------------------------------------------


def _target(name: str, layout: Layout, clock: ManualClock) -> Target:
    from gateway.config import AdmissionSettings, BackendSettings

    side = httpx.AsyncClient(transport=httpx.MockTransport(lambda r: httpx.Response(500)))
    target = Target(BackendSettings(name=name, model="m"), AdmissionSettings(), side,
                    clock=clock)
    target.admission.set_layout(layout)
    target.reachable = True
    return target


LAYOUTS = [Layout(2, 1024, pool_tokens=1024), Layout(1, 2048), Layout(4, 512)]


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.integers(1, 1500), st.integers(1, 600), st.booleans()),
                min_size=1, max_size=25))
def test_the_model_queue_never_overcommits_and_never_lets_a_later_request_pass(
        ops: list[tuple[int, int, bool]]) -> None:
    """Random arrivals (prompt, cap) over three backends of different layouts, each
    followed or not by the release of the oldest lease in flight. At every step no
    backend holds more than its capacity; every request starts in the end; and none
    starts before an earlier one on a backend the earlier one could use (FIFO over the
    whole model, per backend)."""

    async def run() -> None:
        clock = ManualClock()
        members = [_target(f"b{i}", layout, clock) for i, layout in enumerate(LAYOUTS)]
        queue = ModelQueue(members, max_queue=100, max_wait_s=1e9, clock=clock)
        started: list[int] = []
        usable_by: dict[int, set[str]] = {}
        took: dict[int, str] = {}
        leases: list[tuple[Target, Lease]] = []
        tasks = []

        async def request(i: int, prompt: int, cap: int) -> None:
            candidates = [Candidate(t, Charge(prompt, cap), {}) for t in members
                          if prompt + cap < t.admission.layout.ctx_per_slot]
            if not candidates:
                return
            usable_by[i] = {c.backend.name for c in candidates}
            candidate, lease = await queue.admit(candidates)
            started.append(i)
            took[i] = candidate.backend.name
            leases.append((candidate.backend, lease))

        for i, (prompt, cap, release) in enumerate(ops):
            tasks.append(asyncio.ensure_future(request(i, prompt, cap)))
            await asyncio.sleep(0)
            if release and leases:
                backend, lease = leases.pop(0)
                backend.admission.release(lease, served=True)
                await asyncio.sleep(0)
            for t in members:
                stats = t.admission.stats()
                assert stats.reserved_tokens <= stats.capacity_tokens
                assert stats.busy_slots <= stats.slots
        while leases or not all(task.done() for task in tasks):
            if leases:
                backend, lease = leases.pop(0)
                backend.admission.release(lease, served=True)
            await asyncio.sleep(0)
        fitting = [i for i, (p, c, _) in enumerate(ops)
                   if any(p + c < layout.ctx_per_slot for layout in LAYOUTS)]
        assert sorted(started) == fitting  # all served
        # No request started ahead of an earlier one on a backend the earlier could use.
        for later_pos, j in enumerate(started):
            for i in started[later_pos + 1:]:
                if i < j:
                    assert took[j] not in usable_by[i], (i, j, took, usable_by)
        assert queue.waiting == 0

    asyncio.run(run())


async def test_models_lists_each_model_once(make_fleet: Any) -> None:
    fakes = {n: FakeLlamaServer() for n in ("a", "b", "c")}
    fleet = await make_fleet(fakes, [{"name": "a", "model": "llama"},
                                     {"name": "b", "model": "llama"},
                                     {"name": "c", "model": "qwen"}])
    listed = (await fleet.client.get("/v1/models")).json()
    assert sorted(m["id"] for m in listed["data"]) == ["llama", "qwen"]
    assert all("aliases" not in m for m in listed["data"])  # not the backends' own
    assert json.dumps(listed)  # plain JSON


# -- failover and health ---------------------------------------------------------------


async def test_a_refused_connection_fails_over_and_marks_the_backend_down(
        make_fleet: Any) -> None:
    fakes = {"a": FakeLlamaServer(), "b": FakeLlamaServer()}
    fleet = await make_fleet(fakes, [{"name": "a", "model": "m"}, {"name": "b", "model": "m"}])
    fleet.refused.add("a")
    r = await fleet.chat(model="m", max_tokens=3)
    assert r.status_code == 200, r.text
    assert fleet.served_by() == {"a": 0, "b": 1}
    a = fleet.state.fleet.backends["a"]
    assert a.health.failures == 1 and not a.up
    metrics = fleet.state.metrics.registry
    assert metrics.get_sample_value("gateway_failovers_total", {"model": "m"}) == 1
    assert metrics.get_sample_value("gateway_backend_up", {"backend": "a"}) == 0
    assert metrics.get_sample_value("gateway_route_decisions_total", {
        "model": "m", "backend": "b", "reason": "failover"}) == 1
    # While a is down, requests go to b without trying a.
    tried = len(fakes["a"].requests)
    assert (await fleet.chat(model="m", max_tokens=3)).status_code == 200
    assert len(fakes["a"].requests) == tried
    assert fleet.state.fleet.backends["a"].admission.stats().inflight == 0  # released


async def test_a_backend_that_cannot_count_is_passed_over(make_fleet: Any) -> None:
    fakes = {"a": FakeLlamaServer(), "b": FakeLlamaServer()}
    fleet = await make_fleet(fakes, [{"name": "a", "model": "m"}, {"name": "b", "model": "m"}])
    fakes["a"].mode = "connect"  # refuses everything, the count first
    r = await fleet.chat(model="m", max_tokens=3)
    assert r.status_code == 200, r.text
    assert fleet.served_by() == {"a": 0, "b": 1}
    assert not fleet.state.fleet.backends["a"].up


@pytest.mark.parametrize("mode", ["boom", "loading"])
async def test_a_5xx_before_any_byte_fails_over(make_fleet: Any, mode: str) -> None:
    fakes = {"a": FakeLlamaServer(), "b": FakeLlamaServer()}
    fleet = await make_fleet(fakes, [{"name": "a", "model": "m"}, {"name": "b", "model": "m"}])
    fakes["a"].mode = mode
    for stream in (False, True):
        fleet.state.fleet.backends["a"].health.request_served()  # up again
        r = await fleet.chat(model="m", max_tokens=3, stream=stream)
        assert r.status_code == 200, r.text
        if stream:
            assert r.text.rstrip().endswith("data: [DONE]")
    assert fleet.served_by()["b"] == 2


async def test_nothing_is_retried_once_a_byte_has_gone_out(make_fleet: Any) -> None:
    fakes = {"a": FakeLlamaServer(mode="midstream"), "b": FakeLlamaServer()}
    fleet = await make_fleet(fakes, [{"name": "a", "model": "m"}, {"name": "b", "model": "m"}])
    r = await fleet.chat(model="m", max_tokens=5, stream=True)
    assert r.status_code == 200
    assert '"error"' in r.text  # the stream ends with an error event, not a second answer
    assert fleet.served_by()["b"] == 0


async def test_when_every_backend_fails_the_client_gets_the_failure(make_fleet: Any) -> None:
    fakes = {"a": FakeLlamaServer(), "b": FakeLlamaServer()}
    fleet = await make_fleet(fakes, [{"name": "a", "model": "m"}, {"name": "b", "model": "m"}])
    fleet.refused.update(("a", "b"))
    r = await fleet.chat(model="m", max_tokens=3)
    assert r.status_code == 502 and "cannot be reached" in r.json()["error"]["message"]
    r = await fleet.chat(model="m", max_tokens=3)  # both down now: 503 at once
    assert r.status_code == 503 and "down after a failure" in r.json()["error"]["message"]
    assert int(r.headers["retry-after"]) >= 1
    for backend in fleet.state.fleet.backends.values():
        assert backend.admission.stats().inflight == 0


async def test_a_down_backend_is_probed_once_its_backoff_has_passed(make_fleet: Any) -> None:
    clock = ManualClock()
    fakes = {"a": FakeLlamaServer(), "b": FakeLlamaServer()}
    # Every part on the clock the test moves (the pool's queue judges health on its own:
    # a backend with the manual clock alone was still down by the monotonic one on a
    # machine up for less than the manual clock's start).
    fleet = await make_fleet(fakes, [{"name": "a", "model": "m"}, {"name": "b", "model": "m"}],
                             routing={"down_initial_s": 5.0}, clock=clock)
    fleet.refused.add("a")
    a = fleet.state.fleet.backends["a"]
    assert (await fleet.chat(model="m", max_tokens=3)).status_code == 200
    assert a.health.failures == 1 and a.health.down_until == clock.now() + 5.0
    clock.advance(5.0)
    fleet.refused.clear()
    r = await fleet.chat("another conversation", model="m", max_tokens=3)
    assert r.status_code == 200  # the probe
    assert a.health.failures == 0 and a.up and fleet.served_by()["a"] == 1


# -- prefix affinity -------------------------------------------------------------------


def test_turns_of_one_conversation_share_a_key() -> None:
    from gateway.fleet.pool import affinity_key

    system = {"role": "system", "content": "You are terse."}
    turn1 = {"messages": [system, {"role": "user", "content": "Name a river."}]}
    turn2 = {"messages": [*turn1["messages"], {"role": "assistant", "content": "Nile."},
                          {"role": "user", "content": "Another."}]}
    other = {"messages": [system, {"role": "user", "content": "Name a lake."}]}
    assert affinity_key(turn1) == affinity_key(turn2) != affinity_key(other)
    assert affinity_key({"prompt": "x" * 5000}) == affinity_key({"prompt": "x" * 4000})
    assert affinity_key({"prompt": [1, 2, 3]}) is None


async def test_a_conversation_goes_back_to_its_backend_while_it_has_room(
        make_fleet: Any) -> None:
    fakes = {"a": FakeLlamaServer(), "b": FakeLlamaServer()}
    fleet = await make_fleet(fakes, [{"name": "a", "model": "m"}, {"name": "b", "model": "m"}])
    history = [{"role": "user", "content": "Tell me a story."}]
    r = await fleet.client.post(CHAT, json={"model": "m", "messages": history,
                                            "max_tokens": 3})
    assert r.status_code == 200 and fleet.served_by() == {"a": 1, "b": 0}  # a tie: first
    queue = next(iter(fleet.state.fleet._queues.values()))
    from gateway.fleet.pool import affinity_key

    queue.remember(affinity_key({"messages": history}), "b")  # as if b had served it
    history += [{"role": "assistant", "content": "Once"}, {"role": "user", "content": "More"}]
    r = await fleet.client.post(CHAT, json={"model": "m", "messages": history,
                                            "max_tokens": 3})
    assert r.status_code == 200 and fleet.served_by() == {"a": 1, "b": 1}
    registry = fleet.state.metrics.registry
    assert registry.get_sample_value("gateway_route_decisions_total", {
        "model": "m", "backend": "b", "reason": "affinity"}) == 1


async def test_affinity_yields_to_fit() -> None:
    clock = ManualClock()
    members = [_target("a", Layout(1, 2048), clock), _target("b", Layout(1, 2048), clock)]
    queue = ModelQueue(members, max_queue=4, max_wait_s=60, clock=clock)
    busy = members[1].admission.try_admit(Charge(10, 10))  # b's only slot is taken
    assert busy is not None
    got = queue.try_admit([Candidate(t, Charge(10, 10), {}) for t in members], affinity="b")
    assert got is not None and got[0].backend.name == "a"


# -- readiness, draining and reload ---------------------------------------------------

ADMIN = {"Authorization": "Bearer sesame"}


async def test_ready_needs_a_usable_backend_for_every_model(make_fleet: Any) -> None:
    fakes = {n: FakeLlamaServer() for n in ("a", "b", "c")}
    fleet = await make_fleet(fakes, [{"name": "a", "model": "llama"},
                                     {"name": "b", "model": "llama"},
                                     {"name": "c", "model": "qwen"}])
    assert (await fleet.client.get("/ready")).status_code == 200
    fleet.state.fleet.backends["a"].request_failed(30, 30)  # llama still has b
    assert (await fleet.client.get("/ready")).status_code == 200
    fleet.state.fleet.backends["c"].request_failed(30, 30)  # qwen has none left
    r = await fleet.client.get("/ready")
    assert r.status_code == 503 and r.json()["models"] == {"llama": True, "qwen": False}
    assert r.json()["backends"]["c"]["down"] is True


async def test_admin_routes_need_the_key(make_fleet: Any) -> None:
    fleet = await make_fleet({"a": FakeLlamaServer()}, [{"name": "a"}])
    assert (await fleet.client.get("/admin/backends")).status_code == 404  # no key set
    keyed = await make_fleet({"a": FakeLlamaServer()}, [{"name": "a"}],
                             server={"admin_key": "sesame"})
    r = await keyed.client.get("/admin/backends")
    assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"
    r = await keyed.client.get("/admin/backends", headers={"Authorization": "Bearer nope"})
    assert r.status_code == 401
    r = await keyed.client.get("/admin/backends", headers=ADMIN)
    assert r.status_code == 200 and r.json()["backends"][0]["name"] == "a"


async def test_a_drained_backend_finishes_its_requests_and_takes_no_new_ones(
        make_fleet: Any) -> None:
    holds = {"a": asyncio.Event(), "b": asyncio.Event()}
    fakes = {n: FakeLlamaServer(hold=holds[n]) for n in holds}
    fleet = await make_fleet(fakes, [{"name": "a", "model": "m"}, {"name": "b", "model": "m"}],
                             server={"admin_key": "sesame"})
    on_a = asyncio.ensure_future(fleet.chat("first", model="m", max_tokens=3))
    await asyncio.sleep(0.05)
    assert fleet.served_by() == {"a": 1, "b": 0}
    r = await fleet.client.post("/admin/backends/a/drain", headers=ADMIN)
    assert r.status_code == 200 and r.json()["draining"] is True
    holds["b"].set()
    for i in range(3):
        assert (await fleet.chat(f"next {i}", model="m", max_tokens=3)).status_code == 200
    assert fleet.served_by() == {"a": 1, "b": 3}
    holds["a"].set()
    assert (await on_a).status_code == 200  # the request in flight finished
    await fleet.client.post("/admin/backends/a/undrain", headers=ADMIN)
    assert (await fleet.chat("after", model="m", max_tokens=3)).status_code == 200
    assert fleet.served_by()["a"] == 2  # a tie again: the first backend


async def test_reload_adds_and_removes_backends_without_dropping_requests(
        make_fleet: Any, tmp_path: Any) -> None:
    from gateway.fleet.reload import reload_config

    holds = {"a": asyncio.Event()}
    fakes = {"a": FakeLlamaServer(hold=holds["a"]), "b": FakeLlamaServer()}
    fleet = await make_fleet(fakes, [{"name": "a", "model": "m"}],
                             server={"admin_key": "sesame"})
    in_flight = asyncio.ensure_future(fleet.chat("long", model="m", max_tokens=3))
    await asyncio.sleep(0.05)
    old_a = fleet.state.fleet.backends["a"]
    config = tmp_path / "gateway.toml"
    config.write_text('[server]\nadmin_key = "sesame"\n[admission]\ndisconnect_grace_s = 0.0\n'
                      '[[backends]]\nname = "b"\nurl = "http://b:8080"\nmodel = "m"\n')
    fleet.state.config_path = str(config)
    assert await reload_config(fleet.state) == ["added backend b", "removed backend a"]
    assert old_a.draining and old_a in fleet.state.fleet.retiring
    await fleet.state.fleet.backends["b"].discover()  # discovery is off in these tests
    assert (await fleet.chat("new", model="m", max_tokens=3)).status_code == 200
    assert fleet.served_by() == {"a": 1, "b": 1}
    holds["a"].set()
    assert (await in_flight).status_code == 200  # the old backend finished it
    for _ in range(50):
        if not fleet.state.fleet.retiring:
            break
        await asyncio.sleep(0.05)
    assert fleet.state.fleet.retiring == []  # closed once idle
    # An invalid file, or one changing what needs a restart, is refused; nothing changes.
    config.write_text("[[backends]]\nname = 'b'\nslotz = 3\n")
    r = await fleet.client.post("/admin/reload", headers=ADMIN)
    assert r.status_code == 409 and "slotz" in r.json()["error"]["message"]
    config.write_text('[server]\nadmin_key = "sesame"\n[admission]\nmax_queue = 3\n'
                      '[[backends]]\nname = "b"\nurl = "http://b:8080"\nmodel = "m"\n')
    r = await fleet.client.post("/admin/reload", headers=ADMIN)
    assert r.status_code == 409 and "[admission]" in r.json()["error"]["message"]
    assert list(fleet.state.fleet.backends) == ["b"]


# -- regressions from an adversarial pass ----------------------------------------------


def test_an_empty_admin_key_is_refused_at_load() -> None:
    from gateway.config import ConfigError

    with pytest.raises(ConfigError, match="admin_key"):
        load_settings(server={"admin_key": " "})


async def test_an_alias_reaches_every_backend_of_its_model(make_fleet: Any) -> None:
    hold = asyncio.Event()
    fakes = {"gpu0": FakeLlamaServer(slots=1, hold=hold), "gpu1": FakeLlamaServer(slots=1)}
    fleet = await make_fleet(fakes, [  # the README's example
        {"name": "gpu0", "model": "gemma", "aliases": ["gemma-3"]},
        {"name": "gpu1", "model": "gemma"}],
        admission={"max_queue_wait_s": 0.5, "reject_predicted_timeouts": False})
    busy = asyncio.ensure_future(fleet.chat("busy", model="gemma-3", max_tokens=3))
    await asyncio.sleep(0.05)
    r = await fleet.chat("second", model="gemma-3", max_tokens=3)
    hold.set()
    await busy
    assert r.status_code == 200 and fleet.served_by() == {"gpu0": 1, "gpu1": 1}  # 503, gpu1 idle


async def test_one_unreachable_backend_does_not_404_every_request(make_fleet: Any) -> None:
    fakes = {"a": FakeLlamaServer(), "b": FakeLlamaServer(mode="connect")}
    fleet = Fleet(fakes, [{"name": "a"}, {"name": "b"}])  # no model set: both serve fake.gguf
    await fleet.state.fleet.backends["a"].discover()  # b is down at start: its "model" is "b"
    r = await fleet.chat(model="gpt-4o", max_tokens=3)
    ready = await fleet.client.get("/ready")
    await fleet.client.aclose()
    assert r.status_code == 200, r.text  # 404 model_not_found "Models: b, fake.gguf"
    assert ready.status_code == 200  # 503 {"fake.gguf": true, "b": false}


async def test_a_reload_does_not_double_book_a_changed_backend(make_fleet: Any,
                                                                tmp_path: Any) -> None:
    from gateway.fleet.reload import reload_config

    hold = asyncio.Event()
    fakes = {"a": FakeLlamaServer(slots=1, hold=hold)}
    fleet = await make_fleet(fakes, [{"name": "a", "model": "m"}])
    first = asyncio.ensure_future(fleet.chat("first", model="m", max_tokens=3))
    await asyncio.sleep(0.05)
    config = tmp_path / "g.toml"  # same server; only an alias is added
    config.write_text('[admission]\ndisconnect_grace_s = 0.0\n[[backends]]\nname = "a"\n'
                      'url = "http://a:8080"\nmodel = "m"\naliases = ["m2"]\n')
    fleet.state.config_path = str(config)
    await reload_config(fleet.state)
    await fleet.state.fleet.backends["a"].discover()
    second = asyncio.ensure_future(fleet.chat("second", model="m", max_tokens=3))
    await asyncio.sleep(0.05)
    hold.set()
    await asyncio.gather(first, second)
    assert fakes["a"].peak == 1  # 2: both sent with id_slot 0 to a 1-slot server


async def test_a_loading_counter_does_not_fail_the_pool(make_fleet: Any) -> None:
    fakes = {"a": FakeLlamaServer(), "b": FakeLlamaServer()}
    fleet = await make_fleet(fakes, [{"name": "a", "model": "m"}, {"name": "b", "model": "m"}])
    real = fakes["a"].handle

    async def loading(request: httpx.Request) -> httpx.Response:  # llama-server reloading
        if request.url.path == "/props":
            return await real(request)
        return httpx.Response(503, json={"error": {"code": 503, "message": "Loading model",
                                                   "type": "unavailable_error"}})
    fakes["a"].handle = loading
    r = await fleet.chat(model="m", max_tokens=3)
    assert r.status_code == 200, r.text  # 503 "Backend 'a' is loading." every time; b idle


async def test_a_known_model_is_not_served_by_another(make_fleet: Any) -> None:
    fakes = {"big": FakeLlamaServer(), "v": FakeLlamaServer()}
    fleet = Fleet(fakes, [{"name": "big", "model": "llama"},
                          {"name": "v", "model": "qwen", "kind": "vllm"}])
    await fleet.state.fleet.backends["big"].discover()
    r = await fleet.client.post("/infill", json={"model": "qwen", "input_prefix": "def f(",
                                                 "input_suffix": ")", "max_tokens": 2})
    await fleet.client.aclose()
    assert r.status_code == 404 and r.json()["error"]["code"] == "not_found"
    assert not any(q.url.path == "/infill" for q in fakes["big"].requests)  # sent to llama


async def test_a_failed_over_request_does_not_idle_the_pool(make_fleet: Any) -> None:
    hold = asyncio.Event()
    fakes = {"a": FakeLlamaServer(slots=1), "b": FakeLlamaServer(slots=1, hold=hold)}
    fleet = await make_fleet(fakes, [{"name": "a", "model": "m"}, {"name": "b", "model": "m"}],
                             routing={"down_initial_s": 0.1, "down_max_s": 0.1})
    busy = asyncio.ensure_future(fleet.chat("busy on b", model="b", max_tokens=3))
    await asyncio.sleep(0.05)
    fakes["a"].mode = "boom"  # one 500 from a: the request waits at the head for b only
    failed_over = asyncio.ensure_future(fleet.chat("fails on a", model="m", max_tokens=3))
    await asyncio.sleep(0.05)
    fakes["a"].mode = "ok"
    await asyncio.sleep(0.15)  # a is up again and idle
    after = asyncio.ensure_future(fleet.chat("next", model="m", max_tokens=3))
    await asyncio.sleep(0.2)
    done = after.done()
    hold.set()
    await asyncio.gather(busy, failed_over, after)
    assert done  # waits behind the head until b frees room (or max_queue_wait_s)


async def test_metrics_name_the_backend_that_served(make_fleet: Any) -> None:
    hold = asyncio.Event()
    fakes = {"a": FakeLlamaServer(slots=1, hold=hold), "b": FakeLlamaServer(slots=1)}
    fleet = await make_fleet(fakes, [{"name": "a", "model": "m"}, {"name": "b", "model": "m"}])
    busy = asyncio.ensure_future(fleet.chat("busy", model="a", max_tokens=3))
    await asyncio.sleep(0.05)
    assert (await fleet.chat("other", model="m", max_tokens=3)).status_code == 200
    hold.set()
    await busy
    reg = fleet.state.metrics.registry
    assert fleet.served_by() == {"a": 1, "b": 1}
    assert sample_sum(reg, "gateway_requests_total", backend="b", route="chat",
                      code="200") == 1  # None
    assert reg.get_sample_value("gateway_request_duration_seconds_count",
                                {"backend": "b"}) == 1  # None; a has 2


async def test_a_reload_keeps_the_model_queue_of_the_same_servers(
        make_fleet: Any, tmp_path: Any) -> None:
    from gateway.fleet.reload import reload_config

    hold = asyncio.Event()
    fakes = {"a": FakeLlamaServer(slots=1, hold=hold), "b": FakeLlamaServer(slots=1, hold=hold)}
    adm = {"max_queue_wait_s": 5.0, "reject_predicted_timeouts": False}
    fleet = await make_fleet(fakes, [{"name": "a", "model": "m"}, {"name": "b", "model": "m"}],
                             admission=adm)
    busy = [asyncio.ensure_future(fleet.chat(f"busy {i}", model="m", max_tokens=3))
            for i in range(2)]
    await asyncio.sleep(0.05)
    waiting = asyncio.ensure_future(fleet.chat("queued", model="m", max_tokens=3))
    await asyncio.sleep(0.05)
    config = tmp_path / "g.toml"
    config.write_text('[admission]\ndisconnect_grace_s = 0.0\nmax_queue_wait_s = 5.0\n'
                      'reject_predicted_timeouts = false\n' + "".join(
                          f'[[backends]]\nname = "{n}"\nurl = "http://{n}:8080"\nmodel = "m"\n'
                          'read_timeout_s = 100\n' for n in "ab"))
    fleet.state.config_path = str(config)
    assert await reload_config(fleet.state) == ["changed backend a", "changed backend b"]
    assert fleet.state.fleet.backends["a"].settings.read_timeout_s == 100
    late = asyncio.ensure_future(fleet.chat("late", model="m", max_tokens=3))
    await asyncio.sleep(0.05)
    assert not waiting.done() and not late.done()  # both wait: the servers are still full
    hold.set()
    results = await asyncio.gather(waiting, late, *busy)
    assert [r.status_code for r in results] == [200] * 4
    assert fakes["a"].peak == 1 and fakes["b"].peak == 1  # never double-booked


async def test_a_model_named_by_the_gateway_reaches_the_backend_by_its_own_id(
        make_fleet: Any) -> None:
    """vLLM answers 404 to a model name it does not serve: a client using the gateway's
    name (or an alias) has it replaced by the id the backend reports."""
    fakes = {"a": FakeLlamaServer()}
    fleet = await make_fleet(fakes, [{"name": "a", "model": "gemma", "aliases": ["g3"]}])
    for name in ("gemma", "g3"):
        assert (await fleet.chat(model=name, max_tokens=3)).status_code == 200
    assert [g.get("model") for g in fakes["a"].generations] == ["fake.gguf", "fake.gguf"]


async def test_a_disagreed_count_is_forgotten_where_it_was_kept(make_fleet: Any) -> None:
    # The prompt is counted on the first backend of the pool (a) and may run on another
    # (b). When the usage disagrees with a kept count, the count a kept is dropped, so
    # the next request of that prompt is counted afresh.
    hold = asyncio.Event()
    fakes = {"a": FakeLlamaServer(slots=1, hold=hold), "b": FakeLlamaServer(slots=1)}
    fleet = await make_fleet(fakes, [{"name": "a", "model": "m"}, {"name": "b", "model": "m"}])
    busy = asyncio.ensure_future(fleet.chat("keep a busy", model="m", max_tokens=5))
    await asyncio.sleep(0.05)
    a = fleet.state.fleet.backends["a"]
    first = await fleet.chat("the prompt", model="m", max_tokens=5)  # counted on a, run on b
    assert first.status_code == 200 and fleet.served_by()["b"] == 1
    true_count = int(first.headers["x-gateway-prompt-tokens"])
    key = next(iter(k for k in a.counts._counts if a.counts._counts[k] == true_count))
    a.counts.put(key, true_count + 500)  # as if the backend now counted otherwise
    wrong = await fleet.chat("the prompt", model="m", max_tokens=5)
    right = await fleet.chat("the prompt", model="m", max_tokens=5)
    assert int(wrong.headers["x-gateway-prompt-tokens"]) == true_count + 500
    assert int(right.headers["x-gateway-prompt-tokens"]) == true_count
    assert len(a.counts) == 2  # the other prompt's count is kept
    hold.set()
    assert (await busy).status_code == 200
