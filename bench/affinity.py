"""Prefix affinity, measured: two real llama-servers behind the gateway, multi-turn
conversations, with ``routing.affinity`` on and off.

Each of 8 conversations opens with a ~1,000-token message (a system prompt and a long
first question) and goes on for 4 more short turns; the 8 run at once, each turn after
the answer to the last and a pause of 0-3 s (seeded, the same in both modes). Both
servers run Gemma 3 270M with 4 slots sharing 8,192 cells (one thread each: this
machine has 2 cores). llama-server keeps each slot's last prompt
(``cache_prompt``) and picks the slot whose prompt is most alike, so a turn that reaches
the server holding its conversation recomputes only the new part.

Printed per mode: TTFT p50/p95 (first streamed token, seconds) of the later turns, and
llama-server's own ``timings``: prompt tokens computed (``prompt_n``) and taken from the
cache (``cache_n``), summed over the later turns; then the ratios.

Usage: .venv/bin/python bench/affinity.py [--conversations 8] [--turns 4]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from gateway.config import load_settings  # noqa: E402
from gateway.dev.localbackend import LlamaServer  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from goodput import gateway_thread  # noqa: E402

LAYOUT = ["-c", "8192", "-np", "4", "--kv-unified", "-t", "1"]
WORDS = ("river mill house bank summer boat tide garden stone bridge market road light "
         "window paper table music story winter morning letter forest island kitchen").split()


def opening(i: int) -> list[dict[str, Any]]:
    """A conversation's system prompt and ~1,000-token first question."""
    text = " ".join(WORDS[(i * 7 + j * 3) % len(WORDS)] for j in range(950))
    return [{"role": "system", "content": f"You are assistant number {i}. Answer briefly."},
            {"role": "user", "content": f"Read these notes, then answer: {text}"}]


async def turn(client: httpx.AsyncClient, url: str, messages: list[dict[str, Any]]
               ) -> tuple[float, dict[str, Any], str]:
    """One streamed turn: (TTFT seconds, llama-server's timings, answer text)."""
    started = time.monotonic()
    first, timings, text = None, {}, []
    # llama-server puts its timings in the usage chunk, sent when asked for.
    body = {"model": "gemma", "messages": messages, "max_tokens": 24, "temperature": 0,
            "stream": True, "stream_options": {"include_usage": True}}
    async with client.stream("POST", url + "/v1/chat/completions", json=body) as resp:
        resp.raise_for_status()
        async for line in resp.aiter_lines():
            if not line.startswith("data: {"):
                continue
            event = json.loads(line[6:])
            timings = event.get("timings") or timings
            for choice in event.get("choices") or []:
                piece = (choice.get("delta") or {}).get("content")
                if piece:
                    text.append(piece)
                    if first is None:
                        first = time.monotonic() - started
    return (first if first is not None else time.monotonic() - started), timings, "".join(text)


async def conversation(client: httpx.AsyncClient, url: str, i: int, turns: int,
                       later: list[tuple[float, dict[str, Any]]]) -> None:
    messages = opening(i)
    pauses = random.Random(i)  # the same think times in both modes
    for t in range(turns + 1):
        # A user reads and types between turns: the load each turn meets differs, as in
        # real use (in lockstep, routing by fit alone puts every turn back in place).
        await asyncio.sleep(pauses.uniform(0.0, 3.0))
        ttft, timings, answer = await turn(client, url, messages)
        if t > 0:
            later.append((ttft, timings))
        messages += [{"role": "assistant", "content": answer or "ok"},
                     {"role": "user", "content": f"And point {t + 1}?"}]


def run(servers: list[LlamaServer], affinity: bool, conversations: int, turns: int
        ) -> list[tuple[float, dict[str, Any]]]:
    settings = load_settings(
        admission={"max_queue_wait_s": 600.0},
        routing={"affinity": affinity},
        backends=[{"name": f"s{i}", "url": s.url, "model": "gemma"}
                  for i, s in enumerate(servers)])
    later: list[tuple[float, dict[str, Any]]] = []
    with gateway_thread(settings) as (url, _registry):
        async def go() -> None:
            async with httpx.AsyncClient(timeout=900) as client:
                await asyncio.gather(*(conversation(client, url, i, turns, later)
                                       for i in range(conversations)))
        asyncio.run(go())
    return later


def summary(later: list[tuple[float, dict[str, Any]]]) -> dict[str, float]:
    ttfts = sorted(t for t, _ in later)
    return {
        "p50": statistics.median(ttfts),
        "p95": ttfts[min(len(ttfts) - 1, int(0.95 * len(ttfts)))],
        "prompt_n": sum(int(tm.get("prompt_n", 0)) for _, tm in later),
        "cache_n": sum(int(tm.get("cache_n", 0)) for _, tm in later),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--conversations", type=int, default=8)
    parser.add_argument("--turns", type=int, default=4)
    args = parser.parse_args()
    results = {}
    for affinity in (False, True):  # fresh servers for each mode: no cache carried over
        servers = [LlamaServer(LAYOUT).start() for _ in range(2)]
        try:
            results["on" if affinity else "off"] = summary(
                run(servers, affinity, args.conversations, args.turns))
        finally:
            for server in servers:
                server.stop()
    print(f"{args.conversations} conversations x {args.turns} later turns, "
          "2 llama-servers (4 slots, 8,192 cells each)")
    print(f"{'affinity':<10}{'TTFT p50 s':>12}{'TTFT p95 s':>12}{'prompt_n':>10}{'cache_n':>10}")
    for mode, r in results.items():
        print(f"{mode:<10}{r['p50']:>12.2f}{r['p95']:>12.2f}{r['prompt_n']:>10}"
              f"{r['cache_n']:>10}")
    off, on = results["off"], results["on"]
    print(f"on/off: TTFT p50 x{on['p50'] / off['p50']:.2f}, p95 x{on['p95'] / off['p95']:.2f},"
          f" prompt tokens computed x{on['prompt_n'] / max(1, off['prompt_n']):.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
