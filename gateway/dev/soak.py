"""A soak of the gateway in front of a real llama-server: minutes of open-loop overload,
misbehaving clients, and a backend that is killed, restarted with another layout, and
frozen. It prints figures; :func:`problems` lists what breaks the gateway's promises.

The gateway runs as its own process (``python -m gateway serve``), so that its resident
memory (RSS) and open file descriptors are its own. llama-server is the cached build
with Gemma 3 270M (:mod:`gateway.dev.localbackend`).

The load, open-loop (Poisson arrivals at ``rate`` requests/s; by default 3x the rate the
backend served in a calibration run of the same mix, streamed, by 4 clients back to
back: the requests finished plus, for those cut by the end of the run, the fraction of
their cap generated, per second):

* chat completions (3 in 4) and completions, streamed or not (1 in 2);
* prompts of 20-1,500 tokens (random words, about one token each) and ``max_tokens``
  from 16 to 900, both log-uniform (many short, a few long, as real traffic), and no
  ``max_tokens`` at all on a quarter of the requests;
* 10% of the clients leave at a random moment (0-8 s in), 5% send their body in pieces
  over 2-5 s, and 2% send a malformed body.

The faults, at fractions of the duration: at 25% llama-server is killed (SIGKILL) and
started again with another ``-c``/``-np``; at 40% the gateway's configuration is
reloaded with the backend changed (its old version finishes what it holds); at 55%
llama-server is frozen (SIGSTOP) for 10 s; at 80% it is killed again and started with
the first layout.

The figures: requests by outcome; upstream 500s (an HTTP 500, or an error event about
the context, that a client saw, and the gateway's own count of backend 5xx); requests
hung (no end by their deadline); the gateway's queue, leases and KV reservation once
the load stops (and how long they took to reach 0); its RSS and open descriptors after
the calibration and at the end; TTFT p50/p95/p99 of the streams served.

Usage: ``.venv/bin/python bench/soak.py [--duration 300] [--rate R] [--policy strict]``.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import math
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
from collections import Counter
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
from prometheus_client.parser import text_string_to_metric_families

from gateway.dev.localbackend import LlamaServer, free_port

__all__ = ["Report", "SoakOptions", "problems", "run_soak"]

# Unified KV pools (llama-server's default layout, named explicitly since -np is): the
# pool is n_ctx, which /props shows, so the gateway's model of it stays exact across the
# restart with the other layout.
LAYOUTS = (["-c", "16384", "-np", "4", "--kv-unified"],
           ["-c", "8192", "-np", "2", "--kv-unified"])
WORDS = ("river mill house bank child summer boat tide garden stone bridge market road "
         "light window paper table music story winter morning letter forest island "
         "kitchen engine doctor teacher village harbour castle mountain desert city "
         "school train library ocean field cloud horse apple wheel").split()
QUESTIONS = ["Describe", "Tell me about", "Write a few lines on", "Explain"]
MALFORMED: list[bytes] = [
    b'{"messages": [{"role": "user", "content": "hi"}',  # truncated
    b'{"messages": [{"role": "user", "content": null}]}',
    b'{"messages": [{"role": "user", "content": "hi"}], "max_tokens": "ten"}',
    b'{"messages": "hello"}',
    b'{"messages": [{"role": "tool", "content": "x"}]}',
    b'\xff\xfe{"messages": []}',
    b'{"prompt": "hi", "max_tokens": -5}',
]
ADMIN_KEY = "soak-admin"
GAUGES = ("gateway_queue_depth", "gateway_inflight_requests", "gateway_kv_reserved_tokens",
          "gateway_abandoned_reservations")


@dataclass(frozen=True)
class SoakOptions:
    """How long and how hard.

    :param duration_s: how long the open-loop load runs, seconds.
    :param rate: arrivals per second; ``None``: 3x the calibrated service rate.
    :param calibrate_s: length of the calibration run (4 clients back to back), seconds.
    :param faults: kill, restart and freeze the backend during the run.
    :param policy: the gateway's ``admission.policy``.
    :param deadline_s: the least time a request has to end before it counts as hung,
        seconds. Each request's deadline is the larger of this and 70 s (the queue's
        30 s, a freeze and a restart) plus its prompt and cap at half the per-slot
        decode rate of the calibration.
    :param grace_s: after the load stops, how long the gateway has to return to 0.
    :param max_prompt_tokens: the longest prompt, tokens (the shortest is 20).
    :param max_cap: the largest ``max_tokens`` sent (the smallest is 16).
    :param default_max_tokens: the gateway's ``admission.default_max_tokens`` (what
        requests without a cap are charged and capped at); ``None``: its default.
    """

    duration_s: float = 300.0
    rate: float | None = None
    calibrate_s: float = 30.0
    faults: bool = True
    policy: str = "strict"
    deadline_s: float = 120.0
    grace_s: float = 60.0
    seed: int = 1
    max_prompt_tokens: int = 1500
    max_cap: int = 900
    default_max_tokens: int | None = None

    @property
    def uncapped(self) -> int:
        """The cap a request without one gets at the gateway, tokens."""
        if self.default_max_tokens is not None:
            return self.default_max_tokens
        return 1024 if self.policy == "strict" else 16384


@dataclass
class Report:
    """What a soak measured. Sizes in bytes, times in seconds."""

    offered_rate: float = 0.0
    calibrated_rate: float = 0.0
    calibrated_tokens_s: float = 0.0  # tokens streamed per second in the calibration
    sent: int = 0
    outcomes: Counter[str] = field(default_factory=Counter)
    upstream_500_seen: int = 0  # by clients: HTTP 500 or an error event about the context
    # The gateway's gateway_upstream_errors_total: the KV overflows ("Context size has
    # been exceeded."), and other 5xx answers (llama-server's 503 while it loads its
    # model after a restart is one; expected here, as the backend is restarted).
    overflows_counted: float = 0.0
    upstream_5xx_counted: float = 0.0
    hung: int = 0
    hung_details: list[str] = field(default_factory=list)
    malformed_accepted: int = 0
    gauges_after: dict[str, float] = field(default_factory=dict)
    zero_after_s: float | None = None  # None: not back to 0 within the grace
    rss_start: int = 0
    rss_end: int = 0
    fds_start: int = 0
    fds_end: int = 0
    ttft: list[float] = field(default_factory=list)
    faults: list[str] = field(default_factory=list)
    log_errors: list[str] = field(default_factory=list)  # ERROR lines of the gateway's log

    @property
    def rss_growth(self) -> float:
        return (self.rss_end - self.rss_start) / self.rss_start if self.rss_start else 0.0

    def lines(self) -> list[str]:
        """The report as text, one figure per line."""
        def pct(q: float) -> str:
            if not self.ttft:
                return "-"
            ordered = sorted(self.ttft)
            return f"{ordered[min(len(ordered) - 1, int(q * len(ordered)))]:.2f}"

        out = [f"offered load: {self.offered_rate:.2f} req/s "
               f"(calibrated: {self.calibrated_rate:.2f} req/s, "
               f"{self.calibrated_tokens_s:.1f} tokens/s); sent {self.sent}",
               "faults: " + ("; ".join(self.faults) or "none"), "outcomes:"]
        out += [f"  {name:<40} {n}" for name, n in sorted(self.outcomes.items())]
        out += [
            f"upstream 500s seen by clients: {self.upstream_500_seen}; KV overflows counted "
            f"by the gateway: {self.overflows_counted:g}; other backend 5xx (503 while "
            f"loading after a restart, ...): {self.upstream_5xx_counted:g}",
            f"hung requests: {self.hung}",
            *(f"  {detail}" for detail in self.hung_details),
            f"malformed bodies answered other than 4xx: {self.malformed_accepted}",
            "after the load: " + ", ".join(f"{k.removeprefix('gateway_')}={v:g}"
                                           for k, v in self.gauges_after.items())
            + (f" (all 0 after {self.zero_after_s:.1f} s)" if self.zero_after_s is not None
               else " (NOT back to 0 within the grace)"),
            f"gateway RSS: {self.rss_start / 2**20:.1f} MiB -> {self.rss_end / 2**20:.1f} MiB "
            f"({100 * self.rss_growth:+.1f}%)",
            f"gateway open fds: {self.fds_start} -> {self.fds_end} "
            f"({self.fds_end - self.fds_start:+d})",
            f"TTFT of streams served (n={len(self.ttft)}): p50 {pct(0.5)} s, "
            f"p95 {pct(0.95)} s, p99 {pct(0.99)} s",
            f"errors in the gateway's log: {len(self.log_errors)}",
        ]
        out += [f"  {line}" for line in self.log_errors[:10]]
        return out


def problems(report: Report, *, max_rss_growth: float = 0.10) -> list[str]:
    """What in ``report`` breaks the gateway's promises (empty when nothing does)."""
    found = []
    if report.upstream_500_seen or report.overflows_counted:
        found.append("upstream 500s (KV overflow)")
    if report.hung:
        found.append(f"{report.hung} hung requests")
    if report.zero_after_s is None:
        found.append(f"not back to 0 after the load: {report.gauges_after}")
    if report.malformed_accepted:
        found.append(f"{report.malformed_accepted} malformed bodies not answered 4xx")
    if report.rss_growth > max_rss_growth:
        found.append(f"RSS grew {100 * report.rss_growth:.1f}%")
    if report.log_errors:
        found.append(f"{len(report.log_errors)} errors in the gateway's log")
    gateway_500 = sum(n for k, n in report.outcomes.items() if k.startswith("500"))
    if gateway_500:
        found.append(f"{gateway_500} answers with status 500")
    return found


