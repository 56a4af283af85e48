"""Incremental splitting of a server-sent-event byte stream into whole raw events.

The gateway forwards each event byte for byte, so it needs the raw bytes of each event,
not a re-serialised one; a parsing library gives decoded fields only. This is the small
part it needs: find event boundaries (a blank line: ``\\n\\n``, ``\\r\\n\\r\\n`` or
``\\r\\r``, per the WHATWG SSE spec) across arbitrary chunk splits, and read the ``data``
field of one event.
"""

from __future__ import annotations

import re

__all__ = ["EventSplitter", "EventTooLarge", "event_data"]

_BOUNDARY = re.compile(rb"\r\n\r\n|\n\n|\r\r")
_NEWLINE = re.compile(rb"\n")
_LINE = re.compile(rb"\r\n|\n|\r")


class EventTooLarge(ValueError):
    """Raised when one event grows past the splitter's ``max_event_bytes``."""


class EventSplitter:
    """Feed chunks in, get complete raw events (each with its terminating blank line) out.

    Work is linear in the bytes fed: each call scans the new bytes, and the kept ones
    only once a boundary came.

    :param max_event_bytes: largest event accepted; a longer one raises
        :class:`EventTooLarge` so that one response cannot hold unbounded memory.
    :param lines: split newline-delimited JSON (Ollama's native streams) into lines
        instead of SSE events.
    """

    def __init__(self, max_event_bytes: int = 8 * 1024 * 1024, *, lines: bool = False) -> None:
        self._boundary = _NEWLINE if lines else _BOUNDARY
        self._end = b"\n" if lines else b"\n\n"  # the boundary, while no CR is about
        self._buffer = bytearray()
        self._scanned = 0  # bytes of the buffer already searched for a boundary
        self._max = max_event_bytes
        self._cr = False  # a CR came: boundaries are searched for (_search) from then on

    def feed(self, chunk: bytes) -> list[bytes]:
        """Add ``chunk``; return the events it completed, in order.

        Without a CR in the stream the boundary is one fixed string, and ``bytes.split``
        finds the same events a leftmost search does, with a copy of each event and of
        no more: the SSE relay's every event goes through here (issue 37). A chunk with
        no boundary in it is only kept. Once a CR has come, :meth:`_search` reads the
        rest of the stream.

        :raises EventTooLarge: the unterminated event is longer than ``max_event_bytes``.
        """
        if self._cr or b"\r" in chunk:
            self._cr = True
            return self._search(chunk)
        end, buffer = self._end, self._buffer
        if buffer:
            # (an SSE boundary may begin with the kept bytes' last newline)
            if end not in chunk and not (chunk[:1] == b"\n" == buffer[-1:]):
                buffer += chunk
                self._check(len(buffer))
                return []
            data = bytes(buffer) + chunk
            buffer.clear()
        else:
            data = chunk
        if data.find(end) == len(data) - len(end) >= 0:  # one whole event: most reads
            return [data]
        *events, rest = data.split(end)
        if rest:
            buffer += rest
            self._check(len(buffer))
        return [event + end for event in events]

    def _search(self, chunk: bytes) -> list[bytes]:
        """:meth:`feed` by a search for any boundary, scanning only the new bytes (plus
        the 3 before them, where a boundary may have started)."""
        self._buffer += chunk
        events: list[bytes] = []
        start = 0
        pos = max(0, self._scanned - 3)
        while (match := self._boundary.search(self._buffer, pos)) is not None:
            events.append(bytes(self._buffer[start : match.end()]))
            start = pos = match.end()
        if start:
            del self._buffer[:start]
        self._scanned = len(self._buffer)
        self._check(self._scanned)
        return events

    def _check(self, kept: int) -> None:
        if kept > self._max:
            raise EventTooLarge(f"an SSE event exceeded {self._max} bytes")

    def rest(self) -> bytes:
        """Bytes of an unterminated last event (empty when the stream ended cleanly)."""
        return bytes(self._buffer)


def event_data(raw: bytes) -> str | None:
    """Return the event's ``data`` (lines joined by ``\\n``), or ``None`` if it has none.

    Comment lines (``:``) and other fields are ignored.
    """
    if raw.startswith(b"data: ") and raw.find(b"\n") == len(raw) - 2 and raw.find(
            b"\r") < 0:
        return raw[6:-2].decode("utf-8", errors="replace")  # one data line: most events
    lines = []
    for line in _LINE.split(raw):
        if line.startswith(b"data:"):
            value = line[5:]
            lines.append(value[1:] if value.startswith(b" ") else value)
    if not lines:
        return None
    return b"\n".join(lines).decode("utf-8", errors="replace")
