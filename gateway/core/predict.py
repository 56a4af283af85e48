"""Predicting how long an answer will be, for the ``predictive`` admission policy.

Clients set a generous ``max_tokens`` (or none, and get the room left in the slot), and
real answers are much shorter. Charging the whole cap makes the gateway run fewer
requests at once than the backend could. Under ``predictive`` a request is charged a
high quantile of the completion lengths recently served by its backend instead, bounded
by its cap; live accounting and preemption (:mod:`gateway.admission.admission`) cover the answers
that run longer.

Pure and synchronous: no I/O, no clock.
"""

from __future__ import annotations

import math
from collections import deque

__all__ = ["CompletionLengths"]


class CompletionLengths:
    """The completion lengths (tokens, per choice) recently served by one backend.

    :param quantile: the quantile predicted, in (0, 1] (0.95: p95).
    :param min_history: lengths to see before predicting; until then the whole cap is
        charged.
    :param window: most recent lengths kept.
    :raises ValueError: ``quantile`` is outside (0, 1], or ``min_history``/``window``
        is below 1.
    """

    def __init__(self, quantile: float = 0.95, min_history: int = 16,
                 window: int = 256) -> None:
        if not 0.0 < quantile <= 1.0:
            raise ValueError(f"quantile must be in (0, 1], got {quantile}")
        if min_history < 1 or window < 1:
            raise ValueError("min_history and window must be >= 1")
        self.quantile = quantile
        self.min_history = min_history
        self._window = window
        # One history per answer shape (gateway.wire.resume.answer_shape: "plain",
        # "tools", "schema", "grammar"): a tool call's length says nothing of a chat's.
        self._shapes: dict[str, deque[int]] = {}

    def __len__(self) -> int:
        """Lengths kept, over every shape."""
        return sum(len(kept) for kept in self._shapes.values())

    def record(self, tokens: int, shape: str = "plain") -> None:
        """Note one served answer's completion length (tokens, >= 0) under its
        ``shape``."""
        kept = self._shapes.get(shape)
        if kept is None:
            kept = self._shapes[shape] = deque(maxlen=self._window)
        kept.append(max(0, int(tokens)))

    def value(self, shape: str = "plain") -> int | None:
        """The quantile of the lengths seen of ``shape`` (nearest rank), or ``None``
        with fewer than ``min_history``."""
        kept = self._shapes.get(shape, ())
        if len(kept) < self.min_history:
            return None
        ordered = sorted(kept)
        rank = max(1, math.ceil(self.quantile * len(ordered)))
        return ordered[rank - 1]

    def predict(self, cap: int, shape: str = "plain") -> int | None:
        """Output tokens to charge a request of ``shape`` whose cap is ``cap``: the
        quantile of that shape's lengths, at most ``cap``; ``None`` (charge the cap)
        until enough lengths of it were seen."""
        value = self.value(shape)
        return None if value is None else min(cap, value)
