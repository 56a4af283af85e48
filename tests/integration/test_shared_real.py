"""Several gateway processes in front of one real llama-server (``-c 2048``, its default
layout: 4 slots sharing one pool of 2,048 cells), sharing one budget in a real
``redis-server`` (``[state] backend = "redis"``).

Each gateway is a real ``python -m gateway serve`` process. The overload is the seed's
pattern with shorter answers (the long prompt of ``test_llama_server.py``, 783 tokens, and
200 output tokens, so that a run takes seconds, not minutes): each chat fits alone, two
together fit, three overflow llama-server's pool. Spread over the processes, each of which admits one, they must still
be served one pool's worth at a time: no upstream 500, the shared reservation never over
the pool (sampled from Redis while they run).
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx
import pytest
import redis

from gateway.dev.localbackend import LlamaServer, free_port
from tests.integration.conftest import scrape
from tests.integration.test_llama_server import overflow_chat

pytestmark = [pytest.mark.llama, pytest.mark.timeout(900)]


class Gateway:
    """One ``gateway serve`` process on a free port."""

    def __init__(self, config: Path, log: Path, *extra: str) -> None:
        self.port = free_port()
        self.log = log
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "gateway", "serve", "--config", str(config), "--port",
             str(self.port), *extra], stdout=log.open("wb"), stderr=subprocess.STDOUT)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def wait_ready(self, timeout: float = 60) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"gateway exited: {self.log.read_text()[-2000:]}")
            try:
                r = httpx.get(self.url + "/ready", timeout=1)
                # Every backend ready, not only one per model: a backend is ready once
                # its calibration is done (a pool's second member a moment later).
                if r.status_code == 200 and all(
                        row.get("ready") for row in r.json()["backends"].values()):
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.1)
        raise RuntimeError(f"gateway not ready: {self.log.read_text()[-2000:]}")

    def metric(self, name: str, **labels: str) -> float:
        """The sum of ``name``'s samples with ``labels``, from its /metrics."""
        return scrape(self.url, name, **labels)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)


def write_config(path: Path, backend_url: str, redis_url: str, **state: Any) -> Path:
    extra = "".join(f"{k} = {v!r}\n" if isinstance(v, str) else f"{k} = {v}\n"
                    for k, v in state.items())
    path.write_text(f"""
[server]
drain_timeout_s = 5

[admission]
max_queue_wait_s = 600

[state]
backend = "redis"
redis_url = "{redis_url}"
key_prefix = "it"
{extra}
[[backends]]
name = "local"
url = "{backend_url}"
""")
    return path


@contextmanager
def gateways(tmp_path: Path, count: int, backend_url: str, redis_url: str,
             **state: Any) -> Iterator[list[Gateway]]:
    config = write_config(tmp_path / "gateway.toml", backend_url, redis_url, **state)
    procs = [Gateway(config, tmp_path / f"gw{i}.log") for i in range(count)]
    try:
        for gw in procs:
            gw.wait_ready()
        yield procs
    finally:
        for gw in procs:
            gw.stop()


def leases_key(client: redis.Redis) -> str:
    """The leases hash of backend ``local`` (its key names the server's URL too:
    ``it:b:local@{hash}:leases``), or "" before the first lease."""
    keys = sorted(k.decode() for k in client.scan_iter("it:b:local@*:leases"))
    assert len(keys) <= 1, keys
    return keys[0] if keys else ""


class Sampler:
    """Reads the shared reservation from Redis every 20 ms while requests run."""

    def __init__(self, url: str) -> None:
        self.client = redis.Redis.from_url(url)
        self.peak_tokens = 0
        self.peak_slots = 0
        self.samples = 0

    async def run(self, stop: asyncio.Event) -> None:
        while not stop.is_set():
            tokens = slots = 0
            for v in await asyncio.to_thread(self.client.hvals, leases_key(self.client)):
                _, tok, sl, _ = v.decode().split("|")
                tokens, slots = tokens + int(tok), slots + int(sl)
            self.peak_tokens = max(self.peak_tokens, tokens)
            self.peak_slots = max(self.peak_slots, slots)
            self.samples += 1
            await asyncio.sleep(0.02)


