"""The shipped HAProxy config (deploy/haproxy/haproxy.cfg) in front of two real ``gateway
serve`` processes, which share one budget in a real ``redis-server``, in front of one real
llama-server (``-c 2048``, its default layout: 4 slots sharing one pool of 2,048 cells).

The HAProxy config is the deploy file with only what a test on loopback must change: the
replicas' addresses (compose names them ``gateway:8000`` and ``gateway-2:8000``), the
frontend's bind, and a stats socket added to ``global`` so that the test can read each
server's health check. The gateways' ``[state]`` section is the compose stack's
(deploy/compose/gateway.toml) with this Redis's address.

Three of the seed's long chats (783-token prompt, 200 output tokens: two fit the pool at
once, three do not) sent at once through HAProxy are spread over both processes; they
must all be served whole with no upstream error, and a stream must arrive through HAProxy
event by event, not in one lump at the end.
"""

from __future__ import annotations

import asyncio
import json
import shutil
import signal
import socket
import subprocess
import tempfile
import time
import tomllib
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx
import pytest

from gateway.dev.localbackend import LlamaServer, free_port
from tests.integration.test_llama_server import overflow_chat
from tests.integration.test_shared_real import Gateway
from tests.test_deploy import HAPROXY_CFG, haproxy_config_for, haproxy_servers

pytestmark = [
    pytest.mark.llama,
    pytest.mark.timeout(900),
    pytest.mark.skipif(shutil.which("haproxy") is None,
                       reason="haproxy is not installed (.ci/run installs it)"),
]

COMPOSE_GATEWAY = HAPROXY_CFG.parent.parent / "compose" / "gateway.toml"


def gateway_config(path: Path, backend_url: str, redis_url: str) -> Path:
    """A config for one backend, with the compose stack's ``[state]`` and ``redis_url``."""
    state = tomllib.loads(COMPOSE_GATEWAY.read_text())["state"]
    assert state["backend"] == "redis"
    state["redis_url"] = redis_url
    lines = "".join(f"{key} = {json.dumps(value)}\n" for key, value in state.items())
    path.write_text(f"""
[server]
drain_timeout_s = 5

[admission]
max_queue_wait_s = 600

[state]
{lines}
[[backends]]
name = "local"
url = "{backend_url}"
""")
    return path


