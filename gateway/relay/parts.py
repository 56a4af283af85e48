"""What one request's response and its relay strategy share: :class:`RelayParts`, and
the :class:`Strategy` a response holds.

:class:`gateway.relay.response.ProxyResponse` obtains the lease and asks, after each
attempt, what to do next (:meth:`gateway.relay.attempt.Attempt.next_step`). How one
attempt goes upstream and reaches the client is its strategy's:
:class:`gateway.relay.plain.PlainRelay` (an answer relayed as the backend sends it) or
:class:`gateway.relay.tracked.TrackedRelay` (followed token by token, preempted and
resumed). Both are built from the same :class:`RelayParts`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import httpx
from starlette.types import Send

from gateway.admission.lease import Lease
from gateway.clock import Clock
from gateway.fleet.tasks import TaskSet
from gateway.observe.metrics import GatewayMetrics
from gateway.relay.admit import Admitter
from gateway.relay.tries import Tries
from gateway.relay.usage import UsageBook
from gateway.relay.watcher import DisconnectWatcher
from gateway.request.exchange import Exchange

__all__ = ["RelayParts", "Strategy", "StrategyFactory"]


@dataclass(eq=False)
class RelayParts:
    """The parts of one request's relay.

    :param x: the request.
    :param client: the HTTP client of its backend.
    :param metrics: the gateway's metrics.
    :param clock: the injected clock (seconds).
    :param tasks: the app's background tasks (a finished stream's tail is drained there).
    :param tries: its upstream attempts.
    :param usage: the tokens it used.
    :param admitter: how its leases are obtained (and its progress send, if any).
    """

    x: Exchange
    client: httpx.AsyncClient
    metrics: GatewayMetrics
    clock: Clock
    tasks: TaskSet
    tries: Tries
    usage: UsageBook
    admitter: Admitter


class Strategy(Protocol):
    """How a response runs each attempt of its request."""

    async def attempt(self, watcher: DisconnectWatcher, send: Send, lease: Lease) -> None:
        """Run one attempt on ``lease`` (started with :meth:`Tries.start`), relay what
        reaches the client, and give the lease back whatever happens; the attempt's
        :meth:`~gateway.relay.attempt.Attempt.next_step` then says what follows."""

    async def resume(self, watcher: DisconnectWatcher, send: Send) -> Lease | None:
        """After :attr:`~gateway.relay.attempt.NextStep.RESUME`: the lease to go on
        with, or ``None`` when the answer is over (the client was told why)."""


#: How a response builds its strategy from its parts.
StrategyFactory = Callable[[RelayParts], Strategy]
