"""Wire-level fidelity (issue 11): what counts as a generated token for TTFT/ITL, prompt
shapes, and multi-choice token counts."""

from __future__ import annotations

import json
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from gateway.wire.events import has_token, quick_token


@pytest.mark.parametrize("choices,seen", [
    ([{"index": 0, "delta": {"content": "Hi"}}], True),
    ([{"index": 0, "delta": {"reasoning_content": "Let me"}}], True),
    ([{"index": 0, "delta": {"reasoning": "Let me"}}], True),  # vLLM's newer field
    ([{"index": 0, "delta": {"tool_calls": [{"index": 0, "function": {
        "arguments": "{\"ci"}}]}}], True),  # a stream of tool-call arguments only
    ([{"index": 0, "delta": {"function_call": {"arguments": "{"}}}], True),
    ([{"index": 0, "text": "once"}], True),
    ([{"index": 0, "delta": {"role": "assistant", "content": ""}}], False),
    ([{"index": 0, "delta": {}, "finish_reason": "stop"}], False),
    ([], False),
    (None, False),
])
def test_any_generated_delta_is_a_token(choices: Any, seen: bool) -> None:
    assert has_token(choices) is seen


def test_each_routes_stream_is_read_for_tokens_counts_and_end() -> None:
    from gateway.wire.events import read_event

    seen = read_event("messages", {"type": "message_start", "message": {"usage": {
        "input_tokens": 5, "cache_read_input_tokens": 38, "output_tokens": 1}}})
    assert seen.usage == {"prompt_tokens": 43, "completion_tokens": 1} and not seen.done
    assert read_event("messages", {"type": "content_block_delta", "delta": {
        "type": "input_json_delta", "partial_json": "{\"a"}}).token  # tool input only
    assert read_event("messages", {"type": "message_delta", "usage": {
        "output_tokens": 9}}).usage == {"completion_tokens": 9}
    assert read_event("messages", {"type": "message_stop"}).done
    assert read_event("responses", {"type": "response.function_call_arguments.delta",
                                    "delta": "{\"c"}).token
    done = read_event("responses", {"type": "response.completed", "response": {
        "usage": {"input_tokens": 43, "output_tokens": 4}}})
    assert done.done and done.usage == {"prompt_tokens": 43, "completion_tokens": 4}
    assert read_event("completion", {"content": " a", "stop": False}).token
    last = read_event("completion", {"content": "", "stop": True, "tokens_evaluated": 3,
                                     "tokens_predicted": 3})
    assert last.done and last.usage == {"prompt_tokens": 3, "completion_tokens": 3}


def test_each_routes_finish_reason_is_read_from_its_stream_and_its_whole_answer() -> None:
    from gateway.wire.events import read_event, usage_of_whole

    assert read_event("chat", {"choices": [{"index": 0, "delta": {},
                                            "finish_reason": "tool_calls"}]}).finish == \
        "tool_calls"
    assert read_event("chat", {"choices": [{"index": 0, "delta": {"content": "a"},
                                            "finish_reason": None}]}).finish is None
    assert read_event("messages", {"type": "message_delta", "delta": {
        "stop_reason": "max_tokens"}, "usage": {"output_tokens": 9}}).finish == "max_tokens"
    assert read_event("ollama_chat", {"done": True, "done_reason": "length",
                                      "eval_count": 3}).finish == "length"
    assert read_event("ollama_chat", {"done": False, "message": {"content": "a"}}) \
        .finish is None
    assert usage_of_whole("chat", {"choices": [{"finish_reason": "stop"},
                                               {"finish_reason": "length"}]})[1] == \
        ["stop", "length"]
    assert usage_of_whole("messages", {"stop_reason": "end_turn", "usage": {}})[1] == \
        ["end_turn"]
    assert usage_of_whole("ollama_generate", {"done": True, "done_reason": "stop"})[1] == \
        ["stop"]
    assert usage_of_whole("messages", {"usage": {}})[1] == []


