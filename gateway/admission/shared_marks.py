"""A backend's health marks and discovered layout shared by several gateway processes,
in Redis (``[state] backend = "redis"``).

Keys, under ``[state] key_prefix``, next to those of :mod:`gateway.admission.shared`
(``{backend}`` is the same ``{name}@{url hash}``):

* ``{prefix}:b:{backend}:marks``, a hash:

  - ``failures``, ``until``, ``probe``: the backend's failures in a row (every process's),
    the time (ms, on Redis's clock) before which no process sends it a request, and the
    process holding the half-open probe, if any. A process whose request failed there
    raises ``failures`` and sets ``until`` to now plus the backoff
    (:meth:`gateway.core.health.Health.request_failed`'s rule); one whose request was
    served clears them. Once ``until`` has passed, the first process to claim the probe
    (an atomic check-and-set) sets ``until`` to now plus the probe's time-out
    (``connect_timeout_s`` + 1 s) and sends it; the others skip the backend meanwhile,
    so there is one probe per backend, not one per process.
  - ``gen``, ``slots``, ``ctx``, ``pool``, ``block``: the layout the backend last
    reported (llama-server's ``/props``: ``total_slots``, ``n_ctx`` per slot; the pool a
    vLLM reports), with a generation raised at each change. A process that reads a
    change itself publishes it; every process adopts the newest generation.

* ``{prefix}:marks:{backend}``, a pub/sub channel published at each change (down, up,
  a new layout): the other processes read the hash at once, and at every renewal
  (``renew_interval_s``) anyway, since pub/sub may drop a message (:class:`MarksHub`).

While Redis cannot be reached, each process keeps the marks as it last saw them and
goes on with its own (:class:`~gateway.core.health.Health`'s rules, the probe included):
a lost Redis marks nothing down or up. A mark it made meanwhile is published when Redis
answers again.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any, TypeVar

from redis.exceptions import RedisError

from gateway.admission.shared import close_bounded
from gateway.core.health import Health
from gateway.core.pool_model import Reported
from gateway.errors import StateUnavailable
from gateway.tasks import not_cancelled

if TYPE_CHECKING:
    from gateway.admission.shared import SharedAccount, SharedStore

#: A discovery's answer (:class:`gateway.backends.base.Discovered`, a dataclass).
Found = TypeVar("Found", bound=Reported)

__all__ = ["BackendMarks", "LayoutShare", "MarksHub", "MarksReply", "SharedHealth"]

log = logging.getLogger(__name__)

_NOW = r"""
local key = KEYS[1]
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local function num(field) return tonumber(redis.call('HGET', key, field) or '0') end
local function reply(mine)
  return {now, num('failures'), num('until'), redis.call('HGET', key, 'probe') or '',
          num('gen'), num('slots'), num('ctx'), num('pool'), num('block'), mine}
end
"""

# KEYS 1 marks. ARGV 1 owner, 2 probe ms (-1: only read).
# Returns {now, failures, until, probe owner, gen, slots, ctx, pool, block, claimed}.
_READ = _NOW + r"""
local probe_ms = tonumber(ARGV[2])
if probe_ms >= 0 and num('failures') > 0 and now >= num('until') then
  redis.call('HSET', key, 'until', now + probe_ms, 'probe', ARGV[1])
  return reply(1)
end
return reply(0)
"""

# KEYS 1 marks. ARGV 1 channel, 2 failures in a row seen by the caller, 3 initial backoff
# ms, 4 largest backoff ms. The rule of gateway.core.health.Health.request_failed.
_FAIL = _NOW + r"""
local f = math.max(num('failures') + 1, tonumber(ARGV[2]))
local down = math.min(tonumber(ARGV[4]), tonumber(ARGV[3]) * 2 ^ (f - 1))
redis.call('HSET', key, 'failures', f, 'until', now + math.floor(down), 'probe', '')
redis.call('PUBLISH', ARGV[1], 'down')
return reply(0)
"""

# KEYS 1 marks. ARGV 1 channel.
_UP = _NOW + r"""
if num('failures') > 0 or num('until') > 0 then
  redis.call('HSET', key, 'failures', 0, 'until', 0, 'probe', '')
  redis.call('PUBLISH', ARGV[1], 'up')
