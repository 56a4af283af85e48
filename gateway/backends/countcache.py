"""Exact prompt counts a backend already gave, kept so that the same prompt is not sent
to it to be counted again (pure, synchronous).

Counting a prompt exactly costs a round trip to the backend: about a fifth of the
gateway's CPU time per request in ``make bench``, and the backend's own time to template
and tokenize it. The count of a prompt depends only on the fields that build it and on
the backend's model and template, so a count once answered can be reused for a request
that differs only in how it is sampled (``max_tokens``, ``temperature``, ``seed``...):
a retry, the same prompt sampled again, an evaluation that runs each prompt several
times.

The key is a 16-byte BLAKE2b digest of the route and the body without those fields,
serialised with sorted keys (so that key order does not matter). The owner clears the
cache when the backend may have changed its model or template: it was unreachable, it
shows another model, template or build (:meth:`gateway.backends.target.Target.discover`), or it
reported a prompt count other than the exact one charged (then that prompt's count
only is dropped: ``ProxyResponse``).
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from typing import Any

import orjson

__all__ = ["UNSHAPING_FIELDS", "CountCache"]

# Request fields that do not change the prompt a backend builds (sampling, output length,
# the gateway's own) and that its counting call checks in no combination with others.
# (llama-server's ``oaicompat_chat_params_parse`` refuses logprobs with tools and
# stream, and top_logprobs without logprobs, so those stay in the key: such a request is
# sent to be counted, and refused there.) Every other field is part of the key, so an
# unknown field can only cost a miss, never a wrong count.
UNSHAPING_FIELDS = frozenset({
    "max_tokens", "max_completion_tokens", "n_predict", "temperature", "top_p", "top_k",
    "min_p", "typical_p", "seed", "presence_penalty", "frequency_penalty",
    "repeat_penalty", "logit_bias", "stop", "user", "priority", "id_slot", "cache_prompt",
    "timings_per_token",
})


class CountCache:
    """A bounded map from a prompt's key to its exact token count, least recently used
    first out.

    :param size: most entries kept (0 keeps none: every lookup misses). An entry takes
        about 150 bytes.
    """

    def __init__(self, size: int) -> None:
        self.size = size
        self._counts: OrderedDict[bytes, int] = OrderedDict()
        self.hits = 0
        self.misses = 0

    def __len__(self) -> int:
        return len(self._counts)

    def key(self, route: str, body: dict[str, Any]) -> bytes | None:
        """The key of ``body`` on ``route``, or ``None`` when it cannot be keyed (the
        cache is off, or the body holds what the fast serialiser refuses, such as an
        integer beyond 64 bits): such a request is simply counted by the backend."""
        if self.size <= 0:
            return None
        shaping = {k: v for k, v in body.items() if k not in UNSHAPING_FIELDS}
        try:
            data = orjson.dumps(shaping, option=orjson.OPT_SORT_KEYS)
        except TypeError:  # orjson.JSONEncodeError is one
            return None
        return hashlib.blake2b(route.encode() + b"\0" + data, digest_size=16).digest()

    def get(self, key: bytes | None) -> int | None:
        """The count kept under ``key`` (tokens), or ``None``."""
        if key is None:
            return None
        count = self._counts.get(key)
        if count is None:
            self.misses += 1
            return None
        self._counts.move_to_end(key)
        self.hits += 1
        return count

    def put(self, key: bytes | None, count: int) -> None:
        """Keep ``count`` (tokens) under ``key``, dropping the least recently used entry
        beyond ``size``."""
        if key is None or self.size <= 0:
            return
        self._counts[key] = count
        self._counts.move_to_end(key)
        while len(self._counts) > self.size:
            self._counts.popitem(last=False)

    def forget(self, key: bytes) -> None:
        """Drop the count kept under ``key``, if any (the backend disagreed with it)."""
        self._counts.pop(key, None)

    def clear(self) -> None:
        """Forget every count (the backend may count differently now)."""
        self._counts.clear()
