"""Incremental splitting of a server-sent-event byte stream into whole raw events.

The gateway forwards each event byte for byte, so it needs the raw bytes of each event,
not a re-serialised one; a parsing library gives decoded fields only. This is the small
part it needs: find event boundaries (a blank line: ``\\n\\n``, ``\\r\\n\\r\\n`` or
``\\r\\r``, per the WHATWG SSE spec) across arbitrary chunk splits, and read the ``data``
field of one event.
"""

from __future__ import annotations

import re

__all__ = ["EventSplitter", "event_data"]

_BOUNDARY = re.compile(rb"\r\n\r\n|\n\n|\r\r")
_LINE = re.compile(rb"\r\n|\n|\r")


class EventSplitter:
    """Feed chunks in, get complete raw events (each with its terminating blank line) out."""

    def __init__(self) -> None:
        self._buffer = b""

    def feed(self, chunk: bytes) -> list[bytes]:
        """Add ``chunk``; return the events it completed, in order."""
        self._buffer += chunk
        events: list[bytes] = []
        start = 0
        for match in _BOUNDARY.finditer(self._buffer):
            events.append(self._buffer[start : match.end()])
            start = match.end()
        self._buffer = self._buffer[start:]
        return events

    def rest(self) -> bytes:
        """Bytes of an unterminated last event (empty when the stream ended cleanly)."""
        return self._buffer


def event_data(raw: bytes) -> str | None:
    """Return the event's ``data`` (lines joined by ``\\n``), or ``None`` if it has none.

    Comment lines (``:``) and other fields are ignored.
    """
    lines = []
    for line in _LINE.split(raw):
        if line.startswith(b"data:"):
            value = line[5:]
            lines.append(value[1:] if value.startswith(b" ") else value)
    if not lines:
        return None
    return b"\n".join(lines).decode("utf-8", errors="replace")
