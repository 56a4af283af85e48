"""The injected clock: anything with ``now`` and ``sleep`` will do (gateway.clock)."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from gateway.clock import wait

pytestmark = pytest.mark.anyio


class DuckClock:
    """A clock that matches gateway.clock.Clock by shape only: no wait() of its own."""

    def __init__(self) -> None:
        self.t = 1000.0

    def now(self) -> float:
        return self.t

    async def sleep(self, seconds: float) -> None:
        await asyncio.sleep(3600)  # time never moves on its own


async def test_wait_returns_the_result_and_leaves_no_timer() -> None:
    future: asyncio.Future[int] = asyncio.get_running_loop().create_future()
    asyncio.get_running_loop().call_soon(future.set_result, 7)
    before = len(asyncio.all_tasks())
    assert await wait(DuckClock(), future, 5.0) == 7
    await asyncio.sleep(0)
    assert len(asyncio.all_tasks()) == before


async def test_wait_times_out_on_the_clock_and_leaves_the_future() -> None:
    class Quick(DuckClock):
        async def sleep(self, seconds: float) -> None:
            await asyncio.sleep(0)

    future: asyncio.Future[int] = asyncio.get_running_loop().create_future()
    with pytest.raises(TimeoutError):
        await wait(Quick(), future, 5.0)
    assert not future.done()


async def test_a_clock_without_wait_serves_a_queued_request(harness_factory: Any,
                                                            fake: Any) -> None:
    # A queued request waits with a deadline (the waiting room's); with a clock that has
    # only now() and sleep(), it used to fail as an internal error.
    fake.slots = 1
    fake.hold = asyncio.Event()
    h = await harness_factory({"reject_predicted_timeouts": False}, clock=DuckClock())
    first = asyncio.ensure_future(h.chat("one", max_tokens=3))
    await asyncio.sleep(0.05)
    second = asyncio.ensure_future(h.chat("two", max_tokens=3))
    await asyncio.sleep(0.05)
    fake.hold.set()
    assert (await first).status_code == 200
    assert (await second).status_code == 200