# -- the processes ------------------------------------------------------------------


class _Gateway:
    """``python -m gateway serve`` in front of ``backend_url``, as a child process."""

    def __init__(self, backend_url: str, opts: SoakOptions, workdir: Path) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.config = workdir / "gateway.toml"
        default = ("" if opts.default_max_tokens is None
                   else f"default_max_tokens = {opts.default_max_tokens}\n")
        self.text = (f'[server]\nport = {self.port}\nlog_level = "warning"\n'
                     f'admin_key = "{ADMIN_KEY}"\n'
                     f'[admission]\npolicy = "{opts.policy}"\n{default}'
                     f'[[backends]]\nname = "local"\nurl = "{backend_url}"\n')
        self.config.write_text(self.text)
        config = self.config
        self.log_path = workdir / "gateway.log"
        with self.log_path.open("wb") as log:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "gateway", "serve", "--config", str(config)],
                stdout=log, stderr=subprocess.STDOUT)

    def wait_ready(self, timeout_s: float = 60.0) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"the gateway exited; see {self.log_path}")
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(self.url + "/ready", timeout=2).status_code == 200:
                    return
            time.sleep(0.2)
        raise RuntimeError(f"the gateway was not ready in {timeout_s:g} s")

    def reload(self, extra: str) -> list[str]:
        """Append ``extra`` to the backend's settings and reload (``/admin/reload``);
        returns the changes the gateway reports."""
        self.config.write_text(self.text + extra)
        resp = httpx.post(self.url + "/admin/reload", timeout=30,
                          headers={"Authorization": f"Bearer {ADMIN_KEY}"})
        resp.raise_for_status()
        return list(resp.json()["reloaded"])

    def rss_and_fds(self) -> tuple[int, int]:
        status = Path(f"/proc/{self.proc.pid}/status").read_text()
        rss_kib = next(int(line.split()[1]) for line in status.splitlines()
                       if line.startswith("VmRSS:"))
        return rss_kib * 1024, len(os.listdir(f"/proc/{self.proc.pid}/fd"))

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            self.proc.send_signal(signal.SIGINT)  # the second one skips the drain
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


