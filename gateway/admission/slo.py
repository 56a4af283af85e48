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
  want of memory. With no target in flight, or before a level has its samples, the
  layout is the memory layout, unchanged. A limit that rises wakes the queue.
* **TTFT.** A request's deadline is its own header's (``x-gateway-slo-ttft-ms``) or
  else its class's ``ttft_p95_s``. Its predicted TTFT is the predicted queue wait plus
  its prompt over the learned prefill throughput plus one decode step at the level it
  would join (:func:`~gateway.core.latency.predict_ttft`); past the deadline it is
  refused at arrival, 503 ``slo_unattainable`` with ``Retry-After``, unless its class
  says ``late = "serve"``. Nothing is refused before a prefill rate is learnt.

Not covered yet: the limit of a backend whose budget is shared in Redis (``[state]
backend = "redis"``) is this process's alone, and the shared grant does not read it.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import replace
from typing import overload

from gateway.admission.lease import Lease
from gateway.clock import Clock
from gateway.core.capacity import Charge, Layout
from gateway.core.fairness import Party
from gateway.core.latency import LatencyModel, LatencyParams, SloLimit, predict_ttft, tightest
from gateway.errors import SloUnattainable

__all__ = ["STEP_S", "TARGET_MEMORY_S", "SloGuard"]

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


class SloGuard:
    """One backend's latency model, SLO limit and TTFT check (see the module).

    :param clock: injected time source.
    :param active: the admission's leases in flight, by key (read, never changed).
    :param waiting: how many requests wait in the admission's queue now.
    :param wake: called when the limit rose (the queue may grant more).
    :param params: the model's and the controller's parameters.
    :ivar limit: the SLO limit in force, sequences, or ``None`` while it does not bind
        admission (no target in flight, or no level known to break it).
    """

    def __init__(self, clock: Clock, *, active: Mapping[int, Lease],
                 waiting: Callable[[], int], wake: Callable[[], None],
                 params: LatencyParams | None = None) -> None:
        self._clock = clock
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

    def busy(self) -> int:
        """Slots held by the leases in flight: the level a sample is filed under."""
        return sum(lease.charge.slots for lease in self._active.values())

    def target(self) -> float | None:
        """The tightest ITL p95 target of the leases in flight or in flight within the
        last :data:`TARGET_MEMORY_S`, seconds, or ``None``."""
        now = self._clock.now()
        for lease in self._active.values():
            if lease.itl_target_s is not None:
                self._seen[lease.itl_target_s] = now
        for target, at in list(self._seen.items()):
            if now - at > TARGET_MEMORY_S:
                del self._seen[target]
        return tightest(self._seen)

    def observe_itl(self, itl_s: float, layout: Layout | None) -> None:
        """One inter-token latency of a stream on this backend, seconds; steps the
        controller when :data:`STEP_S` has passed (``layout``: the admission's)."""
        if not itl_s >= 0 or not math.isfinite(itl_s):
            return
        self.model.observe_itl(itl_s, self.busy())
        now = self._clock.now()
        if layout is not None and now >= self._next_step:
            self._next_step = now + STEP_S
            self.step(layout)

    def seconds_per_token(self) -> float | None:
        """The decode pace at the slots busy now, seconds per output token, for the wait
        prediction of a gateway that has not yet timed :data:`~gateway.core.waits.
        MIN_HISTORY` served leases: the learned mean ITL at that level, or at the nearest
        level above it (else below) with at least :data:`FIRST_SAMPLES` samples;
        ``None`` before any has."""
        busy = max(1, self.busy())
        known = [(level, h) for level, h in self.model.levels.items()
                 if h.samples >= FIRST_SAMPLES]
        if not known:
            return None
        above = [k for k in known if k[0] >= busy]
        _, hist = min(above, key=lambda k: k[0]) if above else max(known, key=lambda k: k[0])
        return hist.mean()

    def observe_prefill(self, tokens: int, seconds: float) -> None:
        """One attempt's prefill: ``tokens`` prompt tokens before its first token came,
        ``seconds`` after it was sent."""
        self.model.observe_prefill(tokens, seconds)

    def step(self, layout: Layout) -> int | None:
        """One control step against ``layout``'s memory limit (its slots, or its busy
        cap when lower); wakes the queue when the limit rose. Returns :attr:`limit`."""
        memory = min(layout.slots, layout.busy_cap or layout.slots)
        target = self.target()
        before = self.limit if self.limit is not None else memory
        demand = self.busy() + self._waiting()
        value = self.controller.update(self.model, target_s=target, memory_limit=memory,
                                       demand=demand, now=self._clock.now())
        self.memory_limit = memory
        self.limit = value if target is not None and value < memory else None
        if (self.limit if self.limit is not None else memory) > before:
            self._wake()
        return self.limit

    @overload
    def limited(self, layout: Layout) -> Layout: ...

    @overload
    def limited(self, layout: None) -> None: ...

    def limited(self, layout: Layout | None) -> Layout | None:
        """``layout`` with ``busy_cap`` lowered to the SLO limit while it binds and a
        target is in flight; else ``layout`` itself (``None`` stays ``None``). Admission
        checks fits against it, and the wait prediction replays the queue on it."""
        cap = self.limit
        if layout is None or cap is None or self.target() is None:
            return layout
        if layout.busy_cap is not None and layout.busy_cap <= cap:
            return layout
        if self._capped is None or self._capped[:2] != (layout, cap):
            self._capped = (layout, cap, replace(layout, busy_cap=cap))
        return self._capped[2]

    def predicted_ttft_s(self, charge: Charge, queue_wait_s: float | None) -> float | None:
        """Predicted time to first token of ``charge`` after a queue wait of
        ``queue_wait_s`` seconds (``None``: unknown), seconds, or ``None`` while the
        prefill rate is not learnt."""
        step = self.model.itl_p95(self.busy() + charge.slots)
        return predict_ttft(queue_wait_s=queue_wait_s, prompt_tokens=charge.prompt_tokens,
                            prefill_tps=self.model.prefill_tps(), first_step_s=step)

    def check_ttft(self, charge: Charge, party: Party, queue_wait_s: float | None) -> None:
        """Refuse a request whose predicted TTFT misses its deadline.

        :param queue_wait_s: its predicted queue wait, seconds (0 when it is granted at
            once, ``None`` when unknown: then nothing is refused).
        :raises SloUnattainable: the prediction is past the request's deadline (its
            header's, else its class's ``ttft_p95_s``) and its class refuses late work;
            ``Retry-After`` is how much sooner the queue would have to drain (1–60 s).
        """
        deadline = party.ttft_deadline_s if party.ttft_deadline_s is not None \
            else party.ttft_target_s
        if deadline is None or party.serve_late:
            return
        predicted = self.predicted_ttft_s(charge, queue_wait_s)
        if predicted is None or predicted <= deadline:
            return
        raise SloUnattainable(
            f"This request's first token is predicted in about {predicted:.1f} s "
            f"(queue wait plus its {charge.prompt_tokens}-token prefill at the backend's "
            f"recent pace), after its {deadline:g} s deadline; retry after the "
            "Retry-After delay.", retry_after_s=min(60.0, max(1.0, predicted - deadline)),
            predicted_s=predicted, deadline_s=deadline)