class HAProxy:
    """``haproxy -db`` on a free loopback port with the deploy config, its replicas at
    ``replicas`` (``host:port`` each, in the config's order of replicas)."""

    def __init__(self, workdir: Path, replicas: list[str]) -> None:
        text = HAPROXY_CFG.read_text()
        shipped = sorted({address for _, address, _ in haproxy_servers(text)})
        assert len(shipped) == len(replicas), shipped
        self.port = free_port()
        self.socket = workdir / "stats.sock"
        config = haproxy_config_for(text, dict(zip(shipped, replicas, strict=True)),
                                    f"127.0.0.1:{self.port}")
        config = config.replace("\nglobal\n",
                                f"\nglobal\n    stats socket {self.socket} mode 600\n", 1)
        assert str(self.socket) in config
        self.config = workdir / "haproxy.cfg"
        self.config.write_text(config)
        self.log = workdir / "haproxy.log"
        self.proc = subprocess.Popen(["haproxy", "-db", "-f", str(self.config)],
                                     stdout=self.log.open("wb"), stderr=subprocess.STDOUT)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def stats(self) -> list[dict[str, str]]:
        """HAProxy's ``show stat``: one row per frontend, server and backend."""
        with socket.socket(socket.AF_UNIX) as sock:
            sock.connect(str(self.socket))
            sock.sendall(b"show stat\n")
            data = b""
            while chunk := sock.recv(65536):
                data += chunk
        header, *rows = data.decode().strip().splitlines()
        names = header.lstrip("# ").split(",")
        return [dict(zip(names, row.split(","), strict=False)) for row in rows]

    def servers(self) -> dict[str, dict[str, str]]:
        """The rows of the servers (not the frontend's or backend's totals), by name."""
        return {row["svname"]: row for row in self.stats()
                if row["svname"] not in ("FRONTEND", "BACKEND")}

    def wait_checked(self, timeout: float = 30) -> None:
        """Until every checked server has passed its HTTP check (``L7OK``)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"haproxy exited: {self.log.read_text()[-2000:]}")
            try:
                checked = [r for r in self.servers().values() if r["bck"] == "0"]
                if checked and all(r["check_status"] == "L7OK" and r["status"] == "UP"
                                   for r in checked):
                    return
            except OSError:
                pass  # the socket is not there yet
            time.sleep(0.2)
        raise RuntimeError(f"haproxy's checks did not pass: {self.log.read_text()[-2000:]}")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)


@contextmanager
def stack(tmp_path: Path, backend_url: str, redis_url: str) -> Iterator[tuple[HAProxy,
                                                                           list[Gateway]]]:
    config = gateway_config(tmp_path / "gateway.toml", backend_url, redis_url)
    gateways = [Gateway(config, tmp_path / f"gw{i}.log") for i in range(2)]
    # A short directory: a unix socket's path has at most 107 bytes.
    workdir = Path(tempfile.mkdtemp(prefix="haproxy-"))
    proxy: HAProxy | None = None
    try:
        for gw in gateways:
            gw.wait_ready()
        proxy = HAProxy(workdir, [f"127.0.0.1:{gw.port}" for gw in gateways])
        proxy.wait_checked()
        yield proxy, gateways
    finally:
        if proxy is not None:
            proxy.stop()
        for gw in gateways:
            gw.stop()
        shutil.rmtree(workdir, ignore_errors=True)


def served_chats(gw: Gateway) -> float:
    return gw.metric("gateway_requests_total", route="chat", code="200")


async def stream_events(url: str, body: dict[str, Any]) -> tuple[httpx.Response,
                                                                 list[tuple[float, str]]]:
    """(the response, each ``data:`` line with the time it arrived) of one stream."""
    events: list[tuple[float, str]] = []
    async with httpx.AsyncClient(timeout=600) as client, client.stream(
            "POST", url + "/v1/chat/completions", json={**body, "stream": True}) as r:
        async for line in r.aiter_lines():
            if line.startswith("data: "):
                events.append((time.monotonic(), line))
    return r, events


async def test_haproxy_in_front_of_two_processes_serves_the_seed_overload(
        default_server: LlamaServer, redis_server: Any, tmp_path: Path) -> None:
    with stack(tmp_path, default_server.url, redis_server.url) as (proxy, gateways):
        async with httpx.AsyncClient(timeout=600) as client:
            answers = await asyncio.gather(*(
                client.post(proxy.url + "/v1/chat/completions", json=overflow_chat(200))
                for _ in range(3)))
        assert [r.status_code for r in answers] == [200] * 3, [r.text for r in answers]
        assert [r.json()["usage"]["completion_tokens"] for r in answers] == [200] * 3
        # Spread over both processes (leastconn), and each one's admission held: no
        # context overflow or other error from llama-server on either.
        served = [served_chats(gw) for gw in gateways]
        assert sum(served) == 3 and min(served) >= 1, served
        for gw in gateways:
            assert gw.metric("gateway_upstream_errors_total") == 0
            assert gw.metric("gateway_state_up") == 1

        # One stream through HAProxy: many events, arriving as they are generated.
        r, events = await stream_events(proxy.url, overflow_chat(200))
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/event-stream")
        assert events and events[-1][1] == "data: [DONE]"
        chunks = [json.loads(line[len("data: "):]) for _, line in events[:-1]]
        assert len(chunks) >= 20 and all("choices" in c for c in chunks[:-1])
        # Buffered, they would arrive in one or two lumps; here at many distinct times,
        # the last well after the first.
        arrivals = {round(t, 2) for t, _ in events}
        assert len(arrivals) >= 10, len(arrivals)
        assert events[-1][0] - events[0][0] > 0.3
        assert sum(served_chats(gw) for gw in gateways) == 4
        for gw in gateways:
            assert gw.metric("gateway_upstream_errors_total") == 0

        # Every request went to a checked replica, whose check still passes; the
        # unchecked backups (for when no replica is ready) took none.
        servers = proxy.servers()
        checked = [row for row in servers.values() if row["bck"] == "0"]
        backups = [row for row in servers.values() if row["bck"] == "1"]
        assert len(checked) == 2 and backups
        assert all(row["status"] == "UP" and row["check_status"] == "L7OK"
                   for row in checked), checked
        assert sum(int(row["stot"]) for row in checked) >= 4
        assert all(int(row["stot"]) == 0 for row in backups)
