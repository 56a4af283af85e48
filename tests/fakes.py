"""Test doubles: a manual clock and a fake llama-server behind httpx.MockTransport.

The fake follows llama-server's documented shapes (shared/design/backends.md §1.3–1.4):
``/props``, ``/health``, ``/v1/chat/completions/input_tokens``, ``/tokenize``,
``/v1/models``, OpenAI JSON and SSE answers with ``usage``, and its error bodies. It is
used only for the error paths and timings that a real server cannot be made to show on
demand; the real llama-server is exercised in tests/integration.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import httpx


class ManualClock:
    """A clock that only moves when told to; ``sleep`` wakes once ``advance`` passes it."""

    def __init__(self) -> None:
        self.t = 1000.0
        self._sleepers: list[tuple[float, asyncio.Future[None]]] = []

    def now(self) -> float:
        return self.t

    async def sleep(self, seconds: float) -> None:
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._sleepers.append((self.t + seconds, fut))
        await fut

    def advance(self, seconds: float) -> None:
        self.t += seconds
        for deadline, fut in list(self._sleepers):
            if deadline <= self.t and not fut.done():
                fut.set_result(None)
                self._sleepers.remove((deadline, fut))


def count_words(body: dict[str, Any]) -> int:
    """The fake tokenizer: one token per whitespace word, plus 4 per message + 2."""
    if "messages" in body:
        words = sum(len(str(m.get("content") or "").split()) for m in body["messages"])
        return words + 4 * len(body["messages"]) + 2
    return len(str(body.get("content", body.get("prompt", ""))).split()) + 1


@dataclass
class FakeLlamaServer:
    """Answers like llama-server. Set ``mode`` to make generation fail in a given way.

    modes: "ok", "overflow" (500 Context size…), "loading" (503), "connect" (refused),
    "timeout", "bad_request" (400 exceed_context_size_error), "midstream" (the stream
    breaks after two tokens), "midstream_overflow" (an error event after two tokens),
    "truncated" (the stream ends without [DONE]), "boom" (500 other).
    """

    slots: int = 4
    n_ctx: int = 2048
    mode: str = "ok"
    tokens: int = 5
    token_delay: float = 0.0
    hold: asyncio.Event | None = None  # when set, generation waits for it
    input_tokens_route: bool = True
    slots_route: bool = True
    api_key: str | None = None  # as llama-server --api-key: 401 without it
    n_vocab: int = 262144
    # When set, a generation the gateway abandons keeps its slot busy (as llama-server
    # does until it notices the closed connection) until this event is set.
    linger: asyncio.Event | None = None
    slot_state: dict[int, dict[str, Any]] = field(default_factory=dict)
    # When set, a generation waits for it before it takes a slot (as llama-server builds
    # a grammar from a json_schema in its HTTP thread before the task exists).
    prepare: asyncio.Event | None = None
    hide_slots: bool = False  # /slots shows every slot idle and without params
    after_done: asyncio.Event | None = None  # streams stay open after [DONE] until set
    count_fails: bool = False
    requests: list[httpx.Request] = field(default_factory=list)
    generations: list[dict[str, Any]] = field(default_factory=list)
    active: int = 0
    peak: int = 0
    closed_streams: int = 0
    lingering: set[asyncio.Task[None]] = field(default_factory=set)

    def transport(self) -> httpx.MockTransport:
        return httpx.MockTransport(self.handle)

    def client(self) -> httpx.AsyncClient:
        return httpx.AsyncClient(transport=self.transport())

    async def handle(self, request: httpx.Request) -> httpx.Response:
        self.requests.append(request)
        path = request.url.path
        if self.mode == "connect":
            raise httpx.ConnectError("connection refused", request=request)
        if self.api_key is not None and path not in ("/health", "/v1/health"):
            given = request.headers.get("authorization", "").removeprefix("Bearer ")
            if given != self.api_key:  # tools/server/server-http.cpp
                return _error(401, "Invalid API Key", "authentication_error")
        if path == "/props":
            if self.mode == "loading":
                return _error(503, "Loading model", "unavailable_error")
            return httpx.Response(200, json={
                "total_slots": self.slots,
                "default_generation_settings": {"n_ctx": self.n_ctx, "params": {}},
            })
        if path == "/slots":
            if not self.slots_route:
                return _error(501, "This server does not support slots endpoint.",
                              "not_supported_error")
            if self.hide_slots:
                return httpx.Response(200, json=[{"id": i, "n_ctx": self.n_ctx,
                                                  "is_processing": False}
                                                 for i in range(self.slots)])
            return httpx.Response(200, json=[
                {"id": i, "n_ctx": self.n_ctx, "is_processing": st["processing"],
                 "params": {k: st[k] for k in ("seed", "n_predict", "n_discard")}}
                for i, st in ((i, self.slot_state.get(i, {"processing": False, "seed": None,
                                                          "n_predict": None, "n_discard": 0}))
                              for i in range(self.slots))
            ])
        if path == "/v1/models":
            return httpx.Response(200, json={"object": "list", "data": [
                {"id": "fake.gguf", "meta": {"n_vocab": self.n_vocab, "n_ctx_train": 32768}}]})
        if path == "/v1/chat/completions/input_tokens":
            if not self.input_tokens_route:
                return httpx.Response(404, text="Not Found")
            if self.count_fails:  # the backend cannot count in time
                raise httpx.ReadTimeout("timed out", request=request)
            n = count_words(json.loads(request.content))
            return httpx.Response(200, json={"object": "response.input_tokens", "input_tokens": n})
        if path == "/apply-template":
            body = json.loads(request.content)
            return httpx.Response(200, json={"prompt": " ".join(
                "<turn> " + str(m.get("content") or "") for m in body["messages"])})
        if path == "/tokenize":
            body = json.loads(request.content)
            n = len(body["content"].split()) + 1
            return httpx.Response(200, json={"tokens": list(range(n))})
        if path in ("/v1/chat/completions", "/v1/completions"):
            return await self._generate(request)
        return httpx.Response(404, text="Not Found")

    async def _generate(self, request: httpx.Request) -> httpx.Response:
        body = json.loads(request.content)
        self.generations.append(body)
        if self.mode == "drop":
            raise httpx.ReadError("connection reset by peer", request=request)
        if self.prepare is not None:
            await self.prepare.wait()
        if self.mode == "timeout":
            # The task took a slot and ran past the gateway's read timeout; here it has
            # ended by the time /slots is read.
            self._leave(await self._enter(body), True)
            raise httpx.ReadTimeout("timed out", request=request)
        if self.mode == "overflow":
            return _error(500, "Context size has been exceeded.", "server_error")
        if self.mode == "loading":
            return _error(503, "Loading model", "unavailable_error")
        if self.mode == "boom":
            return _error(500, "something else broke", "server_error")
        if self.mode == "bad_request":
            return httpx.Response(400, json={"error": {
                "code": 400, "message": "request (9000 tokens) exceeds the available context "
                "size (2048 tokens), try increasing it", "type": "exceed_context_size_error",
                "n_prompt_tokens": 9000, "n_ctx": 2048}})
        n = min(self.tokens, int(body.get("max_tokens") or self.tokens))
        prompt = count_words(body)
        if body.get("stream"):
            return httpx.Response(
                200, headers={"content-type": "text/event-stream"},
                stream=_Stream(self, body, n, prompt),
            )
        slot = await self._enter(body)
        finished = False
        try:
            await self._wait()
            for _ in range(n):
                await asyncio.sleep(self.token_delay)
            finished = True
        finally:
            self._leave(slot, finished)
        return httpx.Response(200, json={
            "object": "chat.completion",
            "choices": [{"index": 0, "finish_reason": "length",
                         "message": {"role": "assistant", "content": "tok " * n}}],
            "usage": {"prompt_tokens": prompt, "completion_tokens": n,
                      "total_tokens": prompt + n},
        })

    async def _enter(self, body: dict[str, Any]) -> int:
        """Take the slot named by ``id_slot`` (else the first idle one), as llama-server
        does, and record the task's seed and n_predict for ``/slots``."""
        self.active += 1
        self.peak = max(self.peak, self.active)
        slot = body.get("id_slot")
        if not isinstance(slot, int) or slot < 0:
            idle = [i for i in range(self.slots)
                    if not self.slot_state.get(i, {}).get("processing")]
            slot = idle[0] if idle else 0
        self.slot_state[slot] = {"processing": True, "seed": body.get("seed", 0xFFFFFFFF),
                                 "n_predict": body.get("max_tokens", -1),
                                 "n_discard": body.get("n_discard", 0)}
        return slot

    def _leave(self, slot: int, finished: bool) -> None:
        self.active -= 1

        def free() -> None:
            self.slot_state[slot]["processing"] = False

        if finished or self.linger is None:
            free()
            return
        linger = self.linger

        async def later() -> None:
            await linger.wait()
            free()

        self.lingering.add(asyncio.ensure_future(later()))

    async def _wait(self) -> None:
        if self.hold is not None:
            await self.hold.wait()


