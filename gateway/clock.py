"""The injected time source: what the queues, the drain and the relay read the time from.

Every wait in the gateway with a deadline is measured on a :class:`Clock`, never on the
event loop's own time, so that tests drive timeouts with a manual clock (one that moves only
when told to) and no test sleeps on the wall clock. A clock has two primitives, ``now`` and
``sleep``; :meth:`Clock.wait`, the one deadline primitive (as anyio's ``fail_after`` is
anyio's), is built on them.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any, Protocol, TypeVar

__all__ = ["Clock", "MonotonicClock", "wait"]

T = TypeVar("T")


class Clock(Protocol):
    """Time source for queue timeouts and drain-rate estimates (seconds).

    Only ``now`` and ``sleep`` are needed: the gateway waits with deadlines through
    :func:`wait`, built on them, so a clock that matches this protocol structurally works
    as well as a subclass (which also gets :meth:`wait` as a method).
    """

    def now(self) -> float:
        """The current time, seconds; only differences between two readings mean
        anything (monotonic)."""
        ...

    async def sleep(self, seconds: float) -> None:
        """Return once ``seconds`` have passed on this clock."""
        ...

    async def wait(self, future: asyncio.Future[T], timeout_s: float) -> T:
        """Await ``future`` for at most ``timeout_s`` seconds of this clock: see
        :func:`wait`, which any object with ``now`` and ``sleep`` can use."""
        return await wait(self, future, timeout_s)


async def wait(clock: Clock, future: asyncio.Future[T], timeout_s: float) -> T:
    """Await ``future`` for at most ``timeout_s`` seconds of ``clock``.

    The gateway's one deadline primitive. It needs only the clock's ``now`` and ``sleep``,
    so an injected clock that matches :class:`Clock` structurally (with no ``wait`` of its
    own) works too.

    :returns: the future's result, as soon as it is done (at once, without yielding
        to the event loop, when it is done already).
    :raises TimeoutError: ``timeout_s`` passed first. The future is left as it is
        (not cancelled): its owner decides what a timed-out wait means.
    :raises BaseException: the future's own exception, or the cancellation of the
        awaiting task (the future again left as it is).

    No timer outlives the call: the sleep that measures the deadline is cancelled
    however the call ends. Should the future be done by the time the deadline
    passes, its result wins.
    """
    if future.done():
        return future.result()
    timer = asyncio.ensure_future(clock.sleep(timeout_s))
    try:
        either: set[asyncio.Future[Any]] = {future, timer}
        await asyncio.wait(either, return_when=asyncio.FIRST_COMPLETED)
    finally:
        timer.cancel()
    if future.done():
        return future.result()
    raise TimeoutError(f"not done within {timeout_s:g} s")


class MonotonicClock(Clock):
    """The real clock: ``time.monotonic`` and ``asyncio.sleep``."""

    def now(self) -> float:
        return time.monotonic()

    async def sleep(self, seconds: float) -> None:
        await asyncio.sleep(seconds)
