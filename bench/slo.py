"""Latency targets side by side on the real llama-server: each admission mode with and
without an ITL target, and the server direct, the same workload one after the other in
one run (issue 26's benchmark).

The backend is the cached llama-server build with Gemma 3 270M, ``-c 2048`` (4 slots
sharing one pool of 2048 cells), on this machine's CPU. The workload is ``--clients``
streamed completions of ``--tokens`` tokens each (``ignore_eos``), all sent at once,
``--rounds`` times; every third client's prompt is a long one (``--long-words`` words),
so that prefills land among the streams, as in a chat service.

1. **direct**: the clients on llama-server itself.
2. **strict**, **predictive**: the gateway under each ``admission.policy``, no target.
   The strict run also learns the server's ITL by busy slots, which gives the target:
   ``--target`` times the learned ITL p95 with two slots busy (1.25 by default: what two
   streams get, with a quarter to spare).
3. **strict+slo**, **predictive+slo**: a fresh gateway under each policy whose one class
   has that ``itl_p95_s``, prefill deferral off (``prefill_defer_s = 0``); one
   unmeasured round first, so that its limit has learnt where the target breaks.
4. **strict+slo+hold**, **predictive+slo+hold**: the same with ``prefill_defer_s =
   --defer`` (2 s by default): a long prompt is held back while the streams decode.

With ``--stagger S``, client ``i`` of a round starts ``i × S`` seconds after the first,
so that long prompts arrive while earlier streams decode (a chat service's arrivals).

For each it prints wall time, goodput (tokens streamed per second of wall time),
refusals (answers other than 200), failures (streams that began and ended on an error
event: llama-server's own context overflow, directly), the client-side ITL p50 / p95 / max and
TTFT p50 / p95 (queue wait included), the gaps over twice the median ITL (the stalls a
chat window shows), the SLO limit at the end and the requests held back for their prefill;
then each run's ratios to strict.

Usage: python bench/slo.py [--clients 6] [--tokens 120] [--rounds 2] [--target 1.25]
       [--long-words 300] [--defer 2.0] [--stagger 0.0]
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from goodput import gateway_thread  # noqa: E402  (bench/, this script's folder)
from prometheus_client import CollectorRegistry  # noqa: E402

from gateway.config import load_settings  # noqa: E402
from gateway.dev.localbackend import NO_KEEPALIVE, LlamaServer  # noqa: E402


@dataclass
class Run:
    """What one gateway's measured rounds gave."""

    wall_s: float = 0.0
    tokens: int = 0
    refused: int = 0
    failed: int = 0  # streams that began (200) and ended on an error event
    gaps: list[float] = field(default_factory=list)
    ttfts: list[float] = field(default_factory=list)
    limit: float = 0.0
    held: float = 0.0  # requests whose prefill was deferred (gateway_prefill_deferred_total)


def quantile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(q * len(ordered)) - 1))]


async def one(client: httpx.AsyncClient, url: str, i: int, tokens: int, run: Run,
              long_words: int, stagger_s: float = 0.0) -> None:
    await asyncio.sleep(i * stagger_s)
    sent = time.monotonic()
    last: float | None = None
    story = " ".join(f"word{j}" for j in range(long_words)) if i % 3 == 2 else ""
    body = {"prompt": f"Story number {i}: {story} once upon a time", "max_tokens": tokens,
            "temperature": 0, "ignore_eos": True, "stream": True}
    async with client.stream("POST", url + "/v1/completions", json=body) as r:
        if r.status_code != 200:
            await r.aread()
            run.refused += 1
            return
        async for line in r.aiter_lines():
            if line.startswith("data: {") and '"error"' in line[:40]:
                run.failed += 1  # llama-server's "Context size has been exceeded", say
                return
            if not line.startswith("data: {") or '"text":""' in line.replace(" ", ""):
                continue
            now = time.monotonic()
            if last is None:
                run.ttfts.append(now - sent)
            else:
                run.gaps.append(now - last)
            last = now
            run.tokens += 1


async def rounds(url: str, clients: int, tokens: int, count: int, long_words: int,
                 stagger_s: float = 0.0) -> Run:
    run = Run()
    # (Straight to llama-server too, which closes the connection after each stream.)
    async with httpx.AsyncClient(timeout=900, limits=NO_KEEPALIVE) as client:
        start = time.monotonic()
        for _ in range(count):
            await asyncio.gather(*(one(client, url, i, tokens, run, long_words, stagger_s)
                                   for i in range(clients)))
        run.wall_s = time.monotonic() - start
    return run


