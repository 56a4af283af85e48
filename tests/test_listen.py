"""Listening on several addresses (``server.host = "127.0.0.1,::1"``), as llama-server's
``--host`` takes a list: the real ``gateway serve`` process, one port, each address."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from gateway.config import ConfigError, load_settings
from gateway.dev.localbackend import free_port
from gateway.http.serving import listen_hosts

ROOT = Path(__file__).resolve().parent.parent


def test_the_list_of_hosts() -> None:
    assert listen_hosts("127.0.0.1") == ["127.0.0.1"]
    assert listen_hosts("127.0.0.1, [::1]") == ["127.0.0.1", "::1"]
    with pytest.raises(ValueError, match="empty address"):
        listen_hosts("127.0.0.1,")


@pytest.mark.parametrize("host", ["127.0.0.1,", " , ::1", ""])
def test_an_empty_address_is_refused_by_the_settings(host: str) -> None:
    with pytest.raises(ConfigError, match="address must not be empty"):
        load_settings(server={"host": host})


def _ipv6_loopback() -> bool:
    try:
        with socket.socket(socket.AF_INET6) as probe:
            probe.bind(("::1", 0))
    except OSError:
        return False
    return True


@pytest.mark.skipif(not _ipv6_loopback(), reason="no IPv6 loopback here")
def test_one_process_answers_on_each_address(tmp_path: Path) -> None:
    port = free_port()
    config = tmp_path / "g.toml"
    config.write_text(f'[server]\nhost = "127.0.0.1,::1"\nport = {port}\n\n'
                      '[[backends]]\nname = "nowhere"\nurl = "http://127.0.0.1:9"\n')
    proc = subprocess.Popen([sys.executable, "-m", "gateway", "serve", "--config", str(config)],
                            cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)},
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:
        answered: dict[str, int] = {}
        deadline = time.monotonic() + 60
        while len(answered) < 2 and time.monotonic() < deadline and proc.poll() is None:
            for host in ("127.0.0.1", "[::1]"):
                try:
                    answered[host] = httpx.get(f"http://{host}:{port}/health",
                                               timeout=2).status_code
                except httpx.HTTPError:
                    time.sleep(0.2)
        assert answered == {"127.0.0.1": 200, "[::1]": 200}, proc.poll()
    finally:
        proc.send_signal(signal.SIGTERM)
        out, _ = proc.communicate(timeout=30)
    assert proc.returncode == 0, out.decode(errors="replace")[-2000:]
    # Its shutdown left no task running (gateway.http.serving._end_leftovers).
    assert b"still running after their owner ended" not in out, out.decode()[-3000:]
