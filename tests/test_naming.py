"""The ``model`` of answers set from their bytes (gateway/wire/naming.py): every member
named ``model`` with a string value at the top of the answer or one object below is
rewritten, nothing else changes (a tool call's own ``model`` argument is kept), and a name
inside a string is never taken for a member."""

from __future__ import annotations

import json
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gateway.wire import naming
from gateway.wire.naming import EventRenamer, answer_name, rename_model, served_name

PATH = "/home/x/models/gemma-3-270m-q4_k_m.gguf"
NAME = answer_name("gemma")

# As llama-server writes them (measured on the build in use).
CHUNK = ('data: {"choices":[{"finish_reason":null,"index":0,"delta":{"content":"<"}}],'
         f'"created":1,"id":"chatcmpl-1","model":"{PATH}","system_fingerprint":"b0",'
         '"object":"chat.completion.chunk"}\n\n').encode()
MESSAGE_START = ('event: message_start\ndata: {"type":"message_start","message":{"id":"m",'
                 f'"type":"message","role":"assistant","content":[],"model":"{PATH}",'
                 '"usage":{"input_tokens":5,"output_tokens":0}}}\n\n').encode()


def test_a_chunk_names_the_served_model_and_keeps_every_other_byte() -> None:
    out = rename_model(CHUNK, NAME)
    assert out == CHUNK.replace(PATH.encode(), b"gemma")
    assert json.loads(out[6:])["model"] == "gemma"


def test_a_nested_model_is_renamed_too() -> None:
    # Anthropic's message_start (message.model), in an event with an event: line.
    out = rename_model(MESSAGE_START, NAME)
    assert out == MESSAGE_START.replace(PATH.encode(), b"gemma")


def test_several_events_of_one_read_are_all_renamed() -> None:
    out = rename_model(CHUNK * 3 + b"data: [DONE]\n\n", NAME)
    assert out.count(b'"model":"gemma"') == 3 and PATH.encode() not in out


def test_ollama_ndjson_lines_are_renamed() -> None:
    # api/types.go ChatResponse: "model" first, then created_at and message.
    line = b'{"model":"llama3.2:latest","created_at":"t","message":{"role":"assistant",' \
           b'"content":"hi"},"done":false}\n'
    assert rename_model(line * 2, NAME) == line.replace(b"llama3.2:latest", b"gemma") * 2


def test_nothing_to_rename_returns_the_same_object() -> None:
    done = b"data: [DONE]\n\n"
    assert rename_model(done, NAME) is done
    already = CHUNK.replace(PATH.encode(), b"gemma")
    assert rename_model(already, NAME) is already
    null = b'{"model":null,"x":1}'
    assert rename_model(null, NAME) is null


def test_a_model_inside_a_string_is_left_alone() -> None:
    # Generated text that says "model": "x" is escaped inside its string.
    raw = json.dumps({"content": 'say "model": "secret"', "text": '{"model":"y"}'}).encode()
    assert rename_model(raw, NAME) is raw
    # A member whose name ends with an escaped quote before model.
    raw = json.dumps({'a"model': "keep", "model": PATH}).encode()
    assert json.loads(rename_model(raw, NAME)) == {'a"model': "keep", "model": "gemma"}


def test_spacing_and_escapes_in_the_value_are_read() -> None:
    raw = b'{"model" :\n "C:\\\\models\\\\x \\"q\\".gguf", "n": 1}'
    assert json.loads(rename_model(raw, NAME)) == {"model": "gemma", "n": 1}


def test_answer_name_is_a_json_string() -> None:
    assert answer_name('a "quoted"\nname') == json.dumps('a "quoted"\nname').encode()
    raw = rename_model(b'{"model":"x"}', answer_name('a "b"'))
    assert json.loads(raw) == {"model": 'a "b"'}


def test_a_tool_calls_own_model_argument_is_kept() -> None:
    # Ollama's native chat: arguments as an object (api/types.go ToolCallFunction);
    # Anthropic's tool_use block: input as an object. Both are the answer's content.
    ollama = (b'{"model":"llama3.2","message":{"role":"assistant","content":"","tool_calls":'
              b'[{"function":{"name":"car","arguments":{"model":"civic"}}}]},"done":true}\n')
    anthropic = json.dumps({"content": [{"type": "tool_use", "id": "t", "name": "car",
                                         "input": {"model": "civic", "deep": {"model": "x"}}}],
                            "id": "m", "model": PATH, "type": "message"}).encode()
    assert json.loads(rename_model(ollama, NAME))["message"]["tool_calls"][0][
        "function"]["arguments"] == {"model": "civic"}
    out = json.loads(rename_model(anthropic, NAME))
    assert out["model"] == "gemma" and out["content"][0]["input"] == {
        "model": "civic", "deep": {"model": "x"}}
    # Three objects deep is content too, in an event as in a whole answer.
    event = b'data: {"message":{"meta":{"model":"keep"},"model":"' + PATH.encode() + b'"}}\n\n'
    assert rename_model(event, NAME) == event.replace(PATH.encode(), b"gemma")


def _renamed(value: Any, name: str, depth: int = 0) -> Any:
    """The reference: every "model" member with a string value, in the top object or an
    object directly in it, set to ``name``."""
    if isinstance(value, dict):
        return {k: name if k == "model" and isinstance(v, str) and depth < 2
                else _renamed(v, name, depth + 1) for k, v in value.items()}
    if isinstance(value, list):
        return [_renamed(v, name, 99) for v in value]
    return value