class _Stream(httpx.AsyncByteStream):
    def __init__(self, fake: FakeLlamaServer, body: dict[str, Any], n: int, prompt: int) -> None:
        self.fake, self.body, self.n, self.prompt = fake, body, n, prompt

    async def __aiter__(self) -> AsyncIterator[bytes]:
        fake = self.fake
        slot = await fake._enter(self.body)
        finished = False
        try:
            await fake._wait()
            yield _chunk({"choices": [{"index": 0, "delta": {"role": "assistant"}}]})
            for i in range(self.n):
                await asyncio.sleep(fake.token_delay)
                if i == 2 and fake.mode == "midstream":
                    raise httpx.ReadError("connection reset")
                if i == 2 and fake.mode == "midstream_overflow":
                    yield _chunk({"error": {"code": 500, "type": "server_error",
                                            "message": "Context size has been exceeded."}})
                    return
                yield _chunk({"choices": [{"index": 0, "delta": {"content": f"t{i} "}}]})
            if fake.mode == "truncated":
                return
            yield _chunk({"choices": [{"index": 0, "delta": {}, "finish_reason": "length"}]})
            if (self.body.get("stream_options") or {}).get("include_usage"):
                yield _chunk({"choices": [], "usage": {
                    "prompt_tokens": self.prompt, "completion_tokens": self.n,
                    "total_tokens": self.prompt + self.n}})
            yield b"data: [DONE]\n\n"
            finished = True
            if fake.after_done is not None:  # the connection stays open after [DONE]
                await fake.after_done.wait()
        finally:
            fake._leave(slot, finished)

    async def aclose(self) -> None:
        self.fake.closed_streams += 1


def _chunk(obj: dict[str, Any]) -> bytes:
    return b"data: " + json.dumps(obj).encode() + b"\n\n"


def _error(status: int, message: str, kind: str) -> httpx.Response:
    return httpx.Response(status, json={"error": {"code": status, "message": message, "type": kind}})
