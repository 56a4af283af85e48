"""Gateway overhead against a direct call, side by side, on a fixed-response upstream.

Starts (each in its own process):
* an upstream that answers instantly with fixed JSON, shaped like llama-server
  (``/props``, ``/v1/chat/completions/input_tokens``, ``/v1/chat/completions``);
* the gateway in front of it (``gateway serve``, uvloop + h11), configured with
  enough slots that admission never queues, so what is measured is the proxy path:
  validation, the exact-count call upstream, reservation, forwarding, metrics, and its
  access line at the default INFO level (to a discarded stderr); a second gateway with
  ``access_log = false`` prices that line on the ``kept`` rows;
* a load generator (aiohttp, closed loop) at 4 and at 64 connections, for a fixed time,
  first straight at the upstream, then at the gateway; then streams (``stream: true``,
  100 events each, written one by one as llama-server writes tokens, and the connection
  closed after each, as llama-server closes it) at 64 connections. Each is run twice:
  ``kept``, one prompt sent again and again (the gateway counts it once, then reuses
  the count: gateway/backends/countcache.py), and ``new``, a new prompt in every request (each
  counted by a second upstream call).

Also measured, as floors: two bare Starlette pass-through proxies, one on httpx's default
transport and one on the httpx-aiohttp transport the gateway uses. Prints requests/s and
p50/p99 latency for each, the latency added over a direct call, and throughput ratios.
Figures, not asserts: the machine is noisy, compare within one run.
``--only sse`` or ``--only json`` runs one part.

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
from typing import Any

CHAT = {"messages": [{"role": "user", "content": "hello there"}], "max_tokens": 16}
STREAM_EVENTS = 100  # events per streamed answer
# llama-server names its model file's path in every answer; the gateway renames it
# (gateway/wire/naming.py), so each event and answer here carries one too.
MODEL = b'"model":"/models/bench-model-q4_k_m.gguf"'
DELTA = (b'data: {"choices":[{"index":0,"delta":{"content":"tok"},"finish_reason":null}],'
         b'"created":1,"id":"chatcmpl-1",' + MODEL + b',"object":"chat.completion.chunk"}\n\n')
FINAL = (b'data: {"choices":[{"index":0,"delta":{},"finish_reason":"length"}],' + MODEL
         + b'}\n\ndata: {"choices":[],' + MODEL + b',"usage":{"prompt_tokens":10,'
         b'"completion_tokens":100,"total_tokens":110}}\n\ndata: [DONE]\n\n')
ANSWER = json.dumps({
    "object": "chat.completion", "model": "/models/bench-model-q4_k_m.gguf",
    "choices": [{"index": 0, "finish_reason": "stop",
                 "message": {"role": "assistant", "content": "hi"}}],
    "usage": {"prompt_tokens": 10, "completion_tokens": 1, "total_tokens": 11},
}).encode()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def add_llama_routes(app: Any) -> None:
    """The llama-server routes besides generation that the gateway calls: ``/props``
    (4,096 slots of 4,096 tokens, so admission never queues), the chat count and
    ``/tokenize`` (asked once, by the build survey at discovery)."""
    from aiohttp import web

    async def count(request: web.Request) -> web.Response:
        await request.read()
        return web.json_response({"object": "response.input_tokens", "input_tokens": 10})

    async def props(request: web.Request) -> web.Response:
        return web.json_response(
            {"total_slots": 4096, "default_generation_settings": {"n_ctx": 4096}})

    async def tokenize(request: web.Request) -> web.Response:
        await request.read()
        return web.json_response({"tokens": [1, 2, 3]})

    app.router.add_post("/v1/chat/completions/input_tokens", count)
    app.router.add_post("/tokenize", tokenize)  # the gateway's build survey asks it
    app.router.add_get("/props", props)


async def stream_answer(request: Any, event: bytes, count: int, final: bytes,
                        gap_s: float = 0.0) -> Any:
    """Answer ``request`` with ``count`` copies of the SSE ``event`` (each followed by
    ``gap_s`` seconds of silence), then ``final``, and close the connection after it, as
    llama-server does after every stream."""
    from aiohttp import web

    resp = web.StreamResponse(headers={"content-type": "text/event-stream"})
    resp.force_close()  # so the floor pays a new upstream connection per stream too
    await resp.prepare(request)
    for _ in range(count):
        await resp.write(event)
        if gap_s:
            await asyncio.sleep(gap_s)
    await resp.write(final)
    await resp.write_eof()
    return resp


def serve_upstream(chat: Any, port: int, backlog: int = 128) -> None:
    """Serve ``chat`` on ``/v1/chat/completions``, with the other llama-server routes the
    gateway calls (:func:`add_llama_routes`), on 127.0.0.1:``port``, until killed."""
    from aiohttp import web

    app = web.Application()
    app.router.add_post("/v1/chat/completions", chat)
    add_llama_routes(app)
    web.run_app(app, host="127.0.0.1", port=port, print=None, access_log=None,
                backlog=backlog)


def run_trace_sink(port: int) -> None:
    """An OTLP/HTTP collector stand-in on 127.0.0.1:``port`` that takes every export
    (``POST /v1/traces``) and keeps nothing: where a traced gateway's spans go when only
    the gateway's cost of tracing is measured."""
    from aiohttp import web

    async def traces(request: web.Request) -> web.Response:
        await request.read()
        return web.Response(body=b"", content_type="application/x-protobuf")

    app = web.Application()
    app.router.add_post("/v1/traces", traces)
    web.run_app(app, host="127.0.0.1", port=port, print=None, access_log=None)


