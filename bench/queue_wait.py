"""How well the gateway predicts a queued request's wait, against the real llama-server.

Starts llama-server (the cached build and Gemma 3 270M, ``-c 2048``: 4 slots sharing
one pool) and the gateway, then sends waves of concurrent chats whose reservations do
not all fit at once, so that most of each wave queues. Each answer carries
``x-queue-wait-ms`` (the real wait) and, for requests that queued once the gateway had
a drain history, ``x-queue-predicted-wait-ms``. Prints the error of the prediction
(real − predicted) and how many requests were refused at arrival as doomed.

Usage: python bench/queue_wait.py [--waves 4] [--per-wave 8] [--max-tokens 300]
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import threading
import time
from pathlib import Path

import httpx
import uvicorn

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from gateway.config import load_settings  # noqa: E402
from gateway.dev.localbackend import LlamaServer, free_port  # noqa: E402
from gateway.http.app import create_app, uvicorn_options  # noqa: E402


async def wave(url: str, n: int, max_tokens: int, seed: int) -> list[httpx.Response]:
    async with httpx.AsyncClient(timeout=600) as client:
        bodies = [{"messages": [{"role": "user", "content": f"Tell story number {seed + i} "
                                 "about a river, in detail."}],
                   "max_tokens": max_tokens, "ignore_eos": True} for i in range(n)]
        return list(await asyncio.gather(*[client.post(url, json=b) for b in bodies]))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--waves", type=int, default=4)
    parser.add_argument("--per-wave", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=300)
    parser.add_argument("--max-wait", type=float, default=600.0)
    args = parser.parse_args()
    with LlamaServer(["-c", "2048"]).running() as server:
        settings = load_settings(
            admission={"max_queue_wait_s": args.max_wait, "max_queue": 64},
            backends=[{"name": "local", "url": server.url}])
        port = free_port()
        config = uvicorn.Config(create_app(settings), host="127.0.0.1", port=port,
                                log_level="warning", **uvicorn_options(settings))
        gateway = uvicorn.Server(config)
        thread = threading.Thread(target=gateway.run, daemon=True)
        thread.start()
        while not gateway.started:
            time.sleep(0.05)
        url = f"http://127.0.0.1:{port}/v1/chat/completions"
        errors, refused, served = [], 0, 0
        for k in range(args.waves):
            for r in asyncio.run(wave(url, args.per_wave, args.max_tokens, k * 100)):
                if r.status_code == 503 and r.json()["error"]["code"] == "queue_wait_too_long":
                    refused += 1
                    continue
                served += r.status_code == 200
                if "x-queue-predicted-wait-ms" in r.headers:
                    real = int(r.headers["x-queue-wait-ms"]) / 1000
                    errors.append(real - int(r.headers["x-queue-predicted-wait-ms"]) / 1000)
        gateway.should_exit = True
        thread.join(10)
    print(f"waves {args.waves} x {args.per_wave} chats, max_tokens {args.max_tokens}: "
          f"served {served}, refused as doomed {refused}, predictions {len(errors)}")
    if errors:
        ordered = sorted(errors)
        print("real - predicted wait (s): "
              f"median {statistics.median(ordered):+.2f}, "
              f"p10 {ordered[len(ordered) // 10]:+.2f}, "
              f"p90 {ordered[min(len(ordered) - 1, 9 * len(ordered) // 10)]:+.2f}, "
              f"mean |error| {statistics.fmean(abs(e) for e in ordered):.2f}")


if __name__ == "__main__":
    main()
