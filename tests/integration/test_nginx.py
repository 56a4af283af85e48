"""P06: streaming through a default nginx ``proxy_pass`` stays incremental.

nginx buffers proxied responses by default; the gateway's ``X-Accel-Buffering: no`` on
SSE answers turns that off per response. A control upstream without the header shows
that this nginx does buffer, so the test can fail. Needs the ``nginx`` binary (.ci/run
installs it); skipped where it is absent.
"""

from __future__ import annotations

import shutil
import subprocess
import tempfile
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import httpx
import pytest

from gateway.dev.localbackend import LlamaServer, free_port
from tests.integration.conftest import GatewayThread

pytestmark = [
    pytest.mark.llama,
    pytest.mark.skipif(shutil.which("nginx") is None, reason="nginx is not installed"),
]


def start_nginx(upstream_port: int) -> tuple[subprocess.Popen[bytes], int, Path]:
    port = free_port()
    prefix = Path(tempfile.mkdtemp(prefix="nginx-"))
    (prefix / "logs").mkdir()
    conf = prefix / "nginx.conf"
    conf.write_text(f"""
worker_processes 1;
daemon off;
error_log {prefix}/logs/error.log;
pid {prefix}/nginx.pid;
events {{ worker_connections 64; }}
http {{
    access_log off;
    client_body_temp_path {prefix}/body;
    proxy_temp_path {prefix}/proxy;
    fastcgi_temp_path {prefix}/fastcgi;
    uwsgi_temp_path {prefix}/uwsgi;
    scgi_temp_path {prefix}/scgi;
    server {{
        listen 127.0.0.1:{port};
        location / {{ proxy_pass http://127.0.0.1:{upstream_port}; }}
    }}
}}
""")
    proc = subprocess.Popen(["nginx", "-p", str(prefix), "-c", str(conf)])
    for _ in range(100):
        try:
            httpx.get(f"http://127.0.0.1:{port}/", timeout=0.5)
            break
        except httpx.HTTPError:
            time.sleep(0.05)
    return proc, port, prefix


@pytest.fixture
def nginx_in_front() -> Iterator[object]:
    started: list[tuple[subprocess.Popen[bytes], Path]] = []

    def start(upstream_port: int) -> int:
        proc, port, prefix = start_nginx(upstream_port)
        started.append((proc, prefix))
        return port

    yield start
    for proc, prefix in started:
        proc.terminate()
        proc.wait(10)
        shutil.rmtree(prefix, ignore_errors=True)


def arrivals(url: str, body: dict[str, object] | None = None) -> list[float]:
    times: list[float] = []
    with httpx.Client(timeout=60) as client:
        method = "POST" if body is not None else "GET"
        with client.stream(method, url, json=body) as r:
            assert r.status_code == 200
            for line in r.iter_lines():
                if line.startswith("data: "):
                    times.append(time.monotonic())
    return times


class _Unbuffered(BaseHTTPRequestHandler):
    """An SSE source that does NOT send X-Accel-Buffering: 40 small events, 25 ms apart."""

    def do_GET(self) -> None:  # noqa: N802
        self.send_response(200)
        self.send_header("content-type", "text/event-stream")
        self.send_header("content-length", str(40 * 12))
        self.end_headers()
        for i in range(40):
            self.wfile.write(f"data: {i:04d}\n\n\n".encode()[:12])
            self.wfile.flush()
            time.sleep(0.025)

    def log_message(self, *args: object) -> None:
        pass


def test_control_nginx_buffers_sse_without_the_header(nginx_in_front: object) -> None:
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Unbuffered)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        port = nginx_in_front(server.server_address[1])  # type: ignore[operator]
        times = arrivals(f"http://127.0.0.1:{port}/")
        assert len(times) == 40
        assert len({round(t, 2) for t in times}) <= 3  # arrived in a lump at the end
    finally:
        server.shutdown()


def test_gateway_stream_through_default_nginx_is_incremental(
    default_server: LlamaServer, nginx_in_front: object
) -> None:
    with GatewayThread({"url": default_server.url}) as gw:
        port = nginx_in_front(gw.port)  # type: ignore[operator]
        body = {"messages": [{"role": "user", "content": "Tell a story."}], "max_tokens": 50,
                "ignore_eos": True, "stream": True}
        times = arrivals(f"http://127.0.0.1:{port}/v1/chat/completions", body)
        assert len(times) >= 50
        assert times[-1] - times[0] > 0.2
        assert len({round(t, 2) for t in times}) > 10  # one by one, not one burst
