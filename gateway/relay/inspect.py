"""What a relayed stream shows, event by event, without I/O: the :class:`StreamInspector`.

The relay (:class:`gateway.relay.response.ProxyResponse`) splits the upstream bytes into
events (:class:`gateway.wire.sse.EventSplitter`) and hands each to
:meth:`StreamInspector.feed`, which answers what to relay (the event as it came, the event
put in the route's error shape, or nothing), whether it carried output, and the upstream
error kind it showed, and keeps what the whole stream has shown so far: its end, its
error, its usage. The relay acts on that (metrics, TTFT and ITL, the backend's health);
the inspector touches no clock, no metric and no socket, so it is tested on bytes alone
(``tests/test_inspect.py``), as h11 tests its readers.

Backend behaviour read here (sources in :mod:`gateway.wire.events`):

* llama-server ends an OpenAI stream with ``data: [DONE]``; an error after the 200 is an
  event ``{"error": {...}}`` (its overflow error: ``Context size has been exceeded.``).
* With ``n > 1`` on chat or completions, llama-server sends usage once per choice: their
  completion tokens sum to the total.
* Its native ``/completion`` and ``/infill`` streams end each task (prompt × n) with its
  own ``"stop": true`` chunk and counts; the stream is over after the last one.
* Ollama's native streams are NDJSON lines (``{"error": "..."}`` on failure).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from gateway.relay.send import json_object
from gateway.wire.events import Seen, quick_token, read_event
from gateway.wire.routes import RouteSpec
from gateway.wire.shapes import reshape_upstream_error
from gateway.wire.sse import event_data

__all__ = ["Inspected", "StreamInspector", "TokenTimes"]

#: What one event showed: the bytes to relay (``None``: drop it), whether it carried
#: output, and the upstream error kind it showed (``context_overflow``,
#: ``stream_aborted``) or ``None``.
Inspected = tuple[bytes | None, bool, str | None]


@dataclass(slots=True)
class TokenTimes:
    """When the last output token of a stream arrived (seconds on the injected clock;
    ``None`` before the first), for TTFT and ITL; and the usage a tracked stream saw."""

    last_token: float | None = None
    usage: dict[str, Any] | None = None


@dataclass(slots=True)
class StreamInspector:
    """Reads one upstream stream's events; see the module docstring.

    :param spec: the route's entry in the route table: OpenAI chunks
        (``openai_chunks``: plain chunks read from bytes by
        :func:`gateway.wire.events.quick_token`, usage once per choice), or llama-server's
        native stream (``native_tasks``: a stop chunk per task).
    :param api: the client's API shape (``openai``, ``anthropic``, ``ollama``): an error
        event on an OpenAI route is relayed in the OpenAI shape.
    :param tasks: the upstream tasks of the request (prompts × n), for native streams.
    :param client_wants_usage: the client asked for the usage chunk itself (else the
        chunk the gateway asked for on its behalf is dropped).
    :param is_overflow: whether an error event is the backend's KV overflow (the
        dialect's rule).
    :param ndjson: the stream is NDJSON lines (Ollama's native API), not SSE.
    """

    spec: RouteSpec
    api: str
    tasks: int
    client_wants_usage: bool
    is_overflow: Callable[[dict[str, Any]], bool]
    ndjson: bool = False
    #: The stream's last event came (``[DONE]``, the last task's end, Ollama's ``done``).
    done: bool = False
    #: The backend sent an error event.
    errored: bool = False
    #: The usage the stream reported, merged over its chunks.
    usage: dict[str, Any] | None = None
    final_completion: int = 0  # completion tokens summed over the usage chunks
    final_chunks: int = 0  # usage (or task end) chunks seen
    #: Each finish reason the stream's events gave (one per choice), for the trace.
    finish_reasons: list[str] = field(default_factory=list)

    def feed(self, raw: bytes) -> Inspected:
        """Inspect one raw event (SSE, or an NDJSON line)."""
        return self._line(raw) if self.ndjson else self._event(raw)

    def reader(self) -> Callable[[bytes], Inspected]:
        """:meth:`feed` for this stream's framing, with no choice made per event."""
        return self._line if self.ndjson else self._event

    @property
    def whole(self) -> bool:
        """The stream ended as it should: its last event came and no error."""
        return self.done and not self.errored

    def stream_usage(self, covers_one_choice: bool) -> dict[str, Any] | None:
        """The usage of the whole stream: as reported, with the completion tokens summed
        over its usage chunks when the backend reports one choice's per chunk
        (``covers_one_choice``, the dialect's capability)."""
        usage = self.usage
        if isinstance(usage, dict) and self.final_chunks > 1 and covers_one_choice:
            usage = {**usage, "completion_tokens": self.final_completion}
        return usage

    def _line(self, raw: bytes) -> Inspected:
        obj = json_object(raw)
        if obj is None:
            return raw, False, None
        if "error" in obj:
            self.errored = True
            return raw, False, "stream_aborted"
        return raw, self._seen(read_event(self.spec.name, obj)), None

    def _seen(self, seen: Seen) -> bool:
        if seen.finish is not None:
            self.finish_reasons.append(seen.finish)
        if seen.usage:
            self.usage = {**(self.usage or {}), **seen.usage}
        if seen.done and self.spec.native_tasks:
            self.final_completion += (seen.usage or {}).get("completion_tokens", 0)
            self.final_chunks += 1
            if self.final_chunks < self.tasks:
                return seen.token
            if self.usage is not None:
                self.usage["completion_tokens"] = self.final_completion
        self.done = self.done or seen.done
        return seen.token

    def _event(self, raw: bytes) -> Inspected:
        openai_chunks = self.spec.openai_chunks
        if openai_chunks and (token := quick_token(raw)) is not None:
            return raw, token, None  # a plain chunk: no usage, no error, nothing to change
        data = event_data(raw)
        if data is None:
            return raw, False, None
        if data.strip() == "[DONE]":
            self.done = True
            return (None if self.errored else raw), False, None  # the error stays last
        obj = json_object(data)
        if obj is None:
            return raw, False, None
        if "error" in obj or obj.get("type") == "error":
            return self._error(raw, obj)
        seen = read_event(self.spec.name, obj)
        if seen.usage and "completion_tokens" in seen.usage and openai_chunks:
            self.final_completion += seen.usage["completion_tokens"]
            self.final_chunks += 1
        token = self._seen(seen)
        if (obj.get("choices") == [] and seen.usage and not self.client_wants_usage
                and openai_chunks):
            return None, token, None
        return raw, token, None

    def _error(self, raw: bytes, obj: dict[str, Any]) -> Inspected:
        self.errored = True
        kind = "context_overflow" if self.is_overflow(obj) else "stream_aborted"
        if self.api == "openai" and isinstance(obj.get("error"), dict):
            code = obj["error"].get("code")
            status = code if isinstance(code, int) and 400 <= code < 600 else 500
            obj["error"] = reshape_upstream_error(status, obj["error"])
            raw = b"data: " + json.dumps(obj, separators=(",", ":")).encode() + b"\n\n"
        return raw, False, kind
