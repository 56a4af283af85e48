"""Property-based fuzzing of the request parser and validator (issue 14: edge fuzzing).

Every generation route the gateway forwards (:data:`gateway.wire.routes.FORWARDED`),
Anthropic's ``/v1/messages/count_tokens`` and Ollama's ``/api/chat`` and ``/api/generate``
get requests that are *almost* valid, through the whole app: an in-process client over
``create_app``, in front of a healthy fake upstream (:class:`Upstream`) that records every
call that reaches it. One app is built per example, so that no example depends on another;
each example also draws the admission policy (chat and completions: strict on private
slots, or predictive on a unified pool) and whether the backend can count tokens (else the
gateway estimates them).

The oracle
----------

Whether an input is valid is known without asking the gateway's code: each input is a
request drawn valid *by construction* (one strategy per route, following the request types
of the ``openai``, ``anthropic`` and ``ollama`` SDKs installed here, and llama-server's
native routes), then changed by one :class:`Mutation` labelled with what the API's rules
say of the result:

``VALID``
    The API accepts it. The gateway answers 200, in the form asked for (an SSE or NDJSON
    stream, or one JSON answer), and forwards exactly one generation to the route's
    upstream path (``count_tokens``: one count), with every field the client sent
    unchanged except the ones the gateway owns (the cap fields, which carry the client's
    cap; ``stream_options``; the slot tags ``id_slot``/``n_discard``; ``stream`` for an
    answer followed under the predictive policy; on Ollama ``options.num_predict``/
    ``num_ctx`` and ``truncate``).
``INVALID``
    The API refuses it: a required field missing or null, a known field of the wrong JSON
    type or out of range, an empty ``messages``/``prompt``/``input``, a message without a
    field its role requires (system, developer, user and tool messages need ``content``;
    an assistant message ``content`` or ``tool_calls``; a tool message ``tool_call_id``),
    a content part or block of the wrong shape; or the gateway's documented refusals
    before counting (cap fields that disagree, n × prompts over the slots, token ids
    outside the vocabulary). The gateway answers 400 itself and nothing but discovery
    reaches the upstream: no count, no generation.
``REFUSED``
    Valid in form but can never be served (a cap larger than a slot): 400
    ``context_length_exceeded``, possibly after counting, and no generation.
``EITHER``
    The API's published schema and the backend the gateway fronts disagree, and the
    gateway may leave it to the backend: a field llama-server ignores when its type is
    wrong (``response_format: "json"``, ``tool_choice: 5``, ``stop_sequences: 5``), a role
    only some chat templates know, a field the API does not have (``stream_options``
    outside OpenAI's routes), an empty string where the backend decides, a prompt long
    enough that only counting tells whether it fits. Forwarded or refused are both
    right; only properties 1 and 3 below.

Decisions of the oracle, where the APIs differ: ``model`` may be absent (llama-server
serves the model it loaded); unknown top-level fields, and unknown fields of an OpenAI
chat message, stay valid (llama-server and Ollama ignore them) and must be forwarded
unchanged; on Ollama, ``null`` is valid for any field but ``model`` (Go's
``encoding/json`` leaves the field unset), and a message ``role`` must be a string
(``api.Message``).

For every input, whatever its label:

1. no 5xx: the fake upstream is healthy, so any 5xx is a gateway bug (a fake that fails
   on a body fails the test with its own message instead);
2. the label's expectation above;
3. every error is in its API's shape: ``{"error": {"message", "type", "param", "code"}}``
   on OpenAI's and llama-server's routes, ``{"type": "error", "error": {"type",
   "message"}}`` on ``/v1/messages*``, ``{"error": "..."}`` on Ollama's ``/api/*``
   (:func:`gateway.wire.shapes.render`), as JSON, with ``x-should-retry: false`` on a 400.

Raw bytes that are almost JSON (truncated, bad UTF-8, lone surrogate escapes, duplicate
keys, huge numbers, number literals JSON lacks (NaN, Infinity), deep nesting, a BOM,
trailing data, comments and single quotes, raw control characters, bit flips, odd
Content-Types) go to chat, completions, messages and Ollama's chat with properties 1 and
3, and, for what none of the backends' JSON parsers accepts, the 400-and-nothing-forwarded
of ``INVALID`` (Go's parser, behind Ollama, accepts bad UTF-8, lone surrogates and
trailing data, so those are ``EITHER`` there).

``FUZZ_EXAMPLES=N`` sets the examples per test (150 by default). The bugs this found are
kept as plain regression tests at the end of the module.
"""

from __future__ import annotations

import asyncio
import copy
import json
import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, NamedTuple

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import note as _note
from hypothesis import strategies as st
from hypothesis.control import currently_in_test_context
from prometheus_client import CollectorRegistry

from gateway.config import load_settings
from gateway.http.app import create_app
from gateway.wire.routes import BY_PATH as BY_SPEC_PATH
from gateway.wire.routes import FORWARDED
from tests.fake_ollama import FakeOllama
from tests.fakes import FakeLlamaServer

VALID, INVALID, REFUSED, EITHER = "valid", "invalid", "refused", "either"
Draw = Callable[..., Any]
OLLAMA_MODEL = FakeOllama().model
N_VOCAB = FakeLlamaServer().n_vocab
SLOTS = FakeLlamaServer().slots
DISCOVERY = frozenset({"/props", "/slots", "/v1/models", "/health", "/api/ps",
                       "/api/version", "/api/tags", "/api/show"})
COUNTING = frozenset({"/tokenize", "/apply-template", "/v1/chat/completions/input_tokens",
                      "/v1/messages/count_tokens", "/v1/responses/input_tokens"})
CAP_ALIASES = ("max_tokens", "max_completion_tokens", "n_predict", "max_output_tokens")
ANTHROPIC_ERROR_TYPES = {"invalid_request_error", "authentication_error", "permission_error",
                         "not_found_error", "request_too_large", "rate_limit_error",
                         "api_error", "overloaded_error", "timeout_error"}
# FUZZ_EXAMPLES=5000 fuzzes longer (the default keeps the module near 30 s on 2 cores).
FUZZ = settings(max_examples=int(os.environ.get("FUZZ_EXAMPLES", "150")), deadline=None,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])


# -- the upstream ----------------------------------------------------------------------


def _tokens(content: Any) -> int:
    """The fake tokenizer: a token per whitespace word and per id, plus BOS."""
    if isinstance(content, str):
        return len(content.split()) + 1
    if isinstance(content, list):
        return 1 + sum(1 if isinstance(t, int) else len(str(t).split()) for t in content)
    return 1


def _sse(events: list[tuple[str | None, dict[str, Any]]]) -> bytes:
    out = b""
    for name, data in events:
        out += (f"event: {name}\n".encode() if name else b"") + b"data: " + json.dumps(
            data).encode() + b"\n\n"
    return out


_RESPONSE = {"id": "resp_1", "object": "response", "status": "completed", "output": [
    {"type": "message", "role": "assistant",
     "content": [{"type": "output_text", "text": "ok"}]}],
    "usage": {"input_tokens": 3, "output_tokens": 1, "total_tokens": 4}}
_MESSAGE = {"id": "msg_1", "type": "message", "role": "assistant", "model": "m",
            "content": [{"type": "text", "text": "ok"}], "stop_reason": "end_turn",
            "usage": {"input_tokens": 3, "output_tokens": 1}}
_NATIVE = {"content": "ok", "stop": True, "tokens_predicted": 1, "tokens_evaluated": 3}
# Whole answers and streams of the routes FakeLlamaServer does not generate on.
_WHOLE = {
    "/v1/responses": _RESPONSE, "/v1/messages": _MESSAGE,
    "/v1/embeddings": {"object": "list", "model": "m", "data": [
        {"object": "embedding", "index": 0, "embedding": [0.0, 0.5]}],
        "usage": {"prompt_tokens": 3, "total_tokens": 3}},
    # llama-server's native /embedding answers a list, with no usage (server-context.cpp)
    "/embedding": [{"index": 0, "embedding": [[0.0, 0.5]]}],
    "/v1/rerank": {"object": "list", "model": "m", "results": [
        {"index": 0, "relevance_score": 0.5}], "usage": {"prompt_tokens": 3,
                                                          "total_tokens": 3}},
}
_STREAMS = {
    "/v1/responses": _sse([
        ("response.created", {"type": "response.created",
                              "response": {"id": "resp_1", "status": "in_progress"}}),
        ("response.output_text.delta", {"type": "response.output_text.delta",
                                        "delta": "ok"}),
        ("response.completed", {"type": "response.completed", "response": _RESPONSE})]),
    "/v1/messages": _sse([
        ("message_start", {"type": "message_start", "message": {
            **_MESSAGE, "content": [], "usage": {"input_tokens": 3, "output_tokens": 0}}}),
        ("content_block_start", {"type": "content_block_start", "index": 0,
                                 "content_block": {"type": "text", "text": ""}}),
        ("content_block_delta", {"type": "content_block_delta", "index": 0,
                                 "delta": {"type": "text_delta", "text": "ok"}}),
        ("content_block_stop", {"type": "content_block_stop", "index": 0}),
        ("message_delta", {"type": "message_delta", "delta": {"stop_reason": "end_turn"},
                           "usage": {"output_tokens": 1}}),
        ("message_stop", {"type": "message_stop"})]),
}


