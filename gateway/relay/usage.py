"""A request's token accounting, from the answers' usage to the metrics, the output
prediction and the tenant's window, and the timing of its output tokens (TTFT, ITL): the
:class:`UsageBook`."""

from __future__ import annotations

import logging
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

from gateway.admission.lease import Lease
from gateway.admission.slo import deadline_of
from gateway.clock import Clock
from gateway.observe.metrics import GatewayMetrics, observe_all
from gateway.relay.inspect import TokenTimes
from gateway.request.exchange import Exchange
from gateway.wire.resume import answer_shape

if TYPE_CHECKING:
    from gateway.relay.attempt import Attempt

__all__ = ["GAPS_AGE_S", "GAPS_BATCH", "PACE_MIN_TOKENS", "UsageBook"]

#: A stream's inter-token gaps are handed to ``gateway_itl_seconds`` and the backend's
#: latency model in batches (:meth:`UsageBook.flush_gaps`), not one call each (about
#: 3 us a token, 8 % of the SSE relay's time: issue 37): at most this many gaps ...
GAPS_BATCH = 64
#: ... or gaps this old, seconds (the first of them), so that the latency model learns
#: within a tenth of a second of a real backend's tokens.
GAPS_AGE_S = 0.1

#: Completion tokens a whole answer needs before its time over them is taken for a
#: decode pace (over fewer, its prefill would weigh too much).
PACE_MIN_TOKENS = 16

log = logging.getLogger(__name__)


