"""Noticing that an HTTP client went away, and cancelling work when it does.

After the request body is read, the only ASGI message left for a request is
``http.disconnect``; a background task waits for it. :meth:`DisconnectWatcher.race` runs
a piece of work against that task, so that a queue wait, an upstream request or a relay
is cancelled the moment the client leaves.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable
from typing import TypeVar

from starlette.types import Receive

from gateway.errors import ClientDisconnected, ShuttingDown

__all__ = ["DisconnectWatcher"]

T = TypeVar("T")


class DisconnectWatcher:
    """Reads ASGI ``receive`` in the background and notes ``http.disconnect``.

    The request body must already have been read.
    """

    def __init__(self, receive: Receive, cut: asyncio.Event | None = None) -> None:
        self._receive = receive
        self.disconnected = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._cut = cut  # set when a drain runs out of time: work in hand is cut
        self._cut_seen: asyncio.Task[bool] | None = None  # one wait on it, for every race

    def start(self) -> None:
        self._task = asyncio.ensure_future(self._watch())
        if self._cut is not None:
            self._cut_seen = asyncio.ensure_future(self._cut.wait())

    async def _watch(self) -> None:
        while True:
            message = await self._receive()
            if message["type"] == "http.disconnect":
                self.disconnected.set()
                return

    async def stop(self) -> None:
        # gather, not ``try: await task except CancelledError``: a cancellation of the
        # caller during the wait must go on, not be taken for the task's (issue 42).
        tasks = [t for t in (self._task, self._cut_seen) if t is not None and not t.done()]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    async def race(self, work: Awaitable[T], *, cancel: bool = True) -> T:
        """Await ``work``; raise :class:`ClientDisconnected` if the client goes away
        first (the watcher task itself is the other side of the race), or
        :class:`~gateway.errors.ShuttingDown` if the gateway's drain runs out of time.

        :param cancel: cancel ``work`` when the client leaves. With ``False`` it goes on
            (pass a task you keep, to hand it on).
        """
        task = asyncio.ensure_future(work)
        watcher, cut = self._task, self._cut_seen
        try:
            if watcher is None or self.disconnected.is_set():
                raise ClientDisconnected()
            if self._cut is not None and self._cut.is_set():
                raise _cut_off()
            await asyncio.wait({task, watcher, *([cut] if cut else [])},
                               return_when=asyncio.FIRST_COMPLETED)
            if task.done():
                return task.result()
            if self.disconnected.is_set():
                raise ClientDisconnected()
            raise _cut_off()
        finally:
            if cancel and not task.done():
                task.cancel()
                await asyncio.gather(task, return_exceptions=True)  # (see stop)


def _cut_off() -> ShuttingDown:
    return ShuttingDown("The gateway is shutting down and its drain timeout has passed: "
                        "this request was cut. Retry it, on another instance or after the "
                        "restart.", retry_after_s=1.0)