def _native_tasks(body: Any) -> int:
    """Tasks of a native ``/completion`` or ``/infill`` request (prompts × n): llama-server
    answers a batch with a list, and streams each task's chunks to its ``stop``."""
    if not isinstance(body, dict):
        return 1
    prompt = body.get("prompt")
    batch = len(prompt) if isinstance(prompt, list) and prompt and not any(
        isinstance(p, int) for p in prompt) else 1
    n = body.get("n_cmpl") or body.get("n") or 1
    return batch * (n if isinstance(n, int) else 1)


def _native(path: str, body: Any, stream: bool) -> httpx.Response:
    tasks = _native_tasks(body)
    if stream:
        events = [(None, {"index": i, "content": "ok", "stop": False}) for i in range(tasks)]
        events += [(None, {**_NATIVE, "index": i}) for i in range(tasks)]
        return httpx.Response(200, headers={"content-type": "text/event-stream"},
                              stream=_Chunks(_sse(events)))
    whole = [{**_NATIVE, "index": i} for i in range(tasks)]
    return httpx.Response(200, json=whole if tasks > 1 else _NATIVE)


class _Chunks(httpx.AsyncByteStream):
    """A streamed body (one chunk per SSE event), read as a network answer is."""

    def __init__(self, data: bytes) -> None:
        self.chunks = [c + b"\n\n" for c in data.split(b"\n\n") if c]

    async def __aiter__(self) -> Any:
        for chunk in self.chunks:
            yield chunk


class Upstream:
    """A healthy llama-server (or Ollama) that records every call: ``calls`` holds
    ``(path, body)`` pairs. Discovery, chat and completions are
    :class:`tests.fakes.FakeLlamaServer`'s (or :class:`tests.fake_ollama.FakeOllama`'s);
    counting and the other routes answer here, in llama-server's shapes
    (:mod:`gateway.wire.events`), for any body."""

    def __init__(self, kind: str, counts: bool = True) -> None:
        self.kind = kind
        self.counts = counts  # False: a build without the counting endpoints (404)
        self.llama = FakeLlamaServer()
        self.ollama = FakeOllama()
        self.calls: list[tuple[str, Any]] = []
        self.failures: list[str] = []

    async def handle(self, request: httpx.Request) -> httpx.Response:
        try:
            return await self._handle(request)
        except Exception as exc:  # a fake that cannot take a body is the test's bug
            self.failures.append(repr(exc))
            raise

    async def _handle(self, request: httpx.Request) -> httpx.Response:
        path = request.url.path
        try:
            body = json.loads(request.content) if request.content else None
        except ValueError:
            body = request.content
        self.calls.append((path, body))
        if self.kind == "ollama":
            if isinstance(body, dict) and "messages" in body and body["messages"] is None:
                # Ollama reads "messages": null as none; the fake needs the key gone.
                body = {k: v for k, v in body.items() if k != "messages"}
                request = httpx.Request("POST", request.url, json=body)
            return await self.ollama.handle(request)
        if path in COUNTING and not self.counts:  # the gateway estimates instead
            return httpx.Response(404, text="Not Found")
        if path == "/tokenize":
            content = body.get("content") if isinstance(body, dict) else None
            return httpx.Response(200, json={"tokens": list(range(_tokens(content)))})
        if path in ("/v1/messages/count_tokens", "/v1/responses/input_tokens"):
            return httpx.Response(200, json={"input_tokens": 3 + len(request.content) // 64})
        stream = isinstance(body, dict) and body.get("stream") is True
        if path in ("/completion", "/infill"):
            return _native(path, body, stream)
        if path in _WHOLE:
            if stream:
                return httpx.Response(200, headers={"content-type": "text/event-stream"},
                                      stream=_Chunks(_STREAMS[path]))
            return httpx.Response(200, json=_WHOLE[path])
        return await self.llama.handle(request)


@dataclass
class Outcome:
    """One answer, and the upstream calls the request made."""

    status: int
    headers: httpx.Headers
    content: bytes
    calls: list[tuple[str, Any]]
    fake_failures: list[str]

    def to(self, path: str) -> list[Any]:
        return [body for p, body in self.calls if p == path]

    @property
    def contacted(self) -> list[str]:
        """Upstream paths called besides discovery."""
        return [p for p, _ in self.calls if p not in DISCOVERY]

    @property
    def generations(self) -> list[str]:
        return [p for p in self.contacted if p not in COUNTING]


def _backend(kind: str, policy: str) -> dict[str, Any]:
    if kind == "ollama":
        return {"name": "ollama", "url": "http://ollama:11434", "kind": "ollama"}
    # Strict on private slots, or predictive on a unified pool large enough for every
    # slot: either way, a valid request without a cap (1024 by default) fits.
    layout = {"kv_unified": False} if policy == "strict" else {"pool_tokens": 4 * 2048}
    # No build survey: this upstream answers the generation routes only.
    return {"name": "local", "url": "http://upstream:8080", "survey": False, **layout}


async def _exchange(kind: str, path: str, raw: bytes, policy: str = "strict", *,
                    counts: bool = True,
                    content_type: str | None = "application/json") -> Outcome:
    upstream = Upstream(kind, counts)
    settings = load_settings(admission={"disconnect_grace_s": 0.0, "policy": policy},
                             backends=[_backend(kind, policy)])
    http = httpx.AsyncClient(transport=httpx.MockTransport(upstream.handle))
    app = create_app(settings, http_client=http, registry=CollectorRegistry(),
                     discover=False)
    for backend in app.state.gateway.fleet.backends.values():
        await backend.discover()
    before = len(upstream.calls)
    headers = {"content-type": content_type} if content_type else {}
    try:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app),
                                     base_url="http://gateway") as client:
            r = await client.post(path, content=raw, headers=headers)
    finally:
        await http.aclose()
    return Outcome(r.status_code, r.headers, r.content, upstream.calls[before:],
                   upstream.failures)


def send(kind: str, path: str, raw: bytes, policy: str = "strict", counts: bool = True
         ) -> Outcome:
    """POST ``raw`` to ``path`` of a fresh gateway over a fresh :class:`Upstream`."""
    return asyncio.run(_exchange(kind, path, raw, policy, counts=counts))


# -- the checks --------------------------------------------------------------------------


def note(text: str) -> None:
    """Shown with a failing example (the plain regression tests have no example)."""
    if currently_in_test_context():
        _note(text)


def check_error_shape(shape: str, out: Outcome) -> None:
    """Property 3: the error is in the shape of its API."""
    assert out.headers.get("content-type", "").startswith("application/json"), out.headers
    payload = json.loads(out.content)
    assert isinstance(payload, dict), payload
    if shape == "ollama":
        assert set(payload) == {"error"} and isinstance(payload["error"], str), payload
        assert payload["error"], payload
    elif shape == "anthropic":
        assert set(payload) == {"type", "error"} and payload["type"] == "error", payload
        err = payload["error"]
        assert isinstance(err, dict) and isinstance(err.get("message"), str), payload
        assert err.get("type") in ANTHROPIC_ERROR_TYPES, payload
        if out.status == 400:
            assert err["type"] == "invalid_request_error", payload
    else:
        assert set(payload) == {"error"} and isinstance(payload["error"], dict), payload
        err = payload["error"]
        assert isinstance(err.get("message"), str) and err["message"], payload
        assert isinstance(err.get("type"), str), payload
        assert err.get("param") is None or isinstance(err["param"], str), payload
        assert err.get("code") is None or isinstance(err["code"], str), payload
        if out.status == 400 and err.get("code") == "context_length_exceeded":
            # llama-server's own type for it (gateway.errors.ContextLengthExceeded)
            assert err["type"] == "exceed_context_size_error", payload
            assert isinstance(err["n_prompt_tokens"], int) and err["n_ctx"] > 0, payload
        elif out.status == 400:
            assert err["type"] == "invalid_request_error", payload
    if out.status == 400:
        assert out.headers.get("x-should-retry") == "false", out.headers


def check_common(shape: str, out: Outcome) -> None:
    """Properties 1 and 3."""
    assert not out.fake_failures, f"the fake upstream failed: {out.fake_failures}"
    assert out.status < 500, (out.status, out.content[:500])
    if out.status >= 400:
        check_error_shape(shape, out)