async def post_all(pairs: list[tuple[str, dict[str, Any]]],
                   timeout: float = 600) -> list[httpx.Response]:
    async with httpx.AsyncClient(timeout=timeout) as client:
        return await asyncio.gather(*(client.post(url + "/v1/chat/completions", json=body)
                                      for url, body in pairs))


async def test_three_processes_serve_the_seed_overload_with_no_overflow(
        default_server: LlamaServer, redis_server: Any, tmp_path: Path) -> None:
    with gateways(tmp_path, 3, default_server.url, redis_server.url) as gws:
        sampler = Sampler(redis_server.url)
        stop = asyncio.Event()
        sampling = asyncio.ensure_future(sampler.run(stop))
        # Three chats, one per process, plus a fourth on the first: two fit at a time.
        pairs = [(gw.url, overflow_chat(200)) for gw in gws] + [(gws[0].url,
                                                                 overflow_chat(200))]
        try:
            answers = await post_all(pairs)
        finally:
            stop.set()
            await sampling
        assert [r.status_code for r in answers] == [200] * 4, [r.text for r in answers]
        assert [r.json()["usage"]["completion_tokens"] for r in answers] == [200] * 4
        assert sampler.samples > 10
        assert 0 < sampler.peak_tokens <= 2048 and sampler.peak_slots <= 4
        status = httpx.get(gws[1].url + "/status.json", timeout=5).json()["state"]
        assert status["backend"] == "redis" and status["up"] is True
        assert len(status["processes"]) == 3 and status["process"] in status["processes"]
        for gw in gws:
            assert gw.metric("gateway_upstream_errors_total") == 0
            assert gw.metric("gateway_state_up") == 1
            # Every process's gauge shows the shared figure: nothing held now.
            assert gw.metric("gateway_kv_reserved_tokens") == 0


async def test_a_killed_process_gives_its_capacity_back(
        default_server: LlamaServer, redis_server: Any, tmp_path: Path) -> None:
    with gateways(tmp_path, 2, default_server.url, redis_server.url,
                  lease_ttl_s=3.0, renew_interval_s=0.5) as (a, b):
        async with httpx.AsyncClient(timeout=600) as client:
            doomed = asyncio.ensure_future(
                client.post(a.url + "/v1/chat/completions", json=overflow_chat(700)))
            store = redis.Redis.from_url(redis_server.url)
            deadline = time.monotonic() + 60
            while (not (key := leases_key(store)) or not store.hlen(key)) and (
                    time.monotonic() < deadline):
                await asyncio.sleep(0.05)
            assert store.hlen(leases_key(store)) == 1
            os.kill(a.proc.pid, signal.SIGKILL)  # its lease is never released
            started = time.monotonic()
            # Another chat of 1,483 tokens does not fit beside the dead one's; it is served once
            # the TTL has passed (llama-server stops a request whose client went away).
            answer = await client.post(b.url + "/v1/chat/completions",
                                       json=overflow_chat(700))
            waited = time.monotonic() - started
            with pytest.raises(httpx.HTTPError):
                await doomed
        assert answer.status_code == 200, answer.text
        assert answer.json()["usage"]["completion_tokens"] == 700
        assert waited > 2.0  # not before the TTL
        assert b.metric("gateway_upstream_errors_total") == 0
        assert b.metric("gateway_state_lease_expiries_total", reason="owner_lost") >= 1


