"""Tenants against the real llama-server (issue 10).

A batch tenant submits 40 long requests, then an interactive tenant 4 short ones. Through
the gateway with the two tenants and classes, each interactive request waits for at most
one slot to free (one admission: no longer than one batch request holds its slot);
through the same gateway without tenants (one FIFO queue), the same requests wait behind
the whole batch. Both runs are in this test, against one server, and their waits are
printed side by side. Then a tenant over its tokens per minute gets 429 with OpenAI's
headers while another tenant's requests go on being served.
"""

from __future__ import annotations

import asyncio

import httpx
import pytest

from gateway.dev.localbackend import LlamaServer
from gateway.dev.tenants_run import WEB_KEY, fair_settings, gateway_at, run_scenario

pytestmark = [pytest.mark.llama, pytest.mark.anyio]


async def test_interactive_requests_pass_a_batch_backlog(default_server: LlamaServer) -> None:
    with gateway_at({k: v for k, v in fair_settings(default_server.url).items()
                     if k not in ("tenants", "classes")}) as url:
        fifo = await run_scenario(url, keys=(None, None), finish_batch=True)
    with gateway_at(fair_settings(default_server.url)) as url:
        fair = await run_scenario(url)
    f, q = fair.summary(), fifo.summary()
    print(f"\ninteractive wait, fair: {fair.interactive_wait_s}")  # noqa: T201
    print(f"interactive wait, FIFO: {fifo.interactive_wait_s}")  # noqa: T201
    print(f"fair {f}\nFIFO {q}")  # noqa: T201
    assert fair.interactive_status == [200] * 4 and fifo.interactive_status == [200] * 4
    # Within one admission: no interactive request waited longer than one batch request
    # held its slot (the first slot to free is given to it), plus scheduling slack.
    assert f["interactive_wait_max_s"] <= q["batch_hold_max_s"] * 1.5 + 1.0, (f, q)
    assert fair.batch_done_before_interactive <= 8  # the 4 running, and 4 more at most
    # FIFO: they waited behind the batch.
    assert fifo.batch_done_before_interactive >= 30
    assert f["interactive_wait_max_s"] * 3 < q["interactive_wait_p50_s"], (f, q)


async def test_a_tenant_over_its_tokens_per_minute_gets_429(default_server: LlamaServer
                                                             ) -> None:
    metered = {"name": "metered", "key": "sk-demo-metered", "priority": "interactive",
               "tokens_per_minute": 150}
    with gateway_at(fair_settings(default_server.url, metered)) as url:
        async with httpx.AsyncClient(base_url=url, timeout=120) as client:
            async def ask(key: str) -> httpx.Response:
                return await client.post("/v1/chat/completions", headers={
                    "authorization": f"Bearer {key}"}, json={
                    "messages": [{"role": "user", "content": "Name a colour."}],
                    "max_tokens": 16})

            statuses = []
            for _ in range(12):
                r = await ask("sk-demo-metered")
                statuses.append(r.status_code)
                if r.status_code == 429:
                    break
                assert r.headers["x-ratelimit-limit-tokens"] == "150"
            assert statuses[-1] == 429 and set(statuses[:-1]) == {200}, statuses
            assert 2 <= len(statuses) <= 10, statuses  # ~14 prompt + up to 16 completion
            err = r.json()["error"]
            assert err["code"] == "rate_limit_exceeded"
            remaining = int(r.headers["x-ratelimit-remaining-tokens"])
            assert 0 <= remaining < 150
            assert 1 <= int(r.headers["retry-after"]) <= 60
            assert r.headers["x-ratelimit-reset-tokens"].endswith("s")
            # The other tenant is not affected, even at the same moment.
            others = await asyncio.gather(*(ask(WEB_KEY) for _ in range(3)),
                                          ask("sk-demo-metered"))
            assert [o.status_code for o in others] == [200, 200, 200, 429]
            metrics = (await client.get("/metrics")).text
            assert 'gateway_rejections_total{backend="local",priority="interactive",' \
                   'reason="tokens_per_minute",tenant="metered"} 2.0' in metrics
