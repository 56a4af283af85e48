"""The access line and the log set-up (gateway/observe/logs.py): one line per request that says
what the gateway decided, a request id returned to the client, no prompt text nor key at
any level, and one format (text or JSON) for the gateway's lines and uvicorn's, checked
on a real ``gateway serve`` process."""

from __future__ import annotations

import asyncio
import json
import logging
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx
import pytest

from gateway.config import ServerSettings
from gateway.dev.localbackend import free_port
from gateway.observe.logs import TextFormatter, configure_logging
from tests.conftest import Harness
from tests.test_app import until_inflight

pytestmark = pytest.mark.anyio


def access_records(caplog: pytest.LogCaptureFixture) -> list[logging.LogRecord]:
    return [r for r in caplog.records if r.name == "gateway.access"]


async def test_one_access_line_per_request_with_what_the_gateway_decided(
        harness: Harness, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO)
    r = await harness.chat("hello there", max_tokens=7, stream=True)
    assert r.status_code == 200
    (line,) = access_records(caplog)
    assert line.levelno == logging.INFO
    assert r.headers["x-request-id"] == line.request_id and len(line.request_id) == 32
    assert (line.method, line.path, line.route, line.backend, line.status) == (
        "POST", "/v1/chat/completions", "chat", "local", 200)
    assert line.tenant == "anonymous" and line.reason is None
    assert line.prompt_tokens == int(r.headers["x-gateway-prompt-tokens"]) > 0
    assert line.count_source == "backend" and line.max_tokens == 7
    assert line.queue_wait_ms == pytest.approx(int(r.headers["x-queue-wait-ms"]), abs=1)
    assert 0 <= line.ttft_ms <= line.duration_ms
    # a second time (stream stays in the count's key) the prompt's count comes from the
    # cache; an answer in one piece has no TTFT
    await harness.chat("hello there", max_tokens=3, stream=True)
    await harness.chat("hello there", max_tokens=3)
    second, third = access_records(caplog)[1:]
    assert second.count_source == "cache" and third.count_source == "backend"
    assert third.ttft_ms is None and third.duration_ms > 0
    assert len({line.request_id, second.request_id, third.request_id}) == 3


async def test_a_plain_client_request_id_is_kept_and_a_bad_one_replaced(
        harness: Harness, fake: Any, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO)
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    kept = await harness.client.post("/v1/chat/completions", json=body,
                                     headers={"x-request-id": "trace-42.a:b"})
    assert kept.headers["x-request-id"] == "trace-42.a:b"
    for bad in ("two words", "x" * 129, "evil\u00e9"):
        r = await harness.client.post("/v1/chat/completions", json=body,
                                      headers={"x-request-id": bad.encode()})
        assert r.headers["x-request-id"] != bad and len(r.headers["x-request-id"]) == 32
    ids = [rec.request_id for rec in access_records(caplog)]
    assert ids[0] == "trace-42.a:b" and len(set(ids)) == 4
    # the backend is sent one id, in place of the client's: the gateway's own, or the
    # client's made unique (vLLM keys its requests by it)
    sent = [r.headers.get_list("x-request-id") for r in fake.requests
            if r.url.path == "/v1/chat/completions"]
    assert [len(s) for s in sent] == [1] * 4
    assert sent[0][0].startswith("trace-42.a:b-") and len(sent[0][0]) == 12 + 1 + 8
    assert [s[0] for s in sent[1:]] == ids[1:]
    lines = access_records(caplog)
    assert lines[0].upstream_request_id == sent[0][0]
    assert [rec.upstream_request_id for rec in lines[1:]] == [None] * 3