class UsageBook:
    """The tokens one request used, over all its upstream attempts, and when its output
    tokens came.

    :param x: the request (its backend is read at each call: in a pool, admission binds
        it).
    :ivar completion: completion tokens the backends reported, summed (``None``: none).
    :ivar reported_prompt: the backend's last ``usage.prompt_tokens``.
    :ivar streamed: output events relayed (the completion count when no usage came).
    :ivar finish_reasons: why the answer ended, as the backend said (one per choice).
    """

    def __init__(self, x: Exchange, metrics: GatewayMetrics, clock: Clock) -> None:
        self.x = x
        self.metrics = metrics
        self.clock = clock
        self.completion: int | None = None
        self.reported_prompt: int | None = None
        self.streamed = 0
        self.finish_reasons: list[str] = []
        self._itl_of: Any = None  # the backend of the gaps below
        self._itl: Any = None  # its gateway_itl_seconds
        self._gaps: list[float] = []  # gaps not yet observed, seconds
        self._learnt: list[float] = []  # of them, those its latency model learns from
        self._gaps_since = 0.0  # when the first of them came, clock seconds
        self._level = 0  # the slots busy on the backend when the gaps learnt from came
        self.gaps = 0  # gaps between the stream's tokens, as its client saw them
        self.late_gaps = 0  # of them, over its class's itl_p95_s

    def token_seen(self, times: TokenTimes, lease: Lease | None = None, *,
                   first: bool = False, now: float | None = None) -> None:
        """An output token was relayed now: count it, and observe the request's TTFT
        (its first token) or the inter-token latency since ``times.last_token``, under
        the backend that sent it. A whole answer followed token by token upstream (the
        predictive policy) has no TTFT or ITL: its client sees no first token.

        The backend's latency model (:mod:`gateway.admission.slo`) learns from it too:
        ``first`` (the first token of an attempt on ``lease``) is a prefill of the
        lease's prompt tokens in the seconds since its grant; any later token of a
        stream is an ITL sample (the gap before an attempt's first token, which holds a
        queue wait and a prefill, is not; nor are the gaps of an ``n > 1`` stream, whose
        choices decoded in one step arrive back to back).

        :param now: the clock's time, seconds, when the caller read it already (the
            tokens of one upstream read arrive together: one clock read for them all).
        """
        self.streamed += 1
        if now is None:
            now = self.clock.now()
        backend = self.x.backend
        if lease is not None:
            lease.streamed += 1
            if first:
                backend.admission.slo.observe_prefill(lease.charge.prompt_tokens,
                                                      now - lease.granted_at)
                if lease.first_token_at is None:  # it decodes now (prefill deferral reads)
                    lease.first_token_at = now
        if not self.x.stream:
            return
        last, times.last_token = times.last_token, now
        if last is None:
            ttft = now - self.x.started
            if self.x.ttft_s is None:  # a resumed answer's first token is not its first
                self.x.ttft_s = ttft
                if self.x.trace is not None:
                    self.x.trace.first_token(ttft)
            self.metrics.ttft.labels(backend.name).observe(ttft)
            return
        self._gap(now - last, now, first)

    def _gap(self, itl: float, now: float, first: bool) -> None:
        """One gap of the stream, ``itl`` seconds, kept for :meth:`flush_gaps`."""
        backend = self.x.backend
        if self._itl_of is not backend:  # a failover's gaps are the new backend's
            self.flush_gaps()
            self._itl, self._itl_of = self.metrics.itl.labels(backend.name), backend
        learns = not first and self.x.charge.n == 1  # (n > 1: its choices come in pairs)
        if learns:
            level = backend.admission.slo.busy()
            if level != self._level:  # gaps are learnt under the level they came at
                self.flush_gaps(now)
                self._level = level
        gaps = self._gaps
        if not gaps:
            self._gaps_since = now
        gaps.append(itl)
        if learns:
            self._learnt.append(itl)
        self.gaps += 1
        target = self.x.party.itl_target_s
        if target is not None and itl > target:
            self.late_gaps += 1
        if len(gaps) >= GAPS_BATCH or now - self._gaps_since >= GAPS_AGE_S:
            self.flush_gaps(now)

    def flush_gaps(self, now: float | None = None) -> None:
        """Observe the gaps kept since the last flush: ``gateway_itl_seconds`` and the
        latency model of the backend they came from (:meth:`gateway.admission.slo.
        SloGuard.observe_itls`, under the slots busy when they came: a batch ends when
        that changes). Called by :meth:`token_seen` at :data:`GAPS_BATCH` gaps, at
        :data:`GAPS_AGE_S` or at a new level, and at the response's end
        (:class:`gateway.relay.response.ProxyResponse`); nothing when none are kept.

        :param now: the clock's time, seconds, if the caller has it.
        """
        backend, gaps, learnt = self._itl_of, self._gaps, self._learnt
        if not gaps:
            return
        self._gaps, self._learnt = [], []
        observe_all(self._itl, gaps)
        if learnt:
            admission = backend.admission
            admission.slo.observe_itls(learnt, admission.layout, now, level=self._level)

    def paced(self, attempt: Attempt | None, usage: Any, reported: float | None) -> None:
        """A whole answer's decode pace, for the wait prediction of a gateway whose
        streams have not yet taught it one (:meth:`gateway.admission.slo.SloGuard.
        observe_pace`): the pace the answer ``reported`` (seconds per token: llama-server's
        ``timings``), else its attempt's time over its completion tokens (an upper bound:
        the prefill is in it), from :data:`PACE_MIN_TOKENS` tokens on. A stream, an
        ``n > 1`` answer and one without usage teach nothing here."""
        x = self.x
        if x.stream or attempt is None or x.charge.n != 1 or not isinstance(usage, dict):
            return
        tokens = usage.get("completion_tokens")
        if not isinstance(tokens, int) or tokens < PACE_MIN_TOKENS:
            return
        pace = reported if reported is not None else (
            (self.clock.now() - attempt.started) / tokens)
        x.backend.admission.slo.observe_pace(pace)

    def all_choices(self, usage: Any, reasons: list[Any]) -> Any:
        """``usage`` with ``completion_tokens`` for every choice of an ``n > 1`` answer.

        llama-server reports one choice's tokens in a whole (non-streamed) answer
        (``usage_covers_one_choice``); each choice that stopped at the cap then counts
        the cap charged, which is exact, and each other choice counts as the one
        reported. Other kinds report the sum themselves.
        """
        if (len(reasons) < 2 or not isinstance(usage, dict)
                or not self.x.backend.dialect.usage_covers_one_choice):
            return usage
        one = usage.get("completion_tokens")
        if not isinstance(one, int):
            return usage
        cap = self.x.charge.max_tokens
        total = sum(cap if reason == "length" else min(one, cap) for reason in reasons)
        return {**usage, "completion_tokens": total}

    def attained(self) -> None:
        """Count a streamed answer of a class with targets in ``gateway_slo_requests_total``:
        TTFT met when its first token came by its deadline (its header's, else the class's
        ``ttft_p95_s``), ITL met when at most 5 % of its gaps were over ``itl_p95_s`` (its
        own ITL p95 within the target). A request with no first token is not counted."""
        x = self.x
        if not x.stream or x.ttft_s is None:
            return
        party, name = x.party, x.backend.name
        deadline = deadline_of(party)
        if deadline is not None:
            met = "met" if x.ttft_s <= deadline else "missed"
            self.metrics.slo_requests.labels(name, party.priority, "ttft", met).inc()
        if party.itl_target_s is not None and self.gaps:
            met = "met" if self.late_gaps <= 0.05 * self.gaps else "missed"
            self.metrics.slo_requests.labels(name, party.priority, "itl", met).inc()

    def settle(self, forwarded: bool) -> None:
        """Count the request in its tenant's tokens: prompt + completion once it went
        upstream (the tokens-per-minute window and ``gateway_tenant_tokens_total``);
        nothing when it never did."""
        x = self.x
        if x.tenant is None or not forwarded:
            if x.tenant is not None:
                x.tenant.settle(x.hold, 0, 0, self.clock.now())
            return
        # The gateway's own count (a continuation's prompt would count its earlier
        # answer again); a batch's true sum from the backend's usage.
        prompt = x.prompt_total
        if x.batched and self.reported_prompt is not None:
            prompt = self.reported_prompt
        completion = self.completion if self.completion is not None else self.streamed
        x.tenant.settle(x.hold, prompt, completion, self.clock.now())
        tokens = self.metrics.tenant_tokens
        tokens.labels(x.tenant.name, "prompt").inc(prompt)
        tokens.labels(x.tenant.name, "completion").inc(completion)

    def record(self, usage: Any, finish_reasons: Iterable[Any] = ()) -> None:
        """Observe a finished answer's ``usage`` (or ``None``) and why it ended: the
        token histograms, the completion for the output prediction, the prompt count
        against the one charged (a disagreement drops the kept count; an estimate is
        calibrated), the finish reasons for the trace."""
        self.finish_reasons += [r for r in finish_reasons if isinstance(r, str)]
        name = self.x.backend.name
        prompt = self.x.charge.prompt_tokens
        completion = None
        who = self.x.who
        if isinstance(usage, dict):
            completion = usage.get("completion_tokens")
            if isinstance(completion, int):
                self.completion = (self.completion or 0) + completion
                self.metrics.completion_tokens.labels(name, *who).observe(completion)
                if self.x.spec.predicts_output:
                    self.x.backend.lengths.record(completion // max(1, self.x.charge.n),
                                                  answer_shape(self.x.body))
            reported = usage.get("prompt_tokens")
            if isinstance(reported, int):
                if reported > prompt and not self.x.spec.sums_usage:
                    # (embeddings and rerank report the tokens of every item together)
                    log.warning(
                        "backend %s counted %d prompt tokens, the gateway charged %d",
                        name, reported, prompt,
                    )
                if reported != prompt and self.x.forget_count is not None and \
                        self.x.spec.exact_usage:
                    # An exact count the backend disagrees with (it may count otherwise
                    # now: a new template, unseen by discovery): count it afresh.
                    self.x.forget_count()
                self.calibrate(reported)
                prompt = self.reported_prompt = reported
        self.metrics.prompt_tokens.labels(name, *who).observe(prompt)
        if isinstance(completion, int):
            self.metrics.request_tokens.labels(name, *who).observe(prompt + completion)

    def calibrate(self, reported: int) -> None:
        """Compare a locally estimated prompt with the backend's count of it."""
        x = self.x
        if x.raw_estimate is None or reported <= 0:
            return
        name = x.backend.name
        self.metrics.estimate_error.labels(name).observe(
            (x.charge.prompt_tokens - reported) / reported)
        if x.backend.dialect.observe(str(x.body.get("model") or ""), x.raw_estimate,
                                     reported):
            self.metrics.suspected_truncations.labels(name).inc()
