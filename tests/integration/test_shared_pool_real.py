"""A pool of two real llama-servers (``-c 2048`` each: 4 slots sharing one pool of 2,048
cells) behind two real ``gateway serve`` processes sharing their budgets in a real
``redis-server`` (``[state] backend = "redis"``, gateway/fleet/shared_pool.py).

The overload is the seed's long chat (783 prompt tokens) with 200 output tokens: two fit
one server, three overflow it. Eight of them, spread over both processes, must be served
whole with no upstream 500, or refused cleanly; the shared reservation of each server,
sampled from Redis while they run, never passes its pool.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import redis

from gateway.dev.localbackend import LlamaServer
from tests.integration.test_llama_server import overflow_chat
from tests.integration.test_shared_real import Gateway, post_all

pytestmark = [pytest.mark.llama, pytest.mark.timeout(900)]

# One thread each: two servers of two threads on two cores would spin against each other.
LAYOUT = ["-c", "2048", "-t", "1"]


@pytest.fixture
def servers(llama_parts: tuple[Any, Any]) -> Iterator[tuple[LlamaServer, LlamaServer]]:
    binary, model = llama_parts
    a = LlamaServer(LAYOUT, binary=binary, model=model)
    b = LlamaServer(LAYOUT, binary=binary, model=model)
    with a.running(), b.running():
        yield a, b


def write_config(path: Path, urls: list[str], redis_url: str) -> Path:
    backends = "".join(f'\n[[backends]]\nname = "{name}"\nurl = "{url}"\nmodel = "gemma"\n'
                       for name, url in zip("ab", urls, strict=True))
    path.write_text(f"""
[server]
drain_timeout_s = 5

[admission]
max_queue_wait_s = 600

[state]
backend = "redis"
redis_url = "{redis_url}"
key_prefix = "itp"
{backends}""")
    return path


class PoolSampler:
    """Reads each backend's shared reservation from Redis every 20 ms."""

    def __init__(self, url: str) -> None:
        self.client = redis.Redis.from_url(url)
        self.peaks: dict[str, tuple[int, int]] = {}
        self.samples = 0

    def read(self) -> dict[str, tuple[int, int]]:
        sums = {}
        for key in self.client.scan_iter("itp:b:*:leases"):
            tokens = slots = 0
            for v in self.client.hvals(key):
                _, tok, sl, _ = v.decode().split("|")
                tokens, slots = tokens + int(tok), slots + int(sl)
            sums[key.decode()] = (tokens, slots)
        return sums

    async def run(self, stop: asyncio.Event) -> None:
        while not stop.is_set():
            for key, (tokens, slots) in (await asyncio.to_thread(self.read)).items():
                old = self.peaks.get(key, (0, 0))
                self.peaks[key] = (max(old[0], tokens), max(old[1], slots))
            self.samples += 1
            await asyncio.sleep(0.02)


async def test_two_processes_share_a_pool_of_two_servers_with_no_overflow(
        servers: tuple[LlamaServer, LlamaServer], redis_server: Any,
        tmp_path: Path) -> None:
    config = write_config(tmp_path / "gateway.toml", [s.url for s in servers],
                          redis_server.url)
    gws = [Gateway(config, tmp_path / f"gw{i}.log") for i in range(2)]
    try:
        for gw in gws:
            gw.wait_ready()
        sampler = PoolSampler(redis_server.url)
        stop = asyncio.Event()
        sampling = asyncio.ensure_future(sampler.run(stop))
        pairs = [(gws[i % 2].url, overflow_chat(200)) for i in range(8)]
        try:
            answers = await post_all(pairs)
        finally:
            stop.set()
            await sampling
        served = [r for r in answers if r.status_code == 200]
        for r in answers:  # served whole, or refused cleanly
            if r.status_code == 200:
                assert r.json()["usage"]["completion_tokens"] == 200, r.text
            else:
                assert r.status_code == 503, r.text
                assert r.json()["error"]["code"] in ("queue_full", "queue_timeout")
        assert len(served) == 8, [r.text for r in answers]
        assert sampler.samples > 10 and len(sampler.peaks) == 2, sampler.peaks
        for tokens, slots in sampler.peaks.values():  # both served, neither overfilled
            assert 0 < tokens <= 2048 and 0 < slots <= 4, sampler.peaks
        for gw in gws:
            assert gw.metric("gateway_upstream_errors_total") == 0
        for _ in range(50):  # every lease given back (releases run in the background)
            if not any(t or s for t, s in (await asyncio.to_thread(sampler.read)).values()):
                break
            await asyncio.sleep(0.1)
        assert not any(t or s for t, s in (await asyncio.to_thread(sampler.read)).values())
    finally:
        for gw in gws:
            gw.stop()
