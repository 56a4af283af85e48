"""Several gateway processes under ``admission.policy = "predictive"`` in front of one
real llama-server (``-c 2048``: 4 slots sharing one pool of 2,048 cells), sharing one
budget and their live figures in a real ``redis-server``.

Each gateway is a real ``python -m gateway serve`` process (tests/integration/
test_shared_real.py's :class:`Gateway`). The workloads are those of
tests/integration/test_predictive_real.py, spread over the processes: short answers
under caps that do not fit together (``"stop": ["."]`` ends them after a sentence), and
long chats predicted short that must be preempted before the pool overflows. A sampler
reads the shared leases and their live figures from Redis while they run: the live sum
(each lease's published use, or its charge before its first publish) must never pass the
pool.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx
import pytest
import redis

from gateway.dev.localbackend import LlamaServer
from tests.integration.conftest import long_prompt
from tests.integration.test_predictive_real import SHORT, events, short
from tests.integration.test_shared_real import Gateway

pytestmark = [pytest.mark.llama, pytest.mark.timeout(1200)]

POOL = 2048


def write_config(path: Path, backend_url: str, redis_url: str) -> Path:
    path.write_text(f"""
[server]
drain_timeout_s = 5

[admission]
max_queue_wait_s = 600
policy = "predictive"
predict_min_history = 4
predict_quantile = 0.5

[state]
backend = "redis"
redis_url = "{redis_url}"
key_prefix = "it"