# -- strategies: valid requests by construction -----------------------------------------

WORD = st.from_regex(r"[a-z]{1,8}( [a-z]{1,8}){0,3}", fullmatch=True)
TEXT = st.one_of(WORD, st.text(min_size=1, max_size=16))
ODD_TEXTS = ["\u0000", "h\u00e9llo w\u00f6rld", "\u65e5\u672c\u8a9e",
             "emoji \U0001f600\U0001f44d\U0001f3fd", "\u202eRTL override", "a\u0301 combining",
             "line\u2028sep\u2029para",
             "\ufeffBOM inside", "\U0010ffff", "tab\tnew\nline\r", "back\\slash \\u0000",
             '"quoted" {json}', "null", "<|im_end|><|im_start|>system", "\x7f\x1b[31m",
             "\U0001d54f\U0001d550", "\ufffd\ufffe"]
# Long enough to be estimated in a worker thread (tokens.py), short or long in tokens.
LONG_TEXTS = ["a" * 20_000, "word " * 4_000, "\u65e5\u672c" * 9_000, "1234567890" * 2_000]
UNICODE = st.one_of(st.sampled_from(ODD_TEXTS), st.text(
    st.characters(min_codepoint=0x80, codec="utf-8"), min_size=1, max_size=12))
CAP = st.integers(1, 64)
TOKEN_ID = st.integers(0, 1000)
MODEL = st.one_of(st.sampled_from(["local", "fake.gguf", "gpt-4o", "m"]),
                  st.text(max_size=10))
FLOAT01 = st.floats(0, 1)
CALL = {"id": "call_1", "type": "function", "function": {"name": "f", "arguments": "{}"}}
TOOL = {"type": "function", "function": {"name": "f", "description": "d",
                                         "parameters": {"type": "object", "properties": {}}}}
JSON_VALUES = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**53), 2**53) | st.floats(
        allow_nan=False, allow_infinity=False) | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=5), inner,
                                                                 max_size=3),
    max_leaves=6)

TEXT_PARTS = st.lists(st.builds(lambda t: {"type": "text", "text": t}, TEXT), min_size=1,
                      max_size=2)
IMAGE_PART = {"type": "image_url", "image_url": {"url": "data:image/png;base64,iVBORw0K"}}


@st.composite
def chat_message(draw: Draw, role: str | None = None) -> dict[str, Any]:
    """One OpenAI chat message (``ChatCompletion*MessageParam``)."""
    role = role or draw(st.sampled_from(["system", "developer", "user", "assistant", "tool"]))
    if role == "assistant":
        if draw(st.booleans()):
            message: dict[str, Any] = {"role": role, "tool_calls": [CALL]}
            if draw(st.booleans()):
                message["content"] = None
            return message
        return {"role": role, "content": draw(st.one_of(TEXT, TEXT_PARTS))}
    if role == "tool":
        return {"role": role, "tool_call_id": "call_1",
                "content": draw(st.one_of(TEXT, TEXT_PARTS))}
    parts = TEXT_PARTS.map(lambda p: [*p, IMAGE_PART]) if role == "user" else TEXT_PARTS
    message = {"role": role, "content": draw(st.one_of(TEXT, TEXT_PARTS, parts))}
    if draw(st.integers(0, 4)) == 0:
        message["name"] = draw(WORD)
    return message


def _streaming(body: dict[str, Any]) -> dict[str, Any]:
    """``stream_options`` only with ``stream: true`` (OpenAI refuses it otherwise)."""
    if body.get("stream") is not True:
        body.pop("stream_options", None)
    return body


OPENAI_SAMPLING = {
    "model": MODEL, "temperature": st.floats(0, 2), "top_p": FLOAT01,
    "presence_penalty": st.floats(-2, 2), "frequency_penalty": st.floats(-2, 2),
    "stream": st.booleans(), "stream_options": st.fixed_dictionaries(
        {"include_usage": st.booleans()}),
    "stop": st.one_of(TEXT, st.lists(TEXT, max_size=4)), "seed": st.integers(-1, 2**32),
    "user": WORD,
}


def _chat_fixup(body: dict[str, Any]) -> dict[str, Any]:
    if body.get("logprobs") is not True:
        body.pop("top_logprobs", None)
    return _streaming(body)


CHAT = st.fixed_dictionaries(
    {"messages": st.lists(chat_message(), min_size=1, max_size=4)},
    optional={**OPENAI_SAMPLING, "max_tokens": CAP, "n": st.integers(1, 2),
              "logprobs": st.booleans(), "top_logprobs": st.integers(0, 20),
              "tools": st.just([TOOL]), "response_format": st.just({"type": "text"}),
              "top_k": st.integers(0, 50)},
).map(_chat_fixup)

PROMPT = st.one_of(
    TEXT, st.lists(TOKEN_ID, min_size=1, max_size=8), st.lists(TEXT, min_size=1, max_size=2),
    st.lists(st.lists(TOKEN_ID, min_size=1, max_size=4), min_size=1, max_size=2),
    st.tuples(st.lists(TOKEN_ID, min_size=1, max_size=3), st.lists(TEXT, min_size=1,
                                                                   max_size=2))
    .map(lambda t: t[0] + t[1]).flatmap(st.permutations),
)


COMPLETIONS = st.fixed_dictionaries(
    {"prompt": PROMPT},
    optional={**OPENAI_SAMPLING, "max_tokens": CAP, "n": st.integers(1, 2),
              "logprobs": st.integers(0, 5), "echo": st.booleans(), "suffix": WORD},
).map(_streaming)
NATIVE_COMPLETION = st.fixed_dictionaries(
    {"prompt": PROMPT},
    optional={"n_predict": st.one_of(CAP, st.just(-1)), "temperature": st.floats(0, 2),
              "top_k": st.integers(0, 100), "top_p": FLOAT01, "min_p": FLOAT01,
              "repeat_penalty": st.floats(0.5, 2), "stream": st.booleans(),
              "seed": st.integers(-1, 2**32 - 1), "stop": st.lists(TEXT, max_size=3),
              "n_probs": st.integers(0, 10), "cache_prompt": st.booleans(), "model": MODEL},
)
RESPONSE_ITEM = st.one_of(
    st.builds(lambda r, t: {"role": r, "content": t},
              st.sampled_from(["user", "system", "developer", "assistant"]), TEXT),
    st.builds(lambda t: {"type": "message", "role": "user",
                         "content": [{"type": "input_text", "text": t}]}, TEXT))
RESPONSES = st.fixed_dictionaries(
    {"input": st.one_of(TEXT, st.lists(RESPONSE_ITEM, min_size=1, max_size=3))},
    optional={"model": MODEL, "instructions": TEXT, "max_output_tokens": st.integers(16, 64),
              "temperature": st.floats(0, 2), "top_p": FLOAT01, "stream": st.booleans(),
              "store": st.just(False), "user": WORD},
)
ANTHROPIC_CONTENT = st.one_of(TEXT, TEXT_PARTS)


@st.composite
def anthropic_messages(draw: Draw) -> list[dict[str, Any]]:
    """Alternating user/assistant turns, from a user turn (``MessageParam``)."""
    n = draw(st.integers(1, 3))
    return [{"role": "user" if i % 2 == 0 else "assistant",
             "content": draw(ANTHROPIC_CONTENT)} for i in range(n)]


SYSTEM = st.one_of(TEXT, TEXT_PARTS)
MESSAGES = st.fixed_dictionaries(
    {"model": MODEL, "max_tokens": CAP, "messages": anthropic_messages()},
    optional={"system": SYSTEM, "temperature": FLOAT01, "top_p": FLOAT01,
              "top_k": st.integers(0, 100), "stop_sequences": st.lists(WORD, max_size=2),
              "stream": st.booleans(), "metadata": st.just({"user_id": "u1"})},
)
COUNT_TOKENS = st.fixed_dictionaries(
    {"model": MODEL, "messages": anthropic_messages()},
    optional={"system": SYSTEM, "tools": st.just([{
        "name": "f", "description": "d", "input_schema": {"type": "object"}}])},
)
EMBEDDINGS = st.fixed_dictionaries(
    {"input": st.one_of(TEXT, st.lists(TEXT, min_size=1, max_size=3),
                        st.lists(TOKEN_ID, min_size=1, max_size=8),
                        st.lists(st.lists(TOKEN_ID, min_size=1, max_size=4), min_size=1,
                                 max_size=2))},
    optional={"model": MODEL, "encoding_format": st.just("float"), "user": WORD},
)
RERANK = st.fixed_dictionaries(
    {"query": TEXT, "documents": st.lists(TEXT, min_size=1, max_size=3)},
    optional={"model": MODEL, "top_n": st.integers(0, 3)},
)
INFILL = st.fixed_dictionaries(
    {"input_prefix": st.one_of(st.just(""), TEXT), "input_suffix": st.one_of(st.just(""),
                                                                             TEXT)},
    optional={"prompt": TEXT, "input_extra": st.lists(st.fixed_dictionaries(
        {"filename": WORD, "text": TEXT}), max_size=2), "n_predict": CAP,
        "temperature": st.floats(0, 2), "top_k": st.integers(0, 50), "stream": st.booleans(),
        "seed": st.integers(-1, 2**32 - 1), "model": MODEL},
)
OLLAMA_OPTIONS = st.fixed_dictionaries({}, optional={
    "num_predict": st.integers(1, 32), "temperature": st.floats(0, 2),
    "top_k": st.integers(1, 50), "num_ctx": st.integers(2048, 4096), "seed": st.integers(0, 99),
    "stop": st.lists(WORD, max_size=2)})
