"""The predictive policy's live figures, shared by the gateway processes of one backend
(``[state] backend = "redis"`` with ``admission.policy = "predictive"``).

Under ``predictive`` a lease is charged a predicted answer length, and
:class:`~gateway.admission.live.LiveAccounting` follows what each tracked lease really
holds. Several processes in front of one backend each see only their own streams; here
each publishes, per backend, the live figures of its leases, so that the grant and the
pool's pressure are judged on the whole backend:

* ``{prefix}:b:{backend}:live``, a hash: lease id -> ``used|room|rate|progress|state|
  since|at`` (:class:`LiveFigures`). Written by :class:`SharedLive` every
  ``[state] live_interval_s`` while something changed (one call per backend, which also
  reads every process's figures back), and all of them once per ``renew_interval_s``
  (a Redis restarted empty gets them again). An entry goes with its lease: the release
  script deletes both, and a dead process's entries are purged with its leases.
* The grant script (:mod:`gateway.admission.shared`) counts each lease as the larger of
  its charge and its published use plus growth, and keeps the margin free: the
  arithmetic of :func:`live_reserved`, whose Lua twin is :data:`LIVE_LUA`
  (``tests/test_shared_live.py`` holds them to the same answers on a real
  ``redis-server``).

The staleness bound. A figure is measured at ``at`` (Redis's clock) and read later; in
between, its stream kept decoding. Every reader therefore projects a figure over the
growth horizon plus its age: ``growth = n x min(room, ceil(rate x (horizon + age)) + 1)``
tokens, ``rate`` the stream's decode rate per sequence. A figure's age is at most
``live_interval_s`` plus a call's time while the publisher runs, so what can go unseen
of one stream is its rate times that error, and the projection covers
``rate x (horizon + live_interval_s)`` per stream (36 tokens at 100 tokens/s with the
defaults, 0.25 s and 0.1 s). A lease granted but not published yet (for at most one
interval) is counted as its charge plus ``n x fresh_growth``, that same bound at the
fastest decode rate seen.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from gateway.core.capacity import LiveUse
from gateway.errors import StateUnavailable
from gateway.tasks import not_cancelled

if TYPE_CHECKING:
    from gateway.admission.shared import SharedAccount

__all__ = ["LIVE_LUA", "LiveFigures", "LiveRule", "LiveSnapshot", "SharedLive", "growth",
           "live_reserved"]

#: :attr:`LiveFigures.state`: may not be preempted; may be; already preempted (its cells
#: are freed within the horizon, so pressure no longer counts it).
KEPT, PREEMPTIBLE, PREEMPTED = 0, 1, 2


def growth(n: int, room: int, rate_m: int, window_ms: int) -> int:
    """KV cells a stream may add within ``window_ms``: ``n x min(room, ceil(rate x
    window) + 1)``, the one more covering the token in flight.

    :param n: completions (one sequence each).
    :param room: tokens per completion left before its cap (0: it cannot grow).
    :param rate_m: decode rate per sequence, thousandths of a token per second (integers
        keep the Lua twin's arithmetic exact).
    :param window_ms: milliseconds ahead.
    """
    return n * min(room, math.ceil(rate_m * window_ms / 1_000_000) + 1)


@dataclass(frozen=True)
class LiveFigures:
    """What one lease in flight holds, as its process last measured it.

    :param used: KV cells it holds now: n x (prompt + generated) when tracked, its whole
        charge when not.
    :param room: tokens per completion it may still generate (0 for an untracked lease).
    :param rate_m: its decode rate per sequence, thousandths of a token per second.
    :param progress: tokens generated over all its attempts (lost if it is preempted).
    :param state: :data:`KEPT`, :data:`PREEMPTIBLE` or :data:`PREEMPTED`.
    :param since_ms: when it was granted, on Redis's clock, ms (the victims' tie-break).
    :param at_ms: when measured, on Redis's clock, ms (stamped by the publish script).
    """

    used: int
    room: int
    rate_m: int
    progress: int
    state: int
    since_ms: int
    at_ms: int = 0

    def encode(self) -> str:
        """The hash value, without ``at`` (the script appends it)."""
        return (f"{self.used}|{self.room}|{self.rate_m}|{self.progress}|{self.state}|"
                f"{self.since_ms}")

    @classmethod
    def parse(cls, text: str) -> LiveFigures | None:
        """Read a hash value (seven integers); ``None`` when malformed."""
        parts = text.split("|")
        if len(parts) != 7 or not all(p.isdigit() for p in parts):
            return None
        return cls(*map(int, parts))

    def growth(self, n: int, window_ms: int) -> int:
        """:func:`growth` of this stream within ``window_ms``."""
        return growth(n, self.room, self.rate_m, window_ms)


@dataclass(frozen=True)
class LiveRule:
    """The predictive policy's numbers for a grant.

    :param margin_tokens: tokens of a unified pool in use kept free.
    :param horizon_ms: how far ahead use is projected
        (:data:`~gateway.admission.live.GROWTH_HORIZON_S`).
    :param fresh_growth: tokens per completion counted above its charge for a lease not
        published yet.
    """

    margin_tokens: int
    horizon_ms: int
    fresh_growth: int


def live_reserved(reserved: int, leases: Mapping[str, tuple[int, int]],
                  figures: Mapping[str, LiveFigures], now_ms: int, rule: LiveRule) -> int:
    """The reservation a grant is judged against on a unified pool under ``predictive``:
    ``reserved`` + the sum over ``leases`` of max(0, used + growth - charge) + the margin
    (none while no lease is in flight). A lease with figures grows over the horizon plus
    their age; one without counts ``n x fresh_growth``. Then
    :func:`gateway.core.capacity.fits` decides on it. :data:`LIVE_LUA` is its twin.

    :param reserved: the leases' charges summed, tokens.
    :param leases: lease id -> (charge tokens, n).
    :param figures: lease id -> its figures (entries of other leases are ignored).
    :param now_ms: the time figures are projected from, ms of their clock.
    :returns: tokens.
    """
    if not leases:
        return reserved
    excess = 0
    for lease_id, (tokens, n) in leases.items():
        fig = figures.get(lease_id)
        if fig is None:
            excess += n * rule.fresh_growth
            continue
        window = rule.horizon_ms + max(0, now_ms - fig.at_ms)
        excess += max(0, fig.used + fig.growth(n, window) - tokens)
    return reserved + excess + rule.margin_tokens


#: :func:`live_reserved` in the grant script. Needs ``live`` (the hash key), ``now``,
#: ``pool``, ``held_leases`` (id -> {tokens, n} of the live leases) and, at ARGV[b..b+3],
#: the rule: on (1/0), margin, horizon ms, fresh growth. Defines ``live_extra()``, the
#: tokens to add to ``reserved``, and ``live_granted(n)``, for a lease it grants.
LIVE_LUA = r"""
local live_on = tonumber(ARGV[b]) == 1 and live ~= nil and pool > 0
local margin, horizon, fresh = tonumber(ARGV[b + 1]), tonumber(ARGV[b + 2]),
  tonumber(ARGV[b + 3])
