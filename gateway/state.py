"""What every request handler needs, built once per app by :func:`gateway.app.create_app`."""

from __future__ import annotations

import asyncio
from collections.abc import Iterable
from dataclasses import dataclass, field

import httpx

from gateway.admission import AdmissionStats, Clock
from gateway.config import Settings
from gateway.errors import RouteNotFound, ShuttingDown
from gateway.metrics import GatewayMetrics
from gateway.target import Target

__all__ = ["GatewayState"]


@dataclass
class GatewayState:
    """Settings, the upstream client, the clock, the backends and the metrics."""

    settings: Settings
    client: httpx.AsyncClient
    clock: Clock
    backends: dict[str, Target]
    metrics: GatewayMetrics = field(init=False)
    tasks: list[asyncio.Task[None]] = field(default_factory=list)
    draining: bool = False  # stopping: /ready is 503 and new requests are refused

    async def drain(self) -> bool:
        """Stop taking requests and wait for those in hand: new ones get 503
        ``shutting_down`` (see :func:`gateway.pipeline.prepare_exchange`); queued ones
        are served, or refused at once with ``server.drain_queued = "refuse"``; then wait
        up to ``server.drain_timeout_s`` seconds for the queues to empty and the leases of
        clients' requests to be given back (reservations the slot watch holds for
        abandoned requests are not waited for).

        :returns: True when everything finished in time.
        """
        self.draining = True
        server = self.settings.server
        if server.drain_queued == "refuse":
            for backend in self.backends.values():
                backend.admission.refuse_waiting(ShuttingDown(
                    "The gateway is shutting down; retry after the Retry-After delay.",
                    retry_after_s=1.0))
        deadline = self.clock.now() + server.drain_timeout_s
        while self.clock.now() < deadline:
            if not any(s.queued or s.inflight - s.abandoned_held for _, s, _r in self.stats()):
                return True
            await self.clock.sleep(0.1)
        return False

    def stats(self) -> Iterable[tuple[str, AdmissionStats, bool]]:
        """Each backend's name, admission figures and readiness (for metrics)."""
        for name, backend in self.backends.items():
            yield name, backend.stats(), backend.ready

    def pick_backend(self, model: object, kind: str | None = None,
                     route: str | None = None) -> Target:
        """The backend named like ``model``, else the first configured one (of ``kind``
        and serving ``route``, when given).

        :raises RouteNotFound: no backend of ``kind`` serving ``route`` is configured (404).
        """
        def fits(backend: Target) -> bool:
            return ((kind is None or backend.kind == kind)
                    and (route is None or route in backend.dialect.route_paths))

        named = self.backends.get(model) if isinstance(model, str) else None
        if named is not None:
            if not fits(named):
                raise RouteNotFound(f"Backend {named.name!r} (kind {named.kind}) does not "
                                    "serve this route.")
            return named
        for backend in self.backends.values():
            if fits(backend):
                return backend
        if kind is not None:
            raise RouteNotFound(f"This route needs a backend of kind {kind!r}; none is "
                                "configured.")
        kinds = sorted({b.kind for b in self.backends.values()})
        raise RouteNotFound(f"No configured backend serves this route (backend kinds: "
                            f"{', '.join(kinds)}).")
