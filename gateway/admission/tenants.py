"""Who may use the gateway, and how much: tenants, their keys, classes and quotas.

A request names its tenant by its key, sent as ``Authorization: Bearer KEY`` (the
OpenAI SDKs) or ``x-api-key: KEY`` (the Anthropic SDK). Keys are kept only as SHA-256
hashes (:func:`hash_key`); a presented key is hashed and compared with every hash
configured in constant time (``hmac.compare_digest``), so neither the time taken nor
the logs tell anything about the keys.

Each tenant has a priority class, a weight (its share of KV tokens when several wait,
:mod:`gateway.core.fairness`) and optional quotas:

* ``max_inflight``: most of its requests past its gate at once, waiting for capacity or
  in flight; the rest wait at the gate, in arrival order;
* ``max_queued``: most of its requests waiting at once (at the gate or for capacity);
  one more is refused with 429;
* ``tokens_per_minute``: prompt + completion tokens over the last 60 s, as the gateway
  counts them (the prompt at arrival, the completion from the backend's usage when the
  answer ends; a request refused before forwarding is taken back out). A request whose
  prompt would pass the limit is refused with 429 and OpenAI's ``x-ratelimit-*-tokens``
  headers.

With no tenant configured every request is the tenant :data:`~gateway.core.fairness.ANONYMOUS`
and nothing is checked.
"""

from __future__ import annotations

import hashlib
import hmac
import math
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Protocol

from gateway.admission.waitroom import Waitroom
from gateway.clock import Clock
from gateway.config import Settings, TenantSettings
from gateway.core.fairness import ANONYMOUS, Party
from gateway.errors import Forbidden, InvalidRequest, RateLimited, Unauthorized
from gateway.wire import routes

__all__ = ["LOCAL", "OPEN_PATHS", "PRIORITY_HEADER", "TOKENS_WINDOW_S", "LocalQuota",
           "Quota", "Tenant", "Tenants", "TokenHold", "admin_key_matches", "hash_key",
           "key_of", "local_quota", "window_reset_s"]

TOKENS_WINDOW_S = 60.0  # the tokens_per_minute window, seconds
PRIORITY_HEADER = "x-priority"  # a request's class, when it asks for a lower one
OPEN_PATHS = routes.OPEN_PATHS  # probes: never need a key


def hash_key(key: str) -> str:
    """The SHA-256 of ``key`` (UTF-8), as 64 lowercase hex digits: the form keys are
    configured in (``[[tenants]] key_hashes``)."""
    return hashlib.sha256(key.encode("utf-8", "surrogateescape")).hexdigest()


def key_of(headers: Iterable[tuple[bytes, bytes]]) -> str | None:
    """The key a request presents: ``Authorization: Bearer KEY`` or ``x-api-key: KEY``.

    :returns: the key, or ``None`` when neither header is there.
    :raises Unauthorized: an ``Authorization`` header of another form (``Basic``, no
        scheme, an empty key).
    """
    auths = [v for k, v in headers if k.lower() == b"authorization"]
    api_keys = [v for k, v in headers if k.lower() == b"x-api-key"]
    if len(auths) > 1 or len(api_keys) > 1:
        raise Unauthorized("The request has more than one Authorization or x-api-key "
                           "header; send one key.")
    if auths:  # bytes kept as sent (UTF-8 or not): the hash is of those very bytes
        scheme, _, key = auths[0].decode("utf-8", "surrogateescape").strip().partition(" ")
        if scheme.lower() != "bearer" or not key.strip():
            raise Unauthorized("The Authorization header must be \"Bearer <key>\"; the "
                               "gateway takes no other scheme.")
        return key.strip()
    if api_keys and api_keys[0].strip():
        return api_keys[0].decode("utf-8", "surrogateescape").strip()
    return None




def admin_key_matches(given: str, expected: str) -> bool:
    """``given`` is ``expected`` (surrounding spaces of ``expected`` aside), compared in
    constant time over their SHA-256 digests."""
    return hmac.compare_digest(
        hashlib.sha256(given.encode("utf-8", "surrogateescape")).digest(),
        hashlib.sha256(expected.strip().encode("utf-8", "surrogatepass")).digest())


