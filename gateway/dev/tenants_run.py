"""Two tenants on one real llama-server: a batch job and interactive users (issue 10).

A batch tenant submits ``batch`` long requests at once; a moment later an interactive
tenant submits ``interactive`` short ones. The same scenario runs twice against the same
server, side by side in one run: through a gateway with the two tenants and classes
(``fair``), and through one without tenants (``fifo``, today's single FIFO queue). For
each interactive request it records the queue wait the gateway reports
(``x-queue-wait-ms``) and the time to its answer; for the batch requests, how long each
held its slot. Used by ``bench/tenants.py`` (prints the figures) and by
``tests/integration/test_tenants_real.py`` (checks them).
"""

from __future__ import annotations

import asyncio
import hashlib
import statistics
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import httpx

__all__ = ["BATCH_KEY", "WEB_KEY", "Outcome", "fair_settings", "gateway_at", "run_scenario"]

WEB_KEY = "sk-demo-web-interactive"
BATCH_KEY = "sk-demo-batch-nightly"


def _digest(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


def fair_settings(url: str, extra: dict[str, Any] | None = None) -> dict[str, Any]:
    """Config sections for the ``fair`` gateway: classes interactive and batch, tenants
    ``web`` (interactive) and ``batch`` (batch); ``extra`` adds a third tenant entry,
    given with its plain ``key`` (hashed here) and any quotas."""
    tenants = [
        {"name": "web", "key_hashes": [_digest(WEB_KEY)], "priority": "interactive"},
        {"name": "batch", "key_hashes": [_digest(BATCH_KEY)], "priority": "batch"},
    ]
    if extra is not None:
        entry = {k: v for k, v in extra.items() if k != "key"}
        tenants.append({**entry, "key_hashes": [_digest(extra["key"])]})
    return {
        "admission": {"max_queue": 64, "max_queue_wait_s": 600.0,
                      "reject_predicted_timeouts": False},
        "backends": [{"name": "local", "url": url}],
        "classes": [{"name": "interactive"}, {"name": "batch", "max_queue_wait_s": 900.0}],
        "tenants": tenants,
    }


@contextmanager
def gateway_at(sections: dict[str, Any]) -> Iterator[str]:
    """The gateway with ``sections`` on a free loopback port, in a thread; its URL."""
    import threading

    import uvicorn

    from gateway.config import load_settings
    from gateway.dev.localbackend import free_port
    from gateway.http.app import create_app, uvicorn_options

    settings = load_settings(**sections)
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(
        create_app(settings), host="127.0.0.1", port=port, log_level="warning",
        loop="asyncio", **{**uvicorn_options(settings), "timeout_graceful_shutdown": 2}))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        try:
            if httpx.get(url + "/ready", timeout=1).status_code == 200:
                break
        except httpx.HTTPError:
            pass
        time.sleep(0.1)
    try:
        yield url
    finally:
        server.should_exit = True
        thread.join(15)


@dataclass
class Outcome:
    """What one run measured (seconds)."""

    interactive_wait_s: list[float] = field(default_factory=list)  # x-queue-wait-ms
    interactive_total_s: list[float] = field(default_factory=list)  # send to answer
    interactive_status: list[int] = field(default_factory=list)
    batch_hold_s: list[float] = field(default_factory=list)  # answer time - queue wait
    batch_done_before_interactive: int = 0  # batch answers that ended before the last

    def summary(self) -> dict[str, float]:
        """Median and largest interactive wait, and the median batch hold."""
        return {
            "interactive_wait_p50_s": statistics.median(self.interactive_wait_s),
            "interactive_wait_max_s": max(self.interactive_wait_s),
            "interactive_total_max_s": max(self.interactive_total_s),
            "batch_hold_p50_s": statistics.median(self.batch_hold_s or [0.0]),
            "batch_hold_max_s": max(self.batch_hold_s or [0.0]),
            "batch_done_before_interactive": float(self.batch_done_before_interactive),
        }


async def run_scenario(url: str, *, batch: int = 40, interactive: int = 4,
                       batch_tokens: int = 48, interactive_tokens: int = 8,
                       keys: tuple[str | None, str | None] = (BATCH_KEY, WEB_KEY),
                       finish_batch: bool = False) -> Outcome:
    """Submit ``batch`` requests of ``batch_tokens`` tokens (``ignore_eos``) with the
    first key, then, once the gateway holds them, ``interactive`` requests of
    ``interactive_tokens`` with the second. Returns when every interactive request is
    answered and, with ``finish_batch``, every batch one too (else the rest are
    abandoned: the client closes them)."""
    out = Outcome()
    batch_key, web_key = keys
    interactive_done = asyncio.Event()

    def headers(key: str | None) -> dict[str, str]:
        return {} if key is None else {"authorization": f"Bearer {key}"}

    async with httpx.AsyncClient(timeout=900, limits=httpx.Limits(
            max_connections=batch + interactive + 4)) as client:
        endpoint = url + "/v1/chat/completions"

        async def one_batch(i: int) -> None:
            sent = time.monotonic()
            r = await client.post(endpoint, headers=headers(batch_key), json={
                "messages": [{"role": "user", "content": f"Batch item {i}: list every "
                              "river you know, one per line."}],
                "max_tokens": batch_tokens, "ignore_eos": True})
            if r.status_code == 200:
                wait = int(r.headers.get("x-queue-wait-ms", "0")) / 1000
                out.batch_hold_s.append(time.monotonic() - sent - wait)
                if not interactive_done.is_set():
                    out.batch_done_before_interactive += 1

        async def one_interactive(i: int) -> None:
            sent = time.monotonic()
            r = await client.post(endpoint, headers=headers(web_key), json={
                "messages": [{"role": "user", "content": f"Say hello to user {i}."}],
                "max_tokens": interactive_tokens})
            out.interactive_status.append(r.status_code)
            out.interactive_total_s.append(time.monotonic() - sent)
            out.interactive_wait_s.append(int(r.headers.get("x-queue-wait-ms", "0")) / 1000)

        jobs = [asyncio.ensure_future(one_batch(i)) for i in range(batch)]
        await asyncio.sleep(1.5)  # the gateway holds them all: some running, the rest queued
        await asyncio.gather(*(one_interactive(i) for i in range(interactive)))
        interactive_done.set()
        if finish_batch:
            await asyncio.gather(*jobs)
        else:
            for job in jobs:
                job.cancel()
            await asyncio.gather(*jobs, return_exceptions=True)
    return out
