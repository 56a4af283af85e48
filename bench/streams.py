"""Many open streams at once: the gateway's memory and time to first event.

Starts an upstream shaped like llama-server that streams slowly (one event a second,
``--events`` events per answer), the gateway in front of it (``gateway serve``, room for
every stream: 4,096 slots, no queue wait), and ``--streams`` clients that open their
streams together. Prints the time to the first event (p50/p95/max, from the request to
the first ``data:`` line), how many streams finished whole, and the gateway's RSS before,
at its peak while every stream is open, and after; the difference per open stream.

Usage: .venv/bin/python bench/streams.py [--streams 2000] [--events 10]
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
from bench import add_llama_routes, free_port, wait_http  # noqa: E402

EVENT = b'data: {"choices":[{"index":0,"delta":{"content":"tok"},"finish_reason":null}]}\n\n'
FINAL = (b'data: {"choices":[{"index":0,"delta":{},"finish_reason":"length"}]}\n\n'
         b'data: {"choices":[],"usage":{"prompt_tokens":10,"completion_tokens":10,'
         b'"total_tokens":20}}\n\ndata: [DONE]\n\n')


def run_slow_upstream(port: int, events: int) -> None:
    from aiohttp import web

    async def chat(request: web.Request) -> web.StreamResponse:
        await request.read()
        resp = web.StreamResponse(headers={"content-type": "text/event-stream"})
        await resp.prepare(request)
        for _ in range(events):
            await resp.write(EVENT)
            await asyncio.sleep(1.0)
        await resp.write(FINAL)
        await resp.write_eof()
        return resp

    app = web.Application()
    app.router.add_post("/v1/chat/completions", chat)
    add_llama_routes(app)
    web.run_app(app, host="127.0.0.1", port=port, print=None, access_log=None,
                backlog=4096)


def rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0


async def open_streams(url: str, streams: int, pid: int) -> dict[str, float]:
    import aiohttp

    body = json.dumps({"messages": [{"role": "user", "content": "hello there"}],
                       "max_tokens": 16, "stream": True}).encode()
    ttft: list[float] = []
    whole = 0
    peak = 0.0
    done = asyncio.Event()

    async def sample() -> None:
        nonlocal peak
        while not done.is_set():
            peak = max(peak, rss_mib(pid))
            await asyncio.sleep(0.2)

    conn = aiohttp.TCPConnector(limit=0)
    timeout = aiohttp.ClientTimeout(total=600)
    async with aiohttp.ClientSession(connector=conn, timeout=timeout) as session:

        async def one() -> None:
            nonlocal whole
            t0 = time.perf_counter()
            first = None
            data = b""
            async with session.post(url, data=body,
                                    headers={"content-type": "application/json"}) as r:
                async for line in r.content:
                    if first is None and line.startswith(b"data:"):
                        first = time.perf_counter() - t0
                    data += line
            if first is not None:
                ttft.append(first)
            if r.status == 200 and data.rstrip().endswith(b"[DONE]"):
                whole += 1

        sampler = asyncio.ensure_future(sample())
        results = await asyncio.gather(*(one() for _ in range(streams)),
                                       return_exceptions=True)
        done.set()
        await sampler
    ttft.sort()
    errors = sum(isinstance(r, BaseException) for r in results)
    return {"ttft_p50_s": statistics.median(ttft) if ttft else float("nan"),
            "ttft_p95_s": ttft[int(len(ttft) * 0.95) - 1] if ttft else float("nan"),
            "ttft_max_s": ttft[-1] if ttft else float("nan"),
            "whole": whole, "errors": errors, "peak_mib": peak}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--streams", type=int, default=2000)
    parser.add_argument("--events", type=int, default=10, help="events per stream, 1/s")
    args = parser.parse_args()
    up_port, gw_port = free_port(), free_port()
    upstream = mp.Process(target=run_slow_upstream, args=(up_port, args.events), daemon=True)
    upstream.start()
    wait_http(f"http://127.0.0.1:{up_port}/props")
    env = dict(
        os.environ, GATEWAY_SERVER__PORT=str(gw_port), GATEWAY_SERVER__LOG_LEVEL="warning",
        GATEWAY_SERVER__MAX_CONNECTIONS=str(args.streams + 100),
        GATEWAY_ADMISSION__MAX_QUEUE="100000", GATEWAY_ADMISSION__MAX_QUEUE_WAIT_S="600",
        GATEWAY_BACKENDS=json.dumps([{"name": "bench", "url": f"http://127.0.0.1:{up_port}",
                                      "kv_unified": False}]),
    )
    gateway = subprocess.Popen([sys.executable, "-m", "gateway", "serve"], env=env)
    try:
        wait_http(f"http://127.0.0.1:{gw_port}/ready")
        before = rss_mib(gateway.pid)
        out = asyncio.run(open_streams(f"http://127.0.0.1:{gw_port}/v1/chat/completions",
                                       args.streams, gateway.pid))
        time.sleep(1)
        after = rss_mib(gateway.pid)
    finally:
        gateway.terminate()
        gateway.wait(10)
        upstream.terminate()
    per_stream_kib = (out["peak_mib"] - before) * 1024 / args.streams
    print(f"{args.streams} streams of {args.events} events (1/s), opened together")  # noqa: T201
    print(f"TTFT p50 {out['ttft_p50_s']:.2f} s, p95 {out['ttft_p95_s']:.2f} s, "  # noqa: T201
          f"max {out['ttft_max_s']:.2f} s; whole {out['whole']}, errors {out['errors']}")
    print(f"gateway RSS {before:.0f} MiB before, {out['peak_mib']:.0f} MiB at peak, "  # noqa: T201
          f"{after:.0f} MiB after; {per_stream_kib:.0f} KiB per open stream")
    return 0


if __name__ == "__main__":
    sys.exit(main())
