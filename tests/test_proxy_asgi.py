"""Streaming, disconnects and mid-stream failures, driven at the ASGI level.

httpx's ASGITransport buffers whole responses and never disconnects, so these tests
call the app with hand-written ``receive``/``send`` (as starlette's own tests do).
"""

from __future__ import annotations

import asyncio
import json
import time
from typing import Any

import pytest

from tests.conftest import Harness

pytestmark = pytest.mark.anyio


class AsgiCall:
    """One request to the app; records what it sends back, with arrival times."""

    def __init__(self, h: Harness, body: dict[str, Any], path: str = "/v1/chat/completions"):
        self.h = h
        self.raw = json.dumps(body).encode()
        self.path = path
        self.messages: list[tuple[float, dict[str, Any]]] = []
        self.gone = asyncio.Event()
        self._sent_body = False
        self.first_body = asyncio.Event()

    async def receive(self) -> dict[str, Any]:
        if not self._sent_body:
            self._sent_body = True
            return {"type": "http.request", "body": self.raw, "more_body": False}
        await self.gone.wait()
        return {"type": "http.disconnect"}

    async def send(self, message: dict[str, Any]) -> None:
        self.messages.append((time.monotonic(), message))
        if message["type"] == "http.response.body" and message.get("body"):
            self.first_body.set()

    async def run(self) -> None:
        scope = {
            "type": "http", "asgi": {"version": "3.0", "spec_version": "2.3"},
            "http_version": "1.1", "method": "POST", "scheme": "http", "path": self.path,
            "raw_path": self.path.encode(), "query_string": b"", "root_path": "",
            "headers": [(b"content-type", b"application/json"),
                        (b"content-length", str(len(self.raw)).encode())],
            "client": ("127.0.0.1", 1234), "server": ("gateway", 80),
        }
        await self.h.app(scope, self.receive, self.send)

    @property
    def status(self) -> int:
        return next(m["status"] for _, m in self.messages if m["type"] == "http.response.start")

    @property
    def headers(self) -> dict[bytes, bytes]:
        start = next(m for _, m in self.messages if m["type"] == "http.response.start")
        return {k.lower(): v for k, v in start["headers"]}  # names are case-insensitive

    @property
    def chunks(self) -> list[bytes]:
        return [m["body"] for _, m in self.messages
                if m["type"] == "http.response.body" and m.get("body")]

    @property
    def text(self) -> str:
        return b"".join(self.chunks).decode()


def chat(stream: bool = True, **extra: Any) -> dict[str, Any]:
    return {"messages": [{"role": "user", "content": "hello"}], "max_tokens": 8,
            "stream": stream, **extra}


async def test_stream_is_relayed_event_by_event(harness: Harness, fake: Any) -> None:
    fake.tokens, fake.token_delay = 8, 0.02
    call = AsgiCall(harness, chat())
    await call.run()
    assert call.status == 200
    h = call.headers
    assert h[b"content-type"] == b"text/event-stream"
    assert h[b"cache-control"] == b"no-cache" and h[b"x-accel-buffering"] == b"no"
    times = [t for t, m in call.messages if m["type"] == "http.response.body" and m.get("body")]
    assert len(times) >= 9  # role chunk + 8 tokens + finish + [DONE], one send each
    assert times[-1] - times[0] >= 0.1  # spread over time, not one burst at the end
    assert call.chunks[-1] == b"data: [DONE]\n\n"
    assert "usage" not in call.text  # the client did not ask for it: the injected chunk is dropped
    assert fake.generations[-1]["stream_options"] == {"include_usage": True}
    assert harness.sample("gateway_completion_tokens_sum", backend="local") == 8
    assert harness.sample("gateway_ttft_seconds_count", backend="local") == 1
    assert harness.sample("gateway_itl_seconds_count", backend="local") == 7


async def test_stream_usage_kept_when_asked(harness: Harness) -> None:
    call = AsgiCall(harness, chat(stream_options={"include_usage": True}))
    await call.run()
    events = [c for c in call.chunks if c.startswith(b"data: {")]
    last = json.loads(events[-1][6:])
    assert last["choices"] == [] and last["usage"]["completion_tokens"] == 5
    assert call.chunks[-1] == b"data: [DONE]\n\n"


async def test_disconnect_mid_stream_closes_upstream_and_releases(
    harness: Harness, fake: Any
) -> None:
    fake.tokens, fake.token_delay = 1000, 0.01
    call = AsgiCall(harness, chat(max_tokens=1000))
    task = asyncio.ensure_future(call.run())
    await asyncio.wait_for(call.first_body.wait(), 2)
    assert harness.sample("gateway_kv_reserved_tokens", backend="local") > 0
    call.gone.set()
    await asyncio.wait_for(task, 2)
    assert fake.closed_streams == 1 and fake.active == 0
    # Held until /slots shows the slot free (the fake frees it at once): one poll.
    await asyncio.wait_for(harness.backend.slot_watch._task, 2)
    assert harness.sample("gateway_kv_reserved_tokens", backend="local") == 0
    assert harness.sample("gateway_inflight_requests", backend="local") == 0
    assert harness.sample("gateway_requests_total", backend="local", route="chat",
                          code="499") == 1


