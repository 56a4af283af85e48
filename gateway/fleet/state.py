"""What every request handler needs, built once per app by :func:`gateway.http.app.create_app`."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

import httpx

from gateway.admission.admission import AdmissionStats, Clock
from gateway.admission.tenants import Tenants
from gateway.backends.target import Target
from gateway.config import (
    AdmissionSettings,
    BackendSettings,
    ConfigError,
    Settings,
    load_settings,
)
from gateway.errors import (
    BackendNotReady,
    GatewayError,
    ModelNotFound,
    ReloadRefused,
    RouteNotFound,
    ShuttingDown,
)
from gateway.fleet.pool import ModelQueue
from gateway.observe.metrics import GatewayMetrics

__all__ = ["GatewayState", "reload_config"]

log = logging.getLogger(__name__)


@dataclass
class GatewayState:
    """Settings, the upstream client, the clock, the backends and the metrics."""

    settings: Settings
    client: httpx.AsyncClient
    clock: Clock
    backends: dict[str, Target]
    metrics: GatewayMetrics = field(init=False)
    tenants: Tenants = field(init=False)  # who may call, and their quotas
    tasks: list[asyncio.Task[None]] = field(default_factory=list)
    draining: bool = False  # stopping: /ready is 503 and new requests are refused
    # Builds a backend from its settings (gateway.http.app.create_app); used by reload.
    make_target: Callable[[BackendSettings, AdmissionSettings], Target] | None = None
    config_path: str | None = None  # the TOML file a reload reads
    discovering: bool = False  # each backend runs its discovery loop
    retiring: list[Target] = field(default_factory=list)  # removed, finishing requests
    reload_lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    # Set when a drain runs out of time: requests in hand are cut, each stream with a
    # final error event (gateway.relay.response.ProxyResponse._cut_off).
    cut: asyncio.Event = field(default_factory=asyncio.Event)
    _queues: dict[tuple[str, ...], ModelQueue] = field(default_factory=dict)
    _old_queues: list[ModelQueue] = field(default_factory=list)  # retired, still serving
    _discovery: dict[int, asyncio.Task[None]] = field(default_factory=dict)
    _retirements: set[asyncio.Task[None]] = field(default_factory=set)

    def start_discovery(self, backend: Target) -> None:
        """Run ``backend``'s discovery loop in the background (when discovery is on)."""
        if self.discovering:
            task = asyncio.create_task(backend.run_discovery())
            self._discovery[id(backend)] = task
            self.tasks.append(task)

    async def reload(self, new: Settings, *, first_look_s: float = 5.0) -> list[str]:
        """Apply ``new`` settings without a restart: backends added start taking
        requests once discovered; backends removed or changed stop taking new ones,
        finish what they hold (leases taken under the old layout stay theirs), and are
        then closed; a changed backend's new version takes its place. New versions are
        discovered first (for up to ``first_look_s`` seconds), so that the swap leaves no
        moment without a ready backend. Unchanged backends keep their state (queue,
        leases, health).

        :returns: one line per change.
        :raises ReloadRefused: ``[server]``, ``[admission]`` or ``[[classes]]`` changed
            (they take effect only at a restart); nothing is applied. Tenants (keys,
            classes, weights, quotas) are applied at once.
        """
        running = self.settings.server
        listen = {"host": running.host, "port": running.port}  # may come from the CLI
        if (new.server.model_copy(update=listen) != running
                or new.admission != self.settings.admission
                or new.classes != self.settings.classes):
            section = ("admission" if new.admission != self.settings.admission else
                       "[classes]" if new.classes != self.settings.classes else "server")
            raise ReloadRefused(f"[{section}] differs from the running configuration; it "
                                "takes effect only at a restart. Nothing was reloaded.")
        moved = [k for k in ("host", "port") if getattr(new.server, k) != listen[k]]
        new = new.model_copy(update={"server": running})
        assert self.make_target is not None
        changes: list[str] = []
        fresh: dict[str, Target] = {}
        built: list[Target] = []
        for entry in new.backends:
            old = self.backends.get(entry.name)
            if old is not None and old.settings == entry:
                fresh[entry.name] = old
                continue
            if old is not None and old.same_server(entry):
                # The same server: keep its budget (what it holds now) and queue.
                old.reconfigure(entry)
                fresh[entry.name] = old
                changes.append(f"changed backend {entry.name}")
                continue
            changes.append(f"{'changed' if old else 'added'} backend {entry.name}")
            fresh[entry.name] = self.make_target(entry, new.admission)
            built.append(fresh[entry.name])
        if self.discovering and built:
            looks = [asyncio.ensure_future(_first_look(b)) for b in built]
            await asyncio.wait(looks, timeout=first_look_s)
            for look in looks:
                look.cancel()
        for target in built:
            old = self.backends.get(target.name)
            if old is not None:
                self._retire(old)
            self.start_discovery(target)
        for name, old in self.backends.items():
            if name not in fresh:
                self._retire(old)
                changes.append(f"removed backend {name}")
        if new.routing != self.settings.routing:
            changes.append("routing settings")
        if new.tenants != self.settings.tenants:
            # Tenants of the same name keep their requests in hand and token window.
            self.tenants = Tenants(new, previous=self.tenants)
            changes.append("tenants")
            if not new.tenants:
                log.warning("reload: no [[tenants]] left; the gateway is now open to anyone "
                            "who can reach it")
                changes.append("no tenants left: the gateway is open to anyone")
        if moved:
            changes.append(f"not applied: server.{' and server.'.join(moved)} (the listening "
                           "address changes only at a restart)")
        kept = set(map(id, fresh.values()))
        names = tuple(fresh)
        self._old_queues = [q for q in self._old_queues if q.waiting]
        for key, queue in list(self._queues.items()):
            if (all(id(b) in kept for b in queue.members) and set(key) <= set(names)
                    and {b.model for b in queue.members} == {queue.model}):
                continue
            del self._queues[key]  # its members changed: new requests get a new queue
            queue.retire()
            if queue.waiting:
                self._old_queues.append(queue)
        for queue in self._queues.values():
            queue.failover = new.routing.failover
            queue.down_initial_s = new.routing.down_initial_s
            queue.down_max_s = new.routing.down_max_s
        self.backends, self.settings = fresh, new
        self.prime_metrics()
        return changes

    def prime_metrics(self) -> None:
        """Give the counters the alert rules read a zero series for every configured
        backend and tenant, in the tenant's own class (:meth:`GatewayMetrics.prime`)."""
        self.metrics.prime(list(self.backends),
                           [(t.name, t.priority) for t in self.tenants.by_name.values()])

    def _retire(self, backend: Target) -> None:
        backend.set_draining(True)
        self.retiring.append(backend)

        async def when_idle() -> None:
            while True:
                stats = backend.stats()
                if not (stats.inflight or stats.queued):
                    break
                await self.clock.sleep(0.5)
            task = self._discovery.pop(id(backend), None)
            if task is not None:
                task.cancel()
                await asyncio.gather(task, return_exceptions=True)
            await backend.close()
            for client in backend.owned_clients:
                await client.aclose()
            self.retiring.remove(backend)

        task = asyncio.ensure_future(when_idle())
        self._retirements.add(task)
        task.add_done_callback(self._retirements.discard)

    def models(self) -> dict[str, list[Target]]:
        """The backends of each model name, in configuration order. Backends whose
        model is not known yet join the only model there is, or stand alone (by their
        name) while several are known."""
        found: dict[str, list[Target]] = {}
        unknown = []
        for backend in self.backends.values():
            if backend.model_known:
                found.setdefault(backend.model, []).append(backend)
            else:
                unknown.append(backend)
        if len(found) == 1:
            next(iter(found.values())).extend(unknown)
        else:
            for backend in unknown:
                found.setdefault(backend.model, []).append(backend)
        return found

    async def drain(self) -> bool:
        """Stop taking requests and wait for those in hand: new ones get 503
        ``shutting_down`` (see :func:`gateway.request.plan.prepare_exchange`); queued ones
        are served, or refused at once with ``server.drain_queued = "refuse"``; then wait
        up to ``server.drain_timeout_s`` seconds for the queues to empty and the leases of
        clients' requests to be given back (reservations the slot watch holds for
        abandoned requests are not waited for).

        :returns: True when everything finished in time.
        """
        self.draining = True
        server = self.settings.server
        tenants = [*self.tenants.by_name.values(), *self.tenants.retired.values()]
        if server.drain_queued == "refuse":
            for waiting in (*(b.admission for b in self.backends.values()),
                            *self._queues.values(), *self._old_queues, *tenants):
                waiting.refuse_waiting(ShuttingDown(
                    "The gateway is shutting down; retry after the Retry-After delay.",
                    retry_after_s=1.0))
        deadline = self.clock.now() + server.drain_timeout_s
        while self.clock.now() < deadline:
            if not (any(s.queued or s.inflight - s.abandoned_held for _, s, _r in self.stats())
                    or any(q.waiting for q in (*self._queues.values(), *self._old_queues))
                    or any(t.waiting for t in tenants)):
                return True
            await self.clock.sleep(0.1)
        return False

    def stats(self) -> Iterable[tuple[str, AdmissionStats, bool]]:
        """Each backend's name, admission figures and readiness (for metrics)."""
        for name, backend in self.backends.items():
            yield name, backend.stats(), backend.ready

    def pool_queues(self) -> list[tuple[ModelQueue, float]]:
        """The shared queues of the models served by several backends (retired ones
        only while requests still wait there), each with how long its longest waiter
        has waited so far, seconds (0.0 when none waits). For the status page and the
        pool queue gauges."""
        return [(queue, queue.oldest_wait_s()) for queue in
                (*self._queues.values(), *(q for q in self._old_queues if q.waiting))]

    def pick_backend(self, model: object, kind: str | None = None,
                     route: str | None = None) -> Target:
        """The first backend :meth:`resolve` gives that is usable now, else its first.

        :raises RouteNotFound: as :meth:`resolve`.
        :raises ModelNotFound: as :meth:`resolve`.
        """
        members = self.resolve(model, kind, route)
        now = self.clock.now()
        return next((b for b in members if b.usable(now)), members[0])

    def resolve(self, model: object, kind: str | None = None,
                route: str | None = None) -> list[Target]:
        """The backends a request naming ``model`` may go to (of ``kind`` and serving
        ``route``, when given), in configuration order: see :mod:`gateway.fleet.pool`.

        :raises RouteNotFound: no backend of ``kind`` serving ``route`` is configured (404).
        :raises ModelNotFound: no backend serves ``model``, there is no
            ``routing.default_model``, and the backends serve more than one model (404).
        """
        def fits(backend: Target) -> bool:
            return ((kind is None or backend.kind == kind)
                    and (route is None or route in backend.dialect.route_paths))

        eligible = [b for b in self.backends.values() if fits(b)]
        for name in (model, self.settings.routing.default_model):
            if not isinstance(name, str):
                continue
            named = self.backends.get(name)
            if named is not None:
                if not fits(named):
                    raise RouteNotFound(f"Backend {named.name!r} (kind {named.kind}) does "
                                        "not serve this route.")
                return [named]
            # An alias stands for its model, on every backend of that model.
            stands_for = {b.model for b in self.backends.values() if name in b.model_names}
            if stands_for:
                pool = [b for b in eligible if b.model in stands_for]
                if not pool:
                    raise RouteNotFound(f"No backend of model {_shown(name)} serves this "
                                        "route.")
                return pool
        if not eligible:
            if kind is not None:
                raise RouteNotFound(f"This route needs a backend of kind {kind!r}; none "
                                    "is configured.")
            kinds = sorted({b.kind for b in self.backends.values()})
            raise RouteNotFound(f"No configured backend serves this route (backend kinds: "
                                f"{', '.join(kinds)}).")
        # Ollama loads whatever model a request names: one without a configured model
        # takes the names no other backend serves.
        open_ended = [b for b in eligible if b.kind == "ollama" and b.settings.model is None]
        if open_ended:
            return open_ended
        # A backend whose model is not known yet (not discovered, none configured) is
        # not counted as a model of its own.
        models = sorted({b.model for b in eligible if b.model_known})
        if len(models) <= 1:
            return eligible
        asked = ("This request names no model" if model is None
                 else f"The model {_shown(model)} is not served here")
        raise ModelNotFound(
            f"{asked}. Models: {', '.join(models)} (see GET /v1/models); "
            "routing.default_model names the one for requests that name none.",
            param="model")

    def usable(self, members: list[Target]) -> list[Target]:
        """The members new requests may go to now (ready, up, not draining:
        :meth:`Target.usable`).

        :raises BackendNotReady: none is (503, with the reason of the first).
        """
        now = self.clock.now()
        found = [b for b in members if b.usable(now)]
        if found:
            return found
        for backend in members:
            if not backend.ready:
                backend.request_rediscovery()
        first = members[0]
        if len(members) == 1 and not first.ready:
            why = first.problem or "unreachable, loading, or its capacity is not known yet"
            raise BackendNotReady(f"Backend {first.name!r} is not ready ({why}); retry "
                                  "after the Retry-After delay.", retry_after_s=1.0)
        states = "; ".join(
            f"{b.name}: " + ("draining" if b.draining else
                             f"down after a failure, for {b.health.down_until - now:.0f} s more"
                             if b.ready else (b.problem or "not ready"))
            for b in members)
        retry = min((max(1.0, b.health.down_until - now) for b in members if b.ready),
                    default=1.0)
        raise BackendNotReady(f"No backend of this model can take a request now ({states});"
                              " retry after the Retry-After delay.", retry_after_s=retry)

    def queue_for(self, members: list[Target]) -> ModelQueue | None:
        """The one queue shared by ``members`` when there are several, else ``None``
        (a lone backend queues in its own admission)."""
        if len(members) < 2:
            return None
        key = tuple(b.name for b in members)
        queue = self._queues.get(key)
        if queue is None:
            admission, routing = self.settings.admission, self.settings.routing
            model = members[0].model
            decisions = self.metrics.route_decisions
            queue = self._queues[key] = ModelQueue(
                members, max_queue=admission.max_queue,
                max_wait_s=admission.max_queue_wait_s, clock=self.clock, model=model,
                failover=routing.failover, down_initial_s=routing.down_initial_s,
                down_max_s=routing.down_max_s, age_s=admission.priority_age_s,
                on_route=lambda backend, reason: decisions.labels(
                    model, backend, reason).inc())
        return queue


def _shown(name: object) -> str:
    """A client-given name for an error message, cut to 80 characters."""
    text = repr(name)
    return text if len(text) <= 80 else text[:77] + "..."


async def _first_look(backend: Target) -> None:
    """Discover ``backend`` once; a failure is left to its discovery loop."""
    with contextlib.suppress(GatewayError):
        await backend.discover()


async def reload_config(state: GatewayState) -> list[str]:
    """Read the configuration file again and apply it (:meth:`GatewayState.reload`):
    the ``/admin/reload`` route and SIGHUP.

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
    changes = await state.reload(new)
    log.info("configuration reloaded from %s: %s", state.config_path,
             "; ".join(changes) or "no change")
    return changes
