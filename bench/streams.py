"""Many open streams at once: the gateway's memory and time to first event.

Starts an upstream shaped like llama-server that streams slowly (one event a second,
``--events`` events per answer, the connection closed after each answer as llama-server
does), the gateway in front of it (``gateway serve``, room for every stream: 4,096 slots,
no queue wait), and ``--streams`` clients. The clients start over ``--ramp-s`` seconds
(a burst of 2,000 requests in the same millisecond measures the length of the burst, not
the gateway), and each opens a new stream as soon as its last one ends, until
``--minutes`` have passed: so ``--streams`` streams stay open the whole time, and the
gateway serves ``streams × minutes × 60 / events`` requests.

Prints, for the gateway and for the bare pass-through proxy of bench.py (the floor,
in the same run): the time to the first event (p50/p95/max, from the request to the
first ``data:`` line), how many streams finished whole, and the RSS before, at its
peak, one minute into the run (or at the end of the ramp, in a shorter run) and at the
end, with the RSS per open stream and the growth from that first reading to the end.

Usage: .venv/bin/python bench/streams.py [--streams 2000] [--events 20] [--ramp-s 10]
[--minutes 1]; the issue's memory check is ``--minutes 5``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing as mp
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench import (  # noqa: E402
    free_port,
    run_bare_proxy,
    serve_upstream,
    stream_answer,
    wait_http,
)

EVENT = b'data: {"choices":[{"index":0,"delta":{"content":"tok"},"finish_reason":null}]}\n\n'
FINAL = (b'data: {"choices":[{"index":0,"delta":{},"finish_reason":"length"}]}\n\n'
         b'data: {"choices":[],"usage":{"prompt_tokens":10,"completion_tokens":10,'
         b'"total_tokens":20}}\n\ndata: [DONE]\n\n')


def run_slow_upstream(port: int, events: int) -> None:
    from aiohttp import web

    async def chat(request: web.Request) -> web.StreamResponse:
        await request.read()
        return await stream_answer(request, EVENT, events, FINAL, gap_s=1.0)

    serve_upstream(chat, port, backlog=4096)


def rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0


async def hold_streams(url: str, streams: int, ramp_s: float, seconds: float, pid: int
                       ) -> dict[str, float]:
    """``streams`` clients, started over ``ramp_s``, each streaming again and again
    until ``seconds`` have passed; the RSS of ``pid`` is read every second."""
    import aiohttp

    body = json.dumps({"messages": [{"role": "user", "content": "hello there"}],
                       "max_tokens": 16, "stream": True}).encode()
    ttft: list[float] = []
    whole = failed = 0
    rss: list[tuple[float, float]] = []
    start = time.perf_counter()
    deadline = start + seconds
    done = asyncio.Event()

    async def sample() -> None:
        while not done.is_set():
            rss.append((time.perf_counter() - start, rss_mib(pid)))
            await asyncio.sleep(1.0)

    conn = aiohttp.TCPConnector(limit=0)
    timeout = aiohttp.ClientTimeout(total=600)
    async with aiohttp.ClientSession(connector=conn, timeout=timeout) as session:

        async def client(number: int) -> None:
            nonlocal whole, failed
            await asyncio.sleep(ramp_s * number / streams)
            while time.perf_counter() < deadline:
                t0 = time.perf_counter()
                first = None
                data = b""
                try:
                    async with session.post(url, data=body, headers={
                            "content-type": "application/json"}) as r:
                        async for line in r.content:
                            if first is None and line.startswith(b"data:"):
                                first = time.perf_counter() - t0
                            data += line
                except (TimeoutError, aiohttp.ClientError):
                    failed += 1
                    continue
                if first is not None:
                    ttft.append(first)
                if r.status == 200 and data.rstrip().endswith(b"[DONE]"):
                    whole += 1
                else:
                    failed += 1

        sampler = asyncio.ensure_future(sample())
        await asyncio.gather(*(client(n) for n in range(streams)))
        done.set()
        await sampler
    ttft.sort()
    steady_at = min(60.0, ramp_s + 5.0)  # the first reading with every stream open
    steady = next((m for t, m in rss if t >= steady_at), rss[-1][1])
    end = max(m for t, m in rss if t >= seconds - 5) if len(rss) > 5 else rss[-1][1]
    minutes = [m for t, m in rss if t >= steady_at][::60]  # one reading a minute
    return {"ttft_p50_s": statistics.median(ttft) if ttft else float("nan"),
            "by_minute": minutes,
            "ttft_p95_s": ttft[int(len(ttft) * 0.95) - 1] if ttft else float("nan"),
            "ttft_max_s": ttft[-1] if ttft else float("nan"),
            "whole": whole, "failed": failed, "peak_mib": max(m for _, m in rss),
            "steady_mib": steady, "steady_at_s": steady_at, "end_mib": end}


def run(label: str, url: str, pid: int, args: argparse.Namespace) -> dict[str, float]:
    wait_http(url.rsplit("/v1/", 1)[0] + ("/ready" if label == "gateway" else "/props"))
    before = rss_mib(pid)
    out = asyncio.run(hold_streams(url, args.streams, args.ramp_s, args.minutes * 60, pid))
    out["before_mib"] = before
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--streams", type=int, default=2000)
    parser.add_argument("--events", type=int, default=20, help="events per stream, 1/s")
    parser.add_argument("--ramp-s", type=float, default=10.0, help="clients start over this")
    parser.add_argument("--minutes", type=float, default=1.0, help="length of the run")
    parser.add_argument("--no-floor", action="store_true", help="the gateway only")
    args = parser.parse_args()
    up_port, gw_port, bare_port = free_port(), free_port(), free_port()
    upstream = mp.Process(target=run_slow_upstream, args=(up_port, args.events), daemon=True)
    upstream.start()
    wait_http(f"http://127.0.0.1:{up_port}/props")
    env = dict(
        os.environ, GATEWAY_SERVER__PORT=str(gw_port), GATEWAY_SERVER__LOG_LEVEL="warning",
        GATEWAY_SERVER__MAX_CONNECTIONS=str(2 * args.streams + 100),  # (with reconnects)
        GATEWAY_ADMISSION__MAX_QUEUE="100000", GATEWAY_ADMISSION__MAX_QUEUE_WAIT_S="600",
        GATEWAY_BACKENDS=json.dumps([{"name": "bench", "url": f"http://127.0.0.1:{up_port}",
                                      "kv_unified": False}]),
    )
    results = {}
    try:
        if not args.no_floor:
            bare = mp.Process(target=run_bare_proxy,
                              args=(bare_port, up_port, "aiohttp", True), daemon=True)
            bare.start()
            results["bare proxy, aiohttp"] = run(
                "bare", f"http://127.0.0.1:{bare_port}/v1/chat/completions", bare.pid, args)
            bare.terminate()
        gateway = subprocess.Popen([sys.executable, "-m", "gateway", "serve"], env=env)
        try:
            results["gateway"] = run(
                "gateway", f"http://127.0.0.1:{gw_port}/v1/chat/completions", gateway.pid,
                args)
        finally:
            gateway.terminate()
            gateway.wait(10)
    finally:
        upstream.terminate()
    print(f"{args.streams} streams open at once for {args.minutes:g} min (each "  # noqa: T201
          f"{args.events} events, 1/s, then a new one), clients started over "
          f"{args.ramp_s:g} s")
    print(f"{'target':<20} {'TTFT p50':>8} {'p95':>6} {'max':>6} {'whole':>6} "  # noqa: T201
          f"{'failed':>6} {'RSS MiB: before':>15} {'peak':>5} {'steady':>6} {'end':>5} "
          f"{'KiB/stream':>10} {'growth MiB':>10}")
    for label, r in results.items():
        per_stream = (r["steady_mib"] - r["before_mib"]) * 1024 / args.streams
        print(f"{label:<20} {r['ttft_p50_s']:>8.3f} {r['ttft_p95_s']:>6.3f} "  # noqa: T201
              f"{r['ttft_max_s']:>6.2f} {int(r['whole']):>6} {int(r['failed']):>6} "
              f"{r['before_mib']:>15.0f} {r['peak_mib']:>5.0f} {r['steady_mib']:>6.0f} "
              f"{r['end_mib']:>5.0f} {per_stream:>10.0f} "
              f"{r['end_mib'] - r['steady_mib']:>+10.1f}")
    print("steady: the RSS once every stream is open (at the end of the ramp, or one "  # noqa: T201
          "minute in for a longer run); growth: from there to the end")
    for label, r in results.items():
        print(f"{label}: RSS MiB from steady on, a minute apart: "  # noqa: T201
              + ", ".join(f"{m:.0f}" for m in r["by_minute"]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
