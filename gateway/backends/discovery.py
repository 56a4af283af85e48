"""A backend's discovery loop: its capacity read forever in the background, and again
soon after an upstream error, at most one read at a time.

The read itself is :meth:`gateway.backends.target.Target.discover`; this module only
decides when to call it, on the injected clock, and never lets the loop die.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable

from gateway.clock import Clock
from gateway.core.capacity import Layout
from gateway.errors import GatewayError
from gateway.tasks import cancel_bounded, not_cancelled

__all__ = ["CLOSE_S", "RETRY_DISCOVERY_S", "DiscoveryLoop"]

log = logging.getLogger(__name__)

RETRY_DISCOVERY_S = 1.0  # delay between discovery attempts while the backend is down
CLOSE_S = 2.0  # the most a close waits for a re-read to end once cancelled


class DiscoveryLoop:
    """When to read a backend's capacity.

    :param name: the backend's name, for the log.
    :param read: one discovery; returns the layout in force afterwards, raises
        :class:`~gateway.errors.GatewayError` while the backend is not ready.
    :param interval_s: the delay before the next read after one that succeeded, seconds,
        given the layout it returned.
    :param clock: the injected time source.
    """

    def __init__(self, name: str, read: Callable[[], Awaitable[Layout | None]],
                 interval_s: Callable[[Layout | None], float], clock: Clock) -> None:
        self.name = name
        self._read = read
        self._interval_s = interval_s
        self._clock = clock
        self._again: asyncio.Task[None] | None = None

    async def run(self) -> None:
        """Read forever: every :data:`RETRY_DISCOVERY_S` while the backend is not ready,
        else after ``interval_s``. Logs the backend going and coming back."""
        failing = False
        while not_cancelled():
            try:
                delay = self._interval_s(await self._read())
                if failing:
                    log.info("backend %s is reachable again", self.name)
                failing = False
            except GatewayError as exc:
                log.log(logging.DEBUG if failing else logging.WARNING,
                        "backend %s not ready: %s", self.name, exc.message)
                failing, delay = True, RETRY_DISCOVERY_S
            except Exception:  # never let discovery die
                log.exception("discovery of backend %s failed", self.name)
                delay = RETRY_DISCOVERY_S
            await self._clock.sleep(delay)

    def request(self) -> None:
        """Re-read capacity soon (after an upstream error); at most one read at a time."""
        if self._again is None or self._again.done():
            self._again = asyncio.ensure_future(self._reread())

    async def _reread(self) -> None:
        """Re-read capacity, every second until the backend answers again."""
        while not_cancelled():
            try:
                await self._read()
                return
            except GatewayError as exc:
                log.debug("backend %s re-discovery failed: %s", self.name, exc.message)
            await self._clock.sleep(RETRY_DISCOVERY_S)

    async def close(self) -> None:
        """Stop a re-read under way (shutdown), waiting at most :data:`CLOSE_S` s."""
        if self._again is not None:
            await cancel_bounded([self._again], f"backend {self.name}'s re-read", CLOSE_S)