async def test_redis_lost_then_back(default_server: LlamaServer, redis_server: Any,
                                    tmp_path: Path) -> None:
    with gateways(tmp_path, 2, default_server.url, redis_server.url,
                  renew_interval_s=0.5, lease_ttl_s=3.0) as (a, b):
        small = {"messages": [{"role": "user", "content": "Say hi."}], "max_tokens": 8}
        first = await post_all([(a.url, small), (b.url, small)])
        assert [r.status_code for r in first] == [200, 200]
        redis_server.stop()
        refused = await post_all([(a.url, small), (b.url, small)])
        for r in refused:
            assert r.status_code == 503, r.text
            assert r.json()["error"]["code"] == "state_unavailable"
            assert int(r.headers["retry-after"]) >= 1
        assert a.metric("gateway_state_up") == 0
        assert a.metric("gateway_rejections_total", reason="state_unavailable") >= 1
        redis_server.start()  # empty: the processes republish, then admit again
        deadline = time.monotonic() + 30
        statuses: list[int] = []
        while time.monotonic() < deadline:
            statuses = [r.status_code for r in await post_all([(a.url, small),
                                                               (b.url, small)])]
            if statuses == [200, 200]:
                break
            await asyncio.sleep(0.5)
        assert statuses == [200, 200]
        assert a.metric("gateway_state_up") == 1
        assert "cannot be reached" in a.log.read_text()
        assert "reachable again" in a.log.read_text()


def capacity(gw: Gateway) -> tuple[int, int]:
    """(slots, KV tokens) of backend ``local`` as ``gw`` admits against them."""
    row = httpx.get(gw.url + "/ready", timeout=5).json()["backends"]["local"]
    return row["slots"], row["capacity_tokens"]


async def test_a_restart_with_a_smaller_context_shrinks_every_process(
        llama_parts: tuple[Any, Any], redis_server: Any, tmp_path: Path) -> None:
    binary, model = llama_parts
    server = LlamaServer(["-c", "2048"], binary=binary, model=model)
    with server.running():
        # A reads /props every second; B only every 10 minutes: B's layout after the
        # restart can only be the one A read and published.
        procs = []
        for name, interval in (("a", 1), ("b", 600)):
            config = write_config(tmp_path / f"{name}.toml", server.url, redis_server.url,
                                  renew_interval_s=0.5, lease_ttl_s=3.0)
            config.write_text(config.read_text() + f"discovery_interval_s = {interval}\n")
            procs.append(Gateway(config, tmp_path / f"{name}.log"))
        try:
            for gw in procs:
                gw.wait_ready()
            a, b = procs
            before = capacity(a)
            assert capacity(b) == before and before[1] == 2048
            server.stop()
            server.args = ["-c", "1024"]  # the same port, a smaller context
            server.start()
            deadline = time.monotonic() + 30
            while time.monotonic() < deadline and not (
                    capacity(a)[1] == capacity(b)[1] == 1024):
                await asyncio.sleep(0.2)
            assert capacity(a) == capacity(b) and capacity(b)[1] == 1024
            assert "layout changed" in b.log.read_text()
        finally:
            for gw in procs:
                gw.stop()


async def test_workers_on_one_port_share_the_budget(
        default_server: LlamaServer, redis_server: Any, tmp_path: Path) -> None:
    config = write_config(tmp_path / "gateway.toml", default_server.url, redis_server.url)
    gw = Gateway(config, tmp_path / "workers.log", "--workers", "2")
    url, log, proc = gw.url, gw.log, gw.proc
    try:
        gw.wait_ready()
        sampler = Sampler(redis_server.url)
        stop = asyncio.Event()
        sampling = asyncio.ensure_future(sampler.run(stop))
        try:
            answers = await post_all([(url, overflow_chat(200)) for _ in range(3)])
        finally:
            stop.set()
            await sampling
        assert [r.status_code for r in answers] == [200] * 3, [r.text for r in answers]
        assert 0 < sampler.peak_tokens <= 2048
        for _ in range(6):  # whichever worker answers the scrape, it sums both
            text = httpx.get(url + "/metrics", timeout=5).text
            served = sum(float(line.split()[-1]) for line in text.splitlines()
                         if line.startswith("gateway_requests_total{")
                         and 'route="chat"' in line and 'code="200"' in line)
            assert served == 3, text
        assert "with 2 workers" in log.read_text()
        # Two processes renew their liveness in the shared state.
        assert redis.Redis.from_url(redis_server.url).zcard("it:procs") == 2
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(30)
    assert proc.returncode == 0, log.read_text()[-3000:]
