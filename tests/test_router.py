"""llama-server's router mode: one backend per model, layouts of unloaded models, loads
as waits, --models-max, /v1/models and the probe (tests/fake_router.py)."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import httpx
import pytest
from prometheus_client import CollectorRegistry

from gateway.backends.router import ModelEntry, child_layout, parse_models
from gateway.config import load_settings
from gateway.core.capacity import Charge
from gateway.errors import BackendNotReady, UpstreamUnavailable
from gateway.fleet.reload import reload
from gateway.http.app import create_app, shutdown
from tests.conftest import closed_at_test_end, closed_now, sample_sum
from tests.fake_router import FakeRouter, child_args
from tests.fakes import FakeLlamaServer, ManualClock

pytestmark = pytest.mark.anyio


class RouterHarness:
    """The gateway over a fake router, named ``router``."""

    def __init__(self, router: FakeRouter, clock: Any = None, server: Any = None,
                 admission: Any = None, **backend: Any) -> None:
        self.router = router
        self.settings = load_settings(
            admission={"disconnect_grace_s": 0.0, **(admission or {})}, server=server or {},
            backends=[{"name": "router", "url": "http://upstream:8080", **backend}])
        self.app = create_app(self.settings, http_client=router.client(),
                              registry=CollectorRegistry(), clock=clock, discover=False)
        self.state = self.app.state.gateway
        self.client = httpx.AsyncClient(transport=httpx.ASGITransport(app=self.app),
                                        base_url="http://gateway")
        closed_at_test_end(self.aclose)

    async def aclose(self) -> None:
        """Close the client, then stop the app as its lifespan would."""
        closed_now(self.aclose)
        await self.client.aclose()
        await shutdown(self.app)

    @property
    def hub(self) -> Any:
        return self.state.fleet.backends["router"]

    def member(self, model_id: str) -> Any:
        return self.state.fleet.backends[f"router/{model_id}"]

    def sample(self, name: str, **labels: str) -> float:
        return sample_sum(self.state.metrics.registry, name, **labels)

    async def chat(self, model: str | None, content: str = "hello there",
                   **extra: Any) -> httpx.Response:
        body: dict[str, Any] = {"messages": [{"role": "user", "content": content}],
                                "max_tokens": 5, **extra}
        if model is not None:
            body["model"] = model
        return await self.client.post("/v1/chat/completions", json=body)


async def harness(router: FakeRouter, clock: Any = None, server: Any = None,
                  admission: Any = None, **backend: Any) -> RouterHarness:
    h = RouterHarness(router, clock, server, admission, **backend)
    await h.hub.discover()
    return h


def two_models(**kw: Any) -> FakeRouter:
    return FakeRouter({"a": FakeLlamaServer(), "b": FakeLlamaServer()}, **kw)


async def until(check: Any, what: str) -> None:
    for _ in range(400):
        if check():
            return
        await asyncio.sleep(0.005)
    raise AssertionError(f"never: {what}")


# -- the router's shapes --------------------------------------------------------------


@pytest.mark.parametrize("args,expected", [
    # -np unset: 4 slots sharing one pool of -c (tools/server/server.cpp, n_parallel auto).
    (["--ctx-size", "2048"], (True, 4, 2048, 2048)),
    # -np 2 without --kv-unified: each slot its own pad(-c / 2) (src/llama-context.cpp).
    (["--ctx-size", "2048", "--parallel", "2"], (False, 2, 1024, None)),
    (["--ctx-size", "2048", "--parallel", "2", "--kv-unified"], (True, 2, 2048, 2048)),
    (["-c", "1000", "-np", "2", "-kvu"], (True, 2, 1024, 1024)),  # padded to 256
    (["--ctx-size", "4096", "--parallel", "2", "--kv-unified", "--no-kv-unified"],
     (False, 2, 2048, None)),
    # --kv-unified-per-slot without -c: the pool is -np x N, a slot at most N.
    (["--parallel", "4", "--kv-unified", "--kv-unified-per-slot", "512"],
     (True, 4, 512, 2048)),
    (["--parallel", "-1", "--ctx-size", "8192"], (True, 4, 8192, 8192)),
])
def test_child_layout_follows_llama_server(args: list[str], expected: tuple[Any, ...]) -> None:
    unified, found = child_layout(tuple(child_args("m", *args)))
    assert found is not None
    assert (unified, found.slots, found.ctx_per_slot, found.pool_tokens) == expected


def test_child_layout_without_a_context_is_unknown() -> None:
    # -c unset (or 0) is the model's own training context, shown only once it runs.
    assert child_layout(tuple(child_args("m"))) == (True, None)
    assert child_layout(tuple(child_args("m", "--ctx-size", "0", "--parallel", "2"))) == (
        False, None)


def test_models_are_parsed_from_the_router_shape() -> None:
    router = two_models(loaded={"a"})
    router.exit_code["b"] = 1
    entries = parse_models(router.models_json())
    assert entries["a"].status == "loaded" and entries["a"].running
    assert entries["a"].meta["n_ctx"] == 2048
    assert (entries["b"].state, entries["b"].failed, entries["b"].exit_code) == (
        "failed", True, 1)
    with pytest.raises(ValueError):
        parse_models({"data": [{"id": "x"}]})  # no status object
    with pytest.raises(ValueError):
        parse_models({"models": []})


def test_layout_arguments_leave_out_what_changes_at_every_load() -> None:
    first = ModelEntry("a", "loaded", tuple(child_args("a", "--ctx-size", "2048", port=4)))
    again = ModelEntry("a", "unloaded", tuple(child_args("a", "--ctx-size", "2048")))
    other = ModelEntry("a", "unloaded", tuple(child_args("a", "--ctx-size", "4096")))
    assert first.layout_args == again.layout_args != other.layout_args
    assert "--port" not in first.layout_args and first.layout_args[0] == "--model"


# -- discovery ------------------------------------------------------------------------


async def test_a_router_is_one_backend_per_model_with_its_own_layout() -> None:
    router = two_models(loaded={"a"}, models_max=2)
    router.children["a"].slots = 2  # its /props: 2 slots
    h = await harness(router)
    fleet = h.state.fleet
    assert list(fleet.backends) == ["router", "router/a", "router/b"]
    a, b = h.member("a"), h.member("b")
    assert (a.model, b.model) == ("a", "b")
    # a runs: its child's /props; b does not: its arguments (-c 2048, -np unset).
    assert (a.admission.layout.slots, a.admission.layout.pool_tokens) == (2, 2048)
    assert (b.admission.layout.slots, b.admission.layout.ctx_per_slot,
            b.admission.layout.pool_tokens) == (4, 2048, 2048)
    assert a.ready and b.ready and h.hub.ready
    assert set(fleet.models()) == {"a", "b"}  # the hub serves nothing itself
    r = await h.client.get("/ready")
    assert r.status_code == 200 and r.json()["models"] == {"a": True, "b": True}
    # Discovery never loads a model: every GET naming one says autoload=false.
    assert router.loads == []
    named = [q for q in router.requests if q.method == "GET" and "model" in q.url.params]
    assert named and all(q.url.params["autoload"] == "false" for q in named)
    r = await h.chat("router")  # the hub's name is no model
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"


async def test_a_request_for_an_unloaded_model_waits_while_it_loads() -> None:
    gate = asyncio.Event()
    router = two_models(loaded={"a"}, load_gate=gate)
    h = await harness(router)
    task = asyncio.ensure_future(h.chat("b"))
    await until(lambda: router.status["b"] == "loading", "b loading")
    await asyncio.sleep(0.05)
    assert not task.done()  # waiting, not failed
    gate.set()
    r = await task
    assert r.status_code == 200, r.text
    assert router.loads == ["b"]
    # Counted on b's own child (the router forwards by the body's model), then served.
    assert [(m, p) for m, p, _ in router.forwarded] == [
        ("b", "/v1/chat/completions/input_tokens"), ("b", "/v1/chat/completions")]
    await h.hub.discover()
    assert h.hub.router.hub.gate.load_s["b"] > 0
    assert h.sample("gateway_router_model_load_seconds", backend="router/b") > 0
    assert h.sample("gateway_router_model_state", backend="router/b", state="loaded") == 1


async def test_names_the_client_uses_reach_the_router_as_its_id() -> None:
    router = FakeRouter({"gemma-a": FakeLlamaServer()}, loaded={"gemma-a"},
                        aliases={"gemma-a": ["gem"]})
    h = await harness(router)
    assert (await h.chat("gem")).status_code == 200  # the router's alias
    assert (await h.chat(None)).status_code == 200  # no model: the only one
    sent = [body["model"] for _m, path, body in router.forwarded
            if path == "/v1/chat/completions"]
    assert sent == ["gemma-a", "gemma-a"]


async def test_an_unloaded_model_refuses_as_a_loaded_one_without_loading() -> None:
    router = two_models(loaded={"a"})
    h = await harness(router)
    r = await h.chat("b", content="word " * 60000)  # surely longer than a slot
    assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded"
    r = await h.chat("b", n=5)  # more completions than its 4 slots
    assert r.status_code == 400
    assert router.loads == [] and router.forwarded == []
    # Counted (the router loads b for the count), then refused as on a loaded model:
    # prompt + max_tokens over its 2048-token slot, never forwarded.
    r = await h.chat("b", content="word " * 100, max_tokens=2000)
    assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded"
    assert [p for _m, p, _b in router.forwarded] == ["/v1/chat/completions/input_tokens"]


async def test_counts_are_kept_per_model() -> None:
    router = two_models(loaded={"a", "b"})
    h = await harness(router)
    for model in ("a", "b", "a", "b"):
        assert (await h.chat(model, content="the same prompt")).status_code == 200
    counted = [m for m, p, _ in router.forwarded if p.endswith("input_tokens")]
    assert counted == ["a", "b"]
    assert h.sample("gateway_token_count_source_total", source="cache") == 2


async def test_a_failed_load_is_a_503_with_the_routers_reason() -> None:
    router = two_models(loaded={"a"}, fail={"b"})
    h = await harness(router)
    r = await h.chat("b")
    assert r.status_code == 503, r.text
    err = r.json()["error"]
    assert err["code"] == "backend_unavailable" and "failed to load" in err["message"]
    assert int(r.headers["retry-after"]) >= 1
    await h.hub.discover()
    listed = {m["id"]: m for m in (await h.client.get("/v1/models")).json()["data"]}
    assert listed["b"]["status"] == {"value": "unloaded", "failed": True, "exit_code": 1}
    assert h.sample("gateway_router_model_state", backend="router/b", state="failed") == 1
    assert "exit" in h.member("b").dialect.translate_error(
        500, b'{"error":{"code":500,"message":"model name=b failed to load"}}', None,
        retry_after_s=1.0).message


async def test_v1_models_lists_the_routers_models_and_states_but_no_paths() -> None:
    router = two_models(loaded={"a"})
    h = await harness(router)
    data = (await h.client.get("/v1/models")).json()["data"]
    assert [(m["id"], m["status"]["value"]) for m in data] == [("a", "loaded"),
                                                               ("b", "unloaded")]
    assert "/srv/models" not in json.dumps(data) and "args" not in data[0]["status"]
    # llama-server's own GET /models too: the router's list holds the children's
    # command lines, and sent to one model it is not found.
    plain = await h.client.get("/models")
    assert plain.status_code == 200, plain.text
    assert [m["id"] for m in plain.json()["data"]] == ["a", "b"]
    assert "/srv/models" not in plain.text


# -- what is not the client's mistake ---------------------------------------------------


async def test_the_routers_refusals_are_waits_not_client_errors() -> None:
    router = two_models(loaded={"a"}, autoload=False)
    h = await harness(router)
    assert h.hub.router.hub.autoload is False
    r = await h.chat("b")  # --no-models-autoload: 400 "model is not loaded" from the router
    assert r.status_code == 503 and "not loaded" in r.json()["error"]["message"]
    dialect = h.member("a").dialect
    for body in (b'{"error":{"code":400,"message":"model name=a is not running"}}',
                 b'{"error":{"code":500,"message":"model limit reached, try again later"}}'):
        assert isinstance(dialect.translate_error(400, body, None, retry_after_s=1.0),
                          BackendNotReady)
    client_fault = b'{"error":{"code":400,"message":"tools must be an array"}}'
    assert dialect.translate_error(400, client_fault, None, retry_after_s=1.0) is None


async def test_slots_are_read_per_model_and_an_unloaded_one_runs_nothing() -> None:
    router = two_models(loaded={"a"})
    h = await harness(router)
    views = await h.member("a").dialect.read_slots()
    assert len(views) == 4
    last = router.requests[-1]
    assert last.url.path == "/slots" and last.url.params["model"] == "a"
    assert last.url.params["autoload"] == "false"
    with pytest.raises(UpstreamUnavailable):
        await h.member("b").dialect.read_slots()  # its child has exited (or never ran)
    assert router.loads == []


async def test_a_model_whose_layout_is_unknown_is_loaded_to_learn_it() -> None:
    router = FakeRouter({"a": FakeLlamaServer(n_ctx=4096)}, args={"a": []})
    h = await harness(router)
    a = h.member("a")
    assert not a.ready  # no -c, never loaded: no layout
    r = await h.chat("a")
    assert r.status_code == 503 and int(r.headers["retry-after"]) >= 1
    await until(lambda: router.status["a"] == "loaded", "a loaded by the gateway")
    await h.hub.discover()
    assert a.ready and a.admission.layout.ctx_per_slot == 4096
    assert (await h.chat("a")).status_code == 200
    router.status["a"] = "unloaded"  # unloaded again: its last layout is kept
    await h.hub.discover()
    assert a.ready and a.admission.layout.ctx_per_slot == 4096


# -- --models-max ---------------------------------------------------------------------


async def test_models_max_holds_a_busy_model_so_a_waiting_one_loads() -> None:
    clock = ManualClock()
    router = two_models(loaded={"a"}, models_max=1)
    hold = asyncio.Event()
    router.children["a"].hold = hold  # a's generations run until released
    h = await harness(router, clock=clock)
    gate = h.hub.router.hub.gate
    first = asyncio.ensure_future(h.chat("a"))
    await until(lambda: router.req_count["a"] == 1, "a busy")
    for_b = asyncio.ensure_future(h.chat("b"))
    # b waits for its turn in the gateway, before its count: the router would not
    # unload the busy a anyway, and a count sent now would only queue there.
    await until(lambda: gate._waiting["b"] == 1, "b waiting for its turn")
    assert router.queue == [] and router.status["a"] == "loaded"
    await h.hub.discover()  # the gateway holds a: it takes no new request
    assert set(gate.holds) == {"a"} and gate.holds["a"].wanted == "b"
    assert h.sample("gateway_router_model_held", backend="router/a") == 1
    assert h.sample("gateway_router_holds_total", backend="router/a") == 1
    facts = (await h.client.get("/status.json")).json()["backends"][1]["router"]
    assert facts["held_for"] == "b"
    later = asyncio.ensure_future(h.chat("a", content="later"))
    await asyncio.sleep(0.05)
    assert len([f for f in router.forwarded if f[1] == "/v1/chat/completions"
                and f[0] == "a"]) == 1  # the later one waits in the gateway
    hold.set()  # a's request ends: a is idle, the router unloads it and loads b
    assert (await first).status_code == 200
    assert (await for_b).status_code == 200
    assert router.unloads == ["a"] and router.peak_running == 1
    await h.hub.discover()  # a was unloaded: the hold goes, a's queued request proceeds
    assert gate.holds == {}
    r = await later
    assert r.status_code == 200 and router.loads == ["b", "a"]
    assert router.peak_running == 1


async def test_a_hold_outlasts_the_queue_wait_and_is_placed_once() -> None:
    # Found by a fresh-user pass: with max_queue_wait_s = 2 the hold's own wait for the
    # held model's slots timed out every 2 s, and it was placed, logged and counted again.
    clock = ManualClock()
    router = two_models(loaded={"a"}, models_max=1)
    router.children["a"].hold = asyncio.Event()
    h = await harness(router, clock=clock, admission={"max_queue_wait_s": 2.0})
    gate = h.hub.router.hub.gate
    first = asyncio.ensure_future(h.chat("a"))
    await until(lambda: router.req_count["a"] == 1, "a busy")
    for_b = asyncio.ensure_future(h.chat("b"))
    await until(lambda: gate._waiting["b"] == 1, "b waiting for its turn")
    await h.hub.discover()
    assert set(gate.holds) == {"a"}
    for _ in range(5):  # 10 s: five of the queue's waits
        clock.advance(2.0)
        await asyncio.sleep(0.01)
        await h.hub.discover()
    assert set(gate.holds) == {"a"} and gate.holds_placed["a"] == 1
    assert h.sample("gateway_router_holds_total", backend="router/a") == 1
    router.children["a"].hold.set()
    assert (await first).status_code == 200
    assert (await for_b).status_code == 200
    assert router.peak_running == 1


async def test_no_hold_while_an_idle_model_can_make_way() -> None:
    router = two_models(loaded={"a"}, models_max=1)
    h = await harness(router, clock=ManualClock())
    assert (await h.chat("b")).status_code == 200  # a idle: the router swaps itself
    await h.hub.discover()
    assert h.hub.router.hub.gate.holds == {} and router.unloads == ["a"]


async def test_a_turn_waits_for_a_place_at_most_its_bound() -> None:
    from gateway.core.capacity import Charge

    clock = ManualClock()
    router = two_models(loaded={"a"}, models_max=1)
    h = await harness(router, clock=clock)
    gate = h.hub.router.hub.gate
    lease = await h.member("a").admission.admit(Charge(10, 10))  # a is busy
    waiting = asyncio.ensure_future(gate.turn("b", 30.0))
    await asyncio.sleep(0.01)
    assert not waiting.done()
    clock.advance(31)  # past its bound it goes on (and would wait at the router)
    await asyncio.wait_for(waiting, 1)
    clock.advance(10)
    await h.hub.discover()  # the turn given and never used is forgotten: b waits again
    again = asyncio.ensure_future(gate.turn("b", 30.0))
    await asyncio.sleep(0.01)
    assert not again.done()
    h.member("a").admission.release(lease)
    clock.advance(10)
    await h.hub.discover()  # a idle now: b's turn
    await asyncio.wait_for(again, 1)


# -- the fleet ------------------------------------------------------------------------


async def test_members_follow_the_routers_models_and_reloads() -> None:
    router = two_models(loaded={"a"})
    h = await harness(router)
    a = h.member("a")
    await reload(h.state, h.settings)  # the same settings: hub and members kept
    assert h.member("a") is a and list(h.state.fleet.backends)[0] == "router"
    del router.children["b"], router.status["b"]  # the router no longer lists b
    await h.hub.discover()
    assert "router/b" not in h.state.fleet.backends
    assert [b.name for b in h.state.fleet.retiring] == ["router/b"]
    other = load_settings(backends=[{"name": "other", "url": "http://elsewhere:8080"}],
                          admission={"disconnect_grace_s": 0.0})
    await reload(h.state, other, first_look_s=0)
    assert list(h.state.fleet.backends) == ["other"]  # the hub went, and its members


async def test_side_routes_name_the_model_at_the_router() -> None:
    router = two_models(loaded={"a", "b"}, aliases={"b": ["bee"]})
    h = await harness(router)
    r = await h.client.post("/tokenize", json={"content": "hello world", "model": "bee"})
    assert r.status_code == 200 and len(r.json()["tokens"]) == 3
    assert router.forwarded[-1][:2] == ("b", "/tokenize")
    assert router.forwarded[-1][2]["model"] == "b"  # the router's id, not the alias
    r = await h.client.get("/props", params={"model": "a"})
    assert r.status_code == 200 and r.json()["total_slots"] == 4
    last = router.requests[-1]
    assert (last.url.params["model"], last.url.params["autoload"]) == ("a", "false")


async def test_a_per_slot_child_is_admitted_per_slot() -> None:
    router = two_models(loaded={"a"})
    router.args["b"] = ["--ctx-size", "2048", "--parallel", "2"]  # no --kv-unified
    h = await harness(router)
    layout = h.member("b").admission.layout
    assert (layout.slots, layout.ctx_per_slot, layout.unified) == (2, 1024, False)
    assert h.member("b").settings.kv_unified is False
    r = await h.chat("b", max_tokens=1100)  # over one slot's 1024 tokens
    assert r.status_code == 400 and router.forwarded[-1][1].endswith("input_tokens")


async def test_draining_the_router_drains_its_models() -> None:
    router = two_models(loaded={"a"})
    h = await harness(router, server={"admin_key": "k"})
    admin = {"authorization": "Bearer k"}
    r = await h.client.post("/admin/backends/router/drain", headers=admin)
    assert r.status_code == 200
    assert h.member("a").draining and h.member("b").draining
    r = await h.chat("a")
    assert r.status_code == 503
    await h.client.post("/admin/backends/router/undrain", headers=admin)
    assert (await h.chat("a")).status_code == 200


def test_probe_reads_each_model_of_a_router() -> None:
    from gateway.planner.probe import probe, render_probe

    router = two_models(loaded={"a"}, models_max=2)
    router.children["a"].slots = 2

    def handle(request: httpx.Request) -> httpx.Response:
        query = dict(request.url.params)
        answer = router.get_sync(request.url.path, query)
        if answer is not None:
            return answer
        child = router.children[query["model"]]
        assert query["autoload"] == "false"
        return httpx.Response(200, json={"total_slots": child.slots, "default_generation_"
                                         "settings": {"n_ctx": child.n_ctx}})

    with httpx.Client(transport=httpx.MockTransport(handle)) as client:
        found = probe("http://router:8080", client=client)
    assert (found["role"], found["max_instances"]) == ("router", 2)
    rows = {m["id"]: m for m in found["models"]}
    assert (rows["a"]["slots"], rows["a"]["from"]) == (2, "props")
    assert (rows["b"]["slots"], rows["b"]["ctx_per_slot"], rows["b"]["from"]) == (
        4, 2048, "arguments")
    text = render_probe(found)
    assert "model          b: unloaded, 4 slots x 2048 tokens, unified pool 2048" in text


# -- load time in Retry-After and the wait forecasts ----------------------------------


def test_a_loads_time_left_is_its_own_else_the_routers_else_a_first_guess() -> None:
    from gateway.backends.router_gate import FIRST_LOAD_S, POLL_S, remaining_load_s

    assert remaining_load_s(12.0, [12.0, 2.0], 0.0) == 12.0
    assert remaining_load_s(12.0, [12.0], 5.0) == 7.0
    assert remaining_load_s(None, [4.0, 8.0], 1.0) == 5.0  # the others' mean, less 1 s
    assert remaining_load_s(None, [], 0.0) == FIRST_LOAD_S
    assert remaining_load_s(3.0, [3.0], 30.0) == POLL_S  # overdue: due at any moment


async def test_a_loading_models_retry_after_and_queue_forecast_count_its_load() -> None:
    clock = ManualClock()
    gate_open = asyncio.Event()
    router = two_models(loaded={"a"}, load_gate=gate_open)
    h = await harness(router, clock=clock)
    gate = h.hub.router.hub.gate
    gate.load_s["a"] = 8.0  # a's load was timed: b's first load is guessed from it
    b = h.member("b")
    assert gate.retry_after_s("b") == 8.0 and b.admission.retry_after_s() >= 8.0
    # Without served history the forecast is the load alone; a's is nothing (loaded).
    charge = Charge(10, 5)
    assert b.admission.predict_wait_s(charge) == 8.0
    assert h.member("a").admission.predict_wait_s(charge) is None
    assert gate.retry_after_s("a") == 1.0
    task = asyncio.ensure_future(h.chat("b"))
    await until(lambda: router.status["b"] == "loading", "b loading")
    await h.hub.discover()  # the gateway sees b loading
    clock.advance(3.0)
    assert gate.load_wait_s("b") == 5.0 and gate.retry_after_s("b") == 5.0
    assert b.admission.predict_wait_s(charge) == 5.0
    gate_open.set()
    assert (await task).status_code == 200
    await h.hub.discover()
    assert gate.load_wait_s("b") == 0.0 and b.admission.predict_wait_s(charge) is None
    assert gate.load_s["b"] == 3.0  # timed on the injected clock: 3 s


async def test_what_a_router_answers_itself_goes_to_the_router() -> None:
    # /tools is the router's own (tools/server/server.cpp), never one model's; a router
    # that lists no model still answers its own /props (role: router).
    router = two_models(loaded={"a"})
    h = await harness(router, server={"relay_tools": True})
    r = await h.client.get("/tools", params={"model": "a"})
    assert r.status_code == 403 and r.json()["error"]["type"] == "feature_disabled"
    tools = [q for q in router.requests if q.url.path == "/tools"]
    assert len(tools) == 1 and "autoload" not in tools[0].url.params  # not for_model()
    empty = await harness(FakeRouter({}))
    props = await empty.client.get("/props")
    assert props.status_code == 200 and props.json()["role"] == "router"
    assert (await empty.client.get("/props", params={"model": "x"})).status_code == 404
    # GET /models?reload=1 has the router re-read its models (the gateway lists them).
    router.requests.clear()
    listed = await h.client.get("/models", params={"reload": "1"})
    assert listed.status_code == 200 and {m["id"] for m in listed.json()["data"]} == {
        "a", "b"}
    sent = [q for q in router.requests if q.url.path == "/models"]
    assert sent and sent[0].url.params["reload"] == "1"
    router.requests.clear()
    await h.client.get("/models")
    assert all("reload" not in q.url.params for q in router.requests)
    # With models, a /props naming none goes to the only model, as before.
    one = await harness(FakeRouter({"a": FakeLlamaServer()}, loaded={"a"}))
    assert "total_slots" in (await one.client.get("/props")).json()


async def test_a_burst_of_reloads_is_one_or_two_at_the_router() -> None:
    # Found by an adversarial pass: each GET /models?reload=1 reached the router, one
    # after another on the hub's lock, and delayed every other read of the hub.
    router = two_models(loaded={"a"})
    h = await harness(router)
    gate = router.reload_gate = asyncio.Event()
    router.requests.clear()
    burst = [asyncio.ensure_future(h.client.get("/models", params={"reload": "1"}))
             for _ in range(20)]
    await asyncio.sleep(0.05)
    gate.set()
    answers = await asyncio.gather(*burst)
    assert all(r.status_code == 200 for r in answers)
    reloads = [q for q in router.requests if q.url.path == "/models"
               and "reload" in q.url.params]
    assert 1 <= len(reloads) <= 2


async def test_a_wait_for_a_turn_is_no_part_of_a_loads_prediction() -> None:
    # Under --models-max a model waiting for its turn has not begun to load: ten seconds
    # of that wait leave its predicted load whole, where they used to make it "due".
    from gateway.backends.router_gate import FIRST_LOAD_S

    clock = ManualClock()
    h = await harness(two_models(loaded={"a"}, models_max=1), clock=clock)
    gate = h.hub.router.hub.gate
    gate.wanted("b")
    clock.advance(10.0)
    assert gate.load_wait_s("b") == FIRST_LOAD_S
    gate._sent["b"] = clock.now()  # its turn given now: the load runs from here
    clock.advance(2.0)
    assert gate.load_wait_s("b") == FIRST_LOAD_S - 2.0
    await gate.close()


async def test_a_target_outside_a_fleet_that_finds_a_router_says_so() -> None:
    """Router mode is the fleet's (gateway.fleet.routers.settle): a target built alone
    (no fleet to keep the router's members) answers its discovery with a clear error, and
    stays unready, rather than taking the router's /props for one model's."""
    from gateway.backends.target import Target
    from gateway.config import AdmissionSettings, BackendSettings
    from gateway.errors import UpstreamError

    router = FakeRouter({"a": FakeLlamaServer()}, loaded={"a"})
    side = httpx.AsyncClient(transport=httpx.MockTransport(router.handle),
                             base_url="http://r:8080")
    target = Target(BackendSettings(name="r", url="http://r:8080"), AdmissionSettings(), side)
    try:
        with pytest.raises(UpstreamError, match="runs many models"):
            await target.discover()
        assert not target.ready and target.admission.layout is None
    finally:
        await target.close()
        await side.aclose()


class _Switch:
    """One upstream address: a single-model llama-server, later a router; the next
    ``GET /v1/models`` can be held while the test switches it."""

    def __init__(self, current: Any) -> None:
        self.current = current
        self.hold: asyncio.Event | None = None
        self.held = asyncio.Event()

    async def handle(self, request: httpx.Request) -> httpx.Response:
        server = self.current
        if request.url.path == "/v1/models" and self.hold is not None:
            hold, self.hold = self.hold, None
            self.held.set()
            await hold.wait()
        return await server.handle(request)


async def test_a_backend_found_a_router_while_its_list_is_read_is_listed_as_a_router() -> None:
    """GET /v1/models names a backend's model by its configured name only when, once its
    list came back, it is still a one-model server (the adversarial pass's reproducer: the
    role was read before the list, so a server that came back as a router meanwhile had
    its router's list renamed to the configured name)."""
    router = FakeRouter({"a": FakeLlamaServer(), "b": FakeLlamaServer()}, loaded={"a"})
    switch = _Switch(FakeLlamaServer())
    settings = load_settings(admission={"disconnect_grace_s": 0.0}, backends=[
        {"name": "r", "url": "http://upstream:8080", "model": "cfg"}])
    app = create_app(settings, http_client=httpx.AsyncClient(
        transport=httpx.MockTransport(switch.handle)), registry=CollectorRegistry(),
        discover=False)
    client = httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://g")
    target = app.state.gateway.fleet.backends["r"]
    try:
        await target.discover()  # one model, listed under its configured name
        assert [m["id"] for m in (await client.get("/v1/models")).json()["data"]] == ["cfg"]
        gate = switch.hold = asyncio.Event()
        listing = asyncio.ensure_future(client.get("/v1/models"))
        await asyncio.wait_for(switch.held.wait(), 5)  # its list is being read...
        switch.current = router  # ...when the server comes back as a router
        await target.discover()
        assert target.router.hub is not None
        gate.set()
        data = (await asyncio.wait_for(listing, 5)).json()["data"]
        assert [m["id"] for m in data] != ["cfg"], data
    finally:
        await client.aclose()
        await shutdown(app)
