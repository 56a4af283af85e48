"""The shared admission state (``[state] backend = "redis"``) measured, in one run.

Three parts, each printing figures (no asserts; the machine is noisy, so each compares
targets side by side, a few seconds per cell):

1. **cost**: the cost per request of the Redis path against the memory one. An upstream
   that answers at once (bench/bench.py's, shaped like llama-server, with ``--slots``
   slots so that admission never queues), one gateway with memory state and one with
   Redis state, side by side under bench/bench.py's closed-loop load: JSON and SSE (100
   events), at 4 and 64 connections. Per cell: req/s, p50/p99, the ratio redis/memory,
   the CPU each process spent per request (from ``/proc``), and Redis's own count of
   script calls per request and their cost (``INFO commandstats``).
2. **workers**: throughput of the Redis gateway with 1 process and with ``gateway serve
   --workers 2``, beside the memory gateway; then what that predicts for N cores, with
   the model printed: each core serves ``1 / (gateway CPU seconds per request)``
   requests/s, and Redis (one thread) caps the whole at ``1 / (Redis CPU seconds per
   request)``; the grant script's own ceiling is measured with ``redis-benchmark`` for
   several slot counts and leases held.
3. **fairness**: 100 waiters spread over 3 OS processes (a :class:`SharedStore` and an
   :class:`Admission` each, on a backend of 1 slot so that grants serialise), arriving on
   a seeded schedule; how far the order of admission strays from the order of arrival:
   displacement in places (max, mean) and the largest inversion in ms (a request admitted
   before one that arrived that much earlier). ``queued``: all 100 wait behind a held
   lease, then it is released; ``live``: they arrive while earlier ones are served.

The load generator, the upstream, Redis and the gateways share the machine's cores: the
load average at the start and the machine's busy share per cell are printed.

Run: ``python bench/shared.py`` (``--seconds 5`` per cell; ``--only cost|workers|fair``).
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import multiprocessing as mp
import os
import random
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench import (  # noqa: E402
    ANSWER,
    DELTA,
    FINAL,
    STREAM_EVENTS,
    free_port,
    measure,
    stream_answer,
    wait_http,
)
from gateway.dev.redisserver import RedisServer  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
TICK = os.sysconf("SC_CLK_TCK")


# -- processes: Redis, the upstream, gateways, and their CPU time ------------------------

class Redis(RedisServer):
    """gateway.dev.redisserver's server, with a synchronous client for the bench."""

    def client(self) -> Any:
        import redis

        return redis.Redis(port=self.port)


def run_upstream(port: int, slots: int) -> None:
    """bench/bench.py's instant upstream (JSON answer, or 100 SSE events), whose
    ``/props`` reports ``slots`` slots of 4,096 tokens."""
    from aiohttp import web

    async def chat(request: web.Request) -> web.StreamResponse:
        body = await request.read()
        if b'"stream":true' not in body.replace(b" ", b""):
            return web.Response(body=ANSWER, content_type="application/json")
        return await stream_answer(request, DELTA, STREAM_EVENTS - 1, FINAL)

    async def count(request: web.Request) -> web.Response:
        await request.read()
        return web.json_response({"object": "response.input_tokens", "input_tokens": 10})

    async def props(request: web.Request) -> web.Response:
        return web.json_response(
            {"total_slots": slots, "default_generation_settings": {"n_ctx": 4096}})

    app = web.Application()
    app.router.add_post("/v1/chat/completions", chat)
    app.router.add_post("/v1/chat/completions/input_tokens", count)
    app.router.add_get("/props", props)
    web.run_app(app, host="127.0.0.1", port=port, print=None, access_log=None)


