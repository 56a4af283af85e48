"""Pure model of one backend's layout: what config and discovery say, less what the
gateway learnt from overflows and preemptions.

Rules of this module: no I/O, no logging and no clock of its own (every time is passed
in, seconds on the gateway's clock); it imports only :mod:`gateway.core.capacity`. The
caller (:class:`gateway.backends.target.Target`) reads the server, logs and applies the
layout to its admission.

**Layout.** For slots, context and pool, the smaller of the configured value and the one
the server reports (a server never holds more than it reports; config can only narrow
it), either one when the other is unknown. The pool is then ``pool_tokens`` / the
reported pool (vLLM), else one slot's context (the safe guess,
``shared/design/backends.md`` §4.7); less the *penalty*. A pool smaller than the context
lowers the context to it.

**Penalty.** An overflow of the unified pool (llama-server fails every request in flight
with "Context size has been exceeded") or a rise in the server's preemption count while
the gateway admitted work (vLLM preempts rather than failing, ``shared/cases/public.md``
P10) means the model of the pool let in more than the server holds: 10 % comes off, or
down to the cells the gateway's requests held, never below one slot's context
(``shared/design/backends.md`` §4.10). After :data:`PENALTY_RECOVERY_S` quiet seconds half
of it comes back; a restarted server clears it.

**Busy cap.** A server that refuses a request for want of room by limits of its own (vLLM
answers 503 once its requests in flight reach ``--max-num-queued-reqs``, or the prompt
tokens waiting for prefill ``--max-num-queued-tokens``: ``vllm/v1/engine/async_llm.py``
``check_admission``) held at most what the gateway's other requests there held: the
slots kept busy at once are capped to those (at least one), the layout's ``busy_cap``.
After :data:`CAP_RECOVERY_S` seconds without such a refusal the cap doubles, and it goes
once it reaches the slots; a restarted server clears it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from gateway.core.capacity import Layout

__all__ = ["CAP_RECOVERY_S", "OVERFLOW_BURST_S", "PENALTY_RECOVERY_S", "Limits", "PoolModel",
           "Reported", "describe", "smaller"]

PENALTY_RECOVERY_S = 300.0  # quiet time after which the pool penalty is halved
CAP_RECOVERY_S = 60.0  # time without a refusal for want of room after which the cap doubles
# Overflow reports this close together are one overflow: llama-server fails every request
# in flight at once, and each of them reports it.
OVERFLOW_BURST_S = 2.0


@dataclass(frozen=True)
class Limits:
    """The configured numbers of one backend (``[[backends]]``; ``None``: not set).

    :param slots: ``slots``.
    :param ctx_per_slot: ``ctx_per_slot``, tokens.
    :param pool_tokens: ``pool_tokens``, tokens.
    :param unified: the slots may share one KV pool: ``unified`` is set and the kind's
        server can share one (``Dialect.unified_pool``).
    :param stop_margin: tokens of a slot a request can never use (the kind's
        ``stop_margin``: 1 for llama-server, 0 for vLLM).
    """

    slots: int | None = None
    ctx_per_slot: int | None = None
    pool_tokens: int | None = None
    unified: bool = True
    stop_margin: int = 1


class Reported(Protocol):
    """What the server reports of its capacity (``gateway.backends.base.Discovered``
    has these fields)."""

    @property
    def slots(self) -> int: ...
    @property
    def ctx_per_slot(self) -> int: ...
    @property
    def pool_tokens(self) -> int | None: ...
    @property
    def block_size(self) -> int: ...
    @property
    def preemptions(self) -> int | None: ...


@dataclass
class PoolModel:
    """The pool penalty learnt on one backend, and the layout it leads to.

    :param penalty: tokens taken off the unified pool after overflows or preemptions.
    :param penalized_at: clock time (seconds) of the last overflow, preemption or
        recovery step.
    :param preemptions_seen: server preemptions counted while the gateway admitted work.
    :param busy_cap: the most slots kept busy at once after the server refused a request
        for want of room (``None``: no cap; see the module).
    :param capped_at: clock time (seconds) of the last such refusal or recovery step.
    """

    penalty: int = 0
    penalized_at: float = 0.0
    preemptions_seen: int = 0
    busy_cap: int | None = None
    capped_at: float = 0.0
    _busy_at_check: bool = False  # leases in flight at the last preemption check
    _admitted_at_check: int = 0  # leases granted by then

    def layout(self, limits: Limits, found: Reported | None) -> Layout | None:
        """The layout from ``limits`` and what the server reported (``found``, ``None``
        while not discovered), less the penalty (see the module); ``None`` while slots or
        context are unknown."""
        slots = smaller(limits.slots, found.slots if found else None)
        ctx = smaller(limits.ctx_per_slot, found.ctx_per_slot if found else None)
        if slots is None or ctx is None:
            return None
        margin = limits.stop_margin
        block = found.block_size if found else 1
        cap = self.busy_cap if self.busy_cap is not None and self.busy_cap < slots else None
        if not limits.unified:
            return Layout(slots, ctx, stop_margin=margin, busy_cap=cap)
        pool = smaller(limits.pool_tokens, found.pool_tokens if found else None) or ctx
        ctx = max(2, min(ctx, pool))
        pool = max(ctx, pool - self.penalty)
        return Layout(slots, ctx, pool_tokens=pool, block_size=block, stop_margin=margin,
                      busy_cap=cap)

    def shrink(self, layout: Layout | None, now: float, live_tokens: int | None = None,
               *, burst: bool = False) -> bool:
        """The backend overflowed its pool (or preempted) at ``now`` under ``layout``:
        take 10 % of the pool off, or down to ``live_tokens`` (the cells the gateway's
        requests held) when the overflow came with less than that in use (the rest was
        someone else's); never below one slot's context. With ``burst``, a report
        within :data:`OVERFLOW_BURST_S` of the last shrink is the same overflow.

        :returns: True when the penalty grew (the layout is to be computed again); False
            for a per-slot or unknown layout, a pool at one slot's context already, or a
            report of the same burst.
        """
        if layout is None or layout.pool_tokens is None:
            return False
        if layout.pool_tokens <= layout.ctx_per_slot:
            return False
        if burst and self.penalty and now - self.penalized_at < OVERFLOW_BURST_S:
            return False
        cut = max(1, layout.pool_tokens // 10)
        if live_tokens is not None and live_tokens < layout.pool_tokens:
            cut = max(cut, layout.pool_tokens - live_tokens)
        self.penalty += cut
        self.penalized_at = now
        return True

    def recover(self, now: float) -> bool:
        """Halve the penalty after :data:`PENALTY_RECOVERY_S` without an overflow or a
        preemption: a penalty taken for someone else's traffic, or for a passing peak,
        is not kept for ever.

        :returns: True when it was halved.
        """
        if self.penalty and now - self.penalized_at >= PENALTY_RECOVERY_S:
            self.penalty //= 2
            self.penalized_at = now
            return True
        return False

    def full(self, busy: int, refused: int, now: float) -> int:
        """The server refused a request for want of room at ``now``, while the gateway
        kept ``busy`` slots busy there, ``refused`` of them the refused request's: cap
        the slots kept busy at once to the others' (at least 1; never raised here).

        :returns: the cap now in force.
        """
        cap = max(1, busy - refused)
        self.busy_cap = cap if self.busy_cap is None else min(self.busy_cap, cap)
        self.capped_at = now
        return self.busy_cap

    def relax(self, now: float, slots: int | None) -> bool:
        """Double the busy cap after :data:`CAP_RECOVERY_S` seconds without a refusal
        for want of room (the server's limit, or the traffic that filled it, may have
        changed); drop it once it reaches ``slots`` (the layout's, when known).

        :returns: True when the cap changed.
        """
        if self.busy_cap is None or now - self.capped_at < CAP_RECOVERY_S:
            return False
        self.busy_cap *= 2
        self.capped_at = now
        if slots is not None and self.busy_cap >= slots:
            self.busy_cap = None
        return True

    def restarted(self) -> None:
        """The server restarted (it reports other values): what was learnt of the old
        one is moot."""
        self.penalty = 0
        self.busy_cap = None

    def preempted(self, before: int | None, after: int | None, *, inflight: int,
                  admitted: int) -> int:
        """The server's preemption count went from ``before`` to ``after`` (``None``:
        not shown) between two discoveries; the gateway has ``inflight`` leases now and
        had granted ``admitted`` in all. A rise while the gateway had requests in flight
        (at either check, or granted between them) is the gateway's doing: counted in
        :attr:`preemptions_seen`; the caller shrinks the pool (:meth:`shrink`).

        :returns: the preemptions counted now (0 for none or someone else's).
        """
        if before is None or after is None:
            return 0
        ours = self._busy_at_check or inflight > 0 or admitted > self._admitted_at_check
        self._busy_at_check, self._admitted_at_check = inflight > 0, admitted
        if after > before and ours:
            self.preemptions_seen += after - before
            return after - before
        return 0


def smaller(configured: int | None, seen: int | None) -> int | None:
    """The smaller of two limits, either one when the other is ``None``."""
    if configured is None or seen is None:
        return configured if seen is None else seen
    return min(configured, seen)


def describe(layout: Layout | None) -> str:
    """``layout`` for a log line: ``"4 slots x 4096 tokens, unified pool 16384"``."""
    if layout is None:
        return "unknown"
    kind = f"unified pool {layout.pool_tokens}" if layout.unified else "per-slot KV"
    cap = "" if layout.busy_cap is None else f", at most {layout.busy_cap} busy"
    return f"{layout.slots} slots x {layout.ctx_per_slot} tokens, {kind}{cap}"
