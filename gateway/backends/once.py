"""One call at a time per key, its answer shared by whoever asks meanwhile:
:class:`OnceAtATime`.

Exact counting costs a round trip to the backend per prompt not yet in the count cache
(:mod:`gateway.backends.countcache`). A burst of the same prompt (an evaluation, a
benchmark, clients retrying together) arrives before the first answer can be kept, and
each request used to ask again: 750 to 1,500 counting calls for 2,000 streams opened at
once with one prompt, measured (issue 37). With this, the first asks and the others wait
for its answer.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Generic, TypeVar

__all__ = ["OnceAtATime"]

T = TypeVar("T")


class _LeaderGone(Exception):
    """The call others waited for was cancelled with its caller."""


class OnceAtATime(Generic[T]):
    """Runs ``call`` for a key unless a call for that key runs already; then waits for
    that one's answer (its result, or its exception, raised in every waiter).

    The call runs in its first caller's task, not a task of its own: if that caller is
    cancelled, the call is, and each waiter then makes the call itself (in turn, one at
    a time again). A waiter's own cancellation takes nothing from the call.
    """

    def __init__(self) -> None:
        self._running: dict[bytes, asyncio.Future[T]] = {}

    def __len__(self) -> int:
        """Calls running now."""
        return len(self._running)

    async def run(self, key: bytes | None, call: Callable[[], Awaitable[T]]) -> T:
        """``call()``'s answer, or that of the call for ``key`` running now (``None``:
        no key, always called).

        :raises Exception: what the call raised.
        """
        if key is None:
            return await call()
        while (running := self._running.get(key)) is not None:
            try:
                return await asyncio.shield(running)
            except _LeaderGone:
                continue
        self._running[key] = answer = asyncio.get_running_loop().create_future()
        try:
            result = await call()
        except BaseException as exc:
            answer.set_exception(exc if isinstance(exc, Exception) else _LeaderGone())
            answer.exception()  # (retrieved: no warning when nobody waited)
            raise
        else:
            answer.set_result(result)
            return result
        finally:
            del self._running[key]
