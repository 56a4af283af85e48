"""A stream's token chunks settled by a splice of the last one learnt
(gateway/wire/splice.py): whatever the chunks, a spliced one is exactly the chunk renamed
in full, and one the inspector reads as output with nothing else in it; a chunk the splice
cannot settle is left to be read in full."""

from __future__ import annotations

import json
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gateway.wire.events import has_token, quick_token
from gateway.wire.naming import answer_name, rename_model
from gateway.wire.splice import MAX_STRIKES, TokenSplice

PATH = "/home/x/models/gemma-3-270m-q4_k_m.gguf"
NAME = answer_name("gemma")


def llama_chunk(text: str, created: int = 1) -> bytes:
    """A chat chunk as llama-server writes it: the model after the choices."""
    return ('data: {"choices":[{"finish_reason":null,"index":0,"delta":{"content":'
            f'{json.dumps(text, ensure_ascii=False)}}}}}],"created":{created},'
            f'"id":"chatcmpl-1","model":"{PATH}","system_fingerprint":"b0",'
            '"object":"chat.completion.chunk"}\n\n').encode()


def vllm_chunk(text: str) -> bytes:
    """A chat chunk as vLLM writes it: the model before the choices."""
    return ('data: {"id":"chatcmpl-1","object":"chat.completion.chunk","created":1,'
            f'"model":"{PATH}","choices":[{{"index":0,"delta":{{"content":'
            f'{json.dumps(text, ensure_ascii=False)}}},"logprobs":null,"finish_reason":null}}]}}\n\n').encode()


def relay(splice: TokenSplice, events: list[bytes]) -> list[tuple[bytes, bool]]:
    """What the SSE relay does with each event (gateway.relay.stream): the splice, else
    the reading and the renaming in full (then learnt). (bytes out, spliced)"""
    out = []
    for raw in events:
        spliced = splice(raw)
        if spliced is not None:
            out.append((spliced, True))
            continue
        renamed = rename_model(raw, NAME)
        if quick_token(raw) is True:
            splice.learn(raw, renamed)
        out.append((renamed, False))
    return out


@pytest.mark.parametrize("chunk", [llama_chunk, vllm_chunk])
def test_a_streams_later_tokens_are_spliced_and_renamed(chunk: Any) -> None:
    splice = TokenSplice()
    texts = ["Hel", "lo", " wor{l}d", "[", "é😀", "models", "a: b,"]
    out = relay(splice, [chunk(t) for t in texts])
    assert [spliced for _, spliced in out] == [False] + [True] * (len(texts) - 1)
    for (data, _), text in zip(out, texts, strict=True):
        parsed = json.loads(data[6:])
        assert parsed["model"] == "gemma" and PATH.encode() not in data
        assert parsed["choices"][0]["delta"]["content"] == text


@pytest.mark.parametrize("text", [
    'say "hi"', "back\\slash", "line\nbreak", "", "usage", "error", "finish_reason", "model",
    "content", "text", "tool_calls"])
def test_what_the_splice_leaves_to_the_full_reading(text: str) -> None:
    # A quote, an escape or a line break in the text, no text at all, or a text that
    # the chunk's quotes would make a name quick_token reads.
    splice = TokenSplice()
    relay(splice, [llama_chunk("x")])
    assert splice(llama_chunk(text)) is None


def test_a_new_second_is_learnt_again() -> None:
    # llama-server's created changes once a second: one chunk read in full, then spliced.
    splice = TokenSplice()
    out = relay(splice, [llama_chunk("a"), llama_chunk("b"), llama_chunk("c", 2),
                         llama_chunk("d", 2)])
    assert [spliced for _, spliced in out] == [False, True, False, True]


def test_what_is_not_a_plain_token_chunk_is_not_learnt() -> None:
    usage = b'data: {"choices":[],"usage":{"completion_tokens":3},"model":"m"}\n\n'
    two = b'data: {"choices":[{"index":0,"delta":{"content":"a","reasoning_content":"b"}}]}\n\n'
    tool = (b'data: {"choices":[{"index":0,"delta":{"tool_calls":[{"index":0,"function":'
            b'{"arguments":"{"}}]}}]}\n\n')
    for raw in (usage, two, tool, b"data: [DONE]\n\n"):
        splice = TokenSplice()
        splice.learn(raw, rename_model(raw, NAME))
        assert splice(raw) is None


