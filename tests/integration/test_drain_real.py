"""The graceful drain of the real gateway process in front of the real llama-server
(issue 14, part 1): SIGTERM while a stream is in flight."""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import httpx
import pytest

from gateway.dev.localbackend import LlamaServer, free_port
from tests.integration.conftest import StreamInFlight

pytestmark = pytest.mark.llama


def _serve(config: Path, port: int) -> tuple[subprocess.Popen[bytes], str]:
    """``gateway serve --config config`` as a child process, and its URL."""
    proc = subprocess.Popen([sys.executable, "-m", "gateway", "serve", "--config",
                             str(config)], stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    return proc, f"http://127.0.0.1:{port}"


def _wait_for(ready: Callable[[], bool], timeout_s: float = 60) -> None:
    """Poll ``ready`` (transport errors count as not yet) until it is true."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            if ready():
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    raise AssertionError(f"not ready within {timeout_s:g} s")


def test_sigterm_lets_a_stream_finish_refuses_new_work_and_exits_0(
        default_server: LlamaServer, tmp_path: Path) -> None:
    port = free_port()
    config = tmp_path / "gateway.toml"
    config.write_text(f'[server]\nport = {port}\ndrain_timeout_s = 120\n'
                      f'[[backends]]\nname = "local"\nurl = "{default_server.url}"\n')
    proc, url = _serve(config, port)
    try:
        _wait_for(lambda: httpx.get(url + "/ready", timeout=1).status_code == 200)
        stream = StreamInFlight(url)
        assert stream.begin()
        proc.send_signal(signal.SIGTERM)
        time.sleep(0.5)
        assert httpx.get(url + "/ready", timeout=5).status_code == 503
        late = httpx.post(url + "/v1/chat/completions", timeout=5, json={
            "messages": [{"role": "user", "content": "hi"}], "max_tokens": 5})
        assert late.status_code == 503 and late.json()["error"]["code"] == "shutting_down"
        text = stream.text()
        assert text.rstrip().endswith("data: [DONE]") and '"error"' not in text
        assert proc.wait(30) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_sighup_reloads_the_config_file(default_server: LlamaServer, tmp_path: Path) -> None:
    """SIGHUP to ``gateway serve`` reads its file again: a model name added is served
    at once; then an invalid file is refused and the running configuration stays."""
    port = free_port()
    config = tmp_path / "gateway.toml"
    head = f'[server]\nport = {port}\n[[backends]]\nname = "local"\nurl = "{default_server.url}"\n'
    config.write_text(head + 'model = "gemma"\n[[backends]]\nname = "spare"\n'
                      'url = "http://127.0.0.1:9"\nmodel = "other"\n')
    proc, url = _serve(config, port)
    chat = {"model": "gemma-3", "messages": [{"role": "user", "content": "hi"}],
            "max_tokens": 3}
    try:
        # Served once llama-server is discovered ("spare" never is).
        _wait_for(lambda: httpx.post(url + "/v1/chat/completions", timeout=60,
                                     json={**chat, "model": "gemma"}).status_code == 200)
        # Two models, and "gemma-3" names neither: 404.
        assert httpx.post(url + "/v1/chat/completions", json=chat, timeout=60
                          ).status_code == 404
        config.write_text(head + 'model = "gemma"\naliases = ["gemma-3"]\n')
        proc.send_signal(signal.SIGHUP)
        for _ in range(100):
            r = httpx.post(url + "/v1/chat/completions", json=chat, timeout=60)
            if r.status_code != 404:
                break
            time.sleep(0.1)
        assert r.status_code == 200, r.text
        config.write_text(head + "slotz = 3\n")
        proc.send_signal(signal.SIGHUP)
        time.sleep(1.0)
        assert httpx.post(url + "/v1/chat/completions", json=chat, timeout=60
                          ).status_code == 200  # still the last good configuration
        assert proc.poll() is None
    finally:
        proc.send_signal(signal.SIGINT)
        proc.send_signal(signal.SIGINT)
        try:
            out = proc.communicate(timeout=30)[0].decode(errors="replace")
        except subprocess.TimeoutExpired:  # a hang at shutdown: show what it logged
            proc.kill()
            out = proc.communicate()[0].decode(errors="replace")
            raise AssertionError("gateway serve did not exit 30 s after two SIGINTs; "
                                 f"its log:\n{out[-6000:]}") from None
    assert "SIGHUP" in out and "slotz" in out  # the refusal is logged with its reason
