"""A fake vLLM OpenAI server behind httpx.MockTransport, with a toy paged-KV scheduler.
vLLM cannot run on these machines (no GPU), so the gateway's vLLM support is tested
against this instead.

Shapes follow vLLM's sources (vllm-project/vllm); the recorded payloads are in
``tests/data/vllm/``:

* ``vllm/entrypoints/serve/tokenize/protocol.py``: ``POST /tokenize`` with ``prompt`` or
  ``messages``, answering ``{"count", "max_model_len", "tokens", "token_strs"}``;
* ``vllm/entrypoints/openai/engine/protocol.py``: ``GET /v1/models`` cards with
  ``max_model_len``; errors ``{"error": {"message", "type", "param", "code"}}``;
* ``vllm/renderers/params.py``: prompt + max_tokens over ``max_model_len`` is a 400
  (equality passes), in the wording of ``errors.json`` ``context_renderer`` (the
  ``wording`` field picks an older or newer one);
* ``vllm/entrypoints/utils.py`` ``get_max_tokens``: a missing cap is the room left on
  chat; ``completion/protocol.py``: 16 on completions;
* ``vllm/v1/engine/async_llm.py`` ``check_admission`` and ``vllm/exceptions.py``
  (vLLM PR #49445): with ``--max-num-queued-reqs`` (``max_num_queued_reqs``), a request
  is refused when the requests in flight (waiting or running) plus its ``n`` would pass
  it: 503 ``QueueOverflowError`` "The engine is currently busy …"; with
  ``--max-num-queued-tokens`` (``max_num_queued_tokens``), when the prompt tokens of the
  requests still in prefill (no output yet) are at or over it: 503
  ``MaxQueuedTokensError`` "… prefill token backlog limit …". Both are checked before the
  prompt is rendered (``_preflight``, vllm-project/vllm#58192), so a stream is refused
  with the HTTP status before it starts; the body is ``create_error_response``'s
  (``type`` "Service Unavailable", ``code`` 503, no ``Retry-After``);
* ``vllm/v1/metrics/loggers.py``: ``/metrics`` with ``vllm:num_preemptions_total``,
  ``vllm:kv_cache_usage_perc`` and ``vllm:cache_config_info`` whose labels are the
  ``CacheConfig`` fields (``block_size``, ``num_gpu_blocks``, ``kv_cache_size_tokens``);
* ``chat_completion/serving.py``: SSE chunks, a ``choices: []`` usage chunk only when
  ``stream_options`` is present (``{}`` counts), then ``data: [DONE]``;
* ``serve/instrumentator/health.py``: ``/health`` 200 or 503, empty body;
* ``api_server.py`` ``AuthenticationMiddleware``: only ``/v1`` paths need the key, and
  a refusal is 401 ``{"error": "Unauthorized"}``.

The scheduler (a toy of ``vllm/v1/core/sched/scheduler.py``): a waiting request starts
when fewer than ``max_num_seqs`` run and the blocks of its prompt are free (vLLM checks
only what the next step needs, not prompt + max_tokens); every step each running
request decodes one token and takes a new block at each block boundary; when no block
is free, the newest running request is preempted: its blocks are freed, it goes back to
the front of the queue and is recomputed later. ``preemptions`` counts them.
"""

from __future__ import annotations

import asyncio
import json
import re
from collections import deque
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

DATA = Path(__file__).parent / "data" / "vllm"
ERRORS = json.loads((DATA / "errors.json").read_text())
TEMPLATE_TOKENS = 5  # per message: role markers and separators of the fake chat template


def fill(template: str, **values: Any) -> str:
    """``template`` with each ``{key}`` replaced by its value (JSON braces untouched)."""
    for key, value in values.items():
        template = template.replace("{" + key + "}", str(value))
    return template


def tokens_of(text: str) -> int:
    """The fake's tokenizer: one token per word and per punctuation mark."""
    return len(re.findall(r"\w+|[^\w\s]", text))


def error(kind: str, status: int, **values: Any) -> httpx.Response:
    """One of the recorded error bodies, filled in."""
    return httpx.Response(status, content=fill(json.dumps(ERRORS[kind]), **values).encode(),
                          headers={"content-type": "application/json"})


@dataclass
class _Seq:
    prompt: int
    max_tokens: int
    stream: asyncio.Queue[int | None] = field(default_factory=asyncio.Queue)
    done: asyncio.Event = field(default_factory=asyncio.Event)
    generated: int = 0
    blocks: int = 0
    cancelled: bool = False


