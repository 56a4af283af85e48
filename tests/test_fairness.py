"""The pure queue order (gateway/core/fairness.py): classes with ageing, fair shares of KV
tokens between tenants, shedding. Unit and property tests; no I/O, no clock."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from gateway.core.fairness import FairQueue, Party

A = Party("a")
B = Party("b")


class Req:
    """A waiter (compared by identity, as the queues' waiters are)."""

    def __init__(self, name: str) -> None:
        self.name = name

    def __repr__(self) -> str:
        return self.name


def admit_all(q: FairQueue[Req], now: float = 0.0) -> list[str]:
    out = []
    while (head := q.head(now)) is not None:
        q.take(head)
        out.append(head.name)
    return out


def test_one_tenant_one_class_is_fifo() -> None:
    q: FairQueue[Req] = FairQueue()
    for i in range(5):
        q.push(Req(f"r{i}"), A, cost=10 * (5 - i), now=i)
    assert [r.name for r in q.order(10)] == ["r0", "r1", "r2", "r3", "r4"]
    assert admit_all(q, 10) == ["r0", "r1", "r2", "r3", "r4"]


def test_front_goes_first_then_higher_class_then_older() -> None:
    q: FairQueue[Req] = FairQueue(age_s=100)
    q.push(Req("batch"), Party("a", rank=1), 5, now=0)
    q.push(Req("interactive"), Party("a", rank=0), 5, now=1)
    q.push(Req("back"), Party("b", rank=1), 5, now=2, front=True)
    assert [r.name for r in q.order(3)] == ["back", "interactive", "batch"]


def test_ageing_raises_a_waiter_one_class_per_age_s() -> None:
    q: FairQueue[Req] = FairQueue(age_s=10)
    q.push(Req("old-batch"), Party("a", rank=1), 5, now=0)
    q.push(Req("new-interactive"), Party("b", rank=0), 5, now=5)
    assert q.head(9.9).name == "new-interactive"
    assert q.head(10.0).name == "old-batch"  # it now competes as interactive, and is older


def test_tenants_alternate_by_tokens_not_requests() -> None:
    q: FairQueue[Req] = FairQueue()
    for i in range(6):
        q.push(Req(f"a{i}"), A, cost=100, now=0)
        q.push(Req(f"b{i}"), B, cost=50, now=0)
    order = [r.name for r in q.order(0)]
    # b's requests cost half as much: b gets two for each of a's.
    assert order[:6] == ["a0", "b0", "b1", "a1", "b2", "b3"]


def test_a_weight_scales_the_share() -> None:
    q: FairQueue[Req] = FairQueue()
    heavy = Party("a", weight=3.0)
    for i in range(8):
        q.push(Req(f"a{i}"), heavy, cost=30, now=0)
        q.push(Req(f"b{i}"), B, cost=30, now=0)
    first8 = [r.name[0] for r in q.order(0)[:8]]
    assert first8.count("a") == 6 and first8.count("b") == 2


def test_a_newcomer_waits_behind_at_most_one_request_of_a_busy_tenant() -> None:
    q: FairQueue[Req] = FairQueue()
    for i in range(200):
        q.push(Req(f"a{i}"), A, cost=4000, now=0)
    for _ in range(37):
        q.take(q.head(0))
    q.push(Req("b0"), B, cost=50, now=1)
    assert q.order(1).index(next(r for r in q.order(1) if r.name == "b0")) <= 1


def test_idle_time_earns_no_credit() -> None:
    q: FairQueue[Req] = FairQueue()
    for i in range(10):  # b waits alone and is served a lot
        q.push(Req(f"b{i}"), B, cost=100, now=0)
    admit_all(q)
    for i in range(4):  # a, idle all along, arrives together with b's next requests
        q.push(Req(f"a{i}"), A, cost=100, now=1)
        q.push(Req(f"bb{i}"), B, cost=100, now=1)
    order = [r.name for r in q.order(1)]
    assert order[:4] in (["a0", "bb0", "a1", "bb1"], ["bb0", "a0", "bb1", "a1"])


def test_admissions_without_waiting_count_too() -> None:
    q: FairQueue[Req] = FairQueue()
    q.push(Req("b0"), B, 10, now=0)
    for _ in range(5):
        q.charge(A, 1000)  # a was admitted at once five times (on room b cannot use)
    q.push(Req("a0"), A, 10, now=1)
    q.push(Req("b1"), B, 10, now=1)
    assert [r.name for r in q.order(1)] == ["b0", "b1", "a0"]


def test_shed_picks_the_newest_of_the_lowest_class_below() -> None:
    q: FairQueue[Req] = FairQueue()
    q.push(Req("i"), Party("a", rank=0), 1, now=0)
    q.push(Req("b-old"), Party("a", rank=1), 1, now=1)
    q.push(Req("b-new"), Party("b", rank=1), 1, now=2)
    q.push(Req("bulk"), Party("a", rank=2), 1, now=0)
    assert q.shed_for(Party("c", rank=0)).name == "bulk"
    assert q.shed_for(Party("c", rank=1)).name == "bulk"
    assert q.shed_for(Party("c", rank=2)) is None  # nothing lower: refuse the newcomer
    q.remove(q.shed_for(Party("c", rank=0)))
    assert q.shed_for(Party("c", rank=0)).name == "b-new"


def test_ahead_of_leaves_the_queue_as_it_was() -> None:
    q: FairQueue[Req] = FairQueue()
    q.push(Req("a0"), A, 100, now=0)
    q.push(Req("a1"), A, 100, now=0)
    before = [r.name for r in q.order(0)]
    assert [r.name for r in q.ahead_of(B, 10, 0)] == ["a0"]
    assert [r.name for r in q.ahead_of(Party("a"), 10, 0)] == ["a0", "a1"]
    assert [r.name for r in q.order(0)] == before and len(q) == 2


# -- properties -------------------------------------------------------------------------

arrivals = st.lists(
    st.tuples(st.integers(0, 2),  # tenant
              st.integers(0, 2),  # class rank
              st.integers(1, 50),  # cost
              st.integers(1, 3)),  # arrivals in this step
    min_size=1, max_size=150)


def run_with_victim(steps: list[tuple[int, int, int, int]], age_s: float,
                    horizon: int) -> int | None:
    """A lowest-class request waits from step 0 while at least as many requests arrive
    as are admitted (one per step, a second of clock each); the step it is admitted at,
    or ``None`` within ``horizon`` steps."""
    q: FairQueue[Req] = FairQueue(age_s=age_s)
    victim = Req("victim")
    q.push(victim, Party("t0", rank=2), 50, now=0)
    for step in range(horizon):
        tenant, rank, cost, count = steps[step % len(steps)]
        for i in range(count):
            q.push(Req(f"s{step}.{i}"), Party(f"t{tenant}", rank=rank), cost, now=step)
        head = q.head(step)
        assert head is not None
        q.take(head)
        if head is victim:
            return step
    return None


@settings(max_examples=150, deadline=None)
@given(arrivals)
def test_every_waiter_is_eventually_admitted(steps: list[tuple[int, int, int, int]]) -> None:
    # It reaches the top class after 2 x age_s; there, each tenant ahead of it by
    # virtual time passes it at most (its lead / the smallest cost) more times.
    admitted = run_with_victim(steps, age_s=10, horizon=20 + 3 * 60 + 10)
    assert admitted is not None


def test_without_ageing_a_low_class_starves() -> None:
    # The same run with ageing effectively off: the property above can fail.
    steps = [(1, 0, 10, 2)]  # interactive requests keep coming, two a step
    assert run_with_victim(steps, age_s=1e9, horizon=500) is None
    assert run_with_victim(steps, age_s=10, horizon=500) is not None


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(1, 4096), min_size=2, max_size=60),
       st.lists(st.integers(1, 4096), min_size=2, max_size=60),
       st.integers(0, 5))
