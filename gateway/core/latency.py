"""A backend's latency curve, the SLO concurrency limit under its memory limit, and the
TTFT prediction (issue 26, items 2, 3, 5 and 7). Pure: numbers in, numbers out; no I/O,
no event loop, no clock of its own (every call that needs time is given ``now``).

Wired into admission by :mod:`gateway.admission.slo` (``docs/latency.md``).

The model (:class:`LatencyModel`), one per backend:

* **ITL by concurrency.** Each inter-token latency sample (seconds between two tokens of
  one stream) is filed under the number of sequences decoding on the backend when it
  arrived (its *level*, 1 to :attr:`LatencyParams.max_level`; more are filed at the top).
  Each level keeps a :class:`DecayedHistogram`: log-spaced buckets (8 per doubling, so a
  quantile is read within 9 % of the truth) whose weights decay exponentially with the
  samples that follow: a sample's weight halves every ``half_life_samples`` newer samples
  at that level. The p95 of a level is read from its histogram (geometric interpolation
  inside the bucket), its mean from the same weights. Small and explainable: a table of
  levels, each with a p95 and a count, that forgets the old at a stated rate.
* **Enough data first.** A level says nothing (``None``) until it has
  ``min_samples`` samples since it was last cleared: until then the controller acts as if
  there were no target.
* **Prefill throughput** (prompt tokens per second): the ratio of decayed sums of
  prefilled tokens and prefill seconds, each request's weight halving every
  ``prefill_half_life`` newer requests; ``None`` before ``prefill_min_samples`` requests.
  The source may be the gateway's own timing (request sent to first token, over the
  uncached prompt tokens) or the backend's report (llama-server's ``timings.prompt_n``
  and ``timings.prompt_ms``).

The controller (:class:`SloLimit`) is **AIMD** (additive increase, multiplicative
decrease; Chiu and Jain, 1989), chosen over a gradient controller (Netflix's Gradient2,
Envoy's adaptive concurrency) because the signal here is an absolute target against a
learned table, not a drift of latency against its own long-run baseline: "is the ITL p95
at this level over the target" is a yes-or-no signal, and AIMD is the controller for
one, stable, with two parameters. At each :meth:`SloLimit.update`:

1. no target (no class in flight has one): the limit is the memory limit, nothing else
   changes (inert). When a target appears, the limit **starts slow**
   (:meth:`SloLimit.start`): a level without enough samples is not assumed to hold the
   target, so it starts one level above the highest level up to which every level is
   known to hold it (1 on a backend never measured) and grows by rule 4;
2. the limit is kept within [1, memory limit]: it can only make admission stricter;
3. **decrease**: if a level ``n`` at or under the limit has enough samples and its p95 is
   over the target, the limit drops to ``max(1, min(n - 1, floor(beta × limit)))``
   (``beta`` = 0.75), and ``n`` becomes the *ceiling* for ``probe_hold_s`` (30 s);
4. **increase**: otherwise, if the limit binds (as many requests want the backend as
   the limit allows), its own level has enough samples within the target, and the next
   level is under the memory limit and not a ceiling still on hold, the limit rises by
   one. A probe into a level whose old samples break the target clears them first, so
   that it measures afresh: that is how the limit **recovers** when the backend is fast
   again.

Where the target holds up to ``n*`` and breaks above, the limit climbs to ``n*``, probes
``n* + 1`` once per hold, and falls back to ``n*`` (the tests check this on a synthetic
backend whose ITL grows with concurrency).

The TTFT prediction (:func:`predict_ttft`) is the predicted queue wait plus the uncached
prompt tokens over the learned prefill throughput, plus one decode step.

Prefill deferral (:func:`prefill_hold_s`, item 4): a prompt whose prefill would take
longer than the ITL target of the streams decoding beside it stalls every one of them
by that much (llama-server computes the prompt, in ``n_batch`` chunks, inside the decode
steps of the slots already generating: tools/server/server-context.cpp, one batch per
step for every slot), so it is held back while they decode, for a bounded time.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass, field

__all__ = [
    "HOLD_RECHECK_S",
    "DecayedHistogram",
    "LatencyModel",
    "LatencyParams",
    "LevelStats",
    "SloLimit",
    "predict_ttft",
    "prefill_hold_s",
    "tightest",
]

# Histogram buckets: upper bounds BASE_S x RATIO**i, i = 0 .. N_BUCKETS - 1, from 0.5 ms
# to about 45 s; a value at or under BASE_S is in bucket 0, one over the last bound in the
# last bucket.
BASE_S = 0.0005
RATIO = 2 ** (1 / 8)
N_BUCKETS = 132
_RENORMALISE_AT = 2.0**64  # the weight scale is folded back into the weights past this


_PER_LOG = 1 / math.log(RATIO)  # buckets per unit of natural log
_LOG_BASE = math.log(BASE_S)


def _bucket(value: float) -> int:
    if value <= BASE_S:
        return 0
    return min(N_BUCKETS - 1, math.ceil((math.log(value) - _LOG_BASE) * _PER_LOG - 1e-9))


def _upper(i: int) -> float:
    return BASE_S * RATIO**i


@dataclass
class DecayedHistogram:
    """Log-spaced buckets whose weights decay with the samples that follow.

    Decay is done the cheap way round: each new sample is added with a weight that grows
    by ``2 ** (1 / half_life)`` per sample, which is the same as multiplying every older
    weight by ``2 ** (-1 / half_life)``; the weights are rescaled before they overflow.

    :param half_life: samples after which a sample's weight has halved (> 0).
    """

    half_life: float
    weights: list[float] = field(default_factory=lambda: [0.0] * N_BUCKETS)
    total: float = 0.0
    weighted_sum: float = 0.0  # Σ weight × value, for the mean
    samples: int = 0  # samples since created or cleared, undecayed
    _scale: float = 1.0
    _growth: float = field(init=False, repr=False)  # 2 ** (1 / half_life), once

    def __post_init__(self) -> None:
        self._growth = 2.0 ** (1.0 / self.half_life)

    def add(self, value: float) -> None:
        """Add one sample (seconds; a negative or non-finite value is ignored)."""
        self.add_many((value,))

    def add_many(self, values: Iterable[float]) -> None:
        """Add samples in order, as :meth:`add` would one by one (seconds; a negative or
        non-finite value is ignored), in one call: a stream's inter-token gaps come in
        batches (:class:`gateway.relay.usage.UsageBook`, issue 37)."""
        weights, growth, scale = self.weights, self._growth, self._scale
        total, weighted, samples = self.total, self.weighted_sum, self.samples
        for value in values:
            if not math.isfinite(value) or value < 0:
                continue
            scale *= growth
            if scale > _RENORMALISE_AT:
                weights[:] = [w / scale for w in weights]
                total /= scale
                weighted /= scale
                scale = 1.0
            weights[_bucket(value)] += scale
            total += scale
            weighted += scale * value
            samples += 1
        self._scale, self.total, self.weighted_sum, self.samples = (
            scale, total, weighted, samples)

    def clear(self) -> None:
        """Forget every sample."""
        self.weights = [0.0] * N_BUCKETS
        self.total = self.weighted_sum = 0.0
        self.samples, self._scale = 0, 1.0

    def mean(self) -> float | None:
        """The decayed mean, seconds (``None`` when empty)."""
        return self.weighted_sum / self.total if self.total > 0 else None

    def quantile(self, q: float) -> float | None:
        """The decayed ``q`` quantile (0 < q < 1), seconds, interpolated geometrically in
        its bucket; within one bucket's width (9 %) of the truth. ``None`` when empty."""
        if self.total <= 0:
            return None
        rank, seen = q * self.total, 0.0
        for i, weight in enumerate(self.weights):
            if weight > 0 and seen + weight >= rank:
                low = _upper(i - 1) if i else BASE_S / RATIO
                return float(low * (_upper(i) / low) ** ((rank - seen) / weight))
            seen += weight
        return _upper(N_BUCKETS - 1)