def test_chunks_that_differ_every_time_stop_being_learnt() -> None:
    # A backend writing a new id in every chunk: each learnt shape is replaced before it
    # matched; after MAX_STRIKES of those, nothing more is learnt.
    splice = TokenSplice()
    for n in range(MAX_STRIKES + 1):
        raw = llama_chunk("a").replace(b"chatcmpl-1", f"chatcmpl-{n}".encode())
        splice.learn(raw, rename_model(raw, NAME))
    assert splice(raw) is None


_TEXTS = st.lists(st.sampled_from(list('ab "\\:{}[],\n\r\u00e9') + [
    "usage", "error", "model", "content", "finish_reason", '"model":"x"']),
    max_size=4).map("".join)
_CHUNKS = st.builds(
    lambda content, other, model_first, created: {
        **({"model": PATH} if model_first else {}),
        "choices": [{"index": 0, "delta": {"content": content, **other},
                     "finish_reason": None}],
        "created": created,
        **({} if model_first else {"model": PATH})},
    content=st.one_of(st.none(), _TEXTS), other=st.fixed_dictionaries({}, optional={
        "reasoning_content": st.one_of(st.none(), st.just(""), _TEXTS)}),
    model_first=st.booleans(), created=st.integers(1, 2))


@settings(max_examples=300, deadline=None)
@given(chunks=st.lists(_CHUNKS, min_size=1, max_size=8), ascii_only=st.booleans())
def test_a_spliced_chunk_is_the_chunk_read_and_renamed_in_full(
        chunks: list[dict[str, Any]], ascii_only: bool) -> None:
    splice = TokenSplice()
    events = [b"data: " + json.dumps(c, separators=(",", ":"), ensure_ascii=ascii_only)
              .encode() + b"\n\n" for c in chunks]
    for (data, spliced), raw, chunk in zip(relay(splice, events), events, chunks,
                                           strict=True):
        assert data == rename_model(raw, NAME)
        if spliced:
            assert quick_token(raw) is True and has_token(chunk["choices"])


_PIECES = st.sampled_from([b"data: ", b"{", b"}", b"[", b"]", b'"model":"m"', b'"model"',
                           b'"content":"', b'"content":"t"', b":", b",", b'"x"', b"\\",
                           b'\\"', b"\n\n", b" ", b"null", b'"usage"'])


@settings(max_examples=400, deadline=None)
@given(events=st.lists(st.lists(_PIECES, max_size=10).map(b"".join), min_size=1,
                       max_size=6),
       texts=st.lists(_TEXTS.map(str.encode), min_size=1, max_size=4))
def test_malformed_chunks_are_spliced_only_as_read_in_full(
        events: list[bytes], texts: list[bytes]) -> None:
    # Not JSON, or half of it, each followed by the same bytes with other texts: what is
    # spliced is what quick_token reads as output and rename_model renames alike.
    stream = []
    for raw in events:
        stream.append(raw)
        stream += [raw.replace(b'"content":"t"', b'"content":"' + t + b'"') for t in texts]
    splice = TokenSplice()
    for (data, spliced), raw in zip(relay(splice, stream), stream, strict=True):
        assert data == rename_model(raw, NAME), stream
        if spliced:
            assert quick_token(raw) is True, stream


# -- found by the adversarial pass: a malformed learnt chunk leaked the model's path -----

def test_a_text_followed_by_a_colon_never_hides_a_model_member() -> None:
    # Not JSON: the text "model" with a colon after it is a member's name.
    def event(text: bytes) -> bytes:
        return b'data: {"content":"' + text + b'":"/home/u/m.gguf"}\n\n'
    out = relay(TokenSplice(), [event(b"hi"), event(b"model")])
    assert out[1][0] == rename_model(event(b"model"), NAME)


def test_a_stray_quote_never_changes_a_later_chunks_depth() -> None:
    # Not JSON: with a stray quote before it, the text is outside a string and its
    # brackets count.
    def event(text: bytes) -> bytes:
        return b'data: {"a"b","content":"' + text + b'","model":"/p.gguf"}\n\n'
    out = relay(TokenSplice(), [event(b"{{{"), event(b"hi")])
    assert out[1][0] == rename_model(event(b"hi"), NAME)
