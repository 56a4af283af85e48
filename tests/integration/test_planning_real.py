"""gateway plan / probe / re-discovery against a real llama-server and the real model."""

from __future__ import annotations

import re
import time
from typing import Any

import httpx
import pytest

from gateway.dev.localbackend import LlamaServer, free_port
from gateway.planner import modelshape
from gateway.planner.planning import kv_size
from gateway.planner.probe import probe
from gateway.planner.sizing import recommend
from tests.integration.conftest import GatewayThread

pytestmark = pytest.mark.llama

KV_LINE = re.compile(r"llama_kv_cache: size =\s+([\d.]+) MiB")


@pytest.mark.parametrize("args,n_ctx,n_seq,unified,types", [
    (["-c", "2048"], 2048, 4, True, ("f16", "f16")),
    (["-c", "6144", "-np", "3", "--no-kv-unified"], 6144, 3, False, ("f16", "f16")),
    (["-c", "3000", "-np", "2", "--no-kv-unified", "-ctk", "q8_0", "-ctv", "q8_0"], 3000, 2,
     False, ("q8_0", "q8_0")),
    (["-c", "8192", "-np", "2", "--kv-unified"], 8192, 2, True, ("f16", "f16")),
])
def test_plan_predicts_the_kv_size_llama_server_prints(
    llama_parts: tuple[Any, Any], args: list[str], n_ctx: int, n_seq: int, unified: bool,
    types: tuple[str, str],
) -> None:
    binary, model = llama_parts
    server = LlamaServer([*args, "-lv", "4"], binary=binary, model=model)
    with server.running():
        printed = [float(x) for x in KV_LINE.findall(server.log())]
    assert len(printed) == 2, server.log()[-2000:]  # full-attention cache + sliding-window cache
    shape = modelshape.from_gguf(model)
    kv = kv_size(shape, n_ctx, n_seq, unified=unified, type_k=types[0], type_v=types[1])
    assert [round(kv.full_bytes / 2**20, 2), round(kv.swa_bytes / 2**20, 2)] == printed


def test_capped_unified_plan_runs_as_planned(llama_parts: tuple[Any, Any]) -> None:
    """``gateway plan``'s --kv-unified-per-slot line: llama-server allocates the planned
    pool, /props shows the cap as the slot context, and probe explains the layout."""
    binary, model = llama_parts
    shape = modelshape.from_gguf(model)
    from gateway.planner.plan import build_report

    report = build_report(shape, ctx=512, parallel=4, unified=True)
    capped = report["launch"]["llama_server_capped"]
    args = capped["llama_server"].split("MODEL.gguf ", 1)[1].split()
    server = LlamaServer([*args, "-lv", "4"], binary=binary, model=model)
    with server.running():
        found = probe(server.url)
        printed = [float(x) for x in KV_LINE.findall(server.log())]
    assert (found["slots"], found["ctx_per_slot"]) == (4, 512)
    assert any("--kv-unified-per-slot" in note for note in found["undiscoverable"])
    kv = kv_size(shape, 2048, 4, unified=True)
    assert [round(kv.full_bytes / 2**20, 2), round(kv.swa_bytes / 2**20, 2)] == printed
    assert "pool_tokens = 2048" in capped["gateway"]


def test_probe_real_llama_server(default_server: LlamaServer) -> None:
    found = probe(default_server.url)
    assert (found["kind"], found["slots"], found["ctx_per_slot"]) == ("llama.cpp", 4, 2048)
    assert found["n_ctx_train"] == 32768


def test_restarted_backend_changes_the_model_without_gateway_restart(
    llama_parts: tuple[Any, Any],
) -> None:
    binary, model = llama_parts
    port = free_port()
    first = LlamaServer(["-c", "2048"], port=port, binary=binary, model=model)
    first.start()
    try:
        with GatewayThread({"url": first.url, "discovery_interval_s": 0.3}) as gw:
            assert gw.metric("gateway_kv_capacity_tokens") == 2048
            first.stop()
            second = LlamaServer(["-c", "4096", "-np", "2", "--kv-unified"], port=port,
                                 binary=binary, model=model)
            with second.running():
                deadline = time.monotonic() + 20
                while time.monotonic() < deadline:
                    if gw.metric("gateway_kv_capacity_tokens") == 4096:
                        break
                    time.sleep(0.2)
                assert gw.metric("gateway_kv_capacity_tokens") == 4096
                assert gw.metric("gateway_slots") == 2
                assert gw.metric("gateway_backend_layout_changes_total") == 1
                # Up to 3000 tokens at ~45 tokens/s (llama-server started --no-repack here)
                r = httpx.post(gw.url + "/v1/chat/completions", timeout=300, json={
                    "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 3000})
                assert r.status_code == 200  # 3000 fits the new 4096 slot, not the old 2048
    finally:
        first.stop()


def test_sizing_from_a_live_gateway(default_server: LlamaServer) -> None:
    with GatewayThread({"url": default_server.url}) as gw:
        for n in (8, 16, 32):
            r = httpx.post(gw.url + "/v1/chat/completions", timeout=60, json={
                "messages": [{"role": "user", "content": "Count."}], "max_tokens": n,
                "ignore_eos": True})
            assert r.status_code == 200
        result = recommend(httpx.get(gw.url + "/metrics").text)["local"]
        assert result["requests"] == 3
        assert result["recommended_ctx_per_slot"] == 256
        assert result["recommended_slots"] == 8  # 2048 / 256
