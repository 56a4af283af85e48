"""``gateway health``, the container's health check (issue 40): it reads the same
settings as ``gateway serve`` (the file, then ``GATEWAY_*``), so it finds the port set
in a mounted configuration file, which the image's old check (``GATEWAY_SERVER__PORT``
only) did not: the container turned unhealthy while the gateway served."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from gateway.__main__ import health_url, main
from gateway.dev.localbackend import free_port


@contextmanager
def answering(status: int) -> Iterator[int]:
    """A server on a free loopback port that answers ``GET /health`` with ``status``
    (and 404 elsewhere); yields its port."""
    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802 (http.server's name)
            self.send_response(status if self.path == "/health" else 404)
            self.send_header("content-length", "0")
            self.end_headers()

        def log_message(self, *args: object) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield server.server_address[1]
    finally:
        server.shutdown()
        server.server_close()


def config(tmp_path: Path, port: int, host: str = "0.0.0.0") -> str:
    path = tmp_path / "config.toml"
    path.write_text(f'[server]\nhost = "{host}"\nport = {port}\n')
    return str(path)


def test_the_port_comes_from_the_configuration_file(tmp_path: Path,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("GATEWAY_SERVER__PORT", raising=False)
    with answering(200) as port:
        assert main(["health", "--config", config(tmp_path, port)]) == 0
    with answering(503) as port:  # the process answers, but not healthy
        assert main(["health", "--config", config(tmp_path, port)]) == 1
    assert main(["health", "--config", config(tmp_path, free_port()), "--timeout", "1"]) == 1


def test_the_environment_overrides_the_file_as_for_serve(tmp_path: Path,
                                                         monkeypatch: pytest.MonkeyPatch
                                                         ) -> None:
    with answering(200) as port:
        monkeypatch.setenv("GATEWAY_SERVER__PORT", str(port))
        assert main(["health", "--config", config(tmp_path, free_port())]) == 0
    monkeypatch.setenv("GATEWAY_SERVER__PORT", "0")
    assert main(["health"]) == 1  # a random port: nothing to check, said so


def test_a_wildcard_listen_address_is_asked_on_the_loopback() -> None:
    assert health_url("0.0.0.0", 8000) == "http://127.0.0.1:8000/health"
    assert health_url("::", 9) == "http://[::1]:9/health"
    assert health_url("[::]", 9) == "http://[::1]:9/health"
    assert health_url("10.0.0.5,::1", 80) == "http://10.0.0.5:80/health"
    assert health_url("::1", 80) == "http://[::1]:80/health"
