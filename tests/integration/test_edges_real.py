"""Issue 15, points 3, 4 and 7, against the real llama-server."""

from __future__ import annotations

import json
from typing import Any

import httpx
import pytest

from gateway.dev.localbackend import LlamaServer
from gateway.planner.probe import probe
from tests.integration.conftest import GatewayThread
from tests.served import exchange, request_bytes, split_response

pytestmark = [pytest.mark.llama]

CHAT = "/v1/chat/completions"
BODY = {"messages": [{"role": "user", "content": "Say hi."}], "max_tokens": 4}


def test_headers_llama_server_refuses_are_not_forwarded(default_server: LlamaServer) -> None:
    # Straight to llama-server, a cookie this size gets an empty 400.
    direct = httpx.post(default_server.url + CHAT, json=BODY, timeout=60,
                        headers={"Cookie": "a=" + "x" * 8300})
    assert direct.status_code >= 400
    with GatewayThread({"url": default_server.url}) as gw:
        r = httpx.post(gw.url + CHAT, json=BODY, timeout=60,
                       headers={"Cookie": "a=" + "x" * 8300})
        assert r.status_code == 200, r.text
        many = {f"X-H{i}": "v" for i in range(120)}
        r = httpx.post(gw.url + CHAT, json=BODY, timeout=60, headers=many)
        assert r.status_code == 431
        assert r.json()["error"]["code"] == "request_header_fields_too_large"


def test_http_1_0_client_reads_a_stream(default_server: LlamaServer) -> None:
    with GatewayThread({"url": default_server.url}) as gw:
        raw = exchange(gw.port, request_bytes(
            CHAT, json.dumps({**BODY, "stream": True}).encode(), version="1.0"), timeout=60)
        status, headers, payload = split_response(raw)
        assert status == 200 and "transfer-encoding" not in headers
        assert payload.rstrip().endswith(b"data: [DONE]")


@pytest.fixture(scope="module")
def keyed_server(llama_parts: tuple[Any, Any]) -> Any:
    binary, model = llama_parts
    server = LlamaServer(["-c", "2048", "--api-key", "k-123"], binary=binary, model=model)
    with server.running():
        yield server


def test_backend_with_api_key_is_fronted(keyed_server: LlamaServer) -> None:
    found = probe(keyed_server.url)
    assert found["kind"] == "unknown" and "--api-key" in found["error"]
    assert probe(keyed_server.url, api_key="k-123")["kind"] == "llama.cpp"
    with GatewayThread({"url": keyed_server.url, "api_key": "k-123"}) as gw:
        # The client's own Authorization is not the backend's and is not forwarded.
        r = httpx.post(gw.url + CHAT, json=BODY, timeout=60,
                       headers={"Authorization": "Bearer client-key"})
        assert r.status_code == 200, r.text
        assert int(r.headers["x-gateway-prompt-tokens"]) == r.json()["usage"]["prompt_tokens"]
        models = httpx.get(gw.url + "/v1/models", timeout=10).json()
        assert models["data"]


def test_backend_with_api_key_and_none_configured_stays_not_ready(
    keyed_server: LlamaServer, caplog: pytest.LogCaptureFixture
) -> None:
    gw = GatewayThread({"url": keyed_server.url, "api_key": "wrong"}, ready_timeout=4)
    with pytest.raises(RuntimeError, match="did not become ready"):
        with gw:
            pass
    assert "api_key" in caplog.text


def test_an_idle_client_connection_is_kept_30_s(default_server: LlamaServer) -> None:
    """Issue 11: client pools keep idle connections 60-90 s; uvicorn's default drops them
    after 5 s, and the next request on the pooled socket meets EOF."""
    import socket
    import time

    request = (b"POST /v1/chat/completions HTTP/1.1\r\nHost: gw\r\nContent-Type: "
               b"application/json\r\nContent-Length: %d\r\n\r\n")
    body = b'{"messages": [{"role": "user", "content": "Say hi."}], "max_tokens": 2}'
    with GatewayThread({"url": default_server.url}) as gw, \
            socket.create_connection(("127.0.0.1", gw.port), timeout=120) as sock:
        replies = []
        for attempt in range(2):
            if attempt:
                time.sleep(30)
            sock.sendall(request % len(body) + body)
            head = b""
            while b"\r\n\r\n" not in head:
                head += sock.recv(65536)
            header, _, rest = head.partition(b"\r\n\r\n")
            length = int(header.lower().split(b"content-length: ")[1].split(b"\r\n")[0])
            while len(rest) < length:
                rest += sock.recv(65536)
            replies.append(header)
        assert all(h.startswith(b"HTTP/1.1 200") for h in replies)
        assert b"keep-alive: timeout=120" in replies[0].lower()
