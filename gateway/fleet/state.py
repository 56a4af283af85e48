"""What every request handler needs, built whole, once per app, by
:func:`gateway.http.app.create_app`: settings, the upstream client, the clock, the
:class:`~gateway.fleet.fleet.Fleet`, the tenants and the metrics, plus the app's
background tasks and its drain.

It is built in order (fleet, then the metrics reading the fleet's figures, then the
state), so no part is filled in after construction. A reload
(:mod:`gateway.fleet.reload`) replaces ``settings`` and ``tenants`` as a whole.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

import httpx

from gateway.admission.state import LOCAL_STATE, StateStore
from gateway.admission.tenants import Tenants
from gateway.clock import Clock
from gateway.config import Settings
from gateway.errors import ShuttingDown
from gateway.fleet.fleet import Fleet
from gateway.fleet.tasks import TaskSet
from gateway.observe.metrics import GatewayMetrics
from gateway.tasks import Flag

__all__ = ["GatewayState"]


@dataclass
class GatewayState:
    """The app's parts.

    :param settings: the running configuration (a reload replaces it).
    :param client: the upstream client.
    :param clock: time source, seconds.
    :param fleet: the backends and what they serve.
    :param tenants: who may call, and their quotas (a reload replaces it).
    :param metrics: the app's Prometheus metrics.
    :param tasks: the app's background tasks (discovery loops, retirements, and the
        relay's reading of finished streams' tails); the lifespan cancels them.
    :param config_path: the TOML file a reload reads (``None``: started without one).
    :param store: where admission state lives
        (:class:`~gateway.admission.state.StateStore`: memory, or Redis shared with
        other gateway processes); the lifespan starts and closes it.
    """

    settings: Settings
    client: httpx.AsyncClient
    clock: Clock
    fleet: Fleet
    tenants: Tenants
    metrics: GatewayMetrics
    tasks: TaskSet
    store: StateStore = LOCAL_STATE
    config_path: str | None = None
    draining: bool = False  # stopping: /ready is 503 and new requests are refused
    reload_lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    # Set when a drain runs out of time: requests in hand are cut, each stream with a
    # final error event (gateway.relay.plain.PlainRelay, which cuts it off).
    cut: Flag = field(default_factory=Flag)

    def prime_metrics(self) -> None:
        """Give the counters the alert rules read a zero series for every configured
        backend and tenant, in the tenant's own class (:meth:`GatewayMetrics.prime`)."""
        self.metrics.prime(list(self.fleet.backends),
                           [(t.name, t.priority) for t in self.tenants.by_name.values()])

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
            refusal = ShuttingDown(
                "The gateway is shutting down; retry after the Retry-After delay.",
                retry_after_s=1.0)
            self.fleet.refuse_waiting(refusal)
            for tenant in tenants:
                tenant.refuse_waiting(refusal)
        deadline = self.clock.now() + server.drain_timeout_s
        while self.clock.now() < deadline:
            if not (self.fleet.busy() or any(t.waiting for t in tenants)):
                return True
            await self.clock.sleep(0.1)
        return False

    def count_route(self, model: str, backend: str, reason: str) -> None:
        """Count one routing decision of a pool queue (``gateway_route_decisions_total``)."""
        self.metrics.route_decisions.labels(model, backend, reason).inc()
