"""Issue 11, wire-level fidelity, against the real llama-server: prompts of ids mixed
with texts, and token metrics of n > 1 requests."""

from __future__ import annotations

import time

import httpx
import pytest

from gateway.dev.localbackend import LlamaServer
from tests.integration.conftest import GatewayThread

pytestmark = [pytest.mark.llama]


def test_ids_mixed_with_text_are_served_and_counted_exactly(default_server: LlamaServer
                                                            ) -> None:
    body = {"prompt": [2, 818, 5279, "of France", 563], "max_tokens": 3}
    direct = httpx.post(default_server.url + "/v1/completions", json=body, timeout=120)
    with GatewayThread({"url": default_server.url}) as gw:
        r = httpx.post(gw.url + "/v1/completions", json=body, timeout=120)
        batch = httpx.post(gw.url + "/v1/completions", timeout=120, json={
            "prompt": [["of France", 563], "The capital"], "max_tokens": 2})
    assert direct.status_code == r.status_code == 200, r.text
    assert int(r.headers["x-gateway-prompt-tokens"]) == direct.json()["usage"][
        "prompt_tokens"] == r.json()["usage"]["prompt_tokens"]
    assert batch.status_code == 200 and len(batch.json()["choices"]) == 2


@pytest.mark.parametrize("stream", [False, True])
def test_completion_tokens_of_every_choice_are_counted(default_server: LlamaServer,
                                                       stream: bool) -> None:
    # llama-server's usage counts one choice of an n > 1 answer; with ignore_eos each
    # choice runs to the cap, so the gateway's histogram must see n x cap.
    body = {"prompt": "Once upon a time", "max_tokens": 5, "n": 2, "ignore_eos": True,
            "stream": stream}
    with GatewayThread({"url": default_server.url}) as gw:
        r = httpx.post(gw.url + "/v1/completions", json=body, timeout=120)
        assert r.status_code == 200, r.text
        assert gw.metric("gateway_completion_tokens_sum", backend="local") == 10
        assert gw.metric("gateway_request_tokens_count", backend="local") == 1


def test_a_queued_stream_hears_where_it_stands(default_server: LlamaServer) -> None:
    import concurrent.futures

    body = {"messages": [{"role": "user", "content": "Tell a long story."}],
            "max_tokens": 300, "ignore_eos": True}
    # A pool model of 600 tokens admits one such chat at a time.
    with GatewayThread({"url": default_server.url, "pool_tokens": 600},
                       admission={"queue_progress_s": 1.0}) as gw, \
            concurrent.futures.ThreadPoolExecutor(2) as pool:
        first = pool.submit(httpx.post, gw.url + "/v1/chat/completions", json=body,
                            timeout=300)
        time.sleep(0.5)
        second = httpx.post(gw.url + "/v1/chat/completions", timeout=300,
                            headers={"X-Queue-Progress": "1"}, json={**body, "stream": True})
        assert first.result().status_code == 200
    assert second.status_code == 200
    assert second.text.startswith(": queued position=1")
    assert second.text.rstrip().endswith("data: [DONE]")
