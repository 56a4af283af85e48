"""Who owns a background task, and what happens to one that outlives its owner.

Every task the gateway starts has an owner that ends it: awaited, or cancelled and
waited for with a bound (:func:`cancel_bounded`). After a shutdown nothing should be
left; :func:`end_leftovers` finds what is, names it with its stack and ends it, within
a bound, so that a task that swallowed its cancellation shows as a log line (or a
test's failure, tests/leaks.py) instead of a process, or a test run, that never
exits (issue 42).
"""

from __future__ import annotations

import asyncio
import io
import logging
from collections.abc import Coroutine, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

__all__ = ["Flag", "Leftovers", "TaskSet", "cancel_bounded", "describe", "end_leftovers",
           "first_done", "not_cancelled", "stop_if_cancelled"]

log = logging.getLogger(__name__)


def stop_if_cancelled() -> None:
    """Raise ``CancelledError`` when the running task was asked to stop and the request
    was lost on the way. A loop that runs for ever calls this at each turn.

    On Python 3.11, ``asyncio.wait_for`` returns its inner call's result when that call
    ends as the awaiting task is cancelled, and the cancellation is gone, though
    ``Task.cancelling()`` still counts it (CPython gh-86296, fixed in 3.12). redis-py
    wraps every command's write in ``wait_for`` (``send_packed_command``), so a task
    cancelled while it sends a Redis command can go on as if nothing happened: measured
    here, 8 to 12 of 300 cancellations of a loop doing Redis calls (redis-py 8.2). A loop
    that then goes round again never ends, and whoever waits for it hangs (issue 42).

    :raises asyncio.CancelledError: the task has a cancellation request pending.
    """
    task = asyncio.current_task()
    if task is not None and task.cancelling():
        raise asyncio.CancelledError("a cancellation was swallowed on the way; "
                                     "stopping at the loop's turn")


def not_cancelled() -> bool:
    """``True``, unless a cancellation of the running task was swallowed on the way:
    then :func:`stop_if_cancelled` raises. A loop that runs until cancelled is
    ``while not_cancelled():``.

    :raises asyncio.CancelledError: as :func:`stop_if_cancelled`.
    """
    stop_if_cancelled()
    return True


class Flag(asyncio.Event):
    """An ``asyncio.Event`` that also offers one future, done once it is set
    (:meth:`future`), for any number of waiters that each add a callback to it instead
    of starting a task to wait: every request watches the drain's cut (issue 37)."""

    def __init__(self) -> None:
        super().__init__()
        self._future: asyncio.Future[None] | None = None

    def future(self) -> asyncio.Future[None]:
        """The future of this flag, on the running loop (made at the first call)."""
        if self._future is None:
            self._future = asyncio.get_running_loop().create_future()
            if self.is_set():
                self._future.set_result(None)
        return self._future

    def set(self) -> None:
        super().set()
        if self._future is not None and not self._future.done():
            self._future.set_result(None)

    def clear(self) -> None:
        super().clear()
        if self._future is not None and self._future.done():
            self._future = None  # (the next wait gets a future not yet done)


async def first_done(*futures: asyncio.Future[Any] | None) -> None:
    """Wait until one of ``futures`` (``None`` ones left out) is done, and no longer:
    ``asyncio.wait(..., return_when=FIRST_COMPLETED)`` with one callback on each and
    no sets built, taking nothing from any of them. Cancelling the wait leaves them
    as they are."""
    waiter = asyncio.get_running_loop().create_future()

    def wake(_: asyncio.Future[Any]) -> None:
        if not waiter.done():
            waiter.set_result(None)

    watched = [f for f in futures if f is not None]
    for future in watched:
        future.add_done_callback(wake)
    try:
        await waiter
    finally:
        for future in watched:
            future.remove_done_callback(wake)


async def cancel_bounded(tasks: Iterable[asyncio.Task[Any]], owner: str,
                         seconds: float) -> None:
    """Cancel ``tasks`` and wait at most ``seconds`` for them to end, dropping what they
    end with. One still running then (it swallowed its cancellation) is logged, with
    its stack, and left. The caller's own cancellation is never swallowed (unlike
    ``try: await task except CancelledError``, which cannot tell the two apart).

    :param owner: who started them, for the log.
    :param seconds: the bound, seconds.
    """
    tasks = [t for t in tasks if not t.done()]
    for task in tasks:
        task.cancel()
    if not tasks:
        return
    done, running = await asyncio.wait(tasks, timeout=seconds)
    for task in done:
        task.cancelled() or task.exception()  # retrieved: not reported as lost
    for task in running:
        log.error("%s: a background task did not end %g s after it was cancelled:\n%s",
                  owner, seconds, describe(task))