def test_two_waiting_tenants_stay_within_one_charge(costs_a: list[int], costs_b: list[int],
                                                     head_start: int) -> None:
    q: FairQueue[Req] = FairQueue()
    for cost in costs_a[:head_start]:  # a was served alone before b came
        q.charge(A, cost)
    for i, cost in enumerate(costs_a):
        q.push(Req(f"a{i}"), A, cost, now=0)
    for i, cost in enumerate(costs_b):
        q.push(Req(f"b{i}"), B, cost, now=0)
    cost_of = {f"a{i}": c for i, c in enumerate(costs_a)} | {
        f"b{i}": c for i, c in enumerate(costs_b)}
    largest = max(costs_a + costs_b)
    served = {"a": 0, "b": 0}
    left = {"a": len(costs_a), "b": len(costs_b)}
    while left["a"] and left["b"]:  # while both wait
        head = q.head(0)
        q.take(head)
        served[head.name[0]] += cost_of[head.name]
        left[head.name[0]] -= 1
        assert abs(served["a"] - served["b"]) <= largest, served


@settings(max_examples=100, deadline=None)
@given(st.lists(st.integers(1, 4096), min_size=1, max_size=200), st.integers(0, 199),
       st.integers(1, 4096))
def test_a_first_request_waits_at_most_one_admission(costs: list[int], served: int,
                                                     cost_b: int) -> None:
    q: FairQueue[Req] = FairQueue()
    for i, cost in enumerate(costs):
        q.push(Req(f"a{i}"), A, cost, now=0)
    for _ in range(min(served, len(costs) - 1)):
        q.take(q.head(0))
    q.push(Req("b"), B, cost_b, now=1)
    names = [r.name for r in q.order(1)]
    assert names.index("b") <= 1