class _Backend:
    """llama-server on a fixed port, which the faults kill, restart and freeze."""

    def __init__(self) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.server = LlamaServer(LAYOUTS[0], port=self.port).start()

    def kill_and_restart(self, layout: list[str]) -> None:
        assert self.server.proc is not None
        self.server.proc.kill()
        self.server.proc.wait()
        self.server = LlamaServer(layout, port=self.port, log_path=self.server.log_path)
        for attempt in range(5):  # the port may take a moment to be free again
            try:
                self.server.start()
                return
            except RuntimeError:
                if attempt == 4:
                    raise
                time.sleep(1)

    def signal(self, sig: int) -> None:
        assert self.server.proc is not None
        self.server.proc.send_signal(sig)

    def stop(self) -> None:
        self.signal(signal.SIGCONT)
        self.server.stop()


# -- the clients --------------------------------------------------------------------


def _prompt_text(rng: random.Random, tokens: int) -> str:
    return (f"{rng.choice(QUESTIONS)} the {rng.choice(WORDS)}: "
            + " ".join(rng.choice(WORDS) for _ in range(max(1, tokens - 6))))


def _log_uniform(rng: random.Random, low: float, high: float) -> float:
    return math.exp(rng.uniform(math.log(low), math.log(high)))


def _request(rng: random.Random, opts: SoakOptions, *, misbehave: bool = True
             ) -> dict[str, Any]:
    """One client's request: path, body (a dict or raw bytes) and behaviour."""
    roll = rng.random() if misbehave else 1.0
    if roll < 0.02:
        return {"path": "/v1/chat/completions", "raw": rng.choice(MALFORMED),
                "kind": "malformed", "stream": False, "tokens": 0, "received": 0,
                "body": {}}
    chat = rng.random() < 0.75
    prompt = round(_log_uniform(rng, 20, opts.max_prompt_tokens))
    text = _prompt_text(rng, prompt)
    body: dict[str, Any] = ({"messages": [{"role": "user", "content": text}]} if chat
                            else {"prompt": text})
    cap = opts.uncapped
    if rng.random() >= 0.25:
        body["max_tokens"] = cap = round(_log_uniform(rng, 16, opts.max_cap))
    stream = rng.random() < 0.5
    body["stream"] = stream
    kind = "normal"
    if roll < 0.12:
        kind = "leaves"
    elif roll < 0.17:
        kind = "slow_body"
    return {"path": "/v1/chat/completions" if chat else "/v1/completions", "body": body,
            "kind": kind, "stream": stream, "leave_after": rng.uniform(0.0, 8.0),
            "trickle_s": rng.uniform(2.0, 5.0), "tokens": prompt / 20 + cap,
            "received": 0}