def test_whole_answers_of_each_route_give_their_counts() -> None:
    from gateway.wire.events import usage_of_whole

    assert usage_of_whole("messages", {"usage": {"input_tokens": 42,
                                                 "cache_read_input_tokens": 1,
                                                 "output_tokens": 4}})[0] == {
        "prompt_tokens": 43, "completion_tokens": 4}
    assert usage_of_whole("responses", {"usage": {"input_tokens": 43, "output_tokens": 4}}
                          )[0] == {"prompt_tokens": 43, "completion_tokens": 4}
    batch = [{"tokens_evaluated": 3, "tokens_predicted": 2},
             {"tokens_evaluated": 5, "tokens_predicted": 2}]
    assert usage_of_whole("completion", batch)[0] == {"prompt_tokens": 5,
                                                       "completion_tokens": 4}
    assert usage_of_whole("embeddings", {"usage": {"prompt_tokens": 7,
                                                   "total_tokens": 7}})[0] == {
        "prompt_tokens": 7}


@pytest.mark.parametrize("route,body,param", [
    ("messages", {"messages": [{"role": "user", "content": "hi"}]}, "max_tokens"),
    ("messages", {"max_tokens": 5, "messages": [{"role": "system", "content": "x"}]},
     "messages.0.role"),
    ("responses", {"input": ""}, "input"),
    ("embeddings", {"input": []}, "input"),
    ("rerank", {"query": "q", "documents": []}, "documents"),
    ("infill", {"input_prefix": 5}, "input_prefix"),
])
def test_each_routes_required_fields(route: str, body: dict[str, Any], param: str) -> None:
    import json

    from gateway.errors import InvalidRequest
    from gateway.wire.routes import BY_NAME

    with pytest.raises(InvalidRequest) as info:
        BY_NAME[route].parse(json.dumps(body).encode())
    assert info.value.param == param


def test_every_cap_field_llama_server_reads_gets_the_charge() -> None:
    # llama-server copies a Responses body into the chat it runs and reads n_predict,
    # then max_completion_tokens, then max_tokens, whatever the route.
    import json

    from gateway.backends.base import openai_body
    from gateway.core.capacity import Charge
    from gateway.errors import InvalidRequest
    from gateway.wire.routes import BY_NAME

    with pytest.raises(InvalidRequest):
        BY_NAME["responses"].parse(json.dumps({"input": "hi", "max_output_tokens": 2,
                                                  "n_predict": 12}).encode())
    req = BY_NAME["responses"].parse(json.dumps({"input": "hi", "max_output_tokens": 5,
                                                    "max_completion_tokens": 5,
                                                    "n": 3}).encode())
    assert (req.max_tokens, req.n) == (5, 3)
    body = openai_body(req, Charge(10, 4, n=3), ())
    assert body["max_output_tokens"] == body["max_completion_tokens"] == 4
    infill = BY_NAME["infill"].parse(json.dumps({"input_prefix": "a", "n_cmpl": 2,
                                                    "max_tokens": 7}).encode())
    assert (infill.n, infill.max_tokens) == (2, 7)
    body = openai_body(infill, Charge(10, 6, n=2), ())
    assert body["n_predict"] == body["max_tokens"] == 6


def test_media_in_structured_prompts_is_not_read_as_text() -> None:
    import json

    from gateway.wire.routes import BY_NAME
    from gateway.wire.validation import IMAGE_TOKENS

    image = {"type": "image", "source": {"type": "base64", "media_type": "image/png",
                                         "data": "iVBOR" * 100_000}}
    req = BY_NAME["messages"].parse(json.dumps({"max_tokens": 5, "messages": [
        {"role": "user", "content": [image, {"type": "text", "text": "what is this"}]}]}
    ).encode())
    assert all(len(t) < 100 for t in req.texts) and req.extra_prompt_tokens == IMAGE_TOKENS
    req = BY_NAME["responses"].parse(json.dumps({"input": [{"role": "user", "content": [
        {"type": "input_image", "image_url": "data:image/png;base64," + "A" * 10_000},
        {"type": "input_text", "text": "hi"}]}]}).encode())
    assert "hi" in req.texts and req.extra_prompt_tokens == IMAGE_TOKENS