local excess, in_use = 0, 0
if live_on then
  local seen = {}
  local figs = redis.call('HGETALL', live)
  for i = 1, #figs, 2 do
    local h = held_leases[figs[i]]
    local used, room, rate, at = string.match(figs[i + 1],
      '^(%d+)|(%d+)|(%d+)|%d+|%d+|%d+|(%d+)$')
    if h == nil then
      redis.call('HDEL', live, figs[i])  -- its lease was released or purged
    elseif used then
      seen[figs[i]] = true
      local window = horizon + math.max(0, now - tonumber(at))
      local grown = h[2] * math.min(tonumber(room),
        math.ceil(tonumber(rate) * window / 1000000) + 1)
      excess = excess + math.max(0, tonumber(used) + grown - h[1])
    end
  end
  for id, h in pairs(held_leases) do
    in_use = in_use + 1
    if not seen[id] then excess = excess + h[2] * fresh end
  end
end
local function live_extra()
  if live_on and in_use > 0 then return excess + margin end
  return 0
end
local function live_granted(n)
  if live_on then in_use = in_use + 1; excess = excess + n * fresh end
end
"""

# KEYS 1 live hash, 2 leases hash, 3 procs. ARGV 1 count w, w x (id, figures), then the
# ids of this process's entries to delete. An entry is written only while its lease is
# held (a publish that crossed a release writes nothing). Returns {now, skipped count,
# skipped ids, leases count, (id, lease)..., figures count, (id, figures)...}: the live
# leases of every process and their figures.
_PUBLISH = r"""
local live, leases, procs = KEYS[1], KEYS[2], KEYS[3]
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local w = tonumber(ARGV[1])
local skipped = {}
for i = 0, w - 1 do
  local id, v = ARGV[2 + 2 * i], ARGV[3 + 2 * i]
  if redis.call('HEXISTS', leases, id) == 1 then
    redis.call('HSET', live, id, v .. '|' .. now)
  else
    table.insert(skipped, id)
  end
end
if #ARGV > 1 + 2 * w then redis.call('HDEL', live, unpack(ARGV, 2 + 2 * w)) end
local alive = {}
local held = {}
local all = redis.call('HGETALL', leases)
for i = 1, #all, 2 do
  local o = string.match(all[i + 1], '^([^|]*)|')
  if alive[o] == nil then
    local s = redis.call('ZSCORE', procs, o)
    alive[o] = (s ~= false and s ~= nil and tonumber(s) > now)
  end
  if alive[o] then table.insert(held, all[i]); table.insert(held, all[i + 1]) end