async def _trickle(data: bytes, seconds: float) -> AsyncIterator[bytes]:
    pieces = 10
    step = max(1, len(data) // pieces)
    for i in range(0, len(data), step):
        yield data[i:i + step]
        await asyncio.sleep(seconds / pieces)


def _classify_error(status: int, payload: Any) -> str:
    error = payload.get("error") if isinstance(payload, dict) else None
    code = error.get("code") if isinstance(error, dict) else None
    return f"{status} {code}" if code else str(status)


async def _one(client: httpx.AsyncClient, url: str, req: dict[str, Any],
               report: Report) -> str:
    """Send one request; return its outcome label (and record TTFT and 500s)."""
    started = time.monotonic()
    data = req["raw"] if "raw" in req else json.dumps(req["body"]).encode()
    content: Any = _trickle(data, req["trickle_s"]) if req["kind"] == "slow_body" else data
    headers = {"content-type": "application/json"}
    async with client.stream("POST", url + req["path"], content=content,
                             headers=headers) as resp:
        if resp.status_code != 200 or not req["stream"]:
            raw = await resp.aread()
            try:
                payload = json.loads(raw)
            except ValueError:
                payload = None
            if resp.status_code == 500 and "exceeded" in raw.decode(errors="replace"):
                report.upstream_500_seen += 1
            if resp.status_code == 200:
                return "200"
            return _classify_error(resp.status_code, payload)
        first = None
        async for line in resp.aiter_lines():
            req["received"] += 1
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[6:])
            if "error" in event:
                message = str(event["error"])
                if "exceeded" in message.lower() or "context size" in message.lower():
                    report.upstream_500_seen += 1
                return "200, then error event " + _classify_error(0, event).split()[-1]
            if first is None:
                first = time.monotonic() - started
        if first is not None:
            report.ttft.append(first)
        return "200 stream"


async def _client(client: httpx.AsyncClient, url: str, req: dict[str, Any],
                  report: Report, opts: SoakOptions) -> None:
    deadline = opts.deadline_s
    if report.calibrated_tokens_s:
        per_token_s = 2 * 4 / report.calibrated_tokens_s  # half of a slot's share
        deadline = max(deadline, 70 + req["tokens"] * per_token_s)
    limit = req["leave_after"] if req["kind"] == "leaves" else deadline
    try:
        outcome = await asyncio.wait_for(_one(client, url, req, report), limit)
    except TimeoutError:
        if req["kind"] == "leaves":
            outcome = "client left"
        else:
            outcome = "HUNG"
            report.hung += 1
            report.hung_details.append(
                f"{req['path']} stream={req['stream']} kind={req['kind']} "
                f"cap={req['body'].get('max_tokens')} deadline={deadline:.0f} s "
                f"lines received={req['received']}")
    except httpx.HTTPError as exc:
        outcome = f"transport error {type(exc).__name__}"
    if req["kind"] == "malformed" and not outcome.startswith("4"):
        report.malformed_accepted += 1
    report.outcomes[outcome] += 1