OLLAMA_COMMON = {"stream": st.booleans(), "options": OLLAMA_OPTIONS,
                 "keep_alive": st.sampled_from(["5m", 0, -1]), "format": st.just("json")}
OLLAMA_CHAT = st.fixed_dictionaries(
    {"model": st.just(OLLAMA_MODEL), "messages": st.lists(st.fixed_dictionaries(
        {"role": st.sampled_from(["user", "system", "assistant"]), "content": TEXT}),
        min_size=1, max_size=3)},
    optional=OLLAMA_COMMON,
)
OLLAMA_GENERATE = st.fixed_dictionaries(
    {"model": st.just(OLLAMA_MODEL), "prompt": TEXT},
    optional={**OLLAMA_COMMON, "system": TEXT, "template": st.just("{{ .Prompt }}"),
              "suffix": WORD, "context": st.lists(TOKEN_ID, max_size=8),
              "raw": st.booleans(), "images": st.just(["aGVsbG8="])},
)


# -- mutations -------------------------------------------------------------------------


class Labelled(NamedTuple):
    """A mutated body whose label depends on what the mutation drew."""

    body: Any
    label: str


@dataclass(frozen=True)
class Mutation:
    """One change to a valid body, and the label of the result (``None`` when ``apply``
    returns a :class:`Labelled`)."""

    name: str
    apply: Callable[[dict[str, Any], Draw], Any]
    label: str | None = None

    def __repr__(self) -> str:
        return self.name

    def __call__(self, body: dict[str, Any], draw: Draw) -> tuple[Any, str]:
        mutated = self.apply(copy.deepcopy(body), draw)
        if isinstance(mutated, Labelled):
            return mutated.body, mutated.label
        assert self.label is not None
        return mutated, self.label


def _strategy(values: Any) -> st.SearchStrategy[Any]:
    return values if isinstance(values, st.SearchStrategy) else st.sampled_from(values)


def _put(key: str, values: Any) -> Callable[[dict[str, Any], Draw], None]:
    """Set ``key`` of an object (the body, or one message) to a drawn value."""
    strategy = _strategy(values)

    def change(obj: dict[str, Any], draw: Draw) -> None:
        obj[key] = draw(strategy)
    return change


def _pop(key: str) -> Callable[[dict[str, Any], Draw], None]:
    return lambda obj, draw: obj.pop(key, None)


def _on_body(change: Callable[[dict[str, Any], Draw], None]
             ) -> Callable[[dict[str, Any], Draw], Any]:
    def apply(body: dict[str, Any], draw: Draw) -> Any:
        change(body, draw)
        return body
    return apply


def setting(key: str, values: Any, label: str, what: str = "wrong value") -> Mutation:
    return Mutation(f"{key}: {what}", _on_body(_put(key, values)), label)


def dropping(key: str, label: str) -> Mutation:
    return Mutation(f"{key} dropped", _on_body(_pop(key)), label)


def nulling(key: str, label: str) -> Mutation:
    return Mutation(f"{key} = null", _on_body(_put(key, [None])), label)


def known_field(key: str, wrong: Any, *, required: bool = False, null: str | None = None,
                drop: str | None = None) -> list[Mutation]:
    """Wrong values (``INVALID``), null and absence of a known field."""
    return [setting(key, wrong, INVALID),
            nulling(key, null or (INVALID if required else VALID)),
            dropping(key, drop or (INVALID if required else VALID))]


NOT_POSITIVE_INT = ["5", -1, 0, 1.5, True, False, [5], {"n": 5}]
NOT_NUMBER = ["hot", "0.5", True, [0.5], {}]
NOT_BOOL = ["yes", "true", 1, 0, [], {}]
NOT_STRING = [7, 1.5, True, [], ["x"], {}]
NOT_OBJECT = ["x", 5, [1], True]
NOT_LIST = ["hi", 5, {}, True, {"role": "user", "content": "x"}]
NOT_TEXT_BLOCKS = [[5], ["x"], [None], [{"text": "x"}], [{"type": "text", "text": 5}],
                   [{"type": "text"}], [{"type": "text", "text": None}]]


def _unknown_field(body: dict[str, Any], draw: Draw) -> dict[str, Any]:
    body["x_" + draw(st.from_regex(r"[a-z_]{1,10}", fullmatch=True))] = draw(JSON_VALUES)
    return body


def _not_an_object(body: dict[str, Any], draw: Draw) -> Any:
    return draw(st.sampled_from([[body], [], "body", 5, None, True]))


def common(sampling: bool = True, stream_options: str = INVALID) -> list[Mutation]:
    """Mutations of every route: an unknown field (kept), a body that is no object,
    ``model`` and ``stream`` of the wrong type, and the sampling fields."""
    muts = [Mutation("unknown top-level field", _unknown_field, VALID),
            Mutation("body not an object", _not_an_object, INVALID),
            setting("model", NOT_STRING, INVALID), dropping("model", VALID),
            nulling("model", EITHER),
            setting("stream_options", NOT_OBJECT, stream_options)]
    if sampling:
        muts += [setting("stream", NOT_BOOL, INVALID), nulling("stream", VALID)]
        for key in ("temperature", "top_p"):
            muts += [setting(key, NOT_NUMBER, INVALID), nulling(key, VALID)]
        muts += [setting("top_k", ["5", 1.5, True, 2**31], INVALID),
                 setting("seed", [1.5, "1", True, 2**64], INVALID), nulling("seed", VALID)]
    return muts


def caps(*keys: str, huge: str = REFUSED) -> list[Mutation]:
    """Wrong, null and absent values of the cap fields, and a cap no slot holds."""
    muts: list[Mutation] = []
    for key in keys:
        wrong = ["5", -2, 1.5, True, [5]] if key == "n_predict" else NOT_POSITIVE_INT
        muts += [setting(key, wrong, INVALID), nulling(key, VALID), dropping(key, VALID)]
    muts.append(setting(keys[0], [10**6, 2**40], huge, "larger than a slot"))
    return muts


def _disagreeing(body: dict[str, Any], draw: Draw) -> dict[str, Any]:
    body["max_tokens"] = draw(CAP)
    body["max_completion_tokens"] = body["max_tokens"] + 1
    return body


def _rename(old: str, new: str) -> Callable[[dict[str, Any], Draw], Any]:
    def apply(body: dict[str, Any], draw: Draw) -> Any:
        if old in body:
            body[new] = body.pop(old)
        return body
    return apply


# OpenAI chat messages, one at a time.


def _role_needs_content(message: dict[str, Any]) -> str:
    """The label of a message after its content was removed or nulled (OpenAI rules)."""
    if message.get("role") == "assistant":
        return VALID if message.get("tool_calls") else INVALID
    return INVALID


def on_message(name: str, change: Callable[[dict[str, Any], Draw], None],
               label: str | Callable[[dict[str, Any]], str]) -> Mutation:
    """A change to one message of ``messages``; a callable label reads that message."""
    def apply(body: dict[str, Any], draw: Draw) -> Labelled:
        message = body["messages"][draw(st.integers(0, len(body["messages"]) - 1))]
        change(message, draw)
        return Labelled(body, label(message) if callable(label) else label)
    return Mutation(name, apply)


def _append(messages: Any) -> Callable[[dict[str, Any], Draw], Any]:
    strategy = _strategy(messages)

    def apply(body: dict[str, Any], draw: Draw) -> Any:
        body["messages"] += draw(strategy)
        return body
    return apply


def _replace_message(body: dict[str, Any], draw: Draw) -> Any:
    i = draw(st.integers(0, len(body["messages"]) - 1))
    body["messages"][i] = draw(st.sampled_from(["hi", 5, None, [], [{"role": "user"}]]))
    return body


def messages_field(empty: str = INVALID) -> list[Mutation]:
    """``messages`` is required, an array: non-empty in OpenAI's chat; Anthropic's may be
    empty, as llama-server answers it (docs/differences.md)."""
    return [*known_field("messages", NOT_LIST, required=True),
            setting("messages", [[]], empty, "empty list")]


