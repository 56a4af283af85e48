"""A ``redis-server`` on a free loopback port with no persistence, for the tests and the
benchmarks of the shared admission state (Debian's ``redis-server``; ``.ci/run``
installs it). Development tooling: the gateway itself never starts one."""

from __future__ import annotations

import shutil
import socket
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

from gateway.dev.localbackend import free_port

__all__ = ["RedisMissing", "RedisServer"]


class RedisMissing(RuntimeError):
    """``redis-server`` is not on the ``PATH``."""


@dataclass
class RedisServer:
    """One ``redis-server`` process in ``workdir``. :meth:`stop`, then :meth:`start`
    again, restarts it on the same port with every key lost, as a restart without
    persistence does.

    :raises RedisMissing: from :meth:`start`, when the binary is not installed.
    :raises RuntimeError: from :meth:`start`, when it does not answer ``PING`` in 10 s.
    """

    workdir: Path | str
    port: int = 0
    proc: subprocess.Popen[bytes] | None = None
    #: More ``redis-server`` options (``--requirepass``, ``--enable-debug-command``).
    extra: tuple[str, ...] = ()
    password: str | None = None  # what the readiness ping authenticates with

    @property
    def url(self) -> str:
        """``redis://127.0.0.1:{port}/0``."""
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> RedisServer:
        """Start it (on a free port the first time) and wait until it answers."""
        binary = shutil.which("redis-server")
        if binary is None:
            raise RedisMissing("redis-server is not installed (.ci/run installs it)")
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
        """Stop it (SIGTERM, then SIGKILL after 5 s)."""
        if self.proc is None:
            return
        self.proc.terminate()
        try:
            self.proc.wait(5)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(5)
        self.proc = None