@pytest.mark.parametrize("route,body", [
    ("messages", {"max_tokens": 5, "temperature": "hot",
                  "messages": [{"role": "user", "content": "hi"}]}),
    ("responses", {"input": "hi", "n_probs": 5000}),
    ("infill", {"input_prefix": "a", "top_k": "many"}),
])
def test_sampling_fields_are_checked_on_every_route(route: str, body: dict[str, Any]) -> None:
    import json

    from gateway.errors import InvalidRequest
    from gateway.wire.routes import BY_NAME

    with pytest.raises(InvalidRequest):
        BY_NAME[route].parse(json.dumps(body).encode())


@pytest.mark.anyio
async def test_every_forwarded_answer_says_how_long_it_queued(harness: Any) -> None:
    r = await harness.chat("hi", max_tokens=3)
    assert r.status_code == 200 and r.headers["x-queue-wait-ms"] == "0"
    assert "x-queue-predicted-wait-ms" not in r.headers  # it did not queue


@pytest.mark.anyio
async def test_a_queued_stream_that_asks_gets_progress_comments(harness_factory: Any,
                                                                fake: Any) -> None:
    import asyncio

    from tests.fakes import ManualClock

    clock = ManualClock()
    h = await harness_factory({"queue_progress_s": 5.0}, clock=clock, slots=1)
    fake.hold = asyncio.Event()
    first = asyncio.ensure_future(h.chat("one", max_tokens=2))
    for _ in range(20):
        await asyncio.sleep(0)
    second = asyncio.ensure_future(h.client.post(
        "/v1/chat/completions", headers={"X-Queue-Progress": "1"},
        json={"messages": [{"role": "user", "content": "two"}], "max_tokens": 2,
              "stream": True}))
    for _ in range(20):
        await asyncio.sleep(0)
    clock.advance(5.0)
    for _ in range(20):
        await asyncio.sleep(0)
    fake.hold.set()
    assert (await first).status_code == 200
    r = await second
    assert r.status_code == 200 and r.text.startswith(": queued position=1")
    assert r.text.rstrip().endswith("data: [DONE]") and r.text.count(": queued") == 1
    plain = await h.client.post("/v1/chat/completions", json={  # nothing asked, no wait
        "messages": [{"role": "user", "content": "three"}], "max_tokens": 2, "stream": True})
    assert ": queued" not in plain.text


@pytest.mark.anyio
async def test_a_queue_timeout_after_the_early_200_is_a_final_error_event(
    harness_factory: Any, fake: Any
) -> None:
    import asyncio

    from tests.fakes import ManualClock

    clock = ManualClock()
    h = await harness_factory({"queue_progress_s": 5.0, "max_queue_wait_s": 8.0},
                              clock=clock, slots=1)
    fake.hold = asyncio.Event()
    first = asyncio.ensure_future(h.chat("one", max_tokens=2))
    for _ in range(20):
        await asyncio.sleep(0)
    second = asyncio.ensure_future(h.client.post(
        "/v1/chat/completions", headers={"X-Queue-Progress": "1"},
        json={"messages": [{"role": "user", "content": "two"}], "max_tokens": 2,
              "stream": True}))
    for _ in range(20):
        await asyncio.sleep(0)
    for _ in range(2):
        clock.advance(5.0)
        for _ in range(20):
            await asyncio.sleep(0)
    r = await second
    assert r.status_code == 200 and ": queued position=1" in r.text
    last = [line for line in r.text.splitlines() if line.startswith("data: ")][-1]
    assert '"queue_timeout"' in last and "[DONE]" not in r.text
    fake.hold.set()
    await first
    assert h.backend.stats().reserved_tokens == 0 and h.backend.stats().queued == 0


@pytest.mark.anyio
async def test_a_full_queue_is_still_a_503_for_a_stream_that_asked_for_progress(
    harness_factory: Any, fake: Any
) -> None:
    import asyncio

    h = await harness_factory({"queue_progress_s": 5.0, "max_queue": 0}, slots=1)
    fake.hold = asyncio.Event()
    first = asyncio.ensure_future(h.chat("one", max_tokens=2))
    for _ in range(20):
        await asyncio.sleep(0)
    r = await h.client.post("/v1/chat/completions", headers={"X-Queue-Progress": "1"},
                            json={"messages": [{"role": "user", "content": "two"}],
                                  "max_tokens": 2, "stream": True})
    assert r.status_code == 503 and r.json()["error"]["code"] == "queue_full"
    fake.hold.set()
    await first