def test_within_a_tenants_class_the_earliest_due_goes_first() -> None:
    """Due = arrival + TTFT deadline, or + the longest wait without one: deadlines pass
    requests that can wait longer, and a request without one is not passed for ever."""
    q: FairQueue[str] = FairQueue()
    q.push("patient", Party(max_wait_s=60.0), 10, 0.0)
    q.push("urgent", Party(max_wait_s=60.0, ttft_deadline_s=1.0), 10, 0.1)
    q.push("soon", Party(max_wait_s=60.0, ttft_deadline_s=5.0), 10, 0.2)
    assert q.order(0.3) == ["urgent", "soon", "patient"]
    q2: FairQueue[str] = FairQueue()
    q2.push("old", Party(max_wait_s=2.0), 10, 0.0)  # due at 2.0
    q2.push("later", Party(max_wait_s=2.0, ttft_deadline_s=5.0), 10, 0.5)  # due at 5.5
    q2.push("next", Party(max_wait_s=2.0), 10, 0.6)  # due at 2.6
    assert q2.order(1.0) == ["old", "next", "later"]


def test_a_request_due_sooner_does_not_slow_the_ageing_of_an_older_one() -> None:
    """A batch lane whose head is a fresh request due sooner still competes at the rank
    its oldest waiter has aged to."""
    q: FairQueue[str] = FairQueue(age_s=30.0)
    q.push("old batch", Party(tenant="a", rank=1, max_wait_s=600.0), 10, 0.0)
    q.push("new batch", Party(tenant="a", rank=1, max_wait_s=600.0, ttft_deadline_s=1.0),
           10, 29.0)
    q.push("interactive", Party(tenant="b", rank=0, max_wait_s=600.0), 10, 29.5)
    assert q.order(29.9)[0] == "interactive"  # nothing has aged a class yet
    assert q.order(31.0)[0] == "new batch"  # its lane aged to rank 0 with "old batch"
