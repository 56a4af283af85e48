"""Goodput side by side: straight to the backend, through the gateway under ``strict``,
and through it under ``predictive``.

Two backends, one run each:

* **real**: llama-server (the cached build and Gemma 3 270M, ``-c 2048``: 4 slots
  sharing one pool of 2048 cells), on this machine's CPU, where a second decode stream
  costs almost as much as the first;
* **flat**: ``tests.fakes.FakeLlamaServer`` in-process, with the same layout and
  llama-server's overflow (every stream in flight fails once the pool is over), whose
  decode step costs the same whatever the batch size, as on a GPU.

Three workloads:

* ``short``: 16 completions of 6–7 prompt tokens that stop by themselves at the end of
  their first sentence (``"stop": ["."]``, 10–20 tokens), under ``max_tokens`` 1024.
  (This model's chat template never lets chats stop, so completions stand for them.)
* ``seed``: 3 requests of ~790 prompt tokens and 900 output tokens (the shared seed
  scenario): each fits alone, the three together overflow the pool.
* ``mixed``: 16 requests with random prompts (20–600 tokens) and random answers
  (short natural ones, and long ones that run to a random cap of 200–700).

Each target first serves the short workload once, unmeasured (so that ``predictive`` has
seen answers and the prompt cache is warm alike). For each run it prints wall time,
requests served, upstream 500s seen by clients, the gateway's preemptions and TTFT
p50/p95 (first streamed token), and the ratios to the direct and strict runs.

Usage: python bench/goodput.py [--backend real|flat|both] [--workload short,seed,mixed]
"""

from __future__ import annotations

import argparse
import asyncio
import random
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import uvicorn

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from prometheus_client import CollectorRegistry  # noqa: E402

from gateway.config import load_settings  # noqa: E402
from gateway.dev.localbackend import LlamaServer, free_port  # noqa: E402
from gateway.http.app import create_app, uvicorn_options  # noqa: E402
from tests.fakes import FakeLlamaServer  # noqa: E402

# Completions that end with their first sentence ("stop": ["."]): 10-20 tokens each
# in two probes here at 4 at a time (other openings, "The history of the city" or "A walk
# through the river", ran to their cap, and are left out: those are not short answers).
SUBJECTS = ["river", "mountain", "city", "garden", "library", "train", "kitchen", "forest",
            "ocean", "school", "market", "bridge", "castle", "island", "desert", "harbour"]
SHORT = [f"My first visit to the {s}" for s in SUBJECTS]
FILLER = ("the river runs past the old mill and the houses along the bank where the "
          "children play in summer and the boats wait for the tide ")  # ~30 tokens


@dataclass
class Run:
    """What one workload through one target gave."""

    wall_s: float = 0.0
    served: int = 0
    upstream_500: int = 0
    other_errors: int = 0
    preemptions: float = 0.0
    ttft: list[float] = field(default_factory=list)


def workload(name: str, flat: bool) -> list[dict[str, Any]]:
    """The request bodies of a workload (completions, streamed)."""
    rng = random.Random(7)
    if name == "short":
        return [{"prompt": p + (" answer=" + str(5 + (i * 7) % 16) if flat else ""),
                 "max_tokens": 1024, "temperature": 0, "stop": ["."]}
                for i, p in enumerate(SHORT)]
    if name == "seed":
        return [{"prompt": f"Story {i}: " + FILLER * 26 + (" answer=900" if flat else ""),
                 "max_tokens": 900, "temperature": 0, "ignore_eos": True}
                for i in range(3)]
    bodies = []
    for i in range(16):
        filler = FILLER * rng.randint(0, 20)
        if rng.random() < 0.6:
            p = rng.choice(SHORT)
            bodies.append({"prompt": filler + p + (f" answer={rng.randint(5, 20)}"
                                                   if flat else ""),
                           "max_tokens": 1024, "temperature": 0, "stop": ["."]})
        else:
            cap = rng.randint(200, 700)
            bodies.append({"prompt": f"Tale {i}: " + filler + (f" answer={cap}" if flat
                                                                else ""),
                           "max_tokens": cap, "temperature": 0, "ignore_eos": True})
    return bodies


async def one(client: httpx.AsyncClient, url: str, body: dict[str, Any], run: Run) -> None:
    t0 = time.monotonic()
    first = None
    async with client.stream("POST", url, json={**body, "stream": True}) as resp:
        if resp.status_code != 200:
            await resp.aread()
            if resp.status_code == 500:
                run.upstream_500 += 1
            else:
                run.other_errors += 1
            return
        failed = False
        async for line in resp.aiter_lines():
            if line.startswith("data: ") and '"error"' in line:
                failed = True
                if "exceeded" in line or '"code":500' in line.replace(" ", ""):
                    run.upstream_500 += 1
                else:
                    run.other_errors += 1
            elif first is None and line.startswith("data: ") and '"text"' in line:
                first = time.monotonic() - t0
        if not failed:
            run.served += 1
            if first is not None:
                run.ttft.append(first)


async def drive(client: httpx.AsyncClient, url: str, bodies: list[dict[str, Any]]) -> Run:
    run = Run()
    t0 = time.monotonic()
    await asyncio.gather(*(one(client, url, b, run) for b in bodies))
    run.wall_s = time.monotonic() - t0
    return run


def preemptions(registry: CollectorRegistry | None) -> float:
    if registry is None:
        return 0.0
    return sum(registry.get_sample_value("gateway_preemptions_total",
                                         {"backend": "local", "reason": r}) or 0.0
               for r in ("pool_pressure", "overflow"))


