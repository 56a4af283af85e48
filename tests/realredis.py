"""A real ``redis-server`` on loopback for the shared-state tests (Debian's package;
``.ci/run`` installs it). Each server is started on a free port, with no persistence, and
stopped (``SIGKILL`` when it will not stop) at the end."""

from __future__ import annotations

import shutil
import socket
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

import pytest


def free_port() -> int:
    """A TCP port free on loopback now."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@dataclass
class RedisServer:
    """One ``redis-server`` process; :meth:`stop` and :meth:`start` again on the same port
    (a restart that loses every key, as one without persistence does)."""

    workdir: Path
    port: int = 0
    proc: subprocess.Popen[bytes] | None = None
    #: More ``redis-server`` options (``--requirepass``, ``--enable-debug-command``).
    extra: tuple[str, ...] = ()
    password: str | None = None  # what the readiness ping authenticates with

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> RedisServer:
        binary = shutil.which("redis-server")
        if binary is None:
            pytest.skip("redis-server is not installed (.ci/run installs it)")
        self.port = self.port or free_port()
        self.proc = subprocess.Popen(
            [binary, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "",
             "--appendonly", "no", "--dir", str(self.workdir), "--protected-mode", "no",
             *self.extra],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=0.2) as s:
                    auth = f"AUTH {self.password}\r\n" if self.password else ""
                    s.sendall(f"{auth}PING\r\n".encode())
                    seen = b""
                    while b"\r\n" not in seen.removeprefix(b"+OK\r\n") and len(seen) < 64:
                        chunk = s.recv(64)
                        if not chunk:
                            break
                        seen += chunk
                    if seen.removeprefix(b"+OK\r\n").startswith(b"+PONG"):
                        return self
            except OSError:
                time.sleep(0.02)
        raise RuntimeError(f"redis-server did not start on port {self.port}")

    def stop(self) -> None:
        if self.proc is None:
            return
        self.proc.terminate()
        try:
            self.proc.wait(5)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(5)
        self.proc = None