@pytest.mark.anyio
async def test_a_stream_is_whole_at_its_last_event(harness: Any, fake: Any) -> None:
    # The answer ends at [DONE], even if the backend's connection lingers: a client that
    # closes there (the OpenAI SDK does) got everything, and is not counted as gone.
    import asyncio

    fake.after_done = asyncio.Event()
    r = await asyncio.wait_for(harness.chat("hi", max_tokens=2, stream=True), 5)
    assert r.status_code == 200 and r.text.rstrip().endswith("data: [DONE]")
    assert harness.sample("gateway_requests_total", backend="local", route="chat",
                          code="200") == 1
    assert harness.backend.stats().reserved_tokens == 0
    fake.after_done.set()


# -- quick_token: the byte-level reading of plain chunks agrees with the parsed one -----

_TEXTS = st.one_of(st.none(), st.just(""), st.text(max_size=12),
                   st.sampled_from(['"content":"x', 'a": "b', '\\"text\\":\\"', "usage",
                                    "error", "\n", "data: {}", "é😀"]))
_DELTAS = st.fixed_dictionaries({}, optional={
    "role": st.just("assistant"), "content": _TEXTS, "reasoning_content": _TEXTS,
    "reasoning": _TEXTS,
    "tool_calls": st.lists(st.fixed_dictionaries({"index": st.just(0), "function": (
        st.fixed_dictionaries({"arguments": _TEXTS.filter(lambda t: t is not None)}))}),
        max_size=1),
})
_CHOICES = st.fixed_dictionaries({"index": st.integers(0, 2)}, optional={
    "delta": _DELTAS, "text": _TEXTS, "finish_reason": st.sampled_from([None, "stop"]),
    "logprobs": st.one_of(st.none(), st.fixed_dictionaries({"content": st.lists(
        st.fixed_dictionaries({"token": _TEXTS.filter(lambda t: t is not None),
                               "logprob": st.floats(-5, 0)}), max_size=2)})),
})
_CHUNKS = st.fixed_dictionaries({"choices": st.lists(_CHOICES, max_size=2)}, optional={
    "id": st.just("chatcmpl-1"), "object": st.just("chat.completion.chunk"),
    "usage": st.none(), "model": _TEXTS,
})


@given(chunk=_CHUNKS, compact=st.booleans(), ascii_only=st.booleans())
def test_quick_token_agrees_with_the_parsed_reading(chunk: dict[str, Any], compact: bool,
                                                    ascii_only: bool) -> None:
    separators = (",", ":") if compact else (", ", ": ")
    raw = b"data: " + json.dumps(chunk, separators=separators,
                                 ensure_ascii=ascii_only).encode() + b"\n\n"
    quick = quick_token(raw)
    assert quick is None or quick is has_token(chunk["choices"])


@pytest.mark.parametrize("raw,quick", [
    (b'data: {"choices":[{"index":0,"delta":{"content":"Hi"}}]}\n\n', True),
    (b'data: {"choices":[{"index":0,"delta":{"content":"\\"Hi"}}]}\n\n', True),
    (b'data: {"choices":[{"index":0,"delta":{"role":"assistant","content":null}}]}\n\n',
     False),
    (b'data: {"choices":[{"index":0,"delta":{"content":""},"finish_reason":null}]}\n\n',
     False),
    (b'data: {"choices":[{"index":0,"text":"once"}]}\n\n', True),
    # what must be parsed: usage, errors, tool calls, spacing, several lines, [DONE]
    (b'data: {"choices":[],"usage":{"prompt_tokens":3}}\n\n', None),
    (b'data: {"error":{"message":"boom"}}\n\n', None),
    (b'data: {"choices":[{"delta":{"tool_calls":[{"index":0}]}}]}\n\n', None),
    (b'data: {"choices": [{"delta": {"content": "Hi"}}]}\n\n', None),
    (b'data: {"choices":\ndata: [{"delta":{"content":"Hi"}}]}\n\n', None),
    (b"data: [DONE]\n\n", None),
    (b'data: {"choices":[{"delta":{"content":"Hi"}}]}\r\n\r\n', None),
    # the last chunk of a choice: its finish reason is read (for the trace)
    (b'data: {"choices":[{"index":0,"delta":{},"finish_reason":"stop"}]}\n\n', None),
    (b'data: {"choices":[{"index":0,"delta":{},"finish_reason": "stop"}]}\n\n', None),
    (b'data: {"choices":[{"index":0,"delta":{"content":"a"},"finish_reason":null},'
     b'{"index":1,"delta":{},"finish_reason":"length"}]}\n\n', None),
    (b'data: {"choices":[{"index":0,"delta":{"content":"a"},"finish_reason":null}]}\n\n',
     True),
])
def test_quick_token_reads_plain_chunks_and_leaves_the_rest(raw: bytes,
                                                            quick: bool | None) -> None:
    assert quick_token(raw) is quick


