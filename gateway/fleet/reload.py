"""Reloading the configuration without a restart: a diff, then an apply.

:func:`plan_reload` compares the running settings and backends with new settings and
returns a :class:`ReloadPlan`: one action per backend (kept, reconfigured in place, built
anew, removed) and the other changes, each with its line for the operator. It reads but
never changes anything, so a refused reload applies nothing. :func:`apply_reload` carries
a plan out on the app's state; :func:`reload` does both, and :func:`reload_config` reads
the file again first (``POST /admin/reload`` and SIGHUP).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Mapping
from dataclasses import dataclass
from enum import Enum

from gateway.admission.tenants import Tenants
from gateway.backends.target import Target
from gateway.config import BackendSettings, ConfigError, Settings, load_settings
from gateway.errors import GatewayError, ReloadRefused
from gateway.fleet.state import GatewayState

__all__ = ["Action", "BackendAction", "ReloadPlan", "apply_reload", "plan_reload", "reload",
           "reload_config"]

log = logging.getLogger(__name__)


class Action(Enum):
    """What a reload does to one backend."""

    keep = "keep"  # same settings: untouched (queue, leases, health kept)
    reconfigure = "reconfigure"  # the same server: new settings applied in place
    add = "add"  # a new backend, built and discovered
    replace = "replace"  # another server under the same name: built anew, the old retired
    remove = "remove"  # no longer configured: retired


@dataclass(frozen=True)
class BackendAction:
    """One backend's part of a reload.

    :param action: what is done.
    :param name: the backend's name.
    :param entry: its new ``[[backends]]`` entry (``None`` for :attr:`Action.remove`).
    """

    action: Action
    name: str
    entry: BackendSettings | None = None

    @property
    def line(self) -> str | None:
        """The line reported for it (``None`` for a backend kept as it is)."""
        return {Action.keep: None, Action.reconfigure: f"changed backend {self.name}",
                Action.add: f"added backend {self.name}",
                Action.replace: f"changed backend {self.name}",
                Action.remove: f"removed backend {self.name}"}[self.action]


@dataclass(frozen=True)
class ReloadPlan:
    """What a reload changes.

    :param settings: the settings to run with (the new ones, with the running
        ``[server]``: its listening address changes only at a restart).
    :param backends: one action per backend: the new entries in their order, then the
        removed backends in their old order.
    :param routing: ``[routing]`` changed.
    :param tenants: ``[[tenants]]`` changed (keys, classes, weights, quotas).
    :param moved: the ``[server]`` keys of the listening address that differ and are not
        applied (``host``, ``port``).
    """

    settings: Settings
    backends: tuple[BackendAction, ...]
    routing: bool = False
    tenants: bool = False
    moved: tuple[str, ...] = ()

    @property
    def changes(self) -> list[str]:
        """One line per change, as the reload reports them."""
        lines = [a.line for a in self.backends if a.line is not None]
        if self.routing:
            lines.append("routing settings")
        if self.tenants:
            lines.append("tenants")
            if not self.settings.tenants:
                lines.append("no tenants left: the gateway is open to anyone")
        if self.moved:
            lines.append(f"not applied: server.{' and server.'.join(self.moved)} (the "
                         "listening address changes only at a restart)")
        return lines


def plan_reload(running: Settings, new: Settings, backends: Mapping[str, Target]
                ) -> ReloadPlan:
    """The diff of ``running`` (with its ``backends``) and ``new``. Changes nothing.

    :raises ReloadRefused: ``[server]`` (but its listening address), ``[admission]`` or
        ``[[classes]]`` changed: they take effect only at a restart.
    """
    server = running.server
    listen = {"host": server.host, "port": server.port}  # may come from the CLI
    if (new.server.model_copy(update=listen) != server
            or new.admission != running.admission or new.classes != running.classes):
        section = ("admission" if new.admission != running.admission else
                   "[classes]" if new.classes != running.classes else "server")
        raise ReloadRefused(f"[{section}] differs from the running configuration; it "
                            "takes effect only at a restart. Nothing was reloaded.")
    moved = tuple(k for k in ("host", "port") if getattr(new.server, k) != listen[k])
    actions = []
    for entry in new.backends:
        old = backends.get(entry.name)
        if old is None:
            action = Action.add
        elif old.settings == entry:
            action = Action.keep
        elif old.same_server(entry):  # keep its budget (what it holds now) and queue
            action = Action.reconfigure
        else:
            action = Action.replace
        actions.append(BackendAction(action, entry.name, entry))
    configured = {entry.name for entry in new.backends}
    # A router's members (gateway.backends.router) are not configured: they come and go
    # with their hub.
    actions += [BackendAction(Action.remove, name) for name, b in backends.items()
                if name not in configured and b.router.parent is None]
    return ReloadPlan(new.model_copy(update={"server": server}), tuple(actions),
                      routing=new.routing != running.routing,
                      tenants=new.tenants != running.tenants, moved=moved)


async def apply_reload(state: GatewayState, plan: ReloadPlan, *,
                       first_look_s: float = 5.0) -> list[str]:
    """Carry ``plan`` out: backends added start taking requests once discovered;
    backends removed or replaced stop taking new ones, finish what they hold (leases
    taken under the old layout stay theirs), and are then closed; a replaced backend's
    new version takes its place. New versions are discovered first (for up to
    ``first_look_s`` seconds), so that the swap leaves no moment without a ready backend.
    Kept backends keep their state (queue, leases, health). Tenants of the same name
    keep their requests in hand and token window.

    :returns: one line per change (:attr:`ReloadPlan.changes`).
    """
    fleet = state.fleet
    fresh: dict[str, Target] = {}
    built: list[Target] = []
    for step in plan.backends:
        old, entry = fleet.backends.get(step.name), step.entry
        if step.action is Action.remove or entry is None:
            continue
        if old is not None and step.action is Action.keep:
            fresh[step.name] = old
        elif old is not None and step.action is Action.reconfigure:
            old.reconfigure(entry)
            fresh[step.name] = old
        else:
            fresh[step.name] = fleet.build(entry)
            built.append(fresh[step.name])
    if fleet.discovering and built:
        looks = [asyncio.ensure_future(_first_look(b)) for b in built]
        try:
            await asyncio.wait(looks, timeout=first_look_s)
        finally:  # (a reload cancelled meanwhile leaves none behind)
            for look in looks:
                look.cancel()
    for target in built:
        old = fleet.backends.get(target.name)
        if old is not None:
            fleet.retire(old)
        fleet.start_discovery(target)
    for step in plan.backends:
        if step.action is Action.remove:
            fleet.retire(fleet.backends[step.name])
    if plan.tenants:
        state.tenants = Tenants(plan.settings, previous=state.tenants,
                                quota_for=state.tenants.quota_for)
        if not plan.settings.tenants:
            log.warning("reload: no [[tenants]] left; the gateway is now open to anyone "
                        "who can reach it")
    fleet.replace(fresh, plan.settings.routing)
    state.settings = plan.settings
    state.prime_metrics()
    return plan.changes


async def reload(state: GatewayState, new: Settings, *, first_look_s: float = 5.0
                 ) -> list[str]:
    """Apply ``new`` settings without a restart (:func:`plan_reload`, then
    :func:`apply_reload`).

    :returns: one line per change.
    :raises ReloadRefused: ``[server]``, ``[admission]`` or ``[[classes]]`` changed
        (they take effect only at a restart); nothing is applied. Tenants (keys,
        classes, weights, quotas) are applied at once.
    """
    plan = plan_reload(state.settings, new, state.fleet.backends)
    return await apply_reload(state, plan, first_look_s=first_look_s)


async def _first_look(backend: Target) -> None:
    """Discover ``backend`` once; a failure is left to its discovery loop."""
    with contextlib.suppress(GatewayError):
        await backend.discover()


async def reload_config(state: GatewayState) -> list[str]:
    """Read the configuration file again and apply it (:func:`reload`): the
    ``/admin/reload`` route and SIGHUP.

    :returns: one line per change.
    :raises ReloadRefused: the gateway was started without a file, the file is not a
        valid configuration (the reason is given), or it changes what needs a restart;
        the running configuration stays.
    """
    async with state.reload_lock:  # one at a time: the last file read is applied last
        return await _reload_config(state)


async def _reload_config(state: GatewayState) -> list[str]:
    if state.config_path is None:
        raise ReloadRefused("The gateway was started without a configuration file; "
                            "there is nothing to reload.")
    try:
        new = load_settings(state.config_path)
    except ConfigError as exc:
        raise ReloadRefused(f"The configuration was not reloaded: {exc}") from None
    changes = await reload(state, new)
    log.info("configuration reloaded from %s: %s", state.config_path,
             "; ".join(changes) or "no change")
    return changes
