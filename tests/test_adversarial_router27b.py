"""Adversarial checks of llama-server's router mode (issue 27): odd model ids, odd
``/models`` answers, models that vanish, and every reservation given back
(tests/fake_router.py)."""

from __future__ import annotations

import asyncio
import contextlib
import json
from typing import Any

import httpx
import pytest

from gateway.errors import UpstreamError
from tests.fake_router import FakeRouter
from tests.fakes import FakeLlamaServer
from tests.test_router import RouterHarness, harness, two_models

pytestmark = pytest.mark.anyio


def _idle(target: Any) -> bool:
    stats = target.admission.stats()
    return (stats.inflight, stats.reserved_tokens, stats.busy_slots, stats.queued) == (
        0, 0, 0, 0)


async def test_odd_model_ids_are_served_and_listed() -> None:
    # The router's cache names a model by its Hugging Face repo and quant
    # (ggml-org/gemma-3-1b-it-GGUF:Q4_K_M); a preset section may hold spaces.
    ids = ["org/m-GGUF:Q4_K_M", "my model", 'q"uote\\', "é.."]
    router = FakeRouter({i: FakeLlamaServer() for i in ids}, loaded={ids[0]})
    h = await harness(router)
    for model in ids:
        r = await h.chat(model)
        assert r.status_code == 200, (model, r.text)
        assert router.forwarded[-1][2]["model"] == model
        assert _idle(h.member(model))
    listed = [m["id"] for m in (await h.client.get("/v1/models")).json()["data"]]
    assert listed == ids


async def test_a_member_drains_by_its_own_name() -> None:
    # Each model's backend is named <router>/<id>, listed so in /admin/backends.
    router = two_models(loaded={"a"})
    h = await harness(router, server={"admin_key": "k"})
    admin = {"authorization": "Bearer k"}
    names = [b["name"] for b in (await h.client.get("/admin/backends",
                                                    headers=admin)).json()["backends"]]
    assert "router/a" in names
    r = await h.client.post("/admin/backends/router/a/drain", headers=admin)
    assert r.status_code == 200, r.text
    assert r.json()["name"] == "router/a"
    assert h.member("a").draining and not h.member("b").draining
    assert not h.hub.draining
    assert (await h.chat("a")).status_code == 503
    assert (await h.chat("b")).status_code == 200
    r = await h.client.post("/admin/backends/router/a/undrain", headers=admin)
    assert r.status_code == 200 and not h.member("a").draining


@pytest.mark.parametrize("answer", [
    {"data": "nope"}, {"data": [{"id": 3}]}, {"data": [{"id": "a", "status": "loaded"}]},
    ["a"],
])
async def test_a_malformed_models_list_is_a_clear_not_ready(answer: Any) -> None:
    router = two_models(loaded={"a"})
    router.models_json = lambda: answer  # type: ignore[method-assign]
    h = RouterHarness(router)
    with contextlib.suppress(UpstreamError):
        await h.hub.discover()
    assert h.hub.problem and not h.hub.ready
    r = await h.chat("a")  # the router's fault, not the client's
    assert r.status_code == 503, r.text
    err = r.json()["error"]
    assert err["code"] == "backend_unavailable" and "/models" in err["message"]
    assert "retry-after" in r.headers
    ready = await h.client.get("/ready")  # it serves nothing: not ready
    assert ready.status_code == 503 and ready.json()["ready"] is False


async def test_a_router_listing_no_models_is_not_ready_and_names_none() -> None:
    router = FakeRouter({})
    h = await harness(router)
    r = await h.chat("a")
    assert r.status_code == 404, r.text
    assert r.json()["error"]["code"] == "model_not_found"
    assert "lists no models" in r.json()["error"]["message"]
    assert (await h.client.get("/ready")).status_code == 503
    assert (await h.client.get("/v1/models")).json()["data"] == []


async def test_a_model_gone_while_its_request_runs_gives_its_reservation_back() -> None:
    router = two_models(loaded={"a"})
    h = await harness(router)
    a = h.member("a")
    gate = asyncio.Event()
    child = router.children["a"]
    original = child.handle

    async def held(request: httpx.Request) -> httpx.Response:
        if request.url.path.endswith("/chat/completions"):
            await gate.wait()
        return await original(request)

    child.handle = held  # type: ignore[method-assign]
    task = asyncio.ensure_future(h.chat("a"))
    for _ in range(400):
        if a.admission.stats().inflight == 1:
            break
        await asyncio.sleep(0.005)
    assert a.admission.stats().inflight == 1
    del router.children["a"], router.status["a"]  # the router no longer lists a
    await h.hub.discover()
    assert "router/a" not in h.state.fleet.backends
    gate.set()
    r = await task
    assert r.status_code in (200, 503), r.text
    assert _idle(a)


async def test_many_models_are_each_a_backend() -> None:
    ids = [f"m{i:03d}" for i in range(150)]
    router = FakeRouter({i: FakeLlamaServer() for i in ids}, loaded={"m000"})
    h = await harness(router)
    assert len(h.state.fleet.backends) == 151
    r = await h.chat("m149")
    assert r.status_code == 200, r.text
    data = (await h.client.get("/v1/models")).json()["data"]
    assert len(data) == 150 and "/srv/models" not in json.dumps(data)


async def test_a_failed_load_gives_every_reservation_back() -> None:
    router = two_models(loaded={"a"}, fail={"b"})
    h = await harness(router)
    for stream in (False, True):
        r = await h.chat("b", stream=stream)
        assert r.status_code == 503, r.text
        assert r.json()["error"]["code"] == "backend_unavailable"
        assert _idle(h.member("b")) and _idle(h.member("a"))
    assert (await h.chat("a")).status_code == 200 and _idle(h.member("a"))
