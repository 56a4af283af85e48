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
  ``ShowHandler``/``GetModelInfo``: ``POST /api/show`` with ``parameters`` as one
  ``fmt.Sprintf("%-30s %#v")`` line per Modelfile parameter (a list, one line per
  value), ``model_info`` with ``<arch>.context_length``, ``capabilities``; 404
  ``model 'x' not found``;
* ``server/sched.go``: 503 ``server busy, please try again.  maximum pending requests
  exceeded`` (two spaces); the context a model loads with (the Modelfile's ``num_ctx``,
  else the server's default; at least 4, 2048 with ``vision``, at most the trained
  context); a loaded model unloaded ``keep_alive`` after its last request (5 minutes by
  default, ``envconfig/config.go``; a request's ``keep_alive``: seconds or a Go duration,
  0 unloads at once, negative never, ``api/types.go`` ``Duration``), after which
  ``/api/ps`` lists nothing;
* ``server/prompt.go``: a chat that does not fit ``num_ctx`` loses its oldest non-system
  messages silently unless ``truncate`` is false; ``llm/llama_server.go``: a prompt still
  too long is refused with 400 ``the input length exceeds the context length``;
* ``openai/openai.go``: ``/v1/chat/completions`` (``max_tokens`` → ``num_predict``,
  ``usage.prompt_tokens`` = ``prompt_eval_count``, errors ``{"error": {"message",
  "type", "param", "code"}}``; each ``image_url`` part becomes a message with one image,
  ``FromChatRequest``; an http(s) URL, a data URL of another type than jpeg, jpg, png or
  webp, bad base64, or a part of another type, ``input_audio`` included, is refused by
  ``middleware/openai.go`` with 400 before the model is looked up).

The recorded payloads (``/api/ps``, the error bodies) are in ``tests/data/ollama/``.

Its tokenizer is its own (words and punctuation, plus 4 tokens of template per message,
``image_tokens`` per image), so the gateway's estimate really is an estimate here. Its
time is :attr:`FakeOllama.time`, seconds a test moves (no test waits on the clock).
"""

from __future__ import annotations

import asyncio
import base64
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
STOP_TOKENS = ["<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"]
_DURATION = re.compile(r"(-?\d+(?:\.\d+)?)(ns|us|ms|s|m|h)")
_UNIT_S = {"ns": 1e-9, "us": 1e-6, "ms": 1e-3, "s": 1.0, "m": 60.0, "h": 3600.0}


def tokens_of(text: str) -> int:
    """The fake's tokenizer: one token per word and per punctuation mark."""
    return len(re.findall(r"\w+|[^\w\s]", text))


def keep_alive_s(value: Any, default: float) -> float:
    """A request's ``keep_alive`` in seconds, as ``api.Duration`` reads it: a number of
    seconds or a Go duration string (``"5m"``, ``"1h30m"``); negative is for ever."""
    if value is None:
        return default
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        seconds = float(value)
    else:
        parts = _DURATION.findall(str(value))
        seconds = sum(float(n) * _UNIT_S[unit] for n, unit in parts) if parts else default
    return float("inf") if seconds < 0 else seconds


def go_value(value: Any) -> str:
    """``value`` as Go's ``%#v`` prints a Modelfile option (strings quoted)."""
    return json.dumps(value) if isinstance(value, str) else str(value).lower() \
        if isinstance(value, bool) else str(value)


_IMAGE_PREFIXES = ("data:;base64,", *(f"data:image/{t};base64,"
                                      for t in ("jpeg", "jpg", "png", "webp")))


def parts_refused(body: dict[str, Any]) -> str | None:
    """Why Ollama's ``/v1`` refuses a chat's content parts (``openai/openai.go``
    ``FromChatRequest`` and ``decodeImageURL``), or ``None``."""
    for message in body.get("messages") or []:
        content = message.get("content")
        for part in content if isinstance(content, list) else []:
            kind = part.get("type") if isinstance(part, dict) else None
            if kind == "text" and isinstance(part.get("text"), str):
                continue
            if kind != "image_url":
                return "invalid message format"
            given = part.get("image_url")
            url = given.get("url") if isinstance(given, dict) else given
            if not isinstance(url, str):
                return "invalid message format"
            if url.startswith(("http://", "https://")):
                return ("image URLs are not currently supported, please use base64 "
                        "encoded data instead")
            prefix = next((p for p in _IMAGE_PREFIXES if url.startswith(p)), None)
            if prefix is None:
                return "invalid image input"
            try:
                base64.b64decode(url[len(prefix):], validate=True)
            except ValueError:
                return "invalid image input"
    return None