async def test_rejections_carry_their_reason(
        harness_factory: Any, fake: Any, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO)
    fake.hold = asyncio.Event()
    h = await harness_factory({"max_queue_wait_s": 0.05})
    never = await h.chat("x", max_tokens=10**7)  # refused before any queue
    first = asyncio.ensure_future(h.chat("x", max_tokens=1500))
    await until_inflight(h, 1)
    timed_out = await h.chat("y", max_tokens=1500)  # refused by the queue (the proxy)
    fake.hold.set()
    await first
    lines = {rec.request_id: rec for rec in access_records(caplog)}
    refused = lines[never.headers["x-request-id"]]
    assert refused.status == never.status_code == 400
    assert refused.reason == never.json()["error"]["code"]
    assert h.sample("gateway_rejections_total", reason=refused.reason) == 1
    waited = lines[timed_out.headers["x-request-id"]]
    assert waited.status == 503 and waited.reason == timed_out.json()["error"]["code"]
    assert h.sample("gateway_rejections_total", reason=waited.reason) == 1
    assert waited.prompt_tokens and waited.max_tokens == 1500


async def test_probes_and_scrapes_are_debug_lines(
        harness: Harness, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG, logger="gateway.access")
    for path in ("/health", "/ready", "/metrics"):
        assert (await harness.client.get(path)).status_code == 200
    await harness.client.get("/v1/models")
    levels = {rec.path: rec.levelno for rec in access_records(caplog)}
    assert levels == {"/health": logging.DEBUG, "/ready": logging.DEBUG,
                      "/metrics": logging.DEBUG, "/v1/models": logging.INFO}


async def test_no_prompt_text_or_key_at_any_level(
        harness: Harness, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG)  # every logger, every level
    secret_prompt, secret_key = "purple-elephant-prompt", "sk-very-secret-key-123"
    headers = {"authorization": f"Bearer {secret_key}"}
    body = {"messages": [{"role": "user", "content": secret_prompt}], "max_tokens": 3}
    for stream in (False, True):
        r = await harness.client.post("/v1/chat/completions", headers=headers,
                                      json={**body, "stream": stream})
        assert r.status_code == 200
    await harness.client.post("/v1/chat/completions", headers=headers,
                              content=b'{"messages": [' + secret_prompt.encode())  # a 400
    assert len(access_records(caplog)) == 3
    for record in caplog.records:
        text = record.getMessage() + " " + repr(record.__dict__)
        assert secret_prompt not in text and secret_key not in text, record.name


def test_the_text_format_keeps_a_line_one_line() -> None:
    record = logging.LogRecord("gateway.access", logging.INFO, __file__, 1, "%s %s %s",
                               ("GET", '"/a\\nb"', 404), None)
    record.__dict__.update({"request_id": "abc", "route": "other", "status": 404,
                            "tenant": "ten ant", "reason": None, "duration_ms": 1.5})
    line = TextFormatter("%(name)s: %(message)s").format(record)
    assert "\n" not in line
    assert line == ('gateway.access: GET "/a\\nb" 404 request_id=abc route=other '
                    'tenant="ten ant" duration_ms=1.5')


def test_configure_logging_sets_one_handler_and_quiets_httpx() -> None:
    root = logging.getLogger()
    saved = (root.handlers[:], root.level)
    try:
        configure_logging(ServerSettings(log_format="json", access_log=False))
        assert len(root.handlers) == 1 and root.level == logging.INFO
        assert logging.getLogger("httpx").level == logging.WARNING
        assert logging.getLogger("uvicorn.access").disabled
        assert not logging.getLogger("gateway.access").isEnabledFor(logging.INFO)
        configure_logging(ServerSettings(log_level="debug"))
        assert logging.getLogger("httpx").level == logging.DEBUG
        assert logging.getLogger("gateway.access").isEnabledFor(logging.INFO)
    finally:
        root.handlers[:], _ = saved[0], root.setLevel(saved[1])
        logging.getLogger("gateway.access").disabled = False
        logging.getLogger("uvicorn.access").disabled = False