async def _calibrate(url: str, opts: SoakOptions) -> tuple[float, float]:
    """Requests served per second by 4 well-behaved clients back to back over the mix,
    streamed: those finished, plus the fraction of its cap that each request cut by the
    end had generated; and the tokens streamed per second."""
    rng = random.Random(opts.seed + 1000)
    served = 0.0
    tokens = 0
    stop = time.monotonic() + opts.calibrate_s

    async def one(client: httpx.AsyncClient) -> None:
        nonlocal served, tokens
        req = _request(rng, opts, misbehave=False)
        req["body"]["stream"] = req["stream"] = True
        cap = req["body"].get("max_tokens", opts.uncapped)
        events, done = 0, False
        try:
            async with client.stream("POST", url + req["path"], json=req["body"]) as resp:
                async for line in resp.aiter_lines():
                    events += line.startswith("data: {")
                    done = line == "data: [DONE]"
        finally:
            served += 1.0 if done else min(1.0, events / cap)
            tokens += events

    async def worker(client: httpx.AsyncClient) -> None:
        while time.monotonic() < stop:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(one(client), stop - time.monotonic())

    async with httpx.AsyncClient(timeout=600) as client:
        started = time.monotonic()
        await asyncio.gather(*(worker(client) for _ in range(4)))
        elapsed = time.monotonic() - started
        return served / elapsed, tokens / elapsed


async def _load(url: str, opts: SoakOptions, report: Report,
                faults: list[tuple[float, Any]]) -> None:
    rng = random.Random(opts.seed)
    tasks: set[asyncio.Task[None]] = set()
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=64)
    async with httpx.AsyncClient(timeout=httpx.Timeout(None),
                                 limits=limits) as client:
        started = time.monotonic()
        pending = sorted(faults, key=lambda f: f[0])
        injected: list[asyncio.Task[None]] = []
        next_at = started
        while (now := time.monotonic()) < started + opts.duration_s:
            while pending and now >= started + pending[0][0] * opts.duration_s:
                _, fault = pending.pop(0)  # in a thread, while the arrivals go on
                injected.append(asyncio.create_task(asyncio.to_thread(fault)))
            if now >= next_at:
                task = asyncio.create_task(
                    _client(client, url, _request(rng, opts), report, opts))
                tasks.add(task)
                task.add_done_callback(tasks.discard)
                report.sent += 1
                next_at += rng.expovariate(report.offered_rate)
            await asyncio.sleep(min(0.05, max(0.0, next_at - time.monotonic())))
        await asyncio.gather(*injected)
        if tasks:
            await asyncio.wait(tasks)


def _gauges(url: str) -> dict[str, float]:
    text = httpx.get(url + "/metrics", timeout=10,
                     headers={"Authorization": f"Bearer {ADMIN_KEY}"}).text
    values = dict.fromkeys(GAUGES, 0.0)
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name in values:
                values[sample.name] += sample.value
    return values


def _upstream_errors(url: str, kind: str) -> float:
    """The gateway's count of backend failures of ``kind`` (all backends)."""
    text = httpx.get(url + "/metrics", timeout=10,
                     headers={"Authorization": f"Bearer {ADMIN_KEY}"}).text
    return sum(sample.value for family in text_string_to_metric_families(text)
               for sample in family.samples
               if sample.name == "gateway_upstream_errors_total"
               and sample.labels.get("kind") == kind)


@contextlib.contextmanager
def _stack(opts: SoakOptions) -> Iterator[tuple[_Backend, _Gateway]]:
    backend = _Backend()
    try:
        with tempfile.TemporaryDirectory(prefix="soak-") as tmp:
            gateway = _Gateway(backend.url, opts, Path(tmp))
            try:
                gateway.wait_ready()
                yield backend, gateway
            finally:
                gateway.stop()
    finally:
        backend.stop()


