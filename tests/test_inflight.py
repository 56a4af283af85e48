"""gateway.admission.lease.InFlight: the running sum of the slots held by the leases in
flight equals their sum, and the leases kept apart as targeted are those with an ITL
target, whatever the order of grants, targets and releases."""

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


target_ops = st.lists(st.tuples(st.sampled_from(["put", "pop", "target"]), st.integers(0, 5),
                                st.sampled_from([None, 0.02, 0.05])), max_size=60)


@given(target_ops)
def test_the_targeted_leases_are_those_with_a_target(
        steps: list[tuple[str, int, float | None]]) -> None:
    # Keyed by id(lease), as the admission keys them.
    active = InFlight()
    leases = [Lease(Charge(10, 10)) for _ in range(6)]  # some in flight, some not
    for op, index, target in steps:
        lease = leases[index]
        if op == "put":
            lease.itl_target_s = target
            active[id(lease)] = lease
        elif op == "pop":
            active.pop(id(lease))
        else:
            active.set_itl_target(lease, target)
        assert active.targeted == {k: lease for k, lease in active.items()
                                   if lease.itl_target_s is not None}