CHAT_MESSAGE_MUTATIONS = [
    on_message("message content dropped", _pop("content"), _role_needs_content),
    on_message("message content = null", _put("content", [None]), _role_needs_content),
    on_message("message content of a wrong type",
               _put("content", [5, 1.5, True, {"type": "text", "text": "x"}]), INVALID),
    on_message("message content empty", _put("content", [""]), VALID),
    on_message("message content unicode", _put("content", UNICODE), VALID),
    on_message("message content long", _put("content", LONG_TEXTS), EITHER),
    on_message("message content as text parts", _put("content", TEXT_PARTS), VALID),
    on_message("message content parts not objects",
               _put("content", [["x"], [5], [None], [["x"]]]), INVALID),
    on_message("message content part without a type",
               _put("content", [[{"text": "x"}], [{"type": 5, "text": "x"}]]), INVALID),
    on_message("message text part without a string",
               _put("content", [[{"type": "text", "text": 5}], [{"type": "text"}],
                                [{"type": "text", "text": None}]]), INVALID),
    on_message("message role dropped", _pop("role"), INVALID),
    on_message("message role of a wrong type", _put("role", [5, None, ["user"], {}]),
               INVALID),
    on_message("message tool_calls of a wrong type", _put("tool_calls", ["x", 5, {}]),
               INVALID),
    on_message("message unknown field", _put("x_meta", JSON_VALUES), VALID),
    on_message("message name of a wrong type", _put("name", [5, []]), EITHER),
    Mutation("message not an object", _replace_message, INVALID),
    Mutation("tool message without a string tool_call_id", _append([
        [{"role": "tool", "content": "42"}],
        [{"role": "tool", "content": "42", "tool_call_id": None}],
        [{"role": "tool", "content": "42", "tool_call_id": 5}]]), INVALID),
    Mutation("tool message without content", _append([
        [{"role": "tool", "tool_call_id": "call_1"}],
        [{"role": "tool", "tool_call_id": "call_1", "content": None}]]), INVALID),
    Mutation("assistant message without content or tool_calls", _append([
        [{"role": "assistant"}], [{"role": "assistant", "content": None}],
        [{"role": "assistant", "content": None, "tool_calls": None}],
        [{"role": "assistant", "tool_calls": []}]]), INVALID),
    Mutation("assistant tool call and its answer", _append([
        [{"role": "assistant", "tool_calls": [CALL]},
         {"role": "tool", "tool_call_id": "call_1", "content": "42"}],
        [{"role": "assistant", "content": None, "tool_calls": [CALL]},
         {"role": "tool", "tool_call_id": "call_1", "content": [{"type": "text",
                                                                 "text": "42"}]}]]), VALID),
    Mutation("a message of a role the API does not define", _append(st.builds(
        lambda r, t: [{"role": r, "content": t}],
        st.sampled_from(["ipython", "function", "observation", "Robot"]), TEXT)), EITHER),
]

CHAT_MUTATIONS = [
    *common(), *messages_field(), *CHAT_MESSAGE_MUTATIONS,
    *caps("max_tokens", "max_completion_tokens", "n_predict"),
    Mutation("max_tokens and max_completion_tokens disagree", _disagreeing, INVALID),
    Mutation("cap given as max_completion_tokens", _rename("max_tokens",
                                                           "max_completion_tokens"), VALID),
    Mutation("cap given as n_predict", _rename("max_tokens", "n_predict"), VALID),
    setting("n_predict", [-1], VALID, "-1 (no limit)"),
    setting("n", ["2", 0, -1, 1.5, True], INVALID), nulling("n", VALID),
    setting("n", [SLOTS + 1, 2**40], INVALID, "more choices than slots"),
    setting("n_cmpl", ["2", 0, 1.5], INVALID),
    *[m for key in ("presence_penalty", "frequency_penalty")
      for m in (setting(key, NOT_NUMBER, INVALID), nulling(key, VALID))],
    setting("stop", [5, [1], ["a", 2], {"x": 1}, True], INVALID), nulling("stop", VALID),
    setting("logprobs", [3, "yes", 1], INVALID),
    setting("top_logprobs", [21, -1, "3", 1.5], INVALID),
    setting("n_probs", [101, -1, "5"], INVALID),
    setting("tools", ["x", 5, [5], [{"type": "function"}], {}], INVALID),
    nulling("tools", VALID),
    setting("response_format", ["json", 5], EITHER),
    setting("tool_choice", [5, ["auto"]], EITHER), setting("user", [5, {}], EITHER),
]


def _prompt_batch_over_slots(body: dict[str, Any], draw: Draw) -> dict[str, Any]:
    body["prompt"] = ["a", "b", "c"]
    body["n"] = 2
    body["max_tokens"] = 4
    body.pop("n_predict", None)
    return body


def prompt_mutations() -> list[Mutation]:
    return [
        *known_field("prompt", [5, 1.5, True, {}, {"text": "x"}], required=True),
        setting("prompt", [[], [None], ["a", None], [1.5], [True], [-1], [2**40],
                           [[1, None]], [[1.5]]], INVALID, "not text or token ids"),
        setting("prompt", [[N_VOCAB], [1, N_VOCAB + 5]], INVALID, "ids outside the vocabulary"),
        setting("prompt", ["", [""]], EITHER, "empty"),
        setting("prompt", UNICODE, VALID, "unicode"),
        setting("prompt", LONG_TEXTS, EITHER, "long"),
        setting("prompt", st.lists(UNICODE, min_size=1, max_size=2), VALID, "unicode batch"),
        Mutation("n x prompts over the slots", _prompt_batch_over_slots, INVALID),
    ]


COMPLETIONS_MUTATIONS = [
    *common(), *prompt_mutations(),
    *caps("max_tokens", "max_completion_tokens", "n_predict"),
    setting("n", ["2", 0, -1, 1.5, True], INVALID), nulling("n", VALID),
    setting("logprobs", [True, "3", 21, -1, 1.5], INVALID), nulling("logprobs", VALID),
    setting("stop", [5, [1], True], INVALID),
    setting("echo", ["yes", 5], EITHER), setting("suffix", [5, []], EITHER),
]
NATIVE_COMPLETION_MUTATIONS = [
    *common(stream_options=EITHER), *prompt_mutations(),
    *caps("n_predict", "max_tokens"), setting("n_predict", [-1], VALID, "-1 (no limit)"),
    setting("min_p", NOT_NUMBER, INVALID), setting("repeat_penalty", NOT_NUMBER, INVALID),
    setting("n_probs", [101, -1, "5", 1.5], INVALID),
    setting("mirostat", [3, -1, "1"], INVALID), setting("n_keep", ["1", 1.5, 2**40], INVALID),
    setting("id_slot", ["0", 1.5], INVALID),
    setting("stop", [5, [1], True], INVALID), setting("cache_prompt", ["yes"], EITHER),
]


def _input_item(body: dict[str, Any], draw: Draw) -> dict[str, Any]:
    body["input"] = [draw(st.sampled_from([5, None, "x", [], {"role": 5}]))]
    return body


RESPONSES_MUTATIONS = [
    *common(),
    *known_field("input", [5, 1.5, True, {}], required=True),
    setting("input", [[]], INVALID, "empty list"), setting("input", [""], EITHER, "empty"),
    setting("input", UNICODE, VALID, "unicode"),
    setting("input", LONG_TEXTS, EITHER, "long"),
    Mutation("input item of a wrong type", _input_item, EITHER),
    *caps("max_output_tokens", "max_tokens"),
    setting("instructions", [5, ["x"], {}], EITHER), nulling("instructions", VALID),
    setting("instructions", UNICODE, VALID, "unicode"),
]


def anthropic_message_mutations() -> list[Mutation]:
    return [
        on_message("message role not user or assistant",
                   _put("role", ["system", "tool", "developer", 5, None, ["user"]]), INVALID),
        on_message("message role dropped", _pop("role"), INVALID),
        on_message("message content dropped", _pop("content"), INVALID),
        on_message("message content = null", _put("content", [None]), INVALID),
        on_message("message content of a wrong type", _put("content", [5, 1.5, True, {}]),
                   INVALID),
        on_message("message content blocks malformed", _put("content", NOT_TEXT_BLOCKS),
                   INVALID),
        on_message("message content unicode", _put("content", UNICODE), VALID),
        on_message("message content long", _put("content", LONG_TEXTS), EITHER),
        on_message("message content as text blocks", _put("content", TEXT_PARTS), VALID),
        on_message("message unknown field", _put("x_meta", JSON_VALUES), EITHER),
        Mutation("message not an object", _replace_message, INVALID),
        setting("system", [5, {}, True], INVALID),
        setting("system", NOT_TEXT_BLOCKS, INVALID, "malformed text blocks"),
        nulling("system", EITHER), setting("system", UNICODE, VALID, "unicode"),
        setting("system", TEXT_PARTS, VALID, "text blocks"),
    ]