@dataclass(frozen=True)
class LatencyParams:
    """The model's and the controller's parameters (defaults in parentheses).

    :param half_life_samples: ITL samples at a level after which an older sample's
        weight has halved (200).
    :param min_samples: ITL samples a level needs before it counts (50).
    :param quantile: the quantile the targets are of (0.95).
    :param max_level: the highest concurrency level kept; more are filed there (256,
        vLLM's default ``--max-num-seqs``).
    :param prefill_half_life: requests after which an older prefill's weight has halved
        (16); ``prefill_min_samples`` prefills before a rate is given (3).
    :param beta: the multiplicative decrease (0.75: the limit drops by a quarter).
    :param probe_hold_s: seconds the limit stays under a level that broke the target
        before probing it again (30).
    :raises ValueError: a parameter out of its range.
    """

    half_life_samples: float = 200.0
    min_samples: int = 50
    quantile: float = 0.95
    max_level: int = 256
    prefill_half_life: float = 16.0
    prefill_min_samples: int = 3
    beta: float = 0.75
    probe_hold_s: float = 30.0

    def __post_init__(self) -> None:
        if self.half_life_samples <= 0 or self.prefill_half_life <= 0:
            raise ValueError("half lives must be positive")
        if self.min_samples < 1 or self.prefill_min_samples < 1 or self.max_level < 1:
            raise ValueError("min_samples, prefill_min_samples and max_level must be >= 1")
        if not 0 < self.quantile < 1 or not 0 < self.beta < 1:
            raise ValueError("quantile and beta must be between 0 and 1")
        if self.probe_hold_s < 0:
            raise ValueError("probe_hold_s must not be negative")