def run_upstream(port: int) -> None:
    from aiohttp import web

    async def chat(request: web.Request) -> web.StreamResponse:
        body = await request.read()
        if b'"stream":true' not in body.replace(b" ", b""):
            return web.Response(body=ANSWER, content_type="application/json")
        return await stream_answer(request, DELTA, STREAM_EVENTS - 1, FINAL)

    serve_upstream(chat, port)


def run_bare_proxy(port: int, upstream_port: int, transport: str,
                   unbounded: bool = False) -> None:
    """A bare Starlette pass-through proxy: the floor any httpx-based gateway starts from.
    ``unbounded``: no connection limit and no timeout (aiohttp's default pool holds 100
    connections, and httpx times out after 5 s), for thousands of open streams."""
    import httpx
    import uvicorn
    from starlette.applications import Starlette
    from starlette.requests import Request
    from starlette.responses import Response, StreamingResponse
    from starlette.routing import Route

    if transport == "aiohttp":
        from httpx_aiohttp import AiohttpTransport

        if unbounded:
            import aiohttp

            client = httpx.AsyncClient(timeout=None, transport=AiohttpTransport(
                client=lambda: aiohttp.ClientSession(
                    connector=aiohttp.TCPConnector(limit=0))))
        else:
            client = httpx.AsyncClient(transport=AiohttpTransport())
    else:
        client = httpx.AsyncClient(limits=httpx.Limits(max_connections=256))
    target = f"http://127.0.0.1:{upstream_port}/v1/chat/completions"

    async def forward(request: Request) -> Response:
        body = await request.body()
        if b'"stream":true' in body.replace(b" ", b""):
            up = await client.send(client.build_request(
                "POST", target, content=body, headers={"content-type": "application/json"}),
                stream=True)

            async def relay() -> object:
                try:
                    async for chunk in up.aiter_raw():
                        yield chunk
                finally:
                    await up.aclose()
            return StreamingResponse(relay(), up.status_code, media_type="text/event-stream")
        r = await client.post(target, content=body, headers={"content-type": "application/json"})
        return Response(r.content, r.status_code, media_type="application/json")

    app = Starlette(routes=[Route("/v1/chat/completions", forward, methods=["POST"]),
                            Route("/props", lambda r: Response("{}"), methods=["GET"])])
    uvicorn.run(app, host="127.0.0.1", port=port, log_level="warning", loop="uvloop",
                http="h11")


async def _load(url: str, connections: int, seconds: float, stream: bool = False,
                unique: bool = False) -> tuple[int, list[float], int]:
    import aiohttp

    latencies: list[float] = []
    errors = 0
    chat = {**CHAT, "max_tokens": STREAM_EVENTS, "stream": True} if stream else CHAT
    body = json.dumps(chat).encode()
    deadline = time.perf_counter() + seconds
    conn = aiohttp.TCPConnector(limit=connections)
    async with aiohttp.ClientSession(connector=conn) as session:

        async def worker(number: int) -> None:
            nonlocal errors
            sent = 0
            while time.perf_counter() < deadline:
                if unique:  # a prompt never sent before: the gateway must count it
                    sent += 1
                    body_now = json.dumps({**chat, "messages": [{
                        "role": "user", "content": f"hello there {number}.{sent}"}]}).encode()
                else:
                    body_now = body
                t0 = time.perf_counter()
                async with session.post(url, data=body_now,
                                        headers={"content-type": "application/json"}) as r:
                    data = await r.read()
                    if r.status != 200 or (stream and not data.endswith(b"[DONE]\n\n")):
                        errors += 1
                latencies.append(time.perf_counter() - t0)

        await asyncio.gather(*(worker(n) for n in range(connections)))
    return len(latencies), latencies, errors


def load(url: str, connections: int, seconds: float, out: mp.Queue,  # type: ignore[type-arg]
         stream: bool = False, unique: bool = False) -> None:
    try:
        import uvloop

        uvloop.install()
    except ImportError:
        pass
    n, lat, errors = asyncio.run(_load(url, connections, seconds, stream, unique))
    out.put((n, lat, errors))