MESSAGES_MUTATIONS = [
    *common(stream_options=EITHER), *messages_field(VALID), *anthropic_message_mutations(),
    *known_field("max_tokens", NOT_POSITIVE_INT, required=True),
    setting("max_tokens", [10**6, 2**40], REFUSED, "larger than a slot"),
    setting("top_k", ["5", 1.5, True], INVALID),
    setting("stop_sequences", [5, "x", [1]], EITHER),
    setting("tools", ["x", 5], EITHER),
]
COUNT_TOKENS_MUTATIONS = [
    *common(sampling=False, stream_options=EITHER), *messages_field(VALID),
    *anthropic_message_mutations(),
    setting("tools", ["x", 5, [5]], EITHER),
]


def _rename_input(body: dict[str, Any], draw: Draw) -> dict[str, Any]:
    body["content"] = body.pop("input")
    return body


EMBEDDINGS_MUTATIONS = [
    *common(sampling=False, stream_options=EITHER),
    *known_field("input", [5, 1.5, True, {}], required=True),
    setting("input", ["", [], [""], [None], ["a", None], [1.5], [True], [-1], [[1, None]],
                      [{"text": "x"}]], INVALID, "not text or token ids"),
    setting("input", [[N_VOCAB]], INVALID, "ids outside the vocabulary"),
    setting("input", [["a", 5]], EITHER, "ids mixed with text"),
    setting("input", UNICODE, VALID, "unicode"),
    setting("input", st.lists(UNICODE, min_size=1, max_size=3), VALID, "unicode batch"),
    Mutation("input given as content (llama-server)", _rename_input, VALID),
    setting("encoding_format", [5, "hex"], EITHER),
]


def _rename_documents(body: dict[str, Any], draw: Draw) -> dict[str, Any]:
    body["texts"] = body.pop("documents")
    return body


RERANK_MUTATIONS = [
    *common(sampling=False, stream_options=EITHER),
    *known_field("query", [5, [], {}, True], required=True),
    setting("query", [""], EITHER, "empty"),
    setting("query", UNICODE, VALID, "unicode"),
    *known_field("documents", ["x", 5, {}], required=True),
    setting("documents", [[], [5], ["a", None], [["a"]]], INVALID, "not a list of text"),
    setting("documents", st.lists(UNICODE, min_size=1, max_size=3), VALID, "unicode"),
    Mutation("documents given as texts", _rename_documents, VALID),
    setting("top_n", ["3", -1, 1.5, True], INVALID), nulling("top_n", VALID),
]
INFILL_MUTATIONS = [
    *common(stream_options=EITHER),
    *[m for key in ("input_prefix", "input_suffix") for m in (
        setting(key, [5, [], {}, True], INVALID), nulling(key, EITHER), dropping(key, EITHER),
        setting(key, UNICODE, VALID, "unicode"))],
    setting("prompt", [5, [], {}], INVALID), nulling("prompt", EITHER),
    setting("input_extra", ["x", 5, [5], [{"text": 5}], [{"filename": 5, "text": "x"}]],
            INVALID),
    nulling("input_extra", VALID),
    setting("input_extra", st.lists(st.fixed_dictionaries({"filename": UNICODE,
                                                           "text": UNICODE}), max_size=2),
            VALID, "unicode"),
    *caps("n_predict", "max_tokens"),
]


# Ollama's native API (api/types.go; the ollama SDK's _types.py).


def _options(key: str, values: list[Any], label: str) -> Mutation:
    def apply(body: dict[str, Any], draw: Draw) -> Any:
        body["options"] = {**(body.get("options") or {}), key: draw(st.sampled_from(values))}
        return body
    return Mutation(f"options.{key}: {values!r}", apply, label)


def _add_image(body: dict[str, Any], draw: Draw) -> Any:
    if "messages" in body:
        body["messages"][0]["images"] = ["aGVsbG8="]
    else:
        body["images"] = ["aGVsbG8="]
    return body


def ollama_common() -> list[Mutation]:
    return [
        Mutation("unknown top-level field", _unknown_field, VALID),
        Mutation("body not an object", _not_an_object, INVALID),
        *known_field("model", NOT_STRING, required=True), setting("model", [""], INVALID, "empty"),
        setting("model", ["nope:1b"], EITHER, "a model not pulled"),
        setting("stream", NOT_BOOL, INVALID), nulling("stream", VALID),
        setting("options", NOT_OBJECT, INVALID), nulling("options", VALID),
        _options("num_predict", ["5", True, [], {}], INVALID),
        _options("num_predict", [1.5, -3], EITHER),
        _options("num_predict", [10**6], REFUSED),
        _options("temperature", ["hot", True, []], INVALID),
        _options("num_ctx", ["2048", True], INVALID),
        setting("stream_options", NOT_OBJECT, EITHER),
        Mutation("one image", _add_image, VALID),
    ]


OLLAMA_CHAT_MUTATIONS = [
    *ollama_common(),
    *known_field("messages", NOT_LIST, null=VALID, drop=VALID),
    setting("messages", [[]], VALID, "empty list"),
    Mutation("message not an object", _replace_message, INVALID),
    on_message("message role of a wrong type", _put("role", [5, [], {}, True]), INVALID),
    on_message("message role dropped", _pop("role"), EITHER),
    on_message("message content of a wrong type", _put("content", [5, [], {}, True, 1.5]),
               INVALID),
    on_message("message content = null", _put("content", [None]), VALID),
    on_message("message content dropped", _pop("content"), VALID),
    on_message("message content unicode", _put("content", UNICODE), VALID),
    on_message("message content long", _put("content", LONG_TEXTS), EITHER),
    on_message("message images of a wrong type", _put("images", ["x", 5, [5], {}]), INVALID),
    on_message("message images = null", _put("images", [None]), VALID),
]
OLLAMA_GENERATE_MUTATIONS = [
    *ollama_common(),
    *[m for key in ("prompt", "system", "template", "suffix") for m in (
        setting(key, [5, [], {}, True], INVALID), nulling(key, VALID), dropping(key, VALID))],
    setting("prompt", UNICODE, VALID, "unicode"), setting("system", UNICODE, VALID, "unicode"),
    setting("prompt", LONG_TEXTS, EITHER, "long"),
    setting("context", ["x", 5, [1.5], [True], [None], {}], INVALID),
    nulling("context", VALID), setting("context", [[]], VALID, "empty"),
    setting("images", ["x", 5, [5], {}], INVALID), nulling("images", VALID),
    setting("raw", NOT_BOOL, INVALID), setting("truncate", NOT_BOOL, INVALID),
]


@dataclass(frozen=True)
class Route:
    """A route under test: its base strategy, mutations, and where it goes upstream."""

    path: str
    kind: str  # "llama" or "ollama"
    shape: str  # "openai", "anthropic" or "ollama"
    base: st.SearchStrategy[dict[str, Any]]
    mutations: list[Mutation]
    upstream: str  # the upstream path of its generation (count_tokens: its count)
    cap_field: str | None = None  # the field the gateway puts the charged cap in
    cap_keys: tuple[str, ...] = ()  # the fields a client may give the cap in
    answered_here: bool = False  # the gateway answers (count_tokens)
    policies: tuple[str, ...] = ("strict",)

    def __repr__(self) -> str:
        return self.path


OPENAI_CAPS = ("max_tokens", "max_completion_tokens", "n_predict")
ROUTES = [
    Route("/v1/chat/completions", "llama", "openai", CHAT, CHAT_MUTATIONS,
          "/v1/chat/completions", "max_tokens", OPENAI_CAPS,
          policies=("strict", "predictive")),
    Route("/v1/completions", "llama", "openai", COMPLETIONS, COMPLETIONS_MUTATIONS,
          "/v1/completions", "max_tokens", OPENAI_CAPS, policies=("strict", "predictive")),
    Route("/v1/responses", "llama", "openai", RESPONSES, RESPONSES_MUTATIONS,
          "/v1/responses", "max_output_tokens",
          ("max_output_tokens", "max_tokens", "max_completion_tokens", "n_predict")),
    Route("/v1/messages", "llama", "anthropic", MESSAGES, MESSAGES_MUTATIONS, "/v1/messages",
          "max_tokens", ("max_tokens", "max_completion_tokens", "n_predict")),
    Route("/v1/messages/count_tokens", "llama", "anthropic", COUNT_TOKENS,
          COUNT_TOKENS_MUTATIONS, "/v1/messages/count_tokens", answered_here=True),
    Route("/v1/embeddings", "llama", "openai", EMBEDDINGS, EMBEDDINGS_MUTATIONS,
          "/v1/embeddings"),
    Route("/embedding", "llama", "openai", EMBEDDINGS, EMBEDDINGS_MUTATIONS, "/embedding"),
    Route("/v1/rerank", "llama", "openai", RERANK, RERANK_MUTATIONS, "/v1/rerank"),
    Route("/infill", "llama", "openai", INFILL, INFILL_MUTATIONS, "/infill", "n_predict",
          ("n_predict", "max_tokens", "max_completion_tokens")),
    Route("/completion", "llama", "openai", NATIVE_COMPLETION, NATIVE_COMPLETION_MUTATIONS,
          "/completion", "n_predict", ("n_predict", "max_tokens", "max_completion_tokens")),
    Route("/api/chat", "ollama", "ollama", OLLAMA_CHAT, OLLAMA_CHAT_MUTATIONS, "/api/chat",
          "options.num_predict"),
    Route("/api/generate", "ollama", "ollama", OLLAMA_GENERATE, OLLAMA_GENERATE_MUTATIONS,
          "/api/generate", "options.num_predict"),
]
BY_PATH = {r.path: r for r in ROUTES}


