"""The admission layout of one backend, kept up to date: from its settings, what
discovery found, and what overflows and preemptions taught (the pool penalty), and what
refusals for want of room taught (the busy cap).

:class:`Sizing` is the I/O side of the pure :class:`~gateway.core.pool_model.PoolModel`:
it logs what changed and applies the layout to the backend's
:class:`~gateway.admission.admission.Admission`. The
:class:`~gateway.backends.target.Target` calls it from its discovery loop and after an
upstream failure.
"""

from __future__ import annotations

import logging

from gateway.admission.admission import Admission
from gateway.admission.slotwatch import SlotWatch
from gateway.backends.base import Dialect, Discovered
from gateway.backends.countcache import CountCache
from gateway.clock import Clock
from gateway.config import BackendSettings
from gateway.core.capacity import Layout
from gateway.core.pool_model import (
    CAP_RECOVERY_S,
    PENALTY_RECOVERY_S,
    Limits,
    PoolModel,
    describe,
)

__all__ = ["Sizing"]

log = logging.getLogger(__name__)


def limits(settings: BackendSettings, dialect: Dialect) -> Limits:
    """The configured numbers a layout starts from (``[[backends]]`` and the kind's pool
    sharing and stop margin)."""
    return Limits(settings.slots, settings.ctx_per_slot, settings.pool_tokens,
                  unified=settings.unified and dialect.unified_pool,
                  stop_margin=dialect.stop_margin)


