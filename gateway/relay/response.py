"""Forward one admitted request upstream and relay the answer, holding its lease.

:class:`ProxyResponse` is an ASGI response. When called it:

1. waits for a lease in the backend's admission queue (leaving the queue, and
   forwarding nothing, if the client disconnects meanwhile:
   :class:`gateway.relay.admit.Admitter`);
2. runs an attempt on it through its strategy (:class:`gateway.relay.plain.PlainRelay`,
   or :class:`gateway.relay.tracked.TrackedRelay` for a tracked request), which sends
   the request upstream and relays the answer: JSON whole, SSE event by event;
3. asks the attempt what follows (:meth:`gateway.relay.attempt.Attempt.next_step`):
   stop, fail over to another backend, wait for room after a full backend's refusal,
   restart at the head of the queue (:mod:`gateway.relay.retry`), or resume a preempted
   answer (the strategy's);
4. releases each lease in ``finally`` whatever happened, and closes the upstream
   response so that llama-server cancels the task and frees the slot.

Until the status line is sent, failures become OpenAI-style JSON errors. After it, a
failure becomes one final ``data: {"error": …}`` event, and no ``[DONE]`` is invented.
"""

from __future__ import annotations

import httpx
from starlette.responses import Response
from starlette.types import Receive, Scope, Send

from gateway.clock import Clock
from gateway.fleet.tasks import TaskSet
from gateway.observe.metrics import GatewayMetrics
from gateway.observe.record import record_of
from gateway.relay.admit import Admitter
from gateway.relay.attempt import NextStep
from gateway.relay.parts import RelayParts, Strategy, StrategyFactory
from gateway.relay.plain import PlainRelay
from gateway.relay.retry import fail_over, requeue, restart
from gateway.relay.tracked import TrackedRelay
from gateway.relay.tries import Tries
from gateway.relay.usage import UsageBook
from gateway.relay.watcher import DisconnectWatcher
from gateway.request.exchange import Exchange
from gateway.tasks import Flag
from gateway.wire.naming import served_name

__all__ = ["ProxyResponse", "strategy_for"]


def strategy_for(x: Exchange) -> StrategyFactory:
    """The relay strategy request ``x`` asks for: tracked (followed token by token,
    preemptible) or plain."""
    return TrackedRelay if x.tracked else PlainRelay


class ProxyResponse(Response):
    """ASGI response that admits, forwards and relays one request (see module doc).

    :param exchange: the request, as planned.
    :param client: the HTTP client of its backend.
    :param metrics: the gateway's metrics.
    :param clock: the injected clock (seconds).
    :param cut: set when the gateway's drain runs out of time (work in hand is cut).
    :param tasks: the app's background tasks (a new set when not given).
    :param strategy: how each attempt runs (default: :func:`strategy_for` the request).
    """

    def __init__(
        self, exchange: Exchange, *, client: httpx.AsyncClient, metrics: GatewayMetrics,
        clock: Clock, cut: Flag | None = None, tasks: TaskSet | None = None,
        strategy: StrategyFactory | None = None,
    ) -> None:
        self.x = exchange
        self.metrics = metrics
        self.clock = clock
        self.cut = cut
        self.parts = RelayParts(
            x=exchange, client=client, metrics=metrics, clock=clock,
            tasks=TaskSet() if tasks is None else tasks,
            tries=Tries(exchange, metrics, clock),
            usage=UsageBook(exchange, metrics, clock),
            admitter=Admitter(exchange, metrics, clock),
        )
        self.strategy: Strategy = (strategy or strategy_for(exchange))(self.parts)
        self.background = None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        watcher = DisconnectWatcher(receive, self.cut)
        watcher.start()
        failed = False  # an unexpected error: the middleware answers 500 if it can
        try:
            await self._run(watcher, send)
        except Exception:
            failed = True
            raise
        finally:
            await watcher.stop()
            self.parts.admitter.leave()
            self.parts.usage.flush_gaps()  # the stream's last gaps
            self.parts.usage.settle(self.parts.tries.charged)
            self.parts.usage.attained()
            self._record(scope, failed)

    def _record(self, scope: Scope, failed: bool) -> None:
        """Write what happened on the request's access record: gateway.http.middleware
        counts the request with this status (499: client left), under the backend that
        took it (in a pool, known once admitted)."""
        x = self.x
        record = record_of(scope)
        if x.status or not failed:
            record.final_status = x.status or 499
        record.backend = x.backend.name
        record.queue_wait_s, record.ttft_s = x.queue_wait_s, x.ttft_s
        record.forwarded = self.parts.tries.forwarded
        record.upstream_error = x.upstream_error
        if x.reason is not None:
            record.reason = x.reason
        if x.trace is not None:
            usage = self.parts.usage
            x.trace.answered(served_name(x.backend.model), usage.reported_prompt,
                             usage.completion,
                             usage.finish_reasons)
            if record.final_status == 499:
                x.trace.event("gateway.client_left")
        self.metrics.duration.labels(x.backend.name).observe(self.clock.now() - x.started)

    async def _run(self, watcher: DisconnectWatcher, send: Send) -> None:
        """Obtain a lease, then run attempts until one's next step is to stop."""
        parts = self.parts
        lease, send = await parts.admitter.obtain(watcher, send)
        while lease is not None:
            await self.strategy.attempt(watcher, send, lease)
            step = parts.tries.now.next_step()
            if step is NextStep.STOP:
                return
            if step is NextStep.FAIL_OVER:
                lease = await fail_over(parts, watcher, send)
            elif step is NextStep.REQUEUE:
                lease = await requeue(parts, watcher, send)
            elif step is NextStep.RESTART:
                lease = await restart(parts, watcher, send)
            else:
                lease = await self.strategy.resume(watcher, send)
