"""The check that an async test leaves no asyncio task behind (issue 42).

anyio's pytest runner closes its event loop after the last async fixture of a test is
torn down; ``asyncio.Runner.close`` then cancels every task still alive and waits for
them with no bound. A task that outlives its cancellation (a swallowed
``CancelledError``, a close that awaits a socket with no bound) hung the whole run
there once, with nothing to say which test left it. This fixture runs last in an async
test's teardown (tests/conftest.py requests it first) and turns a leak into one failure
of the test that caused it, with :func:`gateway.tasks.end_leftovers`: tasks still
alive after a grace period are named with their stacks and cancelled with a bound; one
that ignores its cancellation is named as such and taken off the loop's list, so that
the loop's own close cannot wait on it for ever.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import pytest

from gateway.tasks import end_leftovers


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
        asyncio.tasks._unregister_task(task)  # (a test-only step: no public way)
    if found:
        pytest.fail(found.report(), pytrace=False)