@contextmanager
def gateway(backend_url: str, classes: list[dict[str, Any]], policy: str = "strict",
            defer_s: float = 2.0) -> Iterator[tuple[str, CollectorRegistry]]:
    """The gateway under ``policy`` with these ``[[classes]]`` and
    ``prefill_defer_s`` on a free port in a thread."""
    settings = load_settings(admission={"max_queue_wait_s": 600.0, "max_queue": 64,
                                        "policy": policy, "prefill_defer_s": defer_s},
                             backends=[{"name": "local", "url": backend_url}],
                             classes=classes)
    with gateway_thread(settings) as running:
        yield running


def sample(registry: CollectorRegistry, name: str, **labels: str) -> float | None:
    for family in registry.collect():
        for s in family.samples:
            if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()):
                return float(s.value)
    return None


def row(name: str, run: Run) -> str:
    median = statistics.median(run.gaps)
    stalls = sum(1 for g in run.gaps if g > 2 * median) / len(run.gaps)
    limit = f"{run.limit:6.0f}" if run.limit else f"{'-':>6}"
    return (f"{name:15} {run.wall_s:7.1f} {run.tokens / run.wall_s:8.1f} "
            f"{run.refused:5d} {run.failed:5d} "
            f"{median * 1000:8.1f} {quantile(run.gaps, 0.95) * 1000:8.1f} "
            f"{max(run.gaps) * 1000:8.1f} {statistics.median(run.ttfts):8.2f} "
            f"{quantile(run.ttfts, 0.95):8.2f} {stalls:7.1%} {limit} {run.held:5.0f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--clients", type=int, default=6)
    parser.add_argument("--tokens", type=int, default=120)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--long-words", type=int, default=300)
    parser.add_argument("--stagger", type=float, default=0.0,
                        help="seconds between the starts of a round's clients")
    parser.add_argument("--defer", type=float, default=2.0,
                        help="prefill_defer_s of the +hold runs (the +slo runs have 0)")
    parser.add_argument("--target", type=float, default=1.25,
                        help="the ITL target as a multiple of the learned p95 at 2 busy")
    args = parser.parse_args()
    work = (args.clients, args.tokens)
    runs: dict[str, Run] = {}

    def measured(url: str, registry: CollectorRegistry | None, warm: bool = True) -> Run:
        if warm:  # the warm-up round (and, with a target, the round the limit learns in)
            asyncio.run(rounds(url, *work, 1, args.long_words, args.stagger))
        run = asyncio.run(rounds(url, *work, args.rounds, args.long_words, args.stagger))
        if registry is not None:
            run.limit = sample(registry, "gateway_slo_limit", backend="local") or 0
        return run

    with LlamaServer(["-c", "2048"]).running() as server:
        runs["direct"] = measured(server.url, None)
        with gateway(server.url, [{"name": "chat"}]) as (url, registry):
            runs["strict"] = measured(url, registry)
            two = sample(registry, "gateway_latency_itl_p95_seconds", backend="local",
                         level="2")
            four = sample(registry, "gateway_latency_itl_p95_seconds", backend="local",
                          level="4")
        if two is None:
            sys.exit("no ITL learnt with 2 slots busy: raise --clients or --rounds")
        target = args.target * two
        with gateway(server.url, [{"name": "chat"}], "predictive") as (url, registry):
            runs["predictive"] = measured(url, registry)
        for policy in ("strict", "predictive"):
            with gateway(server.url, [{"name": "chat", "itl_p95_s": target}],
                         policy, 0.0) as (url, registry):
                runs[f"{policy}+slo"] = measured(url, registry)
            with gateway(server.url, [{"name": "chat", "itl_p95_s": target}],
                         policy, args.defer) as (url, registry):
                runs[f"{policy}+slo+hold"] = measured(url, registry)
                run = runs[f"{policy}+slo+hold"]
                run.held = sample(registry, "gateway_prefill_deferred_total",
                                  backend="local") or 0
    print(f"learned ITL p95: 2 busy {two * 1000:.1f} ms, 4 busy "
          f"{(four or 0) * 1000:.1f} ms; target {target * 1000:.1f} ms")
    print(f"{'run':15} {'wall s':>7} {'tok/s':>8} {'refus':>5} {'fail':>5} {'ITL p50':>8} "
          f"{'ITL p95':>8} {'ITL max':>8} {'TTFT p50':>8} {'TTFT p95':>8} {'stalls':>7} "
          f"{'limit':>6} {'held':>5}")
    for name, run in runs.items():
        print(row(name, run))
    base = runs["strict"]
    for name, run in runs.items():
        if name != "strict":
            print(f"{name} / strict: ITL p95 "
                  f"{quantile(run.gaps, 0.95) / quantile(base.gaps, 0.95):.2f}, "
                  f"goodput {(run.tokens / run.wall_s) / (base.tokens / base.wall_s):.2f}, "
                  f"TTFT p95 {quantile(run.ttfts, 0.95) / quantile(base.ttfts, 0.95):.2f}")


if __name__ == "__main__":
    main()
