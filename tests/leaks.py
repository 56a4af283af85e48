"""The check that an async test leaves no asyncio task behind (issue 42).

anyio's pytest runner closes its event loop after the last async fixture of a test is
torn down; ``asyncio.Runner.close`` then cancels every task still alive and waits for
them with no bound. A task that outlives its cancellation (a swallowed
``CancelledError``, a close that awaits a socket with no bound) hung the whole run
there once, with nothing to say which test left it. This plugin (tests/conftest.py
loads it, so its autouse fixture comes before any of the conftest's) turns a leak into
one failure of the test that caused it. At an async test's end:

1. what it opened and registered with :func:`closed_at_test_end` (harnesses, apps,
   admissions) is closed, the last opened first, as the app's lifespan would;
2. then :func:`gateway.tasks.end_leftovers`: tasks still alive after a grace period
   fail the test, named with their stacks, and are cancelled with a bound; one that
   ignores its cancellation is named as such and taken off the loop's list, so that
   the loop's own close cannot wait on it for ever.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import pytest

from gateway.tasks import end_leftovers

#: How to close what a test opened and has not closed yet: async callables, called at
#: the test's end, the last opened first, before the leak check.
OPEN: list[Callable[[], Awaitable[Any]]] = []
#: Tasks that ignored their cancellation, kept referenced so that they are not
#: collected as "destroyed but pending" in a later test.
STUCK: list[asyncio.Task[Any]] = []


def closed_at_test_end(close: Callable[[], Awaitable[Any]]) -> None:
    """Call ``close()`` when the test ends, unless :func:`closed_now` said it ran."""
    OPEN.append(close)


def closed_now(close: Callable[[], Awaitable[Any]]) -> None:
    """``close`` is being called by its owner: not again at the test's end."""
    if close in OPEN:
        OPEN.remove(close)


@pytest.fixture(autouse=True)
def _no_task_left(request: pytest.FixtureRequest) -> None:
    """An async test fails if it leaves a task running (set up first, torn down last)."""
    if "anyio_backend" in request.fixturenames:
        request.getfixturevalue("_tasks_end_with_the_test")
        request.getfixturevalue("_opened_closed")  # torn down first


@pytest.fixture
async def _opened_closed() -> AsyncIterator[None]:
    yield
    closers, OPEN[:] = OPEN[::-1], []
    errors = []
    for close in closers:  # each one, whatever the others do
        try:
            await close()
        except Exception as exc:
            errors.append(exc)
    if errors:
        raise errors[0]


def _runners() -> set[asyncio.Task[object]]:
    """anyio's own tasks: the runner task and the one awaiting this fixture's step."""
    return {t for t in asyncio.all_tasks()
            if getattr(t.get_coro(), "__qualname__", "").startswith("TestRunner.")}


@pytest.fixture
async def _tasks_end_with_the_test() -> AsyncIterator[None]:
    before = set(asyncio.all_tasks())
    yield
    found = await end_leftovers(before | _runners())
    for task in found.tasks:  # stuck: the loop's close would wait for them for ever
        STUCK.append(task)
        asyncio.tasks._unregister_task(task)  # (a test-only step: no public way)
    if found:
        pytest.fail(found.report(), pytrace=False)