@dataclass(frozen=True)
class LevelStats:
    """One row of the learned table: ITL at ``level`` sequences decoding (seconds)."""

    level: int
    samples: int
    mean_s: float | None
    p95_s: float | None


@dataclass
class LatencyModel:
    """One backend's learned latency: ITL by concurrency, and prefill throughput.

    :param params: the parameters (:class:`LatencyParams`).
    """

    params: LatencyParams = field(default_factory=LatencyParams)
    levels: dict[int, DecayedHistogram] = field(default_factory=dict)
    _prefill_tokens: float = 0.0
    _prefill_seconds: float = 0.0
    prefills: int = 0

    def level_of(self, decoding: int) -> int:
        """The table level of ``decoding`` sequences: clamped to [1, max_level]."""
        return max(1, min(self.params.max_level, decoding))

    def observe_itl(self, itl_s: float, decoding: int) -> None:
        """One inter-token latency (seconds) seen while ``decoding`` sequences decoded."""
        self.observe_itls((itl_s,), decoding)

    def observe_itls(self, itls_s: Iterable[float], decoding: int) -> None:
        """Inter-token latencies (seconds, in the order seen) while ``decoding`` sequences
        decoded, as :meth:`observe_itl` one by one."""
        level = decoding if 1 <= decoding <= self.params.max_level else self.level_of(decoding)
        hist = self.levels.get(level)
        if hist is None:
            hist = self.levels[level] = DecayedHistogram(self.params.half_life_samples)
        hist.add_many(itls_s)

    def itl_p95(self, level: int) -> float | None:
        """The learned ITL quantile (``params.quantile``) at ``level``, seconds, or
        ``None`` before the level has ``min_samples`` samples."""
        hist = self.levels.get(self.level_of(level))
        if hist is None or hist.samples < self.params.min_samples:
            return None
        return hist.quantile(self.params.quantile)

    def forget(self, level: int) -> None:
        """Clear one level's samples (a probe measures afresh)."""
        hist = self.levels.get(self.level_of(level))
        if hist is not None:
            hist.clear()

    def observe_prefill(self, tokens: int, seconds: float) -> None:
        """One request's prefill: ``tokens`` prompt tokens evaluated in ``seconds``
        (llama-server: ``timings.prompt_n`` and ``timings.prompt_ms / 1000``). Ignored
        when either is not positive."""
        if tokens <= 0 or not seconds > 0 or not math.isfinite(seconds):
            return
        keep = 2.0 ** (-1.0 / self.params.prefill_half_life)
        self._prefill_tokens = self._prefill_tokens * keep + tokens
        self._prefill_seconds = self._prefill_seconds * keep + seconds
        self.prefills += 1

    def prefill_tps(self) -> float | None:
        """Learned prefill throughput, prompt tokens per second (``None`` before
        ``prefill_min_samples`` prefills)."""
        if self.prefills < self.params.prefill_min_samples:
            return None
        return self._prefill_tokens / self._prefill_seconds

    def table(self) -> list[LevelStats]:
        """The learned table, by level (for metrics and the status page)."""
        return [LevelStats(level, h.samples, h.mean(),
                           h.quantile(self.params.quantile) if h.samples else None)
                for level, h in sorted(self.levels.items())]