[[backends]]
name = "local"
url = "{backend_url}"
""")
    return path


@contextmanager
def gateways(tmp_path: Path, count: int, backend_url: str,
             redis_url: str) -> Iterator[list[Gateway]]:
    config = write_config(tmp_path / "gateway.toml", backend_url, redis_url)
    procs = [Gateway(config, tmp_path / f"gw{i}.log") for i in range(count)]
    try:
        for gw in procs:
            gw.wait_ready()
        yield procs
    finally:
        for gw in procs:
            gw.stop()


class LiveSampler:
    """Every 20 ms: the shared leases and their live figures of backend ``local``."""

    def __init__(self, url: str) -> None:
        self.client = redis.Redis.from_url(url)
        self.peak_live = 0
        self.peak_reserved = 0
        self.published = 0  # samples that held a published figure
        self.samples = 0

    def read(self) -> tuple[int, int, bool]:
        keys = sorted(k.decode() for k in self.client.scan_iter("it:b:local@*:leases"))
        if not keys:
            return 0, 0, False
        leases = self.client.hgetall(keys[0])
        figures = self.client.hgetall(keys[0].rsplit(":", 1)[0] + ":live")
        reserved = live = 0
        for lease_id, value in leases.items():
            charge = int(value.decode().split("|")[1])
            reserved += charge
            fig = figures.get(lease_id)
            live += int(fig.decode().split("|")[0]) if fig else charge
        return reserved, live, bool(figures)

    async def run(self, stop: asyncio.Event) -> None:
        while not stop.is_set():
            reserved, live, published = await asyncio.to_thread(self.read)
            self.peak_reserved = max(self.peak_reserved, reserved)
            self.peak_live = max(self.peak_live, live)
            self.published += published
            self.samples += 1
            await asyncio.sleep(0.02)


async def warm(client: httpx.AsyncClient, gws: list[Gateway]) -> None:
    """Four short answers on each process: each predicts from its own history."""
    for gw in gws:
        for prompt in SHORT[:4]:
            r = await client.post(gw.url + "/v1/completions", json=short(prompt))
            assert r.status_code == 200, r.text


def upstream_overflows(gws: list[Gateway]) -> float:
    return sum(gw.metric("gateway_upstream_errors_total", kind="context_overflow")
               for gw in gws)


def story(gws: list[Gateway]) -> str:
    """Each process's log lines about preemptions, overflows and chats: printed when an
    assertion on them fails, so that a failure on another machine can be read."""
    words = ("preempt", "overflow", "exceeded", "resum", "/v1/chat")
    return "\n".join(f"gw{i}: {line}" for i, gw in enumerate(gws)
                     for line in gw.log.read_text(errors="replace").splitlines()
                     if any(w in line for w in words))


def preemptions(gws: list[Gateway]) -> float:
    return sum(gw.metric("gateway_preemptions_total", reason=reason)
               for gw in gws for reason in ("pool_pressure", "overflow"))


async def test_short_answers_under_caps_that_do_not_fit_run_together_across_processes(
        default_server: LlamaServer, redis_server: Any, tmp_path: Path) -> None:
    """Eight short answers with a cap of 1,024 each, spread over three processes: their
    caps do not fit two at a time (strict would serve them one by one), their
    predicted and real lengths do. They run together and all come back whole."""
    with gateways(tmp_path, 3, default_server.url, redis_server.url) as gws:
        async with httpx.AsyncClient(timeout=600) as client:
            await warm(client, gws)
            busy: list[int] = []

            async def watch() -> None:
                while True:
                    slots = (await client.get(default_server.url + "/slots")).json()
                    busy.append(sum(1 for s in slots if s["is_processing"]))
                    await asyncio.sleep(0.1)

            sampler = LiveSampler(redis_server.url)
            stop = asyncio.Event()
            tasks = [asyncio.ensure_future(watch()),
                     asyncio.ensure_future(sampler.run(stop))]
            try:
                results = await asyncio.gather(*(client.post(
                    gws[i % 3].url + "/v1/completions", json={**short(p), "stream": True})
                    for i, p in enumerate(SHORT)))
            finally:
                stop.set()
                tasks[0].cancel()
                await asyncio.gather(*tasks, return_exceptions=True)
        for r in results:
            assert r.status_code == 200, r.text
            objs, done = events(r.text)
            assert done == 1 and not any("error" in o for o in objs)
        assert max(busy) >= 2  # strict charges 1,024 + prompt each: one at a time
        assert sampler.samples > 10
        assert sampler.peak_live <= POOL and sampler.peak_reserved <= POOL
        assert upstream_overflows(gws) == 0, story(gws)


async def test_long_answers_predicted_short_are_preempted_before_the_pool_overflows(
        default_server: LlamaServer, redis_server: Any, tmp_path: Path) -> None:
    """The seed scenario over three processes, one chat each: after short answers every
    process predicts a short answer for a ~790-token prompt that runs to 900 tokens, so
    two or three are let in together, and the whole backend's live use passes the pool
    unless one is preempted. Each is preempted (by its own process) and resumed as
    needed: every answer arrives whole, none is an upstream 500, and the live sum read
    from Redis never passes the pool."""
    prompt = long_prompt(55)  # ~790 tokens with the template
    with gateways(tmp_path, 3, default_server.url, redis_server.url) as gws:
        async with httpx.AsyncClient(timeout=900) as client:
            await warm(client, gws)

            def chat(i: int, stream: bool) -> Any:
                return client.post(gws[i].url + "/v1/chat/completions", json={
                    "messages": [{"role": "user", "content": f"Story {i}. {prompt}"}],
                    "max_tokens": 900, "temperature": 0, "stream": stream,
                    **({"stream_options": {"include_usage": True}} if stream else {})})

            sampler = LiveSampler(redis_server.url)
            stop = asyncio.Event()
            task = asyncio.ensure_future(sampler.run(stop))
            try:
                results = await asyncio.gather(chat(0, True), chat(1, True),
                                               chat(2, False))
            finally:
                stop.set()
                await task
        for r in results[:2]:
            assert r.status_code == 200, r.text
            objs, done = events(r.text)
            assert done == 1 and not any("error" in o for o in objs)
            assert len({o["id"] for o in objs}) == 1
            usage = [o["usage"] for o in objs if o.get("usage")]
            assert usage[-1]["completion_tokens"] == 900
        whole = results[2]
        assert whole.status_code == 200, whole.text
        answer = whole.json()
        assert answer["object"] == "chat.completion"
        assert answer["usage"]["completion_tokens"] == 900
        assert answer["choices"][0]["message"]["content"]
        assert sampler.samples > 10 and sampler.published > 0
        assert sampler.peak_live <= POOL, sampler.peak_live
        assert preemptions(gws) >= 1, story(gws)
        assert upstream_overflows(gws) == 0, story(gws)
        for gw in gws:
            assert gw.metric("gateway_resumes_total", outcome="failed") == 0
