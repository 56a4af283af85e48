"""The scoreboard: every headline promise re-measured, each row side by side in one run.

Rows (``--rows`` picks some), each over a matrix of workloads (its cells):

* ``seed``: the shared seed scenario on the real llama-server (the project's build and
  Gemma 3 270M, ``-c 2048``, its default 4 slots sharing one pool): 3 chats of ~790
  prompt tokens and ``max_tokens`` 900, straight to llama-server and through the
  gateway; requests served whole, upstream 500s (a 500 status, or a stream's error
  event), wall time. Cells: whole / streamed answers in a burst, whole answers 0.2 s
  apart (streams 0.2 s apart: the ``refusal`` row).
* ``router``: the seed through llama-server in router mode (``--models-dir`` holding the
  model under the name :data:`ROUTER_MODEL`, ``-c 2048`` passed on to its child), the
  model named only in each request (the gateway's configuration names none): the same
  figures. Cells: whole / streamed answers in a burst.
* ``goodput``: 16 short completions (10-20 tokens, ``max_tokens`` 1024) straight and
  through the gateway under ``strict`` and ``predictive``, as plain text, under a GBNF
  grammar and under a JSON schema (structured output); ``goodput_ratio`` is
  llama-server's wall time over the gateway's, for the same answers (1.0: the gateway
  costs nothing).
* ``overhead``: the gateway against the bare pass-through floor (a Starlette proxy on the
  same HTTP stack) and against the gateway of an earlier commit (``--against``, by
  default :data:`REFERENCE`), in front of an instant fake upstream (``bench/bench.py``'s):
  requests per second at 64 connections, JSON answers and 100-event SSE streams;
  ``ratio_floor`` and ``ratio_other`` are the gateway's over the floor's and the earlier
  gateway's; ``ratio_traced`` the gateway's with tracing on over its own without.
* ``burst``: 2,000 streams opened at once (one each, 30 events a second apart, from
  ``bench/streams.py``'s slow upstream), through the gateway and through the floor in
  turn (and through the earlier commit's gateway): each stream's time to its first
  event (p95), the streams served whole, and the peak RSS of the process in the middle.
* ``refusal``: honest refusals. The seed's three chats 0.2 s apart on a gateway with
  ``max_queue_wait_s`` 6 (one fits at a time, so two are doomed): how long the refused
  ones waited for their 503, and the first one's ``Retry-After`` against when it could
  really have started (``retry_after_over_real``; 1.0 is exact). Cells: whole / streamed
  answers, a fresh gateway / a warm one (one short answer served first).
* ``slo``: latency targets. Six streams of 150 tokens on llama-server ``-c 4096``, at
  once or 0.5 s apart, through a gateway without a target and one whose class has
  ``itl_p95_s`` 1.4 × one stream's ITL p95 alone: ITL p95 of each, and the targeted
  run's over the target (``itl_p95_over_target``). Cells: burst / staggered, the gateway
  with the target warm (three single streams first) / fresh.
* ``shared``: several processes sharing Redis. Three of the seed's chats with
  ``max_tokens`` 300 (any two overflow the pool together) through one gateway and
  through two processes sharing one ``redis-server``: served, upstream 500s, wall time.
* ``fakes``: Ollama and vLLM, which cannot run here, on the project's faithful fakes
  (labelled so in the table), straight and through the gateway: an Ollama model named
  in the configuration / only in the request, its over-long chat after an unload
  (silently cut by Ollama alone, refused by the gateway); vLLM's over-admission
  (preemptions alone, none through the gateway). ``bench/fakes_row.py``.

Each cell runs ``--repeats`` times (2 by default; the spread is the noise); ``--quick``
runs the first cell of each row once. Writes ``bench/results/<date>-<commit>.json``
(``--out``), prints every row as a Markdown table, and with ``--compare FILE`` each
metric against an earlier result, marked WORSE when it moved past the noise in the bad
direction. ``--write-docs`` puts the result's tables into the README and
``docs/benchmarks.md`` (their generated blocks; ``tests/test_scoreboard.py`` fails when
they differ from the latest committed result).

Run: ``make score`` (``make score-quick`` for one cell per row).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import datetime
import json
import multiprocessing as mp
import os
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))
sys.path.insert(0, str(ROOT / "scripts"))

import demo  # noqa: E402  (scripts/demo.py: the seed's prompt, the gateway's overflow count)
import fakes_row  # noqa: E402  (bench/fakes_row.py: the Ollama and vLLM fakes' row)
import goodput  # noqa: E402  (bench/goodput.py: the short answers' subjects)
import slo  # noqa: E402  (bench/slo.py: streams' client-side ITL)

import bench as overhead_bench  # noqa: E402  (bench/bench.py)
from gateway.dev.localbackend import LlamaServer, free_port, model_links  # noqa: E402
from gateway.dev.scoreboard import (  # noqa: E402
    REFERENCE,
    Cell,
    compare,
    doc_blocks,
    markdown,
    splice,
)

RESULTS = ROOT / "bench" / "results"
ROWS = ("overhead", "burst", "seed", "router", "goodput", "refusal", "slo", "shared",
        "fakes")

#: (Streams arriving staggered: the refusal row's seed chats, 0.2 s apart.)
SEED_CELLS = [{"answer": "whole", "arrivals": "burst"}, {"answer": "stream", "arrivals": "burst"},
              {"answer": "whole", "arrivals": "staggered"}]
ROUTER_CELLS = [{"answer": "whole", "arrivals": "burst"},
                {"answer": "stream", "arrivals": "burst"}]
ROUTER_MODEL = "gemma-3-270m"  # the model's name in the router's --models-dir
GOODPUT_CELLS = [{"policy": p, "output": o} for p in ("predictive", "strict")
                 for o in ("plain", "grammar", "schema")]
OVERHEAD_CELLS = [{"body": "sse"}, {"body": "json"}]
BURST_CELLS = [{"streams": "2000", "arrivals": "burst"}]
BURST_EVENTS = 30  # events per stream, one a second
REFUSAL_CELLS = [{"answer": a, "gateway": g} for g in ("fresh", "warm")
                 for a in ("whole", "stream")]
SLO_CELLS = [{"arrivals": a, "gateway": g} for g in ("warm", "fresh")
             for a in ("burst", "staggered")]
SHARED_CELLS = [{"answer": "whole"}, {"answer": "stream"}]
SLO_TOKENS = 150  # tokens per stream of the latency-target row
SLO_TARGET = 1.4  # the target: this many times one stream's ITL p95 alone


#: A sentence of words ending at a period: the grammar ends the answer there, within
#: 160 characters. Unbounded (``[A-Za-z ,]+``), the small model ran one answer of 16 to
#: the 1024-token cap in two runs of three, alone or batched as it happened: the cell
#: then timed that one answer, not the admission (measured 2026-12-07).
GRAMMAR = 'root ::= [A-Za-z ,]{1,160} "."'
#: A JSON answer of one short field (an agent's structured reply).
SCHEMA = {"type": "object", "properties": {"place": {"type": "string", "maxLength": 40}},
          "required": ["place"], "additionalProperties": False}


# -- running a gateway ----------------------------------------------------------------------

_GATEWAY_PIDS: dict[str, int] = {}  # the process of each gateway running, by its URL


@contextlib.contextmanager
def gateway(backend_url: str, tree: Path = ROOT, backend: dict[str, Any] | None = None,
            classes: list[dict[str, Any]] | None = None, redis_url: str | None = None,
            otel: dict[str, str] | None = None, **admission: Any) -> Iterator[str]:
    """``gateway serve`` (of the source ``tree``) in front of ``backend_url``, with
    ``[admission]`` settings (``server_*``: ``[server]`` ones), the ``backend``'s own,
    ``[[classes]]``, with ``redis_url`` state shared in that Redis, and ``otel``'s
    OpenTelemetry variables, as environment variables; yields its URL once ``/ready``."""
    port = free_port()
    server = {k.removeprefix("server_"): v for k, v in admission.items()
              if k.startswith("server_")}
    extra = {} if classes is None else {"GATEWAY_CLASSES": json.dumps(classes)}
    if redis_url is not None:
        extra |= {"GATEWAY_STATE__BACKEND": "redis", "GATEWAY_STATE__REDIS_URL": redis_url}
    extra |= otel or {}
    env = dict(os.environ, GATEWAY_SERVER__PORT=str(port), PYTHONPATH=str(tree),
               GATEWAY_SERVER__LOG_LEVEL="warning", **extra,
               GATEWAY_BACKENDS=json.dumps([{"name": "local", "url": backend_url,
                                             **(backend or {})}]),
               **{f"GATEWAY_ADMISSION__{k.upper()}": str(v) for k, v in admission.items()
                  if not k.startswith("server_")},
               **{f"GATEWAY_SERVER__{k.upper()}": str(v) for k, v in server.items()})
    proc = subprocess.Popen([sys.executable, "-m", "gateway", "serve"], env=env, cwd=tree,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    _GATEWAY_PIDS[url] = proc.pid
    try:
        deadline = time.monotonic() + 60
        while True:
            if proc.poll() is not None or time.monotonic() > deadline:
                raise SystemExit(f"the gateway in front of {backend_url} did not start")
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(url + "/ready", timeout=1).status_code == 200:
                    break
            time.sleep(0.1)
        yield url
    finally:
        _GATEWAY_PIDS.pop(url, None)
        proc.terminate()
        proc.wait(15)


# -- the seed scenario ----------------------------------------------------------------------

async def _one_chat(client: httpx.AsyncClient, url: str, body: dict[str, Any]
                    ) -> tuple[bool, bool]:
    """(served whole, failed with an upstream 500 or overflow)."""
    if not body.get("stream"):
        r = await client.post(url + "/v1/chat/completions", json=body)
        overflow = r.status_code == 500
        whole = (r.status_code == 200 and r.json().get("usage", {})
                 .get("completion_tokens") == body["max_tokens"])
        return whole, overflow
    async with client.stream("POST", url + "/v1/chat/completions", json=body) as r:
        if r.status_code != 200:
            await r.aread()
            return False, r.status_code == 500
        text = "".join([chunk async for chunk in r.aiter_text()])
    errored = '"error"' in text
    overflow = errored and ("exceeded" in text or "500" in text)
    return (text.rstrip().endswith("[DONE]") and not errored), overflow


async def seed_once(url: str, stream: bool, stagger_s: float, model: str | None = None
                    ) -> dict[str, float]:
    body: dict[str, Any] = {"messages": [{"role": "user", "content": demo.prompt()}],
                            "max_tokens": 900, "ignore_eos": True, "stream": stream}
    if model is not None:
        body["model"] = model
    start = time.monotonic()

    async def later(k: int) -> tuple[bool, bool]:
        await asyncio.sleep(k * stagger_s)
        return await _one_chat(client, url, body)

    async with httpx.AsyncClient(timeout=900) as client:
        outcomes = await asyncio.gather(*(later(k) for k in range(3)))
    return {"served": sum(o[0] for o in outcomes), "upstream_500": sum(o[1] for o in outcomes),
            "wall_s": time.monotonic() - start}


def row_seed(server: str, cells: list[dict[str, str]], repeats: int, row: str = "seed",
             model: str | None = None) -> list[Cell]:
    """:func:`seed_once` straight to ``server`` and through a gateway in front of it,
    each cell ``repeats`` times (``model``: named in every request; ``row``: the
    cells' row)."""
    out = []
    with gateway(server, max_queue_wait_s=600) as gw:
        for axes in cells:
            metrics: dict[str, list[float]] = {}
            for _ in range(repeats):
                stream, stagger = axes["answer"] == "stream", (
                    0.2 if axes["arrivals"] == "staggered" else 0.0)
                direct = asyncio.run(seed_once(server, stream, stagger, model))
                before = demo.upstream_overflows(gw)
                through = asyncio.run(seed_once(gw, stream, stagger, model))
                through["upstream_500"] = max(through["upstream_500"],
                                              demo.upstream_overflows(gw) - before)
                for side, got in (("direct", direct), ("gateway", through)):
                    for name in ("served", "upstream_500"):
                        metrics.setdefault(f"{name}_{side}", []).append(got[name])
                    metrics.setdefault(f"wall_{side}_s", []).append(round(got["wall_s"], 2))
            out.append(Cell(row, axes, metrics))
            print(markdown(out[-1:]), flush=True)
    return out


def row_router(cells: list[dict[str, str]], repeats: int) -> list[Cell]:
    """:func:`row_seed` on llama-server in router mode, the model named in each request
    only; the model is loaded first (one short chat), so that no cell times its load."""
    with tempfile.TemporaryDirectory() as folder:
        models = model_links(Path(folder), [ROUTER_MODEL])
        with LlamaServer(["-c", "2048"], models_dir=models).running() as server:
            httpx.post(server.url + "/v1/chat/completions", timeout=300, json={
                "model": ROUTER_MODEL, "max_tokens": 1,
                "messages": [{"role": "user", "content": "Hi"}]}).raise_for_status()
            return row_seed(server.url, cells, repeats, row="router", model=ROUTER_MODEL)


# -- goodput --------------------------------------------------------------------------------

async def short_answers(url: str, output: str) -> tuple[int, float, int]:
    """16 short completions at once: (served, wall seconds, the longest answer's
    completion tokens: an answer run to its cap shows there)."""
    extra: dict[str, Any] = {"plain": {"stop": ["."]}, "grammar": {"grammar": GRAMMAR},
                             "schema": {"json_schema": SCHEMA}}[output]
    bodies = [{"prompt": f"My first visit to the {s}", "max_tokens": 1024,
               "temperature": 0, **extra} for s in goodput.SUBJECTS]
    start = time.monotonic()
    async with httpx.AsyncClient(timeout=900) as client:
        replies = await asyncio.gather(*(client.post(url + "/v1/completions", json=b)
                                         for b in bodies))
    wall = time.monotonic() - start
    longest = max((r.json().get("usage", {}).get("completion_tokens", 0)
                   for r in replies if r.status_code == 200), default=0)
    return sum(r.status_code == 200 for r in replies), wall, longest


def row_goodput(server: str, cells: list[dict[str, str]], repeats: int) -> list[Cell]:
    out = []
    for policy in dict.fromkeys(c["policy"] for c in cells):
        with gateway(server, policy=policy, max_queue_wait_s=600, max_queue=64) as gw:
            for axes in [c for c in cells if c["policy"] == policy]:
                output = axes["output"]
                asyncio.run(short_answers(gw, output))  # warm-up: predictive learns
                metrics: dict[str, list[float]] = {}
                for _ in range(repeats):
                    served_d, wall_d, long_d = asyncio.run(short_answers(server, output))
                    served_g, wall_g, long_g = asyncio.run(short_answers(gw, output))
                    for name, value in (("served_direct", served_d), ("served_gateway", served_g),
                                        ("longest_direct", long_d), ("longest_gateway", long_g),
                                        ("wall_direct_s", round(wall_d, 2)),
                                        ("wall_gateway_s", round(wall_g, 2)),
                                        ("goodput_ratio", round(wall_d / wall_g, 3))):
                        metrics.setdefault(name, []).append(value)
                out.append(Cell("goodput", axes, metrics))
                print(markdown(out[-1:]), flush=True)
    return out


# -- honest refusals -------------------------------------------------------------------------

async def refusal_once(url: str, stream: bool) -> dict[str, float]:
    """The seed's three chats 0.2 s apart on a gateway with ``max_queue_wait_s`` 6: one
    fits the pool at a time, so the second and third cannot start within 6 s. Returns
    the requests served and refused, the longest a refused one waited for its 503, the
    first refused one's ``Retry-After`` and when it could really have started (the
    served one's end, from its arrival), seconds."""
    body = {"messages": [{"role": "user", "content": demo.prompt()}], "max_tokens": 900,
            "ignore_eos": True, "stream": stream}
    start = time.monotonic()

    async def later(k: int) -> tuple[int, float, float, float]:
        """(status, arrival, seconds to the answer's end, Retry-After or 0)."""
        await asyncio.sleep(k * 0.2)
        sent = time.monotonic()
        async with client.stream("POST", url + "/v1/chat/completions", json=body) as r:
            await r.aread()
        return (r.status_code, sent - start, time.monotonic() - sent,
                float(r.headers.get("retry-after", 0)))

    async with httpx.AsyncClient(timeout=900) as client:
        outcomes = await asyncio.gather(*(later(k) for k in range(3)))
    served = [o for o in outcomes if o[0] == 200]
    refused = [o for o in outcomes if o[0] == 503]
    got = {"served": len(served), "refused": len(refused),
           "refused_after_s": max((o[2] for o in refused), default=0.0)}
    if served and refused:
        real = served[0][1] + served[0][2] - refused[0][1]
        got |= {"retry_after_s": refused[0][3], "real_start_s": real,
                "retry_after_over_real": refused[0][3] / real}
    return got


def row_refusal(server: str, cells: list[dict[str, str]], repeats: int) -> list[Cell]:
    """:func:`refusal_once` on a fresh gateway (started for each repeat) and on a warm
    one (that has just served one short answer of the same kind alone)."""
    out = []
    for axes in cells:
        stream = axes["answer"] == "stream"
        metrics: dict[str, list[float]] = {}
        for _ in range(repeats):
            with gateway(server, max_queue_wait_s=6) as gw:
                if axes["gateway"] == "warm":
                    httpx.post(gw + "/v1/chat/completions", timeout=300, json={
                        "messages": [{"role": "user", "content": demo.prompt()}],
                        "max_tokens": 64, "ignore_eos": True, "stream": stream})
                got = asyncio.run(refusal_once(gw, stream))
            for name, value in got.items():
                metrics.setdefault(name, []).append(round(value, 3))
        out.append(Cell("refusal", axes, metrics))
        print(markdown(out[-1:]), flush=True)
    return out


# -- latency targets --------------------------------------------------------------------------

def _itl_p95(run: slo.Run) -> float:
    return slo.quantile(run.gaps, 0.95) if run.gaps else float("nan")


def row_slo(server: str, cells: list[dict[str, str]], repeats: int) -> list[Cell]:
    """Six streams of :data:`SLO_TOKENS` tokens (every third with a 300-word prompt),
    at once or 0.5 s apart, through a gateway without a target and through one whose
    class has ``itl_p95_s`` = :data:`SLO_TARGET` × one stream's ITL p95 alone (measured
    first, straight to llama-server). ``warm``: the gateway with the target has served
    three single streams first; ``fresh``: it is new (the gateway without a target
    learns nothing that changes its admission, so its run of each arrivals and repeat
    is measured once and shown in both cells). ITL p95 in milliseconds;
    ``itl_p95_over_target`` is the targeted run's over the target (≤ 1.1: held)."""
    alone = asyncio.run(slo.rounds(server, 1, SLO_TOKENS, 3, 0))
    target = SLO_TARGET * _itl_p95(alone)
    out = []
    nones: dict[tuple[str, int], dict[str, float]] = {}  # (arrivals, repeat) -> got
    for axes in cells:
        stagger = 0.5 if axes["arrivals"] == "staggered" else 0.0
        metrics: dict[str, list[float]] = {}
        for repeat in range(repeats):
            got: dict[str, float] = {"target_ms": target * 1000}
            for side, classes in (("none", None),
                                  ("target", [{"name": "chat", "itl_p95_s": target}])):
                if classes is None and (axes["arrivals"], repeat) in nones:
                    got |= nones[axes["arrivals"], repeat]  # (no target: warm = fresh)
                    continue
                with gateway(server, classes=classes, max_queue_wait_s=600) as gw:
                    if classes is not None and axes["gateway"] == "warm":
                        asyncio.run(slo.rounds(gw, 1, SLO_TOKENS, 3, 0))
                    run = asyncio.run(slo.rounds(gw, 6, SLO_TOKENS, 1, 300, stagger))
                side_got = {f"itl_p95_ms_{side}": _itl_p95(run) * 1000,
                            f"refused_{side}": run.refused, f"failed_{side}": run.failed,
                            f"wall_{side}_s": run.wall_s}
                if classes is None:
                    nones[axes["arrivals"], repeat] = side_got
                got |= side_got
            got["itl_p95_over_target"] = got["itl_p95_ms_target"] / got["target_ms"]
            for name, value in got.items():
                metrics.setdefault(name, []).append(round(value, 3))
        out.append(Cell("slo", axes, metrics))
        print(markdown(out[-1:]), flush=True)
    return out


# -- several processes sharing Redis ----------------------------------------------------------

def row_shared(server: str, cells: list[dict[str, str]], repeats: int) -> list[Cell]:
    """The seed's chats with ``max_tokens`` 300 (any two overflow the pool together),
    three at once, through one gateway and through two processes sharing one Redis
    (the second chat to the second process): served, upstream 500s and wall time;
    ``goodput_ratio`` is one process's wall time over the two's."""
    from gateway.dev.redisserver import RedisServer

    out = []
    with tempfile.TemporaryDirectory() as work:
        redis = RedisServer(work).start()
        try:
            for axes in cells:
                stream = axes["answer"] == "stream"
                metrics: dict[str, list[float]] = {}
                for _ in range(repeats):
                    got = {}
                    with contextlib.ExitStack() as stack:
                        one = stack.enter_context(gateway(server, max_queue_wait_s=600))
                        pair = [stack.enter_context(gateway(
                            server, redis_url=redis.url, max_queue_wait_s=600))
                            for _ in range(2)]
                        for side, urls in (("one", [one]), ("two", pair)):
                            before = sum(demo.upstream_overflows(u) for u in urls)
                            r = asyncio.run(_chats(urls, stream))
                            r["upstream_500"] = max(r["upstream_500"], sum(
                                demo.upstream_overflows(u) for u in urls) - before)
                            got |= {f"{k}_{side}": v for k, v in r.items()}
                    got["goodput_ratio"] = got["wall_s_one"] / got["wall_s_two"]
                    for name, value in got.items():
                        metrics.setdefault(name, []).append(round(value, 3))
                out.append(Cell("shared", axes, metrics))
                print(markdown(out[-1:]), flush=True)
        finally:
            redis.stop()
    return out


async def _chats(urls: list[str], stream: bool) -> dict[str, float]:
    """Three seed chats (``max_tokens`` 300) at once, the k-th to ``urls[k % len]``."""
    body = {"messages": [{"role": "user", "content": demo.prompt()}], "max_tokens": 300,
            "ignore_eos": True, "stream": stream}
    start = time.monotonic()
    async with httpx.AsyncClient(timeout=900) as client:
        outcomes = await asyncio.gather(*(_one_chat(client, urls[k % len(urls)], body)
                                          for k in range(3)))
    return {"served": sum(o[0] for o in outcomes), "upstream_500": sum(o[1] for o in outcomes),
            "wall_s": time.monotonic() - start}


# -- overhead against the floor ---------------------------------------------------------------

def row_overhead(cells: list[dict[str, str]], repeats: int, seconds: float,
                 other_tree: str | None = None) -> list[Cell]:
    """The gateway and the bare aiohttp pass-through (and the gateway of
    ``other_tree``), in front of bench/bench.py's instant upstream, each measured for
    ``seconds`` at 64 connections, in turn; and the gateway with OpenTelemetry tracing
    on (every request sampled, OTLP/HTTP to a sink that keeps nothing:
    :func:`bench.run_trace_sink`), whose ``ratio_traced`` is its throughput over the
    gateway's without tracing."""
    b = overhead_bench
    up_port, floor_port, sink_port = free_port(), free_port(), free_port()
    procs = [mp.Process(target=b.run_upstream, args=(up_port,), daemon=True),
             mp.Process(target=b.run_bare_proxy, args=(floor_port, up_port, "aiohttp"),
                        daemon=True),
             mp.Process(target=b.run_trace_sink, args=(sink_port,), daemon=True)]
    for proc in procs:
        proc.start()
    b.wait_http(f"http://127.0.0.1:{up_port}/props")
    b.wait_http(f"http://127.0.0.1:{floor_port}/props")
    out = []
    try:
        with contextlib.ExitStack() as stack:
            # (as bench/bench.py: a slot of its own for each request, none waits)
            own = {"kv_unified": False}
            gw = stack.enter_context(gateway(f"http://127.0.0.1:{up_port}", backend=own,
                                             max_queue=100000))
            traced = stack.enter_context(gateway(
                f"http://127.0.0.1:{up_port}", backend=own, max_queue=100000, otel={
                    "OTEL_TRACES_EXPORTER": "otlp",
                    "OTEL_EXPORTER_OTLP_ENDPOINT": f"http://127.0.0.1:{sink_port}"}))
            other = None if other_tree is None else stack.enter_context(gateway(
                f"http://127.0.0.1:{up_port}", tree=Path(other_tree), backend=own,
                max_queue=100000))
            for axes in cells:
                stream = axes["body"] == "sse"
                metrics: dict[str, list[float]] = {}
                for _ in range(repeats):
                    floor = b.measure(f"http://127.0.0.1:{floor_port}/v1/chat/completions",
                                      64, seconds, stream)
                    mine = b.measure(gw + "/v1/chat/completions", 64, seconds, stream)
                    got = {"rps_floor": floor["rps"], "rps_gateway": mine["rps"],
                           "ratio_floor": mine["rps"] / floor["rps"],
                           "errors_gateway": mine["errors"]}
                    on = b.measure(traced + "/v1/chat/completions", 64, seconds, stream)
                    got |= {"rps_traced": on["rps"], "ratio_traced": on["rps"] / mine["rps"]}
                    if other is not None:
                        theirs = b.measure(other + "/v1/chat/completions", 64, seconds, stream)
                        got |= {"rps_other": theirs["rps"],
                                "ratio_other": mine["rps"] / theirs["rps"]}
                    for name, value in got.items():
                        metrics.setdefault(name, []).append(round(value, 3))
                out.append(Cell("overhead", axes, metrics))
                print(markdown(out[-1:]), flush=True)
    finally:
        for proc in procs:
            proc.terminate()
    return out


# -- a burst of streams ----------------------------------------------------------------------

def row_burst(cells: list[dict[str, str]], repeats: int, other_tree: str | None = None
              ) -> list[Cell]:
    """``streams`` streams opened at once (bench/streams.py's clients, no ramp, one
    stream each) through the gateway and through the bare aiohttp pass-through, in turn,
    in front of bench/streams.py's slow upstream (:data:`BURST_EVENTS` events, one a
    second): the time to each stream's first event (p95), streams served whole, and the
    peak RSS of the process in the middle; and through the gateway of ``other_tree``
    too, when given (``_other``)."""
    import streams as burst_bench  # bench/streams.py

    out = []
    for axes in cells:
        n = int(axes["streams"])
        up_port, floor_port = free_port(), free_port()
        procs = [mp.Process(target=burst_bench.run_slow_upstream,
                            args=(up_port, BURST_EVENTS), daemon=True),
                 mp.Process(target=overhead_bench.run_bare_proxy,
                            args=(floor_port, up_port, "aiohttp", True), daemon=True)]
        for proc in procs:
            proc.start()
        overhead_bench.wait_http(f"http://127.0.0.1:{up_port}/props")
        overhead_bench.wait_http(f"http://127.0.0.1:{floor_port}/props")
        metrics: dict[str, list[float]] = {}
        try:
            # (as bench/streams.py: a slot of its own for each stream, none waits)
            settings = {"backend": {"kv_unified": False}, "max_queue": 100000,
                        "max_queue_wait_s": 600, "server_max_connections": 2 * n + 100}
            with contextlib.ExitStack() as stack:
                targets = [("floor", f"http://127.0.0.1:{floor_port}", procs[1].pid),
                           ("gateway", stack.enter_context(gateway(
                               f"http://127.0.0.1:{up_port}", **settings)), 0)]
                if other_tree is not None:
                    targets.append(("other", stack.enter_context(gateway(
                        f"http://127.0.0.1:{up_port}", tree=Path(other_tree), **settings)), 0))
                for _ in range(repeats):
                    got = {}
                    for who, url, pid in targets:
                        pid = pid or _GATEWAY_PIDS[url]
                        r = asyncio.run(burst_bench.hold_streams(
                            url + "/v1/chat/completions", n, 0.0, 1.0, pid))
                        got |= {f"first_event_p95_s_{who}": r["ttft_p95_s"],
                                f"served_{who}": r["whole"],
                                f"peak_rss_mib_{who}": r["peak_mib"]}
                    for name, value in got.items():
                        metrics.setdefault(name, []).append(round(value, 3))
        finally:
            for proc in procs:
                proc.terminate()
        out.append(Cell("burst", axes, metrics))
        print(markdown(out[-1:]), flush=True)
    return out


def reference_tree(rev: str) -> Path:
    """The source of commit ``rev`` of this repository (``git archive``), kept under
    ``~/.cache/llm-gateway/trees/<its full hash>`` for the next run.

    :raises SystemExit: ``rev`` is not in this clone's history.
    """
    sha = subprocess.run(["git", "rev-parse", "--verify", "--quiet", f"{rev}^{{commit}}"],
                         cwd=ROOT, capture_output=True, text=True).stdout.strip()
    if not sha:
        raise SystemExit(f"--against {rev}: not a commit of this clone's history")
    tree = Path.home() / ".cache" / "llm-gateway" / "trees" / sha
    if not (tree / "gateway").is_dir():
        tree.mkdir(parents=True, exist_ok=True)
        archive = subprocess.run(["git", "archive", sha], cwd=ROOT, capture_output=True,
                                 check=True)
        subprocess.run(["tar", "-x", "-C", str(tree)], input=archive.stdout, check=True)
    return tree


# -- the command ------------------------------------------------------------------------------

def commit() -> str:
    def git(*args: str) -> str:
        return subprocess.run(["git", *args], cwd=ROOT, capture_output=True,
                              text=True).stdout.strip()
    short = git("rev-parse", "--short", "HEAD") or "unknown"
    return short + ("-dirty" if git("status", "--porcelain", "--", "gateway") else "")


def machine(build: str) -> str:
    return (f"{os.cpu_count()} cores, Python {sys.version.split()[0]}, "
            f"llama-server {build}, Gemma 3 270M Q4_K_M")


def run(rows: list[str], quick: bool, repeats: int, seconds: float,
        other_tree: str | None = None) -> tuple[list[Cell], dict[str, str]]:
    """Every row of ``rows`` in turn: the cells measured, and what went wrong, by row.

    A row that fails (an exception: once, a request sent straight to llama-server on
    the connection its last stream had closed, before clients here used
    :data:`~gateway.dev.localbackend.NO_KEEPALIVE`) is said on stderr and
    run once more from the start, each llama-server row on a server of its own; a
    second failure leaves the row out of the result, and the failures stay in it
    (``failed``), so that one row cannot lose the half-hour run of the others."""
    pick: Callable[[list[dict[str, str]]], list[dict[str, str]]] = (
        (lambda cells: cells[:1]) if quick else (lambda cells: cells))

    def on_llama(ctx: list[str], row: Callable[[str], list[Cell]]) -> Callable[[], list[Cell]]:
        def go() -> list[Cell]:
            with LlamaServer(ctx).running() as server:
                return row(server.url)
        return go

    plan: dict[str, Callable[[], list[Cell]]] = {
        "overhead": lambda: row_overhead(pick(OVERHEAD_CELLS), repeats, seconds, other_tree),
        "burst": lambda: row_burst(pick(BURST_CELLS), repeats, other_tree),
        "seed": on_llama(["-c", "2048"], lambda u: row_seed(u, pick(SEED_CELLS), repeats)),
        "router": lambda: row_router(pick(ROUTER_CELLS), repeats),
        "goodput": on_llama(["-c", "2048"],
                            lambda u: row_goodput(u, pick(GOODPUT_CELLS), repeats)),
        "refusal": on_llama(["-c", "2048"],
                            lambda u: row_refusal(u, pick(REFUSAL_CELLS), repeats)),
        "shared": on_llama(["-c", "2048"], lambda u: row_shared(u, pick(SHARED_CELLS), repeats)),
        "slo": on_llama(["-c", "4096"], lambda u: row_slo(u, pick(SLO_CELLS), repeats)),
        "fakes": lambda: fakes_row.row_fakes(pick(fakes_row.CELLS), repeats),
    }
    cells: list[Cell] = []
    failed: dict[str, str] = {}
    for name in [r for r in plan if r in rows]:
        for attempt in (1, 2):
            try:
                got = plan[name]()
            except Exception as exc:  # noqa: BLE001 (said, kept, and the run goes on)
                traceback.print_exc()
                failed[name] = (failed.get(name, "") + f" attempt {attempt}: {exc!r}").strip()
                print(f"row {name} failed (attempt {attempt}): {exc!r}", file=sys.stderr,
                      flush=True)
                continue
            cells += got
            if name == "fakes":
                print(markdown(got), flush=True)
            break
    return cells, failed


def write_docs(head: dict[str, Any], cells: list[Cell]) -> None:
    from gateway.dev.scoreboard import BLOCKS

    for name, block in doc_blocks(head, cells).items():
        for file in BLOCKS[name][0]:
            path = ROOT / file
            path.write_text(splice(path.read_text(), name, block))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rows", default=",".join(ROWS))
    parser.add_argument("--quick", action="store_true", help="one cell per row, once")
    parser.add_argument("--repeats", type=int, default=2, help="runs of each cell")
    parser.add_argument("--seconds", type=float, default=5.0,
                        help="per overhead measurement")
    parser.add_argument("--other-tree", metavar="DIR", help="also run the gateway of another "
                        "source tree (a checkout of an earlier commit) in the overhead row, "
                        "side by side: rps_other, and ratio_other (this tree's over it)")
    parser.add_argument("--against", metavar="REV", default=REFERENCE,
                        help="the commit whose gateway is the other tree when --other-tree "
                        f"is not given (default {REFERENCE}; 'none': no other tree)")
    parser.add_argument("--out", type=Path, help="the result file (default: "
                        "bench/results/<date>-<commit>.json)")
    parser.add_argument("--compare", type=Path, metavar="FILE",
                        help="an earlier result to compare with")
    parser.add_argument("--write-docs", action="store_true",
                        help="put this result's tables into the README and docs")
    parser.add_argument("--docs-from", type=Path, metavar="FILE",
                        help="only put the tables of an earlier result into the docs")
    args = parser.parse_args(argv)
    if args.docs_from:
        from gateway.dev.scoreboard import load

        head, cells = load(args.docs_from)
        write_docs(head, cells)
        return 0
    rows = [r.strip() for r in args.rows.split(",") if r.strip()]
    repeats = 1 if args.quick else max(2, args.repeats)
    started = time.monotonic()
    other_tree = args.other_tree
    if other_tree is None and args.against != "none" and {"overhead", "burst"} & set(rows):
        other_tree = str(reference_tree(args.against))
    cells, failed = run(rows, args.quick, repeats, min(3.0, args.seconds) if args.quick
                        else args.seconds, other_tree)
    now = datetime.datetime.now(datetime.UTC)
    build = LlamaServer([]).binary.parent.name if set(rows) - {"overhead", "burst"} else "-"
    head = {"commit": commit(), "date": now.strftime("%Y-%m-%d"),
            "created": now.isoformat(timespec="seconds"), "quick": args.quick,
            "rows": rows, "machine": machine(build),
            "against": args.other_tree or args.against,
            "seconds": round(time.monotonic() - started), "failed": failed}
    # A quick run is a check, not a result to commit: it goes to results/quick/ (ignored).
    folder = RESULTS / "quick" if args.quick else RESULTS
    out = args.out or folder / f"{head['date']}-{head['commit']}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({**head, "cells": [c.as_json() for c in cells]}, indent=1) + "\n")
    shown = out.relative_to(ROOT) if out.is_relative_to(ROOT) else out
    print(f"\n{markdown(cells)}\nwritten to {shown} ({head['seconds']} s)")
    for row, why in failed.items():
        print(f"row {row} failed: {why}")
    if args.compare:
        from gateway.dev.scoreboard import load

        _, before = load(args.compare)
        print(f"\nagainst {args.compare}:")
        for change in compare(before, cells):
            print("  " + change.line())
    if args.write_docs:
        write_docs(head, cells)
    return 0


if __name__ == "__main__":
    sys.exit(main())