class Sizing:
    """Keeps ``admission``'s layout: the configured limits and what discovery found,
    less the pool penalty of ``pool``.

    :param name: the backend's name, for the log.
    :param settings: the ``[[backends]]`` entry (replaced by :meth:`configure`).
    :param dialect: the kind's dialect (its pool sharing and stop margin).
    :param pool: the backend's pure pool model (penalty and preemptions seen).
    :param admission: the admission whose layout this keeps.
    :param slot_watch: released whole when the server restarted.
    :param clock: the time source of the penalty and its recovery.
    :param counts: the backend's exact prompt counts, forgotten when the server may
        count otherwise (restarted, another model or template).
    """

    def __init__(self, name: str, settings: BackendSettings, dialect: Dialect,
                 pool: PoolModel, admission: Admission, slot_watch: SlotWatch,
                 clock: Clock, counts: CountCache | None = None) -> None:
        self.name = name
        self.settings = settings
        self.dialect = dialect
        self.pool = pool
        self.admission = admission
        self.slot_watch = slot_watch
        self.clock = clock
        self.counts = counts

    def take(self, before: Discovered | None, found: Discovered, *,
             fresh: bool = False) -> Layout | None:
        """Take a discovery's answer ``found`` (``before``: the previous one; ``fresh``:
        the first since the backend was unreachable): the counts forgotten when the
        server may count otherwise, then :meth:`learn` and :meth:`apply`. A change of
        slots, context or pool is a restarted server. With shared state, ``found``
        carries the layout every gateway process agreed
        (:mod:`gateway.admission.shared_marks`).

        :returns: the layout in force afterwards (``None`` while unknown).
        """
        restarted = before is not None and (
            found.slots, found.ctx_per_slot, found.pool_tokens) != (
            before.slots, before.ctx_per_slot, before.pool_tokens)
        if self.counts is not None and (fresh or restarted or before is None or (
                found.model_id, found.n_vocab, found.fingerprint) != (
                before.model_id, before.n_vocab, before.fingerprint)):
            # The server may have come back with another model or template: its counts
            # are asked again.
            self.counts.clear()
        self.learn(before, found, restarted=restarted)
        return self.apply(found, restarted=restarted)

    def configure(self, settings: BackendSettings) -> None:
        """Use ``settings`` from now on (a reload applied in place)."""
        self.settings = settings

    @property
    def limits(self) -> Limits:
        """The configured numbers the layout starts from (see :func:`limits`)."""
        return limits(self.settings, self.dialect)

    def configured(self, found: Discovered | None) -> Layout | None:
        """The layout from config and ``found``, less the pool penalty
        (:meth:`gateway.core.pool_model.PoolModel.layout`)."""
        return self.pool.layout(self.limits, found)

    def learn(self, before: Discovered | None, found: Discovered, *,
              restarted: bool) -> None:
        """Learn from a discovery's answer ``found`` (``before``: the previous one): warn
        where it disagrees with the config, forget the pool penalty of a ``restarted``
        server, ease it after quiet minutes, and grow it after preemptions."""
        self._warn_disagreement(before, found)
        if restarted:
            self.pool.restarted()  # what was learnt of the old server is moot
        self.recover()
        self._check_preemptions(before, found)

    def apply(self, found: Discovered, *, restarted: bool) -> Layout | None:
        """Apply the layout of ``found`` (see :meth:`configured`) when it changed. A
        ``restarted`` server runs nothing of the old one: the slot watch lets go of what
        it held.

        :returns: the layout in force afterwards (``None`` while unknown).
        """
        layout = self.configured(found)
        old = self.admission.layout
        if layout != old:
            if old is None:
                log.info("backend %s layout discovered: %s", self.name, describe(layout))
            else:
                log.log(logging.WARNING if restarted else logging.INFO,
                        "backend %s layout changed: %s -> %s", self.name, describe(old),
                        describe(layout))
            if restarted:
                # The server reports other values: a restarted server, which runs nothing
                # of the old one. (A pool penalty easing off is not a restart: what the
                # slot watch holds still runs.)
                self.slot_watch.release_all()
            self.admission.set_layout(layout)
        return layout

    def shrink(self, found: Discovered | None, live_tokens: int | None = None, *,
               burst: bool = False) -> None:
        """The backend overflowed its pool (or preempted): shrink the pool model
        (:meth:`gateway.core.pool_model.PoolModel.shrink`) and apply the smaller layout
        (``found``: the last discovery's answer)."""
        layout = self.admission.layout
        if not self.pool.shrink(layout, self.clock.now(), live_tokens, burst=burst):
            return
        assert layout is not None
        smaller = self.configured(found)
        log.warning("backend %s overflowed its KV pool; pool model %d -> %s tokens", self.name,
                    layout.pool_tokens, smaller.pool_tokens if smaller else None)
        self.admission.set_layout(smaller)

    def recover(self) -> None:
        """Halve the pool penalty after quiet minutes
        (:meth:`gateway.core.pool_model.PoolModel.recover`), and relax the busy cap
        (:meth:`~gateway.core.pool_model.PoolModel.relax`)."""
        now = self.clock.now()
        if self.pool.recover(now):
            log.info("backend %s: no overflow for %.0f s; pool penalty now %d tokens",
                     self.name, PENALTY_RECOVERY_S, self.pool.penalty)
        layout = self.admission.layout
        if self.pool.relax(now, layout.slots if layout else None):
            log.info("backend %s: no refusal for want of room for %.0f s; at most %s "
                     "slots busy now", self.name, CAP_RECOVERY_S,
                     self.pool.busy_cap or "all its")

    def full(self, found: Discovered | None, busy: int, refused: int, cause: str
             ) -> int:
        """The backend refused a request for want of room (``cause``: which of its
        limits) while ``busy`` of its slots were the gateway's, ``refused`` of them the
        refused request's: cap the slots kept busy at once
        (:meth:`gateway.core.pool_model.PoolModel.full`) and apply the layout
        (``found``: the last discovery's answer).

        :returns: the cap now in force.
        """
        before = self.pool.busy_cap
        cap = self.pool.full(busy, refused, self.clock.now())
        if cap != before:
            log.warning("backend %s refused a request for want of room (%s) with %d of "
                        "its slots busy with the gateway's requests; at most %d busy at "
                        "once from now on (relaxed after %.0f s without a refusal)",
                        self.name, cause, busy, cap, CAP_RECOVERY_S)
        layout = self.configured(found)
        if layout is not None and layout != self.admission.layout:
            self.admission.set_layout(layout)
        return cap

    def _check_preemptions(self, before: Discovered | None, found: Discovered) -> None:
        """A rise in the server's preemption count while the gateway had requests in
        flight means its model of the pool let in more than the server holds (vLLM
        preempts and recomputes rather than failing): counted like an overflow, and the
        pool model shrinks (``shared/cases/public.md`` P10)."""
        stats = self.admission.stats()
        seen = self.pool.preempted(before.preemptions if before else None,
                                   found.preemptions, inflight=stats.inflight,
                                   admitted=stats.admitted)
        if seen:
            log.warning("backend %s preempted %d requests while the gateway admitted work; "
                        "its pool model is too large", self.name, seen)
            self.shrink(before)

    def _warn_disagreement(self, before: Discovered | None, found: Discovered) -> None:
        s = self.settings
        for key, configured, seen in (
            ("slots", s.slots, found.slots),
            ("ctx_per_slot", s.ctx_per_slot, found.ctx_per_slot),
        ):
            if configured is not None and configured != seen and before != found:
                log.warning(
                    "backend %s: config says %s = %d but the backend reports %d; using %d",
                    self.name, key, configured, seen, min(configured, seen),
                )
