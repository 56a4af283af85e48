"""Latency targets in one backend's admission (issue 26): the learned latency curve, the
SLO concurrency limit under the memory limit, and the refusal of a request that cannot
get its first token in time. :class:`SloGuard`, one per
:class:`~gateway.admission.admission.Admission`.

* **Fed by the relay.** Each inter-token latency of a relayed stream is filed under the
  slots busy on the backend when it arrived (:meth:`SloGuard.observe_itl`); each
  attempt's first token gives a prefill (prompt tokens over the seconds from sending it
  to that token, :meth:`SloGuard.observe_prefill`). The pure model and controller are
  :mod:`gateway.core.latency`.
* **The limit.** At most every :data:`STEP_S` seconds of samples the AIMD controller
  (:class:`~gateway.core.latency.SloLimit`) takes one step against the tightest ITL
  target of the leases in flight (each lease carries its class's ``itl_p95_s`` from the
  relay, :attr:`~gateway.admission.lease.Lease.itl_target_s`), or in flight within the
  last :data:`TARGET_MEMORY_S`. While one is,
  :meth:`SloGuard.limited` gives admission the layout with ``busy_cap`` lowered to the
  limit: requests over it wait in the same queue, in the same order, exactly as for
  want of memory. With no target in flight, the layout is the memory layout, unchanged.
  A target starts slow (:meth:`~gateway.core.latency.SloLimit.start`): a level without
  its samples is not assumed to hold it, so a burst on a fresh gateway runs one stream,
  then two once one is learnt to hold the target, and so on; a request's own class
  target holds it from its arrival (:meth:`SloGuard.expect`), before any lease here has
  carried one. A limit that rises wakes the queue. Whole answers have no ITL a client
  sees: their party carries no ITL target (:mod:`gateway.request.plan`), so they are
  admitted as a class without one.
* **TTFT.** A request's deadline is its own header's (``x-gateway-slo-ttft-ms``) or
  else its class's ``ttft_p95_s``. Its predicted TTFT is the predicted queue wait plus
  its prompt over the learned prefill throughput plus one decode step at the level it
  would join (:func:`~gateway.core.latency.predict_ttft`); past the deadline it is
  refused at arrival, 503 ``slo_unattainable`` with ``Retry-After``, unless its class
  says ``late = "serve"``. Nothing is refused before a prefill rate is learnt; with the
  wait unknown, the prediction is the prefill alone (a lower bound: a busy backend
  refuses what an idle one would). The deadline counts from the gateway's receipt of
  the request: what it spent before admission (reading, counting, its tenant's gate)
  counts towards it (:func:`spent`), and the prediction refused is the TTFT from that
  receipt; ``Retry-After`` is by how much a request sent afresh would miss (1–60 s).
* **Probes.** A refusal feeds nothing back: a prefill rate learnt too slow (a model
  loading under the first request: Ollama's, a router's) would refuse the long prompts
  for ever. So once :data:`PROBE_S` seconds have passed with no prefill observed and no
  probe let through, one request whose lateness is the prefill rate's doing is served
  anyway, and its prefill is learnt.
* **Prefill deferral.** While streams with an ITL target decode here (leases with a
  target that have their first token), a request whose predicted prefill (its prompt
  over the learned prefill throughput) is longer than the tightest of their targets is
  held back (:class:`~gateway.admission.defer.PrefillDeferral`): for
  at most ``admission.prefill_defer_s`` seconds since it came, never past its TTFT
  slack, and not at all when it goes to a slot that caches its prefix (only its new
  part is computed). It waits at the head of the queue, holding those behind it, as a
  request that does not fit does; the queue is looked at again when the hold runs out.
  In a pool, a backend that holds it does not offer it room, so it goes to one where no
  targeted stream decodes, if any has room. Not applied under ``[state] backend =
  "redis"`` (the shared queue's script grants in arrival order over every process).
* **Pools.** :func:`late_backends` leaves out, for a request of a pool, the backends
  where it would start late even at once, and refuses it when that is all of them.

* **Shared in Redis** (``[state] backend = "redis"``): each process learns from its own
  streams, filed under the slots busy over every process (the shared reply's count), and
  its limit goes to the shared grant as the layout's ``busy_cap``
  (:meth:`gateway.admission.shared.SharedAccount.grant`), where it is published for 30 s:
  every process's grant keeps the backend's busy slots, all processes' together, within
  the smallest live limit.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import replace
from typing import TypeVar, overload

from gateway.admission.defer import PrefillDeferral
from gateway.admission.lease import InFlight, Lease
from gateway.clock import Clock
from gateway.core.capacity import Charge, Layout
from gateway.core.fairness import Party
from gateway.core.latency import (
    LatencyModel,
    LatencyParams,
    SloLimit,
    predict_ttft,
    tightest,
)
from gateway.errors import SloUnattainable

__all__ = ["FIRST_SAMPLES", "PROBE_S", "STEP_S", "TARGET_MEMORY_S", "SloGuard", "deadline_of",
           "late_backends", "spent"]

#: Seconds a target still binds after its last lease ended: the class's users are still
#: there between two turns, and a burst of their requests must not all be let in before
#: the first lease of the burst is seen (measured: four streams at once on llama-server
#: under a limit of one, at each new round, when a target ended with its last lease).
TARGET_MEMORY_S = 30.0

#: ITL samples a level needs before its mean paces the wait prediction of a fresh
#: gateway (a stream's first tokens: fewer than the controller's 50).
FIRST_SAMPLES = 10

#: Seconds between two steps of the controller (it steps on an ITL sample once this much
#: has passed since the last): often enough to follow a load change within a second,
#: rarely enough that a step sees tens of new samples.
STEP_S = 0.5

#: Seconds with no prefill observed on a backend after which one request predicted late
#: for its prefill is served anyway, to learn the rate afresh (see the module).
PROBE_S = 10.0

K = TypeVar("K")


def deadline_of(party: Party) -> float | None:
    """The request's TTFT deadline, seconds: its header's, else its class's
    ``ttft_p95_s``; ``None`` when it has neither."""
    return party.ttft_deadline_s if party.ttft_deadline_s is not None else party.ttft_target_s


def spent(party: Party, elapsed_s: float) -> Party:
    """``party`` noting ``elapsed_s`` seconds already spent since the gateway received
    the request (reading it, counting its prompt, its tenant's gate): they count towards
    its TTFT deadline (``ttft_spent_s``). ``party`` itself when it has no deadline or
    nothing was spent."""
    if deadline_of(party) is None or not elapsed_s > 0:
        return party
    return replace(party, ttft_spent_s=elapsed_s)


def late_backends(offers: Mapping[K, tuple[SloGuard, Charge]], party: Party) -> frozenset[K]:
    """For a request of a pool, planned as ``offers`` (a key per usable backend: its
    guard and the request's charge there): the keys of the backends where it would get
    its first token after its deadline even if granted now. When that is every one,
    the first due a probe (:meth:`SloGuard.probe`) takes it and is left out of the set.

    :raises SloUnattainable: it would be late on every backend, and none is due a probe
        (the error of the one it would miss by least).
    """
    late = {key: refusal for key, (guard, charge) in offers.items()
            if (refusal := guard.late(charge, party, 0.0)) is not None}
    if not late or len(late) < len(offers):
        return frozenset(late)
    for key, (guard, charge) in offers.items():
        if guard.probe(charge, party, 0.0):
            return frozenset(late) - {key}
    raise min(late.values(), key=lambda refusal: refusal.retry_after_s)


class SloGuard:
    """One backend's latency model, SLO limit and TTFT check (see the module).

    :param clock: injected time source.
    :param active: the admission's leases in flight, by key (read, never changed).
    :param waiting: how many requests wait in the admission's queue now.
    :param wake: called when the limit rose (the queue may grant more).
    :param params: the model's and the controller's parameters.
    :param shared_busy: when the backend's budget is shared in Redis, the slots busy
        over every gateway process as the last shared reply gave them
        (:attr:`~gateway.admission.shared.SharedAccount.busy_slots`): the level a sample
        is filed under and a prediction read at is then the larger of it and this
        process's own, since the backend's ITL follows every process's streams.
    :param probe_s: seconds between probes (:data:`PROBE_S`).
    :ivar defer: its prefill deferral (:class:`~gateway.admission.defer.PrefillDeferral`).
    :ivar limit: the SLO limit in force, sequences, or ``None`` while it does not bind
        admission (no target in flight, or no level known to break it).
    """

    def __init__(self, clock: Clock, *, active: InFlight,
                 waiting: Callable[[], int], wake: Callable[[], None],
                 params: LatencyParams | None = None,
                 shared_busy: Callable[[], int] | None = None,
                 probe_s: float = PROBE_S) -> None:
        self._clock = clock
        self._shared_busy = shared_busy
        self.probe_s = probe_s
        # Clock seconds of the last prefill observed and of the last probe let through.
        self._prefill_at = self._probe_at = -math.inf
        self._probe_of: Party | None = None  # the party of the last probe let through
        self._active = active
        self._waiting = waiting
        self._wake = wake
        self.params = params or LatencyParams()
        self.model = LatencyModel(self.params)
        self.controller = SloLimit(self.params)
        self.limit: int | None = None
        #: The memory limit at the last step, sequences (0 before the first).
        self.memory_limit = 0
        self._next_step = 0.0
        self._capped: tuple[Layout, int, Layout] | None = None  # (layout, cap) -> limited
        self._seen: dict[float, float] = {}  # ITL target -> when last seen in flight
        self._paces: dict[int, float] = {}  # busy slots -> seconds per token (observe_pace)
        #: The decode pace of the calibration request at discovery (one slot busy),
        #: seconds per token: the last stand-in, before any answer has taught one.
        self.calibration_s: float | None = None
        self.defer = PrefillDeferral(self, clock, active=active, wake=wake)

    def busy(self) -> int:
        """Slots held by the leases in flight (over every process, when shared): the
        level a sample is filed under."""
        own = self._active.slots
        return own if self._shared_busy is None else max(own, self._shared_busy())

    def set_itl_target(self, lease: Lease, target_s: float | None) -> None:
        """Note ``lease``'s class's ITL p95 target, seconds (``None``: none), which the
        SLO limit and prefill deferral follow while it is in flight."""
        self._active.set_itl_target(lease, target_s)

    def target(self) -> float | None:
        """The tightest ITL p95 target of the leases in flight or in flight within the
        last :data:`TARGET_MEMORY_S`, seconds, or ``None``."""
        now = self._clock.now()
        for lease in self._active.targeted.values():
            if lease.itl_target_s is not None:
                self._seen[lease.itl_target_s] = now
        for target, at in list(self._seen.items()):
            if now - at > TARGET_MEMORY_S:
                del self._seen[target]
        return tightest(self._seen)

    def expect(self, party: Party | None) -> None:
        """Note that a request of ``party`` came to admission: its class's ITL target
        binds from now, as one in flight does (:meth:`target`), so that a fresh
        gateway's first burst is held by it before any lease here has carried it (all
        of a burst is granted before the first attempt starts). Nothing for a party
        without an ITL target."""
        if party is not None and party.itl_target_s is not None:
            self._seen[party.itl_target_s] = self._clock.now()

    def observe_itl(self, itl_s: float, layout: Layout | None,
                    now: float | None = None) -> None:
        """One inter-token latency of a stream on this backend, seconds; steps the
        controller when :data:`STEP_S` has passed (``layout``: the admission's; ``now``:
        the clock's time if the caller has it, else it is read)."""
        if not itl_s >= 0 or not math.isfinite(itl_s):
            return
        self.observe_itls((itl_s,), layout, now)

    def observe_itls(self, itls_s: Sequence[float], layout: Layout | None,
                     now: float | None = None, *, level: int | None = None) -> None:
        """Inter-token latencies of streams on this backend, seconds, in the order seen
        (a negative or non-finite one is ignored), as :meth:`observe_itl` one by one:
        filed under ``level``, the slots that were busy when they came (default: those
        busy now). A stream hands in its gaps in batches of at most
        :data:`gateway.relay.usage.GAPS_BATCH`, :data:`gateway.relay.usage.GAPS_AGE_S`
        and one level (issue 37)."""
        self.model.observe_itls(itls_s, self.busy() if level is None else level)
        if now is None:
            now = self._clock.now()
        if layout is not None and now >= self._next_step:
            self._next_step = now + STEP_S
            self.step(layout)

    def seconds_per_token(self) -> float | None:
        """The decode pace at the slots busy now, seconds per output token, for the wait
        prediction of a gateway that has not yet timed :data:`~gateway.core.waits.
        MIN_HISTORY` served leases: the learned mean ITL at that level, or at the nearest
        level above it (else below) with at least :data:`FIRST_SAMPLES` samples; before
        any has, the pace of :meth:`observe_pace` the same way; before any of those,
        :attr:`calibration_s`; else ``None``."""
        busy = max(1, self.busy())
        known = {level: mean for level, h in self.model.levels.items()
                 if h.samples >= FIRST_SAMPLES and (mean := h.mean()) is not None}
        if not known:
            known = self._paces  # whole answers' pace
        if not known:
            known = {} if self.calibration_s is None else {1: self.calibration_s}
        if not known:
            return None
        above = [level for level in known if level >= busy]
        return known[min(above) if above else max(known)]

    def observe_pace(self, seconds_per_token: float, level: int | None = None) -> None:
        """A whole answer's decode pace, seconds per output token (its own timings, or
        its time on the lease over its completion tokens), with ``level`` slots busy
        (default: those busy now). :meth:`seconds_per_token` falls back on it, by level,
        while no level has :data:`FIRST_SAMPLES` ITL samples (a gateway that has served
        only whole answers). Each level keeps the mean of its last value and the new
        one."""
        if not seconds_per_token > 0 or not math.isfinite(seconds_per_token):
            return
        at = max(1, self.busy() if level is None else level)
        old = self._paces.get(at)
        self._paces[at] = seconds_per_token if old is None else (old + seconds_per_token) / 2

    def observe_prefill(self, tokens: int, seconds: float) -> None:
        """One attempt's prefill: ``tokens`` prompt tokens before its first token came,
        ``seconds`` after it was sent."""
        if tokens > 0 and seconds > 0:
            self._prefill_at = self._clock.now()
        self.model.observe_prefill(tokens, seconds)

    def step(self, layout: Layout) -> int | None:
        """One control step against ``layout``'s memory limit (its slots, or its busy
        cap when lower); wakes the queue when the limit rose. Returns :attr:`limit`."""
        memory = min(layout.slots, layout.busy_cap or layout.slots)
        target = self.target()
        before = memory if target is None else self._cap(memory, target)
        demand = self.busy() + self._waiting()
        value = self.controller.update(self.model, target_s=target, memory_limit=memory,
                                       demand=demand, now=self._clock.now())
        self.memory_limit = memory
        self.limit = value if target is not None and value < memory else None
        if (self.limit if self.limit is not None else memory) > before:
            self._wake()
        return self.limit

    @overload
    def limited(self, layout: Layout, party: Party | None = None) -> Layout: ...

    @overload
    def limited(self, layout: None, party: Party | None = None) -> None: ...

    def limited(self, layout: Layout | None, party: Party | None = None) -> Layout | None:
        """``layout`` with ``busy_cap`` lowered to the SLO limit while it binds and a
        target is in flight; else ``layout`` itself (``None`` stays ``None``). Admission
        checks fits against it, and the wait prediction replays the queue on it.

        A request of a class without an ITL target (``party`` given, its
        ``itl_target_s`` unset) gets ``layout`` itself: another class's target does not
        hold it (docs/latency.md: a class without targets is admitted as before). Before
        the controller's first step with a target, the cap is the slow start's level
        (:meth:`_cap`)."""
        if layout is None or (party is not None and party.itl_target_s is None):
            return layout
        target = self.target()
        if target is None:
            return layout
        cap = self._cap(min(layout.slots, layout.busy_cap or layout.slots), target)
        if cap >= layout.slots or (layout.busy_cap is not None and layout.busy_cap <= cap):
            return layout
        if self._capped is None or self._capped[:2] != (layout, cap):
            self._capped = (layout, cap, replace(layout, busy_cap=cap))
        return self._capped[2]

    def _cap(self, memory: int, target_s: float) -> int:
        """The concurrency admission allows under ``target_s`` with a memory limit of
        ``memory`` sequences: the controller's limit, or, before its first step with a
        target, where it will start (slow start, :meth:`SloLimit.start
        <gateway.core.latency.SloLimit.start>`: a level not yet learnt is not assumed to
        hold the target)."""
        if self.controller.limit is None:
            return self.controller.start(self.model, target_s, max(1, memory))
        return max(1, min(memory, self.controller.limit))

    def in_force(self, slots: int) -> int | None:
        """The concurrency ``gateway_slo_limit`` shows for a layout of ``slots`` slots:
        the SLO limit while it binds (:meth:`binds`), else the memory limit (the slots,
        or a learnt busy cap), always within [1, ``slots``] (a layout that shrank since
        the last step bounds it); ``None`` without a layout (``slots`` 0)."""
        if slots < 1:
            return None
        memory = min(slots, self.memory_limit or slots)
        target = self.target()
        return memory if target is None else self._cap(memory, target)

    def learned_p95(self) -> dict[int, float]:
        """The learned ITL p95 by level (slots busy), seconds: only the levels with their
        :attr:`LatencyParams.min_samples <gateway.core.latency.LatencyParams>` (what
        ``gateway_latency_itl_p95_seconds`` and the status page show)."""
        return {row.level: row.p95_s for row in self.model.table()
                if row.samples >= self.params.min_samples and row.p95_s is not None}

    def binds(self, slots: int) -> bool:
        """The SLO limit is what admission applies now to a layout of ``slots`` slots:
        it is set, below the memory limit, and a target is in flight (or was within
        :data:`TARGET_MEMORY_S`), as in :meth:`limited`. A limit left from the last
        step after the targets expired on an idle backend does not bind; before the
        first step with a target, the slow start's level does."""
        limit = self.in_force(slots)
        return limit is not None and limit < min(slots, self.memory_limit or slots)

    def predicted_ttft_s(self, charge: Charge, queue_wait_s: float | None) -> float | None:
        """Predicted time to first token of ``charge`` after a queue wait of
        ``queue_wait_s`` seconds (``None``: unknown), seconds, or ``None`` while the
        prefill rate is not learnt."""
        step = self.model.itl_p95(self.busy() + charge.slots)
        return predict_ttft(queue_wait_s=queue_wait_s, prompt_tokens=charge.prompt_tokens,
                            prefill_tps=self.model.prefill_tps(), first_step_s=step)

    def late(self, charge: Charge, party: Party, queue_wait_s: float | None
             ) -> SloUnattainable | None:
        """The refusal of a request whose predicted TTFT misses its deadline, or
        ``None`` (in time, no deadline, its class serves late, or no prefill rate yet).

        :param queue_wait_s: its predicted queue wait, seconds (0 when it is granted at
            once; ``None`` when unknown: the prefill alone is predicted, a lower bound).
        """
        deadline = deadline_of(party)
        if deadline is None or party.serve_late:
            return None
        wait = 0.0 if queue_wait_s is None else max(0.0, queue_wait_s)
        predicted = self.predicted_ttft_s(charge, wait)
        if predicted is None or party.ttft_spent_s + predicted <= deadline:
            return None
        total = party.ttft_spent_s + predicted
        return SloUnattainable(
            f"This request's first token is predicted about {total:.1f} s after its "
            f"arrival (time spent before admission, queue wait and its "
            f"{charge.prompt_tokens}-token prefill at the backend's recent pace), after "
            f"its {deadline:g} s deadline; retry after the Retry-After delay.",
            retry_after_s=min(60.0, max(1.0, predicted - deadline)),
            predicted_s=total, deadline_s=deadline)

    def probe(self, charge: Charge, party: Party, queue_wait_s: float | None) -> bool:
        """Whether a request :meth:`late` refuses is served anyway as a probe, and if so
        note it: :attr:`probe_s` seconds have passed since the last prefill observed and
        the last probe, and the wait and one decode step alone are within its deadline
        (its lateness is the prefill rate's doing, which only a served request can
        learn afresh). The request let through is known by its ``party`` (this very
        object): asked again, as it is when it queues after its try, it is still the
        probe."""
        if party is self._probe_of:
            return True
        now, deadline = self._clock.now(), deadline_of(party)
        if deadline is None or now - max(self._prefill_at, self._probe_at) < self.probe_s:
            return False
        wait = party.ttft_spent_s + (0.0 if queue_wait_s is None else max(0.0, queue_wait_s))
        if wait + (self.model.itl_p95(self.busy() + charge.slots) or 0.0) > deadline:
            return False
        self._probe_at, self._probe_of = now, party
        return True

    def slack_s(self, charge: Charge, party: Party) -> float | None:
        """Seconds ``charge`` could still lose and get its first token by its deadline,
        if it started now (its deadline less the time spent and its predicted TTFT);
        ``None`` without a deadline."""
        deadline = deadline_of(party)
        if deadline is None:
            return None
        return deadline - party.ttft_spent_s - (self.predicted_ttft_s(charge, 0.0) or 0.0)

    def check_ttft(self, charge: Charge, party: Party, queue_wait_s: float | None) -> None:
        """Refuse a request whose predicted TTFT misses its deadline (:meth:`late`),
        unless it is a probe (:meth:`probe`).

        :param queue_wait_s: its predicted queue wait, seconds (0 when it is granted at
            once, ``None`` when unknown).
        :raises SloUnattainable: the prediction is past the request's deadline (its
            header's, else its class's ``ttft_p95_s``, counted from its arrival) and
            its class refuses late work; ``Retry-After`` is by how much a request sent
            afresh would miss it (1–60 s).
        """
        refusal = self.late(charge, party, queue_wait_s)
        if refusal is not None and not self.probe(charge, party, queue_wait_s):
            raise refusal
