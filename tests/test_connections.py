"""The gateway on the wire, under uvicorn with the options of ``gateway.http.app.uvicorn_options``:
oversized heads, request smuggling shapes, HTTP/1.0, ``Expect: 100-continue``, slowloris
and stalled bodies (issue 14, part 3), and the connection limits (issue 25, item 8).

The upstream is the fake llama-server (tests/fakes.py). Each test checks both the answer
and that nothing malformed reached the upstream.
"""

from __future__ import annotations

import json
import resource
import socket
import time
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families

from gateway.config import ServerSettings, load_settings, open_files_needed
from gateway.http.app import MAX_HEAD_BYTES
from gateway.http.middleware import MAX_HEADER_BYTES
from tests.fakes import FakeLlamaServer
from tests.served import exchange, read_all, request_bytes, served, split_response

CHAT = "/v1/chat/completions"
BODY = json.dumps({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}).encode()


@pytest.fixture
def fake() -> FakeLlamaServer:
    return FakeLlamaServer()


def settings(make_settings: Any, **server: Any) -> Any:
    base = make_settings()
    return base.model_copy(update={"server": base.server.model_copy(update=server)})


def test_a_plain_request_works_on_the_wire(make_settings: Any, fake: FakeLlamaServer) -> None:
    with served(make_settings(), fake.client()) as port:
        status, headers, body = split_response(exchange(port, request_bytes(CHAT, BODY)))
    assert status == 200 and json.loads(body)["object"] == "chat.completion"
    assert len(fake.generations) == 1


@pytest.mark.parametrize("size", [MAX_HEADER_BYTES + 1024, 16 * MAX_HEAD_BYTES])
def test_an_oversized_head_is_refused_and_not_forwarded(
        make_settings: Any, fake: FakeLlamaServer, size: int) -> None:
    with served(make_settings(), fake.client()) as port:
        raw = exchange(port, request_bytes(CHAT, BODY, extra=[("X-Pad", "a" * size)]))
    status, headers, body = split_response(raw)
    if size < MAX_HEAD_BYTES:  # the gateway's own limit: 431 in the OpenAI shape
        assert status == 431 and json.loads(body)["error"]["type"] == "invalid_request_error"
    else:  # h11's limit (it applies to a head still incomplete after a read): a plain
        # 400, and the connection is closed
        assert status == 400 and headers.get("connection") == "close"
    assert fake.generations == []


@pytest.mark.parametrize("framing", [
    [("Content-Length", "5")],  # two different lengths
    [("Transfer-Encoding", "gzip, chunked")],
    [("Transfer-Encoding", "identity")],
])
def test_ambiguous_framing_is_refused_and_not_forwarded(
        make_settings: Any, fake: FakeLlamaServer, framing: list[tuple[str, str]]) -> None:
    with served(make_settings(), fake.client()) as port:
        raw = exchange(port, request_bytes(CHAT, BODY, extra=framing))
        after = split_response(exchange(port, request_bytes(CHAT, BODY)))[0]
    status = split_response(raw)[0]
    assert 400 <= status < 500 or status == 501, raw[:200]
    assert len(fake.generations) == 1  # only the well-formed request after
    assert after == 200


def test_a_length_and_chunked_at_once_frame_by_chunked(
        make_settings: Any, fake: FakeLlamaServer) -> None:
    """CL.TE smuggling: the length covers a second request hidden after an empty chunked
    body. Transfer-Encoding wins (RFC 9112 section 6.3), so the gateway reads an empty
    body (400) and, the connection being closed after it, never serves the hidden one."""
    hidden = request_bytes(CHAT, BODY)
    body = b"0\r\n\r\n" + hidden
    with served(make_settings(), fake.client()) as port:
        raw = exchange(port, request_bytes(CHAT, body, extra=[("Transfer-Encoding", "chunked")]))
    responses = raw.count(b"HTTP/1.1 ")
    status, _, answer = split_response(raw)
    assert status == 400 and json.loads(answer)["error"]["type"] == "invalid_request_error"
    assert responses == 1 and fake.generations == []


def test_a_chunked_body_is_read(make_settings: Any, fake: FakeLlamaServer) -> None:
    chunked = b"".join(b"%x\r\n%s\r\n" % (len(part), part) for part in (BODY[:7], BODY[7:]))
    with served(make_settings(), fake.client()) as port:
        raw = exchange(port, request_bytes(
            CHAT, chunked + b"0\r\n\r\n", content_length=False,
            extra=[("Transfer-Encoding", "chunked")]))
    status, _, body = split_response(raw)
    assert status == 200 and json.loads(body)["choices"]
    assert len(fake.generations) == 1


def test_http_1_0_gets_a_whole_answer(make_settings: Any, fake: FakeLlamaServer) -> None:
    with served(make_settings(), fake.client()) as port:
        raw = exchange(port, request_bytes(CHAT, BODY, version="1.0"))
    status, headers, body = split_response(raw)
    assert raw.startswith(b"HTTP/1.1 200")  # h11 answers 1.1, framed for a 1.0 reader
    assert "transfer-encoding" not in headers
    assert json.loads(body)["object"] == "chat.completion"


