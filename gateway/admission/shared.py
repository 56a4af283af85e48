"""Admission state shared by several gateway processes, in Redis (``[state] backend =
"redis"``).

Every gateway process in front of the same backends reserves against one budget per
backend, held in Redis under ``[state] key_prefix``:

* ``{prefix}:b:{backend}:leases``, a hash: lease id -> ``owner, tokens, slots, slot ids``.
  Its sums are the backend's reserved tokens and busy slots; its slot ids are the shared
  slot map.
* ``{prefix}:b:{backend}:queue``, a sorted set: ticket id -> arrival time (ms, on Redis's
  clock). The head is the request that arrived first on any process; strict FIFO, as one
  process's :class:`~gateway.admission.admission.Admission` is.
* ``{prefix}:procs``, a sorted set: process id -> the time its liveness expires (ms). A
  process renews it every ``renew_interval_s``; once it has not for ``lease_ttl_s``, any
  process's next call drops its leases and tickets (a process killed with ``kill -9``
  gives back its capacity that way).
* ``{prefix}:epoch``: created on the first call after Redis started empty (a restart
  without persistence). Its value ends a resync window of three renewals and half a
  second, during which nothing is granted, so that every live process republishes its
  leases first; and a process whose calls failed republishes its own before its next
  grant.
* ``{prefix}:wake:{backend}``, a pub/sub channel: published when capacity may have been
  freed; the waiting processes look at the queue again at once (and every
  ``poll_interval_s`` anyway, since pub/sub may drop a message).

One source of rules: the decision is :func:`gateway.core.capacity.fits`, the same
arithmetic applied in a Lua script to the shared sums (Redis runs a script atomically, so
check-and-reserve has no race between processes). ``tests/test_shared_state.py`` holds the
two to the same answers on random states, against a real ``redis-server``.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
import os
import secrets
import socket
from collections import deque
from collections.abc import Awaitable, Callable, Coroutine, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import redis.asyncio as aioredis
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import RedisError

from gateway.admission.shared_live import LIVE_LUA
from gateway.admission.shared_tenants import TenantShare
from gateway.clock import Clock
from gateway.config import StateSettings, redact_url
from gateway.core.capacity import Charge, Layout
from gateway.errors import StateUnavailable
from gateway.tasks import TaskSet, not_cancelled, stop_if_cancelled

__all__ = ["CLOSE_S", "Ask", "GrantReply", "SharedAccount", "SharedStore", "close_bounded"]

log = logging.getLogger(__name__)

#: Seconds a Redis client's or pub/sub's close may take before it is left behind.
CLOSE_S = 2.0


async def close_bounded(closing: Awaitable[Any], seconds: float = CLOSE_S) -> None:
    """Await ``closing`` (a redis-py client's or pub/sub's ``aclose()``) for at most
    ``seconds``, swallowing its errors. redis-py's asyncio close waits on the socket's
    ``wait_closed()``, which can wait for ever (redis/redis-py#3941, seen here as a test
    run that hung in a fixture's close with the event loop idle); the socket is closed
    before that wait, so nothing is lost by leaving it. Cancelling the caller cancels
    the close too."""
    task = asyncio.ensure_future(closing)
    # Its outcome is retrieved whenever it comes, so that one left behind and failing
    # later is not reported as an exception never retrieved.
    task.add_done_callback(lambda t: t.cancelled() or t.exception())
    try:
        await asyncio.wait({task}, timeout=seconds)
    finally:
        if not task.done():
            task.cancel()  # (not awaited: a close that ignores it must not hold us)

#: Slot ids of this process's preferred order sent with each grant (the least recently
#: used free ones first); past them the script takes the lowest free.
ORDER_SENT = 16
#: Replies from which Redis's clock offset is taken: the largest of the last ones, since
#: each reply is read some time after Redis stamped it, so every sample runs short by
#: that delay (measured: 3-20 ms spreads between processes with the last sample alone).
OFFSET_SAMPLES = 32

# Lua helpers shared by the scripts. KEYS: 1 leases hash, 2 queue zset, 3 procs zset,
# 4 epoch, 5 live figures hash (gateway.admission.shared_live). ARGV: 1 owner, 2 lease
# TTL ms, 3 resync window ms, 4 wake channel.
_PRELUDE = r"""
local leases, queue, procs, epoch, live = KEYS[1], KEYS[2], KEYS[3], KEYS[4], KEYS[5]
local owner, ttl, resync_ms, channel = ARGV[1], tonumber(ARGV[2]), tonumber(ARGV[3]), ARGV[4]
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local was = redis.call('ZSCORE', procs, owner)
local lapsed = (not was) or tonumber(was) <= now
redis.call('ZADD', procs, now + ttl, owner)
local resync_until = tonumber(redis.call('GET', epoch) or '-1')
if resync_until < 0 then
  resync_until = now + resync_ms
  redis.call('SET', epoch, resync_until)
  lapsed = false  -- Redis started empty: every process republishes, none lapsed
elseif now < resync_until and not was then
  lapsed = false  -- absent only because Redis restarted: this is its first call since
end
local alive = {}
local function is_alive(o)
  local a = alive[o]
  if a == nil then
    local s = redis.call('ZSCORE', procs, o)
    a = (s ~= false and s ~= nil and tonumber(s) > now)
    alive[o] = a
  end
  return a
end
local function owner_of(id) return string.match(id, '^(.*)#') end
-- Drop the dead owners' leases (and their live figures) and sum the live ones.
local reserved, busy, unpinned, purged = 0, 0, 0, 0
local held, held_leases = {}, {}
local function scan_leases()
  local all = redis.call('HGETALL', leases)
  for i = 1, #all, 2 do
    local o, tok, sl, ids = string.match(all[i + 1], '^([^|]*)|(%d+)|(%d+)|(.*)$')
    if not is_alive(o) then
      redis.call('HDEL', leases, all[i])
      if live then redis.call('HDEL', live, all[i]) end
      purged = purged + 1
    else
      reserved = reserved + tonumber(tok)
      busy = busy + tonumber(sl)
      held_leases[all[i]] = {tonumber(tok), tonumber(sl)}
      if ids == '' then unpinned = unpinned + 1 end
      for id in string.gmatch(ids, '%d+') do held[tonumber(id)] = true end
    end
  end
end
-- This owner's tickets become exactly `mine` (id -> score); dead owners' go.
local function set_tickets(mine)
  for _, m in ipairs(redis.call('ZRANGE', queue, 0, -1)) do
    local o = owner_of(m)
    if o == owner then
      if mine[m] == nil then redis.call('ZREM', queue, m) end
    elseif not is_alive(o) then
      redis.call('ZREM', queue, m)
      purged = purged + 1
    end
  end
  for id, score in pairs(mine) do redis.call('ZADD', queue, 'NX', score, id) end
end
local function finish()
  redis.call('ZREMRANGEBYSCORE', procs, '-inf', now)
  if purged > 0 then redis.call('PUBLISH', channel, 'expired') end
end
"""

# KEYS 6: the SLO limits published, a hash: owner -> "cap|until ms".
# ARGV 5..: pool tokens (0: per-slot layout), slots, usable per slot, capacity tokens,
# busy cap (0: none; the SLO limit, gateway.admission.slo), preferred slot order
# (comma-separated), tickets kept waiting (k), then k x (id, score), then asks (a), then
# a x (id, score, tokens, slots, span, pinnable, prefer), in this process's serving
# order, then the predictive policy's rule (on, margin, horizon ms, fresh growth:
# gateway.admission.shared_live.LIVE_LUA).
# Returns {now, reserved, busy, resyncing, purged, queued, id1, slots1, id2, ...}.
_GRANT = _PRELUDE + r"""
local pool, slots, usable, capacity = tonumber(ARGV[5]), tonumber(ARGV[6]),
  tonumber(ARGV[7]), tonumber(ARGV[8])
local busy_cap = tonumber(ARGV[9])
-- Each process's SLO limit (gateway.admission.slo), published for 30 s with its grants:
-- every process's grant keeps to the smallest live one, not only its own.
local caps = KEYS[6]
if busy_cap > 0 then
  redis.call('HSET', caps, owner, busy_cap .. '|' .. (now + 30000))
else
  redis.call('HDEL', caps, owner)
end
local published = redis.call('HGETALL', caps)
for i = 1, #published, 2 do
  local o = published[i]
  local cap, until_ms = string.match(published[i + 1], '^(%d+)|(%d+)$')
  if not cap or tonumber(until_ms) <= now or not is_alive(o) then
    redis.call('HDEL', caps, o)
  elseif busy_cap == 0 or tonumber(cap) < busy_cap then
    busy_cap = tonumber(cap)
  end
end
local order = ARGV[10]
local mine, asks, seq = {}, {}, {}
local k = tonumber(ARGV[11])
local b = 12
for _ = 1, k do mine[ARGV[b]] = ARGV[b + 1]; b = b + 2 end
local a = tonumber(ARGV[b]); b = b + 1
for _ = 1, a do
  mine[ARGV[b]] = ARGV[b + 1]
  asks[ARGV[b]] = {tonumber(ARGV[b + 2]), tonumber(ARGV[b + 3]), tonumber(ARGV[b + 4]),
                   ARGV[b + 5] == '1', tonumber(ARGV[b + 6])}
  table.insert(seq, ARGV[b])
  b = b + 7
end
scan_leases()
set_tickets(mine)
""" + LIVE_LUA + r"""
local out = {}
if now >= resync_until then
  local nexti = 1
  while true do
    local head = redis.call('ZRANGE', queue, 0, 0)[1]
    if not (head and asks[head]) then break end
    -- This process's turn: its first waiter in its own serving order (classes, fair
    -- shares) takes it; the granted are out of the queue, so seq[nexti] is ungranted.
    head = seq[nexti]
    local ask = asks[head]
    local tokens, n, span, pinnable, prefer = ask[1], ask[2], ask[3], ask[4], ask[5]
    -- gateway.core.capacity.fits (fits_alone, a free slot each, the unified pool, with
    -- the predictive policy's live use: gateway.admission.shared_live.live_reserved)
    if busy + n > slots or n > slots or span > usable or tokens > capacity
        or (busy_cap > 0 and busy > 0 and busy + n > busy_cap)
        or (pool > 0 and reserved + live_extra() + tokens > pool) then break end
    local ids = {}
    if pinnable and unpinned == 0 then
      -- The first: `prefer` if free, else the first free of the caller's order, else the
      -- lowest free; the rest, the lowest free (as gateway.core.slots.SlotMap.pick).
      -- Each scan stops early: a grant costs O(leases + n), not O(slots log slots).
      local first = nil
      if prefer >= 0 and prefer < slots and not held[prefer] then first = prefer end
      if first == nil then
        for id in string.gmatch(order, '%d+') do
          id = tonumber(id)
          if id < slots and not held[id] then first = id; break end
        end
      end
      if first == nil then
        for id = 0, slots - 1 do
          if not held[id] then first = id; break end
        end
      end
      if first ~= nil then
        ids = {first}
        local id = 0
        while #ids < n and id < slots do
          if id ~= first and not held[id] then table.insert(ids, id) end
          id = id + 1
        end
      end
    end
    if #ids == 0 then unpinned = unpinned + 1 end
    for _, id in ipairs(ids) do held[id] = true end
    reserved = reserved + tokens
    busy = busy + n
    live_granted(n)
    local csv = table.concat(ids, ',')
    redis.call('HSET', leases, head, owner .. '|' .. tokens .. '|' .. n .. '|' .. csv)
    redis.call('ZREM', queue, head)
    table.insert(out, head)
    table.insert(out, csv)
    nexti = nexti + 1
  end
end
finish()
local res = {now, reserved, busy, (now < resync_until) and 1 or 0, purged,
             redis.call('ZCARD', queue)}
for _, v in ipairs(out) do table.insert(res, v) end
return res
"""

# The heartbeat. ARGV 5..: this owner's leases (l), l x (id, value), its tickets (k),
# k x (id, score). Its leases and tickets in Redis become exactly these (a restart of
# Redis, or a release that was lost, heals here). Returns {now, reserved, busy,
# resyncing, purged, queued, lapsed}: lapsed is 1 when this owner held leases but had been
# taken for dead (it renewed later than its TTL), so others may have been granted them.
_SYNC = _PRELUDE + r"""
local l = tonumber(ARGV[5])
local b = 6
local keep = {}
for _ = 1, l do keep[ARGV[b]] = ARGV[b + 1]; b = b + 2 end
local all = redis.call('HGETALL', leases)
for i = 1, #all, 2 do
  if owner_of(all[i]) == owner and keep[all[i]] == nil then
    redis.call('HDEL', leases, all[i])
  end
end
for id, v in pairs(keep) do redis.call('HSET', leases, id, v) end
local k = tonumber(ARGV[b]); b = b + 1
local mine = {}
for _ = 1, k do mine[ARGV[b]] = ARGV[b + 1]; b = b + 2 end
scan_leases()
set_tickets(mine)
finish()
return {now, reserved, busy, (now < resync_until) and 1 or 0, purged,
        redis.call('ZCARD', queue), (lapsed and l > 0) and 1 or 0}
"""

# KEYS 1 leases, 2 live figures; ARGV 1 channel, 2.. lease ids. Returns how many were
# held.
_RELEASE = r"""
local n = redis.call('HDEL', KEYS[1], unpack(ARGV, 2))
redis.call('HDEL', KEYS[2], unpack(ARGV, 2))
if n > 0 then redis.call('PUBLISH', ARGV[1], 'released') end
return n
"""


@dataclass(frozen=True)
class Ask:
    """One waiting request, as the grant script sees it.

    :param ticket: its id (``{owner}#{n}``), also the id of the lease it becomes.
    :param score_ms: its place in the shared queue: arrival time on Redis's clock, ms
        (0 for a request resuming at the head).
    :param charge: what it reserves.
    :param prefer: the slot to take if it is free (``None``: any).
    """

    ticket: str
    score_ms: int
    charge: Charge
    prefer: int | None = None


@dataclass(frozen=True)
class GrantReply:
    """What a grant or sync call saw and did.

    :param now_ms: Redis's clock, ms.
    :param reserved_tokens: KV tokens reserved on the backend by every process, after it.
    :param busy_slots: slots taken by every process, after it.
    :param resyncing: Redis started empty moments ago; nothing is granted until every
        live process has republished its leases.
    :param purged: leases and tickets of dead processes dropped by this call.
    :param queued: tickets waiting on the backend, from every process.
    :param granted: ticket id -> the slot ids its lease holds (``()``: unpinned).
    """

    now_ms: int
    reserved_tokens: int
    busy_slots: int
    resyncing: bool
    purged: int
    queued: int
    granted: dict[str, tuple[int, ...]] = field(default_factory=dict)

    @classmethod
    def parse(cls, raw: Sequence[Any]) -> GrantReply:
        """Read a script's reply (see ``_GRANT``)."""
        def text(v: Any) -> str:
            return v.decode() if isinstance(v, bytes) else str(v)
        granted = {}
        for i in range(6, len(raw) - 1, 2):
            csv = text(raw[i + 1])
            granted[text(raw[i])] = tuple(int(x) for x in csv.split(",")) if csv else ()
        return cls(int(raw[0]), int(raw[1]), int(raw[2]), bool(int(raw[3])), int(raw[4]),
                   int(raw[5]), granted)


def default_owner() -> str:
    """A process id unique across machines and restarts: ``host:pid:random``."""
    return f"{socket.gethostname()}:{os.getpid()}:{secrets.token_hex(3)}".replace("#", "_")


OpHook = Callable[[str, str, float], None]  # (op, outcome, seconds)


class SharedStore:
    """One process's link to the shared admission state: the Redis client, its process id
    (``owner``), the heartbeat that renews its liveness and republishes its leases every
    ``renew_interval_s``, and the subscription that wakes waiting requests.

    :param settings: the ``[state]`` section.
    :param clock: injected time source (the heartbeat's sleeps, ticket arrival times).
    :param client: a Redis client (tests pass their own); by default one on
        ``settings.redis_url``, with ``op_timeout_s`` as its socket timeouts.
    :param owner: this process's id; by default :func:`default_owner`.
    :param on_op: called with (op, outcome, seconds) after each call, for metrics
        (``outcome`` is ``ok`` or ``error``).
    :param on_expired: called with (count, reason): ``owner_lost`` with the leases and
        tickets of dead processes a call dropped; ``renewed_late`` (count 0) when this
        process's own leases had been taken for dead before it renewed.

    Calls raise :class:`~gateway.errors.StateUnavailable` when Redis cannot be reached;
    :attr:`up` is False from then until a call succeeds again (one WARNING log line when
    it goes, one INFO line when it comes back).
    """

    def __init__(self, settings: StateSettings, *, clock: Clock,
                 client: aioredis.Redis | None = None, owner: str | None = None,
                 on_op: OpHook | None = None,
                 on_expired: Callable[[int, str], None] | None = None) -> None:
        self.settings = settings
        self.clock = clock
        self.owner = owner or default_owner()
        # One immediate retry on a broken connection (a pooled connection to a Redis
        # that restarted fails once, then a new one is made); none when it is down.
        self.client = client or aioredis.Redis.from_url(
            settings.redis_url, socket_timeout=settings.op_timeout_s,
            socket_connect_timeout=settings.op_timeout_s,
            retry=Retry(NoBackoff(), 1), retry_on_error=[RedisConnectionError])
        self._owns_client = client is None
        # Subscriptions wait for messages with no read timeout (the calls' op_timeout_s
        # would end an idle subscription every op_timeout_s, and messages published
        # while it is renewed would be lost); a dead connection is found by TCP
        # keepalive and by the periodic health check of redis-py.
        pool = self.client.connection_pool
        self._sub_client = aioredis.Redis(connection_pool=aioredis.ConnectionPool(
            connection_class=pool.connection_class,
            **{**pool.connection_kwargs, "socket_timeout": None, "socket_keepalive": True,
               "health_check_interval": max(1, int(settings.lease_ttl_s))}))
        self._on_op = on_op
        self._on_expired = on_expired
        self.up = True
        self.accounts: dict[str, SharedAccount] = {}
        self.tenants: dict[str, TenantShare] = {}
        #: The ids of the live gateway processes, as the last heartbeat saw them.
        self.processes: list[str] = []
        #: A call failed since the last whole heartbeat: Redis may have lost this
        #: process's leases, so the next grant republishes them first.
        self.stale = False
        self._grant = self.client.register_script(_GRANT)
        self._sync = self.client.register_script(_SYNC)
        self._release = self.client.register_script(_RELEASE)
        self._tasks = TaskSet("shared state")
        # Redis's clock minus ours, seconds: recent samples (see OFFSET_SAMPLES).
        self._offsets: deque[float] = deque(maxlen=OFFSET_SAMPLES)
        self._serial = 0
        self._running = False

    def key(self, *parts: str) -> str:
        """A key or channel name under the prefix."""
        return ":".join((self.settings.key_prefix, *parts))

    def account(self, backend: str, url: str | None = None) -> SharedAccount:
        """The shared budget of ``backend`` (one per name and URL, however many
        admissions use it). With ``url``, the keys name the server too
        (``{name}@{8 hex digits of the URL's SHA-256}``), so that gateways sharing a Redis
        and prefix in front of different servers that happen to share a backend name
        never share a budget; processes in front of one server must give it the same
        name and URL."""
        key = backend
        if url is not None:
            key = f"{backend}@{hashlib.sha256(url.encode()).hexdigest()[:8]}"
        if key not in self.accounts:
            self.accounts[key] = SharedAccount(self, key)
        return self.accounts[key]

    def tenant(self, name: str) -> TenantShare:
        """The shared quotas of tenant ``name`` (one per name)."""
        if name not in self.tenants:
            self.tenants[name] = TenantShare(self, name)
        return self.tenants[name]

    def new_id(self) -> str:
        """A fresh ticket (and lease) id of this process."""
        self._serial += 1
        return f"{self.owner}#{self._serial}"

    def score_ms(self, since: float) -> int:
        """The queue score of a request that came at ``since`` (our clock, seconds):
        that time on Redis's clock, ms."""
        return int((since + self.offset_s) * 1000)

    @property
    def offset_s(self) -> float:
        """Redis's clock minus this process's, seconds (0 before the first reply): the
        largest recent sample, the one read soonest after Redis stamped it."""
        return max(self._offsets, default=0.0)

    def _learn_clock(self, now_ms: int) -> None:
        self._offsets.append(now_ms / 1000 - self.clock.now())

    async def start(self) -> None:
        """Renew liveness once (learning Redis's clock; a failure is logged, not raised),
        then start the heartbeat and the subscription."""
        self._running = True
        with contextlib.suppress(StateUnavailable):
            await self.heartbeat()
        self.spawn(self._beat_forever())
        self.spawn(self._listen_forever())

    async def close(self) -> None:
        """Stop the background tasks, give back this process's leases and tickets, and
        close the client it created."""
        self._running = False
        await self._tasks.close(CLOSE_S)
        with contextlib.suppress(Exception):
            for account in self.accounts.values():
                account.leases.clear()
                account.providers.clear()
                async with account.lock:
                    await self.call("close", account.sync_args)
            for share in self.tenants.values():
                share.held.clear()
                share.queued.clear()
                async with share.lock:
                    await self.call("close", share.sync_args)
            await self.client.zrem(self.key("procs"), self.owner)
        await close_bounded(self._sub_client.aclose())
        await close_bounded(self._sub_client.connection_pool.disconnect())
        if self._owns_client:
            await close_bounded(self.client.aclose())

    async def heartbeat(self) -> None:
        """Renew this process's liveness and republish, per backend, its leases and
        tickets.

        :raises StateUnavailable: Redis could not be reached.
        """
        now_ms = None
        if not self.accounts:
            now_ms = await self.call("renew", self._renew_only)
        for account in list(self.accounts.values()):
            async with account.lock:  # after a grant's leases are recorded (see lock)
                raw = await self.call("renew", account.sync_args)
            reply = self.reply(raw[:6])
            account.seen(reply)
            now_ms = reply.now_ms
            if len(raw) > 6 and int(raw[6]):
                log.error("shared state: this process renewed its liveness later than "
                          "lease_ttl_s (%g s), so the others took its %d lease(s) on %s "
                          "for dead and may have granted that capacity again; the "
                          "backend may overflow until they end. Raise lease_ttl_s, or "
                          "look for what stalled this process.",
                          self.settings.lease_ttl_s, len(account.leases), account.backend)
                if self._on_expired is not None:
                    self._on_expired(0, "renewed_late")
        for share in list(self.tenants.values()):
            await self.renew_tenant(share)
        alive = await self.call("renew", lambda: self.client.zrangebyscore(
            self.key("procs"), f"({now_ms}", "+inf"))
        self.stale = False
        self.processes = sorted(v.decode() if isinstance(v, bytes) else str(v)
                                for v in alive)

    async def renew_tenant(self, share: TenantShare) -> None:
        """The heartbeat's part for one tenant: its places in Redis become exactly
        those this process holds (after any acquire on its way, see
        :attr:`TenantShare.lock <gateway.admission.shared_tenants.TenantShare.lock>`).

        :raises StateUnavailable: Redis could not be reached.
        """
        async with share.lock:
            await self.call("renew", share.sync_args)

    async def _renew_only(self) -> int:
        t = await self.client.time()
        now_ms = int(t[0]) * 1000 + int(t[1]) // 1000
        await self.client.zadd(self.key("procs"),
                               {self.owner: now_ms + self.ttl_ms})
        self._learn_clock(now_ms)
        return now_ms

    @property
    def ttl_ms(self) -> int:
        """The lease TTL, ms."""
        return int(self.settings.lease_ttl_s * 1000)

    async def call(self, op: str, make: Callable[[], Any]) -> Any:
        """Run one Redis call (``make()`` returns its awaitable), timed and counted.

        :returns: its raw result.
        :raises StateUnavailable: Redis could not be reached or timed out.
        """
        start = self.clock.now()
        try:
            # Not asyncio.wait_for: on Python 3.11 it returns the call's result when the
            # call ends as the caller is cancelled, swallowing the cancellation, and a
            # loop around it (the heartbeat) then runs on for ever (issue 42).
            async with asyncio.timeout(self.settings.op_timeout_s):
                raw = await make()
        except (RedisError, OSError, TimeoutError) as exc:
            self._count(op, "error", start)
            if self.up:
                log.warning("shared state: Redis at %s cannot be reached (%s); refusing "
                            "new requests with 503 state_unavailable until it is back",
                            self._where(), type(exc).__name__)
            self.up = False
            self.stale = True
            raise StateUnavailable(
                "The gateway's shared admission state (Redis) cannot be reached, so it "
                "cannot know what the other gateway processes hold on this backend; "
                "retry after the Retry-After delay.", retry_after_s=2.0) from exc
        self._count(op, "ok", start)
        if not self.up:
            log.info("shared state: Redis at %s is reachable again; admission resumes "
                     "(after a resync of three renewals and half a second if Redis "
                     "restarted empty)", self._where())
        self.up = True
        return raw

    def reply(self, raw: Sequence[Any]) -> GrantReply:
        """Read a grant or sync script's reply; learn Redis's clock from it and count the
        leases and tickets of dead processes it dropped."""
        reply = GrantReply.parse(raw)
        self._learn_clock(reply.now_ms)
        if reply.purged and self._on_expired is not None:
            self._on_expired(reply.purged, "owner_lost")
        return reply

    def _where(self) -> str:
        return redact_url(self.settings.redis_url)  # never log a password

    def _count(self, op: str, outcome: str, start: float) -> None:
        if self._on_op is not None:
            self._on_op(op, outcome, max(0.0, self.clock.now() - start))

    def spawn(self, coro: Coroutine[Any, Any, Any]) -> asyncio.Task[Any]:
        """Run ``coro`` as one of the store's background tasks (ended by :meth:`close`;
        ``RuntimeError`` after it: see :meth:`TaskSet.spawn <gateway.tasks.TaskSet.spawn>`)."""
        return self._tasks.spawn(coro)

    def background(self, op: str, make: Callable[[], Any],
                   lock: asyncio.Lock | None = None) -> None:
        """Run the call ``make()`` as :meth:`call` does, in the background, under
        ``lock`` when given. A failure is dropped: the heartbeat, which republishes what
        this process holds, heals it. Nothing runs without an event loop (closing)."""
        async def run() -> None:
            with contextlib.suppress(StateUnavailable):
                if lock is None:
                    await self.call(op, make)
                    return
                async with lock:
                    await self.call(op, make)
        with contextlib.suppress(RuntimeError):
            self.spawn(run())


    async def _beat_forever(self) -> None:
        while not_cancelled() and self._running:
            await self.clock.sleep(self.settings.renew_interval_s)
            with contextlib.suppress(StateUnavailable):
                await self.heartbeat()

    async def _listen_forever(self) -> None:
        """Wake each account's admissions when its channel is published; reconnect after
        a loss, every renewal period."""
        prefix, tenants = self.key("wake", ""), self.key("twake", "")
        while not_cancelled() and self._running:
            pubsub = self._sub_client.pubsub(ignore_subscribe_messages=True)
            try:
                await pubsub.psubscribe(prefix + "*", tenants + "*")
                for account in self.accounts.values():
                    account.stir()  # what was published before this subscription
                for tenant in self.tenants.values():
                    tenant.stir()
                async for message in pubsub.listen():
                    stop_if_cancelled()
                    channel = message.get("channel")
                    name = (channel.decode() if isinstance(channel, bytes)
                            else str(channel))
                    if name.startswith(prefix):
                        woken: Any = self.accounts.get(name[len(prefix):])
                    else:
                        woken = self.tenants.get(name[len(tenants):])
                    if woken is not None:
                        woken.stir()
            except (RedisError, OSError):
                pass
            finally:
                await close_bounded(pubsub.aclose())
            if self._running:
                await self.clock.sleep(self.settings.renew_interval_s)


Provider = Callable[[], list[tuple[str, int]]]  # this process's waiting (ticket, score)


class SharedAccount:
    """One backend's shared budget as this process uses it.

    :ivar leases: this process's leases on the backend: id -> the record kept in Redis.
    :ivar reserved_tokens: KV tokens reserved by every process, as last seen.
    :ivar busy_slots: slots taken by every process, as last seen.
    :ivar queued: requests waiting on the backend in every process, as last seen.
    :ivar lock: held by each call that reads or writes this process's leases in Redis
        (grant, heartbeat, release), so that Redis runs them in the order their
        arguments were built: a heartbeat sent while a grant is on its way would
        otherwise republish the leases as they were before it, deleting the lease just
        granted (which this process then holds while Redis counts it free).
    """

    def __init__(self, store: SharedStore, backend: str) -> None:
        self.store = store
        self.backend = backend
        self.keys = [store.key("b", backend, "leases"), store.key("b", backend, "queue"),
                     store.key("procs"), store.key("epoch"), store.key("b", backend, "live"),
                     store.key("b", backend, "caps")]
        self.channel = store.key("wake", backend)
        self.leases: dict[str, str] = {}
        self.providers: list[Provider] = []
        self.listeners: list[Callable[[], None]] = []
        self.reserved_tokens = 0
        self.busy_slots = 0
        self.queued = 0
        self.lock = asyncio.Lock()
        #: The layout of the last grant; the predictive policy's live figures
        #: (:class:`~gateway.admission.shared_live.SharedLive`, when it is on).
        self.layout: Layout | None = None
        self.live: Any = None

    def bind(self, waiting: Provider, on_change: Callable[[], None]) -> None:
        """Add an admission of this backend: ``waiting()`` lists its waiting tickets and
        ``on_change()`` is called when the shared queue may have moved."""
        self.providers.append(waiting)
        self.listeners.append(on_change)

    def stir(self) -> None:
        """The backend's channel was published: wake its admissions."""
        for listener in list(self.listeners):
            listener()

    def _common(self) -> list[Any]:
        # After Redis started empty, nothing is granted for three renewals and half a
        # second: every live process republishes its leases meanwhile (each renewal does).
        s = self.store.settings
        resync_ms = int(3 * s.renew_interval_s * 1000 + 500)
        return [self.store.owner, self.store.ttl_ms, resync_ms, self.channel]

    def sync_args(self) -> Any:
        """The heartbeat's call for this backend (see ``_SYNC``)."""
        args = self._common()
        args.append(len(self.leases))
        for item in self.leases.items():
            args.extend(item)
        waiting = [t for provider in self.providers for t in provider()]
        args.append(len(waiting))
        for ticket, score in waiting:
            args.extend((ticket, score))
        return self.store._sync(keys=self.keys, args=args)

    def seen(self, reply: GrantReply) -> None:
        """Note the shared figures of a reply."""
        self.reserved_tokens, self.busy_slots = reply.reserved_tokens, reply.busy_slots
        self.queued = reply.queued

    async def grant(self, layout: Layout, asks: Sequence[Ask], *,
                    keep: Iterable[tuple[str, int]] = (),
                    order: Sequence[int] = ()) -> GrantReply:
        """Queue ``asks`` in the shared queue (and withdraw this process's tickets not in
        ``asks`` or ``keep``), then grant, atomically, while the queue's head is one of
        ``asks``: the turn goes to the first ungranted of ``asks`` in the order given
        (this process's serving order: its classes and fair shares), if it fits
        (:func:`gateway.core.capacity.fits` on the shared sums). Across processes the
        order is arrival time; within one, the order of ``asks``.

        :param layout: the backend's layout, as this process discovered it (with its
            ``busy_cap`` lowered to this process's SLO limit while one binds,
            :meth:`gateway.admission.slo.SloGuard.limited`).
        :param keep: other tickets of this process still waiting, (id, score).
        :param order: slot ids in the order this process would pick them (least recently
            used first); others after.
        :returns: the reply; each granted lease is recorded in :attr:`leases`.
        :raises StateUnavailable: Redis could not be reached.
        """
        if self.store.stale:  # after an outage: republish what this process holds first
            await self.store.heartbeat()
        keep = list(keep)
        # The first few of the order are enough: the script takes the first free one.
        args = self._common() + [layout.pool_tokens or 0, layout.slots,
                                 layout.usable_per_slot, layout.capacity_tokens,
                                 layout.busy_cap or 0,
                                 ",".join(map(str, list(order)[:ORDER_SENT])), len(keep)]
        for ticket, score in keep:
            args.extend((ticket, score))
        args.append(len(asks))
        for ask in asks:
            c = ask.charge
            args.extend((ask.ticket, ask.score_ms, c.tokens, c.slots,
                         c.prompt_tokens + c.max_tokens, 1 if c.pinnable else 0,
                         -1 if ask.prefer is None else ask.prefer))
        args.extend([0] * 4 if self.live is None else self.live.grant_args())
        self.layout = layout
        async with self.lock:
            reply = self.store.reply(await self.store.call(
                "grant", lambda: self.store._grant(keys=self.keys, args=args)))
            by_id = {ask.ticket: ask.charge for ask in asks}
            for ticket, ids in reply.granted.items():
                self._record(ticket, by_id[ticket], ids)
        self.seen(reply)
        if reply.granted and self.live is not None:
            self.live.kick()  # publish the new leases' figures soon
        return reply

    def hold_alone(self, lease_id: str, charge: Charge, slot_ids: tuple[int, ...]) -> None:
        """Record a lease granted without Redis (``on_unavailable = "local"``): the
        heartbeat publishes it once Redis answers again."""
        self._record(lease_id, charge, slot_ids)

    def _record(self, lease_id: str, charge: Charge, slot_ids: tuple[int, ...]) -> None:
        """Note a lease of this process as Redis holds it: ``owner|tokens|slots|ids``."""
        self.leases[lease_id] = (f"{self.store.owner}|{charge.tokens}|{charge.slots}|"
                                 f"{','.join(map(str, slot_ids))}")

    def release(self, ids: Iterable[str]) -> None:
        """Give back leases of this process (in the background:
        :meth:`SharedStore.background`)."""
        gone = [i for i in ids if self.leases.pop(i, None) is not None]
        if gone:
            self.store.background("release", lambda: self.store._release(
                keys=[self.keys[0], self.keys[4]], args=[self.channel, *gone]), self.lock)

    async def refresh(self, layout: Layout) -> GrantReply:
        """Read the backend's shared figures anew (:attr:`reserved_tokens`,
        :attr:`busy_slots`, :attr:`queued`): a :meth:`grant` that asks for nothing and
        keeps every ticket of this process waiting (those its admissions list), so the
        shared queue is left as it is. A pool scores its backends on them
        (:mod:`gateway.fleet.shared_pool`).

        :raises StateUnavailable: Redis could not be reached.
        """
        waiting = [t for provider in self.providers for t in provider()]
        return await self.grant(layout, [], keep=waiting)
