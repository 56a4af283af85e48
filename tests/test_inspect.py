"""The stream inspector on bytes alone (gateway.relay.inspect): no ASGI, no clock, no
backend. Event shapes are llama-server's (tools/server/server-context.cpp: OpenAI chunks,
the final usage chunk with "choices": [], data: [DONE], the error event) and Ollama's
NDJSON lines (api/types.go)."""

from __future__ import annotations

import json

from gateway.relay.inspect import StreamInspector
from gateway.wire.routes import BY_NAME


def _sse(obj: object) -> bytes:
    return b"data: " + json.dumps(obj).encode() + b"\n\n"


def _chunk(text: str, index: int = 0) -> bytes:
    return _sse({"object": "chat.completion.chunk",
                 "choices": [{"index": index, "delta": {"content": text}}]})


def _inspector(route: str = "chat", **kw: object) -> StreamInspector:
    args: dict = {"api": "openai", "tasks": 1, "client_wants_usage": False,
                  "is_overflow": lambda obj: "exceeded" in json.dumps(obj)}
    args.update(kw)
    return StreamInspector(BY_NAME[route], **args)


def test_a_plain_chunk_is_output_relayed_as_it_came() -> None:
    s = _inspector()
    raw = _chunk("hello")
    assert s.feed(raw) == (raw, True, None)
    assert not s.done


def test_done_ends_the_stream_and_is_relayed() -> None:
    s = _inspector()
    assert s.feed(b"data: [DONE]\n\n") == (b"data: [DONE]\n\n", False, None)
    assert s.whole


def test_the_usage_chunk_the_client_did_not_ask_for_is_dropped_but_read() -> None:
    usage = {"prompt_tokens": 7, "completion_tokens": 3, "total_tokens": 10}
    raw = _sse({"object": "chat.completion.chunk", "choices": [], "usage": usage})
    s = _inspector()
    assert s.feed(raw) == (None, False, None)
    assert s.usage is not None
    assert (s.usage["prompt_tokens"], s.usage["completion_tokens"]) == (7, 3)
    asked = _inspector(client_wants_usage=True)
    assert asked.feed(raw)[0] == raw


def test_n_choices_usage_is_summed_when_the_backend_reports_one_choice_each() -> None:
    s = _inspector(tasks=2)
    for n in (4, 6):
        s.feed(_sse({"choices": [], "usage": {"prompt_tokens": 5, "completion_tokens": n}}))
    assert s.stream_usage(covers_one_choice=True)["completion_tokens"] == 10
    assert s.stream_usage(covers_one_choice=False)["completion_tokens"] == 6


def test_an_overflow_event_is_reshaped_and_named() -> None:
    s = _inspector()
    raw = _sse({"error": {"code": 500, "message": "Context size has been exceeded.",
                          "type": "server_error"}})
    relayed, token, kind = s.feed(raw)
    assert (token, kind) == (False, "context_overflow") and s.errored
    error = json.loads(relayed.removeprefix(b"data: "))["error"]
    assert error["type"] == "server_error" and isinstance(error["code"], (str, type(None)))
    assert error["message"] == "Context size has been exceeded."
    # After an error, [DONE] is dropped: the error event stays the last one.
    assert s.feed(b"data: [DONE]\n\n") == (None, False, None)
    assert not s.whole


def test_another_error_is_stream_aborted_and_kept_in_anthropic_shape() -> None:
    s = _inspector("messages", api="anthropic")
    raw = b'event: error\ndata: {"type": "error", "error": {"type": "api_error", "message": "x"}}\n\n'
    assert s.feed(raw) == (raw, False, "stream_aborted")


def test_native_streams_end_after_the_last_task() -> None:
    s = _inspector("completion", tasks=2)
    stop = _sse({"content": "", "stop": True, "tokens_predicted": 4, "tokens_evaluated": 9})
    s.feed(stop)
    assert not s.done  # one task of two ended
    s.feed(stop)
    assert s.done and s.usage is not None and s.usage["completion_tokens"] == 8


def test_ndjson_lines_are_relayed_and_an_error_line_named() -> None:
    s = _inspector("ollama_chat", api="ollama", ndjson=True)
    line = b'{"model":"m","message":{"role":"assistant","content":"hi"},"done":false}\n'
    assert s.feed(line) == (line, True, None)
    bad = b'{"error":"model runner has unexpectedly stopped"}\n'
    assert s.feed(bad) == (bad, False, "stream_aborted") and s.errored


def test_comments_and_odd_events_pass_untouched() -> None:
    s = _inspector()
    for raw in (b": keep-alive\n\n", b"data: not json\n\n", b"event: ping\n\n"):
        assert s.feed(raw) == (raw, False, None)
    assert not s.done and not s.errored
