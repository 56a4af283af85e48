"""Pure capacity model of one backend's slots and KV cache.

Rules of this module:
1. No I/O and no async: it imports nothing from asyncio, anyio, httpx, starlette,
   fastapi or prometheus_client (a test enforces this). Inputs and outputs are frozen
   dataclasses; functions return new values and never mutate.
2. Every unit is tokens (KV cells). One KV cell holds one token of one sequence.

The llama-server facts behind it (``shared/design/backends.md`` §1.1–1.3, §4):

* **per-slot layout** (explicit ``-np N``, or ``--no-kv-unified``): N slots with a
  private context of S tokens each. A request fits when a slot is free and its
  reservation fits in S.
* **unified layout** (the default when ``-np`` is not given: 4 slots, one pool):
  N slots share a pool of P cells. A request fits when a slot is free, the reservations
  in flight plus this one are at most P, and the reservation fits in S. When the sum
  goes over P, llama-server fails *every* request in flight with HTTP 500
  "Context size has been exceeded." (``tools/server/server-context.cpp``).
* llama-server stops generating once ``n_tokens + 1 >= n_ctx`` of the slot
  (``server-context.cpp``, STOP_TYPE_LIMIT), so the usable room in a slot is S − 1
  tokens: prompt + output cap ≤ S − 1.

A reservation is ``n × (prompt tokens + output cap)`` and takes ``n`` slots, since
llama-server gives each of the ``n`` completions its own slot (``server-schema.cpp``).

vLLM (``shared/design/backends.md`` §3, §4.5) is the unified layout with two changes:

* its KV cache is paged in blocks of ``block_size`` tokens, so a request holds
  ``ceil((prompt + cap) / block_size)`` whole blocks: the reservation is rounded up to
  a multiple of ``block_size``;
* ``prompt + max_tokens ≤ max_model_len`` is checked strictly, with no token kept back
  (``tests/v1/e2e/test_context_length.py``: 2047 + 1 fits 2048): ``stop_margin`` is 0
  where llama-server's is 1. Its "slots" are ``max_num_seqs``.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from enum import StrEnum

from gateway.errors import ContextLengthExceeded, InvalidRequest

__all__ = [
    "Budget",
    "CapPolicy",
    "Charge",
    "Layout",
    "LiveUse",
    "choose_victims",
    "fits",
    "fits_alone",
    "plan_charge",
    "release",
    "reserve",
]


class CapPolicy(StrEnum):
    """What :func:`plan_charge` does when prompt + requested cap exceeds the slot."""

    reject = "reject"  # raise ContextLengthExceeded
    clamp = "clamp"  # lower the cap to the room left in the slot


@dataclass(frozen=True)
class Layout:
    """The KV layout of one backend.

    :param slots: number of slots (llama-server ``-np``; ``/props`` ``total_slots``).
    :param ctx_per_slot: S, the context of one slot in tokens (``/props``
        ``default_generation_settings.n_ctx``).
    :param pool_tokens: P, the cells of the shared pool when the KV cache is unified;
        ``None`` for the per-slot layout.
    :param block_size: tokens per KV block; reservations are rounded up to whole blocks
        (1 for llama-server's cells, vLLM's ``cache_config.block_size`` for vLLM).
    :param stop_margin: tokens of S a request can never use: 1 for llama-server (it
        stops at ``n_ctx − 1``), 0 for vLLM (``prompt + max_tokens ≤ max_model_len``).
    :param busy_cap: the most slots kept busy at once, below ``slots``, learnt from the
        server's own refusals for want of room (vLLM's 503 past
        ``--max-num-queued-reqs``: :meth:`gateway.core.pool_model.PoolModel.full`); a
        request on a backend with nothing busy is admitted whatever it is. ``None``: no
        cap but ``slots``.
    :raises ValueError: a value is out of range (slots < 1, S < 2, P < S, block_size < 1,
        stop_margin not 0 or 1, busy_cap < 1).
    """

    slots: int
    ctx_per_slot: int
    pool_tokens: int | None = None
    block_size: int = 1
    stop_margin: int = 1
    busy_cap: int | None = None

    def __post_init__(self) -> None:
        if self.slots < 1:
            raise ValueError(f"slots must be >= 1, got {self.slots}")
        if self.ctx_per_slot < 2:
            raise ValueError(f"ctx_per_slot must be >= 2, got {self.ctx_per_slot}")
        if self.pool_tokens is not None and self.pool_tokens < self.ctx_per_slot:
            raise ValueError(
                f"pool_tokens ({self.pool_tokens}) must be >= ctx_per_slot ({self.ctx_per_slot})"
            )
        if self.block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {self.block_size}")
        if self.stop_margin not in (0, 1):
            raise ValueError(f"stop_margin must be 0 or 1, got {self.stop_margin}")
        if self.busy_cap is not None and self.busy_cap < 1:
            raise ValueError(f"busy_cap must be >= 1, got {self.busy_cap}")

    @property
    def unified(self) -> bool:
        """True when all slots share one pool of ``pool_tokens`` cells."""
        return self.pool_tokens is not None

    @property
    def usable_per_slot(self) -> int:
        """Tokens one request may use (prompt + cap): S − ``stop_margin``."""
        return self.ctx_per_slot - self.stop_margin

    @property
    def capacity_tokens(self) -> int:
        """Total KV cells: P when unified, slots × S otherwise."""
        if self.pool_tokens is not None:
            return self.pool_tokens
        return self.slots * self.ctx_per_slot


@dataclass(frozen=True)
class Charge:
    """What one request reserves while it is in flight.

    :param prompt_tokens: prompt length as the backend counts it (template applied).
    :param max_tokens: output cap charged, and forwarded upstream as ``max_tokens``.
    :param n: number of completions (each one a slot and a reservation).
    :param clamped: the requested cap was lowered to fit the slot.
    :param defaulted: no cap was requested; the configured default was used.
    :param pinnable: one prompt (its tasks can be told which slots to use); a batch of
        prompts is not.
    :param block_size: the layout's KV block size; each completion's reservation is
        rounded up to whole blocks.
    :param predicted: under the ``predictive`` policy, the output tokens charged against
        the pool (a predicted completion length, at most ``max_tokens``); ``None`` charges
        the whole cap (``strict``). The cap still has to fit one slot.
    :param to_cap: the answer runs to its cap (``ignore_eos``): its length is known
        before it starts (:meth:`gateway.core.waits.WaitPredictor.replay`).
    """

    prompt_tokens: int
    max_tokens: int
    n: int = 1
    clamped: bool = False
    defaulted: bool = False
    pinnable: bool = True
    block_size: int = 1
    predicted: int | None = None
    to_cap: bool = False

    @property
    def output_charged(self) -> int:
        """Output tokens charged per completion: the prediction, or the whole cap."""
        if self.predicted is None:
            return self.max_tokens
        return max(0, min(self.predicted, self.max_tokens))

    @property
    def tokens(self) -> int:
        """KV cells reserved: n × (prompt + charged output), each rounded up to whole
        blocks."""
        blocks = -(-(self.prompt_tokens + self.output_charged) // self.block_size)
        return self.n * blocks * self.block_size

    @property
    def slots(self) -> int:
        """Slots taken: n."""
        return self.n


@dataclass(frozen=True)
class Budget:
    """What is reserved on one backend right now.

    :param reserved_tokens: sum of the in-flight charges' tokens.
    :param busy_slots: sum of the in-flight charges' slots.
    """

    reserved_tokens: int = 0
    busy_slots: int = 0


def _room_per_slot(layout: Layout, prompt_tokens: int, n: int,
                   prompt_field: str = "messages") -> int:
    """Output tokens one slot leaves after the prompt (at least 1); ``prompt_field``
    names the prompt's field in the error.

    :raises ContextLengthExceeded: the prompt alone fills the slot.
    :raises InvalidRequest: ``n`` is larger than the backend's slot count.
    """
    room = layout.usable_per_slot - prompt_tokens
    if room < 1:
        raise ContextLengthExceeded(
            f"This request's prompt is {prompt_tokens} tokens, which leaves no room for output "
            f"in a context of {layout.ctx_per_slot} tokens (at most {layout.usable_per_slot} "
            f"usable, prompt + max_tokens). Shorten the prompt.",
            param=prompt_field, n_prompt_tokens=prompt_tokens, n_ctx=layout.ctx_per_slot,
        )
    if n > layout.slots:
        raise InvalidRequest(
            f"This request asks for {n} completions (n × prompts), each of which needs its "
            f"own slot, but the backend has {layout.slots} slots.", param="n"
        )
    return room


def plan_charge(
    layout: Layout,
    prompt_tokens: int,
    requested_max_tokens: int | None,
    *,
    n: int = 1,
    default_max_tokens: int,
    policy: CapPolicy,
    cap_field: str = "max_tokens",
    prompt_field: str = "messages",
) -> Charge:
    """Decide the output cap to charge for a request, or refuse one that can never fit.

    The cap is the requested one when given; otherwise ``default_max_tokens`` clamped to
    the room left in a slot (S − ``stop_margin`` − prompt).

    :param prompt_tokens: prompt length in tokens, as the backend counts it.
    :param requested_max_tokens: ``max_tokens``/``max_completion_tokens``, or ``None``.
    :param n: completions requested.
    :param cap_field: the request field the cap came from, named in errors.
    :param prompt_field: the request field the prompt came from (``messages``,
        ``prompt``, ``input``), named in the error of a prompt that fills the slot.
    :raises ContextLengthExceeded: the prompt alone fills the slot; or prompt + cap
        exceeds it under the ``reject`` policy; or the n reservations exceed the pool.
    :raises InvalidRequest: ``n`` is larger than the backend's slot count.
    """
    room = _room_per_slot(layout, prompt_tokens, n, prompt_field)
    clamped = defaulted = False
    if requested_max_tokens is None:
        cap, defaulted = min(default_max_tokens, room), True
    elif requested_max_tokens > room:
        if policy is CapPolicy.reject:
            raise ContextLengthExceeded(
                f"This request needs {prompt_tokens + requested_max_tokens} tokens "
                f"(prompt {prompt_tokens} + {cap_field} {requested_max_tokens}), but one request "
                f"may use at most {layout.usable_per_slot} (context {layout.ctx_per_slot}). "
                f"Lower {cap_field} to {room} or shorten the prompt.",
                param=cap_field, n_prompt_tokens=prompt_tokens, n_ctx=layout.ctx_per_slot,
            )
        cap, clamped = room, True
    else:
        cap = requested_max_tokens
    charge = Charge(prompt_tokens, cap, n=n, clamped=clamped, defaulted=defaulted,
                    block_size=layout.block_size)
    if charge.tokens > layout.capacity_tokens:
        raise ContextLengthExceeded(
            f"This request needs {charge.tokens} KV tokens (n {n} × (prompt {prompt_tokens} + "
            f"max_tokens {cap}), in blocks of {layout.block_size}), more than the backend's "
            f"whole pool of {layout.capacity_tokens}. Lower n or max_tokens.",
            param="n", n_prompt_tokens=prompt_tokens, n_ctx=layout.ctx_per_slot,
        )
    return charge


def fits_alone(layout: Layout, charge: Charge) -> bool:
    """True when ``charge`` fits an idle backend of this layout (e.g. after it changed)."""
    return (
        charge.slots <= layout.slots
        and charge.prompt_tokens + charge.max_tokens <= layout.usable_per_slot
        and charge.tokens <= layout.capacity_tokens
    )


def fits(layout: Layout, budget: Budget, charge: Charge) -> bool:
    """True when ``charge`` can start now on top of ``budget``.

    Per-slot layout: a free slot for each of the n completions (each already fits S),
    within ``busy_cap`` unless nothing is busy. Unified layout: the same, and reserved +
    charge ≤ P.
    """
    if budget.busy_slots + charge.slots > layout.slots:
        return False
    if (layout.busy_cap is not None and budget.busy_slots
            and budget.busy_slots + charge.slots > layout.busy_cap):
        return False
    if not fits_alone(layout, charge):
        return False
    if layout.pool_tokens is not None:
        return budget.reserved_tokens + charge.tokens <= layout.pool_tokens
    return True


def reserve(budget: Budget, charge: Charge) -> Budget:
    """Return ``budget`` with ``charge`` added. The caller checks :func:`fits` first."""
    return replace(
        budget,
        reserved_tokens=budget.reserved_tokens + charge.tokens,
        busy_slots=budget.busy_slots + charge.slots,
    )


def release(budget: Budget, charge: Charge) -> Budget:
    """Return ``budget`` with ``charge`` removed.

    :raises ValueError: the charge was not reserved (the budget would go negative).
    """
    tokens = budget.reserved_tokens - charge.tokens
    slots = budget.busy_slots - charge.slots
    if tokens < 0 or slots < 0:
        raise ValueError(f"release of {charge} from {budget} would go negative")
    return replace(budget, reserved_tokens=tokens, busy_slots=slots)


@dataclass(frozen=True)
class LiveUse:
    """What one request in flight holds of the pool right now, for :func:`choose_victims`.

    :param key: the caller's handle for the request.
    :param used: KV cells it holds now: n × (prompt + tokens generated so far).
    :param growth: cells it may add before the gateway's next observation of it.
    :param generated: tokens generated so far (its progress, lost if it is preempted).
    :param preemptible: the gateway can cancel and resume it.
    :param since: when it was admitted (a tie-break: the later one goes first).
    """

    key: int
    used: int
    growth: int
    generated: int
    preemptible: bool
    since: float = 0.0


def choose_victims(uses: list[LiveUse], limit: int) -> list[int]:
    """The requests to preempt so that live use plus possible growth stays within
    ``limit`` tokens (the pool less a margin), least progress first.

    llama-server fails every request in flight when a decode step finds no free cell
    (``shared/design/backends.md`` §1.3), so the gateway cancels the cheapest requests
    to lose before that step comes. A victim frees all it holds (``used + growth``).
    When the preemptible requests alone cannot bring the sum under ``limit``, all of
    them are returned: nothing better can be done.

    :returns: the keys of the victims, in the order chosen.
    """
    total = sum(u.used + u.growth for u in uses)
    if total <= limit:
        return []
    victims = []
    for use in sorted((u for u in uses if u.preemptible),
                      key=lambda u: (u.generated, -u.since)):
        victims.append(use.key)
        total -= use.used + use.growth
        if total <= limit:
            break
    return victims