@pytest.mark.parametrize("fmt", ["json", "text"])
def test_a_served_gateway_writes_every_line_in_one_format(tmp_path: Path, fmt: str) -> None:
    # A real `gateway serve` in front of a backend that is not there: uvicorn's start-up
    # lines, the gateway's warning and the access lines all come out in one format.
    port = free_port()
    config = tmp_path / "gateway.toml"
    config.write_text(f'[server]\nport = {port}\nlog_format = "{fmt}"\n[[backends]]\n'
                      f'name = "gone"\nurl = "http://127.0.0.1:{free_port()}"\n')
    proc = subprocess.Popen([sys.executable, "-m", "gateway", "serve", "--config",
                             str(config)], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)
    try:
        deadline = time.monotonic() + 30
        while True:
            try:
                httpx.get(f"http://127.0.0.1:{port}/health", timeout=1)
                break
            except httpx.TransportError:
                assert time.monotonic() < deadline and proc.poll() is None
                time.sleep(0.1)
        r = httpx.post(f"http://127.0.0.1:{port}/v1/chat/completions", timeout=10,
                       headers={"x-request-id": "served-1"},
                       json={"messages": [{"role": "user", "content": "hi"}]})
        assert r.status_code == 503 and r.headers["x-request-id"] == "served-1"
    finally:
        proc.terminate()
        _out, err = proc.communicate(timeout=30)
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) >= 3, err
    if fmt == "json":
        parsed = [json.loads(line) for line in lines]  # every line, uvicorn's too
        assert all({"time", "level", "logger", "message"} <= set(p) for p in parsed)
        assert any(p["logger"].startswith("uvicorn") for p in parsed)
        assert not any("color_message" in p or "\x1b" in json.dumps(p) for p in parsed)
        (access,) = [p for p in parsed if p["logger"] == "gateway.access"]
        assert access["request_id"] == "served-1" and access["status"] == 503
        assert access["backend"] == "gone" and access["reason"]
        assert not any("HTTP Request" in p["message"] for p in parsed)  # httpx's lines
    else:
        assert all(" INFO " in line or " WARNING " in line or " ERROR " in line
                   for line in lines), err
        assert any(" uvicorn.error: " in line for line in lines)
        (access,) = [line for line in lines if " gateway.access: " in line]
        assert "POST /v1/chat/completions 503 request_id=served-1 " in access
        assert "backend=gone" in access and "reason=" in access


def test_make_run_sets_up_logging_as_gateway_serve_does(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # `make run` (python -m gateway.dev.localbackend run) once set up its own plain
    # logging, so log_format and the access line's fields were lost there.
    import contextlib
    import signal

    from gateway.dev import localbackend

    class NoServer:
        def __init__(self, args: list[str], **_: Any) -> None:
            self.args, self.url, self.log_path = args, "http://127.0.0.1:1", tmp_path / "l"

        @contextlib.contextmanager
        def running(self) -> Any:
            yield self

    seen: dict[str, Any] = {}

    def fake_serve(app: Any, settings: Any, **_: Any) -> None:
        seen["formatter"] = logging.getLogger().handlers[0].formatter
        seen["access"] = logging.getLogger("gateway.access").isEnabledFor(logging.INFO)

    config = tmp_path / "gateway.toml"
    config.write_text('[server]\nlog_format = "json"\naccess_log = false\n[[backends]]\n'
                      'name = "local"\nurl = "http://127.0.0.1:18080"\n')
    monkeypatch.setattr(localbackend, "LlamaServer", NoServer)
    monkeypatch.setattr("gateway.http.serving.serve", fake_serve)
    root = logging.getLogger()
    saved = root.handlers[:], root.level, signal.getsignal(signal.SIGTERM)
    try:
        assert localbackend.main(["run", "--config", str(config)]) == 0
    finally:
        root.handlers[:] = saved[0]
        root.setLevel(saved[1])
        signal.signal(signal.SIGTERM, saved[2])
        logging.getLogger("gateway.access").disabled = False
        logging.getLogger("uvicorn.access").disabled = False
    assert type(seen["formatter"]).__name__ == "JsonFormatter" and seen["access"] is False
