"""The ``model`` an answer names, set from its bytes: :func:`rename_model`.

llama-server writes its model file's path into every answer's ``model``, the whole JSON
and every streamed chunk (measured on the build in use, started without ``--alias``:
``"model":"/home/…/x.gguf"``, even when the request named another model), so a client
would learn a path of the server. The gateway writes the served model's name there
instead (:func:`answer_name`), as the OpenAI API names the model that answered.

The relay passes answers through as bytes, so this works on bytes too: it finds each
``"model": "…"`` member of the JSON text(s) in a buffer (one whole answer, one SSE event,
an NDJSON line, or several of them back to back) and splices the new string in, without
parsing or re-serialising anything else. A member so named is rewritten at the top of
a JSON text or one object below it: an OpenAI chunk's or Ollama line's own ``model``, the
Anthropic ``message_start`` event's ``message.model`` and the OpenAI Responses
``response.model``. Deeper ones, and any under an array, are the answer's content and are
kept: a tool call's arguments as an object (Ollama's native ``message.tool_calls[].
function.arguments``, api/types.go; Anthropic's ``tool_use`` block ``input``) may well
have a ``model`` of its own. A ``model`` whose value is not a string (``null``) is left
as it is.

Why the bytes are enough: a JSON string cannot hold an unescaped quote, so inside a
string ``"model"`` appears only as ``\\"model\\"``; outside one, ``"model"`` followed by
``:`` is a member's name. A match whose opening quote is escaped (the byte before it a
backslash) is the end of another name and is skipped. Names are read as written: one
spelled with escapes (``"\\u006dodel"``), which no backend sends, is not recognised. A
``data:`` field split over several lines is read line by line: a member cut by a line
break is not recognised (llama-server, Ollama and vLLM write one line per event).
"""

from __future__ import annotations

import json
import re

__all__ = ["ECHOED_NAME_MAX", "EventRenamer", "answer_name", "rename_model", "served_name"]

#: The longest name a client asks for that answers repeat, characters (every streamed
#: event carries it); a longer one is answered with the served model's name.
ECHOED_NAME_MAX = 256

_KEY = b'"model"'
_SPACE = b" \t\r\n"
_QUOTE, _COLON, _BACKSLASH = 0x22, 0x3A, 0x5C
_DRIVE = re.compile(r"^[A-Za-z]:[\\/]")
# What is left of JSON text for its depth (_structure, _depth): its escapes taken out, every
# byte but quotes and brackets deleted, then the strings (now plain pairs of quotes and
# what brackets they held) taken out.
_NOT_STRUCTURE = bytes(b for b in range(256) if b not in b'"[]{}')
_BARE_STRING = re.compile(rb'"[^"]*"')


def _structure(text: bytes) -> bytes:
    """The unescaped quotes and the brackets of ``text`` (JSON, or a part of it that
    starts outside a string), in order: what its depth depends on. C-speed steps only:
    about a quarter of the time of a regular expression over the strings of ``text``
    (the SSE relay renames every event: issue 37). An escaped backslash pair goes first,
    so that the escaped quotes left are exactly those inside strings."""
    if b"\\" in text:
        text = text.replace(b"\\\\", b"").replace(b'\\"', b"")
    return text.translate(None, _NOT_STRUCTURE)


def _depth(structure: bytes) -> tuple[int, int]:
    """The objects and arrays left open by a text of this :func:`_structure` (openings
    less closings, outside strings), as :func:`rename_model` counts them."""
    brackets = _BARE_STRING.sub(b"", structure)
    return (brackets.count(b"{") - brackets.count(b"}"),
            brackets.count(b"[") - brackets.count(b"]"))


def served_name(model: str) -> str:
    """The name answers give a backend's model id: a file path (absolute, relative with
    ``./`` or ``../``, or any name of a ``.gguf`` file) by its file name without
    ``.gguf``; any other id (``Qwen/Qwen3-8B``, ``llama3.2:latest``) as it is.

    Without ``--alias``, llama-server reports its ``-m`` path as the id in ``/v1/models``
    (measured on the build in use); vLLM, without ``--served-model-name``, its
    ``--model`` argument, which may be a directory.
    """
    lowered = model.lower()
    if not (model.startswith(("/", "~", "./", "../", "\\")) or _DRIVE.match(model)
            or lowered.endswith(".gguf")):
        return model
    base = model.rstrip("/\\").replace("\\", "/").rsplit("/", 1)[-1]
    if base.lower().endswith(".gguf"):
        base = base[:-5]
    return base or model


def answer_name(name: str) -> bytes:
    """``name`` as a JSON string (quotes included), ready for :func:`rename_model`."""
    return json.dumps(name, ensure_ascii=False).encode()


def rename_model(raw: bytes, name: bytes) -> bytes:
    """``raw`` with the string value of each ``model`` member replaced by ``name``.

    :param raw: JSON text as received: a whole answer, or SSE events or NDJSON lines
        (any number, whole or not: a member is rewritten only when all of it is in
        ``raw``, so feed whole events).
    :param name: the new value, a JSON string with its quotes (:func:`answer_name`).
    :returns: ``raw`` itself when it names no model or only ``name`` already (no copy),
        else a new buffer of the same bytes but for the values replaced. About 4 µs for
        a llama-server chat chunk (twice :func:`gateway.wire.events.quick_token`'s time:
        the text before its ``model``, which follows ``choices``, is read for its
        depth); about 30 ms a megabyte of a whole answer with logprobs.
    """
    at = raw.find(_KEY)
    if at < 0:
        return raw
    parts: list[bytes] = []
    last = scanned = 0
    size = len(raw)
    objects = arrays = 0  # the objects and arrays open at ``scanned``
    while at >= 0:
        found = _value_at(raw, at, size)
        if found is None:
            at = raw.find(_KEY, at + 7)
            continue
        begin, end = found
        # In nested JSON, what is open of each kind is its openings less its closings.
        opened, opened_arrays = _depth(_structure(raw[scanned:at]))
        objects += opened
        arrays += opened_arrays
        scanned = end  # the name, the colon and the string value hold no bracket
        if objects <= 2 and arrays <= 0 and raw[begin:end] != name:
            parts += (raw[last:begin], name)
            last = end
        at = raw.find(_KEY, end)
    if not parts:
        return raw
    parts.append(raw[last:])
    return b"".join(parts)