async def test_disconnect_while_queued_forwards_nothing(harness: Harness, fake: Any) -> None:
    fake.hold = asyncio.Event()
    first = AsgiCall(harness, chat(stream=False, max_tokens=1500))
    t1 = asyncio.ensure_future(first.run())
    while harness.sample("gateway_inflight_requests", backend="local") < 1:
        await asyncio.sleep(0.001)
    second = AsgiCall(harness, chat(stream=False, max_tokens=1500))
    t2 = asyncio.ensure_future(second.run())
    while harness.sample("gateway_queue_depth", backend="local") < 1:
        await asyncio.sleep(0.001)
    second.gone.set()
    await asyncio.wait_for(t2, 2)
    assert second.messages == []
    assert harness.sample("gateway_queue_depth", backend="local") == 0
    assert harness.sample("gateway_rejections_total", backend="local",
                          reason="client_disconnected") == 1
    fake.hold.set()
    await asyncio.wait_for(t1, 2)
    assert len(fake.generations) == 1
    assert harness.sample("gateway_kv_reserved_tokens", backend="local") == 0


async def test_disconnect_during_non_streaming_generation_releases(
    harness: Harness, fake: Any
) -> None:
    fake.hold = asyncio.Event()
    call = AsgiCall(harness, chat(stream=False))
    task = asyncio.ensure_future(call.run())
    while fake.active < 1:
        await asyncio.sleep(0.001)
    call.gone.set()
    await asyncio.wait_for(task, 2)
    # The upstream request stays open until /slots shows it running (the next poll),
    # then it is closed, and the reservation goes once the slot shows it ended.
    assert call.messages == [] and fake.active == 1
    await asyncio.wait_for(harness.backend.slot_watch._task, 5)
    assert fake.active == 0
    assert harness.sample("gateway_kv_reserved_tokens", backend="local") == 0


async def test_upstream_breaking_mid_stream_ends_with_an_error_event(
    harness: Harness, fake: Any
) -> None:
    fake.mode, fake.tokens = "midstream", 6
    call = AsgiCall(harness, chat())
    await call.run()
    assert call.status == 200
    last = call.chunks[-1]
    assert last.startswith(b"data: {") and json.loads(last[6:])["error"]["code"]
    assert b"[DONE]" not in b"".join(call.chunks)
    assert harness.sample("gateway_upstream_errors_total", backend="local",
                          kind="stream_aborted") == 1
    # The connection broke, but the backend may still run the task: held for one poll.
    await asyncio.wait_for(harness.backend.slot_watch._task, 2)
    assert harness.sample("gateway_kv_reserved_tokens", backend="local") == 0


async def test_upstream_stream_ending_early_gets_an_error_event(
    harness: Harness, fake: Any
) -> None:
    fake.mode = "truncated"
    call = AsgiCall(harness, chat())
    await call.run()
    assert b'"error"' in call.chunks[-1] and b"[DONE]" not in b"".join(call.chunks)


async def test_mid_stream_overflow_event_passes_and_is_counted(
    harness: Harness, fake: Any
) -> None:
    fake.mode, fake.tokens = "midstream_overflow", 6
    call = AsgiCall(harness, chat())
    await call.run()
    assert b"Context size has been exceeded" in call.chunks[-1]
    assert sum(b'"error"' in c for c in call.chunks) == 1  # no second, invented error
    assert harness.sample("gateway_upstream_errors_total", backend="local",
                          kind="context_overflow") == 1


async def test_event_split_across_reads_is_forwarded_whole(harness: Harness, fake: Any) -> None:
    import httpx

    async def split_stream(request: httpx.Request) -> httpx.Response:
        if request.url.path != "/v1/chat/completions":
            return await fake.handle(request)

        async def body() -> Any:
            yield b'data: {"choices": [{"index": 0, "delta": {"content": "he'
            yield b'llo"}}]}\n'
            yield b"\ndata: [DONE]\n\n"

        return httpx.Response(200, headers={"content-type": "text/event-stream"}, content=body())

    harness.state.client._transport = httpx.MockTransport(split_stream)
    call = AsgiCall(harness, chat())
    await call.run()
    # The event is whole in the first write (events completed by one read go out
    # together: here the event and [DONE]).
    assert call.chunks[0] == (b'data: {"choices": [{"index": 0, "delta": {"content": "hello"}}]}'
                              b'\n\ndata: [DONE]\n\n')


async def test_finished_requests_release_at_once_despite_the_grace(
    harness_factory: Any,
) -> None:
    h = await harness_factory({"disconnect_grace_s": 30})
    call = AsgiCall(h, chat())
    await call.run()
    assert h.sample("gateway_kv_reserved_tokens", backend="local") == 0
