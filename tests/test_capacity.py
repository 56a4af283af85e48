"""The pure capacity model: table cases and hypothesis properties."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gateway.core.capacity import (
    Budget,
    CapPolicy,
    Charge,
    Layout,
    fits,
    fits_alone,
    plan_charge,
    release,
    reserve,
)
from gateway.errors import ContextLengthExceeded, InvalidRequest

UNIFIED = Layout(slots=4, ctx_per_slot=2048, pool_tokens=2048)  # llama-server -c 2048
PER_SLOT = Layout(slots=3, ctx_per_slot=2048)  # -c 6144 -np 3 --no-kv-unified


def plan(layout: Layout, prompt: int, cap: int | None, **kw: object) -> Charge:
    kw.setdefault("default_max_tokens", 1024)
    kw.setdefault("policy", CapPolicy.reject)
    return plan_charge(layout, prompt, cap, **kw)  # type: ignore[arg-type]


def test_layout_capacity() -> None:
    assert UNIFIED.capacity_tokens == 2048 and UNIFIED.unified
    assert PER_SLOT.capacity_tokens == 6144 and not PER_SLOT.unified
    assert PER_SLOT.usable_per_slot == 2047


@pytest.mark.parametrize("bad", [
    dict(slots=0, ctx_per_slot=2048), dict(slots=1, ctx_per_slot=1),
    dict(slots=2, ctx_per_slot=2048, pool_tokens=1024),
    dict(slots=2, ctx_per_slot=2048, block_size=0), dict(slots=2, ctx_per_slot=2048,
                                                         stop_margin=2),
])
def test_layout_rejects_nonsense(bad: dict[str, int]) -> None:
    with pytest.raises(ValueError):
        Layout(**bad)


def test_requested_cap_is_charged() -> None:
    c = plan(UNIFIED, 800, 900)
    assert (c.prompt_tokens, c.max_tokens, c.tokens, c.clamped, c.defaulted) == (
        800, 900, 1700, False, False)


def test_default_cap_clamped_to_room_left() -> None:
    assert plan(UNIFIED, 100, None).max_tokens == 1024
    c = plan(UNIFIED, 1500, None)
    assert c.max_tokens == 2047 - 1500 and c.defaulted


def test_prompt_filling_the_slot_never_fits() -> None:
    with pytest.raises(ContextLengthExceeded) as info:
        plan(UNIFIED, 2047, 1)
    assert "2047" in info.value.message and "2048" in info.value.message
    with pytest.raises(ContextLengthExceeded):
        plan(UNIFIED, 5000, None, policy=CapPolicy.clamp)


def test_overlong_cap_rejected_with_numbers() -> None:
    with pytest.raises(ContextLengthExceeded) as info:
        plan(PER_SLOT, 1900, 300)
    msg = info.value.message
    assert "1900" in msg and "300" in msg and "2048" in msg and info.value.param == "max_tokens"


def test_overlong_cap_clamped_under_clamp_policy() -> None:
    c = plan(PER_SLOT, 1900, 300, policy=CapPolicy.clamp)
    assert c.max_tokens == 147 and c.clamped


def test_n_takes_n_slots_and_n_reservations() -> None:
    c = plan(PER_SLOT, 100, 100, n=3)
    assert c.slots == 3 and c.tokens == 600
    with pytest.raises(InvalidRequest):
        plan(PER_SLOT, 100, 100, n=4)
    with pytest.raises(ContextLengthExceeded):  # 2 × 1500 > pool of 2048
        plan(UNIFIED, 500, 1000, n=2)


def test_unified_pool_limits_concurrency() -> None:
    # The documented failure: 3 chats of ~790 prompt + 900 cap on -c 2048.
    c = plan(UNIFIED, 790, 900)
    b = reserve(Budget(), c)
    assert not fits(UNIFIED, b, c)  # 3380 > 2048 although 3 slots are free
    # P02: -c 4096 unified, 1500 + 500 each: two fit, the third waits.
    layout = Layout(4, 4096, pool_tokens=4096)
    c2 = plan(layout, 1500, 500)
    b2 = reserve(reserve(Budget(), c2), c2)
    assert b2.reserved_tokens == 4000 and not fits(layout, b2, c2)


def test_per_slot_layout_limits_only_slots() -> None:
    c = plan(PER_SLOT, 1500, 500)
    b = Budget()
    for _ in range(3):
        assert fits(PER_SLOT, b, c)
        b = reserve(b, c)
    assert not fits(PER_SLOT, b, c)


def test_p01_per_slot_context_from_np() -> None:
    # -c 8192 -np 4: 2048 per slot; 1900 + 300 can never fit, 4 × (1500 + 500) run together.
    layout = Layout(4, 2048)
    with pytest.raises(ContextLengthExceeded):
        plan(layout, 1900, 300)
    c = plan(layout, 1500, 500)
    b = Budget()
    for _ in range(4):
        assert fits(layout, b, c)
        b = reserve(b, c)
    assert not fits(layout, b, c)


def test_release_underflow_is_an_error() -> None:
    with pytest.raises(ValueError):
        release(Budget(), Charge(1, 1))


# vLLM (kind "vllm"): paged blocks, strict prompt + max_tokens <= max_model_len.
VLLM = Layout(slots=16, ctx_per_slot=8192, pool_tokens=20_000, block_size=16, stop_margin=0)


def test_p09_vllm_limit_is_strict_with_no_token_kept_back() -> None:
    # shared case P09: --max-model-len 8192; 4192 + 4000 is exactly 8192 and is admitted.
    c = plan(VLLM, 4192, 4000)
    assert (c.max_tokens, c.clamped) == (4000, False)
    with pytest.raises(ContextLengthExceeded) as info:  # 4200 + 4000 = 8200: refused
        plan(VLLM, 4200, 4000)
    assert "8200" in info.value.message and "3992" in info.value.message
    c = plan(VLLM, 4200, 4000, policy=CapPolicy.clamp)  # or clamped, before queueing
    assert (c.max_tokens, c.clamped) == (3992, True)
    assert plan(Layout(4, 2048, 2048, stop_margin=0), 2047, 1).max_tokens == 1  # 2047+1 fits
    with pytest.raises(ContextLengthExceeded):
        plan(Layout(4, 2048, 2048, stop_margin=0), 2048, 1)  # 2048+1 does not


def test_vllm_reservation_is_whole_blocks() -> None:
    c = plan(VLLM, 3000, 1500)
    assert c.tokens == 4512 == 282 * 16  # ceil(4500 / 16) blocks
    assert plan(VLLM, 3000, 1504).tokens == 4512  # already a whole number of blocks
    budget = Budget()
    admitted = 0
    for _ in range(6):  # shared case P10: 6 × (3000 + 1500) on a 20,000-token pool
        if fits(VLLM, budget, c):
            budget, admitted = reserve(budget, c), admitted + 1
    assert admitted == 4 and budget.reserved_tokens == 4 * 4512


def test_vllm_missing_cap_defaults_to_room_left_clamped_by_default() -> None:
    assert plan(VLLM, 8000, None).max_tokens == 192  # room left: 8192 - 8000
    assert plan(VLLM, 100, None).max_tokens == 1024  # default_max_tokens


def test_fits_alone_after_layout_shrinks() -> None:
    c = plan(UNIFIED, 1000, 900)
    assert fits_alone(UNIFIED, c)
    assert not fits_alone(Layout(4, 1024, pool_tokens=1024), c)


# --- properties ---------------------------------------------------------------

layouts = st.builds(
    lambda slots, ctx, extra, unified, block, margin: Layout(
        slots, ctx, ctx + extra if unified else None, block_size=block, stop_margin=margin),
    st.integers(1, 8), st.integers(2, 8192), st.integers(0, 8192), st.booleans(),
    st.sampled_from([1, 1, 16, 32, 7]), st.sampled_from([0, 1]),
)


@given(layouts, st.integers(0, 10_000), st.one_of(st.none(), st.integers(1, 10_000)),
       st.integers(1, 4), st.sampled_from(list(CapPolicy)))
def test_planned_charge_always_fits_an_idle_backend(
    layout: Layout, prompt: int, cap: int | None, n: int, policy: CapPolicy
) -> None:
    try:
        c = plan_charge(layout, prompt, cap, n=n, default_max_tokens=1024, policy=policy)
    except (ContextLengthExceeded, InvalidRequest):
        return
    assert c.max_tokens >= 1
    assert c.prompt_tokens + c.max_tokens <= layout.ctx_per_slot - layout.stop_margin
    assert c.tokens % layout.block_size == 0
    assert c.n * (c.prompt_tokens + c.max_tokens) <= c.tokens
    assert c.tokens < c.n * (c.prompt_tokens + c.max_tokens + layout.block_size)
    assert fits(layout, Budget(), c)
    if cap is not None and not c.clamped:
        assert c.max_tokens == cap


@settings(max_examples=300)
@given(layouts, st.lists(st.tuples(st.integers(0, 4000), st.integers(1, 4000), st.booleans()),
                         max_size=40))
def test_reserving_only_what_fits_never_exceeds_capacity(
    layout: Layout, ops: list[tuple[int, int, bool]]
) -> None:
    budget, held = Budget(), []
    for prompt, cap, finish in ops:
        if finish and held:
            budget = release(budget, held.pop(0))
            continue
        c = Charge(prompt, cap, block_size=layout.block_size)
        if fits(layout, budget, c):
            budget = reserve(budget, c)
            held.append(c)
        assert budget.reserved_tokens <= layout.capacity_tokens
        assert budget.busy_slots <= layout.slots
    for c in held:
        budget = release(budget, c)
    assert budget == Budget()
