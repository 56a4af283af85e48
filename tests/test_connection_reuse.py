"""Upstream connection reuse (issue 11): a backend that closes a kept-alive connection as
a request is written onto it. The upstream here is a scripted server on a real socket,
and the gateway uses its real upstream client (aiohttp), since the race lives in the
connection pool.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import httpx
import pytest
from prometheus_client import CollectorRegistry

from gateway.backends.upstream import ReuseRetry
from gateway.config import load_settings
from gateway.http.app import create_app

pytestmark = pytest.mark.anyio


class ClosingUpstream:
    """Answers like llama-server, but only the first request of each connection: the
    next one on that connection is read and the connection closed with no answer, as a
    server does when its keep-alive timer fires at that moment."""

    PROMPT_TOKENS = 17

    def __init__(self) -> None:
        self.dropped = 0
        self.connections = 0
        self.paths: list[str] = []
        self.server: asyncio.base_events.Server | None = None
        self.serving: set[asyncio.Task[Any]] = set()  # one per open connection

    async def start(self) -> str:
        self.server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        port = self.server.sockets[0].getsockname()[1]
        return f"http://127.0.0.1:{port}"

    async def stop(self) -> None:
        assert self.server is not None
        self.server.close()

    def _answer(self, path: str) -> dict[str, Any] | list[Any]:
        if path == "/props":
            return {"total_slots": 2, "default_generation_settings": {"n_ctx": 4096}}
        if path == "/v1/models":
            return {"data": [{"id": "m", "meta": {"n_vocab": 1000}}]}
        if path == "/v1/chat/completions/input_tokens":
            return {"input_tokens": self.PROMPT_TOKENS}
        if path == "/slots":
            return []
        return {"id": "c", "object": "chat.completion", "choices": [{
            "index": 0, "message": {"role": "assistant", "content": "ok"},
            "finish_reason": "stop"}], "usage": {
            "prompt_tokens": self.PROMPT_TOKENS, "completion_tokens": 1,
            "total_tokens": self.PROMPT_TOKENS + 1}}

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        served = 0
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                lines = head.decode().split("\r\n")
                path = lines[0].split()[1]
                length = next((int(h.split(":", 1)[1]) for h in lines[1:]
                               if h.lower().startswith("content-length:")), 0)
                await reader.readexactly(length)
                self.paths.append(path)
                if served:
                    self.dropped += 1
                    break
                served += 1
                payload = json.dumps(self._answer(path)).encode()
                writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n"
                             b"Content-Length: " + str(len(payload)).encode() +
                             b"\r\n\r\n" + payload)
                await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()


async def test_a_reused_connection_closed_under_a_request_is_retried_once() -> None:
    upstream = ClosingUpstream()
    url = await upstream.start()
    # A long keep-alive, so that the pool reuses connections the upstream then drops.
    settings = load_settings(backends=[{"name": "local", "url": url,
                                        "keepalive_expiry_s": 60}])
    app = create_app(settings, registry=CollectorRegistry(), discover=False)
    target = app.state.gateway.fleet.backends["local"]
    async with app.router.lifespan_context(app):
        await target.discover()  # /props then /v1/models: the second reuses a connection
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app),
                                     base_url="http://gateway") as client:
            # Three prompts, so that each is counted by the upstream (none is cached).
            replies = [await client.post("/v1/chat/completions", json={
                "messages": [{"role": "user", "content": f"hi {i}"}], "max_tokens": 4})
                for i in range(3)]
        registry = app.state.gateway.metrics.registry
        assert [r.status_code for r in replies] == [200, 200, 200]
        assert all(r.headers["x-gateway-prompt-tokens"] == "17" for r in replies)  # exact
        assert upstream.dropped > 0  # the race really happened
        retried = sum(c._transport.retried for c in (target.client, target.dialect.side.client)
                      if isinstance(c._transport, ReuseRetry))
        # POSTs are sent again by the gateway; aiohttp itself re-sends an idempotent GET.
        assert 1 <= retried <= upstream.dropped
        assert registry.get_sample_value("gateway_token_count_source_total",
                                         {"backend": "local", "source": "backend"}) == 3
        errors = [s for m in registry.collect() if m.name == "gateway_upstream_errors"
                  for s in m.samples if s.name.endswith("_total") and s.value]
        assert errors == []  # every kind's series is there (primed), all at zero
    await upstream.stop()


async def test_a_fresh_connection_closed_without_an_answer_is_not_retried() -> None:
    # Only a reused connection is safe to retry: a fresh one that the server closes may
    # have been read, so it is a failure (502), counted once.
    class Silent(ClosingUpstream):
        async def _serve(self, reader: asyncio.StreamReader,
                         writer: asyncio.StreamWriter) -> None:
            self.connections += 1
            head = await reader.readuntil(b"\r\n\r\n")
            self.paths.append(head.decode().split()[1])
            writer.close()

    upstream = Silent()
    url = await upstream.start()
    settings = load_settings(backends=[{"name": "local", "url": url, "slots": 2,
                                        "ctx_per_slot": 4096}])
    app = create_app(settings, registry=CollectorRegistry(), discover=False)
    async with app.router.lifespan_context(app):
        target = app.state.gateway.fleet.backends["local"]
        with pytest.raises(httpx.TransportError):
            await target.client.post(url + "/v1/chat/completions", json={"messages": []})
        assert upstream.connections == 1 and target.client._transport.retried == 0
    await upstream.stop()


async def test_a_reused_connection_that_breaks_after_work_began_is_not_retried() -> None:
    # The upstream reads the second request of a connection and works on it for a
    # second before the connection breaks: it may have done the work, so the request is
    # never sent again (the client gets a 502 instead of a duplicate generation).
    class Slow(ClosingUpstream):
        async def _serve(self, reader: asyncio.StreamReader,
                         writer: asyncio.StreamWriter) -> None:
            served = 0
            try:
                while True:
                    head = await reader.readuntil(b"\r\n\r\n")
                    lines = head.decode().split("\r\n")
                    length = next((int(h.split(":", 1)[1]) for h in lines[1:]
                                   if h.lower().startswith("content-length:")), 0)
                    await reader.readexactly(length)
                    self.paths.append(lines[0].split()[1])
                    if served:
                        await asyncio.sleep(1.0)
                        break
                    served += 1
                    payload = b'{"ok": true}'
                    writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n"
                                 b"Content-Length: 12\r\n\r\n" + payload)
                    await writer.drain()
            except (asyncio.IncompleteReadError, ConnectionError):
                pass
            finally:
                writer.close()

    upstream = Slow()
    url = await upstream.start()
    settings = load_settings(backends=[{"name": "local", "url": url, "keepalive_expiry_s": 60}])
    app = create_app(settings, registry=CollectorRegistry(), discover=False)
    async with app.router.lifespan_context(app):
        client = app.state.gateway.fleet.backends["local"].client
        first = await client.post(url + "/v1/chat/completions", json={"messages": []})
        assert first.status_code == 200
        with pytest.raises(httpx.TransportError):
            await client.post(url + "/v1/chat/completions", json={"messages": []})
        assert upstream.paths.count("/v1/chat/completions") == 2  # sent once each
        assert client._transport.retried == 0
    await upstream.stop()


class StreamingUpstream:
    """Streams every chat answer as SSE in chunked encoding and keeps the connection
    open, as vLLM (uvicorn) and Ollama (Go's net/http) do; the chunked terminator comes
    ``tail_s`` after ``[DONE]``. Records, per generation request, the connection it
    came on and its ``Connection`` header."""

    ANSWERS = {
        "/props": b'{"total_slots": 2, "default_generation_settings": {"n_ctx": 4096}}',
        "/v1/models": b'{"data": [{"id": "m", "max_model_len": 4096}]}',
        "/health": b"{}", "/slots": b"[]",
        "/tokenize": b'{"count": 5, "tokens": [1, 2, 3, 4, 5]}',
        "/v1/chat/completions/input_tokens": b'{"input_tokens": 5}',
    }

    def __init__(self, tail_s: float = 0.02) -> None:
        self.tail_s = tail_s
        self.connections = 0
        self.generations: list[tuple[int, str | None]] = []
        self.cookies: list[str] = []  # Cookie headers received
        self.server: asyncio.base_events.Server | None = None
        self.serving: set[asyncio.Task[Any]] = set()  # one per open connection

    async def start(self) -> str:
        self.server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        return f"http://127.0.0.1:{self.server.sockets[0].getsockname()[1]}"

    async def stop(self) -> None:
        """Stop listening and end every connection still open (Python 3.11's
        ``Server.close`` leaves them)."""
        assert self.server is not None
        self.server.close()
        for task in self.serving:
            task.cancel()
        await asyncio.gather(*self.serving, return_exceptions=True)

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        me = asyncio.current_task()
        assert me is not None
        self.serving.add(me)
        me.add_done_callback(self.serving.discard)
        self.connections += 1
        conn = self.connections
        try:
            while True:
                head = (await reader.readuntil(b"\r\n\r\n")).decode()
                lines = head.split("\r\n")
                fields = {k.strip().lower(): v.strip() for k, _, v in
                          (h.partition(":") for h in lines[1:] if h)}
                await reader.readexactly(int(fields.get("content-length", 0)))
                if "cookie" in fields:
                    self.cookies.append(fields["cookie"])
                path = lines[0].split()[1]
                if path in self.ANSWERS:  # discovery and counting, for either kind
                    payload = self.ANSWERS[path]
                    writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n"
                                 b"Set-Cookie: session=first-client; Path=/\r\n"
                                 b"Content-Length: %d\r\n\r\n%s" % (len(payload), payload))
                    continue
                if path != "/v1/chat/completions":
                    writer.write(b"HTTP/1.1 404 Not Found\r\nContent-Length: 0\r\n\r\n")
                    continue
                self.generations.append((conn, fields.get("connection")))
                writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\n"
                             b"Set-Cookie: session=first-client; Path=/\r\n"
                             b"Transfer-Encoding: chunked\r\n\r\n")
                for event in (b'data: {"choices":[{"index":0,"delta":{"content":"a"}}]}\n\n',
                              b'data: {"choices":[{"index":0,"delta":{},'
                              b'"finish_reason":"stop"}],"usage":{"prompt_tokens":5,'
                              b'"completion_tokens":1,"total_tokens":6}}\n\n',
                              b"data: [DONE]\n\n"):
                    writer.write(b"%x\r\n%s\r\n" % (len(event), event))
                await writer.drain()
                await asyncio.sleep(self.tail_s)
                writer.write(b"0\r\n\r\n")
                await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()


STREAM = {"model": "m", "stream": True, "max_tokens": 4,
          "messages": [{"role": "user", "content": "hi"}]}


@asynccontextmanager
async def gateway_over(upstream: StreamingUpstream, kind: str, slots: int, *,
                       by_name: bool = False) -> AsyncIterator[tuple[Any, httpx.AsyncClient]]:
    """The app, with its real upstream clients, over ``upstream`` (discovered), and a
    client that calls it in-process; the upstream is stopped at the end. ``by_name``:
    address the upstream as localhost (aiohttp's default jar keeps no cookie from a bare
    IP address)."""
    url = await upstream.start()
    if by_name:
        url = url.replace("127.0.0.1", "localhost")
    settings = load_settings(backends=[{"name": "b", "url": url, "kind": kind,
                                        "slots": slots, "keepalive_expiry_s": 60}])
    app = create_app(settings, registry=CollectorRegistry(), discover=False)
    try:
        async with app.router.lifespan_context(app):
            await app.state.gateway.fleet.backends["b"].discover()
            async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app),
                                         base_url="http://gateway") as client:
                yield app, client
    finally:
        await upstream.stop()


@pytest.mark.parametrize(("kind", "reused"), [("vllm", True), ("llama.cpp", False)])
async def test_streams_reuse_connections_unless_the_server_closes_them(
        kind: str, reused: bool) -> None:
    # A stream is whole at [DONE]; the gateway then still reads the chunked terminator
    # that follows, so that the connection goes back to the pool: closing it unread cost
    # a new TCP connection per stream. llama-server closes the connection after every
    # stream, so the gateway asks for that close instead of pooling a dead connection.
    upstream = StreamingUpstream()
    async with gateway_over(upstream, kind, 2, by_name=True) as (_app, client):
        for _ in range(3):
            reply = await client.post("/v1/chat/completions", json=STREAM)
            assert reply.status_code == 200 and reply.text.endswith("data: [DONE]\n\n")
            await asyncio.sleep(upstream.tail_s * 5)  # the tail is read meanwhile
    assert len(upstream.generations) == 3
    connections = {conn for conn, _ in upstream.generations}
    headers = {header for _, header in upstream.generations}
    if reused:
        assert len(connections) == 1 and "close" not in headers
    else:
        assert headers == {"close"}
    # Every answer set a cookie; none went out again with a later request (it would
    # carry one client's session to the next client).
    assert upstream.cookies == []


async def test_a_late_stream_tail_holds_neither_the_slot_nor_the_request() -> None:
    # The chunked terminator comes a second after [DONE]. The answer is whole at [DONE]:
    # the slot is given back then, the next request does not wait for the tail, and the
    # served request counts as served (200), not as a client that left.
    upstream = StreamingUpstream(tail_s=1.0)
    async with gateway_over(upstream, "vllm", 1, by_name=True) as (app, client):
        first, second = await asyncio.gather(
            client.post("/v1/chat/completions", json=STREAM),
            client.post("/v1/chat/completions", json=STREAM))
        listed = await client.get("/v1/models")
        listed = await client.get("/v1/models")
    assert first.status_code == second.status_code == listed.status_code == 200
    waits = sorted(int(r.headers["x-queue-wait-ms"]) for r in (first, second))
    assert waits[1] < 500  # one waited for the other's answer, not for its tail
    registry = app.state.gateway.metrics.registry
    assert registry.get_sample_value("gateway_requests_total", {
        "backend": "b", "route": "chat", "code": "200", "tenant": "anonymous",
        "priority": "default"}) == 2
    assert upstream.cookies == []  # the listing route keeps no cookie either


async def test_tails_still_read_at_shutdown_are_stopped() -> None:
    upstream = StreamingUpstream(tail_s=5.0)
    async with gateway_over(upstream, "vllm", 1) as (app, client):
        tasks = app.state.gateway.tasks  # the app's own: another app's tails are not here

        def tails() -> list:
            return [t for t in tasks if t.get_coro().__name__ == "drain"]

        reply = await client.post("/v1/chat/completions", json=STREAM)
        assert reply.status_code == 200 and len(tails()) == 1  # the tail waits
        held = tails()[0]
    assert held.done() and not tails()  # stopped with the app, its response closed
