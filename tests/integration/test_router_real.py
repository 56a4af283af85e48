"""The gateway in front of a real llama-server in router mode: two names for Gemma 3
270M in a --models-dir, -c 2048, --models-max 2 and then 1 (docs/router.md)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from gateway.dev.localbackend import LlamaServer, model_links
from tests.integration.conftest import GatewayThread, gather_chats, long_prompt

pytestmark = [pytest.mark.llama, pytest.mark.anyio, pytest.mark.timeout(900)]

# About 650 tokens with Gemma 3's chat template: three chats of it with max_tokens 60
# need more than a 2048-cell pool, two of them fit (mostly prefill: quick to run).
OVERFLOW_PROMPT = long_prompt(45)
OVERFLOW_CAP = 60
A, B = "gemma-a", "gemma-b"


@pytest.fixture(scope="module")
def models_dir(tmp_path_factory: pytest.TempPathFactory, llama_parts: tuple[Any, Any]
               ) -> Path:
    return model_links(tmp_path_factory.mktemp("router-models"), [A, B], llama_parts[1])


def router(models_dir: Path, llama_parts: tuple[Any, Any], models_max: int
           ) -> Iterator[LlamaServer]:
    server = LlamaServer(["-c", "2048", "--models-max", str(models_max)],
                         binary=llama_parts[0], models_dir=models_dir)
    with server.running():
        yield server


@pytest.fixture
def router_2(models_dir: Path, llama_parts: tuple[Any, Any]) -> Iterator[LlamaServer]:
    yield from router(models_dir, llama_parts, 2)


@pytest.fixture
def router_1(models_dir: Path, llama_parts: tuple[Any, Any]) -> Iterator[LlamaServer]:
    yield from router(models_dir, llama_parts, 1)


def chat(model: str, content: str = "Name a colour.", max_tokens: int = 8,
         **extra: Any) -> dict[str, Any]:
    return {"model": model, "messages": [{"role": "user", "content": content}],
            "max_tokens": max_tokens, **extra}


def states(gw: GatewayThread) -> dict[str, str]:
    data = httpx.get(gw.url + "/v1/models", timeout=10).json()["data"]
    return {m["id"]: m["status"]["value"] for m in data}


def upstream_failures(gw: GatewayThread) -> float:
    return sum(gw.metric("gateway_upstream_errors_total", kind=k)
               for k in ("status_5xx", "context_overflow", "connect", "timeout"))


async def test_both_models_served_and_the_overload_held(router_2: LlamaServer) -> None:
    with GatewayThread({"name": "router", "url": router_2.url}) as gw:
        ready = httpx.get(gw.url + "/ready", timeout=5).json()
        assert ready["models"] == {A: True, B: True}
        row = ready["backends"][f"router/{A}"]  # its layout from its arguments: -c 2048
        assert (row["slots"], row["ctx_per_slot"], row["capacity_tokens"]) == (4, 2048, 2048)
        assert states(gw) == {A: "unloaded", B: "unloaded"}

        # The unloaded model: the request waits while the router loads it, then is
        # served, its prompt counted exactly on its own child.
        started = time.monotonic()
        r = httpx.post(gw.url + "/v1/chat/completions", json=chat(A), timeout=300)
        first_s = time.monotonic() - started
        assert r.status_code == 200, r.text
        assert int(r.headers["x-gateway-prompt-tokens"]) == r.json()["usage"]["prompt_tokens"]
        assert states(gw)[A] == "loaded"

        # The seed overload on one model: three chats that together need more than the
        # child's 2048-cell pool (two at a time fit), held by the gateway with no
        # upstream failure.
        bodies = [chat(A, OVERFLOW_PROMPT, OVERFLOW_CAP, ignore_eos=True) for _ in range(3)]
        started = time.monotonic()
        through = await gather_chats(gw.url, bodies)
        overload_s = time.monotonic() - started
        assert [x.status_code for x in through] == [200, 200, 200], [x.text for x in through]
        prompt = through[0].json()["usage"]["prompt_tokens"]
        cells = prompt + OVERFLOW_CAP
        assert 3 * cells > 2048 >= 2 * cells  # three at once overflow the pool
        assert [x.json()["usage"]["completion_tokens"] for x in through] == [OVERFLOW_CAP] * 3
        assert upstream_failures(gw) == 0
        assert gw.metric("gateway_kv_reserved_tokens", backend=f"router/{A}") == 0

        # The other model loads beside it (--models-max 2) and is served.
        r = httpx.post(gw.url + "/v1/chat/completions", json=chat(B), timeout=300)
        assert r.status_code == 200, r.text
        assert states(gw) == {A: "loaded", B: "loaded"}
        assert gw.metric("gateway_router_model_state", backend=f"router/{B}",
                         state="loaded") == 1
        load_s = gw.metric("gateway_router_model_load_seconds", backend=f"router/{A}")
        shown = (f"\nrouter, --models-max 2: first request (with its load) {first_s:.1f} s "
                 f"(load learned: {load_s:.1f} s), 3 overflowing chats held in "
                 f"{overload_s:.1f} s")
        print(shown)  # noqa: T201


async def test_models_max_1_alternating_never_overflows_nor_hangs(
        router_1: LlamaServer) -> None:
    with GatewayThread({"name": "router", "url": router_1.url}) as gw:
        # Both models at once, three requests each: one model runs, the other's wait
        # while it drains and the router swaps them.
        started = time.monotonic()
        bodies = [chat(m, max_tokens=24) for m in (A, B, A, B, A, B)]
        answers = await asyncio.wait_for(gather_chats(gw.url, bodies), 240)
        burst_s = time.monotonic() - started
        assert [r.status_code for r in answers] == [200] * 6, [r.text for r in answers]

        # One model kept busy by two clients back to back: the other one's request is
        # still served (the gateway holds the busy model so that the router can swap).
        stop = asyncio.Event()
        served: list[int] = []

        async def keep_busy(client: httpx.AsyncClient) -> None:
            while not stop.is_set():
                r = await client.post(gw.url + "/v1/chat/completions",
                                      json=chat(A, max_tokens=24))
                served.append(r.status_code)

        async with httpx.AsyncClient(timeout=300) as client:
            workers = [asyncio.ensure_future(keep_busy(client)) for _ in range(2)]
            await asyncio.sleep(8)  # A loaded and busy
            started = time.monotonic()
            r = await asyncio.wait_for(client.post(gw.url + "/v1/chat/completions",
                                                   json=chat(B)), 180)
            waited_s = time.monotonic() - started
            assert r.status_code == 200, r.text
            stop.set()
            await asyncio.wait_for(asyncio.gather(*workers), 180)
        assert served and set(served) == {200}
        holds = gw.metric("gateway_router_holds_total", backend=f"router/{A}")
        assert holds >= 1  # the busy model was held for the other's load
        assert upstream_failures(gw) == 0
        assert sorted(states(gw).values()) == ["loaded", "unloaded"]
        shown = (f"\nrouter, --models-max 1: 6 alternating requests in {burst_s:.1f} s; "
                 f"a request for the other model while one is kept busy served after "
                 f"{waited_s:.1f} s ({holds:.0f} hold(s)); {len(served)} busy requests served")
        print(shown)  # noqa: T201


def test_plan_of_a_running_router_matches_the_kv_its_children_print(
        models_dir: Path, llama_parts: tuple[Any, Any]) -> None:
    # Both models loaded, then `gateway plan --router URL --json` against the same router:
    # each model's KV bytes are what its child printed, and --models-max 2 holds both.
    import json
    import re
    import subprocess
    import sys

    server = LlamaServer(["-c", "2048", "-np", "2", "--models-max", "2", "-lv", "4"],
                         binary=llama_parts[0], models_dir=models_dir)
    with server.running():
        for model in (A, B):
            r = httpx.post(server.url + "/v1/chat/completions", json=chat(model),
                           timeout=300)
            assert r.status_code == 200, r.text
        done = subprocess.run(
            [sys.executable, "-m", "gateway", "plan", "--router", server.url, "--json",
             "--memory", "1GiB"], capture_output=True, text=True, timeout=60)
        log = server.log()
    assert done.returncode == 0, done.stderr
    plan = json.loads(done.stdout)
    printed = [float(x) for x in re.findall(r"llama_kv_cache: size =\s+([\d.]+) MiB", log)]
    assert len(printed) == 4, log[-3000:]  # two children, full + sliding-window each
    rows = {m["id"]: m for m in plan["models"]}
    assert set(rows) == {A, B}
    for row in rows.values():  # -np 2 without --kv-unified: two 1024-cell slots
        assert (row["slots"], row["ctx_per_slot"], row["unified"]) == (2, 1024, False)
        assert round(row["kv_bytes"] / 2**20, 2) == round(printed[0] + printed[1], 2)
    assert printed[:2] == printed[2:]
    assert plan["models_max"] == 2 and sorted(plan["resident"]) == [A, B]
    assert plan["resident_bytes"] == sum(r["total_bytes"] for r in rows.values())
    assert plan["fits"] is True and plan["models_max_that_fits"] == 2
