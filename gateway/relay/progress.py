"""What a stream that asked for progress hears before its answer begins.

A request with ``progress_s > 0`` may get its 200 and SSE headers early, then an SSE
comment every ``progress_s`` (clients ignore comments; proxies count them as traffic):

* ``: queued position=N eta_s=M`` while it waits for a lease (:func:`queued`);
* ``: processing prompt`` while the backend reads a long prompt: llama-server sends a
  stream's headers with its first token, so a long prefill sends nothing for minutes
  (:func:`begun`, shared case P13).

Both write through :class:`gateway.relay.send.Started`, which keeps a later response
start from being sent twice.
"""

from __future__ import annotations

import asyncio

import httpx

from gateway.admission.lease import Lease
from gateway.clock import Clock, wait
from gateway.relay.send import SSE_HEADERS, Started, body_message
from gateway.relay.watcher import DisconnectWatcher
from gateway.request.exchange import Exchange

__all__ = ["begun", "queued"]


async def queued(admit: asyncio.Future[Lease], x: Exchange, clock: Clock,
                 watcher: DisconnectWatcher, send: Started) -> Lease:
    """Wait for ``admit``'s lease while telling the client where ``x`` stands in the
    queue: the 200 and SSE headers first (unless a response started already), then a
    ``: queued`` comment every ``x.progress_s`` seconds on ``clock``.

    :raises GatewayError: as ``admit`` does (the admission's refusal).
    :raises ClientDisconnected: the client left meanwhile (``admit`` is left to the
        caller to cancel).
    """
    if send.can_open:
        await send.open(SSE_HEADERS + x.extra_headers)
    while True:
        try:  # the lease, or the next progress comment's time
            return await watcher.race(wait(clock, admit, x.progress_s))
        except TimeoutError:
            pass
        where = x.queue_progress()
        if where is not None and send.streaming:
            eta = "" if where[1] is None else f" eta_s={where[1]:.0f}"
            await send.raw(body_message(
                f": queued position={where[0]}{eta}\n\n".encode()))


async def begun(sending: asyncio.Future[httpx.Response], x: Exchange,
                progress: Started | None) -> httpx.Response:
    """Wait for the upstream answer ``sending`` to begin; meanwhile, when ``progress``
    is given, send the 200 (unless a response already started) and
    ``: processing prompt`` every ``x.progress_s`` seconds. Cancelling this wait leaves
    ``sending`` running.

    :raises GatewayError: as ``sending`` does (the upstream request's failure).
    """
    while True:
        done, _ = await asyncio.wait({sending}, timeout=x.progress_s or None)
        if done:
            return sending.result()
        if progress is None:
            continue
        try:
            if progress.can_open:
                await progress.open(SSE_HEADERS + x.extra_headers)
            if progress.streaming:
                await progress.raw(body_message(b": processing prompt\n\n"))
        except OSError:
            pass  # the client has gone; the caller notices
