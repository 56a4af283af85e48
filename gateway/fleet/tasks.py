"""The background tasks of one app, owned by its state (never a module global).

Discovery loops, reload retirements and, for the relay, the reading of finished streams'
tails all run as tasks of the app's :class:`TaskSet`
(:attr:`gateway.fleet.state.GatewayState.tasks`). The app's lifespan cancels them at
shutdown (:meth:`TaskSet.cancel_all`), so that one app stopping never touches another
app's tasks in the same process (tests build many apps).
"""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine, Iterator
from typing import Any

__all__ = ["TaskSet"]


class TaskSet:
    """Tasks running in the background, held against collection until they end."""

    def __init__(self) -> None:
        self._tasks: set[asyncio.Task[Any]] = set()

    def spawn(self, coro: Coroutine[Any, Any, Any]) -> asyncio.Task[Any]:
        """Run ``coro`` as a task of this set (on the running loop); it leaves the set
        when it ends."""
        task = asyncio.ensure_future(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    def __len__(self) -> int:
        return len(self._tasks)

    def __iter__(self) -> Iterator[asyncio.Task[Any]]:
        return iter(list(self._tasks))

    async def cancel_all(self) -> None:
        """Cancel every task still running and wait until they have all ended (their
        ``finally`` blocks run); exceptions they end with are dropped."""
        tasks = list(self._tasks)
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
