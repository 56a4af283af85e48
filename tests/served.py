"""The gateway served by a real uvicorn on a local port, in a thread, over a fake
upstream: for tests of what happens on the wire (raw sockets, HTTP framing, timeouts)."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

import httpx
import uvicorn
from prometheus_client import CollectorRegistry

from gateway.config import Settings
from gateway.dev.localbackend import free_port
from gateway.http.app import create_app, uvicorn_options


@contextmanager
def served(settings: Settings, upstream: httpx.AsyncClient) -> Iterator[int]:
    """Serve the gateway with ``settings`` (and the uvicorn options it implies) on a free
    port until the block ends; yields the port once ``/ready`` answers 200."""
    app = create_app(settings, http_client=upstream, registry=CollectorRegistry())
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port,
                                           log_level="warning", loop="asyncio",
                                           **uvicorn_options(settings)))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    try:
        deadline = time.monotonic() + 20
        while True:
            try:
                if httpx.get(f"http://127.0.0.1:{port}/ready", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError("the gateway did not become ready")
            time.sleep(0.05)
        yield port
    finally:
        server.should_exit = True
        thread.join(10)


def read_all(sock: socket.socket) -> bytes:
    """Everything the server sends until it closes the connection (or the socket's
    timeout passes)."""
    raw = b""
    try:
        while chunk := sock.recv(65536):
            raw += chunk
    except (TimeoutError, ConnectionResetError):
        pass
    return raw


def exchange(port: int, data: bytes, timeout: float = 30) -> bytes:
    """Send raw bytes on a new connection and read until the server closes it."""
    with socket.create_connection(("127.0.0.1", port), timeout=timeout) as sock:
        sock.sendall(data)
        return read_all(sock)


def split_response(raw: bytes) -> tuple[int, dict[str, str], bytes]:
    """A raw HTTP/1.x response as (status, lower-cased headers, body bytes as sent)."""
    head, _, body = raw.partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    status = int(lines[0].split()[1])
    headers: dict[str, str] = {}
    for line in lines[1:]:
        name, _, value = line.partition(":")
        headers[name.strip().lower()] = value.strip()
    return status, headers, body


def request_bytes(path: str, body: bytes, *, version: str = "1.1",
                  extra: list[tuple[str, str]] | None = None,
                  content_length: bool = True) -> bytes:
    """A raw POST with a JSON body; ``Connection: close`` unless ``extra`` sets it."""
    lines = [f"POST {path} HTTP/{version}", "Host: gateway", "Content-Type: application/json"]
    if content_length:
        lines.append(f"Content-Length: {len(body)}")
    names = {name.lower() for name, _ in extra or []}
    if "connection" not in names:
        lines.append("Connection: close")
    lines += [f"{name}: {value}" for name, value in extra or []]
    return ("\r\n".join(lines) + "\r\n\r\n").encode() + body