def _client_cap(route: Route, body: dict[str, Any]) -> int | None:
    if route.kind == "ollama":
        value = (body.get("options") or {}).get("num_predict")
        return value if isinstance(value, int) and value > 0 else None
    for key in route.cap_keys:
        value = body.get(key)
        if value is not None and not (key == "n_predict" and value == -1):
            return int(value)
    return None


def check_forwarded(route: Route, sent: dict[str, Any], out: Outcome, policy: str) -> None:
    """A valid request: 200 in the form asked for (a stream or not), one generation (or
    count) upstream, the client's fields kept, and its cap in every cap field forwarded."""
    assert out.status == 200, (out.status, out.content[:500])
    forwarded = out.to(route.upstream)
    assert len(forwarded) == 1, out.calls
    assert len(out.generations) == (0 if route.answered_here else 1), out.calls
    body = forwarded[0]
    owned = set(CAP_ALIASES) | {"stream_options", "id_slot", "n_discard"}
    if "n_discard" in sent:
        owned.add("seed")  # then the slot tag
    if policy == "predictive":
        owned.add("stream")  # followed answers are streamed upstream (gateway.relay.tracked)
    if route.kind == "ollama":
        owned |= {"options", "truncate"}
        options = body["options"]
        for key, value in (sent.get("options") or {}).items():
            if key not in ("num_predict", "num_ctx"):
                assert options[key] == value, (key, options, sent)
        assert body["truncate"] is False
    for key, value in sent.items():
        if key not in owned:
            assert key in body and body[key] == value, (key, value, body.get(key))
    if route.answered_here:
        assert body == sent
        payload = json.loads(out.content)
        assert isinstance(payload.get("input_tokens"), int), payload
        return
    assert b'"error"' not in out.content, out.content[:500]
    media = out.headers.get("content-type", "")
    if route.kind == "ollama":
        streamed = sent.get("stream") is not False  # Ollama streams unless told not to
        assert media.startswith("application/x-ndjson" if streamed else "application/json")
    else:
        streamed = sent.get("stream") is True
        assert media.startswith("text/event-stream" if streamed else "application/json")
    cap = _client_cap(route, sent)
    if route.kind == "ollama":
        assert isinstance(body["options"]["num_predict"], int)
        assert cap is None or body["options"]["num_predict"] == cap, (cap, body)
    elif route.cap_field is not None:
        assert isinstance(body.get(route.cap_field), int), body
        caps_sent = {body[k] for k in CAP_ALIASES if k in body}
        assert len(caps_sent) == 1, body  # no alias gets past the charged cap
        assert cap is None or body[route.cap_field] == cap, (cap, body)


def check(route: Route, sent: Any, label: str, out: Outcome, policy: str = "strict") -> None:
    """Properties 1 to 3 for one answer."""
    note(f"status {out.status}: {out.content[:300]!r}; upstream {out.contacted}")
    check_common(route.shape, out)
    if label == VALID:
        check_forwarded(route, sent, out, policy)
    elif label in (INVALID, REFUSED):
        assert out.status == 400, (out.status, out.content[:500])
        assert not out.generations, out.calls
        if label == INVALID:
            assert not out.contacted, out.calls


def _encode(body: Any, draw: Draw) -> bytes:
    ascii_only = draw(st.booleans(), label="ensure_ascii")
    indent = draw(st.sampled_from([None, 1]), label="indent")
    return json.dumps(body, ensure_ascii=ascii_only, indent=indent).encode()


@pytest.mark.parametrize("route", ROUTES, ids=lambda r: r.path)
@FUZZ
@given(data=st.data())
def test_almost_valid_requests(route: Route, data: st.DataObject) -> None:
    """Properties 1–3 on a valid request of ``route`` changed by one labelled mutation."""
    body = data.draw(route.base, label="valid request")
    mutation = data.draw(st.sampled_from(route.mutations), label="mutation")
    sent, label = mutation(body, data.draw)
    note(f"{mutation!r} -> {label}: {sent!r}")
    raw = _encode(sent, data.draw)
    policy = data.draw(st.sampled_from(route.policies), label="policy")
    counts = data.draw(st.booleans(), label="backend counts")
    if label == VALID and not counts and _has_image_part(sent):
        # Where the prompt is estimated, each image part is charged 1,600 tokens: a chat
        # with images may not fit the fake's 2,048-token slot, and only a count tells.
        label = EITHER
    check(route, sent, label, send(route.kind, route.path, raw, policy, counts), policy)


def _has_image_part(body: Any) -> bool:
    messages = body.get("messages") if isinstance(body, dict) else None
    return isinstance(messages, list) and any(
        isinstance(m, dict) and isinstance(m.get("content"), list) and IMAGE_PART in m["content"]
        for m in messages)


def test_every_generation_route_is_fuzzed() -> None:
    # An alias is its twin's entry (the same parser): each entry is fuzzed once.
    fuzzed = {r.path for r in ROUTES}
    assert {BY_SPEC_PATH[path].path for path in FORWARDED} <= fuzzed
    assert {"/v1/messages/count_tokens", "/api/chat", "/api/generate"} <= fuzzed


# -- raw bytes that are almost JSON ------------------------------------------------------

MARK = "@@MARK@@"
BAD_UTF8 = [b"\xff", b"\xfe", b"\xc0\x80", b"\x80", b"\xe2\x82", b"\xed\xa0\x80",
            b"\xf4\x90\x80\x80", b"\xc3"]
LONE_SURROGATES = [b"\\ud800", b"\\udfff", b"\\ud800\\u0041", b"x\\udbff", b"\\uDC00",
                   b"\\ud83d\\ud83d"]
HUGE_NUMBERS = [b"9" * 40, b"9" * 5000, b"-" + b"9" * 30, b"1e400", b"-1e400", b"1e-400",
                b"18446744073709551616", b"18446744073709551615", b"-9223372036854775809",
                b"-0", b"0e0", b"1E+2", b"1.0", b"123456789.123456789e-5"]
NOT_NUMBERS = [b"NaN", b"Infinity", b"-Infinity", b"nan", b"inf", b"+1", b".5", b"01",
               b"0x10", b"1_000"]


def _with_mark(route: Route, body: dict[str, Any], where: str) -> dict[str, Any]:
    """``body`` with :data:`MARK` as a string the gateway reads, a key, or a value of an
    unknown field."""
    body = copy.deepcopy(body)
    if where == "key":
        body[MARK] = 1
    elif where == "value":
        body["x_mark"] = MARK
    elif "messages" in body:
        body["messages"][-1]["content"] = f"a{MARK}b"
    else:
        body["prompt"] = f"a{MARK}b"
    return body


