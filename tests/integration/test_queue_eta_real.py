"""The ETA fast-fail against the real llama-server (issue 8, section 4).

The seed scenario (3 chats of ~790 prompt + 900 output tokens on ``-c 2048``) runs one
at a time under ``strict``. With ``max_queue_wait_s`` below the time the third would
wait (sized from the server's measured pace), the gateway predicts that at arrival: two answers are served and the third gets
503 ``queue_wait_too_long`` within a second, with a ``Retry-After`` within 2× of when
it could really have started.
"""

from __future__ import annotations

import asyncio
import time

import httpx
import pytest

from gateway.dev.localbackend import LlamaServer
from tests.integration.conftest import GatewayThread, long_prompt

pytestmark = [pytest.mark.llama, pytest.mark.anyio]


async def test_a_doomed_wait_is_refused_at_arrival(default_server: LlamaServer) -> None:
    prompt = long_prompt(55)  # ~790 tokens with the template
    # The queue wait allowed is sized from this server's measured pace: about 1.5x one
    # whole answer, so the second chat's wait (one answer) fits and the third's (two)
    # does not, whether llama-server decodes at 45 or 90 tokens/s here.
    timings = httpx.post(default_server.url + "/completion", timeout=300, json={
        "prompt": prompt, "n_predict": 100, "ignore_eos": True, "cache_prompt": False,
    }).json()["timings"]
    one_answer_s = (900 / timings["predicted_per_second"]
                    + timings["prompt_n"] / timings["prompt_per_second"])
    wait_s = round(1.5 * one_answer_s, 1)
    with GatewayThread({"url": default_server.url}, {"max_queue_wait_s": wait_s}) as gw:
        async with httpx.AsyncClient(timeout=300) as client:
            url = gw.url + "/v1/chat/completions"
            for i in range(8):  # served leases to learn the pace from (MIN_HISTORY)
                r = await client.post(url, json={
                    "messages": [{"role": "user", "content": f"Tale {i}."}],
                    "max_tokens": 300, "ignore_eos": True})
                assert r.status_code == 200, r.text
            done_at: dict[int, float] = {}

            async def chat(i: int) -> tuple[httpx.Response, float]:
                await asyncio.sleep(0.7 * i)  # arrive in order
                sent = time.monotonic()
                r = await client.post(url, json={
                    "messages": [{"role": "user", "content": f"Story {i}. {prompt}"}],
                    "max_tokens": 900, "ignore_eos": True})
                done_at[i] = time.monotonic()
                return r, done_at[i] - sent

            results = await asyncio.gather(*(chat(i) for i in range(3)))
    (first, _), (second, _), (third, third_s) = results
    assert first.status_code == 200 and second.status_code == 200, second.text
    assert third.status_code == 503
    assert third.json()["error"]["code"] == "queue_wait_too_long"
    assert third_s < 1.0
    refused_at = done_at[2]
    remaining = done_at[1] - refused_at  # when the third could have started
    retry_after = float(third.headers["retry-after"])
    assert remaining / 2 <= retry_after <= remaining * 2, (retry_after, remaining)