end
return reply(0)
"""

# KEYS 1 marks. ARGV 1 channel, 2 changed (1: the caller's own reads changed, or kept
# disagreeing), 3 slots, 4 ctx, 5 pool (0: none), 6 block. Publishes the caller's read
# as a new generation when none is published, or when it changed and differs.
_LAYOUT = _NOW + r"""
local same = num('slots') == tonumber(ARGV[3]) and num('ctx') == tonumber(ARGV[4])
  and num('pool') == tonumber(ARGV[5]) and num('block') == tonumber(ARGV[6])
if num('gen') == 0 or (ARGV[2] == '1' and not same) then
  redis.call('HSET', key, 'gen', num('gen') + 1, 'slots', ARGV[3], 'ctx', ARGV[4],
             'pool', ARGV[5], 'block', ARGV[6])
  redis.call('PUBLISH', ARGV[1], 'layout')
  return reply(1)
end
return reply(0)
"""

#: A layout as published: (slots, tokens per slot, pool tokens or 0, block size).
Values = tuple[int, int, int, int]


@dataclass(frozen=True)
class MarksReply:
    """The shared marks of one backend, as a script returned them.

    :param now_ms: Redis's clock, ms.
    :param failures: failures in a row, over every process (0: up).
    :param until_ms: no request before this time (ms, Redis's clock); 0 when up.
    :param probe: the process holding the half-open probe ('' when none).
    :param gen: the published layout's generation (0: none published).
    :param layout: the published layout (see :data:`Values`).
    :param mine: this call claimed the probe, or published its layout.
    """

    now_ms: int
    failures: int
    until_ms: int
    probe: str
    gen: int
    layout: Values
    mine: bool

    @classmethod
    def parse(cls, raw: Sequence[Any]) -> MarksReply:
        """Read a script's reply (see ``_NOW``)."""
        probe = raw[3].decode() if isinstance(raw[3], bytes) else str(raw[3])
        n = [int(v) for v in (*raw[:3], *raw[4:])]
        return cls(n[0], n[1], n[2], probe, n[3], (n[4], n[5], n[6], n[7]), bool(n[8]))


def values_of(found: Reported) -> Values:
    """The layout part of a discovery's answer, as published."""
    return (found.slots, found.ctx_per_slot, found.pool_tokens or 0, found.block_size)


class MarksHub:
    """The :class:`BackendMarks` of one store's backends, read at every renewal
    (``renew_interval_s``) and at once when their channel is published. Its loop is one
    of the store's background tasks (:meth:`SharedStore.spawn
    <gateway.admission.shared.SharedStore.spawn>`, stopped by its ``close``), started by
    the first call on the marks; it subscribes on a connection of the store's client,
    waiting at most until the next renewal for a message.

    :param store: the process's link to Redis.
    """

    def __init__(self, store: SharedStore) -> None:
        self.store = store
        self.marks: list[BackendMarks] = []
        self._started = False

    @classmethod
    def of(cls, store: SharedStore) -> MarksHub:
        """The one hub of ``store``."""
        hub = _HUBS.get(store)
        if hub is None:
            hub = _HUBS[store] = cls(store)
        return hub

    def start(self) -> None:
        """Run the loop (once; nothing without an event loop)."""
        if not self._started:
            with contextlib.suppress(RuntimeError):
                self.store.spawn(self._run())
                self._started = True

    def stir(self, channel: str) -> None:
        """``channel`` was published: read the marks of its backend."""
        for marks in [m for m in self.marks if m.channel == channel]:
            marks.stir()

    async def sync(self) -> None:
        """Read (or send) every backend's marks.

        :raises StateUnavailable: Redis could not be reached.
        """
        for marks in list(self.marks):
            await marks.sync()

    async def _run(self) -> None:
        """Read the marks until cancelled (by the store's close). Each turn of each
        loop first checks for a cancellation swallowed by a Redis call
        (:func:`gateway.tasks.stop_if_cancelled`): this loop once went on after its
        cancellation and held the test run's event loop open for ever (issue 42)."""
        renew_s = self.store.settings.renew_interval_s
        loop = asyncio.get_running_loop()
        while not_cancelled():
            pubsub = self.store.client.pubsub(ignore_subscribe_messages=True)
            try:
                await pubsub.psubscribe(self.store.key("marks", "*"))
                while not_cancelled():
                    await self.sync()  # also what was published before subscribing
                    end = loop.time() + renew_s
                    while not_cancelled() and (left := end - loop.time()) > 0:
                        message = await pubsub.get_message(timeout=left)
                        if message is not None:
                            self.stir(_text(message.get("channel")))
            except (RedisError, OSError, StateUnavailable):
                pass
            except Exception:  # never let the marks' loop die
                log.exception("shared state: reading the backends' marks failed")
            finally:
                await close_bounded(pubsub.aclose())
            await asyncio.sleep(renew_s)


_HUBS: weakref.WeakKeyDictionary[Any, MarksHub] = weakref.WeakKeyDictionary()


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


class BackendMarks:
    """One backend's shared marks as one backend object of this process uses them,
    read by the store's :class:`MarksHub`.

    :param account: the backend's shared budget (its key names the backend).
    :param probe_s: the probe's time-out, seconds (the connect time-out and a second).
    :param on_change: called when the backend may be usable again, or its layout
        changed (the admission looks at its waiters again).
    :param on_layout: called with a newer published layout (:meth:`LayoutShare.adopt`).

    :ivar health: the backend's :class:`SharedHealth`.
    :ivar layout: its :class:`LayoutShare`.
    """

    def __init__(self, account: SharedAccount, probe_s: Callable[[], float],
                 on_change: Callable[[], None],
                 on_layout: Callable[[Values], None]) -> None:
        store = account.store
        self.store = store
        self.key = store.key("b", account.backend, "marks")
        self.channel = store.key("marks", account.backend)
        self._read = store.client.register_script(_READ)
        self._fail = store.client.register_script(_FAIL)
        self._up = store.client.register_script(_UP)
        self._layout = store.client.register_script(_LAYOUT)
        self.health = SharedHealth(self, probe_s, on_change)
        self.layout = LayoutShare(self, on_layout)
        self.hub = MarksHub.of(store)
        self.hub.marks.append(self)

    def detach(self) -> None:
        """Stop reading the marks (the backend object is closed)."""
        with contextlib.suppress(ValueError):
            self.hub.marks.remove(self)
        self.health.cancel_timer()

    def stir(self) -> None:
        """The channel was published: read the marks (in the background)."""
        self.background(self.sync())

    async def sync(self) -> None:
        """The renewal's part: send a mark made while Redis was lost, else read.

        :raises StateUnavailable: Redis could not be reached.
        """
        if self.health.unsent is not None:
            await self.fail(*self.health.unsent)
            return
        await self.call(self._read, [self.store.owner, -1])

    async def claim(self, probe_s: float) -> MarksReply:
        """Take the half-open probe when the backoff has passed and no one holds it.

        :raises StateUnavailable: Redis could not be reached.
        """
        return await self.call(self._read, [self.store.owner, int(probe_s * 1000)])

    async def fail(self, failures: int, initial_s: float, max_s: float) -> MarksReply:
        """Publish a failure (see ``_FAIL``).

        :raises StateUnavailable: Redis could not be reached.
        """
        self.health.unsent = None
        try:
            return await self.call(self._fail, [self.channel, failures,
                                                int(initial_s * 1000), int(max_s * 1000)])
        except StateUnavailable:
            self.health.unsent = (failures, initial_s, max_s)
            raise

    async def up(self) -> MarksReply:
        """Publish a served request: the backend is up.

        :raises StateUnavailable: Redis could not be reached.
        """
        return await self.call(self._up, [self.channel])

    async def publish(self, read: Values, changed: bool) -> MarksReply:
        """Publish a discovery's layout ``read`` (see ``_LAYOUT``).

        :raises StateUnavailable: Redis could not be reached.
        """
        return await self.call(self._layout, [self.channel, 1 if changed else 0, *read])

    async def call(self, script: Any, args: list[Any]) -> MarksReply:
        """Run one of the scripts, learn the marks it returns, and return them.

        :raises StateUnavailable: Redis could not be reached.
        """
        self.hub.start()
        op = "layout" if script is self._layout else "health"
        reply = MarksReply.parse(await self.store.call(
            op, lambda: script(keys=[self.key], args=args)))
        self.health.seen(reply)
        if script is not self._layout:  # a publish's reply is LayoutShare.agree's own
            self.layout.seen(reply)
        return reply

    def background(self, coro: Any) -> None:
        """Run ``coro`` in the background; a lost Redis is dropped (the marks stay as
        this process has them). Closed unrun when the store is closed, or no event
        loop runs."""
        try:
            self.store.spawn(self._quietly(coro))
        except RuntimeError:
            coro.close()

    @staticmethod
    async def _quietly(coro: Any) -> None:
        with contextlib.suppress(StateUnavailable):
            await coro


class SharedHealth(Health):
    """:class:`~gateway.core.health.Health` kept in step with every process's marks
    (:class:`BackendMarks`): the same methods and rules, with

    * a failure here published to the others, who skip the backend too;
    * a served request here published as the backend up;
    * once the backoff has passed, :meth:`usable` true in one process only: the one
      that claimed the probe in Redis (every process that saw the mark tries as the
      backoff ends, and again as an unused claim times out); the others skip the
      backend until the probe ends or times out;
    * while Redis is lost, the rules of one process on the marks as last seen.

    Times are seconds on this process's clock; Redis's are converted with the store's
    offset (:attr:`SharedStore.offset_s <gateway.admission.shared.SharedStore.offset_s>`).
    """

    def __init__(self, marks: BackendMarks, probe_s: Callable[[], float],
                 on_change: Callable[[], None]) -> None:
        super().__init__()
        self.marks = marks
        self.probe_s = probe_s
        self.on_change = on_change
        #: A failure marked while Redis was lost, to publish: (failures, initial, max).
        self.unsent: tuple[int, float, float] | None = None
        self._ticket: float | None = None  # this process holds the probe until then
        self._claiming = False
        self._timer: asyncio.TimerHandle | None = None

    def usable(self, now: float) -> bool:
        """Not marked down at ``now`` by any process; after a backoff, only in the
        process holding the probe (Redis lost: this process's rule)."""
        if now < self.down_until:
            return False
        if not self.failures or not self.marks.store.up or self.unsent is not None:
            return True  # up; or Redis lost, or a mark of the outage not sent yet
        # The probe is claimed as the backoff ends (see seen), never by asking here:
        # a /ready or a metrics scrape claims nothing.
        return self._ticket is not None and now < self._ticket

    def request_failed(self, now: float, initial_s: float, max_s: float) -> float:
        """:meth:`Health.request_failed`, published to every process (in the
        background).

        :returns: how long it is down, seconds.
        """
        down = super().request_failed(now, initial_s, max_s)
        self._ticket = None
        self.marks.background(self.marks.fail(self.failures, initial_s, max_s))
        return down

    def probe_started(self, now: float, probe_s: float) -> None:
        """:meth:`Health.probe_started`; the probe this process claimed is used."""
        if self.failures and now >= self.down_until:
            self._ticket = None
        super().probe_started(now, probe_s)

    def request_served(self) -> None:
        """:meth:`Health.request_served`; published when the backend was marked."""
        marked = bool(self.failures or self.down_until or self.unsent)
        super().request_served()
        self._ticket = None
        self.unsent = None
        if marked:
            self.marks.background(self.marks.up())

    def seen(self, reply: MarksReply) -> None:
        """Take the marks of a reply as this process's: skip the backend until their
        time; hold the probe when this call claimed it."""
        if self.unsent is not None:
            return  # this process's mark of an outage goes first (BackendMarks.sync)
        store = self.marks.store
        was_usable = self.usable(store.clock.now())
        self.failures = reply.failures
        if reply.mine and reply.probe == store.owner and reply.failures:
            # Claimed: others skip the backend for the probe's time; here it may go.
            self._ticket = reply.until_ms / 1000 - store.offset_s
            self.down_until = min(self.down_until, self._ticket - self.probe_s())
        elif not (self._ticket is not None and reply.probe == store.owner):
            self.down_until = (reply.until_ms / 1000 - store.offset_s
                               if reply.until_ms else 0.0)
        if reply.failures:
            self._wake_at(reply.until_ms - reply.now_ms)
        if self.usable(store.clock.now()) and not was_usable:
            self.on_change()

    def cancel_timer(self) -> None:
        """Stop the wake-up at the backoff's end (closing)."""
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def _claim(self) -> None:
        if self._claiming:
            return
        self._claiming = True

        async def run() -> None:
            try:
                await self.marks.claim(self.probe_s())
            finally:
                self._claiming = False
        self.marks.background(run())

    def _wake_at(self, delay_ms: int) -> None:
        """Claim the probe as the backoff ends (the next waiter, here or elsewhere, is
        then the probe without waiting for a heartbeat)."""
        self.cancel_timer()
        with contextlib.suppress(RuntimeError):
            loop = asyncio.get_running_loop()
            self._timer = loop.call_later(max(0.0, delay_ms / 1000) + 0.005, self._claim)


class LayoutShare:
    """The layout a backend reported, agreed over every process.

    :param marks: the backend's :class:`BackendMarks`.
    :param on_layout: called with a newer published layout than the one in use here.

    :ivar gen: the generation in use here (0: none yet).
    """

    def __init__(self, marks: BackendMarks, on_layout: Callable[[Values], None]) -> None:
        self.marks = marks
        self.on_layout = on_layout
        self.gen = 0
        self._last_read: Values | None = None
        self._disagreed = False

    async def agree(self, found: Found) -> Found:
        """A discovery's answer ``found`` as every process uses it: this process's read
        is published when it changed since its last read (or went on disagreeing with
        the published one over two reads, or none is published); the newest published
        layout comes back in ``found``'s place. Redis lost: ``found`` as read.
        """
        read = values_of(found)
        changed = read != self._last_read or self._disagreed
        self._last_read = read
        try:
            reply = await self.marks.publish(read, changed)
        except StateUnavailable:
            return found
        self._disagreed = reply.layout != read
        self.gen = reply.gen
        return with_values(found, reply.layout)

    def seen(self, reply: MarksReply) -> None:
        """Adopt a newer published layout than the one in use (after this process's
        first discovery: :meth:`agree` takes the first)."""
        if reply.gen > self.gen and self.gen > 0:
            self.gen = reply.gen
            self.on_layout(reply.layout)


def with_values(found: Found, values: Values) -> Found:
    """``found`` with the layout ``values`` in place of its own."""
    slots, ctx, pool, block = values
    return replace(found, slots=slots,  # type: ignore[type-var]  # a dataclass
                   ctx_per_slot=ctx, pool_tokens=pool or None, block_size=block)
