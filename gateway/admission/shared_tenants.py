"""Tenant quotas shared by several gateway processes, in Redis (``[state] backend =
"redis"``): a tenant's ``tokens_per_minute`` window and its ``max_inflight`` count hold
over every process, however its requests are spread.

Keys, under ``[state] key_prefix``, next to those of :mod:`gateway.admission.shared`:

* ``{prefix}:t:{tenant}:tpm``, a sorted set: ``{id}|{tokens}`` -> when they were counted
  (ms, on Redis's clock). The window is what scored within the last 60 s; a script checks
  and adds atomically, so two processes cannot both take the last tokens.
* ``{prefix}:t:{tenant}:inflight``, a sorted set: ``{owner}#{n}`` -> when it was taken.
  Its size is the tenant's requests past its gate in every process; entries of a process
  taken for dead (``{prefix}:procs``) are dropped, as its leases are.
* ``{prefix}:t:{tenant}:queued``, a sorted set of the same form: the tenant's requests
  waiting (at its gate or for capacity) in every process, for ``max_queued``; a dead
  process's entries are dropped likewise.
* ``{prefix}:twake:{tenant}``, a pub/sub channel published when a place is given back.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from gateway.admission.tenants import TOKENS_WINDOW_S, TokenHold, window_reset_s
from gateway.clock import Clock, wait
from gateway.errors import StateUnavailable
from gateway.tasks import not_cancelled

if TYPE_CHECKING:
    from gateway.admission.shared import SharedStore
    from gateway.admission.tenants import Tenant

__all__ = ["TenantShare", "WindowReply"]

# KEYS 1 window. ARGV 1 window ms, 2 limit, 3 member id, 4 tokens.
# Returns {admitted (0/1), used before, now ms, then (score, tokens) of each entry}.
_HOLD = r"""
local key = KEYS[1]
local span, limit, id, need = tonumber(ARGV[1]), tonumber(ARGV[2]), ARGV[3], tonumber(ARGV[4])
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
redis.call('ZREMRANGEBYSCORE', key, '-inf', now - span)
local all = redis.call('ZRANGE', key, 0, -1, 'WITHSCORES')
local used = 0
local out = {}
for i = 1, #all, 2 do
  local tok = tonumber(string.match(all[i], '|(%d+)$'))
  used = used + tok
  table.insert(out, all[i + 1])
  table.insert(out, tok)
end
local ok = 0
if used + need <= limit then
  ok = 1
  redis.call('ZADD', key, now, id .. '|' .. need)
  redis.call('PEXPIRE', key, span + 1000)
end
local res = {ok, used, now}
for _, v in ipairs(out) do table.insert(res, v) end
return res
"""

# KEYS 1 window. ARGV 1 window ms, 2 old member, 3 its score, 4 new member (or ''),
# 5 completion member (or ''). The prompt keeps its time; the completion counts from now.
_SETTLE = r"""
local key = KEYS[1]
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
redis.call('ZREM', key, ARGV[2])
if ARGV[4] ~= '' then redis.call('ZADD', key, tonumber(ARGV[3]), ARGV[4]) end
if ARGV[5] ~= '' then redis.call('ZADD', key, now, ARGV[5]) end
redis.call('PEXPIRE', key, tonumber(ARGV[1]) + 1000)
return 1
"""

# KEYS 1 inflight, 2 procs. ARGV 1 cap, 2 id, 3 owner, 4 TTL ms.
# Returns {taken (0/1), count after}.
_ACQUIRE = r"""
local key, procs = KEYS[1], KEYS[2]
local cap, id, owner, ttl = tonumber(ARGV[1]), ARGV[2], ARGV[3], tonumber(ARGV[4])
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
redis.call('ZADD', procs, now + ttl, owner)
local alive = {}
for _, m in ipairs(redis.call('ZRANGE', key, 0, -1)) do
  local o = string.match(m, '^(.*)#')
  if alive[o] == nil then
    local s = redis.call('ZSCORE', procs, o)
    alive[o] = (s ~= false and s ~= nil and tonumber(s) > now)
  end
  if not alive[o] then redis.call('ZREM', key, m) end
