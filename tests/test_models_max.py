"""The ``--models-max`` gate's decisions (gateway.core.models_max), pure: properties over
random routers, then the gate using them on the fake router."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from gateway.core.models_max import (
    Resident,
    Turn,
    needs_turn,
    released,
    turn,
    victims,
    wanting,
)

STATUSES = ("loaded", "loading", "unloaded", "sleeping")


@st.composite
def routers(draw: st.DrawFn) -> tuple[dict[str, Resident], int, set[str], set[str]]:
    """A snapshot of up to 6 models, ``--models-max``, the turns pending and the holds."""
    n = draw(st.integers(1, 6))
    models = {}
    for i in range(n):
        status = draw(st.sampled_from(STATUSES))
        running = status != "unloaded"
        models[f"m{i}"] = Resident(
            status, running, busy=draw(st.booleans()), member=draw(st.booleans()),
            granted=running and draw(st.booleans()), settled=draw(st.booleans()),
            used_at=draw(st.floats(0, 100)))
    limit = draw(st.integers(0, 4))
    sent = {i for i, e in models.items() if not e.running and draw(st.booleans())}
    holds = {i for i, e in models.items() if e.running and e.status != "loading"
             and e.member and draw(st.booleans())}
    return models, limit, sent, holds


@settings(max_examples=300, deadline=None)
@given(routers())
def test_a_request_waits_only_when_every_place_is_taken_and_none_is_idle(
        router: tuple[dict[str, Resident], int, set[str], set[str]]) -> None:
    models, limit, sent, _ = router
    running = [i for i, e in models.items() if e.running]
    pending = [i for i in sent if i not in running]
    for model_id, entry in models.items():
        decided = turn(model_id, models, limit, sent)
        # The gate's shortcut (no snapshot) agrees with the whole decision.
        assert needs_turn(entry.status, entry.running, limit, model_id in sent) == (
            decided is not Turn.GO)
        if entry.running or limit <= 0 or model_id in sent:
            assert decided is Turn.GO
        elif len(running) + len(pending) < limit:
            assert decided is Turn.TURN  # a place is free
        elif decided is Turn.TURN:  # only because a loaded model would make way
            assert any(models[i].status != "loading" and i not in pending
                       and (models[i].granted or not models[i].busy) for i in running)
        else:
            assert decided is Turn.WAIT
    assert turn("not listed", models, limit, sent) is Turn.GO


@settings(max_examples=300, deadline=None)
@given(routers())
def test_holds_are_only_settled_loaded_members_least_recently_used_and_no_more_than_needed(
        router: tuple[dict[str, Resident], int, set[str], set[str]]) -> None:
    models, limit, _, holds = router
    waiting = wanting(models)
    chosen = victims(models, waiting, limit, holds)
    assert len(set(chosen)) == len(chosen)
    for victim in chosen:
        entry = models[victim]
        assert entry.running and entry.status != "loading" and entry.member
        assert entry.settled and victim not in holds
    if limit <= 0 or not waiting:
        assert chosen == []
        return
    running = [i for i, e in models.items() if e.running]
    up = [i for i in running if models[i].status != "loading"]
    idle = [i for i in up if i not in holds and not models[i].busy]
    deficit = len(waiting) - (limit - len(running)) - len(idle) - len(holds)
    candidates = [i for i in up if i not in holds and models[i].member and models[i].settled]
    assert len(chosen) == max(0, min(deficit, len(candidates)))
    left = [i for i in candidates if i not in chosen]
    assert all(models[c].used_at <= models[o].used_at for c in chosen for o in left)


def test_wanting_is_the_members_not_running_with_work_in_order() -> None:
    models = {"a": Resident("unloaded", False, busy=True),
              "b": Resident("loaded", True, busy=True),
              "c": Resident("unloaded", False, busy=False),
              "d": Resident("unloaded", False, busy=True, member=False),
              "e": Resident("unloaded", False, busy=True)}
    assert wanting(models) == ["a", "e"]


def test_a_hold_is_let_go_once_its_model_is_unloaded_or_nothing_waits() -> None:
    models = {"a": Resident("loaded", True), "b": Resident("unloaded", False)}
    assert released(["a", "b"], models, ["x"]) == ["b"]
    assert released(["a"], models, []) == ["a"]
    assert released(["gone"], models, ["x"]) == ["gone"]


def test_two_busy_models_at_the_limit_of_two_hold_the_least_recently_used_for_a_third() -> None:
    models = {"a": Resident("loaded", True, busy=True, used_at=5.0),
              "b": Resident("loaded", True, busy=True, used_at=2.0),
              "c": Resident("unloaded", False, busy=True)}
    assert turn("c", models, 2, set()) is Turn.WAIT
    assert victims(models, wanting(models), 2, set()) == ["b"]
    held = {**models, "b": Resident("loaded", True, busy=True, granted=True, used_at=2.0)}
    assert turn("c", held, 2, set()) is Turn.TURN  # b runs nothing now: the router unloads it
    assert victims(held, wanting(held), 2, {"b"}) == []  # one hold is enough
