"""gateway.admission.lease.InFlight: the running sum of the slots held by the leases in
flight equals their sum, whatever the order of grants and releases."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from gateway.admission.lease import InFlight, Lease
from gateway.core.capacity import Charge

ops = st.lists(st.tuples(st.sampled_from(["put", "pop"]), st.integers(0, 5),
                         st.integers(1, 4)), max_size=60)


@given(ops)
def test_the_running_sum_is_the_sum(steps: list[tuple[str, int, int]]) -> None:
    active = InFlight()
    for op, key, n in steps:
        if op == "put":
            active[key] = Lease(Charge(10, 10, n=n))
        else:
            popped = active.pop(key)
            assert popped is None or popped.charge.slots >= 1
        assert active.slots == sum(lease.charge.slots for lease in active.values())


def test_pop_of_an_absent_lease_gives_the_default_and_changes_nothing() -> None:
    active = InFlight()
    active[1] = Lease(Charge(10, 10))
    assert active.pop(2) is None and active.slots == 1