def tightest(targets: Iterable[float | None]) -> float | None:
    """The tightest (smallest) of the targets given, seconds; ``None`` if none is set.
    The SLO limit follows the tightest ITL target of the classes in flight."""
    present = [t for t in targets if t is not None]
    return min(present) if present else None


@dataclass
class SloLimit:
    """The SLO concurrency limit of one backend, under its memory limit (AIMD; the rules
    are in the module's docstring).

    :param params: the parameters (:class:`LatencyParams`).
    :ivar limit: the current limit, sequences (``None`` while there is no target: before
        the first update with one, and after an update without one).
    :ivar ceiling: the lowest level that last broke the target, on hold until
        ``hold_until`` (clock seconds); ``None`` when there is none.
    """

    params: LatencyParams = field(default_factory=LatencyParams)
    limit: int | None = None
    ceiling: int | None = None
    hold_until: float = 0.0

    def update(self, model: LatencyModel, *, target_s: float | None, memory_limit: int,
               demand: int, now: float) -> int:
        """One control step; returns the limit (sequences admitted at once, 1 to
        ``memory_limit``).

        :param target_s: the tightest ITL p95 target of the classes in flight, seconds
            (:func:`tightest`), or ``None``: then the limit is ``memory_limit``.
        :param memory_limit: the most sequences the KV memory admits at once (>= 1).
        :param demand: requests that want this backend now (in flight + waiting).
        :param now: clock seconds (for the hold on a ceiling).
        :raises ValueError: ``memory_limit`` under 1.
        """
        if memory_limit < 1:
            raise ValueError("memory_limit must be at least 1")
        if target_s is None:
            self.limit = None
            return memory_limit
        if self.limit is None:
            limit = self.start(model, target_s, memory_limit)
        else:
            limit = max(1, min(memory_limit, self.limit))
        broken = self._lowest_broken(model, target_s, limit)
        if broken is not None:
            limit = max(1, min(broken - 1, math.floor(self.params.beta * limit)))
            self.ceiling, self.hold_until = broken, now + self.params.probe_hold_s
        elif self._may_rise(model, target_s, limit, memory_limit, demand, now):
            limit += 1
            p95 = model.itl_p95(limit)
            if p95 is not None and p95 > target_s:
                model.forget(limit)  # old samples of a level that broke it: measure anew
            if self.ceiling is not None and limit >= self.ceiling:
                self.ceiling = None
        self.limit = limit
        return limit

    @staticmethod
    def start(model: LatencyModel, target_s: float, memory_limit: int) -> int:
        """Slow start: the limit a target begins at, sequences. A level without
        ``min_samples`` samples is not assumed to hold the target: it is one above the
        highest level ``n`` such that every level from 1 to ``n`` is known to hold it,
        within [1, ``memory_limit``] (1 on a backend not yet measured). From there the
        limit grows one level at a time as each is learnt (rule 4)."""
        level = 1
        while level < memory_limit:
            p95 = model.itl_p95(level)
            if p95 is None or p95 > target_s:
                break
            level += 1
        return level

    def _lowest_broken(self, model: LatencyModel, target_s: float, limit: int
                       ) -> int | None:
        for level in sorted(model.levels):
            if level > limit:
                break
            p95 = model.itl_p95(level)
            if p95 is not None and p95 > target_s:
                return level
        return None

    def _may_rise(self, model: LatencyModel, target_s: float, limit: int,
                  memory_limit: int, demand: int, now: float) -> bool:
        if limit + 1 > memory_limit or demand < limit:
            return False
        here = model.itl_p95(limit)
        if here is None or here > target_s:
            return False  # its own level is not yet known to hold the target
        on_hold = self.ceiling is not None and limit + 1 >= self.ceiling
        return not (on_hold and now < self.hold_until)