def run_soak(opts: SoakOptions, say: Any = print) -> Report:
    """Run one soak (see the module docstring) and return its figures.

    :param say: called with each progress line.
    :raises gateway.dev.localbackend.BuildError: llama-server could not start.
    """
    report = Report()
    with _stack(opts) as (backend, gateway):
        say(f"llama-server {' '.join(LAYOUTS[0])} on {backend.url}; gateway on {gateway.url}")
        if opts.rate is None:
            report.calibrated_rate, report.calibrated_tokens_s = asyncio.run(
                _calibrate(gateway.url, opts))
            report.offered_rate = max(0.2, 3 * report.calibrated_rate)
        else:
            report.offered_rate = opts.rate
        say(f"offered load {report.offered_rate:.2f} req/s for {opts.duration_s:g} s")
        report.rss_start, report.fds_start = gateway.rss_and_fds()
        before = {k: _upstream_errors(gateway.url, k) for k in ("context_overflow", "status_5xx")}

        def kill(layout: list[str]) -> Any:
            def fault() -> None:
                backend.kill_and_restart(layout)
                report.faults.append(f"kill -9, restart with {' '.join(layout)}")
                say(report.faults[-1])
            return fault

        def freeze() -> None:
            backend.signal(signal.SIGSTOP)
            report.faults.append("SIGSTOP for 10 s")
            say(report.faults[-1])
            time.sleep(10)
            backend.signal(signal.SIGCONT)

        def reload() -> None:
            # A changed backend: the old one finishes its requests, the new one takes
            # new ones (gateway.fleet.reload.reload).
            changes = gateway.reload("discovery_interval_s = 10.0\n")
            report.faults.append("config reload (" + "; ".join(changes) + ")")
            say(report.faults[-1])

        faults = [(0.25, kill(LAYOUTS[1])), (0.40, reload), (0.55, freeze),
                  (0.80, kill(LAYOUTS[0]))]
        asyncio.run(_load(gateway.url, opts, report, faults if opts.faults else []))
        say("load stopped; waiting for the gateway to return to 0")
        stopped = time.monotonic()
        while True:
            report.gauges_after = _gauges(gateway.url)
            if not any(report.gauges_after.values()):
                report.zero_after_s = time.monotonic() - stopped
                break
            if time.monotonic() - stopped > opts.grace_s:
                break
            time.sleep(0.5)
        report.overflows_counted = (_upstream_errors(gateway.url, "context_overflow")
                                    - before["context_overflow"])
        report.upstream_5xx_counted = (_upstream_errors(gateway.url, "status_5xx")
                                       - before["status_5xx"])
        report.rss_end, report.fds_end = gateway.rss_and_fds()
        report.log_errors = [line for line in gateway.log_path.read_text(
            errors="replace").splitlines() if "ERROR" in line or "Traceback" in line]
    return report


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``bench/soak.py``: run a soak, print its figures, exit 1 on a
    broken promise (see :func:`problems`)."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--duration", type=float, default=300.0, help="seconds of load")
    parser.add_argument("--rate", type=float, help="arrivals/s (default: 3x calibrated)")
    parser.add_argument("--calibrate", type=float, default=30.0, help="calibration, s")
    parser.add_argument("--policy", default="strict", choices=["strict", "predictive"])
    parser.add_argument("--no-faults", action="store_true", help="no kills or freezes")
    parser.add_argument("--max-prompt", type=int, default=1500, help="longest prompt")
    parser.add_argument("--max-cap", type=int, default=900, help="largest max_tokens")
    parser.add_argument("--default-max-tokens", type=int,
                        help="the gateway's admission.default_max_tokens")
    parser.add_argument("--seed", type=int, default=1)
    args = parser.parse_args(argv)
    opts = SoakOptions(duration_s=args.duration, rate=args.rate, calibrate_s=args.calibrate,
                       policy=args.policy, faults=not args.no_faults, seed=args.seed,
                       max_prompt_tokens=args.max_prompt, max_cap=args.max_cap,
                       default_max_tokens=args.default_max_tokens)
    report = run_soak(opts, say=lambda line: print(line, flush=True))  # noqa: T201
    for line in report.lines():
        print(line)  # noqa: T201
    found = problems(report)
    print("problems: " + ("; ".join(found) if found else "none"))  # noqa: T201
    return 1 if found else 0
