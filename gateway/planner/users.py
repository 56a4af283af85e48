"""``gateway plan --users N --turn-s S --think-s T``: size a server from its users.

Pure arithmetic, no I/O. The model is Little's law over a closed population of users who
each take one turn at a time:

* **requests in flight** = ``users × turn_s / think_s``. ``turn_s`` is the seconds the
  server spends generating one turn (prefill + decode of its answer); ``think_s`` is the
  seconds **from one turn's request to the user's next** (start to start), so it includes
  the turn's own ``turn_s``. 20 users, 12 s per turn, a turn every 90 s: 20 × 12 / 90 =
  2.67 in flight. If what you know is only the idle time between an answer and the next
  question, pass ``turn_s`` + that idle time as ``think_s``.
* **how many are busy at once** varies around that mean: each user is generating a
  share ``p = turn_s / think_s`` of the time, independently, so the number busy at a
  random moment is Binomial(users, p). Its quantiles say how often the slots are all
  taken (an approximation: it ignores that a queued turn ends later).
* **slots** = ``ceil(in_flight × (1 + headroom))``, at least 1 (headroom 0.25 by default):
  a little above the mean, so the engine usually has a free slot and a burst waits in the
  gateway's short queue rather than deepening every decode batch (which raises every
  stream's inter-token latency).
* **context per slot** = ``--ctx``, or ``pad(prompt_tokens + answer_tokens, 256)``
  (llama.cpp rounds contexts to 256, ``llama-context.cpp``), or with neither the largest
  that fits the KV budget at that many slots, or else 4096 (Ollama's default).
* **the gateway's queue bounds**: ``max_queue = users - slots`` (users taking one turn at
  a time can never queue more, so it refuses no real user), at least 1; and
  ``max_queue_wait_s = turn_s × max(1, ceil((busy_p99 - slots) / slots))``: in the 99th
  percentile burst, the requests beyond the slots wait at most that many rounds of turns
  for a slot. A longer wait means load beyond this sizing, and the 503 with Retry-After is
  the honest answer.

Backend settings (sources: llama.cpp ``tools/server/README.md`` and ``common/arg.cpp``;
Ollama ``envconfig/config.go`` and ``server/sched.go``; vLLM
``vllm/engine/arg_utils.py``):

* llama-server: ``-np slots -c slots × ctx``. ``-c`` is the whole KV pool; without
  ``--kv-unified`` each of the ``-np`` slots gets ``pad(c / np, 256)`` cells of its own,
  with it the slots share the pool (then the gateway needs ``pool_tokens``).
* Ollama: ``OLLAMA_NUM_PARALLEL = slots`` and ``OLLAMA_CONTEXT_LENGTH = ctx`` (per slot:
  Ollama's scheduler sets ``NumCtx × NumParallel`` for the runner); ``OLLAMA_MAX_QUEUE = 2 ×
  slots``: its pending queue (a channel of that size, 503 "server busy" when full) only
  needs to buffer what the gateway has already admitted while a model loads, with room for
  requests the gateway abandoned but Ollama has not yet seen end; the waiting belongs in
  the gateway's queue, in its order.
* vLLM: ``--max-num-seqs slots --max-model-len ctx``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from gateway.planner.planning import (
    CTX_ALIGN,
    ModelShape,
    kv_size,
    max_ctx_for_slots,
    max_slots_for_ctx,
    pad,
)

__all__ = [
    "DEFAULT_CTX",
    "DEFAULT_HEADROOM",
    "UserLoad",
    "binomial_quantile",
    "in_flight",
    "queue_bounds",
    "render_users",
    "size_from_users",
    "slots_for",
]

DEFAULT_HEADROOM = 0.25
DEFAULT_CTX = 4096  # a slot's context when nothing says otherwise: Ollama's default
MIB = 1024**2


@dataclass(frozen=True)
class UserLoad:
    """The load a team puts on one model.

    :param users: people using it (each takes one turn at a time).
    :param turn_s: seconds of generation per turn (prefill + decode of one answer).
    :param think_s: seconds from one turn's request to the same user's next request
        (start to start; ``turn_s`` included).
    :param prompt_tokens: tokens of a turn's prompt (history included), if known.
    :param answer_tokens: tokens of a turn's answer, if known.
    :raises ValueError: a count or time not positive, or ``think_s < turn_s`` (a user
        cannot generate for longer than the interval between their turns).
    """

    users: int
    turn_s: float
    think_s: float
    prompt_tokens: int | None = None
    answer_tokens: int | None = None

    def __post_init__(self) -> None:
        if self.users < 1:
            raise ValueError("--users must be at least 1")
        if self.turn_s <= 0 or self.think_s <= 0:
            raise ValueError("--turn-s and --think-s must be positive seconds")
        if self.think_s < self.turn_s:
            raise ValueError(f"--think-s {self.think_s:g} is shorter than --turn-s "
                             f"{self.turn_s:g}: it is the time from one turn to the next, "
                             "the turn included (idle time + turn)")
        for name, value in (("--prompt-tokens", self.prompt_tokens),
                            ("--answer-tokens", self.answer_tokens)):
            if value is not None and value < 0:
                raise ValueError(f"{name} must not be negative")

    @property
    def busy_share(self) -> float:
        """The share of time one user has a turn generating: ``turn_s / think_s``."""
        return self.turn_s / self.think_s


def in_flight(users: int, turn_s: float, think_s: float) -> float:
    """Requests in flight on average (Little's law): ``users × turn_s / think_s``.

    :param think_s: seconds from one turn's request to the user's next, turn included.
    """
    return users * turn_s / think_s


def slots_for(mean_in_flight: float, headroom: float = DEFAULT_HEADROOM) -> int:
    """Slots to set: ``ceil(mean × (1 + headroom))``, at least 1.

    :raises ValueError: a negative ``headroom``.
    """
    if headroom < 0:
        raise ValueError("--headroom must not be negative")
    # round() first: 2.4 x 1.25 is 3.0000000000000004 in binary floating point.
    return max(1, math.ceil(round(mean_in_flight * (1 + headroom), 9)))


def binomial_quantile(n: int, p: float, q: float) -> int:
    """The smallest ``k`` with P(Binomial(n, p) <= k) >= q: how many of ``n`` users, each
    busy a share ``p`` of the time, are busy at once at quantile ``q``."""
    if p >= 1.0:
        return n
    cumulative = 0.0
    for k in range(n + 1):
        cumulative += math.comb(n, k) * p**k * (1 - p) ** (n - k)
        if cumulative >= q - 1e-12:
            return k
    return n


def _share_over(n: int, p: float, slots: int) -> float:
    """P(Binomial(n, p) > slots): the share of time more users want a slot than exist."""
    return max(0.0, 1.0 - sum(math.comb(n, k) * p**k * (1 - p) ** (n - k)
                              for k in range(min(slots, n) + 1)))


def queue_bounds(load: UserLoad, slots: int) -> dict[str, Any]:
    """The gateway's ``[admission]`` queue bounds for this load (rules in the module doc):
    ``max_queue`` (requests) and ``max_queue_wait_s`` (seconds, whole)."""
    busy_p99 = binomial_quantile(load.users, load.busy_share, 0.99)
    rounds = max(1, math.ceil(max(0, busy_p99 - slots) / slots))
    return {"max_queue": max(1, load.users - slots),
            "max_queue_wait_s": math.ceil(load.turn_s * rounds), "busy_p99": busy_p99}


def _budget(shape: ModelShape | None, kv_budget: int | None, memory: int | None) -> int | None:
    if kv_budget is not None or memory is None:
        return kv_budget
    if shape is None or shape.weights_bytes is None:
        raise ValueError("--memory needs a GGUF file (its size is the weights); "
                         "use --kv-memory instead")
    if memory <= shape.weights_bytes:
        raise ValueError("the weights alone fill the memory given")
    return memory - shape.weights_bytes


def _settings(slots: int, ctx: int, unified: bool, type_k: str, type_v: str,
              bounds: dict[str, Any]) -> dict[str, Any]:
    n_ctx = slots * ctx
    flags = ["-c", str(n_ctx), "-np", str(slots),
             "--kv-unified" if unified else "--no-kv-unified"]
    if (type_k, type_v) != ("f16", "f16"):
        flags += ["-ctk", type_k, "-ctv", type_v]
    if type_v not in ("f16", "bf16", "f32"):
        flags += ["-fa", "on"]  # a quantized V cache needs flash attention
    block = ["[admission]", f"max_queue = {bounds['max_queue']}",
             f"max_queue_wait_s = {bounds['max_queue_wait_s']}", "",
             "[[backends]]", 'name = "local"', 'url = "http://127.0.0.1:8080"',
             'kind = "llama.cpp"', f"slots = {slots}", f"ctx_per_slot = {ctx}",
             f"kv_unified = {'true' if unified else 'false'}"]
    if unified:
        block.append(f"pool_tokens = {n_ctx}")
    return {
        "llama_server": "llama-server -m MODEL.gguf " + " ".join(flags),
        "ollama_env": {"OLLAMA_NUM_PARALLEL": str(slots), "OLLAMA_CONTEXT_LENGTH": str(ctx),
                       "OLLAMA_MAX_QUEUE": str(2 * slots)},
        "vllm": f"vllm serve MODEL --max-num-seqs {slots} --max-model-len {ctx} --port 8001",
        "gateway": "\n".join(block),
        "gateway_admission": {"max_queue": bounds["max_queue"],
                              "max_queue_wait_s": bounds["max_queue_wait_s"]},
    }


def size_from_users(
    load: UserLoad, *, headroom: float = DEFAULT_HEADROOM, ctx: int | None = None,
    shape: ModelShape | None = None, kv_budget: int | None = None,
    memory: int | None = None, unified: bool = False, type_k: str = "f16",
    type_v: str = "f16",
) -> dict[str, Any]:
    """The sizing report (a plain dict, also the ``--json`` output).

    :param ctx: context per slot (tokens); unset, ``pad(prompt + answer tokens, 256)``,
        else the largest that fits the budget at these slots, else :data:`DEFAULT_CTX`.
    :param shape: the model, to check that slots × context fits ``kv_budget`` (bytes of
        KV) or ``memory`` (bytes, the GGUF's weights taken off); without both the fit is
        not checked (``kv["fits"]`` is None).
    :raises ValueError: a memory the weights fill, or a budget too small for the slots.
    """
    mean = in_flight(load.users, load.turn_s, load.think_s)
    slots = slots_for(mean, headroom)
    budget = _budget(shape, kv_budget, memory)
    if ctx is not None:
        source = "--ctx"
    elif load.prompt_tokens is not None and load.answer_tokens is not None:
        ctx, source = load.prompt_tokens + load.answer_tokens, "prompt + answer tokens"
    elif shape is not None and budget is not None:
        widest = max_ctx_for_slots(shape, budget, slots, unified=unified, type_k=type_k,
                                   type_v=type_v)
        if widest is None:
            raise ValueError(f"the KV budget does not hold {slots} slots of 256 tokens")
        ctx, source = widest.kv.n_ctx // slots, "the largest that fits the KV budget"
    else:
        ctx, source = DEFAULT_CTX, f"default {DEFAULT_CTX}, Ollama's; give --ctx or tokens"
    if ctx < 1:
        raise ValueError("the context per slot must be at least 1 token")
    ctx = pad(ctx, CTX_ALIGN)
    p = load.busy_share
    bounds = queue_bounds(load, slots)
    report: dict[str, Any] = {
        "users": load.users, "turn_s": load.turn_s, "think_s": load.think_s,
        "think_s_means": "seconds from one turn's request to the next (turn included)",
        "busy_share": p, "in_flight": mean, "headroom": headroom, "slots": slots,
        "busy_p95": binomial_quantile(load.users, p, 0.95), "busy_p99": bounds["busy_p99"],
        "share_of_time_all_slots_busy": _share_over(load.users, p, slots - 1),
        "share_of_time_some_wait": _share_over(load.users, p, slots),
        "ctx_per_slot": ctx, "ctx_source": source, "prompt_tokens": load.prompt_tokens,
        "answer_tokens": load.answer_tokens,
    }
    if load.answer_tokens:
        rate = load.answer_tokens / load.turn_s
        report["decode"] = {
            "tokens_per_s_per_stream": rate, "itl_needed_s": 1 / rate,
            "tokens_per_s_all_slots": rate * slots,
        }
    kv: dict[str, Any] = {"budget_bytes": budget, "fits": None}
    if shape is not None:
        size = kv_size(shape, slots * ctx, slots, unified=unified, type_k=type_k,
                       type_v=type_v)
        kv["bytes"] = size.total_bytes
        if budget is not None:
            kv["fits"] = size.total_bytes <= budget
            most = max_slots_for_ctx(shape, budget, ctx, unified=unified, type_k=type_k,
                                     type_v=type_v)
            widest = max_ctx_for_slots(shape, budget, slots, unified=unified,
                                       type_k=type_k, type_v=type_v)
            kv["most_slots_at_ctx"] = most.slots if most else 0
            kv["largest_ctx_at_slots"] = widest.kv.n_ctx // slots if widest else 0
    report["kv"] = kv
    report["layout"] = "unified" if unified else "per-slot"
    report["settings"] = _settings(slots, ctx, unified, type_k, type_v, bounds)
    return report


def render_users(r: dict[str, Any]) -> str:
    """The sizing report as text for a terminal."""
    lines = [
        f"users          {r['users']}, {r['turn_s']:g} s of generation per turn, a turn every "
        f"{r['think_s']:g} s (request to request): each busy {r['busy_share']:.0%} of the time",
        f"in flight      {r['in_flight']:.1f} on average ({r['users']} x {r['turn_s']:g} / "
        f"{r['think_s']:g}); at once: p95 {r['busy_p95']}, p99 {r['busy_p99']}",
        f"slots          {r['slots']} (ceil({r['in_flight']:.2f} x {1 + r['headroom']:g})): all "
        f"busy {r['share_of_time_all_slots_busy']:.1%} of the time, a turn waits for a slot "
        f"{r['share_of_time_some_wait']:.1%} of the time",
        f"context        {r['ctx_per_slot']} tokens per slot ({r['ctx_source']}"
        + (f": {r['prompt_tokens']} + {r['answer_tokens']}, rounded up to 256"
           if r["ctx_source"].startswith("prompt") else "") + ")",
    ]
    if "decode" in r:
        d = r["decode"]
        lines.append(f"decode         {d['tokens_per_s_per_stream']:.1f} tokens/s per stream "
                     f"(ITL {d['itl_needed_s'] * 1000:.0f} ms), "
                     f"{d['tokens_per_s_all_slots']:.1f} tokens/s with all slots busy")
    for name, seen in (r.get("latency") or {}).items():
        if seen["itl_p95_s"] is None:
            lines.append(f"learned        {name}: no ITL learnt yet (a level needs 50 "
                         "samples)")
            continue
        bound = "at least " if seen["at_least"] else ""
        ttft = "" if seen["ttft_s"] is None else \
            f", TTFT {seen['ttft_s']:.2f} s for a turn that does not wait"
        lines.append(f"learned        {name}: ITL p95 {bound}{seen['itl_p95_s'] * 1000:.0f} ms "
                     f"with {seen['level']} busy (learnt with {seen['from_level']}){ttft}")
    kv = r["kv"]
    if kv["fits"] is None:
        lines.append("KV memory      not checked (give the model and --kv-memory or --memory)"
                     if "bytes" not in kv else
                     f"KV memory      {kv['bytes'] / MIB:,.2f} MiB needed; no budget given")
    else:
        verdict = "fits" if kv["fits"] else "DOES NOT FIT"
        lines.append(
            f"KV memory      {r['slots']} x {r['ctx_per_slot']} needs {kv['bytes'] / MIB:,.2f} "
            f"MiB of {kv['budget_bytes'] / MIB:,.2f} MiB: {verdict} (at most "
            f"{kv['most_slots_at_ctx']} slots of {r['ctx_per_slot']}, or {r['slots']} slots "
            f"of {kv['largest_ctx_at_slots']})")
    s = r["settings"]
    lines += [
        "", "llama-server   " + s["llama_server"],
        "Ollama         " + " ".join(f"{k}={v}" for k, v in s["ollama_env"].items())
        + " ollama serve",
        "vLLM           " + s["vllm"],
        "", f"gateway config ({r['layout']} llama-server):", s["gateway"],
    ]
    return "\n".join(lines)