@dataclass
class FakeOllama:
    """Answers like Ollama; one model, ``num_parallel`` slots of ``num_ctx`` tokens.

    :param num_ctx: the context the model runs with while loaded (``/api/ps``); set
        again from :meth:`load_num_ctx` each time the model loads.
    :param parameters: the model's Modelfile parameters (``/api/show``); ``None``: a
        ``num_ctx`` equal to :attr:`num_ctx` and the stop tokens.
    :param default_num_ctx: the server's default context (``OLLAMA_CONTEXT_LENGTH``, else
        its VRAM tier), for a model whose Modelfile sets none.
    :param context_length: the model's trained context (``model_info``).
    :param mode: "ok", "busy" (503 on generations), "boom" (500).
    :param load_delay: seconds the first generation spends loading the model; until then
        ``/api/ps`` lists nothing.
    :param keep_alive_s: seconds a model stays loaded after its last request.
    :param time: the fake's clock, seconds; a test moves it.
    """

    model: str = "llama3.2:1b"
    num_ctx: int = 4096
    num_parallel: int = 1
    parameters: dict[str, Any] | None = None
    default_num_ctx: int = 4096
    context_length: int = 131072
    capabilities: list[str] = field(default_factory=lambda: ["completion"])
    family: str = "llama"
    image_tokens: int = 768
    keep_alive_s: float = 300.0
    time: float = 0.0
    expires_at: float | None = None
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
        self._expire()
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
            return self._show(json.loads(request.content or b"{}"))
        if path in ("/api/chat", "/api/generate", "/v1/chat/completions"):
            return await self._generate(request, path)
        return httpx.Response(404, text="404 page not found")

    def _details(self) -> dict[str, Any]:
        return {"parent_model": "", "format": "gguf", "family": self.family,
                "families": [self.family], "parameter_size": "1.2B",
                "quantization_level": "Q8_0"}

    def modelfile(self) -> dict[str, Any]:
        """The model's Modelfile parameters."""
        if self.parameters is None:
            return {"num_ctx": self.num_ctx, "stop": STOP_TOKENS}
        return self.parameters

    def load_num_ctx(self) -> int:
        """The context Ollama loads the model with (``server/sched.go``)."""
        ctx = int(self.modelfile().get("num_ctx") or self.default_num_ctx)
        ctx = max(ctx, 4)
        if "vision" in self.capabilities:
            ctx = max(ctx, 2048)
        return min(ctx, self.context_length)

    def _show(self, body: dict[str, Any]) -> httpx.Response:
        name = body.get("model") or body.get("name")
        if not name:
            return httpx.Response(400, json={"error": "model is required"})
        if name not in (self.model, self.model.removesuffix(":latest")):
            return httpx.Response(404, json={"error": f"model '{name}' not found"})
        lines = [f"{key:<30} {go_value(v)}" for key, value in self.modelfile().items()
                 for v in (value if isinstance(value, list) else [value])]
        arch = self.family
        return httpx.Response(200, json={
            "modelfile": f"# Modelfile generated by \"ollama show\"\nFROM {self.model}\n",
            "parameters": "\n".join(lines), "template": "{{ .Prompt }}",
            "details": self._details(),
            "model_info": {"general.architecture": arch, "general.parameter_count": 1235814432,
                           f"{arch}.context_length": self.context_length,
                           f"{arch}.embedding_length": 2048},
            "capabilities": self.capabilities, "modified_at": CREATED})

    def _expire(self) -> None:
        """Unload the model once ``keep_alive`` has passed since its last request."""
        if (self.loaded and self.active == 0 and self.expires_at is not None
                and self.time >= self.expires_at):
            self.loaded, self.expires_at = False, None

    def _idle(self, body: dict[str, Any]) -> None:
        """The last request running ended: the model stays loaded for its keep_alive."""
        if self.active == 0 and self.loaded:
            self.expires_at = self.time + keep_alive_s(body.get("keep_alive"),
                                                       self.keep_alive_s)
            self._expire()

    def _ps_entry(self) -> dict[str, Any]:
        text = (DATA / "ps.json").read_text().replace("{model}", self.model).replace(
            "{num_ctx}", str(self.num_ctx))
        entry: dict[str, Any] = json.loads(text)["models"][0]
        return entry

    def prompt_tokens(self, body: dict[str, Any]) -> int:
        """What this Ollama counts for a body's prompt (``prompt_eval_count``)."""
        if "messages" in body:
            return sum(self._message_tokens(m) for m in body["messages"]) + 2
        return tokens_of(str(body.get("system") or "") + " " + str(body.get("prompt") or "")) \
            + len(body.get("context") or []) + 2 \
            + self.image_tokens * len(body.get("images") or [])

    def _message_tokens(self, message: dict[str, Any]) -> int:
        content = message.get("content")
        if isinstance(content, list):  # /v1 parts: one message per part (openai.go)
            return sum(4 + (tokens_of(str(p.get("text") or "")) if p.get("type") == "text"
                            else self.image_tokens) for p in content)
        return tokens_of(str(content or "")) + 4 \
            + self.image_tokens * len(message.get("images") or [])

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
        refused = parts_refused(body) if path == "/v1/chat/completions" else None
        if refused is not None:
            return self._error(400, refused, openai)
        if body.get("model") != self.model:
            msg = ERRORS["not_found"]["native"]["error"].replace("{model}",
                                                                  str(body.get("model")))
            return self._error(404, msg, openai)
        if self.mode == "busy":
            return self._error(503, BUSY, openai)
        if self.mode == "boom":
            return self._error(500, ERRORS["runner_gone"]["native"]["error"], openai)
        if not self.loaded:  # scheduleRunner loads the model before the prompt is fit
            await asyncio.sleep(self.load_delay)
            self.loaded, self.num_ctx = True, self.load_num_ctx()
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
        await self._run(n, body)
        return httpx.Response(200, json=self._final(body, n, prompt, path, whole=True))

    async def _run(self, n: int, body: dict[str, Any]) -> None:
        self.active += 1
        self.peak = max(self.peak, self.active)
        try:
            if self.hold is not None:
                await self.hold.wait()
            for _ in range(n):
                await asyncio.sleep(self.token_delay)
        finally:
            self.active -= 1
            if n:
                self._idle(body)

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
        await fake._run(0, self.body)
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
            fake._idle(self.body)

    def _chunk(self, text: str) -> bytes:
        if self.path == "/v1/chat/completions":
            return b"data: " + json.dumps({"choices": [{"index": 0, "delta": {
                "content": text}}]}).encode() + b"\n\n"
        key = {"message": {"role": "assistant", "content": text}} \
            if self.path == "/api/chat" else {"response": text}
        return json.dumps({"model": self.fake.model, "created_at": CREATED, **key,
                           "done": False}).encode() + b"\n"