def test_expect_100_continue(make_settings: Any, fake: FakeLlamaServer) -> None:
    with served(make_settings(), fake.client()) as port, \
            socket.create_connection(("127.0.0.1", port), timeout=20) as sock:
        head = request_bytes(CHAT, b"", extra=[("Expect", "100-continue")])
        head = head.replace(b"Content-Length: 0", b"Content-Length: %d" % len(BODY))
        sock.sendall(head)
        interim = sock.recv(4096)
        assert interim.startswith(b"HTTP/1.1 100 Continue")
        sock.sendall(BODY)
        status, _, body = split_response(read_all(sock))
    assert status == 200 and json.loads(body)["choices"]


def test_slowloris_connections_are_closed_and_others_are_served(
        make_settings: Any, fake: FakeLlamaServer) -> None:
    """40 clients each send part of a request head and then a byte now and again; each
    is closed once ``head_timeout_s`` has passed since its first byte, while a normal
    request is served all along."""
    with served(settings(make_settings, head_timeout_s=1.0), fake.client()) as port:
        socks = [socket.create_connection(("127.0.0.1", port), timeout=10) for _ in range(40)]
        started = time.monotonic()
        for sock in socks:
            sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: g\r\n")
        closed: set[int] = set()
        while len(closed) < len(socks) and time.monotonic() - started < 8:
            for i, sock in enumerate(socks):
                if i in closed:
                    continue
                try:
                    sock.sendall(b"X-a: b\r\n")  # a header line at a time, never the end
                except OSError:
                    closed.add(i)
            assert split_response(exchange(port, request_bytes(CHAT, BODY)))[0] == 200
            time.sleep(0.2)
        waited = time.monotonic() - started
        for sock in socks:
            sock.close()
    assert len(closed) == len(socks)
    assert 1.0 <= waited < 8
    assert len(fake.generations) >= 5  # the normal requests, one per round


def test_a_silent_connection_is_closed(make_settings: Any, fake: FakeLlamaServer) -> None:
    with served(settings(make_settings, head_timeout_s=0.5), fake.client()) as port, \
            socket.create_connection(("127.0.0.1", port), timeout=5) as sock:
        started = time.monotonic()
        assert read_all(sock) == b""  # closed without an answer
        assert 0.4 <= time.monotonic() - started < 4


def test_a_stalled_body_is_cut_and_a_slow_one_is_not(
        make_settings: Any, fake: FakeLlamaServer) -> None:
    with served(settings(make_settings, body_idle_timeout_s=0.6), fake.client()) as port:
        with socket.create_connection(("127.0.0.1", port), timeout=5) as sock:
            sock.sendall(request_bytes(CHAT, BODY[:10]).replace(
                b"Content-Length: 10", b"Content-Length: %d" % len(BODY)))
            started = time.monotonic()
            assert read_all(sock) == b""
            assert time.monotonic() - started < 4
        with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
            sock.sendall(request_bytes(CHAT, b"").replace(
                b"Content-Length: 0", b"Content-Length: %d" % len(BODY)))
            for i in range(0, len(BODY), 8):  # 0.3 s between pieces: slow, not stalled
                sock.sendall(BODY[i:i + 8])
                time.sleep(0.3)
            status, _, body = split_response(read_all(sock))
    assert status == 200 and json.loads(body)["choices"]
    assert len(fake.generations) == 1


def test_a_burst_past_max_connections_refuses_only_the_rest(make_settings: Any) -> None:
    """30 clients connect at once, then each sends a stream request, with room for 20
    requests in hand and a slow upstream with room for all: the first 20 are served
    whole, the other 10 get 503 too_many_connections in the OpenAI shape, with
    Retry-After, counted as rejections and never forwarded. (With uvicorn's own
    limit_concurrency all 30 got its plain 503: each head saw 30 connections open.)"""
    fake = FakeLlamaServer(slots=32, tokens=8, token_delay=0.4)  # 3.2 s per stream
    stream = json.dumps({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 8,
                         "stream": True}).encode()
    with served(settings(make_settings, max_connections=20), fake.client()) as port:
        socks = [socket.create_connection(("127.0.0.1", port), timeout=30)
                 for _ in range(30)]
        for sock in socks:
            sock.sendall(request_bytes(CHAT, stream))
        health = split_response(exchange(port, b"GET /health HTTP/1.1\r\nHost: g\r\n"
                                               b"Connection: close\r\n\r\n"))[0]
        answers = [split_response(read_all(sock)) for sock in socks]
        for sock in socks:
            sock.close()
        rejected = rejections(port, "too_many_connections")
    served_whole = [body for status, _, body in answers
                    if status == 200 and b"data: [DONE]" in body and b'"error"' not in body]
    refused = [(headers, body) for status, headers, body in answers if status == 503]
    assert len(served_whole) == 20 and len(refused) == 10
    for headers, body in refused:
        error = json.loads(body)["error"]
        assert error["code"] == "too_many_connections" and error["type"] == "server_error"
        assert "server.max_connections = 20" in error["message"]
        assert int(headers["retry-after"]) >= 1
    assert rejected == 10
    assert len(fake.generations) == 20
    assert health == 200  # probes are outside the limit