def measure(url: str, connections: int, seconds: float, stream: bool = False,
            unique: bool = False) -> dict[str, float]:
    q: mp.Queue = mp.Queue()  # type: ignore[type-arg]
    proc = mp.Process(target=load, args=(url, connections, seconds, q, stream, unique))
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
    parser.add_argument("--only", choices=["json", "sse"], help="run one part")
    parser.add_argument("--compare-with", metavar="DIR", help="also run the gateway of "
                        "another source tree (a checkout of an earlier commit, say) beside "
                        "this one, in the same run, as the row 'gateway, other tree'")
    args = parser.parse_args()
    up_port, gw_port, quiet_port = free_port(), free_port(), free_port()
    upstream = mp.Process(target=run_upstream, args=(up_port,), daemon=True)
    upstream.start()
    wait_http(f"http://127.0.0.1:{up_port}/props")
    env = dict(
        os.environ, GATEWAY_SERVER__PORT=str(gw_port), GATEWAY_SERVER__LOG_LEVEL="info",
        GATEWAY_ADMISSION__MAX_QUEUE="100000",
        GATEWAY_BACKENDS=json.dumps([{"name": "bench", "url": f"http://127.0.0.1:{up_port}",
                                      "kv_unified": False}]),
    )
    # The gateway as configured by default (INFO, one access line per request, written
    # to a discarded stderr), and the same without its access line, to price that line.
    gateway = subprocess.Popen([sys.executable, "-m", "gateway", "serve"], env=env,
                               stderr=subprocess.DEVNULL)
    quiet = subprocess.Popen([sys.executable, "-m", "gateway", "serve"], env={
        **env, "GATEWAY_SERVER__PORT": str(quiet_port),
        "GATEWAY_SERVER__ACCESS_LOG": "false"}, stderr=subprocess.DEVNULL)
    others = []
    if args.compare_with:
        other_port = free_port()
        others.append(("gateway, other tree", other_port, subprocess.Popen(
            [sys.executable, "-m", "gateway", "serve"], cwd=args.compare_with,
            env={**env, "GATEWAY_SERVER__PORT": str(other_port),
                 "PYTHONPATH": os.path.abspath(args.compare_with)},
            stderr=subprocess.DEVNULL)))
    bare = {}
    for transport in ("httpx", "aiohttp"):
        port = free_port()
        proc = mp.Process(target=run_bare_proxy, args=(port, up_port, transport), daemon=True)
        proc.start()
        bare[transport] = (port, proc)
    targets = [("direct", up_port)] + [(f"bare proxy, {t}", p) for t, (p, _) in bare.items()]
    targets += [("gateway", gw_port), ("gateway, no access", quiet_port)]
    targets += [(label, port) for label, port, _ in others]
    rows = []
    try:
        wait_http(f"http://127.0.0.1:{gw_port}/ready")
        wait_http(f"http://127.0.0.1:{quiet_port}/ready")
        for _, port, _ in others:
            wait_http(f"http://127.0.0.1:{port}/ready")
        for port, _ in bare.values():
            wait_http(f"http://127.0.0.1:{port}/props")
        # (row, connections, stream, a new prompt per request)
        runs = [] if args.only == "sse" else [
            ("JSON 4 kept", 4, False, False), ("JSON 64 kept", 64, False, False),
            ("JSON 4 new", 4, False, True), ("JSON 64 new", 64, False, True)]
        runs += [] if args.only == "json" else [("SSE 64 kept", 64, True, False),
                                                ("SSE 64 new", 64, True, True)]
        for row, connections, stream, unique in runs:
            for label, port in targets:
                if (stream or unique) and label == "bare proxy, httpx":
                    continue  # the httpx floor once, for reference
                if unique and label == "gateway, no access":
                    continue  # the access line's price, on the kept prompts
                result = measure(f"http://127.0.0.1:{port}/v1/chat/completions", connections,
                                 args.seconds, stream, unique)
                rows.append((row, label, result))
    finally:
        for proc_ in (gateway, quiet, *(proc for _, _, proc in others)):
            proc_.terminate()
            proc_.wait(10)
        for _, proc in bare.values():
            proc.terminate()
        upstream.terminate()
    print("kept: one prompt, sent again and again (the gateway counts it once and reuses "  # noqa: T201
          "the count);\nnew: a new prompt every request (each counted by the upstream, a "
          "second call).")
    print(f"{'run':>12}  {'target':<20} {'req/s':>7} {'p50 ms':>7} {'p99 ms':>7} "  # noqa: T201
          f"{'added p50':>9} {'added p99':>9} {'rps vs direct':>13} "
          f"{'rps vs bare aiohttp':>19} errors")
    for connections, label, r in rows:
        same = {lab: res for c, lab, res in rows if c == connections}
        d, b = same["direct"], same["bare proxy, aiohttp"]
        print(f"{connections:>12}  {label:<20} {r['rps']:>7.0f} {r['p50_ms']:>7.2f} "  # noqa: T201
              f"{r['p99_ms']:>7.2f} {r['p50_ms'] - d['p50_ms']:>9.2f} "
              f"{r['p99_ms'] - d['p99_ms']:>9.2f} {r['rps'] / d['rps']:>13.2f} "
              f"{r['rps'] / b['rps']:>19.2f} {int(r['errors'])}")
    for connections, label, r in rows:
        if label == "gateway, no access":
            logged = next(res for c, lab, res in rows if c == connections and lab == "gateway")
            print(f"access line, {connections}: the gateway with it serves "  # noqa: T201
                  f"{logged['rps'] / r['rps']:.2f}x the requests/s of the gateway without it")
    return 0


if __name__ == "__main__":
    sys.exit(main())
