"""``--models-max`` of a llama-server router: the gateway's decisions, pure (no I/O, no
async). :class:`gateway.backends.router_gate.ModelsMaxGate` reads the router's
``/models`` and its members' admissions into a snapshot (one :class:`Resident` per
model) and acts on what these functions decide: whether a request may reach the router
now (:func:`turn`), which models wait to load (:func:`wanting`), which holds to let go
(:func:`released`) and which loaded models to hold (:func:`victims`).

The router's own rules they follow (``tools/server/server-models.cpp``): a model that is
not running loads once fewer than ``--models-max`` children run (``try_claim``); to make
room, the router unloads the least recently used model that is idle, with no request in
flight and none queued (``tick``, ``pick_victim``), and never one still loading
(``is_ready_or_sleep``). The module docstring of :mod:`gateway.backends.router_gate` says
why the gateway holds a busy model.
"""

from __future__ import annotations

import enum
from collections.abc import Collection, Mapping
from dataclasses import dataclass

__all__ = ["UNLISTED", "Resident", "Turn", "needs_turn", "released", "turn", "victims",
           "wanting"]

#: The status of a member the last ``/models`` read did not list (it needs no turn).
UNLISTED = "unlisted"


@dataclass(frozen=True)
class Resident:
    """One model of a router at one moment, as the gate sees it.

    :param status: its ``/models`` ``status.value`` (``loaded``, ``loading``,
        ``unloaded``, ``sleeping``, ...), or :data:`UNLISTED`.
    :param running: it holds one of the ``--models-max`` places (loaded, loading or
        sleeping).
    :param busy: the gateway has work on it: a request in flight or queued (a hold's own
        lease aside), a count under way or waiting for its turn, or one planned a moment
        ago.
    :param member: the gateway has a member backend for it (only those are held).
    :param granted: a hold on it has all its slots: it runs nothing, takes nothing.
    :param settled: loaded long enough to be held (at least its own load time).
    :param used_at: when a request was last planned on it, seconds on the gate's clock.
    """

    status: str
    running: bool
    busy: bool = False
    member: bool = True
    granted: bool = False
    settled: bool = True
    used_at: float = 0.0


class Turn(enum.Enum):
    """What :func:`turn` decides for a request of one model."""

    GO = "go"  # it runs, is not listed, there is no --models-max, or its turn was given
    TURN = "turn"  # it is given its turn now: it takes a place until it shows running
    WAIT = "wait"  # every place is taken or pending, and no loaded model is idle


def needs_turn(status: str, running: bool, max_instances: int, given: bool) -> bool:
    """A request for a model of ``status`` (``running``: it holds a place) must wait for
    a turn (:func:`turn`): it is listed, not running, under a ``--models-max``
    (``max_instances`` > 0), and not ``given`` one already. Decided from the model's own
    entry alone, before any snapshot of the others is taken."""
    return not (status == UNLISTED or running or max_instances <= 0 or given)


def turn(model_id: str, models: Mapping[str, Resident], max_instances: int,
         sent: Collection[str]) -> Turn:
    """Whether a request for ``model_id`` may reach the router now.

    :param models: the snapshot, by model id.
    :param max_instances: the router's ``--models-max`` (0 or less: no limit).
    :param sent: the models given a turn that have not shown running yet (each takes a
        place meanwhile).
    :returns: :attr:`Turn.TURN` when a place is free (none taken by a pending turn) or
        a loaded model is idle (no work in the gateway, or held with all its slots: the
        router unloads it); :attr:`Turn.GO` when no turn is needed.
    """
    entry = models.get(model_id)
    if entry is None or not needs_turn(entry.status, entry.running, max_instances,
                                       model_id in sent):
        return Turn.GO
    running = [i for i, e in models.items() if e.running]
    pending = [i for i in sent if i not in running]
    idle = [i for i in running if i not in pending and models[i].status != "loading"
            and (models[i].granted or not models[i].busy)]
    if max_instances - len(running) - len(pending) > 0 or idle:
        return Turn.TURN
    return Turn.WAIT


def wanting(models: Mapping[str, Resident]) -> list[str]:
    """The models that wait to load: members not running with work in the gateway, in
    the snapshot's order."""
    return [i for i, e in models.items() if e.member and not e.running and e.busy]


def released(holds: Collection[str], models: Mapping[str, Resident],
             waiting: Collection[str]) -> list[str]:
    """The holds to let go: the held model is no longer running (the router unloaded
    it), or no model waits to load any more."""
    return [i for i in holds if not (i in models and models[i].running) or not waiting]


def victims(models: Mapping[str, Resident], waiting: Collection[str], max_instances: int,
            holds: Collection[str]) -> list[str]:
    """The loaded models to hold now, least recently used first: as many as the models
    ``waiting`` to load outnumber the places that are free or will free (idle loaded
    models, which the router unloads itself, and the models already in ``holds``).
    Only a settled member that is loaded (not loading) and not already held is taken.

    :param max_instances: the router's ``--models-max`` (0 or less: none is held).
    """
    if max_instances <= 0 or not waiting:
        return []
    running = [i for i, e in models.items() if e.running]
    up = [i for i in running if models[i].status != "loading"]
    idle = [i for i in up if i not in holds and not models[i].busy]
    deficit = len(waiting) - (max_instances - len(running)) - len(idle) - len(holds)
    if deficit <= 0:
        return []
    chosen = sorted((i for i in up if i not in holds and models[i].member
                     and models[i].settled), key=lambda i: models[i].used_at)
    return chosen[:deficit]