def format_reset(seconds: float) -> str:
    """A duration as OpenAI writes ``x-ratelimit-reset-tokens``: ``250ms``, ``1.5s``,
    ``6m0s``."""
    if seconds < 1:
        return f"{max(0, math.ceil(seconds * 1000))}ms"
    if seconds < 60:
        return f"{math.ceil(seconds * 10) / 10:g}s"
    minutes, rest = divmod(math.ceil(seconds), 60)
    return f"{minutes}m{rest}s"


def window_reset_s(entries: Iterable[tuple[float, int]], excess: int) -> float:
    """Seconds until ``excess`` tokens have left a tokens-per-minute window whose entries
    are ``entries``, (age seconds, tokens), oldest first."""
    if excess <= 0:
        return 0.0
    for age, tokens in entries:
        excess -= tokens
        if excess <= 0:
            return max(0.0, TOKENS_WINDOW_S - age)
    return TOKENS_WINDOW_S


@dataclass(eq=False)
class TokenHold:
    """Tokens one request counts in its tenant's window, from ``at`` (clock seconds).

    :param entry: with quotas counted over every process, its entry in Redis and that
        entry's time (ms on Redis's clock), for :meth:`Tenant.settle`.
    """

    at: float
    tokens: int
    settled: bool = False  # its final count is in
    entry: tuple[str, int] | None = None


class Quota(Protocol):
    """Where a tenant's quotas are counted: over this process's requests
    (:data:`LOCAL`), or over every gateway process's
    (:class:`~gateway.admission.shared_tenants.TenantShare`, with ``[state] backend =
    "redis"``). Chosen once, when the tenant is made (:attr:`Tenants.quota_for`); the
    tenant hands each step to it and never asks which it has. Each method is the
    tenant's method of the same name (``take_tokens``: :meth:`Tenant.hold`), given the
    tenant."""

    async def take_tokens(self, tenant: Tenant, now: float, prompt_tokens: int
                          ) -> TokenHold | None: ...

    def settle_tokens(self, hold: TokenHold, prompt: int, completion: int) -> None: ...

    def window(self, tenant: Tenant, now: float) -> tuple[int, float]: ...

    async def begin_waiting(self, tenant: Tenant, now: float) -> None: ...

    def stop_waiting(self) -> None: ...

    def enter_now(self, tenant: Tenant) -> bool: ...

    async def enter(self, tenant: Tenant, timeout_s: float, clock: Clock) -> float: ...

    def leave(self, tenant: Tenant) -> None: ...

    def stir(self) -> None: ...


class LocalQuota:
    """A tenant's quotas over this process's requests only: the tenant's own window,
    counts and gate (:class:`Quota`)."""

    async def take_tokens(self, tenant: Tenant, now: float, prompt_tokens: int
                          ) -> TokenHold | None:
        return tenant.hold_tokens(now, prompt_tokens)

    def settle_tokens(self, hold: TokenHold, prompt: int, completion: int) -> None:
        """Nothing: the tenant's window is all there is."""

    def window(self, tenant: Tenant, now: float) -> tuple[int, float]:
        return tenant.local_window(now)

    async def begin_waiting(self, tenant: Tenant, now: float) -> None:
        tenant.start_waiting(now)

    def stop_waiting(self) -> None:
        """Nothing: the tenant's count is all there is."""

    def enter_now(self, tenant: Tenant) -> bool:
        return tenant.pass_gate_now()

    async def enter(self, tenant: Tenant, timeout_s: float, clock: Clock) -> float:
        return await tenant.wait_at_gate(timeout_s, clock)

    def leave(self, tenant: Tenant) -> None:
        tenant.leave_gate()

    def stir(self) -> None:
        """Nothing: the gate's waiters are woken by the gate itself."""


#: The quotas of every tenant of a gateway whose state is its own.
LOCAL = LocalQuota()