@contextmanager
def gateway_thread(settings: Any) -> Iterator[tuple[str, CollectorRegistry]]:
    """The gateway on a free port in a thread (its own event loop)."""
    registry = CollectorRegistry()
    port = free_port()
    config = uvicorn.Config(create_app(settings, registry=registry), host="127.0.0.1",
                            port=port, log_level="warning", **uvicorn_options(settings))
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    while not server.started:
        time.sleep(0.05)
    try:
        yield f"http://127.0.0.1:{port}", registry
    finally:
        server.should_exit = True
        thread.join(15)


def settings_for(url: str, policy: str) -> Any:
    return load_settings(
        admission={"policy": policy, "max_queue_wait_s": 600.0, "max_queue": 64},
        backends=[{"name": "local", "url": url}])


async def through(url: str, names: list[str], flat: bool, registry: Any) -> dict[str, Run]:
    out = {}
    async with httpx.AsyncClient(timeout=900) as client:
        await drive(client, url + "/v1/completions", workload("short", flat))  # warm-up
        for name in names:
            before = preemptions(registry)
            run = await drive(client, url + "/v1/completions", workload(name, flat))
            run.preemptions = preemptions(registry) - before
            out[name] = run
    return out


def real(names: list[str]) -> dict[str, dict[str, Run]]:
    results: dict[str, dict[str, Run]] = {}
    with LlamaServer(["-c", "2048"]).running() as server:
        results["direct"] = asyncio.run(through(server.url, names, False, None))
        for policy in ("strict", "predictive"):
            with gateway_thread(settings_for(server.url, policy)) as (url, registry):
                results[policy] = asyncio.run(through(url, names, False, registry))
    return results


def flat_fake() -> FakeLlamaServer:
    # 4 slots sharing 2048 cells; 20 ms per decode step whatever the batch (a GPU), and
    # prefill at 2,000 tokens/s.
    return FakeLlamaServer(slots=4, n_ctx=2048, pool=2048, token_delay=0.02,
                           tokens=10**6, queue_slots=True, prefill_s_per_token=0.0005)


def flat(names: list[str]) -> dict[str, dict[str, Run]]:
    results: dict[str, dict[str, Run]] = {}

    async def direct() -> dict[str, Run]:
        fake = flat_fake()
        out = {}
        async with httpx.AsyncClient(transport=fake.transport(), base_url="http://fake",
                                     timeout=900) as client:
            await drive(client, "/v1/completions", workload("short", True))
            for name in names:
                out[name] = await drive(client, "/v1/completions", workload(name, True))
        return out

    async def gated(policy: str) -> dict[str, Run]:
        fake = flat_fake()
        registry = CollectorRegistry()
        app = create_app(settings_for("http://fake", policy), http_client=fake.client(),
                         registry=registry)
        out = {}
        async with app.router.lifespan_context(app), httpx.AsyncClient(
                transport=httpx.ASGITransport(app=app), base_url="http://gw",
                timeout=900) as client:
            for _ in range(200):  # discovery runs in the lifespan: wait until it is done
                if app.state.gateway.backends["local"].ready:
                    break
                await asyncio.sleep(0.05)
            await drive(client, "/v1/completions", workload("short", True))
            for name in names:
                before = preemptions(registry)
                run = await drive(client, "/v1/completions", workload(name, True))
                run.preemptions = preemptions(registry) - before
                out[name] = run
        return out

    results["direct"] = asyncio.run(direct())
    for policy in ("strict", "predictive"):
        results[policy] = asyncio.run(gated(policy))
    return results


def pct(values: list[float], q: float) -> str:
    if not values:
        return "-"
    ordered = sorted(values)
    return f"{ordered[min(len(ordered) - 1, int(q * len(ordered)))]:.2f}"


def report(backend: str, results: dict[str, dict[str, Run]], names: list[str]) -> None:
    print(f"\n== {backend} backend ==")
    print(f"{'workload':8} {'target':11} {'wall s':>7} {'served':>7} {'500s':>5} "
          f"{'errors':>6} {'preempt':>7} {'ttft p50':>8} {'ttft p95':>8} "
          f"{'goodput/direct':>14} {'wall/strict':>11}")
    for name in names:
        direct = results["direct"][name]
        strict = results["strict"][name]
        for target in ("direct", "strict", "predictive"):
            run = results[target][name]
            goodput = (run.served / run.wall_s) if run.wall_s else 0.0
            base = (direct.served / direct.wall_s) if direct.wall_s and direct.served else 0
            ratio = f"{goodput / base:.2f}x" if base else "n/a (0 served)"
            print(f"{name:8} {target:11} {run.wall_s:7.1f} {run.served:4}/"
                  f"{run.served + run.upstream_500 + run.other_errors:<2} "
                  f"{run.upstream_500:5} {run.other_errors:6} {run.preemptions:7.0f} "
                  f"{pct(run.ttft, 0.5):>8} {pct(run.ttft, 0.95):>8} {ratio:>14} "
                  f"{run.wall_s / strict.wall_s if strict.wall_s else 0:10.2f}x")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--backend", choices=["real", "flat", "both"], default="both")
    parser.add_argument("--workload", default="short,seed,mixed")
    args = parser.parse_args()
    names = [n for n in args.workload.split(",") if n]
    if args.backend in ("flat", "both"):
        report("flat (constant-cost decode, fake)", flat(names), names)
    if args.backend in ("real", "both"):
        report("real (llama-server, CPU)", real(names), names)
    print("\ngoodput = requests served per second of wall time; 500s = upstream 500s that "
          "reached a client (a whole 500 or a streamed error event)")


if __name__ == "__main__":
    main()