_text = st.text(alphabet=st.sampled_from(list('model"\\:{},[] \n\tx\u00e9')), max_size=12)
_keys = st.one_of(st.just("model"), _text)
_json = st.recursive(
    st.one_of(st.none(), st.booleans(), st.integers(), _text),
    lambda inner: st.one_of(st.lists(inner, max_size=4),
                            st.dictionaries(_keys, inner, max_size=4)),
    max_leaves=12)


@settings(max_examples=300, deadline=None)
@given(doc=st.dictionaries(_keys, _json, max_size=5), name=_text,
       indent=st.sampled_from([None, 1]), ascii_only=st.booleans())
def test_renaming_the_bytes_equals_renaming_the_parsed_json(
        doc: dict[str, Any], name: str, indent: int | None, ascii_only: bool) -> None:
    raw = json.dumps(doc, indent=indent, ensure_ascii=ascii_only).encode()
    assert json.loads(rename_model(raw, answer_name(name))) == _renamed(doc, name)


@settings(max_examples=300, deadline=None)
@given(base=st.dictionaries(_keys, _json, min_size=1, max_size=5),
       changes=st.lists(st.tuples(st.integers(0, 4), _json), max_size=8),
       name=_text, ndjson=st.booleans())
def test_a_streams_renamer_equals_renaming_each_event_in_full(
        base: dict[str, Any], changes: list[tuple[int, Any]], name: str,
        ndjson: bool) -> None:
    # Events alike but for one member's value each time (before or after the model,
    # the model itself, or the model's own object): what the renamer keeps of one event
    # never renames the next differently.
    keys, docs = list(base), [base]
    for index, value in changes:
        docs.append({**docs[-1], keys[index % len(keys)]: value})
    renamer, new = EventRenamer(answer_name(name)), answer_name(name)
    for doc in docs:
        text = json.dumps(doc, separators=(",", ":"), ensure_ascii=False).encode()
        raw = text + b"\n" if ndjson else b"data: " + text + b"\n\n"
        assert renamer(raw) == rename_model(raw, new)


_PIECES = st.sampled_from([b"data: ", b"{", b"}", b"[", b"]", b'"model":"m"', b'"model"',
                           b":", b",", b'"x"', b"\\", b'\\"', b": [\n", b"\n\n", b" "])


@settings(max_examples=400, deadline=None)
@given(events=st.lists(st.lists(_PIECES, max_size=8).map(b"".join), min_size=1,
                       max_size=6))
def test_malformed_events_never_change_how_later_ones_are_renamed(
        events: list[bytes]) -> None:
    # Not JSON at all, or half of it: whatever came before, each event is renamed as
    # rename_model renames it alone (the tail's depth is read, not assumed).
    renamer = EventRenamer(NAME)
    for raw in events:
        assert renamer(raw) == rename_model(raw, NAME), events


@pytest.mark.parametrize("events", [
    [b'data: {"model":"m"}\n\n', b'data: [{"model":"m"}\n\n'],
    [b'data: [{"model":"m"}\n\n', b'data: {"model":"m"}\n\n'],
    [b'data: {"a":[{"model":"m"}\n\n', b'data: {"model":"m"}\n\n'],
    [b': [\ndata: {"model":"m"}\n\n', b'data: {"model":"m"}\n\n'],
    [b'x[{"model":"m"}', b'"model":"m"}'],
])
def test_the_adversarial_passes_sequences(events: list[bytes]) -> None:
    renamer = EventRenamer(NAME)
    assert [renamer(raw) for raw in events] == [rename_model(raw, NAME) for raw in events]


@pytest.mark.parametrize("first,later", [
    # llama-server: the model after the choices (its tail is the same every token)
    (CHUNK, [CHUNK.replace(b'"<"', b'"' + t + b'"') for t in (b"a", b"bc", b"\\\"")]),
    # Ollama's native lines: the model first (the head is the same every line)
    (b'{"model":"llama3.2","created_at":"t","message":{"content":"a"},"done":false}\n',
     [b'{"model":"llama3.2","created_at":"t","message":{"content":"' + t + b'"},'
      b'"done":false}\n' for t in (b"x", b"yz", b"\\\\")]),
])
def test_a_streams_later_events_are_renamed_by_a_splice(
        monkeypatch: pytest.MonkeyPatch, first: bytes, later: list[bytes]) -> None:
    renamer = EventRenamer(NAME)
    assert renamer(first) == rename_model(first, NAME)
    full: list[bytes] = []
    monkeypatch.setattr(naming, "rename_model",
                        lambda raw, name: full.append(raw) or rename_model(raw, name))
    assert [renamer(raw) for raw in later] == [rename_model(raw, NAME) for raw in later]
    assert full == []  # none of them read in full


@pytest.mark.parametrize("model,served", [
    ("/home/x/models/gemma-3-270m-q4_k_m.gguf", "gemma-3-270m-q4_k_m"),
    ("models/qwen.GGUF", "qwen"),
    ("./m.gguf", "m"),
    ("C:\\models\\phi.gguf", "phi"),
    ("/srv/models/Llama-3-8B/", "Llama-3-8B"),
    ("~/weights/mistral", "mistral"),
    ("Qwen/Qwen3-8B", "Qwen/Qwen3-8B"),  # a hub id, not a path
    ("llama3.2:latest", "llama3.2:latest"),
    ("gemma", "gemma"),
])
def test_served_name_of_a_path_is_its_file_name(model: str, served: str) -> None:
    assert served_name(model) == served
