"""Which backends exist and what they serve: the one owner of the running set.

A :class:`Fleet` holds the configured backends (by name, in configuration order), those a
reload removed or replaced that still finish requests (``retiring``), and the shared
queue of each pool (:class:`~gateway.fleet.pool.ModelQueue`). It answers where a request
naming a model may go (:meth:`Fleet.resolve`, :meth:`Fleet.usable`,
:meth:`Fleet.queue_for`), marks a backend down after a failure (:meth:`Fleet.mark_failed`),
and runs the backends' discovery loops and retirements as tasks of the app
(:class:`~gateway.fleet.tasks.TaskSet`). Reloads go through :mod:`gateway.fleet.reload`.
A llama-server router's models are backends of their own, kept by
:mod:`gateway.fleet.routers`; the router's own entry (its hub) serves nothing itself.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterable
from typing import Any

from gateway.admission.admission import Admission
from gateway.admission.lease import AdmissionStats
from gateway.admission.state import LOCAL_STATE, StateStore
from gateway.backends.target import Target
from gateway.clock import Clock
from gateway.config import AdmissionSettings, BackendSettings, RoutingSettings
from gateway.errors import BackendNotReady, ModelNotFound, RouteNotFound
from gateway.fleet.pool import LocalPoolGrantor, ModelQueue, PoolGrantor
from gateway.fleet.routers import adopt, refuse_for_routers, with_members
from gateway.fleet.tasks import TaskSet
from gateway.tasks import not_cancelled
from gateway.wire.naming import served_name

__all__ = ["Fleet", "MakeTarget", "RouteCounter"]

#: Builds a backend from its settings (the app factory's, with its clients).
MakeTarget = Callable[[BackendSettings, AdmissionSettings], Target]
#: Counts one routing decision: (model, backend name, reason), for
#: ``gateway_route_decisions_total``.
RouteCounter = Callable[[str, str, str], None]


class Fleet:
    """The running set of backends.

    :param backends: the configured backends by name, in configuration order.
    :param clock: time source, seconds.
    :param admission: ``[admission]`` (queue bounds of the pool queues; fixed until a
        restart).
    :param routing: ``[routing]`` (default model, failover, backoff); a reload replaces
        it (:meth:`replace`).
    :param make_target: builds the backend of a ``[[backends]]`` entry (reloads).
    :param tasks: the app's background tasks; discovery loops and retirements run there.
    :param discover: run each backend's discovery loop once :meth:`start` is called.
    :param store: where admission state lives
        (:class:`~gateway.admission.state.StateStore`): the members of a router's
        models are built over it.
    :param pool_grantor: makes the :class:`~gateway.fleet.pool.PoolGrantor` of each
        pool's queue (this process alone, or the queues every process shares).
    """

    def __init__(self, backends: dict[str, Target], *, clock: Clock,
                 admission: AdmissionSettings, routing: RoutingSettings,
                 make_target: MakeTarget, tasks: TaskSet, discover: bool = True,
                 store: StateStore = LOCAL_STATE,
                 pool_grantor: Callable[[], PoolGrantor] = LocalPoolGrantor) -> None:
        self.backends = backends
        self.clock = clock
        self.admission = admission
        self.routing = routing
        self.make_target = make_target
        self.tasks = tasks
        self.discover = discover
        self.store = store
        self.pool_grantor = pool_grantor
        self.retiring: list[Target] = []  # removed by a reload, finishing requests
        self._started = False  # the app's lifespan runs
        self._queues: dict[tuple[str, ...], ModelQueue] = {}
        self._old_queues: list[ModelQueue] = []  # retired by a reload, still serving
        self._discovery: dict[int, asyncio.Task[Any]] = {}
        for backend in backends.values():
            adopt(self, backend)

    # -- lifecycle ---------------------------------------------------------------------

    @property
    def discovering(self) -> bool:
        """Each backend runs its discovery loop (discovery is on and the app started)."""
        return self.discover and self._started

    def start(self) -> None:
        """The app started: run every backend's discovery loop (when discovery is on)."""
        self._started = True
        for backend in self.backends.values():
            self.start_discovery(backend)

    def start_discovery(self, backend: Target) -> None:
        """Run ``backend``'s discovery loop in the background (when discovering)."""
        if self.discovering:
            self._discovery[id(backend)] = self.tasks.spawn(backend.discovery.run())

    def build(self, entry: BackendSettings) -> Target:
        """A new backend for ``entry`` (not yet part of the fleet)."""
        return adopt(self, self.make_target(entry, self.admission))

    def retire(self, backend: Target) -> None:
        """Take ``backend`` out of service: it takes no new requests, finishes those it
        holds, and is then closed (its discovery stopped, its own clients closed); it is
        in :attr:`retiring` meanwhile."""
        backend.set_draining(True)
        self.retiring.append(backend)
        self.tasks.spawn(self._close_when_idle(backend))

    async def _close_when_idle(self, backend: Target) -> None:
        while not_cancelled():
            stats = backend.stats()
            if not (stats.inflight or stats.queued):
                break
            await self.clock.sleep(0.5)
        task = self._discovery.pop(id(backend), None)
        if task is not None:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
        await _close(backend)
        self.retiring.remove(backend)

    def replace(self, backends: dict[str, Target], routing: RoutingSettings) -> None:
        """Serve ``backends`` under ``routing`` from now on (a reload). A pool queue
        whose members changed is retired (new requests get a new queue; those waiting
        there stay until served); the others take the new routing settings."""
        backends = with_members(self, backends)  # a router's, with their hub
        kept = set(map(id, backends.values()))
        names = tuple(backends)
        for queue in self._old_queues:
            if not queue.waiting:
                queue.close()  # served its last waiter: nothing of it is needed
        self._old_queues = [q for q in self._old_queues if q.waiting]
        for key, queue in list(self._queues.items()):
            if (all(id(b) in kept for b in queue.members) and set(key) <= set(names)
                    and {b.model for b in queue.members} == {queue.model}):
                continue
            del self._queues[key]  # its members changed: new requests get a new queue
            queue.retire()
            if queue.waiting:
                self._old_queues.append(queue)
            else:
                queue.close()
        for queue in self._queues.values():
            queue.failover = routing.failover
            queue.down_initial_s = routing.down_initial_s
            queue.down_max_s = routing.down_max_s
        self.backends, self.routing = backends, routing

    async def close(self) -> None:
        """Close every backend, retiring ones included, and the clients each owns
        (shutdown, after the app's tasks are cancelled)."""
        for queue in (*self._queues.values(), *self._old_queues):
            queue.close()
        for backend in (*self.backends.values(), *self.retiring):
            await _close(backend)

    # -- what is served ----------------------------------------------------------------

    def models(self) -> dict[str, list[Target]]:
        """The backends of each model name, in configuration order. Backends whose
        model is not known yet join the only model there is, or stand alone (by their
        name) while several are known."""
        found: dict[str, list[Target]] = {}
        unknown = []
        for backend in self.backends.values():
            if backend.router.hub is not None:  # a router's hub: its members serve
                continue
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

    def pick(self, model: object, kind: str | None = None,
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
        :raises BackendNotReady: as :func:`~gateway.fleet.routers.refuse_for_routers`.
        """
        def fits(backend: Target) -> bool:
            return ((kind is None or backend.kind == kind)
                    and (route is None or route in backend.dialect.route_paths))

        serving = [b for b in self.backends.values() if b.router.hub is None]  # not hubs
        eligible = [b for b in serving if fits(b)]
        for name in (model, self.routing.default_model):
            if not isinstance(name, str):
                continue
            named = self.backends.get(name)
            if named is not None and named.router.hub is None:
                if not fits(named):
                    raise RouteNotFound(f"Backend {named.name!r} (kind {named.kind}) does "
                                        "not serve this route.")
                return [named]
            # An alias stands for its model, on every backend of that model.
            stands_for = {b.model for b in serving if name in b.model_names}
            if stands_for:
                pool = [b for b in eligible if b.model in stands_for]
                if not pool:
                    raise RouteNotFound(f"No backend of model {_shown(name)} serves this "
                                        "route.")
                return pool
        if not eligible:
            refuse_for_routers(self.backends.values(), kind, route)
            if kind is not None:
                raise RouteNotFound(f"This route needs a backend of kind {kind!r}; none "
                                    "is configured.")
            kinds = sorted({b.kind for b in serving})
            raise RouteNotFound(f"No configured backend serves this route (backend kinds: "
                                f"{', '.join(kinds)}).")
        # Ollama loads whatever model a request names: one without a configured model
        # takes the names no other backend serves.
        open_ended = [b for b in eligible if b.kind == "ollama" and b.settings.model is None]
        if open_ended:
            return open_ended
        # A backend whose model is not known yet (not discovered, none configured) is
        # not counted as a model of its own.
        models = sorted({served_name(b.model) for b in eligible if b.model_known})
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
                backend.discovery.request()
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

    def queue_for(self, members: list[Target],
                  on_route: RouteCounter | None = None) -> ModelQueue | None:
        """The one queue shared by ``members`` when there are several, else ``None``
        (a lone backend queues in its own admission). A queue made now reports each
        request it routes to ``on_route``."""
        if len(members) < 2:
            return None
        key = tuple(b.name for b in members)
        queue = self._queues.get(key)
        if queue is None:
            admission, routing = self.admission, self.routing
            model = members[0].model
            options: dict[str, Any] = dict(
                max_queue=admission.max_queue, max_wait_s=admission.max_queue_wait_s,
                clock=self.clock, model=model, failover=routing.failover,
                down_initial_s=routing.down_initial_s, down_max_s=routing.down_max_s,
                age_s=admission.priority_age_s, on_route=None if on_route is None else (
                    lambda backend, reason: on_route(model, backend, reason)))
            queue = self._queues[key] = ModelQueue(members, grantor=self.pool_grantor(),
                                                   **options)
        return queue

    def mark_failed(self, backend: Target, queue: ModelQueue | None = None) -> float:
        """A request failed on ``backend`` before any byte reached its client: mark it
        down for the ``routing`` backoff (:meth:`Target.request_failed`) and have
        ``queue`` (the pool queue the request came through, if any) look again once the
        backoff has passed, when nothing else would wake its waiters.

        :returns: how long the backend is down, seconds.
        """
        if queue is not None:  # the pool's own backoff, as the relay marks it
            return queue.backend_failed(backend)
        return backend.request_failed(self.routing.down_initial_s, self.routing.down_max_s)

    # -- drain -------------------------------------------------------------------------

    def refuse_waiting(self, exc: Exception) -> None:
        """Fail every request waiting in a backend's queue or a pool queue with ``exc``."""
        waiting: list[Admission | ModelQueue] = [b.admission for b in self.backends.values()]
        for queue in (*waiting, *self._queues.values(), *self._old_queues):
            queue.refuse_waiting(exc)

    def busy(self) -> bool:
        """Work in hand: a request queued or pausing (a backend refused it for want of
        room), or a client's lease (not the slot watch's, held for abandoned requests)."""
        return (any(s.queued or s.inflight - s.abandoned_held for _, s, _r in self.stats())
                or any(b.pausing for b in self.backends.values())
                or any(q.waiting for q in (*self._queues.values(), *self._old_queues)))


async def _close(backend: Target) -> None:
    """Stop ``backend``'s background work (its admission's and a router hub's loads and
    holds too) and close the clients it owns."""
    await backend.close()
    await backend.admission.close()
    if backend.router.hub is not None:
        await backend.router.hub.close()
    for client in backend.owned_clients:
        await client.aclose()


def _shown(name: object) -> str:
    """A client-given name for an error message, cut to 80 characters."""
    text = repr(name)
    return text if len(text) <= 80 else text[:77] + "..."