end
local n = redis.call('ZCARD', key)
if n < cap then
  redis.call('ZADD', key, now, id)
  return {1, n + 1}
end
return {0, n}
"""

# The heartbeat: this owner's places in each key become exactly those given (a lost
# release heals). KEYS 1 inflight, 2 queued. ARGV 1 owner, 2 n, then n inflight ids,
# then the queued ids.
_SYNC = r"""
local owner = ARGV[1]
local t = redis.call('TIME')
local n = tonumber(ARGV[2])
local function sync(key, first, last)
  local keep = {}
  for i = first, last do keep[ARGV[i]] = true end
  for _, m in ipairs(redis.call('ZRANGE', key, 0, -1)) do
    if string.match(m, '^(.*)#') == owner and not keep[m] then redis.call('ZREM', key, m) end
  end
  for id, _ in pairs(keep) do redis.call('ZADD', key, 'NX', tonumber(t[1]) * 1000, id) end
end
sync(KEYS[1], 3, 2 + n)
sync(KEYS[2], 3 + n, #ARGV)
return 1
"""

# KEYS 1 places. ARGV 1 channel ('': none), 2.. ids.
_RELEASE = r"""
local n = redis.call('ZREM', KEYS[1], unpack(ARGV, 2))
if n > 0 and ARGV[1] ~= '' then redis.call('PUBLISH', ARGV[1], 'released') end
return n
"""


@dataclass(frozen=True)
class WindowReply:
    """A tokens-per-minute check.

    :param admitted: the tokens were counted.
    :param used: tokens in the window before them, from every process.
    :param now_ms: Redis's clock, ms.
    :param entries: (age seconds, tokens) of each entry in the window, oldest first.
    :param member: the entry added (its id and tokens), for :meth:`TenantShare.settle`.
    """

    admitted: bool
    used: int
    now_ms: int
    entries: tuple[tuple[float, int], ...]
    member: str = ""


class TenantShare:
    """One tenant's quotas as every gateway process sees them: its
    :class:`~gateway.admission.tenants.Quota` with ``[state] backend = "redis"``.

    :param store: the process's link to Redis (:class:`~gateway.admission.shared.SharedStore`).
    :param name: the tenant's name.

    Calls raise :class:`~gateway.errors.StateUnavailable` when Redis cannot be reached.
    """

    def __init__(self, store: SharedStore, name: str) -> None:
        self.store = store
        self.name = name
        self.window_key = store.key("t", name, "tpm")
        self.inflight_key = store.key("t", name, "inflight")
        self.queued_key = store.key("t", name, "queued")
        self.channel = store.key("twake", name)
        self._hold = store.client.register_script(_HOLD)
        self._settle = store.client.register_script(_SETTLE)
        self._acquire = store.client.register_script(_ACQUIRE)
        self._release = store.client.register_script(_RELEASE)
        self._sync = store.client.register_script(_SYNC)
        self.changed = asyncio.Event()
        self.held: list[str] = []  # this process's places past the gate
        self.queued: list[str] = []  # this process's places among the waiting
        # Held by each call on the places (acquire, heartbeat, release): a heartbeat sent
        # while an acquire is on its way would drop the place just taken (as
        # SharedAccount.lock).
        self.lock = asyncio.Lock()
        self.last: WindowReply | None = None

    def stir(self) -> None:
        """A place was given back somewhere (or the gateway drains): wake this process's
        waiters at the gate."""
        self.changed.set()

    # -- the tenant's Quota ----------------------------------------------------------

    async def take_tokens(self, tenant: Tenant, now: float, prompt_tokens: int
                          ) -> TokenHold | None:
        """:meth:`~gateway.admission.tenants.Tenant.hold` over every process's window
        (:meth:`hold`: one atomic check-and-add).

        :raises RateLimited: the window cannot take them.
        :raises StateUnavailable: Redis could not be reached.
        """
        limit = tenant.settings.tokens_per_minute if tenant.settings else None
        if limit is None:
            return tenant.hold_tokens(now, prompt_tokens)
        reply = await self.hold(prompt_tokens, limit, TOKENS_WINDOW_S)
        if not reply.admitted:
            tenant.refuse_tokens(now, reply.used, prompt_tokens, limit, window_reset_s(
                reply.entries, reply.used + prompt_tokens - limit))
        return tenant.count(TokenHold(now, prompt_tokens, entry=(reply.member, reply.now_ms)))

    def settle_tokens(self, hold: TokenHold, prompt: int, completion: int) -> None:
        """Set ``hold``'s entry to what the request counted (:meth:`settle`)."""
        if hold.entry is not None:
            self.settle(hold.entry[0], hold.entry[1], prompt, completion)

    def window(self, tenant: Tenant, now: float) -> tuple[int, float]:
        """Tokens in every process's window as the last check saw them (with its own,
        when it was counted), and seconds until it is empty; this process's before any
        check."""
        last = self.last
        if last is None:
            return tenant.local_window(now)
        used = last.used + (int(last.member.rsplit("|", 1)[1]) if last.admitted else 0)
        ages = [age for age, _ in last.entries]
        full = TOKENS_WINDOW_S - min(ages) if ages else (
            TOKENS_WINDOW_S if last.admitted else 0.0)
        return used, full

    async def begin_waiting(self, tenant: Tenant, now: float) -> None:
        """Count one more of the tenant's requests as waiting, over every process
        (:meth:`take_queued`; Redis lost: this process's waiters only).

        :raises RateLimited: one more would pass ``max_queued``; nothing is counted.
        """
        cap = tenant.settings.max_queued if tenant.settings else None
        if cap is None:
            tenant.start_waiting(now)
            return
        try:
            taken = await self.take_queued(cap)
        except StateUnavailable:
            taken = tenant.waiting < cap
        if not taken:
            tenant.refuse_queued(cap, now)
        tenant.waiting += 1

    def stop_waiting(self) -> None:
        """One of this process's waiting requests waits no more (:meth:`release_queued`)."""
        self.release_queued()

    def enter_now(self, tenant: Tenant) -> bool:
        """Pass at once only without ``max_inflight``: with it, a place is taken in
        Redis (:meth:`enter`)."""
        cap = tenant.settings.max_inflight if tenant.settings else None
        return cap is None and tenant.pass_gate_now()

    async def enter(self, tenant: Tenant, timeout_s: float, clock: Clock) -> float:
        """Pass the gate when ``max_inflight`` counts every process's requests: take a
        place in Redis, or wait (counted as waiting) for one given back (notified, or
        polled every ``[state] poll_interval_s``).

        :raises RateLimited: ``max_queued`` already wait, or the wait passed
            ``timeout_s``.
        :raises Exception: what the tenant's ``refuse_waiting`` was given.
        """
        cap = tenant.settings.max_inflight if tenant.settings else None
        if cap is None:
            return await tenant.wait_at_gate(timeout_s, clock)
        start = clock.now()
        self.changed.clear()
        if await self.acquire(cap):
            tenant.inflight += 1
            return 0.0
        poll_s = self.store.settings.poll_interval_s
        tenant.refused = None
        await tenant.begin_waiting(clock.now())
        try:
            while not_cancelled():
                left = timeout_s - (clock.now() - start)
                if tenant.refused is not None:
                    raise tenant.refused
                if left <= 0:
                    raise tenant.refuse_inflight(cap, timeout_s, clock.now(),
                                                 ", over every gateway process")
                changed = asyncio.ensure_future(self.changed.wait())
                try:
                    await wait(clock, changed, min(poll_s, left))
                except TimeoutError:
                    pass
                finally:
                    changed.cancel()
                self.changed.clear()
                if tenant.refused is None and await self.acquire(cap):
                    tenant.inflight += 1
                    return clock.now() - start
            raise AssertionError("not_cancelled() returns True or raises")
        finally:
            tenant.stop_waiting()

    def leave(self, tenant: Tenant) -> None:
        """A request of the tenant past the gate has ended: its place in Redis is given
        back (:meth:`release`), or, without one, this process's gate lets the next
        through."""
        if self.held:
            self.release()
            tenant.inflight -= 1
            return
        tenant.leave_gate()

    async def hold(self, tokens: int, limit: int, window_s: float) -> WindowReply:
        """Count ``tokens`` in the tenant's window when they fit ``limit`` over the last
        ``window_s`` seconds of every process.

        :raises StateUnavailable: Redis could not be reached.
        """
        member = self.store.new_id()
        raw = await self.store.call("tenant", lambda: self._hold(
            keys=[self.window_key], args=[int(window_s * 1000), limit, member, tokens]))
        reply = _window_reply(raw, f"{member}|{tokens}" if int(raw[0]) else "")
        self.last = reply
        return reply

    def settle(self, member: str, score_ms: int, prompt: int, completion: int) -> None:
        """Set what a held request really counted (in the background): its prompt at the
        time it was held (0 drops it), its completion from now."""
        base = member.rsplit("|", 1)[0]
        args: list[str | int] = [60_000, member, score_ms, f"{base}|{prompt}" if prompt > 0 else "",
                f"{base}c|{completion}" if completion > 0 else ""]
        self.store.background("tenant", lambda: self._settle(keys=[self.window_key],
                                                             args=args))

    async def acquire(self, cap: int) -> bool:
        """Take a place past the gate when fewer than ``cap`` are taken in every process.

        :raises StateUnavailable: Redis could not be reached.
        """
        return await self._take(self.inflight_key, self.held, cap)

    async def take_queued(self, cap: int) -> bool:
        """Count one more waiting request when fewer than ``cap`` wait in every process
        (``max_queued``); give it back with :meth:`release_queued`.

        :raises StateUnavailable: Redis could not be reached.
        """
        return await self._take(self.queued_key, self.queued, cap)

    async def _take(self, key: str, places: list[str], cap: int) -> bool:
        place = self.store.new_id()
        async with self.lock:
            raw = await self.store.call("tenant", lambda: self._acquire(
                keys=[key, self.store.key("procs")],
                args=[cap, place, self.store.owner, self.store.ttl_ms]))
            if int(raw[0]):
                places.append(place)
                return True
        return False

    def release_queued(self) -> None:
        """One of this process's waiting requests waits no more (in the background)."""
        if self.queued:
            place = self.queued.pop()
            self.store.background("tenant", lambda: self._release(
                keys=[self.queued_key], args=["", place]), self.lock)

    def release(self) -> None:
        """Give back one of this process's places (in the background); the others' waiters
        are told."""
        if self.held:
            place = self.held.pop()
            self.store.background("tenant", lambda: self._release(
                keys=[self.inflight_key], args=[self.channel, place]), self.lock)

    def sync_args(self) -> Any:
        """The heartbeat's call: this process's places become exactly :attr:`held`
        and :attr:`queued`."""
        return self._sync(keys=[self.inflight_key, self.queued_key],
                          args=[self.store.owner, len(self.held), *self.held,
                                *self.queued])



def _window_reply(raw: Sequence[Any], member: str) -> WindowReply:
    now_ms = int(raw[2])
    entries = tuple(((now_ms - float(raw[i])) / 1000, int(raw[i + 1]))
                    for i in range(3, len(raw) - 1, 2))
    return WindowReply(bool(int(raw[0])), int(raw[1]), now_ms, entries, member)