_PLAIN_TEXTS = st.one_of(st.none(), st.just(""), st.text(max_size=12).filter(
    lambda t: "usage" not in t and "error" not in t))


@given(chunk=st.fixed_dictionaries({"choices": st.lists(st.fixed_dictionaries(
    {"index": st.integers(0, 2)}, optional={
        "delta": st.fixed_dictionaries({}, optional={
            "role": st.just("assistant"), "content": _PLAIN_TEXTS,
            "reasoning_content": _PLAIN_TEXTS}),
        "text": _PLAIN_TEXTS, "finish_reason": st.none()}),
    max_size=2)}, optional={"id": st.just("c1"), "model": _PLAIN_TEXTS}))
def test_quick_token_settles_every_plain_chunk(chunk: dict[str, Any]) -> None:
    # Compact chunks of text deltas (what llama-server and vLLM send for each token) are
    # read from their bytes, and read as the parser reads them.
    raw = b"data: " + json.dumps(chunk, separators=(",", ":"),
                                 ensure_ascii=False).encode() + b"\n\n"
    assert quick_token(raw) is has_token(chunk["choices"])


def test_an_embeddings_entry_may_be_openai_content_parts() -> None:
    # llama-server joins an entry's text parts with no separator and loads its media
    # parts (tools/server/server-context.cpp, the embeddings handler); the suite's
    # test_embedding_content_text_same_as_string and test_embedding_invalid_input.
    import json

    from gateway.errors import InvalidRequest
    from gateway.wire.routes import BY_NAME
    from gateway.wire.validation import IMAGE_TOKENS

    parse = BY_NAME["embeddings"].parse
    req = parse(json.dumps({"input": ["hello world", {"content": [
        {"type": "text", "text": "hello "}, {"type": "text", "text": "world"}]}]}).encode())
    assert req.prompts == ("hello world", "hello world") and req.media == 0
    image = {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}
    req = parse(json.dumps({"input": {"content": [image, {"type": "text",
                                                          "text": "a cat"}]}}).encode())
    assert req.prompts == ("a cat",) and req.extra_prompt_tokens == IMAGE_TOKENS
    req = parse(json.dumps({"input": [[1, 2, 3], {"content": [image]}]}).encode())
    assert req.prompts == ((1, 2, 3), "") and req.media == 1
    video = {"type": "video_url", "video_url": {"url": "data:video/mp4;base64,AAAA"}}
    assert parse(json.dumps({"input": {"content": [video]}}).encode()).media == 1
    # Found by an adversarial pass: these were the gateway's own 500, or forwarded.
    for bad in ([], {"content": "string"}, {"content": [{"type": "unknown"}]},
                {"content": []}, {"content": [{"type": "text", "text": 5}]},
                ["ok", {"content": "string"}], ["ok", 5.5],
                {"content": [{"type": ["text"]}]}, {"content": [{"type": {}}]},
                {"prompt_string": "x", "multimodal_data": 5},
                [{"prompt_string": "x", "multimodal_data": True}],
                [{"content": [{"type": "text", "text": "a"}]}, ["a", "b"]],
                [{"content": [{"type": "text", "text": "a"}]}, [[1, 2], [3]]]):
        with pytest.raises(InvalidRequest) as info:
            parse(json.dumps({"input": bad}).encode())
        assert info.value.param == "input", bad