@dataclass
class FakeVllm:
    """Answers like ``vllm serve MODEL --max-model-len L --max-num-seqs S`` with a KV
    pool of ``num_gpu_blocks × block_size`` tokens.

    :param step_delay: seconds per decode step (every running request gains a token).
    :param max_num_queued_reqs: ``--max-num-queued-reqs``; ``None`` is vLLM's unbounded
        default.
    :param max_num_queued_tokens: ``--max-num-queued-tokens``; ``None``: unbounded.
    :param hold: while set to an unset event, the engine takes no step (requests wait
        or run, unfinished, until it is set).
    :param wording: which context-length message to send: ``renderer``, ``legacy`` or
        ``newer``.
    :param show_pool_tokens: export ``kv_cache_size_tokens`` (newer vLLM) or only
        ``num_gpu_blocks`` (older).
    :param blocks_used_elsewhere: blocks taken by traffic that bypasses the gateway.
    """

    model: str = "Qwen/Qwen2.5-1.5B-Instruct"
    max_model_len: int = 8192
    max_num_seqs: int = 16
    block_size: int = 16
    num_gpu_blocks: int = 1250
    step_delay: float = 0.0
    max_num_queued_reqs: int | None = None
    max_num_queued_tokens: int | None = None
    hold: asyncio.Event | None = None
    refused: list[str] = field(default_factory=list)  # the queue limit of each 503
    wording: str = "renderer"
    show_pool_tokens: bool = True
    api_key: str | None = None
    healthy: bool = True
    blocks_used_elsewhere: int = 0  # KV held by work the gateway cannot see (not reported)
    metrics_status: int = 200  # answer /metrics with this status (500: a failing scrape)
    fail_after: int | None = None  # stream this many tokens, then an error event
    requests: list[httpx.Request] = field(default_factory=list)
    generations: list[dict[str, Any]] = field(default_factory=list)
    preemptions: int = 0
    peak_running: int = 0
    prompt_total: int = 0
    generation_total: int = 0
    _waiting: deque[_Seq] = field(default_factory=deque)
    _running: list[_Seq] = field(default_factory=list)
    _engine: asyncio.Task[None] | None = None

    def client(self) -> httpx.AsyncClient:
        return httpx.AsyncClient(transport=httpx.MockTransport(self.handle))

    @property
    def free_blocks(self) -> int:
        return (self.num_gpu_blocks - self.blocks_used_elsewhere
                - sum(s.blocks for s in self._running))

    # -- HTTP ------------------------------------------------------------------------

    async def handle(self, request: httpx.Request) -> httpx.Response:
        self.requests.append(request)
        path = request.url.path
        if self.api_key and path.startswith("/v1") and request.headers.get(
                "authorization") != f"Bearer {self.api_key}":
            return error("unauthorized", 401)
        if path == "/health":
            return httpx.Response(200 if self.healthy else 503)
        if path == "/v1/models":
            return httpx.Response(200, content=fill(
                (DATA / "models.json").read_text(), model=self.model,
                max_model_len=self.max_model_len).encode(),
                headers={"content-type": "application/json"})
        if path == "/metrics":
            if self.metrics_status != 200:
                return httpx.Response(self.metrics_status, text="Internal Server Error")
            return httpx.Response(200, text=self.metrics_text(),
                                  headers={"content-type": "text/plain; version=0.0.4"})
        if path == "/tokenize":
            return self._tokenize(json.loads(request.content))
        if path in ("/v1/chat/completions", "/v1/completions"):
            return await self._generate(path, json.loads(request.content))
        return httpx.Response(404, json={"detail": "Not Found"})

    def metrics_text(self) -> str:
        pool = self.num_gpu_blocks * self.block_size
        text = fill(
            (DATA / "metrics.txt").read_text(), running=len(self._running),
            waiting=len(self._waiting), preemptions=self.preemptions,
            usage=1 - self.free_blocks / self.num_gpu_blocks, prompt_total=self.prompt_total,
            generation_total=self.generation_total, block_size=self.block_size,
            num_gpu_blocks=self.num_gpu_blocks, kv_cache_size_tokens=pool,
            max_concurrency=round(pool / self.max_model_len, 2))
        if not self.show_pool_tokens:
            text = re.sub(r'kv_cache_size_tokens="\d+",', "", text)
        return text

    def prompt_tokens(self, body: dict[str, Any]) -> int:
        """What this vLLM counts for a body's prompt (chat template applied; documents,
        top level or in ``chat_template_kwargs``, rendered by the template)."""
        if "messages" in body:
            documents = body.get("documents") or (body.get("chat_template_kwargs") or {}
                                                  ).get("documents") or []
            total = sum(tokens_of(json.dumps(d)) for d in documents)
            for m in body["messages"]:
                content = m.get("content")
                if isinstance(content, list):
                    content = " ".join(str(p.get("text", "")) for p in content
                                       if isinstance(p, dict))
                total += tokens_of(str(content or "")) + TEMPLATE_TOKENS
            return total + (2 if body.get("add_generation_prompt", True) else 0)
        prompt = body.get("prompt")
        if isinstance(prompt, list):
            return len(prompt)
        return tokens_of(str(prompt or "")) + 1  # BOS

    def _tokenize(self, body: dict[str, Any]) -> httpx.Response:
        if "messages" not in body and "prompt" not in body:
            return httpx.Response(400, json={"error": {
                "message": "1 validation error:\n  {'type': 'missing', 'loc': ('body', "
                "'prompt'), 'msg': 'Field required'}", "type": "Bad Request",
                "param": "body.prompt", "code": 400}})
        if body.get("model") not in (None, self.model):
            return error("not_found", 404, model=body.get("model"))
        n = self.prompt_tokens(body)
        return httpx.Response(200, json={"count": n, "max_model_len": self.max_model_len,
                                         "tokens": list(range(n)), "token_strs": None})

    async def _generate(self, path: str, body: dict[str, Any]) -> httpx.Response:
        self.generations.append(body)
        if body.get("model") != self.model:
            return error("not_found", 404, model=body.get("model"))
        full = self._admission(int(body.get("n") or 1))
        if full is not None:
            self.refused.append(full)
            return error(full, 503)
        chat = path == "/v1/chat/completions"
        n = self.prompt_tokens(body)
        asked = body.get("max_completion_tokens") if chat else None
        asked = asked if asked is not None else body.get("max_tokens")
        room = self.max_model_len - n
        if asked is not None and n + int(asked) > self.max_model_len:
            kind = f"context_{self.wording}"
            return error(kind, 400, n=n, m=asked, l=self.max_model_len, room=room,
                         total=n + int(asked))
        if asked is None:
            asked = room if chat else 16
        if asked < 1:
            return httpx.Response(400, json={"error": {
                "message": f"max_tokens must be at least 1, got {asked}.",
                "type": "BadRequestError", "param": "max_tokens", "code": 400}})
        if int(body.get("min_tokens") or 0) > asked:  # vllm/sampling_params.py
            return httpx.Response(400, json={"error": {
                "message": f"min_tokens must be less than or equal to max_tokens={asked}, "
                           f"got {body['min_tokens']}.", "type": "BadRequestError",
                "param": "min_tokens", "code": 400}})
        seq = _Seq(n, int(asked))
        self._submit(seq)
        if body.get("stream"):
            return httpx.Response(200, headers={"content-type": "text/event-stream"},
                                  stream=_Stream(self, seq, body, chat))
        try:
            await seq.done.wait()
        except asyncio.CancelledError:
            seq.cancelled = True  # vLLM aborts a request whose client left
            raise
        return httpx.Response(200, json=self._whole(seq, chat))

    def _admission(self, n: int) -> str | None:
        """``AsyncLLM.check_admission``: the recorded error of the limit a new request
        of ``n`` sequences would pass, or ``None``."""
        unfinished = len(self._waiting) + len(self._running)
        if self.max_num_queued_reqs is not None and unfinished + n > self.max_num_queued_reqs:
            return "queue_full"
        prefilling = sum(s.prompt for s in (*self._waiting, *self._running)
                         if s.generated == 0)
        if self.max_num_queued_tokens is not None and prefilling >= self.max_num_queued_tokens:
            return "prefill_backlog"
        return None

    def _whole(self, seq: _Seq, chat: bool) -> dict[str, Any]:
        reason = "length"
        usage = {"prompt_tokens": seq.prompt, "total_tokens": seq.prompt + seq.generated,
                 "completion_tokens": seq.generated, "prompt_tokens_details": None}
        text = "tok " * seq.generated
        if chat:
            choice = {"index": 0, "message": {"role": "assistant", "content": text,
                                              "refusal": None, "tool_calls": []},
                      "logprobs": None, "finish_reason": reason, "stop_reason": None}
            return {"id": "chatcmpl-1", "object": "chat.completion", "created": 1764417600,
                    "model": self.model, "choices": [choice], "usage": usage}
        return {"id": "cmpl-1", "object": "text_completion", "created": 1764417600,
                "model": self.model, "choices": [{"index": 0, "text": text, "logprobs": None,
                                                  "finish_reason": reason,
                                                  "stop_reason": None}],
                "usage": usage}

    # -- the toy scheduler -----------------------------------------------------------

    def _submit(self, seq: _Seq) -> None:
        self._waiting.append(seq)
        if self._engine is None or self._engine.done():
            self._engine = asyncio.ensure_future(self._run())

    def _blocks(self, tokens: int) -> int:
        return -(-tokens // self.block_size)

    async def _run(self) -> None:
        while self._waiting or self._running:
            if self.hold is not None:
                await self.hold.wait()
            self._running = [s for s in self._running if not s.cancelled]
            self._waiting = deque(s for s in self._waiting if not s.cancelled)
            while self._waiting and len(self._running) < self.max_num_seqs:
                head = self._waiting[0]
                need = self._blocks(head.prompt + head.generated + 1)
                if need > self.free_blocks:
                    break
                self._waiting.popleft()
                head.blocks = need
                self.prompt_total += head.prompt + head.generated  # (re)computed prefill
                self._running.append(head)
            self.peak_running = max(self.peak_running, len(self._running))
            for seq in list(self._running):
                if seq not in self._running:
                    continue  # preempted during this step
                if self._blocks(seq.prompt + seq.generated + 1) > seq.blocks:
                    while self.free_blocks < 1 and seq in self._running:
                        victim = self._running.pop()  # the newest running request
                        victim.blocks = 0
                        self._waiting.appendleft(victim)
                        self.preemptions += 1
                    if seq not in self._running:
                        continue
                    seq.blocks += 1
                seq.generated += 1
                self.generation_total += 1
                seq.stream.put_nowait(seq.generated)
                if seq.generated >= seq.max_tokens:
                    self._running.remove(seq)
                    seq.blocks = 0
                    seq.stream.put_nowait(None)
                    seq.done.set()
            await asyncio.sleep(self.step_delay)


class _Stream(httpx.AsyncByteStream):
    """SSE of one request, chunk per token (``chat_completion/serving.py``)."""

    def __init__(self, fake: FakeVllm, seq: _Seq, body: dict[str, Any], chat: bool) -> None:
        self.fake, self.seq, self.body, self.chat = fake, seq, body, chat

    def _event(self, data: dict[str, Any]) -> bytes:
        return b"data: " + json.dumps(data).encode() + b"\n\n"

    def _chunk(self, choice: dict[str, Any]) -> bytes:
        kind = "chat.completion.chunk" if self.chat else "text_completion"
        return self._event({"id": "chatcmpl-1" if self.chat else "cmpl-1", "object": kind,
                            "created": 1764417600, "model": self.fake.model,
                            "choices": [{"index": 0, **choice}]})

    async def __aiter__(self) -> AsyncIterator[bytes]:
        seq = self.seq
        try:
            if self.chat:
                yield self._chunk({"delta": {"role": "assistant", "content": ""},
                                   "logprobs": None, "finish_reason": None})
            while (got := await seq.stream.get()) is not None:
                if self.fake.fail_after is not None and got > self.fake.fail_after:
                    seq.cancelled = True  # serving.py: the error event, then [DONE]
                    yield self._event(ERRORS["engine_dead"])
                    yield b"data: [DONE]\n\n"
                    return
                piece = f"t{got - 1} "
                yield self._chunk({"delta": {"content": piece}, "logprobs": None,
                                   "finish_reason": None} if self.chat else
                                  {"text": piece, "logprobs": None, "finish_reason": None})
            end = {"delta": {"content": ""}} if self.chat else {"text": ""}
            yield self._chunk({**end, "logprobs": None, "finish_reason": "length",
                               "stop_reason": None})
            if "stream_options" in self.body:  # {} already means include_usage
                if (self.body["stream_options"] or {}).get("include_usage", True):
                    yield self._event({
                        "id": "chatcmpl-1", "object": "chat.completion.chunk",
                        "created": 1764417600, "model": self.fake.model, "choices": [],
                        "usage": {"prompt_tokens": seq.prompt,
                                  "completion_tokens": seq.generated,
                                  "total_tokens": seq.prompt + seq.generated}})
            yield b"data: [DONE]\n\n"
        finally:
            if not seq.done.is_set():
                seq.cancelled = True  # the client left: vLLM aborts and frees the blocks
