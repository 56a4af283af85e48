"""What a request's prompt is made of, to pin it to the slot whose cached prompt it
continues (slot affinity). Pure: no I/O.

llama-server keeps each slot's last prompt (``cache_prompt``): a request sent to that slot
(``id_slot``) computes only the part that is new. A conversation's next turn repeats
every earlier message and adds to them, so it *extends* what its slot last held; a new
conversation that only shares an opening (a system prompt, "Hi") with it does not, and
is left to the least recently used slot, where it evicts nothing of value.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from typing import Any

__all__ = ["AFFINITY_PROMPT_CHARS", "Prefix", "digest", "prefix_of"]

# Block size of a prompt string's fingerprint, characters (also how much of a prompt
# keys its conversation for backend affinity, gateway.fleet.pool.affinity_key).
AFFINITY_PROMPT_CHARS = 2048


@dataclass(frozen=True)
class Prefix:
    """What a request's prompt is made of, to find the slot whose cached prompt it
    continues: one hash per message of a chat-shaped body, or, for a prompt string, its
    length and the hash of every :data:`AFFINITY_PROMPT_CHARS`-character block."""

    parts: tuple[str, ...]
    length: int = 0  # characters of a prompt string (0 for messages)

    def extends(self, held: Prefix) -> bool:
        """This request begins with all of ``held`` (a slot's last prompt) and adds to
        it: it continues that conversation, so the slot's cache serves all but the new
        part. Identical openings of different conversations do not extend each other,
        so they spread over the slots instead of queueing for one."""
        n = len(held.parts)
        return 0 < n <= len(self.parts) and self.parts[:n] == held.parts and (
            len(self.parts) > n or self.length > held.length)


def digest(value: Any, size: int = 8) -> str | None:
    """A hash of ``value`` as sorted JSON (``size`` bytes, as hex), or ``None`` when it
    is not JSON-serialisable."""
    try:
        text = json.dumps(value, sort_keys=True, ensure_ascii=False)
    except (TypeError, ValueError):
        return None
    return hashlib.blake2b(text.encode("utf-8", "surrogatepass"), digest_size=size).hexdigest()


def prefix_of(body: dict[str, Any]) -> Prefix | None:
    """The :class:`Prefix` of a chat-shaped body (its system field and each message) or
    of a string prompt (whole blocks only, so that a prompt that only grows keeps its
    earlier blocks); ``None`` for other bodies."""
    messages = body.get("messages") or body.get("input")
    if isinstance(messages, list) and messages:
        parts = [digest(body.get("system")), *(digest(m) for m in messages)]
        if None in parts:
            return None
        return Prefix(tuple(p for p in parts if p is not None))
    prompt = body.get("prompt")
    if isinstance(prompt, str) and prompt:
        size = AFFINITY_PROMPT_CHARS
        blocks = [digest(prompt[i:i + size]) for i in range(0, len(prompt) - size + 1, size)]
        if not blocks:
            return None
        return Prefix(tuple(b for b in blocks if b is not None), len(prompt) // size * size)
    return None
