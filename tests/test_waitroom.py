"""The one waiting room (gateway.admission.waitroom) and the clock's deadline wait."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from gateway.admission.waitroom import Waitroom
from gateway.core.fairness import Party
from gateway.errors import QueueFull, QueueTimeout, Shed, ShuttingDown
from tests.fakes import ManualClock

pytestmark = pytest.mark.anyio

HIGH, LOW = Party("a", rank=0), Party("a", rank=1)


async def settle() -> None:
    for _ in range(5):
        await asyncio.sleep(0)


class Log:
    """A waitroom user that records what the room gives back and when waiters leave."""

    def __init__(self, clock: ManualClock, max_queue: int | None = None) -> None:
        self.given_back: list[Any] = []
        self.left = 0
        self.room: Waitroom[str, str] = Waitroom(
            clock, max_queue=max_queue, give_back=self.given_back.append,
            on_leave=self._left,
            full=lambda: QueueFull(f"full with {len(self.room)}", retry_after_s=2.0))

    def _left(self) -> None:
        self.left += 1


def timed_out() -> Exception:
    return QueueTimeout("too long", retry_after_s=3.0)


# -- Clock.wait --------------------------------------------------------------------------

async def test_clock_wait_returns_the_result_and_leaves_no_timer() -> None:
    clock = ManualClock()
    fut: asyncio.Future[int] = asyncio.get_running_loop().create_future()
    task = asyncio.ensure_future(clock.wait(fut, 5.0))
    await settle()
    fut.set_result(7)
    assert await task == 7
    await settle()
    assert all(f.done() for _, f in clock._sleepers)  # the deadline's sleep was cancelled


async def test_clock_wait_on_a_done_future_does_not_yield() -> None:
    clock = ManualClock()
    fut: asyncio.Future[int] = asyncio.get_running_loop().create_future()
    fut.set_result(3)
    coro = clock.wait(fut, 1.0)
    with pytest.raises(StopIteration) as done:
        coro.send(None)  # finishes in one step: no await reached the loop
    assert done.value.value == 3
    assert clock._sleepers == []


async def test_clock_wait_times_out_on_the_injected_clock_and_leaves_the_future() -> None:
    clock = ManualClock()
    fut: asyncio.Future[int] = asyncio.get_running_loop().create_future()
    task = asyncio.ensure_future(clock.wait(fut, 5.0))
    await settle()
    clock.advance(4.9)
    await settle()
    assert not task.done()
    clock.advance(0.1)
    await settle()
    with pytest.raises(TimeoutError):
        await task
    assert not fut.done()  # the owner decides
    fut.cancel()


async def test_clock_wait_raises_the_future_error_and_is_cancel_safe() -> None:
    clock = ManualClock()
    loop = asyncio.get_running_loop()
    failing: asyncio.Future[int] = loop.create_future()
    task = asyncio.ensure_future(clock.wait(failing, 5.0))
    await settle()
    failing.set_exception(ValueError("no"))
    with pytest.raises(ValueError):
        await task
    pending: asyncio.Future[int] = loop.create_future()
    task = asyncio.ensure_future(clock.wait(pending, 5.0))
    await settle()
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    await settle()
    assert not pending.done()  # left to its owner
    assert all(f.done() for _, f in clock._sleepers)  # no timer left running
    pending.cancel()


# -- Waitroom ----------------------------------------------------------------------------

async def test_waiters_are_served_in_arrival_order_with_positions_and_ages() -> None:
    clock = ManualClock()
    user = Log(clock)
    room = user.room
    first = room.join("one", Party())
    clock.advance(2.0)
    second = room.join("two", Party())
    assert [w.request for w in room.order()] == ["one", "two"]
    assert room.position(lambda r: r == "two") == 2 and room.position(lambda r: r == "x") is None
    assert room.oldest_wait_s() == 2.0 and len(room) == 2
    waits = [asyncio.ensure_future(room.wait(w, 10.0, timed_out)) for w in (first, second)]
    await settle()
    room.grant(room.head(), "lease-1")  # type: ignore[arg-type]
    assert await waits[0] == "lease-1"
    room.grant(room.head(), "lease-2")  # type: ignore[arg-type]
    assert await waits[1] == "lease-2"
    assert not room and room.oldest_wait_s() == 0.0 and user.left == 0


async def test_a_timed_out_waiter_gets_the_error_built_while_it_still_counts() -> None:
    clock = ManualClock()
    user = Log(clock)
    room = user.room
    waiter = room.join("one", Party())
    seen: list[int] = []

    def late() -> Exception:
        seen.append(len(room))
        return timed_out()

    task = asyncio.ensure_future(room.wait(waiter, 1.0, late))
    await settle()
    clock.advance(1.0)
    await settle()
    with pytest.raises(QueueTimeout):
        await task
    assert seen == [1] and not room and user.left == 1
    assert waiter.future.cancelled()


async def test_a_waiter_cancelled_after_its_grant_gives_it_back() -> None:
    clock = ManualClock()
    user = Log(clock)
    room = user.room
    waiter = room.join("one", Party())
    task = asyncio.ensure_future(room.wait(waiter, 10.0, timed_out))
    await settle()
    room.grant(waiter, "lease")
    task.cancel()  # before it could take the grant
    with pytest.raises(asyncio.CancelledError):
        await task
    assert user.given_back == ["lease"] and user.left == 0


async def test_a_waiter_cancelled_before_its_grant_leaves_and_the_user_is_told() -> None:
    clock = ManualClock()
    user = Log(clock)
    room = user.room
    waiter = room.join("one", Party())
    task = asyncio.ensure_future(room.wait(waiter, 10.0, timed_out))
    await settle()
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert not room and user.left == 1 and user.given_back == []


async def test_a_full_room_sheds_the_newest_of_the_lowest_class_or_refuses() -> None:
    clock = ManualClock()
    user = Log(clock, max_queue=2)
    room = user.room
    assert room.victim_for(HIGH) is None
    room.check_room(HIGH)
    low_old, low_new = room.join("low-1", LOW), room.join("low-2", LOW)
    assert room.victim_for(HIGH) is low_new
    room.check_room(HIGH)  # it would shed: not refused
    with pytest.raises(QueueFull, match="full with 2"):
        room.victim_for(LOW)  # none lower than its own class
    with pytest.raises(QueueFull):
        room.check_room(LOW)
    task = asyncio.ensure_future(room.wait(low_new, 10.0, timed_out))
    await settle()
    room.fail(low_new, Shed("shed", retry_after_s=1.0))
    with pytest.raises(Shed):
        await task
    assert list(room) == [low_old] and user.left == 1  # told after an error too
    room.fail(low_old, Shed("shed", retry_after_s=1.0))
    low_old.future.exception()


async def test_an_empty_room_of_no_places_refuses_only_when_asked_to_wait() -> None:
    user = Log(ManualClock(), max_queue=0)
    user.room.check_room(HIGH)  # nobody waits: a request that may start is not refused
    with pytest.raises(QueueFull):
        user.room.victim_for(HIGH)


async def test_refuse_waiting_fails_every_waiter() -> None:
    clock = ManualClock()
    user = Log(clock)
    room = user.room
    waiters = [room.join(name, Party()) for name in ("a", "b")]
    tasks = [asyncio.ensure_future(room.wait(w, 10.0, timed_out)) for w in waiters]
    await settle()
    room.refuse_waiting(ShuttingDown("bye", retry_after_s=1.0))
    for task in tasks:
        with pytest.raises(ShuttingDown):
            await task
    assert not room


async def test_front_waiters_go_first_and_deadlines_follow_the_class_limit() -> None:
    clock = ManualClock()
    room = Log(clock).room
    room.join("late", Party())
    back = room.join("back", Party(max_wait_s=4.0), front=True)
    assert room.head() is back
    assert back.deadline(30.0) == clock.now() + 4.0
    assert room.order()[1].deadline(30.0) == clock.now() + 30.0
    for waiter in list(room):
        room.fail(waiter, ShuttingDown("bye", retry_after_s=1.0))
        waiter.future.exception()
