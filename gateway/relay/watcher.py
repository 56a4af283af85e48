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
from gateway.tasks import Flag, first_done

__all__ = ["DisconnectWatcher"]

T = TypeVar("T")


class DisconnectWatcher:
    """Reads ASGI ``receive`` in the background and notes ``http.disconnect``.

    The request body must already have been read.
    """

    def __init__(self, receive: Receive, cut: Flag | None = None) -> None:
        self._receive = receive
        self.disconnected = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._cut = cut  # set when a drain runs out of time: work in hand is cut

    def start(self) -> None:
        self._task = asyncio.ensure_future(self._watch())

    async def _watch(self) -> None:
        while True:
            message = await self._receive()
            if message["type"] == "http.disconnect":
                self.disconnected.set()
                return

    async def stop(self) -> None:
        # gather, not ``try: await task except CancelledError``: a cancellation of the
        # caller during the wait must go on, not be taken for the task's (issue 42).
        if self._task is not None and not self._task.done():
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)

    async def race(self, work: Awaitable[T], *, cancel: bool = True) -> T:
        """Await ``work``; raise :class:`ClientDisconnected` if the client goes away
        first (the watcher task itself is the other side of the race), or
        :class:`~gateway.errors.ShuttingDown` if the gateway's drain runs out of time.
        A task or future is raced as it is; a coroutine runs in a task of its own.

        :param cancel: cancel ``work`` when the client leaves. With ``False`` it goes on
            (pass a task you keep, to hand it on).
        """
        task = asyncio.ensure_future(work)
        watcher = self._task
        try:
            if watcher is None or self.disconnected.is_set():
                raise ClientDisconnected()
            if self._cut is not None and self._cut.is_set():
                raise _cut_off()
            if not task.done():
                # One callback on each side: the drain's cut is one future for every
                # request (Flag), not a task per request (issue 37).
                await first_done(task, watcher,
                                 None if self._cut is None else self._cut.future())
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
