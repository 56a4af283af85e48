"""The SSE event splitter on split, CRLF and mixed chunks."""

from __future__ import annotations

import re

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gateway.wire.sse import EventSplitter, event_data

EVENTS = [b'data: {"a": 1}\n\n', b": keepalive\n\n", b"data: [DONE]\n\n"]


def test_whole_events_in_one_chunk() -> None:
    s = EventSplitter()
    assert s.feed(b"".join(EVENTS)) == EVENTS and s.rest() == b""


def test_crlf_events() -> None:
    s = EventSplitter()
    assert s.feed(b"data: x\r\n\r\ndata: y\r\n\r\n") == [b"data: x\r\n\r\n", b"data: y\r\n\r\n"]


def test_unterminated_rest_is_kept() -> None:
    s = EventSplitter()
    assert s.feed(b"data: x\n\ndata: partial") == [b"data: x\n\n"]
    assert s.rest() == b"data: partial"


@given(st.lists(st.integers(1, 40), min_size=1, max_size=30))
def test_any_split_gives_the_same_events(cuts: list[int]) -> None:
    stream = b"".join(EVENTS * 3)
    s, out, pos = EventSplitter(), [], 0
    for cut in cuts:
        out += s.feed(stream[pos : pos + cut])
        pos += cut
    out += s.feed(stream[pos:])
    assert out == EVENTS * 3


def _reference(stream: bytes, boundary: bytes) -> tuple[list[bytes], bytes]:
    """Events and rest by one leftmost search after another over the whole stream."""
    events, start = [], 0
    for match in re.finditer(boundary, stream):
        events.append(stream[start : match.end()])
        start = match.end()
    return events, stream[start:]


@settings(max_examples=500)
@pytest.mark.parametrize("lines", [False, True])
@given(stream=st.lists(st.sampled_from([b"a", b"{", b"\n", b"\r", b"\n\n", b"data: x"]),
                       max_size=40).map(b"".join),
       cuts=st.lists(st.integers(0, 12), max_size=10))
def test_whole_chunks_split_as_a_search_would(lines: bool, stream: bytes,
                                              cuts: list[int]) -> None:
    # The fast path (a chunk of whole events, no CR, nothing buffered) and the buffered
    # search find the same events, however the stream is cut.
    boundary = rb"\n" if lines else rb"\r\n\r\n|\n\n|\r\r"
    s, out, pos = EventSplitter(lines=lines), [], 0
    for cut in [*cuts, len(stream)]:
        out += s.feed(stream[pos : pos + cut])
        pos += cut
    assert (out, s.rest()) == _reference(stream, boundary)


def test_event_data() -> None:
    assert event_data(b'data: {"a": 1}\n\n') == '{"a": 1}'
    assert event_data(b"data:x\ndata: y\n\n") == "x\ny"
    assert event_data(b": comment\n\n") is None
    assert event_data(b"event: error\ndata: boom\n\n") == "boom"


@given(st.binary(max_size=64).filter(lambda b: b"\n" not in b and b"\r" not in b),
       st.sampled_from([b"data: ", b"data:"]), st.sampled_from([b"\n\n", b"\r\n\r\n"]))
def test_one_line_events_read_the_same_on_the_fast_path(payload: bytes, field: bytes,
                                                          end: bytes) -> None:
    got = event_data(field + payload + end)
    value = payload[1:] if field == b"data:" and payload.startswith(b" ") else payload
    assert got == value.decode("utf-8", errors="replace")
