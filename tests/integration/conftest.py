"""Fixtures for tests against a real llama-server running Gemma 3 270M (marker ``llama``).

Each server runs on a free loopback port and is stopped afterwards. The binary and model
come from the cache that ``make backend`` (gateway.dev.localbackend) fills.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
import uvicorn

from gateway.config import load_settings
from gateway.dev.localbackend import LlamaServer, ensure_llama_server, ensure_model, free_port
from gateway.http.app import create_app, uvicorn_options


@pytest.fixture(scope="session")
def llama_parts() -> tuple[Any, Any]:
    return ensure_llama_server(), ensure_model()


@pytest.fixture(scope="session")
def default_server(llama_parts: tuple[Any, Any]) -> Iterator[LlamaServer]:
    """llama-server with its default layout (4 slots, unified KV) and -c 2048."""
    binary, model = llama_parts
    server = LlamaServer(["-c", "2048", "--metrics"], binary=binary, model=model)
    with server.running():
        yield server


class GatewayThread:
    """The real gateway (uvicorn) on a free loopback port, in a background thread."""

    def __init__(self, backend: dict[str, Any] | list[dict[str, Any]],
                 admission: dict[str, Any] | None = None, ready_timeout: float = 30,
                 **sections: Any):
        self.ready_timeout = ready_timeout
        # Requests here queue behind real generations; on a busy 2-core machine that can
        # take minutes, so the queue wait is generous unless a test sets its own.
        self.settings = load_settings(
            admission={"max_queue_wait_s": 600, **(admission or {})},
            backends=backend if isinstance(backend, list) else [{"name": "local", **backend}],
            **sections,
        )
        self.port = free_port()
        config = uvicorn.Config(
            create_app(self.settings), host="127.0.0.1", port=self.port, log_level="warning",
            loop="asyncio", **{**uvicorn_options(self.settings), "timeout_graceful_shutdown": 2},
        )
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, daemon=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def metrics_headers(self) -> dict[str, str]:
        """The admin key, when one is set (it guards /metrics)."""
        key = self.settings.server.admin_key
        return {} if key is None else {"authorization": f"Bearer {key.get_secret_value()}"}

    def __enter__(self) -> GatewayThread:
        self.thread.start()
        deadline = time.monotonic() + self.ready_timeout
        while time.monotonic() < deadline:
            try:
                r = httpx.get(self.url + "/ready", timeout=1)
                # Every backend ready, not only one per model: a backend is ready once
                # its calibration is done (a pool's second member a moment later).
                if r.status_code == 200 and all(
                        row.get("ready") for row in r.json().get("backends", {}).values()):
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(0.1)
        self.__exit__()
        raise RuntimeError("gateway did not become ready")

    def __exit__(self, *exc: object) -> None:
        self.server.should_exit = True
        self.thread.join(10)

    def metric(self, name: str, **labels: str) -> float:
        """The sum of the samples of ``name`` with ``labels`` among their labels, from
        the gateway's /metrics (0 when absent)."""
        return scrape(self.url, name, headers=self.metrics_headers, **labels)


def scrape(url: str, name: str, headers: dict[str, str] | None = None,
           **labels: str) -> float:
    """The sum of the samples of ``name`` with ``labels`` among their labels, from the
    /metrics of the gateway at ``url`` (0 when absent)."""
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx.get(url + "/metrics", timeout=5, headers=headers or {}).text
    total = 0.0
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == name and all(sample.labels.get(k) == v
                                           for k, v in labels.items()):
                total += float(sample.value)
    return total


class StreamInFlight:
    """A long stream (300 tokens, ``ignore_eos``) from the gateway at ``url``, read in a
    background thread: what a drain must let finish. :meth:`begin` returns once its
    first event came (``False`` if none came within ``timeout_s``); :meth:`text` waits
    for its end and returns everything read."""

    def __init__(self, url: str) -> None:
        self.url = url
        self._body: list[str] = []
        self._first = threading.Event()
        self._reader = threading.Thread(target=self._read)

    def _read(self) -> None:
        with httpx.stream("POST", self.url + "/v1/chat/completions", timeout=120, json={
                "messages": [{"role": "user", "content": "Tell a long story."}],
                "max_tokens": 300, "ignore_eos": True, "stream": True}) as r:
            for text in r.iter_text():
                self._body.append(text)
                self._first.set()

    def begin(self, timeout_s: float = 60) -> bool:
        self._reader.start()
        return self._first.wait(timeout_s)

    def text(self, timeout_s: float = 120) -> str:
        self._reader.join(timeout_s)
        return "".join(self._body)


def long_prompt(sentences: int) -> str:
    """English text of roughly 10 Gemma tokens per sentence."""
    words = ["river", "mountain", "quiet", "lantern", "orchard", "copper", "meadow", "signal"]
    out = []
    for i in range(sentences):
        a, b, c = words[i % 8], words[(i * 3 + 1) % 8], words[(i * 5 + 2) % 8]
        out.append(f"The {a} near the {b} kept its {c} for day {i}.")
    return " ".join(out)


async def gather_chats(url: str, bodies: list[dict[str, Any]], timeout: float = 300) -> list[httpx.Response]:
    async with httpx.AsyncClient(timeout=timeout) as client:
        return await asyncio.gather(
            *(client.post(url + "/v1/chat/completions", json=b) for b in bodies)
        )