def test_idle_connections_do_not_count_and_past_twice_the_limit_one_is_closed(
        make_settings: Any, fake: FakeLlamaServer) -> None:
    """With max_connections = 4, four idle connections leave room for a request; eight
    open are the cap, so a ninth is closed unanswered; once they close, all is served."""
    with served(settings(make_settings, max_connections=4), fake.client()) as port:
        idle = [socket.create_connection(("127.0.0.1", port), timeout=5) for _ in range(4)]
        time.sleep(0.2)
        beside_idle = split_response(exchange(port, request_bytes(CHAT, BODY)))[0]
        idle += [socket.create_connection(("127.0.0.1", port), timeout=5) for _ in range(4)]
        time.sleep(0.2)
        try:
            past_cap = exchange(port, request_bytes(CHAT, BODY), timeout=5)
        except OSError:  # reset before the request was even written
            past_cap = b""
        for sock in idle:
            sock.close()
        time.sleep(0.2)
        after = split_response(exchange(port, request_bytes(CHAT, BODY)))[0]
    assert beside_idle == 200
    assert past_cap == b""
    assert after == 200
    assert len(fake.generations) == 2


def rejections(port: int, reason: str) -> float:
    """The sum of ``gateway_rejections_total{reason}`` as the gateway's /metrics shows it."""
    raw = exchange(port, b"GET /metrics HTTP/1.1\r\nHost: g\r\nConnection: close\r\n\r\n")
    status, headers, body = split_response(raw)
    assert status == 200
    if headers.get("transfer-encoding") == "chunked":
        body = dechunk(body)
    return sum(sample.value for family in text_string_to_metric_families(body.decode())
               for sample in family.samples
               if sample.name == "gateway_rejections_total"
               and sample.labels.get("reason") == reason)


def dechunk(body: bytes) -> bytes:
    """A chunked body's data."""
    out = b""
    while body:
        size, _, rest = body.partition(b"\r\n")
        n = int(size.split(b";")[0], 16)
        if n == 0:
            break
        out, body = out + rest[:n], rest[n + 2:]
    return out


def test_a_pipelined_request_with_a_stalled_body_is_cut(
        make_settings: Any, fake: FakeLlamaServer) -> None:
    """The second request of a pipeline starts when the first answer ends, not when
    bytes arrive: its body timer must start then too."""
    s = settings(make_settings, head_timeout_s=1.0, body_idle_timeout_s=1.0,
                 keepalive_timeout_s=30)
    with served(s, fake.client()) as port, \
            socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
        second = request_bytes(CHAT, BODY, extra=[("Connection", "keep-alive")])
        sock.sendall(b"GET /health HTTP/1.1\r\nHost: g\r\n\r\n"
                     + second[: second.index(b"\r\n\r\n") + 4 + 5])  # 5 body bytes
        started = time.monotonic()
        raw = read_all(sock)
        waited = time.monotonic() - started
    assert raw.count(b"HTTP/1.1 200") == 1  # the health check; then the cut
    assert waited < 5


def test_an_idle_keep_alive_connection_outlives_the_head_timeout(
        make_settings: Any, fake: FakeLlamaServer) -> None:
    s = settings(make_settings, head_timeout_s=0.5, keepalive_timeout_s=30)
    with served(s, fake.client()) as port, \
            socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
        sock.sendall(b"GET /health HTTP/1.1\r\nHost: g\r\n\r\n")
        first = b""
        while not first.endswith(b'{"status":"ok"}'):  # the whole first answer
            chunk = sock.recv(65536)
            assert chunk, first
            first += chunk
        assert first.startswith(b"HTTP/1.1 200")
        time.sleep(1.5)  # idle between requests: the keep-alive timeout applies, not this
        sock.sendall(b"GET /health HTTP/1.1\r\nHost: g\r\nConnection: close\r\n\r\n")
        assert read_all(sock).startswith(b"HTTP/1.1 200")


@pytest.mark.parametrize(("hard", "expected"), [
    (4096, 1280),  # (4,096 - 256) // 3: 3 descriptors each, 256 kept for the rest
    (200, 1),  # below the reserve: still one
    (1 << 20, 10_000),  # at most 10,000
    (resource.RLIM_INFINITY, 10_000),
])
def test_the_default_max_connections_is_sized_from_the_open_file_limit(
        monkeypatch: pytest.MonkeyPatch, hard: int, expected: int) -> None:
    monkeypatch.setattr(resource, "getrlimit", lambda _which: (1024, hard))
    sized = ServerSettings().max_connections
    assert sized == expected
    if 256 < hard < 10_000 * 3:
        assert open_files_needed(sized) <= hard < open_files_needed(sized + 1)


def test_a_max_connections_set_is_kept(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(resource, "getrlimit", lambda _which: (1024, 4096))
    assert load_settings(server={"max_connections": 50}).server.max_connections == 50