def _raw_mutations(route: Route, body: dict[str, Any], draw: Draw) -> tuple[bytes, str, str]:
    """A raw body, the name of the change, and its label (``INVALID`` when no JSON parser
    the backends use accepts it; ``EITHER`` otherwise)."""
    ollama = route.kind == "ollama"
    # Go's encoding/json replaces bad UTF-8 and lone surrogates with U+FFFD, and gin's
    # decoder stops after the first value (trailing data is ignored).
    lenient = EITHER if ollama else INVALID
    raw = json.dumps(body).encode()
    kind = draw(st.sampled_from([
        "truncated", "bad utf-8", "lone surrogate", "duplicate key", "huge number",
        "number literal", "deep nesting", "bom", "trailing data", "not json syntax",
        "control character", "not an object", "byte flip", "content-type"]), label="raw")
    if kind == "truncated":
        return raw[:draw(st.integers(0, len(raw) - 1))], kind, INVALID
    if kind == "bad utf-8":
        where = draw(st.sampled_from(["text", "value", "anywhere"]))
        bad = draw(st.sampled_from(BAD_UTF8))
        if where == "anywhere":
            i = draw(st.integers(0, len(raw)))
            return raw[:i] + bad + raw[i:], kind, lenient
        marked = json.dumps(_with_mark(route, body, where)).encode()
        return marked.replace(MARK.encode(), bad), kind, lenient
    if kind == "lone surrogate":
        where = draw(st.sampled_from(["text", "key", "value"]))
        marked = json.dumps(_with_mark(route, body, where)).encode()
        escape = draw(st.sampled_from(LONE_SURROGATES))
        return marked.replace(MARK.encode(), escape), kind, lenient
    if kind == "duplicate key":
        key = draw(st.sampled_from(sorted(body)))
        value = draw(st.one_of(st.just(body[key]), st.sampled_from(
            [None, "x", -1, 1.5, [], {}, True])))
        dup = json.dumps(key).encode() + b": " + json.dumps(value).encode()
        if draw(st.booleans()):
            return b"{" + dup + b", " + raw[1:], kind, EITHER
        return raw[:-1] + b", " + dup + b"}", kind, EITHER
    if kind in ("huge number", "number literal"):
        number = draw(st.sampled_from(HUGE_NUMBERS if kind == "huge number" else NOT_NUMBERS))
        key = draw(st.sampled_from(["max_tokens", "temperature", "n", "seed", "x_number",
                                    "top_k"]))
        target = body.get("options") if ollama and key != "x_number" else None
        marked = copy.deepcopy(body)
        (marked["options"] if isinstance(target, dict) else marked)[key] = MARK
        out = json.dumps(marked).encode().replace(json.dumps(MARK).encode(), number)
        return out, kind, EITHER if kind == "huge number" else INVALID
    if kind == "deep nesting":
        depth = draw(st.sampled_from([62, 63, 64, 65, 1000, 100_000]))
        opener, closer = draw(st.sampled_from([(b"[", b"]"), (b'{"a":', b"}")]))
        nested = opener * depth + b"1" + closer * depth
        return raw[:-1] + b', "x_deep": ' + nested + b"}", kind, EITHER
    if kind == "bom":
        return b"\xef\xbb\xbf" + raw, kind, EITHER
    if kind == "trailing data":
        tail = draw(st.sampled_from([b"x", b"{}", b"\x00", b", {}", b"]", b"}"]))
        return raw + tail, kind, lenient
    if kind == "not json syntax":
        broken = draw(st.sampled_from([
            raw[:-1] + b",}", raw.replace(b'"', b"'"), b"// c\n" + raw, raw[:-1] + b"/* c */}",
            raw.replace(b": ", b"= ", 1), b"{" + raw[1:].replace(b'"', b"", 2)]))
        return broken, kind, INVALID
    if kind == "control character":
        marked = json.dumps(_with_mark(route, body, "text")).encode()
        char = draw(st.sampled_from([b"\x00", b"\x01", b"\n", b"\t", b"\x1f"]))
        return marked.replace(MARK.encode(), char), kind, INVALID
    if kind == "not an object":
        return draw(st.sampled_from([b"", b" ", b"null", b"[]", b"1", b'"x"', b"true",
                                     b"[" + raw + b"]"])), kind, INVALID
    if kind == "content-type":
        return raw, kind, VALID
    i = draw(st.integers(0, len(raw) - 1))
    flipped = bytes([raw[i] ^ (1 << draw(st.integers(0, 7)))])
    return raw[:i] + flipped + raw[i + 1:], kind, EITHER


RAW_ROUTES = [BY_PATH[p] for p in ("/v1/chat/completions", "/v1/completions",
                                   "/v1/messages", "/api/chat")]


@pytest.mark.parametrize("route", RAW_ROUTES, ids=lambda r: r.path)
@FUZZ
@given(data=st.data())
def test_almost_json_bytes(route: Route, data: st.DataObject) -> None:
    """Properties 1 and 3 on bytes that are almost JSON (and 400 with nothing forwarded
    for what no backend parses)."""
    body = data.draw(route.base, label="valid request")
    raw, kind, label = _raw_mutations(route, body, data.draw)
    note(f"{kind} -> {label}: {raw[:400]!r}")
    if kind == "content-type":
        media = data.draw(st.sampled_from([None, "application/json; charset=utf-8",
                                           "application/vnd.api+json", "APPLICATION/JSON"]))
        out = asyncio.run(_exchange(route.kind, route.path, raw, content_type=media))
        check(route, body, label, out)
        return
    out = send(route.kind, route.path, raw)
    note(f"status {out.status}: {out.content[:300]!r}; upstream {out.contacted}")
    check_common(route.shape, out)
    if label == INVALID:
        assert out.status == 400, (out.status, out.content[:300])
        assert not out.contacted, out.calls


# -- regressions: what the fuzzing found --------------------------------------------------


def _case(path: str, body: Any, label: str, policy: str = "strict") -> None:
    route = BY_PATH[path]
    check(route, body, label, send(route.kind, path, json.dumps(body).encode(), policy),
          policy)


@pytest.mark.parametrize("path,body", [
    ("/v1/responses", {"input": "hi", "max_output_tokens": 16}),
    ("/v1/messages", {"model": "m", "max_tokens": 5,
                      "messages": [{"role": "user", "content": "hi"}]}),
    ("/v1/embeddings", {"input": "hi"}),
    ("/v1/rerank", {"query": "q", "documents": ["a"]}),
    ("/infill", {"input_prefix": "def f(", "input_suffix": ")"}),
    ("/api/chat", {"model": OLLAMA_MODEL, "messages": [{"role": "user", "content": "hi"}]}),
    ("/api/generate", {"model": OLLAMA_MODEL, "prompt": "hi"}),
])
@pytest.mark.parametrize("options", ["x", 5, [1], True])
def test_stream_options_of_a_wrong_type_is_400_not_500(path: str, body: dict[str, Any],
                                                       options: Any) -> None:
    """Found: ``stream_options`` that is not an object was a 500 (``AttributeError``
    in ``pipeline.prepare_exchange``, which reads ``stream_options.include_usage``) on
    every route but chat and completions, whose parser checked its type. Now a 400 (only
    the Responses API has the field; elsewhere ignoring it would do as well)."""
    _case(path, {**body, "stream_options": options},
          INVALID if path == "/v1/responses" else EITHER)
    _case(path, {**body, "stream_options": None}, VALID)


@pytest.mark.parametrize("path", ["/v1/messages", "/v1/messages/count_tokens"])
@pytest.mark.parametrize("blocks,where", [
    ([{"type": "text", "text": 5}], "content"), ([{"type": "text"}], "content"),
    ([{"type": "text", "text": None}], "content"),
    ([5], "system"), (["x"], "system"), ([{"text": "x"}], "system"),
    ([{"type": "text", "text": 5}], "system"), ([{"type": "image"}], "system"),
])
def test_anthropic_text_blocks_need_a_string_text(path: str, blocks: list[Any],
                                                  where: str) -> None:
    """Found: an Anthropic text block without a string ``text`` (``TextBlockParam``), in
    a message or in ``system`` (an array of text blocks), was forwarded."""
    message: dict[str, Any] = {"role": "user", "content": "hi"}
    body: dict[str, Any] = {"model": "m", "messages": [message]}
    if path == "/v1/messages":
        body["max_tokens"] = 5
    if where == "content":
        message["content"] = blocks
    else:
        body["system"] = blocks
    _case(path, body, INVALID)
    fixed = [{"type": "text", "text": "x"}]
    _case(path, {**body, "system": fixed} if where == "system" else
          {**body, "messages": [{**message, "content": fixed}]}, VALID)


@pytest.mark.parametrize("images", ["aGVsbG8=", 5, [5], {}, [None]])
def test_ollama_images_must_be_an_array_of_strings(images: Any) -> None:
    """Found: Ollama's ``images`` of the wrong type (``api.ImageData`` is base64 text)
    was forwarded, on a chat message and on ``/api/generate``."""
    _case("/api/chat", {"model": OLLAMA_MODEL, "messages": [
        {"role": "user", "content": "hi", "images": images}]}, INVALID)
    _case("/api/generate", {"model": OLLAMA_MODEL, "prompt": "hi", "images": images},
          INVALID)
    _case("/api/generate", {"model": OLLAMA_MODEL, "prompt": "hi", "images": None}, VALID)


@pytest.mark.parametrize("key", ["prompt", "system", "template", "suffix"])
def test_ollama_generate_takes_null_texts(key: str) -> None:
    """Found: ``"system": null`` (or prompt, template, suffix) on ``/api/generate`` was
    refused with 400, where Ollama (Go's ``encoding/json``) reads null as unset."""
    _case("/api/generate", {"model": OLLAMA_MODEL, "prompt": "hi", key: None}, VALID)
