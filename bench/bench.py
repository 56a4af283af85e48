"""Gateway overhead against a direct call, side by side, on a fixed-response upstream.

Starts (each in its own process):
* an upstream that answers instantly with fixed JSON, shaped like llama-server
  (``/props``, ``/v1/chat/completions/input_tokens``, ``/v1/chat/completions``);
* the gateway in front of it (``gateway serve``, uvloop + httptools), configured with
  enough slots that admission never queues, so what is measured is the proxy path:
  validation, the exact-count call upstream, reservation, forwarding, metrics;
* a load generator (aiohttp, closed loop) at 4 and at 64 connections, for a fixed time,
  first straight at the upstream, then at the gateway.

Prints requests/s and p50/p99 latency for each, and the gateway's added latency and
throughput ratio. Figures, not asserts: the machine is noisy, compare within one run.

Run: ``make bench`` (``python bench/bench.py --seconds 5``).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing as mp
import os
import socket
import statistics
import subprocess
import sys
import time

CHAT = {"messages": [{"role": "user", "content": "hello there"}], "max_tokens": 16}
ANSWER = json.dumps({
    "object": "chat.completion",
    "choices": [{"index": 0, "finish_reason": "stop",
                 "message": {"role": "assistant", "content": "hi"}}],
    "usage": {"prompt_tokens": 10, "completion_tokens": 1, "total_tokens": 11},
}).encode()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def run_upstream(port: int) -> None:
    from aiohttp import web

    async def chat(request: web.Request) -> web.Response:
        await request.read()
        return web.Response(body=ANSWER, content_type="application/json")

    async def count(request: web.Request) -> web.Response:
        await request.read()
        return web.json_response({"object": "response.input_tokens", "input_tokens": 10})

    async def props(request: web.Request) -> web.Response:
        return web.json_response(
            {"total_slots": 4096, "default_generation_settings": {"n_ctx": 4096}})

    app = web.Application()
    app.router.add_post("/v1/chat/completions", chat)
    app.router.add_post("/v1/chat/completions/input_tokens", count)
    app.router.add_get("/props", props)
    web.run_app(app, host="127.0.0.1", port=port, print=None, access_log=None)


async def _load(url: str, connections: int, seconds: float) -> tuple[int, list[float], int]:
    import aiohttp

    latencies: list[float] = []
    errors = 0
    body = json.dumps(CHAT).encode()
    deadline = time.perf_counter() + seconds
    conn = aiohttp.TCPConnector(limit=connections)
    async with aiohttp.ClientSession(connector=conn) as session:

        async def worker() -> None:
            nonlocal errors
            while time.perf_counter() < deadline:
                t0 = time.perf_counter()
                async with session.post(url, data=body,
                                        headers={"content-type": "application/json"}) as r:
                    await r.read()
                    if r.status != 200:
                        errors += 1
                latencies.append(time.perf_counter() - t0)

        await asyncio.gather(*(worker() for _ in range(connections)))
    return len(latencies), latencies, errors


def load(url: str, connections: int, seconds: float, out: mp.Queue) -> None:  # type: ignore[type-arg]
    try:
        import uvloop

        uvloop.install()
    except ImportError:
        pass
    n, lat, errors = asyncio.run(_load(url, connections, seconds))
    out.put((n, lat, errors))


def measure(url: str, connections: int, seconds: float) -> dict[str, float]:
    q: mp.Queue = mp.Queue()  # type: ignore[type-arg]
    proc = mp.Process(target=load, args=(url, connections, seconds, q))
    proc.start()
    n, lat, errors = q.get()
    proc.join()
    lat.sort()
    return {
        "rps": n / seconds,
        "p50_ms": statistics.median(lat) * 1000,
        "p99_ms": lat[int(len(lat) * 0.99) - 1] * 1000,
        "errors": errors,
    }


def wait_http(url: str) -> None:
    import urllib.request

    for _ in range(200):
        try:
            with urllib.request.urlopen(url, timeout=1) as r:
                if r.status == 200:
                    return
        except OSError:
            time.sleep(0.1)
    raise SystemExit(f"{url} did not come up")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seconds", type=float, default=5.0, help="per measurement")
    args = parser.parse_args()
    up_port, gw_port = free_port(), free_port()
    upstream = mp.Process(target=run_upstream, args=(up_port,), daemon=True)
    upstream.start()
    wait_http(f"http://127.0.0.1:{up_port}/props")
    env = dict(
        os.environ, GATEWAY_SERVER__PORT=str(gw_port), GATEWAY_SERVER__LOG_LEVEL="warning",
        GATEWAY_ADMISSION__MAX_QUEUE="100000",
        GATEWAY_BACKENDS=json.dumps([{"name": "bench", "url": f"http://127.0.0.1:{up_port}",
                                      "kv_unified": False}]),
    )
    gateway = subprocess.Popen([sys.executable, "-m", "gateway", "serve"], env=env)
    try:
        wait_http(f"http://127.0.0.1:{gw_port}/ready")
        rows = []
        for connections in (4, 64):
            direct = measure(f"http://127.0.0.1:{up_port}/v1/chat/completions", connections,
                             args.seconds)
            via = measure(f"http://127.0.0.1:{gw_port}/v1/chat/completions", connections,
                          args.seconds)
            rows.append((connections, direct, via))
    finally:
        gateway.terminate()
        gateway.wait(10)
        upstream.terminate()
    print(f"{'conns':>5} | {'direct req/s':>12} {'p50 ms':>7} {'p99 ms':>7} | "  # noqa: T201
          f"{'gateway req/s':>13} {'p50 ms':>7} {'p99 ms':>7} | {'added p50 ms':>12} "
          f"{'added p99 ms':>12} {'rps ratio':>9} | errors")
    for c, d, g in rows:
        print(f"{c:>5} | {d['rps']:>12.0f} {d['p50_ms']:>7.2f} {d['p99_ms']:>7.2f} | "  # noqa: T201
              f"{g['rps']:>13.0f} {g['p50_ms']:>7.2f} {g['p99_ms']:>7.2f} | "
              f"{g['p50_ms'] - d['p50_ms']:>12.2f} {g['p99_ms'] - d['p99_ms']:>12.2f} "
              f"{g['rps'] / d['rps']:>9.2f} | {int(d['errors'])}/{int(g['errors'])}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
