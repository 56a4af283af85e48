"""A stream's plain token chunks, read and renamed by a splice: :class:`TokenSplice`.

The SSE relay reads every event of an OpenAI stream for whether it carries output
(:func:`gateway.wire.events.quick_token`, about 4 us a llama-server chunk) and renames its
``model`` (:class:`gateway.wire.naming.EventRenamer`, about 2 us). A stream's token
chunks are the same bytes but for the token's text: llama-server, vLLM and Ollama write
each one as the last with another string in ``delta.content`` (and, once a second, another
``created``). Once one such chunk has been read and renamed, the next one that is the
same bytes around its text, with no quote, backslash or line break in the text, is a
token chunk renamed the same way: the splice settles both in about half a microsecond
(issue 37).

Why the splice is exact: the text sits between the learnt chunk's quotes, so with no
quote or backslash in it the quotes pair up as before and every bracket in it is inside
a string. The JSON members, their depth and every ``model`` value are then those of the
learnt chunk, which is all :func:`~gateway.wire.naming.rename_model` decides on, and
``quick_token`` finds the same names with the same values, the text's being a non-empty
string. That holds when the learnt chunk is JSON: only JSON is learnt (in a malformed one
a stray quote pairs the text's quotes otherwise, or a colon after the text makes it a
member's name). A text that is itself one of the names ``quick_token`` or the renamer
looks for (``usage``, ``error``, ``finish_reason``, ``model``, an output name), which the
chunk's quotes around it would turn into that name, is not settled here.
"""

from __future__ import annotations

import orjson

from gateway.wire.events import OUTPUT_NAMES, quick_token

__all__ = ["MAX_STRIKES", "TokenSplice"]

#: Learnt shapes replaced before any chunk matched them, after which a stream's chunks
#: are no longer learnt (each is read in full: a backend whose chunks differ each time,
#: an ``id`` per chunk say, pays the learning only this many times).
MAX_STRIKES = 8

_KEY = b'"model"'
# Every byte but those that end or escape a JSON string, or break an SSE line.
_PLAIN = bytes(b for b in range(256) if b not in b'"\\\n\r')
# What a text between two quotes would turn into a name quick_token reads.
_NAMES = frozenset({b"usage", b"error", b"finish_reason", b"model"}
                   | {n[1:-1] for n in OUTPUT_NAMES})


class TokenSplice:
    """The plain token chunks of one OpenAI stream (``data: {…}`` events), each settled
    from the bytes of the last one learnt.

    ``splice(raw)`` is ``raw`` renamed (as the stream's renamer renamed the learnt chunk)
    when ``raw`` is a token chunk of the learnt shape, else ``None`` (read it in full);
    :meth:`learn` takes a chunk read in full and its renamed bytes.
    """

    __slots__ = ("_head", "_tail", "_new_head", "_new_tail", "_least", "_hits", "_strikes")

    def __init__(self) -> None:
        self._head = self._tail = self._new_head = self._new_tail = b""
        self._least = 0  # the learnt head and tail's length: a chunk must be longer
        self._hits = 0  # chunks spliced since the last learning
        self._strikes = 0

    def __call__(self, raw: bytes) -> bytes | None:
        """``raw`` renamed when it is a token chunk of the learnt shape, else ``None``."""
        head, tail = self._head, self._tail
        if (len(raw) <= self._least or not raw.startswith(head) or not raw.endswith(tail)
                or not head):
            return None
        text = raw[len(head):len(raw) - len(tail)]
        if text.translate(None, _PLAIN) or text in _NAMES:
            return None
        self._hits += 1
        return self._new_head + text + self._new_tail

    def learn(self, raw: bytes, renamed: bytes) -> None:
        """Keep the shape of ``raw``, an event read in full whose renamed bytes are
        ``renamed``, when it is a plain token chunk (``quick_token`` settles it as output,
        its ``data:`` is one JSON text) with exactly one non-empty string among its
        output members, plain text, and every ``model`` member before that text or every
        one after it."""
        if self._head and not self._hits:
            self._strikes += 1
        self._head, self._hits = b"", 0
        if self._strikes >= MAX_STRIKES or quick_token(raw) is not True:
            return
        try:  # (its bytes decide how the next ones read: JSON only, found by the
            orjson.loads(raw[6:])  # adversarial pass, where a stray quote or a text
        except orjson.JSONDecodeError:  # followed by a colon moved a model member)
            return
        start = -1
        for name in OUTPUT_NAMES:  # (quick_token: each is a key followed by a colon)
            at = raw.find(name)
            while at >= 0:
                value = at + len(name) + 1
                if raw[value:value + 1] == b'"' and raw[value + 1:value + 2] != b'"':
                    if start >= 0:
                        return  # two texts
                    start = value + 1
                at = raw.find(name, value)
        end = raw.find(b'"', start) if start >= 0 else -1
        if end < 0 or raw[start:end].translate(None, _PLAIN):
            return
        head, text, tail = raw[:start], raw[start:end], raw[end:]
        if renamed == raw:
            new_head, new_tail = head, tail
        elif _KEY not in head and renamed.startswith(head + text):
            new_head, new_tail = head, renamed[end:]
        elif _KEY not in tail and renamed.endswith(text + tail):
            new_head, new_tail = renamed[:len(renamed) - len(text) - len(tail)], tail
        else:
            return
        self._head, self._tail, self._new_head, self._new_tail = head, tail, new_head, new_tail
        self._least = len(head) + len(tail)
