"""A llama-server router's models as backends of the fleet: one *member* target per
model, kept in step with the router's ``GET /models`` (:mod:`gateway.backends.router`).

The configured entry is the router's *hub* (``target.router.hub``): a target whose
discovery answers :class:`~gateway.backends.base.ManyModels` becomes one (:func:`settle`,
which the fleet sets as each configured target's ``router.settle``). After each of its
discoveries :func:`sync_members` gives each model listed a member
named ``<hub>/<model id>`` serving that model, placed right after the hub, and retires
the members of models no longer listed (or of a hub that is no longer a router). Members
share the hub's clients and URL, and run no discovery loop of their own: the hub's reads
them all. A reload keeps the members of a hub it keeps (:func:`with_members`).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable
from functools import partial
from typing import Any, Protocol

from gateway.admission.state import StateStore
from gateway.backends.base import Discovered, ManyModels
from gateway.backends.llamacpp import ROUTER_OWN_PATHS
from gateway.backends.router import (
    RouterHub,
    RouterModel,
    RouterSideCalls,
    for_model,
    member_settings,
)
from gateway.backends.target import Target
from gateway.clock import Clock
from gateway.config import AdmissionSettings, BackendSettings
from gateway.errors import BackendNotReady, GatewayError, ModelNotFound

__all__ = ["MODELS_TIMEOUT_S", "Members", "adopt", "configured_model", "family", "has_routers",
           "listed_models", "listing", "member_target", "refuse_for_routers", "router_facts",
           "router_rows", "settle", "side_backend", "side_call", "sync_members",
           "with_members"]

MODELS_TIMEOUT_S = 5.0  # GET /v1/models waits this long for each backend's list

log = logging.getLogger(__name__)


class Members(Protocol):
    """What keeping a router's members needs of the fleet
    (:class:`gateway.fleet.fleet.Fleet` has it)."""

    backends: dict[str, Target]
    admission: AdmissionSettings
    clock: Clock
    store: StateStore

    def retire(self, backend: Target) -> None:
        """Take ``backend`` out of service once its requests finish."""
        ...


def adopt(fleet: Members, target: Target) -> Target:
    """Have ``target`` (a configured backend) become a router's hub when its discovery
    finds many models (:func:`settle`); returns it."""
    target.router.settle = partial(settle, fleet)
    return target


async def settle(fleet: Members, target: Target, found: Discovered | ManyModels
                 ) -> Discovered | None:
    """What ``target``'s discovery answer becomes (its
    :attr:`~gateway.backends.base.RouterRole.settle` in a fleet). Many models: the
    target is (or stays) the router's hub: ``/models`` read, the members kept
    (:func:`sync_members`) and given their layouts, then the ``--models-max`` gate
    (:meth:`~gateway.backends.router_gate.ModelsMaxGate.rebalance`); ``None``. One
    model: what was found, after the members of a hub that restarted as a single-model
    server are retired.

    :raises GatewayError: as :meth:`~gateway.backends.router.RouterHub.read`.
    """
    role = target.router
    if not isinstance(found, ManyModels):
        if role.hub is not None:  # a router restarted as a single-model server
            hub, role.hub = role.hub, None
            sync_members(fleet, target)
            await hub.close()
        return found
    if role.hub is None:
        log.info("backend %s is a llama-server router; each of its models is a backend "
                 "of its own, named %s/<model>", target.name, target.name)
        role.hub = RouterHub(target.name, target.dialect.side,  # type: ignore[attr-defined]
                             target.clock, target.discover)
        target.admission.set_layout(None)
    hub = role.hub
    hub.take_props(found.props)
    await hub.read()
    target.reachable, target.problem = True, None
    sync_members(fleet, target)
    hub.passing = True
    try:
        for member in list(hub.members.values()):
            try:
                await member.discover()
            except GatewayError as exc:
                log.debug("router %s: %s not ready: %s", target.name, member.name,
                          exc.message)
    finally:
        hub.passing = False
    hub.gate.rebalance()
    return None


def sync_members(fleet: Members, hub: Target) -> None:
    """Keep one member target per model of the router ``hub`` (after each of its
    discoveries): new models get a member placed after the hub, which the hub hands its
    layout; members of models gone, or of a hub no longer a router, retire; a member
    whose settings follow from changed hub settings or child arguments takes them in
    place (:meth:`Target.reconfigure <gateway.backends.target.Target.reconfigure>`)."""
    router = hub.router.hub
    current = {b.router.model_id: b for b in fleet.backends.values()
               if b.router.parent is hub}
    members: dict[str, Target] = {}
    for model_id, entry in (router.entries if router is not None else {}).items():
        assert router is not None
        wanted = member_settings(hub.settings, entry, router.unified(model_id))
        member = current.get(model_id)
        if member is None:
            member = member_target(fleet, hub, wanted, model_id)
        elif member.settings != wanted:
            member.reconfigure(wanted)
        members[model_id] = member
    for old_id, member in current.items():
        if old_id not in members:
            fleet.retire(member)
    ordered: dict[str, Target] = {}
    for name, backend in fleet.backends.items():
        if backend.router.parent is hub:
            continue
        ordered[name] = backend
        if backend is hub:
            ordered.update((m.name, m) for m in members.values())
    fleet.backends = ordered
    if router is not None:
        router.members = members


def member_target(fleet: Members, hub: Target, settings: BackendSettings,
                  model_id: str) -> Target:
    """The member target of ``model_id`` at router ``hub``: the hub's clients and URL,
    llama-server's dialect for that model (:class:`~gateway.backends.router.RouterModel`),
    its own admission (whose wait forecasts start after the model's predicted load,
    :meth:`~gateway.backends.router_gate.ModelsMaxGate.load_wait_s`), slot watch and
    count cache."""
    router = hub.router.hub
    assert router is not None
    side = RouterSideCalls(settings, hub.side_client, model_id)
    member = Target(settings, fleet.admission, hub.side_client, fleet.clock,
                    dialect=RouterModel(settings, side, router, model_id), client=hub.client,
                    store=fleet.store)
    member.router.parent, member.router.model_id = hub, model_id
    # Nothing of its queue starts before its model has loaded: every forecast waits for it.
    member.admission.forecast.startup_s = partial(router.gate.load_wait_s, model_id)
    return member


def with_members(fleet: Members, backends: dict[str, Target]) -> dict[str, Target]:
    """``backends`` (a reload's configured ones) with the members of each router hub
    among them, after their hub; the members of a hub not kept retire."""
    out: dict[str, Target] = {}
    for name, backend in backends.items():
        out[name] = backend
        if backend.router.hub is not None:
            out.update((m.name, m) for m in backend.router.hub.members.values())
    for backend in fleet.backends.values():
        if backend.router.parent is not None and out.get(backend.name) is not backend:
            fleet.retire(backend)
    return out


def router_rows(backends: Iterable[Target]) -> list[tuple[str, str, bool, int, float | None]]:
    """Each router member's (name, model state, held, holds placed, learned load seconds
    or ``None``), for metrics (:meth:`gateway.backends.router.RouterHub.rows`)."""
    return [row for b in backends if b.router.hub is not None for row in b.router.hub.rows()]


def refuse_for_routers(backends: Iterable[Target], kind: str | None, route: str | None
                       ) -> None:
    """When no backend but a llama-server router's hub could serve a request (of
    ``kind``, on ``route``): why not, as the error to answer.

    :raises BackendNotReady: a router's ``/models`` could not be read (503: its models
        are not known).
    :raises ModelNotFound: the routers list no model (404).
    """
    hubs = [b for b in backends if b.router.hub is not None
            and (kind is None or b.kind == kind)
            and (route is None or route in b.dialect.route_paths)]
    unread = [b for b in hubs if b.problem or not b.ready]
    if unread:
        raise BackendNotReady(
            f"Backend {unread[0].name!r} (a llama-server router) is not ready "
            f"({unread[0].problem or 'its models are not known yet'}); retry after the "
            "Retry-After delay.", retry_after_s=1.0)
    if hubs:
        raise ModelNotFound(f"The llama-server router {hubs[0].name!r} lists no models "
                            "(see GET /v1/models).", param="model")


# -- what the HTTP edge asks of router mode ---------------------------------------------


def has_routers(backends: Iterable[Target]) -> bool:
    """A llama-server router is among ``backends`` (a hub or a member): ``GET /models``
    is then the gateway's listing, not the router's own."""
    return any(b.router.hub is not None or b.router.model_id is not None for b in backends)


def listing(backends: Iterable[Target]) -> list[Target]:
    """The backends ``GET /v1/models`` asks: a router's hub for all its models, never
    its members."""
    return [b for b in backends if b.router.parent is None]


def configured_model(backend: Target) -> str | None:
    """The name ``GET /v1/models`` lists ``backend``'s model by, when configured
    (``None``: as the backend lists them; always for a router's hub). Asked once its
    list came back: a discovery meanwhile may have found it a router, or no longer one."""
    return backend.settings.model if backend.router.hub is None else None


async def listed_models(backend: Target, reload: bool = False) -> list[dict[str, Any]]:
    """``backend``'s own ``GET /v1/models`` entries, at most :data:`MODELS_TIMEOUT_S`;
    nothing when it does not answer. A llama-server router lists its models with their
    state (:meth:`gateway.backends.router.RouterHub.listed`), re-read from its presets
    first with ``reload`` (and its models' backends then synced at once)."""
    hub = backend.router.hub
    if hub is not None:
        listed = await hub.listed(reload=reload)
        if reload:
            backend.discovery.request()
        return listed
    try:
        resp = await backend.side_client.get(
            backend.url("/v1/models"), headers=backend.settings.auth_headers,
            timeout=min(MODELS_TIMEOUT_S, backend.settings.read_timeout_s))
        return [e for e in resp.json().get("data", []) if isinstance(e, dict)]
    except Exception:  # an unreachable or odd backend lists nothing
        return []


def family(backend: Target) -> tuple[Target, ...]:
    """``backend`` and, for a llama-server router's hub, the backends of its models
    (drained and undrained with it)."""
    hub = backend.router.hub
    return (backend, *(hub.members.values() if hub is not None else ()))


def side_backend(backends: Iterable[Target], pick: Callable[[], Target], named: bool,
                 path: str) -> Target:
    """Where a side call goes: the backend ``pick`` finds for its model, but what a
    llama-server router answers for itself as a whole (``ROUTER_OWN_PATHS``) goes to its
    hub; and a call that names no model (``named`` false) where no backend serves it
    by default goes to the only backend when it is a router listing no model (its own
    ``/props``, ``role: router``).

    :raises ModelNotFound: as ``pick``, unless that lone router takes the call.
    """
    try:
        picked = pick()
    except ModelNotFound:
        hubs = [b for b in backends if b.router.hub is not None]
        if named or len(hubs) != 1:
            raise
        return hubs[0]
    parent = picked.router.parent
    return parent if parent is not None and path in ROUTER_OWN_PATHS else picked


def side_call(backend: Target, method: str, target: str, body: bytes) -> tuple[str, bytes]:
    """The path and query, and the body, of a side call to ``backend``: for one model of
    a llama-server router, naming that model (:func:`gateway.backends.router.for_model`);
    otherwise as they came."""
    model_id = backend.router.model_id
    return (target, body) if model_id is None else for_model(model_id, method, target,
                                                              body)


def router_facts(backend: Target) -> dict[str, Any] | None:
    """What a llama-server router shows (:mod:`gateway.backends.router`), or ``None``.

    The router's hub: ``{"role": "router", "max_instances", "autoload", "models": {id:
    state}}``. One of its models (a member): ``{"role": "model", "router": hub name,
    "model_state": the router's status.value ("failed" after a failed load),
    "held_for": the model whose load it makes way for while it is held (takes no new
    request until the router unloads it; ``None`` otherwise), "load_s": its learned load
    time in seconds (``None`` until measured)}``.
    """
    if backend.router.hub is not None:
        hub = backend.router.hub
        return {"role": "router", "max_instances": hub.max_instances,
                "autoload": hub.autoload,
                "models": {i: e.state for i, e in hub.entries.items()}}
    parent, model_id = backend.router.parent, backend.router.model_id
    if parent is None or parent.router.hub is None or model_id is None:
        return None
    gate, entry = parent.router.hub.gate, parent.router.hub.entries.get(model_id)
    hold = gate.holds.get(model_id)
    load_s = gate.load_s.get(model_id)
    return {"role": "model", "router": parent.name,
            "model_state": entry.state if entry is not None else "gone",
            "held_for": hold.wanted if hold is not None else None,
            "load_s": None if load_s is None else round(load_s, 3)}
