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

from gateway.clock import Clock


class ManualClock(Clock):
    """A clock that only moves when told to; ``sleep`` wakes once ``advance`` passes it
    (and so does a :meth:`~gateway.clock.Clock.wait` whose deadline it passes)."""

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
    count_hold: asyncio.Event | None = None  # when set, counting waits for it
    input_tokens_route: bool = True
    slots_route: bool = True
    #: Paths this build lacks: answered 404 (cpp-httplib's default), as on older builds.
    missing_routes: set[str] = field(default_factory=set)
    #: Answer POST /v1/responses/input_tokens (b10240 and later); off, it is a 404.
    responses_count_route: bool = False
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
    props_extra: dict[str, Any] = field(default_factory=dict)  # more /props fields
    requests: list[httpx.Request] = field(default_factory=list)
    generations: list[dict[str, Any]] = field(default_factory=list)
    active: int = 0
    peak: int = 0
    closed_streams: int = 0
    lingering: set[asyncio.Task[None]] = field(default_factory=set)
    # A unified KV pool of this many cells shared by the streams in flight (prompt +
    # tokens generated so far each). When a token would take the sum over it, every
    # stream in flight gets the error event "Context size has been exceeded.", as
    # llama-server does (shared/design/backends.md §1.3). Streams only.
    pool: int | None = None
    cells: dict[int, int] = field(default_factory=dict)
    failed: set[int] = field(default_factory=set)
    overflows: int = 0
    peak_cells: int = 0
    # As llama-server's task queue: at most ``slots`` generations run, the rest wait.
    queue_slots: bool = False
    prefill_s_per_token: float = 0.0  # prefill time per prompt token, seconds
    # A synthetic decode cost (not measured on llama-server): each token of a stream also
    # waits this many seconds per generation in flight, so the ITL grows with the batch
    # as a decode step's cost does.
    itl_per_stream: float = 0.0
    # When set, whole answers and the native /completion carry llama-server's
    # ``timings`` with this decode pace (seconds per token) and /completion answers.
    pace_s: float | None = None
    _free_slots: asyncio.Semaphore | None = None

    def transport(self) -> httpx.MockTransport:
        return httpx.MockTransport(self.handle)

    def client(self) -> httpx.AsyncClient:
        return httpx.AsyncClient(transport=self.transport())

    async def handle(self, request: httpx.Request) -> httpx.Response:
        self.requests.append(request)
        path = request.url.path
        if path in self.missing_routes:
            return httpx.Response(404, text="Not Found")
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
                **self.props_extra,
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
            if self.count_hold is not None:
                await self.count_hold.wait()
            n = count_words(json.loads(request.content))
            return httpx.Response(200, json={"object": "response.input_tokens", "input_tokens": n})
        if path == "/v1/responses/input_tokens" and self.responses_count_route:
            return httpx.Response(200, json={"object": "response.input_tokens",
                                             "input_tokens": 3})
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
        if path == "/completion" and self.pace_s is not None:  # the native route
            body = json.loads(request.content)
            n = int(body.get("n_predict") or self.tokens)
            self.generations.append(body)
            return httpx.Response(200, json={"content": "tok " * n, "tokens_predicted": n,
                                             "timings": self._timings(n)})
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
            wanted = answer_length(body)
            if wanted is not None:  # the prompt asks for an answer of this many tokens
                n = min(wanted - already_said(body), int(body.get("max_tokens") or wanted))
            return httpx.Response(
                200, headers={"content-type": "text/event-stream"},
                stream=_Stream(self, body, n, prompt, stop=wanted is not None),
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
        timings = {} if self.pace_s is None else {"timings": self._timings(n)}
        return httpx.Response(200, json={
            "object": "chat.completion",
            "choices": [{"index": 0, "finish_reason": "length",
                         "message": {"role": "assistant", "content": "tok " * n}}],
            "usage": {"prompt_tokens": prompt, "completion_tokens": n,
                      "total_tokens": prompt + n}, **timings,
        })

    def _timings(self, n: int) -> dict[str, float]:
        """llama-server's ``timings`` of an answer of ``n`` tokens at :attr:`pace_s`
        (tools/server/server-task.cpp ``result_timings``: milliseconds)."""
        per_ms = (self.pace_s or 0.0) * 1000
        return {"prompt_n": 1, "prompt_ms": 1.0, "predicted_n": n,
                "predicted_ms": per_ms * n, "predicted_per_token_ms": per_ms}

    async def _enter(self, body: dict[str, Any]) -> int:
        """Take the slot named by ``id_slot`` (else the first idle one), as llama-server
        does, and record the task's seed and n_predict for ``/slots``."""
        if self.queue_slots:
            if self._free_slots is None:
                self._free_slots = asyncio.Semaphore(self.slots)
            await self._free_slots.acquire()
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
        if self._free_slots is not None:
            self._free_slots.release()

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


def answer_length(body: dict[str, Any]) -> int | None:
    """The answer length a test asked for with ``answer=N`` in the prompt, or ``None``."""
    text = body.get("prompt") if "prompt" in body else " ".join(
        str(m.get("content") or "") for m in body.get("messages", []) if m.get("role") == "user")
    for word in str(text or "").split():
        if word.startswith("answer=") and word[7:].isdigit():
            return int(word[7:])
    return None


def already_said(body: dict[str, Any]) -> int:
    """Tokens of the answer already given: the ``tN`` words of a final assistant message
    (a prefill) or at the end of a completion prompt."""
    if "messages" in body:
        last = body["messages"][-1] if body["messages"] else {}
        text = str(last.get("content") or "") if last.get("role") == "assistant" else ""
    else:
        text = str(body.get("prompt") or "")
    return sum(1 for w in text.split() if w[:1] == "t" and w[1:].isdigit())


class _Stream(httpx.AsyncByteStream):
    def __init__(self, fake: FakeLlamaServer, body: dict[str, Any], n: int, prompt: int,
                 stop: bool = False) -> None:
        self.fake, self.body, self.n, self.prompt, self.stop = fake, body, n, prompt, stop
        wanted = answer_length(body)
        self.wanted_left = 0 if wanted is None else wanted - already_said(body)
        self.slot: int | None = None
        self.left = False

    def _release(self, finished: bool) -> None:
        if self.left:
            return
        self.left = True
        self.fake.cells.pop(id(self), None)
        if self.slot is not None:
            self.fake._leave(self.slot, finished)

    def _overflowed(self) -> bool:
        """Take one more cell of the pool; True when this stream must fail."""
        fake, key = self.fake, id(self)
        if fake.pool is None:
            return False
        if key in fake.failed:
            return True
        fake.cells[key] = fake.cells.get(key, self.prompt) + 1
        fake.peak_cells = max(fake.peak_cells, sum(fake.cells.values()))
        if sum(fake.cells.values()) > fake.pool:
            fake.overflows += 1
            fake.failed |= set(fake.cells)
            for other in [k for k in fake.cells if k < 0]:  # a client outside the gateway
                del fake.cells[other]  # fails too, and frees its cells
            return True
        return False

    async def __aiter__(self) -> AsyncIterator[bytes]:
        fake = self.fake
        self.slot = await fake._enter(self.body)
        finished = False
        # llama-server continues a final assistant message (prefill), and repeats it at
        # the start of the first content delta (measured on the build in use).
        messages = self.body.get("messages") or [{}]
        prefill = str(messages[-1].get("content") or "") if messages[-1].get(
            "role") == "assistant" else ""
        first = already_said(self.body)
        try:
            await fake._wait()
            if fake.pool is not None:
                fake.cells[id(self)] = self.prompt
            if fake.prefill_s_per_token:
                await asyncio.sleep(fake.prefill_s_per_token * self.prompt)
            yield _chunk({"choices": [{"index": 0, "delta": {"role": "assistant"}}]})
            for i in range(self.n):
                await asyncio.sleep(fake.token_delay + fake.itl_per_stream * fake.active)
                if i == 2 and fake.mode == "midstream":
                    raise httpx.ReadError("connection reset")
                if (i == 2 and fake.mode == "midstream_overflow") or self._overflowed():
                    yield _chunk({"error": {"code": 500, "type": "server_error",
                                            "message": "Context size has been exceeded."}})
                    return
                # A test's answer=N tokens are " tK", numbered through continuations.
                text = f" t{first + i}" if self.stop or first else f"t{i} "
                if i == 0 and prefill:
                    text = prefill + text
                key = "text" if "prompt" in self.body else "content"
                yield _chunk({"choices": [{"index": 0, "delta": {key: text}}]} if key ==
                             "content" else {"choices": [{"index": 0, "text": text}]})
            if fake.mode == "truncated":
                return
            reason = "stop" if self.stop and self.n >= self.wanted_left else "length"
            yield _chunk({"choices": [{"index": 0, "delta": {}, "finish_reason": reason}]})
            if (self.body.get("stream_options") or {}).get("include_usage"):
                yield _chunk({"choices": [], "usage": {
                    "prompt_tokens": self.prompt, "completion_tokens": self.n,
                    "total_tokens": self.prompt + self.n}})
            yield b"data: [DONE]\n\n"
            finished = True
            if fake.after_done is not None:  # the connection stays open after [DONE]
                await fake.after_done.wait()
        finally:
            self._release(finished)

    async def aclose(self) -> None:
        # llama-server cancels a stream at its next write once the client has gone.
        self.fake.closed_streams += 1
        self._release(False)


def _chunk(obj: dict[str, Any]) -> bytes:
    return b"data: " + json.dumps(obj).encode() + b"\n\n"


def _error(status: int, message: str, kind: str) -> httpx.Response:
    return httpx.Response(status, json={"error": {"code": status, "message": message, "type": kind}})
