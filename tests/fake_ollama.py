"""A fake Ollama behind httpx.MockTransport. Ollama cannot run on these machines, so the
gateway's Ollama support is tested against this instead.

Shapes follow Ollama's sources (ollama/ollama, 2026-08 snapshot):

* ``api/types.go``: ``ChatRequest``/``GenerateRequest`` (``options.num_predict``,
  ``options.num_ctx``, ``truncate``, ``stream`` defaulting to true), ``ChatResponse``/
  ``GenerateResponse`` with the final ``done: true`` chunk carrying ``done_reason``,
  ``prompt_eval_count``, ``eval_count`` and durations, ``ProcessModelResponse``
  (``/api/ps``, with ``context_length``), ``StatusError`` (``{"error": "..."}``);
* ``server/routes.go``: NDJSON streaming (``application/x-ndjson``), 404
  ``model "x" not found, try pulling it first``, 499 ``request canceled``;
* ``server/sched.go``: 503 ``server busy, please try again.  maximum pending requests
  exceeded`` (two spaces);
* ``server/prompt.go``: a chat that does not fit ``num_ctx`` loses its oldest non-system
  messages silently unless ``truncate`` is false; ``llm/llama_server.go``: a prompt still
  too long is refused with 400 ``the input length exceeds the context length``;
* ``openai/openai.go``: ``/v1/chat/completions`` (``max_tokens`` → ``num_predict``,
  ``usage.prompt_tokens`` = ``prompt_eval_count``, errors ``{"error": {"message",
  "type", "param", "code"}}``).

The recorded payloads (``/api/ps``, the error bodies) are in ``tests/data/ollama/``.

Its tokenizer is its own (words and punctuation, plus 4 tokens of template per message),
so the gateway's estimate really is an estimate here.
"""

from __future__ import annotations

import asyncio
import json
import re
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

DATA = Path(__file__).parent / "data" / "ollama"  # recorded payloads
ERRORS = json.loads((DATA / "errors.json").read_text())
BUSY = ERRORS["busy"]["native"]["error"]
TOO_LONG = ERRORS["too_long"]["native"]["error"]
CREATED = "2026-11-29T12:00:00.000000Z"


def tokens_of(text: str) -> int:
    """The fake's tokenizer: one token per word and per punctuation mark."""
    return len(re.findall(r"\w+|[^\w\s]", text))