class TaskSet:
    """The tasks one owner runs in the background, held against collection until they
    end, and ended by the owner's shutdown.

    :param owner: who they belong to, for the log.
    """

    def __init__(self, owner: str = "the app") -> None:
        self.owner = owner
        self.closed = False  # by close(): no task may start any more
        self._tasks: set[asyncio.Task[Any]] = set()

    def spawn(self, coro: Coroutine[Any, Any, Any]) -> asyncio.Task[Any]:
        """Run ``coro`` as a task of this set (on the running loop); it leaves the set
        when it ends.

        :raises RuntimeError: the set is closed (nothing would end the task); ``coro``
            is closed unrun.
        """
        if self.closed:
            coro.close()
            raise RuntimeError(f"{self.owner} is closed: no background task may start")
        task = asyncio.ensure_future(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    def __len__(self) -> int:
        return len(self._tasks)

    def __iter__(self) -> Iterator[asyncio.Task[Any]]:
        return iter(list(self._tasks))

    async def cancel_all(self, seconds: float) -> None:
        """Cancel every task still running and wait until they have all ended (their
        ``finally`` blocks run), for at most ``seconds``: see :func:`cancel_bounded`."""
        await cancel_bounded(list(self._tasks), self.owner, seconds)

    async def close(self, seconds: float) -> None:
        """:meth:`cancel_all`, and let no task start after it."""
        self.closed = True
        await self.cancel_all(seconds)


@dataclass(frozen=True)
class Leftovers:
    """The tasks :func:`end_leftovers` found.

    :ivar leaked: tasks still running after the grace period, each described (its name,
        coroutine and stack) before it was cancelled.
    :ivar stuck: those of them that had not ended ``cancel_s`` seconds after their
        cancellation (a swallowed ``CancelledError`` or an unbounded wait), described
        again where they were then.
    """

    leaked: tuple[str, ...] = ()
    stuck: tuple[str, ...] = ()
    tasks: tuple[asyncio.Task[Any], ...] = field(default=(), repr=False)

    def __bool__(self) -> bool:
        return bool(self.leaked)

    def report(self) -> str:
        """The leaked and stuck tasks in a few lines each, for a log or a test failure."""
        lines = [f"{len(self.leaked)} task(s) still running after their owner ended:\n",
                 *self.leaked]
        if self.stuck:
            lines += [f"{len(self.stuck)} of them did not end once cancelled "
                      "(a swallowed cancellation or an unbounded wait):\n", *self.stuck]
        return "".join(lines)


def describe(task: asyncio.Task[Any], limit: int = 8) -> str:
    """``task``'s name, its coroutine and the ``limit`` innermost frames where it is
    suspended, as text."""
    out = io.StringIO()
    out.write(f"  {task.get_name()}: {task.get_coro()!r}\n")
    task.print_stack(limit=limit, file=out)
    return out.getvalue()


async def end_leftovers(ignore: Iterable[asyncio.Task[Any]] = (), *, grace_s: float = 1.0,
                        cancel_s: float = 2.0) -> Leftovers:
    """End the running loop's tasks other than the caller and ``ignore``: give them
    ``grace_s`` seconds to end by themselves, then cancel those still running and
    wait at most ``cancel_s`` seconds for them. Never waits longer than
    ``grace_s + cancel_s`` seconds in all, whatever the tasks do.

    Used after a shutdown (``gateway serve``, each async test's teardown), when every
    task should have been ended by its owner: what this finds is a bug to name.

    :returns: what it found (false when nothing was left).
    """
    skip = {*ignore, asyncio.current_task()}
    left = {t for t in asyncio.all_tasks() if t not in skip and not t.done()}
    if left:
        await asyncio.wait(left, timeout=grace_s)
    leaked = [t for t in left if not t.done()]
    if not leaked:
        return Leftovers()
    described = tuple(describe(t) for t in leaked)
    for task in leaked:
        task.cancel()
    await asyncio.wait(leaked, timeout=cancel_s)
    stuck = tuple(t for t in leaked if not t.done())
    return Leftovers(described, tuple(describe(t) for t in stuck), stuck)
