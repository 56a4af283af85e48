"""The shared-KV overflow, sent straight to llama-server and then through the gateway.

Starts llama-server with its default layout (4 slots, one unified pool) and ``-c 2048``,
and the gateway in front of it (``gateway serve``). Sends 3 concurrent chats of about 790
prompt tokens with ``max_tokens`` 900 (each fits a slot alone; together they need ~5,070
cells of a 2,048-cell pool) once to each, and prints a side-by-side table.

Run: ``make demo`` (or ``python scripts/demo.py``).
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from gateway.dev.localbackend import LlamaServer, free_port  # noqa: E402

CHATS = 3
MAX_TOKENS = 900


def prompt() -> str:
    words = ["river", "mountain", "quiet", "lantern", "orchard", "copper", "meadow", "signal"]
    return " ".join(
        f"The {words[i % 8]} near the {words[(i * 3 + 1) % 8]} kept its "
        f"{words[(i * 5 + 2) % 8]} for day {i}." for i in range(55)
    )


async def burst(url: str) -> dict[str, Any]:
    body = {"messages": [{"role": "user", "content": prompt()}], "max_tokens": MAX_TOKENS,
            "ignore_eos": True}
    started = time.monotonic()

    async def one(client: httpx.AsyncClient, k: int) -> httpx.Response:
        r = await client.post(url + "/v1/chat/completions", json=body)
        print(f"  chat {k + 1}: HTTP {r.status_code} after {time.monotonic() - started:.1f} s",
              flush=True)
        return r

    async with httpx.AsyncClient(timeout=600) as client:
        results = await asyncio.gather(*(one(client, k) for k in range(CHATS)))
    wall = time.monotonic() - started
    tokens = [r.json().get("usage", {}).get("completion_tokens", 0) if r.status_code == 200
              else 0 for r in results]
    return {
        "statuses": [r.status_code for r in results],
        "tokens": tokens,
        "wall": wall,
        "overflow_500s": sum(r.status_code == 500 and "Context size" in r.text for r in results),
    }


def wait_ready(url: str, proc: subprocess.Popen[bytes]) -> None:
    for _ in range(300):
        if proc.poll() is not None:
            raise SystemExit("the gateway exited; see its output above")
        try:
            if httpx.get(url + "/ready", timeout=1).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.1)
    raise SystemExit("the gateway did not become ready")


def upstream_overflows(gateway_url: str) -> int:
    total = 0.0
    for line in httpx.get(gateway_url + "/metrics").text.splitlines():
        if line.startswith("gateway_upstream_errors_total") and "status_5xx" in line:
            total += float(line.split()[-1])
        if line.startswith("gateway_upstream_errors_total") and "context_overflow" in line:
            total += float(line.split()[-1])
    return int(total)


def main() -> int:
    server = LlamaServer(["-c", "2048"])
    print(f"llama-server {server.binary.name}, model {server.model.name}, -c 2048, default slots",
          flush=True)
    with server.running():
        print(f"{CHATS} concurrent chats, ~790 prompt tokens, max_tokens {MAX_TOKENS}, straight "
              "to llama-server ...", flush=True)
        direct = asyncio.run(burst(server.url))
        port = free_port()
        # The three chats run one after another; let the queue wait as long as that takes.
        env = dict(os.environ, GATEWAY_SERVER__PORT=str(port),
                   GATEWAY_ADMISSION__MAX_QUEUE_WAIT_S="600",
                   GATEWAY_SERVER__LOG_LEVEL="warning",
                   GATEWAY_BACKENDS=json.dumps([{"name": "local", "url": server.url}]))
        gw_url = f"http://127.0.0.1:{port}"
        gw = subprocess.Popen([sys.executable, "-m", "gateway", "serve"], env=env)
        try:
            wait_ready(gw_url, gw)
            print("... and the same through the gateway", flush=True)
            through = asyncio.run(burst(gw_url))
            through["overflow_500s"] = upstream_overflows(gw_url)
        finally:
            gw.terminate()
            gw.wait(10)
    rows = [
        ("requests", CHATS, CHATS),
        ("status codes", direct["statuses"], through["statuses"]),
        ("completion tokens", direct["tokens"], through["tokens"]),
        ("wall time (s)", f"{direct['wall']:.1f}", f"{through['wall']:.1f}"),
        ("upstream 500s", direct["overflow_500s"], through["overflow_500s"]),
    ]
    print()
    print(f"| {'':18} | {'straight to llama-server':26} | {'through the gateway':26} |")
    print(f"|{'-' * 20}|{'-' * 28}|{'-' * 28}|")
    for label, a, b in rows:
        print(f"| {label:18} | {str(a):26} | {str(b):26} |")
    ok = through["statuses"] == [200] * CHATS and through["overflow_500s"] == 0
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