@dataclass
class FakeOllama:
    """Answers like Ollama; one model, ``num_parallel`` slots of ``num_ctx`` tokens.

    :param mode: "ok", "busy" (503 on generations), "boom" (500).
    :param load_delay: seconds the first generation spends loading the model; until then
        ``/api/ps`` lists nothing.
    """

    model: str = "llama3.2:1b"
    num_ctx: int = 4096
    num_parallel: int = 1
    mode: str = "ok"
    tokens: int = 5
    token_delay: float = 0.0
    load_delay: float = 0.0
    loaded: bool = True
    hold: asyncio.Event | None = None
    requests: list[httpx.Request] = field(default_factory=list)
    generations: list[dict[str, Any]] = field(default_factory=list)
    active: int = 0
    peak: int = 0
    version: str = "0.33.0"

    def client(self) -> httpx.AsyncClient:
        return httpx.AsyncClient(transport=httpx.MockTransport(self.handle))

    async def handle(self, request: httpx.Request) -> httpx.Response:
        self.requests.append(request)
        path = request.url.path
        if path == "/api/version":
            return httpx.Response(200, json={"version": self.version})
        if path == "/api/ps":
            models = [self._ps_entry()] if self.loaded else []
            return httpx.Response(200, json={"models": models})
        if path == "/api/tags":
            return httpx.Response(200, json={"models": [{
                "name": self.model, "model": self.model, "modified_at": CREATED,
                "size": 1_300_000_000, "digest": "abc123", "details": self._details()}]})
        if path == "/api/show":
            return httpx.Response(200, json={
                "parameters": f"num_ctx {self.num_ctx}", "template": "{{ .Prompt }}",
                "details": self._details(), "capabilities": ["completion"],
                "model_info": {"general.architecture": "llama",
                               "llama.context_length": 131072}})
        if path in ("/api/chat", "/api/generate", "/v1/chat/completions"):
            return await self._generate(request, path)
        return httpx.Response(404, text="404 page not found")

    def _details(self) -> dict[str, Any]:
        return {"format": "gguf", "family": "llama", "parameter_size": "1.2B",
                "quantization_level": "Q8_0"}

    def _ps_entry(self) -> dict[str, Any]:
        text = (DATA / "ps.json").read_text().replace("{model}", self.model).replace(
            "{num_ctx}", str(self.num_ctx))
        entry: dict[str, Any] = json.loads(text)["models"][0]
        return entry

    def prompt_tokens(self, body: dict[str, Any]) -> int:
        """What this Ollama counts for a body's prompt (``prompt_eval_count``)."""
        if "messages" in body:
            return sum(tokens_of(str(m.get("content") or "")) + 4
                       for m in body["messages"]) + 2
        return tokens_of(str(body.get("system") or "") + " " + str(body.get("prompt") or "")) \
            + len(body.get("context") or []) + 2

    def _fit(self, body: dict[str, Any]) -> tuple[dict[str, Any], httpx.Response | None]:
        """Ollama's handling of a prompt over num_ctx: drop the oldest messages silently,
        or refuse when ``truncate`` is false."""
        if self.prompt_tokens(body) < self.num_ctx:
            return body, None
        if body.get("truncate") is False:
            return body, httpx.Response(400, json={"error": TOO_LONG})
        if "messages" in body:
            messages = list(body["messages"])
            while len(messages) > 1 and self.prompt_tokens({"messages": messages}) >= \
                    self.num_ctx:
                messages.pop(0)
            return {**body, "messages": messages}, None
        words = str(body.get("prompt") or "").split()
        return {**body, "prompt": " ".join(words[-(self.num_ctx // 2):])}, None

    async def _generate(self, request: httpx.Request, path: str) -> httpx.Response:
        body = json.loads(request.content)
        self.generations.append(body)
        openai = path.startswith("/v1/")
        if body.get("model") != self.model:
            msg = ERRORS["not_found"]["native"]["error"].replace("{model}",
                                                                  str(body.get("model")))
            return self._error(404, msg, openai)
        if self.mode == "busy":
            return self._error(503, BUSY, openai)
        if self.mode == "boom":
            return self._error(500, ERRORS["runner_gone"]["native"]["error"], openai)
        body, refused = self._fit(body)
        if refused is not None:
            return refused
        if openai:
            n = min(self.tokens, int(body.get("max_tokens") or self.tokens))
        else:
            n = min(self.tokens, int((body.get("options") or {}).get("num_predict")
                                     or self.tokens))
        prompt = self.prompt_tokens(body)
        stream = body.get("stream") if openai else body.get("stream") is not False
        if stream:
            media = "text/event-stream" if openai else "application/x-ndjson"
            return httpx.Response(200, headers={"content-type": media},
                                  stream=_Stream(self, body, n, prompt, path))
        await self._run(n)
        return httpx.Response(200, json=self._final(body, n, prompt, path, whole=True))

    async def _run(self, n: int) -> None:
        self.active += 1
        self.peak = max(self.peak, self.active)
        try:
            if not self.loaded:
                await asyncio.sleep(self.load_delay)
                self.loaded = True
            if self.hold is not None:
                await self.hold.wait()
            for _ in range(n):
                await asyncio.sleep(self.token_delay)
        finally:
            self.active -= 1

    def _final(self, body: dict[str, Any], n: int, prompt: int, path: str, *,
               whole: bool) -> dict[str, Any]:
        reason = "length" if n < self.tokens else "stop"
        text = "tok " * n if whole else ""
        if path == "/v1/chat/completions":
            return {"id": "chatcmpl-1", "object": "chat.completion", "created": 0,
                    "model": self.model, "choices": [{
                        "index": 0, "message": {"role": "assistant", "content": text},
                        "finish_reason": reason}],
                    "usage": {"prompt_tokens": prompt, "completion_tokens": n,
                              "total_tokens": prompt + n}}
        final: dict[str, Any] = {
            "model": self.model, "created_at": CREATED, "done": True, "done_reason": reason,
            "total_duration": 1000, "load_duration": 10, "prompt_eval_count": prompt,
            "prompt_eval_duration": 100, "eval_count": n, "eval_duration": 800,
        }
        if path == "/api/chat":
            final["message"] = {"role": "assistant", "content": text}
        else:
            final["response"] = text
            final["context"] = list(range(prompt + n))
        return final

    @staticmethod
    def _error(status: int, message: str, openai: bool) -> httpx.Response:
        if openai:
            kind = "invalid_request_error" if status == 400 else (
                "not_found_error" if status == 404 else "api_error")
            return httpx.Response(status, json={"error": {
                "message": message, "type": kind, "param": None, "code": None}})
        return httpx.Response(status, json={"error": message})


class _Stream(httpx.AsyncByteStream):
    def __init__(self, fake: FakeOllama, body: dict[str, Any], n: int, prompt: int,
                 path: str) -> None:
        self.fake, self.body, self.n, self.prompt, self.path = fake, body, n, prompt, path

    async def __aiter__(self) -> AsyncIterator[bytes]:
        fake = self.fake
        await fake._run(0)
        fake.active += 1
        try:
            for i in range(self.n):
                await asyncio.sleep(fake.token_delay)
                yield self._chunk(f"t{i} ")
            final = fake._final(self.body, self.n, self.prompt, self.path, whole=False)
            if self.path == "/v1/chat/completions":
                yield b'data: {"choices":[{"index":0,"delta":{},"finish_reason":"length"}]}\n\n'
                if (self.body.get("stream_options") or {}).get("include_usage"):
                    yield b"data: " + json.dumps({"choices": [], "usage": final["usage"]}
                                                 ).encode() + b"\n\n"
                yield b"data: [DONE]\n\n"
            else:
                yield json.dumps(final).encode() + b"\n"
        finally:
            fake.active -= 1

    def _chunk(self, text: str) -> bytes:
        if self.path == "/v1/chat/completions":
            return b"data: " + json.dumps({"choices": [{"index": 0, "delta": {
                "content": text}}]}).encode() + b"\n\n"
        key = {"message": {"role": "assistant", "content": text}} \
            if self.path == "/api/chat" else {"response": text}
        return json.dumps({"model": self.fake.model, "created_at": CREATED, **key,
                           "done": False}).encode() + b"\n"