def predict_ttft(*, queue_wait_s: float | None, prompt_tokens: int, cached_tokens: int = 0,
                 prefill_tps: float | None, first_step_s: float | None = None
                 ) -> float | None:
    """Predicted time to first token, seconds: the queue wait, plus the prompt tokens
    not already in the slot's cache over the prefill throughput, plus one decode step
    (``first_step_s``, the learned ITL at the concurrency it would join; 0 if unknown).

    :param queue_wait_s: the predicted wait before admission, seconds
        (:class:`gateway.core.waits.WaitPredictor`), 0 when it can start at once.
    :param prefill_tps: prompt tokens per second (:meth:`LatencyModel.prefill_tps`).
    :returns: ``None`` when the wait or the throughput is not known yet (no prediction:
        nothing should be refused on it).
    """
    if queue_wait_s is None or prefill_tps is None or prefill_tps <= 0:
        return None
    uncached = max(0, prompt_tokens - max(0, cached_tokens))
    return max(0.0, queue_wait_s) + uncached / prefill_tps + max(0.0, first_step_s or 0.0)


def prefill_hold_s(*, prompt_tokens: int, prefill_tps: float | None,
                   itl_target_s: float | None, defer_s: float, waited_s: float,
                   slack_s: float | None = None, streams_left_s: float | None = None
                   ) -> float:
    """How much longer a request should be held back so that its prefill does not stall
    the streams decoding on its backend, seconds; 0.0 when it may start now.

    Its prefill is predicted to take ``prompt_tokens / prefill_tps`` seconds, and every
    stream decoding beside it waits that long for its next tokens. It is held when that
    is longer than ``itl_target_s``, the tightest ITL p95 target of those streams, for
    at most ``defer_s`` seconds since it came (``waited_s`` of which have passed), and
    never past its TTFT slack (``slack_s``: its deadline less its predicted TTFT if it
    started now). The hold ends sooner when the streams end (the caller asks again).

    A hold only pays if the streams end during it: one released while they still decode
    stalls them all the same, later. So when ``streams_left_s`` (the seconds until the
    last of them is predicted to end) is longer than what is left of the hold, nothing
    is held; otherwise the hold is asked again once that time has passed (at least
    :data:`HOLD_RECHECK_S` later), since a stream may run longer than predicted.

    :param prompt_tokens: tokens its prefill computes (those not in a slot's cache).
    :param prefill_tps: the learned prefill throughput, prompt tokens per second
        (:meth:`LatencyModel.prefill_tps`); ``None`` (not learnt) never holds.
    :param itl_target_s: the tightest ITL p95 target of the streams decoding now,
        seconds; ``None`` (none has one) never holds.
    :param defer_s: the longest hold, seconds (``admission.prefill_defer_s``; 0: off).
    :param waited_s: seconds since the request came to admission.
    :param slack_s: seconds it can still lose and meet its TTFT deadline, or ``None``
        when it has no deadline.
    :param streams_left_s: seconds until the last of those streams is predicted to
        end, or ``None`` when not known (the hold then runs to its bound).
    :returns: seconds, in ``[0, defer_s]``.
    """
    if (itl_target_s is None or prefill_tps is None or not prefill_tps > 0
            or not defer_s > 0 or prompt_tokens <= 0):
        return 0.0
    if prompt_tokens / prefill_tps <= itl_target_s:
        return 0.0
    bound = defer_s if slack_s is None else min(defer_s, slack_s)
    left = bound - max(0.0, waited_s)
    if not (left > 0 and math.isfinite(left)):
        return 0.0
    if streams_left_s is None:
        return left
    if streams_left_s > left:
        return 0.0  # they would still decode when it went: holding spares nothing
    return min(left, max(streams_left_s, HOLD_RECHECK_S))


#: Seconds at least between two looks at a held request whose streams were predicted
#: to have ended (their leases end a little after their last token).
HOLD_RECHECK_S = 0.05
