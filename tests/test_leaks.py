"""gateway.tasks.end_leftovers: what the leak check of every async test
(tests/leaks.py) and ``gateway serve``'s shutdown report (issue 42)."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from gateway.tasks import Flag, end_leftovers, first_done


def others() -> set[asyncio.Task[object]]:
    """The tasks alive now (the test runner's): not the ones under test."""
    return set(asyncio.all_tasks())


async def test_a_task_that_ends_within_the_grace_is_not_reported() -> None:
    before = others()
    quick = asyncio.ensure_future(asyncio.sleep(0.05))
    found = await end_leftovers(before, grace_s=1.0, cancel_s=0.5)
    assert not found and found.leaked == () and quick.done()


async def test_a_leaked_task_is_named_with_its_stack_and_cancelled() -> None:
    async def forgotten_heartbeat() -> None:
        await asyncio.sleep(3600)

    before = others()
    task = asyncio.ensure_future(forgotten_heartbeat())
    task.set_name("heartbeat")
    found = await end_leftovers(before, grace_s=0.05, cancel_s=0.5)
    assert found and len(found.leaked) == 1 and not found.stuck
    assert "heartbeat" in found.leaked[0] and "forgotten_heartbeat" in found.leaked[0]
    assert task.cancelled()
    assert "1 task(s) still running" in found.report()


async def test_a_task_that_swallows_its_cancellation_is_named_stuck_within_the_bound(
        ) -> None:
    release = asyncio.Event()

    async def swallower() -> None:
        while not release.is_set():
            try:
                await asyncio.sleep(3600)
            except asyncio.CancelledError:
                pass  # the bug under test: the cancellation is swallowed, and it waits on

    before = others()
    task = asyncio.ensure_future(swallower())
    loop = asyncio.get_running_loop()
    start = loop.time()
    found = await end_leftovers(before, grace_s=0.05, cancel_s=0.2)
    assert loop.time() - start < 2.0  # bounded, whatever the task does
    assert found.tasks == (task,) and len(found.stuck) == 1
    assert "swallower" in found.stuck[0] and "did not end once cancelled" in found.report()
    release.set()
    task.cancel()
    await asyncio.wait({task}, timeout=1.0)
    assert task.done()


async def test_the_tasks_to_ignore_are_left_alone() -> None:
    kept = asyncio.ensure_future(asyncio.sleep(3600))
    try:
        found = await end_leftovers(others(), grace_s=0.05, cancel_s=0.2)
        assert not found and not kept.done()
    finally:
        kept.cancel()
        await asyncio.gather(kept, return_exceptions=True)


def test_a_test_that_leaves_a_task_fails_naming_it(pytester: pytest.Pytester,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """The fixture in tests/leaks.py, in a pytest run of its own: a test that leaves a
    task running errors at teardown with the task's coroutine named; the one that
    leaves nothing passes."""
    pytester.makeini("[pytest]\nanyio_mode = auto\n")
    pytester.makeconftest(
        "import pytest\n"
        "pytest_plugins = ['tests.leaks']\n"
        "@pytest.fixture\n"
        "def anyio_backend():\n"
        "    return 'asyncio'\n")
    pytester.makepyfile(test_it=(
        "import asyncio\n"
        "async def lost_pump():\n"
        "    await asyncio.sleep(3600)\n"
        "async def test_leaves_one():\n"
        "    asyncio.ensure_future(lost_pump())\n"
        "async def test_leaves_none():\n"
        "    await asyncio.sleep(0)\n"))
    monkeypatch.setenv("PYTHONPATH", str(Path(__file__).parents[1]))  # where tests/ is
    result = pytester.runpytest_subprocess("-p", "anyio", "-q")
    result.assert_outcomes(passed=2, errors=1)
    result.stdout.fnmatch_lines(["*1 task(s) still running*", "*lost_pump*"])


# -- Flag and first_done: one future for every waiter, no task each ----------------------


async def test_a_flags_future_is_done_once_set_and_not_after_a_clear() -> None:
    flag = Flag()
    early = flag.future()
    assert not early.done()
    flag.set()
    assert early.done() and flag.future().done()
    flag.clear()
    later = flag.future()
    assert not later.done()  # a wait after the clear is not woken by the old set
    flag.set()
    assert later.done()


async def test_first_done_wakes_on_any_and_leaves_no_callback() -> None:
    loop = asyncio.get_running_loop()
    a, b = loop.create_future(), loop.create_future()
    waiting = asyncio.ensure_future(first_done(a, None, b))
    await asyncio.sleep(0)
    assert not waiting.done()
    b.set_result(1)
    await waiting
    assert not a.done()  # nothing taken from the other side
    # A cancelled wait takes its callbacks away (a race's future outlives many waits).
    waiting = asyncio.ensure_future(first_done(a))
    await asyncio.sleep(0)
    waiting.cancel()
    await asyncio.gather(waiting, return_exceptions=True)
    assert not a._callbacks  # noqa: SLF001  (None or [] by the Future implementation)
