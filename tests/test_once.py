"""gateway.backends.once.OnceAtATime: one call per key at a time, its answer (or its
error) shared by whoever asks meanwhile, and nothing lost when a caller is cancelled."""

from __future__ import annotations

import asyncio

import pytest

from gateway.backends.once import OnceAtATime


class Calls:
    """A call that waits for ``release`` and counts how often it was made."""

    def __init__(self, result: int = 7, error: Exception | None = None) -> None:
        self.made = 0
        self.release = asyncio.Event()
        self.result, self.error = result, error

    async def __call__(self) -> int:
        self.made += 1
        await self.release.wait()
        if self.error is not None:
            raise self.error
        return self.result


async def test_the_same_key_asked_meanwhile_is_called_once() -> None:
    once: OnceAtATime[int] = OnceAtATime()
    call = Calls()
    waiting = [asyncio.ensure_future(once.run(b"k", call)) for _ in range(50)]
    await asyncio.sleep(0)
    assert call.made == 1 and len(once) == 1
    call.release.set()
    assert await asyncio.gather(*waiting) == [7] * 50
    assert len(once) == 0
    # Once answered, the next ask calls again (keeping answers is the cache's job).
    assert await once.run(b"k", call) == 7 and call.made == 2


async def test_other_keys_and_no_key_are_called_each() -> None:
    once: OnceAtATime[int] = OnceAtATime()
    call = Calls()
    call.release.set()
    await asyncio.gather(once.run(b"a", call), once.run(b"b", call),
                         once.run(None, call), once.run(None, call))
    assert call.made == 4


async def test_an_error_reaches_every_caller_and_no_warning_is_left(
        caplog: pytest.LogCaptureFixture) -> None:
    once: OnceAtATime[int] = OnceAtATime()
    call = Calls(error=ValueError("refused"))
    waiting = [asyncio.ensure_future(once.run(b"k", call)) for _ in range(3)]
    await asyncio.sleep(0)
    call.release.set()
    results = await asyncio.gather(*waiting, return_exceptions=True)
    assert [type(r) for r in results] == [ValueError] * 3 and call.made == 1
    alone = Calls(error=ValueError("alone"))
    alone.release.set()
    with pytest.raises(ValueError):
        await once.run(b"k", alone)
    import gc
    gc.collect()
    assert "never retrieved" not in caplog.text


async def test_a_cancelled_first_caller_hands_the_call_to_a_waiter() -> None:
    once: OnceAtATime[int] = OnceAtATime()
    call = Calls()
    first = asyncio.ensure_future(once.run(b"k", call))
    await asyncio.sleep(0)
    others = [asyncio.ensure_future(once.run(b"k", call)) for _ in range(3)]
    await asyncio.sleep(0)
    first.cancel()
    await asyncio.gather(first, return_exceptions=True)
    await asyncio.sleep(0)
    assert call.made == 2  # one waiter asked itself; the others wait for it
    call.release.set()
    assert await asyncio.gather(*others) == [7, 7, 7]
    assert first.cancelled() and len(once) == 0


async def test_a_cancelled_waiter_takes_nothing_from_the_call() -> None:
    once: OnceAtATime[int] = OnceAtATime()
    call = Calls()
    first = asyncio.ensure_future(once.run(b"k", call))
    await asyncio.sleep(0)
    waiter = asyncio.ensure_future(once.run(b"k", call))
    await asyncio.sleep(0)
    waiter.cancel()
    await asyncio.gather(waiter, return_exceptions=True)
    call.release.set()
    assert await first == 7 and call.made == 1 and waiter.cancelled()