def cpu_ticks(pid: int) -> int:
    """User + system CPU time of one process, in clock ticks (0 once it is gone)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return 0
    return int(fields[11]) + int(fields[12])


def tree(pid: int) -> list[int]:
    """``pid`` and its descendants, from ``/proc``."""
    parents: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                ppid = int(Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError):
                continue
            parents.setdefault(ppid, []).append(int(entry))
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        out.append(p)
        todo.extend(parents.get(p, []))
    return out


def machine_ticks() -> tuple[int, int]:
    """(busy, total) CPU ticks of the whole machine since boot."""
    values = [int(v) for v in Path("/proc/stat").read_text().split("\n")[0].split()[1:]]
    idle = values[3] + values[4]
    return sum(values) - idle, sum(values)


@dataclass
class Gateway:
    """A ``gateway serve`` process (with ``workers`` > 1, the supervisor of them)."""

    label: str
    port: int
    proc: subprocess.Popen[bytes]
    pids: list[int] = field(default_factory=list)

    def find_workers(self) -> None:
        self.pids = tree(self.proc.pid)

    def ticks(self) -> dict[int, int]:
        return {pid: cpu_ticks(pid) for pid in self.pids}


def start_gateway(label: str, up_port: int, redis: Redis | None, workers: int = 1,
                  prefix: str = "bench", metrics_dir: str | None = None) -> Gateway:
    """A gateway in front of the upstream on ``up_port``, as bench/bench.py configures
    it (INFO, an access line per request to a discarded stderr, a queue that never
    fills), with memory state or, given ``redis``, Redis state under ``prefix``.
    ``metrics_dir``: prometheus_client's multiprocess mode in that directory, as each
    worker of ``--workers`` has it."""
    port = free_port()
    env = dict(
        os.environ, GATEWAY_SERVER__PORT=str(port), GATEWAY_SERVER__LOG_LEVEL="info",
        GATEWAY_ADMISSION__MAX_QUEUE="100000",
        GATEWAY_BACKENDS=json.dumps([{"name": "bench", "url": f"http://127.0.0.1:{up_port}",
                                      "kv_unified": False}]),
    )
    if redis is not None:
        env.update(GATEWAY_STATE__BACKEND="redis", GATEWAY_STATE__REDIS_URL=redis.url,
                   GATEWAY_STATE__KEY_PREFIX=prefix)
    if metrics_dir is not None:
        env["PROMETHEUS_MULTIPROC_DIR"] = metrics_dir
    args = [sys.executable, "-m", "gateway", "serve"]
    if workers > 1:
        args += ["--workers", str(workers)]
    proc = subprocess.Popen(args, env=env, stderr=subprocess.DEVNULL)
    return Gateway(label, port, proc)


def script_stats(redis: Redis) -> tuple[int, float]:
    """(script calls, their microseconds in all) Redis has counted since it started."""
    stats = redis.client().info("commandstats")
    calls = usec = 0.0
    for name in ("cmdstat_evalsha", "cmdstat_eval"):
        if name in stats:
            calls += stats[name]["calls"]
            usec += stats[name]["usec"]
    return int(calls), usec


@dataclass
class Cell:
    """One measurement: a workload on a target, and what it cost."""

    run: str
    label: str
    result: dict[str, float]
    gateway_cpu_ms: float  # gateway CPU per request, all its processes
    per_worker: list[float]  # share of the gateway's CPU, per process with any
    upstream_cpu_ms: float
    redis_cpu_ms: float
    script_calls: float  # per request
    script_us: float  # Redis's time per script call
    busy: float  # the machine's busy share of its cores


def run_cell(run: str, gateway: Gateway, connections: int, stream: bool, seconds: float,
             upstream_pid: int, redis: Redis) -> Cell:
    """Measure one workload on one gateway, with the CPU spent by each process."""
    assert redis.proc is not None
    before = gateway.ticks(), cpu_ticks(upstream_pid), cpu_ticks(redis.proc.pid)
    calls0, usec0 = script_stats(redis)
    busy0, total0 = machine_ticks()
    result = measure(f"http://127.0.0.1:{gateway.port}/v1/chat/completions", connections,
                     seconds, stream)
    busy1, total1 = machine_ticks()
    calls1, usec1 = script_stats(redis)
    after = gateway.ticks(), cpu_ticks(upstream_pid), cpu_ticks(redis.proc.pid)
    n = max(1.0, result["rps"] * seconds)
    spent = {pid: after[0].get(pid, 0) - before[0].get(pid, 0) for pid in before[0]}
    total_gw = sum(spent.values())
    shares = sorted((v / total_gw for v in spent.values() if v > 0), reverse=True) \
        if total_gw else []
    calls = calls1 - calls0
    return Cell(run, gateway.label, result,
                gateway_cpu_ms=1000 * total_gw / TICK / n, per_worker=shares,
                upstream_cpu_ms=1000 * (after[1] - before[1]) / TICK / n,
                redis_cpu_ms=1000 * (after[2] - before[2]) / TICK / n,
                script_calls=calls / n, script_us=(usec1 - usec0) / calls if calls else 0.0,
                busy=(busy1 - busy0) / max(1, total1 - total0))


def print_cells(cells: list[Cell], base_label: str) -> None:
    print(f"{'run':>8}  {'target':<18} {'req/s':>7} {'p50 ms':>7} {'p99 ms':>7} "  # noqa: T201
          f"{'rps/' + base_label:>11} {'p50/' + base_label:>11} {'gw cpu ms':>9} "
          f"{'redis cpu ms':>12} {'calls/req':>9} {'us/call':>7} {'busy':>5} errors")
    for c in cells:
        base = next(b for b in cells if b.run == c.run and b.label == base_label)
        r, b = c.result, base.result
        # (a memory cell sees only the heartbeats of the idle Redis gateways)
        us = f"{c.script_us:.1f}" if c.script_calls >= 0.01 else "-"
        print(f"{c.run:>8}  {c.label:<18} {r['rps']:>7.0f} {r['p50_ms']:>7.2f} "  # noqa: T201
              f"{r['p99_ms']:>7.2f} {r['rps'] / b['rps']:>11.2f} "
              f"{r['p50_ms'] / b['p50_ms']:>11.2f} {c.gateway_cpu_ms:>9.3f} "
              f"{c.redis_cpu_ms:>12.3f} {c.script_calls:>9.2f} {us:>7} "
              f"{c.busy:>5.0%} {int(r['errors'])}")
        if len(c.per_worker) > 1:
            split = " / ".join(f"{s:.0%}" for s in c.per_worker)
            print(f"{'':>8}  {'':<18} (gateway CPU by process: {split})")  # noqa: T201


# -- the grant script's own ceiling ------------------------------------------------------

def grant_ceiling(redis: Redis, slots: int, held: int, requests: int = 20000,
                  clients: int = 8) -> tuple[float, float]:
    """Run the grant script (gateway/admission/shared.py ``_GRANT``) with
    ``redis-benchmark``: one request's ask of 1 slot, ``held`` leases of another live
    process held, ``slots`` slots (the ask is granted each time, overwriting its own
    lease, so every call does a whole grant).

    :returns: (calls/s as redis-benchmark saw them, Redis's microseconds per call).
    """
    from gateway.admission.shared import _GRANT

    client = redis.client()
    prefix = f"ceiling{slots}x{held}"
    leases, queue, procs, epoch = (f"{prefix}:b:x:leases", f"{prefix}:b:x:queue",
                                   f"{prefix}:procs", f"{prefix}:epoch")
    sha = client.script_load(_GRANT)
    client.zadd(procs, {"other": 2 ** 50})
    for i in range(held):
        client.hset(leases, f"other#{i}", f"other|26|1|{i}")
    client.set(epoch, 0)  # no resync window
    args = [sha, "4", leases, queue, procs, epoch, "me", "10000", "0", f"{prefix}:wake:x",
            "0", str(slots), "4095", str(4095 * slots), ",".join(map(str, range(slots))),
            "0", "1", "me#1", "1", "26", "1", "26", "1", "-1"]
    calls0, usec0 = script_stats(redis)
    done = subprocess.run(
        ["redis-benchmark", "-p", str(redis.port), "-n", str(requests), "-c", str(clients),
         "-q", "EVALSHA", *args], capture_output=True, text=True, check=True)
    calls1, usec1 = script_stats(redis)
    rate = re.findall(r"([\d.]+) requests per second", done.stdout)
    client.delete(leases, queue, procs, epoch)
    return float(rate[-1]) if rate else 0.0, (usec1 - usec0) / max(1, calls1 - calls0)


# -- fairness across processes -----------------------------------------------------------

def fair_process(index: int, url: str, prefix: str, plan: list[tuple[int, float]],
                 block: bool, hold_s: float, keep_max: bool, ready: Any, go: Any,
                 out: Any) -> None:
    """One gateway process of the fairness run: a SharedStore and an Admission of a
    backend of 1 slot. Each request of ``plan`` (id, offset s) arrives at ``start +
    offset``, waits for its lease, holds it ``hold_s``, and gives it back. With
    ``block``, process 0 holds a lease from before the start until every request has
    arrived (then all 100 wait at once). With ``keep_max`` (a what-if), the store keeps
    the largest clock offset it has ever learnt (the gateway keeps the largest of its
    last ``OFFSET_SAMPLES``)."""
    from gateway.admission.admission import Admission
    from gateway.admission.shared import SharedStore
    from gateway.admission.shared_grant import SharedGrantor
    from gateway.clock import MonotonicClock
    from gateway.config import StateSettings
    from gateway.core.capacity import Charge, Layout

    offsets: list[float] = []

    class Probe(SharedStore):
        """Notes the clock offset (Redis's minus ours) learnt from every reply."""

        async def call(self, op: str, make: Any) -> Any:
            reply = await super().call(op, make)
            if self._offsets:
                offsets.append(self._offsets[-1])  # the sample just learnt
                if keep_max:  # every sample so far, not the gateway's last OFFSET_SAMPLES
                    self._offsets.append(max(offsets))
            return reply

    async def main() -> list[tuple[int, float, float]]:
        settings = StateSettings(backend="redis", redis_url=url, key_prefix=prefix)
        store = Probe(settings, clock=MonotonicClock(), owner=f"p{index}")
        admission = Admission(Layout(slots=1, ctx_per_slot=4096), max_queue=10000,
                              max_wait_s=120.0, grantor=SharedGrantor(store.account("fair")))
        await store.start()
        blocker = None
        if block and index == 0:
            blocker = await admission.admit(Charge(10, 10))
        ready.put(index)
        start, unblock = await asyncio.get_running_loop().run_in_executor(None, go.get)
        seen: list[tuple[int, float, float]] = []

        async def one(rid: int, offset: float) -> None:
            await asyncio.sleep(max(0.0, start + offset - time.monotonic()))
            arrived = time.monotonic()
            lease = await admission.admit(Charge(10, 10))
            seen.append((rid, arrived, time.monotonic()))
            await asyncio.sleep(hold_s)
            admission.release(lease)

        tasks = [asyncio.ensure_future(one(rid, off)) for rid, off in plan]
        if blocker is not None:
            await asyncio.sleep(max(0.0, unblock - time.monotonic()))
            admission.release(blocker)
        await asyncio.gather(*tasks)
        await asyncio.sleep(0.2)
        await store.close()
        return seen

    seen = asyncio.run(main())
    out.put((seen, min(offsets), max(offsets)))


@dataclass
class Fairness:
    """How far one run's admission order strayed from its arrival order."""

    max_places: int
    mean_places: float
    inversions: int  # pairs admitted in the other order than they arrived
    worst_ms: float  # the largest arrival gap of an inverted pair
    handoff_ms: float  # median time from one grant to the next, less the hold
    offset_spread_ms: float  # largest minus smallest clock offset any process learnt


def fairness_run(redis: Redis, mode: str, seed: int, waiters: int = 100,
                 processes: int = 3, mean_gap_ms: float = 2.0,
                 hold_ms: float = 2.0) -> Fairness:
    """``waiters`` requests, each on a process drawn at random, arriving at Poisson times
    (mean gap ``mean_gap_ms``). ``mode``: ``queued``, all wait behind a held lease
    first; ``live``, no lease held; ``queued, max offset``, as ``queued`` with each
    process keeping the largest clock offset it learnt (a what-if)."""
    rng = random.Random(seed)
    offsets = list(itertools.accumulate(rng.expovariate(1000 / mean_gap_ms)
                                        for _ in range(waiters)))
    plans: list[list[tuple[int, float]]] = [[] for _ in range(processes)]
    for rid, offset in enumerate(offsets):
        plans[rng.randrange(processes)].append((rid, offset))
    ctx = mp.get_context("fork")
    ready, out = ctx.Queue(), ctx.Queue()
    gos = [ctx.Queue() for _ in range(processes)]
    prefix = f"fair-{mode.replace(', ', '-').replace(' ', '-')}-{seed}"
    procs = [ctx.Process(target=fair_process, args=(
        i, redis.url, prefix, plans[i], mode != "live", hold_ms / 1000,
        mode == "queued, max offset", ready, gos[i], out)) for i in range(processes)]
    for p in procs:
        p.start()
    for _ in procs:
        ready.get(timeout=30)
    start = time.monotonic() + 0.3
    for go in gos:
        go.put((start, start + offsets[-1] + 0.3))
    replies = [out.get(timeout=120) for _ in procs]
    seen = [row for rows, _, _ in replies for row in rows]
    # Every process runs on this machine's one monotonic clock, so the true offset to
    # Redis's clock is the same for all; each estimate falls short of it by the delay
    # before its reply was read (and Redis's ms). The spread of the estimates bounds
    # how far two processes' queue scores can disagree.
    spread_ms = (max(hi for _, _, hi in replies) - min(lo for _, lo, _ in replies)) * 1000
    for p in procs:
        p.join(10)
    by_arrival = sorted(seen, key=lambda r: r[1])
    by_admission = sorted(seen, key=lambda r: r[2])
    place = {rid: i for i, (rid, _, _) in enumerate(by_admission)}
    moved = [abs(place[rid] - i) for i, (rid, _, _) in enumerate(by_arrival)]
    inversions, worst = 0, 0.0
    for a, b in itertools.combinations(by_arrival, 2):  # a arrived first
        if place[b[0]] < place[a[0]]:
            inversions += 1
            worst = max(worst, (b[1] - a[1]) * 1000)
    grants = [r[2] for r in by_admission]
    gaps = [(b - a) * 1000 - hold_ms for a, b in itertools.pairwise(grants)]
    return Fairness(max(moved), statistics.mean(moved), inversions, worst,
                    statistics.median(gaps) if gaps else 0.0, spread_ms)


# -- the parts ---------------------------------------------------------------------------

@contextmanager
def stack(redis: Redis, slots: int, workers: bool) -> Iterator[tuple[int, list[Gateway]]]:
    """The upstream and the gateways: memory, redis (1 process) and, with ``workers``,
    redis in 1 process with prometheus_client's multiprocess mode (to price it apart)
    and redis with ``--workers 2``; each ready, with its processes found."""
    up_port = free_port()
    upstream = mp.Process(target=run_upstream, args=(up_port, slots), daemon=True)
    upstream.start()
    wait_http(f"http://127.0.0.1:{up_port}/props")
    gateways = [start_gateway("memory", up_port, None),
                start_gateway("redis", up_port, redis, prefix="one")]
    metrics_dir = tempfile.mkdtemp(prefix="bench-metrics-")
    if workers:
        gateways.append(start_gateway("redis, mp metrics", up_port, redis, prefix="mp",
                                      metrics_dir=metrics_dir))
        gateways.append(start_gateway("redis, 2 workers", up_port, redis, workers=2,
                                      prefix="two"))
    try:
        for gw in gateways:
            wait_http(f"http://127.0.0.1:{gw.port}/ready")
        time.sleep(1.0)  # the workers' children are all up
        for gw in gateways:
            gw.find_workers()
        assert upstream.pid is not None
        yield upstream.pid, gateways
    finally:
        for gw in gateways:
            gw.proc.terminate()
            gw.proc.wait(20)
        upstream.terminate()
        shutil.rmtree(metrics_dir, ignore_errors=True)


def part_cost(redis: Redis, seconds: float, slots: int) -> list[Cell]:
    print(f"\n1. cost per request: memory vs redis state, {slots} slots, "  # noqa: T201
          f"{seconds:g} s per cell")
    cells = []
    with stack(redis, slots, workers=False) as (up_pid, gateways):
        for run, connections, stream in (("JSON 4", 4, False), ("JSON 64", 64, False),
                                         ("SSE 4", 4, True), ("SSE 64", 64, True)):
            for gw in gateways:
                cells.append(run_cell(run, gw, connections, stream, seconds, up_pid, redis))
    print_cells(cells, "memory")
    return cells


def part_workers(redis: Redis, seconds: float, slots: int) -> list[Cell]:
    print(f"\n2. workers: redis state with 1 process and with --workers 2, "  # noqa: T201
          f"{slots} slots, {seconds:g} s per cell; the load generator, the upstream and "
          "Redis share the cores with them. 'mp metrics': 1 process with "
          "prometheus_client's multiprocess mode, which every worker of --workers has")
    cells = []
    with stack(redis, slots, workers=True) as (up_pid, gateways):
        for run, connections, stream in (("JSON 64", 64, False), ("SSE 64", 64, True)):
            for gw in gateways:
                cells.append(run_cell(run, gw, connections, stream, seconds, up_pid, redis))
    print_cells(cells, "redis")
    return cells


def part_ceiling(redis: Redis, slots: int) -> dict[tuple[int, int], tuple[float, float]]:
    print("\n   the grant script alone (redis-benchmark, 8 clients; one ask of 1 slot "  # noqa: T201
          "granted per call)")
    print(f"   {'slots':>6} {'leases held':>11} {'calls/s':>8} {'us/call in Redis':>16}")  # noqa: T201
    out = {}
    for s, held in sorted({(4, 2), (slots, 4), (slots, 64), (4096, 4)}):
        if held + 2 > s:
            continue
        out[(s, held)] = grant_ceiling(redis, s, held)
        rate, us = out[(s, held)]
        print(f"   {s:>6} {held:>11} {rate:>8.0f} {us:>16.1f}")  # noqa: T201
    return out


def predict(cells: list[Cell], ceiling: dict[tuple[int, int], tuple[float, float]],
            slots: int) -> None:
    """Print what the measured CPU per request predicts for N cores."""
    print("\n   model: N cores of gateway processes serve N / (gateway CPU s per request) "  # noqa: T201
          "req/s, capped by Redis (one thread) at 1 / (Redis CPU s per request); the "
          "upstream and the load generator are on other cores")
    grant = ceiling.get((slots, 64))
    for run in sorted({c.run for c in cells}):
        two = next(c for c in cells if c.run == run and c.label == "redis, 2 workers")
        one = next(c for c in cells if c.run == run and c.label == "redis")
        per_core = 1000 / two.gateway_cpu_ms
        cap = 1000 / two.redis_cpu_ms if two.redis_cpu_ms else float("inf")
        line = ", ".join(f"{n} cores {min(n * per_core, cap):,.0f}" for n in (1, 2, 4, 8, 16))
        print(f"   {run}: 2 workers / 1 = {two.result['rps'] / one.result['rps']:.2f}; "  # noqa: T201
              f"per core {per_core:,.0f} req/s; Redis cap {cap:,.0f} req/s "
              f"({two.script_calls:.2f} script calls per request); predicted: {line}")
        if grant:
            print(f"   {'':>{len(run)}}  (the grant script alone, {grant[1]:.0f} us a call "  # noqa: T201
                  f"at {slots} slots and 64 leases: Redis saturates at "
                  f"{1e6 / grant[1] / max(1.0, two.script_calls):,.0f} req/s)")


def part_fair(redis: Redis, rounds: int) -> None:
    print("\n3. fairness: 100 waiters over 3 processes, a backend of 1 slot, Poisson "  # noqa: T201
          "arrivals (mean gap 2 ms), each holding its lease 2 ms")
    print(f"   {'mode':<18} {'seed':>4} {'max places':>10} {'mean places':>11} "  # noqa: T201
          f"{'inverted pairs':>14} {'largest inversion ms':>20} {'hand-off p50 ms':>15} "
          f"{'offset spread ms':>16}")
    for mode in ("queued", "live", "queued, max offset"):
        for seed in range(1, rounds + 1):
            f = fairness_run(redis, mode, seed)
            print(f"   {mode:<18} {seed:>4} {f.max_places:>10} {f.mean_places:>11.2f} "  # noqa: T201
                  f"{f.inversions:>14} {f.worst_ms:>20.2f} {f.handoff_ms:>15.2f} "
                  f"{f.offset_spread_ms:>16.2f}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seconds", type=float, default=5.0, help="per cell")
    parser.add_argument("--slots", type=int, default=128,
                        help="the upstream's slots (enough for 64 connections)")
    parser.add_argument("--rounds", type=int, default=5, help="fairness runs per mode")
    parser.add_argument("--only", choices=["cost", "workers", "fair"], help="run one part")
    args = parser.parse_args()
    load = os.getloadavg()
    print(f"{time.strftime('%Y-%m-%d %H:%M')}, {os.cpu_count()} cores, load average "  # noqa: T201
          f"{load[0]:.2f} {load[1]:.2f} {load[2]:.2f}")
    print("columns: gw/redis cpu ms = CPU time per request of the gateway's processes / "  # noqa: T201
          "of redis-server; calls/req = script calls per request; us/call = Redis's time "
          "per call; busy = the machine's busy share over the cell")
    with tempfile.TemporaryDirectory(prefix="bench-redis-") as workdir:
        redis = Redis(workdir).start()
        try:
            if args.only in (None, "cost"):
                part_cost(redis, args.seconds, args.slots)
            if args.only in (None, "workers"):
                cells = part_workers(redis, args.seconds, args.slots)
                predict(cells, part_ceiling(redis, args.slots), args.slots)
            if args.only in (None, "fair"):
                part_fair(redis, args.rounds)
        finally:
            redis.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