def local_quota(name: str) -> Quota:
    """:data:`LOCAL`, for any tenant ``name``: :attr:`Tenants.quota_for` by default."""
    return LOCAL


@dataclass(eq=False)
class Tenant:
    """One tenant's settings and live state (what a reload keeps).

    :param settings: its ``[[tenants]]`` entry, or ``None`` for the anonymous tenant.
    :param rank: its class's rank (0: the highest); ``priority`` the class's name.
    :param quota: where its quotas are counted (:class:`Quota`): this process's
        requests only, by default.
    """

    name: str
    settings: TenantSettings | None
    rank: int
    priority: str
    inflight: int = 0  # requests past its gate
    # Requests waiting, at its gate or for capacity; changed only by its methods (enter,
    # and start_waiting / stop_waiting / counted_waiting around the wait for capacity).
    waiting: int = 0
    # Requests waiting at the gate, in arrival order (one party: FIFO). Made by the first
    # request that waits there, on the clock that request's wait is measured on.
    _gate: Waitroom[None, None] | None = None
    _window: deque[TokenHold] = field(default_factory=deque)
    quota: Quota = LOCAL
    refused: Exception | None = None  # refuse_waiting's error, for a gate that polls

    @property
    def weight(self) -> float:
        """Its share weight (1 for the anonymous tenant)."""
        return 1.0 if self.settings is None else self.settings.weight

    # -- tokens per minute -----------------------------------------------------------

    def used_tokens(self, now: float) -> int:
        """Tokens counted in the last :data:`TOKENS_WINDOW_S` seconds."""
        while self._window and self._window[0].at <= now - TOKENS_WINDOW_S:
            self._window.popleft()
        return sum(hold.tokens for hold in self._window)

    def rate_headers(self, now: float) -> dict[str, str]:
        """OpenAI's ``x-ratelimit-*-tokens`` headers, when a tokens quota is set: the
        limit, what is left of it now, and how long until the window is empty again
        (the whole limit is back)."""
        limit = self.settings.tokens_per_minute if self.settings else None
        if limit is None:
            return {}
        used, full = self.quota.window(self, now)
        return {"x-ratelimit-limit-tokens": str(limit),
                "x-ratelimit-remaining-tokens": str(max(0, limit - used)),
                "x-ratelimit-reset-tokens": format_reset(full)}

    def local_window(self, now: float) -> tuple[int, float]:
        """Tokens in this process's window, and seconds until it is empty."""
        full = self._window[-1].at + TOKENS_WINDOW_S - now if self._window else 0.0
        return self.used_tokens(now), full

    def count(self, hold: TokenHold) -> TokenHold:
        """Keep ``hold`` in this process's window (one its quota took); returns it."""
        self._window.append(hold)
        return hold

    def hold_tokens(self, now: float, prompt_tokens: int) -> TokenHold | None:
        """Count ``prompt_tokens`` in the window for a request arriving now (all its
        prompts, for a batch).

        :returns: the hold (settle it with :meth:`settle`), or ``None`` with no quota.
        :raises RateLimited: the window cannot take them (``reason`` tokens_per_minute).
        """
        limit = self.settings.tokens_per_minute if self.settings else None
        if limit is None:
            return None
        used = self.used_tokens(now)
        if used + prompt_tokens > limit:
            self.refuse_tokens(now, used, prompt_tokens, limit,
                               self._reset_s(now, used, prompt_tokens, limit))
        return self.count(TokenHold(now, prompt_tokens))

    async def hold(self, now: float, prompt_tokens: int) -> TokenHold | None:
        """:meth:`hold_tokens`, over the window of every process its quota counts (one
        atomic check-and-add in Redis when shared).

        :raises RateLimited: as :meth:`hold_tokens`.
        :raises StateUnavailable: the quota is shared and Redis cannot be reached.
        """
        return await self.quota.take_tokens(self, now, prompt_tokens)

    def refuse_tokens(self, now: float, used: int, prompt_tokens: int, limit: int,
                      wait: float) -> None:
        """:raises RateLimited: ``prompt_tokens`` do not fit the window (``used`` of
        ``limit``); they fit in ``wait`` seconds."""
        headers = self.rate_headers(now)
        if prompt_tokens > limit:
            raise RateLimited(
                f"This request's prompt has {prompt_tokens} tokens, more than tenant "
                f"{self.name!r} may use in a minute ({limit}); it can never pass. "
                "Shorten the prompt, or ask for a larger tokens_per_minute.",
                reason="tokens_per_minute", retry_after_s=None,
                headers={**headers, "x-should-retry": "false"})
        raise RateLimited(
            f"Tenant {self.name!r} is over its tokens per minute: limit {limit}, used "
            f"{used}, requested {prompt_tokens} (prompt). Retry in {wait:.1f} s.",
            reason="tokens_per_minute", retry_after_s=wait, headers=headers)

    def settle(self, hold: TokenHold | None, prompt: int, completion: int, now: float
               ) -> None:
        """Set what a held request really counts, once it has ended: its prompt stays
        where it arrived (0, and out of the window, when it was never forwarded), and
        its completion counts from ``now``, when it was generated. Once per hold."""
        if hold is None or hold.settled:
            return
        self.quota.settle_tokens(hold, max(0, prompt), completion)
        hold.settled = True
        hold.tokens = max(0, prompt)
        if not hold.tokens and hold in self._window:
            self._window.remove(hold)
        if completion > 0:
            self._window.append(TokenHold(now, completion, settled=True))

    def reopen(self) -> None:
        """Let waiters through the gate while its (new) ``max_inflight`` allows: after
        a reload raised or removed it."""
        cap = self.settings.max_inflight if self.settings else None
        gate = self._gate
        while gate is not None and (turn := gate.head()) is not None and (
                cap is None or self.inflight < cap):
            self.inflight += 1
            gate.grant(turn, None)

    def refuse_waiting(self, exc: Exception) -> None:
        """Fail every request waiting at the gate with ``exc`` (the gateway drains)."""
        self.refused = exc
        self.quota.stir()
        if self._gate is not None:
            self._gate.refuse_waiting(exc)

    def _reset_s(self, now: float, used: int, need: int, limit: int) -> float:
        """Seconds until ``need`` more tokens fit this process's window."""
        return window_reset_s(((now - hold.at, hold.tokens) for hold in self._window),
                              used + need - limit)

    # -- the gate (max_inflight, max_queued) ------------------------------------------

    def check_queued(self, now: float) -> None:
        """Raise when one more waiting request would pass ``max_queued`` (``now``: the
        clock time, for the tokens headers).

        :raises RateLimited: reason ``max_queued``.
        """
        cap = self.settings.max_queued if self.settings else None
        if cap is not None and self.waiting >= cap:
            self.refuse_queued(cap, now)

    def refuse_queued(self, cap: int, now: float) -> None:
        """:raises RateLimited: ``cap`` requests of the tenant wait already."""
        raise RateLimited(
            f"Tenant {self.name!r} already has as many requests waiting as its "
            f"max_queued ({cap}); retry when some have been served.",
            reason="max_queued", retry_after_s=1.0, headers=self.rate_headers(now))

    def start_waiting(self, now: float) -> None:
        """Count one more of its requests as waiting (for capacity, past the gate);
        pair with :meth:`stop_waiting`.

        :raises RateLimited: that would pass ``max_queued`` (see :meth:`check_queued`);
            then nothing is counted.
        """
        self.check_queued(now)
        self.waiting += 1

    async def begin_waiting(self, now: float) -> None:
        """:meth:`start_waiting`, counted over every process its quota counts (an
        atomic take-if-below-cap in Redis when shared; Redis lost: this process's
        waiters only); pair with :meth:`stop_waiting`.

        :raises RateLimited: one more waiting would pass ``max_queued``; then nothing
            is counted.
        """
        await self.quota.begin_waiting(self, now)

    def stop_waiting(self) -> None:
        """One of its requests counted by :meth:`start_waiting` (or
        :meth:`begin_waiting`) waits no more."""
        self.waiting -= 1
        self.quota.stop_waiting()

    @contextmanager
    def counted_waiting(self, now: float) -> Iterator[None]:
        """Count one of its requests as waiting for the ``with`` block (as
        :meth:`start_waiting`, then :meth:`stop_waiting` however the block ends).

        :raises RateLimited: one more waiting would pass ``max_queued``.
        """
        self.start_waiting(now)
        try:
            yield
        finally:
            self.stop_waiting()

    def enter_now(self) -> bool:
        """Pass the gate if it takes no wait nor Redis call (else await :meth:`enter`)."""
        return self.quota.enter_now(self)

    async def enter(self, timeout_s: float, clock: Clock) -> float:
        """Pass the tenant's gate: at once while fewer than ``max_inflight`` of its
        requests (in every process its quota counts) are past it, else wait in arrival
        order (counted as waiting).

        :param timeout_s: the longest wait at the gate, seconds (on ``clock``).
        :returns: seconds waited at the gate.
        :raises RateLimited: ``max_queued`` already wait, or the wait passed ``timeout_s``.
        :raises Exception: what :meth:`refuse_waiting` was given (a drain's)."""
        return await self.quota.enter(self, timeout_s, clock)

    def leave(self) -> None:
        """A request past the gate has ended: let the next waiting one through."""
        self.quota.leave(self)

    def refuse_inflight(self, cap: int, timeout_s: float, now: float, where: str = ""
                        ) -> RateLimited:
        """The 429 of a request that waited ``timeout_s`` at the gate, ``cap`` (its
        ``max_inflight``) being in hand all that time (``where``: over which processes,
        words put after the cap's name)."""
        return RateLimited(
            f"Tenant {self.name!r} had {cap} requests in hand (its max_inflight{where}) "
            f"for the {timeout_s:g} s this request may wait; retry later.",
            reason="max_inflight", retry_after_s=1.0, headers=self.rate_headers(now))

    # -- this process's gate (LocalQuota's; a shared quota's without max_inflight) -----

    def pass_gate_now(self) -> bool:
        """Pass this process's gate if it takes no wait."""
        cap = self.settings.max_inflight if self.settings else None
        passed = cap is None or (self.inflight < cap and not self._gate)
        self.inflight += passed
        return passed

    async def wait_at_gate(self, timeout_s: float, clock: Clock) -> float:
        """:meth:`enter` by this process's gate alone."""
        if self.pass_gate_now():
            return 0.0
        cap = self.settings.max_inflight if self.settings else None
        if self._gate is None:
            self._gate = Waitroom(clock, give_back=lambda _: self.leave())
        with self.counted_waiting(clock.now()):
            turn = self._gate.join(None, Party(self.name))
            await self._gate.wait(turn, timeout_s, lambda: self.refuse_inflight(
                cap or 0, timeout_s, clock.now()))
        return clock.now() - turn.since

    def leave_gate(self) -> None:
        """:meth:`leave` by this process's gate alone."""
        if self._gate is not None and (turn := self._gate.head()) is not None:
            self._gate.grant(turn, None)  # its place passes on: inflight stays the same
            return
        self.inflight -= 1


