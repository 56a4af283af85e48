"""How each route's answers look on the wire: what in a streamed event is a generated
token, where the token counts are, and what marks the end of a stream.

The proxy relays events byte for byte; this module only reads them, for the metrics
(TTFT, ITL, token histograms) and to tell a finished stream from a cut one. Counts are
normalised to OpenAI's ``{"prompt_tokens", "completion_tokens"}``.

Shapes (routes named as in :mod:`gateway.request.plan`):

* ``chat``, ``completions``: OpenAI chunks; ``usage`` on the last chunk(s), the stream
  ends with ``data: [DONE]``.
* ``completion``, ``infill`` (llama-server's native routes, ``tools/server/server-task.cpp``):
  chunks ``{"content", "stop": false}``, a last one with ``"stop": true``,
  ``tokens_evaluated`` and ``tokens_predicted``; no ``[DONE]``.
* ``responses`` (OpenAI Responses): typed events; ``response.output_text.delta`` and
  the other ``*.delta`` events carry output, ``response.completed`` ends the stream with
  ``response.usage`` ``{input_tokens, output_tokens}``.
* ``messages`` (Anthropic Messages): ``message_start`` carries ``usage.input_tokens``
  (plus ``cache_read_input_tokens``), ``content_block_delta`` the output,
  ``message_delta`` ``usage.output_tokens``, ``message_stop`` ends the stream.
* ``ollama_chat``, ``ollama_generate``: NDJSON lines, the last with ``done: true``,
  ``prompt_eval_count`` and ``eval_count`` (``api/types.go``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, TypeGuard

from gateway.wire.routes import Route

__all__ = ["OUTPUT_NAMES", "Seen", "decode_pace", "finish_of", "has_token", "quick_token",
           "read_event", "usage_of_whole"]

_DELTA_TOKENS = ("content", "reasoning_content", "reasoning", "tool_calls", "function_call")
_NATIVE = (Route.completion, Route.infill)  # llama-server's native stream and answer
_OLLAMA = (Route.ollama_chat, Route.ollama_generate)


@dataclass(frozen=True)
class Seen:
    """What one streamed event showed.

    :param token: it carries generated output (for TTFT and ITL).
    :param usage: token counts it carries, normalised (``prompt_tokens``,
        ``completion_tokens``); ``None`` when it has none.
    :param done: it ends the stream.
    :param finish: the reason the answer (or one choice of it) ended, as the backend
        names it (``stop``, ``length``, ``tool_calls``; Anthropic's ``end_turn``,
        ``max_tokens``; Ollama's ``done_reason``), or ``None``.
    """

    token: bool = False
    usage: dict[str, int] | None = None
    done: bool = False
    finish: str | None = None


def has_token(choices: Any) -> bool:
    """True when an OpenAI chunk's choices carry generated output of any kind: content,
    reasoning, tool-call (or legacy function-call) arguments, or completion text."""
    if not isinstance(choices, list):
        return False
    for choice in choices:
        if not isinstance(choice, dict):
            continue
        delta = choice.get("delta")
        if isinstance(delta, dict) and any(delta.get(k) for k in _DELTA_TOKENS):
            return True
        if choice.get("text"):
            return True
    return False


#: Each name has_token reads, quotes included: the value after it (past a ``:`` with no
#: space around it) settles the question when it is null or "" (no output) or a
#: non-empty string (output).
OUTPUT_NAMES = (b'"content"', b'"reasoning_content"', b'"reasoning"', b'"text"',
                b'"tool_calls"', b'"function_call"')
_NO_OUTPUT = (b"null", b'""')


def quick_token(raw: bytes) -> bool | None:
    """Whether one raw SSE event of an OpenAI ``chat`` or ``completions`` stream carries
    generated output, read from its bytes without parsing it: ``True`` or ``False``, as
    :func:`has_token` would answer for its ``choices``, or ``None`` when the bytes do not
    settle it and the event must be parsed (it may carry usage or an error, it is not
    one compact ``data:`` line, or an output key has a value other than null or a
    string, such as tool calls).

    A JSON string cannot hold an unescaped quote, so ``"content":"x`` in the bytes,
    its first quote not escaped, is a key and the start of its value. Keys are read as
    written: one spelled with escapes (``"\u0063ontent"``), which no backend sends, is
    not recognised. Each name is looked for with ``bytes.find`` (a regular expression
    over all six took 4 µs a chunk, this under 1 µs: the SSE relay reads every event,
    issue 37). A name followed by anything but ``:`` (a spaced key, or a string value
    such as ``"text"``) is not settled here: ``None``. Nor is a chunk whose
    ``finish_reason`` is anything but ``null`` (the last of each choice), which is
    parsed for its reason (the trace's ``gen_ai.response.finish_reasons``).
    """
    if not (raw.startswith(b"data: {") and raw.endswith(b"}\n\n")) or raw.count(b"\n") != 2 \
            or b"\r" in raw or b'"usage"' in raw or b'"error"' in raw:
        return None
    at = raw.find(b'"finish_reason"')
    while at >= 0:  # only ``"finish_reason":null`` is settled here
        if raw[at + 15 : at + 20] != b":null":
            return None
        at = raw.find(b'"finish_reason"', at + 20)
    token = False
    for name in OUTPUT_NAMES:
        at = raw.find(name)
        while at >= 0:
            end = at + len(name)
            if raw[at - 1] == 0x5C or raw[end] != 0x3A:  # an escaped quote; not a key
                return None
            value = raw[end + 1 : end + 5]
            if not (value in _NO_OUTPUT or value.startswith(b'""')):
                if value[:1] != b'"' or value[1:2] == b"":
                    return None  # an object, an array, a number: parse it
                token = True
            at = raw.find(name, end)
    return token


def finish_of(choices: Any) -> str | None:
    """The first ``finish_reason`` among an OpenAI chunk's or answer's ``choices``, or
    ``None``."""
    if isinstance(choices, list):
        for choice in choices:
            if isinstance(choice, dict) and isinstance(choice.get("finish_reason"), str):
                return str(choice["finish_reason"])
    return None


def _text(value: Any) -> str | None:
    return value if isinstance(value, str) and value else None


def _ints(**values: Any) -> dict[str, int] | None:
    out = {k: v for k, v in values.items() if isinstance(v, int) and not isinstance(v, bool)}
    return out or None


def _anthropic_input(usage: dict[str, Any]) -> int | None:
    """Input tokens of an Anthropic usage object: llama-server reports the cached part of
    the prompt apart (``cache_read_input_tokens``), as Anthropic does."""
    parts = [usage.get(k) for k in ("input_tokens", "cache_read_input_tokens",
                                    "cache_creation_input_tokens")]
    ints = [p for p in parts if isinstance(p, int) and not isinstance(p, bool)]
    return sum(ints) if ints else None


def _native_usage(obj: dict[str, Any]) -> dict[str, int] | None:
    """llama-server's native counts: ``tokens_evaluated`` (the prompt) and
    ``tokens_predicted``."""
    return _ints(prompt_tokens=obj.get("tokens_evaluated"),
                 completion_tokens=obj.get("tokens_predicted"))


def _ollama_usage(obj: dict[str, Any]) -> dict[str, int] | None:
    """Ollama's final counts: ``prompt_eval_count`` (cached prompt tokens included,
    ``llm/llama_server.go``) and ``eval_count``."""
    return _ints(prompt_tokens=obj.get("prompt_eval_count"),
                 completion_tokens=obj.get("eval_count"))


def read_event(route: str, obj: dict[str, Any]) -> Seen:
    """Read one streamed JSON object (an SSE ``data`` or an NDJSON line) of ``route``.

    Error objects are the caller's concern; ``[DONE]`` is not JSON and is too.
    """
    if route in (Route.chat, Route.completions):
        usage = obj.get("usage")
        choices = obj.get("choices")
        return Seen(token=has_token(choices),
                    usage=_ints(prompt_tokens=usage.get("prompt_tokens"),
                                completion_tokens=usage.get("completion_tokens"))
                    if isinstance(usage, dict) else None, finish=finish_of(choices))
    if route in _NATIVE:
        stop = obj.get("stop") is True
        return Seen(token=bool(obj.get("content")) and not stop,
                    usage=_native_usage(obj) if stop else None, done=stop)
    if route == Route.responses:
        kind = str(obj.get("type") or "")
        if kind == "response.completed":
            usage = (obj.get("response") or {}).get("usage") or {}
            return Seen(usage=_ints(prompt_tokens=usage.get("input_tokens"),
                                    completion_tokens=usage.get("output_tokens")), done=True)
        return Seen(token=kind.endswith(".delta") and bool(obj.get("delta")),
                    done=kind in ("response.failed", "response.incomplete"))
    if route == Route.messages:
        kind = str(obj.get("type") or "")
        if kind == "message_start":
            usage = (obj.get("message") or {}).get("usage") or {}
            return Seen(usage=_ints(prompt_tokens=_anthropic_input(usage),
                                    completion_tokens=usage.get("output_tokens")))
        if kind == "content_block_delta":
            delta = obj.get("delta") or {}
            return Seen(token=any(delta.get(k) for k in ("text", "partial_json", "thinking")))
        if kind == "message_delta":
            usage = obj.get("usage") or {}
            return Seen(usage=_ints(completion_tokens=usage.get("output_tokens")),
                        finish=_text((obj.get("delta") or {}).get("stop_reason")))
        return Seen(done=kind == "message_stop")
    if route in _OLLAMA:
        message = obj.get("message")
        if not isinstance(message, dict):
            message = {}
        done = obj.get("done") is True
        return Seen(token=bool(obj.get("response") or message.get("content")
                               or message.get("thinking")),
                    usage=_ollama_usage(obj) if done else None, done=done,
                    finish=_text(obj.get("done_reason")) if done else None)
    return Seen()


def usage_of_whole(route: str, data: Any) -> tuple[dict[str, int] | None, list[Any]]:
    """Token counts of a whole (non-streamed) answer of ``route``, normalised, and each
    choice's ``finish_reason`` (OpenAI routes, one per choice, for ``n > 1``
    accounting; Anthropic's ``stop_reason`` and Ollama's ``done_reason``, one)."""
    if isinstance(data, list):  # llama-server's native routes answer a batch with a list
        parts = [part for item in data if isinstance(item, dict)
                 if (part := usage_of_whole(route, item)[0])]
        if not parts:
            return None, []
        return _ints(prompt_tokens=max(p.get("prompt_tokens", 0) for p in parts),
                     completion_tokens=sum(p.get("completion_tokens", 0) for p in parts)), []
    if not isinstance(data, dict):
        return None, []
    if route in _NATIVE:
        return _native_usage(data), []
    if route in _OLLAMA:
        return _ollama_usage(data), [r for r in (_text(data.get("done_reason")),) if r]
    usage = data.get("usage")
    if not isinstance(usage, dict):
        usage = {}
    if route == Route.responses:
        return _ints(prompt_tokens=usage.get("input_tokens"),
                     completion_tokens=usage.get("output_tokens")), []
    if route == Route.messages:
        return _ints(prompt_tokens=_anthropic_input(usage),
                     completion_tokens=usage.get("output_tokens")), \
            [r for r in (_text(data.get("stop_reason")),) if r]
    choices = data.get("choices")
    reasons = [c.get("finish_reason") for c in choices if isinstance(c, dict)] \
        if isinstance(choices, list) else []
    return _ints(prompt_tokens=usage.get("prompt_tokens"),
                 completion_tokens=usage.get("completion_tokens")), reasons


def decode_pace(data: Any) -> float | None:
    """The decode pace a whole answer reports of itself, seconds per output token, or
    ``None``: llama-server's ``timings.predicted_per_token_ms`` (every answer of its
    server, tools/server/server-task.cpp ``result_timings``), Ollama's native
    ``eval_duration`` (nanoseconds) over ``eval_count``. Only a pace measured over at
    least 2 tokens counts (one token is the prefill's)."""
    if not isinstance(data, dict):
        return None
    timings = data.get("timings")
    if isinstance(timings, dict):
        per_ms, n = timings.get("predicted_per_token_ms"), timings.get("predicted_n")
        if _number(per_ms) and _number(n) and n >= 2 and per_ms > 0:
            return float(per_ms) / 1000
    ns, n = data.get("eval_duration"), data.get("eval_count")
    if _number(ns) and _number(n) and n >= 2 and ns > 0:
        return float(ns) / 1e9 / float(n)
    return None


def _number(value: Any) -> TypeGuard[int | float]:
    return isinstance(value, int | float) and not isinstance(value, bool) and \
        math.isfinite(value)
