"""The scoreboard's ``fakes`` row: the promises for Ollama and vLLM, which cannot run on
these machines, measured on the project's faithful fakes (``tests/fake_ollama.py``,
``tests/fake_vllm.py``, built from their sources), straight and through the gateway,
in process. Counts, not timings: the fakes' time is their own.

* **Ollama**, a model the configuration names / one named only in the request
  (``model`` unset: Ollama as a set of models). The model loads with ``num_ctx`` 2048
  and unloads 3 s after its last request. After one short chat and an unload, a chat of
  two turns that no longer fits (~2,150 tokens, ``max_tokens`` 16) is sent: Ollama
  alone drops its oldest turn silently and answers 200 (``cut_direct``: answers whose
  ``prompt_tokens`` are under the prompt sent); through the gateway it is a 400
  ``context_length_exceeded`` (``refused_400_gateway``) and never reaches Ollama
  (``forwarded_gateway``).
* **vLLM**, the model it serves: 6 completions of 3,000 prompt tokens and 1,500 output
  tokens (``ignore_eos``) at once on a pool of 20,000 tokens (``--max-num-seqs`` 16).
  vLLM alone admits all six and preempts (``preemptions_direct``); through the gateway
  four run at once and none is preempted.
"""

from __future__ import annotations

import asyncio
from typing import Any

import httpx
from prometheus_client import CollectorRegistry

from gateway.config import load_settings
from gateway.dev.scoreboard import Cell
from gateway.http.app import create_app, shutdown
from tests.fake_ollama import FakeOllama
from tests.fake_vllm import FakeVllm

CELLS = [{"backend": "ollama", "model": "configured"},
         {"backend": "ollama", "model": "request"},
         {"backend": "vllm", "model": "configured"}]

OLLAMA_MODEL = "llama3.2:1b"


def _two_turns(words: int) -> dict[str, Any]:
    """A chat of two user turns of ``words`` words each (one assistant turn between),
    ``max_tokens`` 16: the fake Ollama drops the first turn when it does not fit."""
    turn = " ".join(["word"] * words)
    return {"model": OLLAMA_MODEL, "max_tokens": 16, "messages": [
        {"role": "user", "content": turn}, {"role": "assistant", "content": "yes"},
        {"role": "user", "content": turn}]}


async def _ollama_side(fake: FakeOllama, client: httpx.AsyncClient, base: str,
                       before: Any = None) -> httpx.Response:
    """One short chat, the keep-alive passes (``before``: what to do then, as the
    gateway's discovery), then the over-long chat; its response."""
    short = await client.post(base + "/v1/chat/completions", json={
        "model": OLLAMA_MODEL, "max_tokens": 8,
        "messages": [{"role": "user", "content": "Hello there"}]})
    short.raise_for_status()
    fake.time += 10  # the keep-alive (3 s) passed: unloaded
    if before is not None:
        await before()
    return await client.post(base + "/v1/chat/completions", json=_two_turns(1070))


async def ollama_once(named: bool) -> dict[str, float]:
    """The Ollama cell once: straight, then through a fresh gateway (see the module)."""
    straight = FakeOllama(num_ctx=2048, keep_alive_s=3.0, loaded=False)
    async with straight.client() as client:
        r = await _ollama_side(straight, client, "http://ollama:11434")
    sent = straight.prompt_tokens(_two_turns(1070))
    cut = r.status_code == 200 and r.json()["usage"]["prompt_tokens"] < sent
    fake = FakeOllama(num_ctx=2048, keep_alive_s=3.0, loaded=False)
    backend: dict[str, Any] = {"name": "ollama", "url": "http://ollama:11434",
                               "kind": "ollama", "slots": 1, "calibrate": False}
    if named:
        backend["model"] = OLLAMA_MODEL
    app = create_app(load_settings(admission={"disconnect_grace_s": 0.0},
                                   backends=[backend]),
                     http_client=fake.client(), registry=CollectorRegistry(), discover=False)
    target = app.state.gateway.fleet.backends["ollama"]
    try:
        await target.discover()
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app)) as client:
            forwarded = len(fake.generations)
            through = await _ollama_side(fake, client, "http://gateway", target.discover)
            forwarded = len(fake.generations) - forwarded - 1  # (less the short chat)
    finally:
        await shutdown(app)
    cut_through = (through.status_code == 200
                   and through.json()["usage"]["prompt_tokens"] < sent)
    return {"cut_direct": float(cut), "cut_gateway": float(cut_through),
            "refused_400_gateway": float(through.status_code == 400),
            "forwarded_gateway": float(forwarded)}


async def _six(client: httpx.AsyncClient, url: str) -> int:
    body = {"model": FakeVllm.model, "prompt": [7] * 3000, "max_tokens": 1500,
            "ignore_eos": True}
    replies = await asyncio.gather(*(client.post(url, json=body, timeout=120)
                                     for _ in range(6)))
    return sum(r.status_code == 200 for r in replies)


async def vllm_once() -> dict[str, float]:
    """The vLLM cell once: straight, then through a fresh gateway (see the module)."""
    straight = FakeVllm()
    async with straight.client() as client:
        served_direct = await _six(client, "http://vllm:8000/v1/completions")
    fake = FakeVllm()
    app = create_app(load_settings(
        admission={"disconnect_grace_s": 0.0},
        backends=[{"name": "vllm", "url": "http://vllm:8000", "kind": "vllm", "slots": 16}]),
        http_client=fake.client(), registry=CollectorRegistry(), discover=False)
    try:
        await app.state.gateway.fleet.backends["vllm"].discover()
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app),
                                     base_url="http://gateway") as client:
            served = await _six(client, "/v1/completions")
    finally:
        await shutdown(app)
    return {"served_direct": served_direct, "served_gateway": served,
            "preemptions_direct": straight.preemptions, "preemptions_gateway": fake.preemptions,
            "peak_running_direct": straight.peak_running,
            "peak_running_gateway": fake.peak_running}


def row_fakes(cells: list[dict[str, str]], repeats: int) -> list[Cell]:
    """The row over ``cells`` (of :data:`CELLS`), each run ``repeats`` times."""
    out = []
    for axes in cells:
        metrics: dict[str, list[float]] = {}
        for _ in range(repeats):
            got = (asyncio.run(vllm_once()) if axes["backend"] == "vllm"
                   else asyncio.run(ollama_once(axes["model"] == "configured")))
            for name, value in got.items():
                metrics.setdefault(name, []).append(value)
        out.append(Cell("fakes", axes, metrics))
    return out