@dataclass
class Tenants:
    """Every tenant, their keys, and the classes (built from :class:`Settings`).

    :param settings: the configuration.
    :param previous: the registry a reload replaces: tenants of the same name keep
        their live state (requests in hand, token window).
    """

    settings: Settings
    previous: Tenants | None = None
    #: The quota of a tenant made now, by its name: counted over every gateway process
    #: with ``[state] backend = "redis"`` (the store's ``tenant``), else
    #: :func:`local_quota`. A tenant a reload keeps keeps its own.
    quota_for: Callable[[str], Quota] = local_quota
    by_name: dict[str, Tenant] = field(init=False)
    # Tenants a reload removed while they held requests: the same objects come back if
    # a later reload adds them again, so their counts stay right.
    retired: dict[str, Tenant] = field(init=False, default_factory=dict)
    ranks: dict[str, int] = field(init=False)
    _hashes: list[tuple[bytes, Tenant]] = field(init=False)

    def __post_init__(self) -> None:
        classes = self.settings.classes
        self.ranks = {c.name: i for i, c in enumerate(classes)}
        self._waits = {c.name: c.max_queue_wait_s for c in classes}
        self._targets = {c.name: (c.ttft_p95_s, c.itl_p95_s, c.late == "serve")
                         for c in classes}
        # Tenants of the running registry, and removed ones still holding requests.
        old = ({**self.previous.retired, **self.previous.by_name}
               if self.previous is not None else {})
        self.by_name = {}
        for entry in self.settings.tenants or ():
            priority = entry.priority or classes[0].name
            tenant = old.get(entry.name) or Tenant(entry.name, entry, 0, priority,
                                                   quota=self.quota_for(entry.name))
            tenant.settings, tenant.priority = entry, priority
            tenant.rank = self.ranks[priority]
            self.by_name[entry.name] = tenant
        if not self.settings.tenants:
            self.by_name[ANONYMOUS] = old.get(ANONYMOUS) or Tenant(
                ANONYMOUS, None, 0, classes[0].name)
        self.retired = {name: t for name, t in old.items()
                        if name not in self.by_name and (t.inflight or t.waiting)}
        for tenant in self.by_name.values():
            tenant.reopen()
        self._hashes = [(bytes.fromhex(h), t) for t in self.by_name.values()
                        if t.settings is not None for h in t.settings.key_hashes]
        self.previous = None  # keep no chain of old registries

    @property
    def open(self) -> bool:
        """No tenant is configured: anyone may call, as the anonymous tenant."""
        return not self.settings.tenants

    def authenticate(self, headers: Iterable[tuple[bytes, bytes]]) -> Tenant:
        """The tenant whose key the request presents.

        :raises Unauthorized: tenants are configured and no key, a key in another form,
            or an unknown key was given.
        """
        if self.open:
            return self.by_name[ANONYMOUS]
        key = key_of(headers)
        if key is None:
            raise Unauthorized("This gateway needs an API key: send \"Authorization: "
                               "Bearer <key>\" (or \"x-api-key: <key>\").")
        digest = hashlib.sha256(key.encode("utf-8", "surrogateescape")).digest()
        found: Tenant | None = None
        for expected, tenant in self._hashes:  # every hash, whatever matches
            if hmac.compare_digest(digest, expected):
                found = tenant
        if found is None:
            raise Unauthorized("The API key is not valid for this gateway.")
        return found

    def party(self, tenant: Tenant, asked: object = None) -> Party:
        """The :class:`Party` of a request of ``tenant`` asking for class ``asked``
        (a class name, or ``None`` for the tenant's own); its ``max_wait_s`` is the
        class's, else ``admission.max_queue_wait_s``, and its latency targets the class's.

        :raises InvalidRequest: ``asked`` is not a class name.
        :raises Forbidden: ``asked`` is a class above the tenant's.
        """
        name = tenant.priority
        if isinstance(asked, str) and not asked.strip():
            asked = None  # an empty x-priority header: the tenant's own class
        if asked is not None:
            if not isinstance(asked, str) or asked not in self.ranks:
                raise InvalidRequest(
                    f"Unknown priority class {str(asked)[:64]!r}; the classes are "
                    f"{', '.join(self.ranks)} (highest first).", param="priority")
            if self.ranks[asked] < tenant.rank:
                raise Forbidden(f"Priority class {asked!r} is above the class of tenant "
                                f"{tenant.name!r} ({tenant.priority!r}); a request may "
                                "only ask for a lower class.", param="priority")
            name = asked
        wait = self._waits[name] or self.settings.admission.max_queue_wait_s
        ttft, itl, late = self._targets[name]
        return Party(tenant.name, self.ranks[name], name, tenant.weight, wait,
                     ttft_target_s=ttft, itl_target_s=itl, serve_late=late)