end
local figs = redis.call('HGETALL', live)
local res = {now, #skipped}
for _, id in ipairs(skipped) do table.insert(res, id) end
table.insert(res, #held / 2)
for _, v in ipairs(held) do table.insert(res, v) end
table.insert(res, #figs / 2)
for _, v in ipairs(figs) do table.insert(res, v) end
return res
"""


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


@dataclass(frozen=True)
class LiveSnapshot:
    """Every process's live leases on one backend, as one publish read them.

    :param now_ms: Redis's clock at the read, ms.
    :param read_at: this process's clock at the read, seconds.
    :param leases: lease id -> (owner, charge tokens, n).
    :param figures: lease id -> its figures, where published.
    :param skipped: this call's entries not written (their lease is no longer held).
    """

    now_ms: int = 0
    read_at: float = 0.0
    leases: dict[str, tuple[str, int, int]] = field(default_factory=dict)
    figures: dict[str, LiveFigures] = field(default_factory=dict)
    skipped: frozenset[str] = frozenset()

    @classmethod
    def parse(cls, raw: Sequence[Any], read_at: float) -> LiveSnapshot:
        """Read the publish script's reply."""
        values = [_text(v) for v in raw]
        i = 2 + int(values[1])
        skipped = frozenset(values[2:i])
        leases: dict[str, tuple[str, int, int]] = {}
        count, i = int(values[i]), i + 1
        for j in range(i, i + 2 * count, 2):
            owner, tokens, n, _ = values[j + 1].split("|")
            leases[values[j]] = (owner, int(tokens), int(n))
        count, i = int(values[i + 2 * count]), i + 2 * count + 1
        figures = {}
        for j in range(i, i + 2 * count, 2):
            fig = LiveFigures.parse(values[j + 1])
            if fig is not None:
                figures[values[j]] = fig
        return cls(int(values[0]), read_at, leases, figures, skipped)


Figures = Callable[[], dict[str, LiveFigures]]  # a bound accounting's leases, by id


class SharedLive:
    """One backend's live figures as this process publishes and reads them (one per
    :class:`~gateway.admission.shared.SharedAccount`, see :meth:`of`).

    Its loop runs while this process holds leases on the backend (started by
    :meth:`kick`): every ``[state] live_interval_s`` it makes one call, when its figures
    changed or a lease of its could be a victim (it then needs the others' figures), and
    republishes all of them every ``renew_interval_s``. After each call it tells the
    bound accountings, which judge the pool's pressure again.

    :param account: the backend's shared budget.
    :param horizon_s: how far ahead live use is projected, seconds.
    """

    def __init__(self, account: SharedAccount, *, horizon_s: float) -> None:
        self.account = account
        self.store = account.store
        self.key = self.store.key("b", account.backend, "live")
        self.horizon_ms = int(horizon_s * 1000)
        self.snapshot = LiveSnapshot()
        #: What this process last published, by lease id.
        self.sent: dict[str, LiveFigures] = {}
        self._bound: list[tuple[Figures, Callable[[], None], Callable[[], float], int]] = []
        self._task: asyncio.Task[None] | None = None
        self._full_at = -math.inf
        self._publish = self.store.client.register_script(_PUBLISH)

    @classmethod
    def of(cls, account: SharedAccount, *, horizon_s: float) -> SharedLive:
        """The account's one instance (made on first use)."""
        if account.live is None:
            account.live = cls(account, horizon_s=horizon_s)
        live: SharedLive = account.live
        return live

    def bind(self, figures: Figures, on_read: Callable[[], None],
             rate: Callable[[], float], margin_tokens: int) -> None:
        """Add an accounting of this backend: ``figures()`` lists its leases' figures,
        ``on_read()`` is called after each read, ``rate()`` is the fastest decode rate it
        has seen (tokens/s per sequence), and its margin is kept free in grants."""
        self._bound.append((figures, on_read, rate, margin_tokens))

    @property
    def interval_s(self) -> float:
        """``[state] live_interval_s``."""
        return float(self.store.settings.live_interval_s)

    def rule(self) -> LiveRule:
        """The grant's numbers: the largest margin bound, and the staleness bound at the
        fastest decode rate seen as the growth of a lease not yet published."""
        rate_m = round(max((b[2]() for b in self._bound), default=0.0) * 1000)
        window_ms = self.horizon_ms + int(self.interval_s * 1000)
        return LiveRule(max((b[3] for b in self._bound), default=0), self.horizon_ms,
                        growth(1, 2**31, rate_m, window_ms))

    def grant_args(self) -> list[int]:
        """The rule as the grant script reads it (ARGV after the asks)."""
        rule = self.rule()
        return [1, rule.margin_tokens, rule.horizon_ms, rule.fresh_growth]

    def kick(self) -> None:
        """Start the loop if it is not running (a lease was granted or advanced)."""
        if self._task is not None and not self._task.done():
            return
        try:
            asyncio.get_running_loop()
        except RuntimeError:
            return
        with contextlib.suppress(RuntimeError):  # the store is closed
            self._task = self.store.spawn(self._run())

    def collect(self) -> dict[str, LiveFigures]:
        """This process's figures on the backend, by lease id."""
        mine: dict[str, LiveFigures] = {}
        for figures, *_ in self._bound:
            mine.update(figures())
        return mine

    async def step(self) -> bool:
        """One round of the loop: publish if due (:meth:`_due`), then let the bound
        accountings judge the pressure on what was read.

        :returns: False once this process has nothing left on the backend to publish or
            withdraw (the loop then ends; :meth:`kick` starts it again).
        """
        mine = self.collect()
        if not mine and not self.sent:
            return False
        if self._due(mine):
            with contextlib.suppress(StateUnavailable):  # the others' figures age
                await self.publish(mine)
            for _, on_read, *_ in list(self._bound):
                on_read()
        return True

    async def _run(self) -> None:
        while not_cancelled() and await self.step():
            await self.store.clock.sleep(self.interval_s)

    def _due(self, mine: Mapping[str, LiveFigures]) -> bool:
        """A call is worth making: figures changed, a lease here could be a victim, or
        the periodic republish is due."""
        if mine.keys() != self.sent.keys() or any(
                self.sent[k].encode() != f.encode() for k, f in mine.items()):
            return True
        if any(f.state == PREEMPTIBLE for f in mine.values()):
            return True
        return bool(mine) and self._full_due()

    def _full_due(self) -> bool:
        return self.store.clock.now() - self._full_at >= self.store.settings.renew_interval_s

    async def publish(self, mine: Mapping[str, LiveFigures]) -> LiveSnapshot:
        """Write what changed of ``mine`` (all of it when the periodic republish is due),
        delete this process's entries no longer in it, and read every process's back.

        :returns: the new :attr:`snapshot`.
        :raises StateUnavailable: Redis could not be reached.
        """
        full = self._full_due()
        sent = self.sent
        writes = [(k, f) for k, f in mine.items()
                  if full or k not in sent or sent[k].encode() != f.encode()]
        args: list[Any] = [len(writes)]
        for lease_id, fig in writes:
            args.extend((lease_id, fig.encode()))
        args.extend(k for k in sent if k not in mine)
        keys = [self.key, self.account.keys[0], self.store.key("procs")]
        raw = await self.store.call("live", lambda: self._publish(keys=keys, args=args))
        snap = LiveSnapshot.parse(raw, self.store.clock.now())
        self.sent = {k: f for k, f in mine.items() if k not in snap.skipped}
        if full:
            self._full_at = snap.read_at
        self.snapshot = snap
        return snap

    def rank(self, progress: int, granted_at: float) -> tuple[int, float]:
        """(progress, since) a lease of this process is ordered by among the victims
        (:class:`~gateway.admission.live.Peers`): by grant time alone, on Redis's clock,
        the latest first. Each process reads the others' progress at another age, so two
        of them could each take the other's lease for the least advanced and neither
        preempt (seen in CI: two streams at 238 tokens each overflowed the pool
        together); grant times never change, so every process picks the same victims."""
        return 0, self.store.score_ms(granted_at) / 1000

    def others(self, now: float, fresh_growth: int | None = None
               ) -> tuple[list[LiveUse], int | None]:
        """The other processes' leases as :func:`~gateway.core.capacity.choose_victims`
        takes them (keys -1, -2, ...: none is this process's), each projected over the
        horizon plus its figures' age at ``now`` (this process's clock); and the sum of
        their whole caps, or ``None`` when one is not known (a lease not published yet,
        counted as its charge plus ``n x fresh_growth``, by default the rule's)."""
        if fresh_growth is None:
            fresh_growth = self.rule().fresh_growth
        snap = self.snapshot
        now_ms = snap.now_ms + round((now - snap.read_at) * 1000)
        uses: list[LiveUse] = []
        caps: int | None = 0
        for i, (lease_id, (owner, tokens, n)) in enumerate(snap.leases.items()):
            if owner == self.store.owner:
                continue
            fig = snap.figures.get(lease_id)
            if fig is None:
                uses.append(LiveUse(-1 - i, tokens, n * fresh_growth, 0, False))
                caps = None
                continue
            if fig.state == PREEMPTED:
                continue
            window = self.horizon_ms + max(0, now_ms - fig.at_ms)
            uses.append(LiveUse(-1 - i, fig.used, fig.growth(n, window), 0,
                                fig.state == PREEMPTIBLE, fig.since_ms / 1000))
            if caps is not None:
                caps += fig.used + n * fig.room
        return uses, caps