class EventRenamer:
    """:func:`rename_model` for the events of one stream, one event per call, with what
    the last event renamed in full showed kept for the next ones.

    A stream's events are alike around their ``model``: llama-server writes it after the
    choices (the same bytes from it to the event's end, every token), vLLM and Ollama
    before them (the same bytes from the event's start to it, but for a second's
    ``created``). Once an event with one ``"model"`` in it has been renamed in full,
    the next event that starts with the same bytes up to that member's value (the
    *head*), or ends with the same bytes from that member on (the *tail*), with no other
    ``"model"`` in it, is renamed by a splice: about 1.2 us for a llama-server chunk
    where :func:`rename_model` takes about 3 (the SSE relay renames every event: issue
    37).

    Same bytes out as :func:`rename_model`, whatever came before: a head match has the
    same bytes before the member, so the same depth. A tail match has the same member
    and value, and the bytes before it are read for their depth (their quotes and
    brackets, at C speed), which must be the learnt event's: the depth and the value are all that
    :func:`rename_model` decides on (an earlier, malformed event cannot change how a
    later one is renamed, found by the adversarial pass).

    :param name: the new value, a JSON string with its quotes (:func:`answer_name`).
    """

    __slots__ = ("name", "_head", "_new_head", "_tail", "_new_tail", "_before", "_depth")

    def __init__(self, name: bytes) -> None:
        self.name = name
        self._head = self._new_head = self._tail = self._new_tail = b""
        self._before = b""  # the quotes and brackets before the learnt member
        self._depth = (0, 0)  # the objects and arrays they leave open

    def __call__(self, raw: bytes) -> bytes:
        """``raw``, one event (or NDJSON line), renamed as :func:`rename_model` would."""
        tail = self._tail
        if tail and raw.endswith(tail):
            at = len(raw) - len(tail)
            if raw.find(_KEY) == at and not (at and raw[at - 1] == _BACKSLASH):
                # The same quotes and brackets before it (a token's text has none,
                # mostly) is the same depth; else the depth itself must be the same.
                before = _structure(raw[:at])
                if before == self._before or _depth(before) == self._depth:
                    return raw if self._new_tail is tail else raw[:at] + self._new_tail
        head = self._head
        # (none after the head: one that starts in its last 6 bytes included)
        if head and raw.startswith(head) and raw.find(_KEY, len(head) - 6) < 0:
            return raw if self._new_head is head else self._new_head + raw[len(head):]
        out = rename_model(raw, self.name)
        self._learn(raw, out)
        return out

    def _learn(self, raw: bytes, out: bytes) -> None:
        """Keep the head and tail of ``raw`` (renamed in full as ``out``) when it has
        exactly one ``"model"`` member with a string value."""
        self._head = self._tail = b""
        at = raw.find(_KEY)
        if at <= 0 or raw.find(_KEY, at + 1) >= 0:
            return
        found = _value_at(raw, at, len(raw))
        if found is None:
            return
        end = found[1]
        self._head, self._tail = raw[:end], raw[at:]
        self._before = _structure(raw[:at])
        self._depth = _depth(self._before)
        if out is raw:
            self._new_head, self._new_tail = self._head, self._tail
        else:  # the member's value changed to the name: the same bytes around it
            shift = len(out) - len(raw)
            self._new_head, self._new_tail = out[: end + shift], out[at:]


def _value_at(raw: bytes, at: int, size: int) -> tuple[int, int] | None:
    """Where the string value of the ``"model"`` name at ``at`` starts (its opening
    quote) and ends (past its closing quote), or ``None``: the quote at ``at`` is
    escaped (inside a string), no ``:`` follows (a value, not a name), the value is not
    a string, or it does not end within ``raw``."""
    if at and raw[at - 1] == _BACKSLASH:
        return None
    if raw.startswith(b':"', at + 7):  # compact, as every backend writes it
        return _string_at(raw, at + 8)
    i = at + 7
    while i < size and raw[i] in _SPACE:
        i += 1
    if i >= size or raw[i] != _COLON:
        return None
    i += 1
    while i < size and raw[i] in _SPACE:
        i += 1
    if i >= size or raw[i] != _QUOTE:
        return None
    return _string_at(raw, i)


def _string_at(raw: bytes, begin: int) -> tuple[int, int] | None:
    """The JSON string whose opening quote is at ``begin``: ``(begin, past its closing
    quote)``, or ``None`` when it does not end within ``raw``."""
    i = begin
    while True:
        i = raw.find(b'"', i + 1)
        if i < 0:
            return None
        escapes = 0
        while raw[i - 1 - escapes] == _BACKSLASH:
            escapes += 1
        if escapes % 2 == 0:  # an odd run of backslashes escapes the quote
            return begin, i + 1
