"""Shared fixtures: settings factory, fake upstream, app and client builders."""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable, Iterator
from typing import Any

import httpx
import pytest
from fastapi import FastAPI
from hypothesis import settings as hypothesis_settings
from prometheus_client import CollectorRegistry

pytest.register_assert_rewrite("tests.leaks")  # a plugin (below), imported here first

from gateway.config import Settings, load_settings  # noqa: E402
from gateway.http.app import GatewayState, create_app, shutdown  # noqa: E402
from tests.fakes import FakeLlamaServer, ManualClock  # noqa: E402
from tests.leaks import closed_at_test_end, closed_now  # noqa: E402

# tests/leaks.py is a plugin, so that its autouse fixture is set up before any of this
# file's, and its leak check torn down after all of them.
pytest_plugins = ["pytester", "tests.leaks"]

# These machines are shared and noisy: a property's example may take far longer than
# Hypothesis's default 200 ms deadline without anything being wrong, so no deadline.
hypothesis_settings.register_profile("shared-machine", deadline=None)
hypothesis_settings.load_profile("shared-machine")


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


@pytest.fixture(autouse=True)
def _no_gateway_env(monkeypatch: pytest.MonkeyPatch) -> None:
    import os

    for key in list(os.environ):
        # (OTEL_*: a machine's own tracing settings would trace every test's app)
        if (key.startswith("GATEWAY_") and key != "GATEWAY_MODEL") or key.startswith("OTEL_"):
            monkeypatch.delenv(key)


SettingsFactory = Callable[..., Settings]


@pytest.fixture
def make_settings() -> SettingsFactory:
    """Settings with one backend 'local'; keyword sections override."""

    def make(admission: dict[str, Any] | None = None, **backend: Any) -> Settings:
        # No calibration request at discovery (backends[].calibrate) unless a test is
        # about it: tests count the fake's requests.
        # Nor the build survey (backends[].survey), for the same reason.
        entry: dict[str, Any] = {"name": "local", "url": "http://upstream:8080",
                                 "calibrate": False, "survey": False, **backend}
        # The fake upstream stops the moment it is closed, so no release grace is needed
        # unless a test is about that grace.
        admission = {"disconnect_grace_s": 0.0, **(admission or {})}
        return load_settings(admission=admission, backends=[entry])

    return make


@pytest.fixture
def fake() -> Iterator[FakeLlamaServer]:
    server = FakeLlamaServer()
    yield server
    for task in server.lingering:  # slots kept busy after their request (linger)
        task.cancel()


@pytest.fixture
def clock() -> ManualClock:
    return ManualClock()



def sample_sum(registry: CollectorRegistry, name: str, **labels: str) -> float:
    """The sum of ``name``'s samples whose labels include ``labels`` (0 when none): a
    test names the labels it cares about, whatever others (tenant, priority) exist."""
    total = 0.0
    for family in registry.collect():
        for sample in family.samples:
            if sample.name == name and all(sample.labels.get(k) == v
                                           for k, v in labels.items()):
                total += sample.value
    return total

class Harness:
    """An app over a fake upstream, plus an httpx client that calls it in-process.
    The app is stopped (:func:`gateway.http.app.shutdown`) by :meth:`aclose`, at the
    latest when the test ends."""

    def __init__(self, app: FastAPI, fake: FakeLlamaServer) -> None:
        closed_at_test_end(self.aclose)
        self.app = app
        self.fake = fake
        self.state: GatewayState = app.state.gateway
        self.client = httpx.AsyncClient(
            transport=httpx.ASGITransport(app=app), base_url="http://gateway"
        )

    async def aclose(self) -> None:
        """Close the client, then stop the app as its lifespan would."""
        closed_now(self.aclose)
        await self.client.aclose()
        await shutdown(self.app)

    @property
    def registry(self) -> CollectorRegistry:
        return self.state.metrics.registry

    def sample(self, name: str, **labels: str) -> float:
        return sample_sum(self.registry, name, **labels)

    @property
    def backend(self) -> Any:
        return self.state.fleet.backends["local"]

    async def chat(self, content: str = "hello there", **extra: Any) -> httpx.Response:
        body = {"messages": [{"role": "user", "content": content}], **extra}
        return await self.client.post("/v1/chat/completions", json=body)


@pytest.fixture
async def harness_factory(
    make_settings: SettingsFactory, fake: FakeLlamaServer
) -> AsyncIterator[Callable[..., Any]]:
    harnesses: list[Harness] = []

    async def build(
        admission: dict[str, Any] | None = None, *, clock: Any = None, discover: bool = True,
        **backend: Any,
    ) -> Harness:
        settings = make_settings(admission, **backend)
        app = create_app(
            settings, http_client=fake.client(), registry=CollectorRegistry(), clock=clock,
            discover=False,
        )
        h = Harness(app, fake)
        if discover:
            await h.backend.discover()
        harnesses.append(h)
        return h

    yield build
    for h in harnesses:
        await h.aclose()


@pytest.fixture
async def harness(harness_factory: Callable[..., Any]) -> Harness:
    return await harness_factory()


@pytest.fixture
def redis_server(tmp_path: Any) -> Any:
    """A real redis-server on loopback (tests/realredis.py), stopped afterwards."""
    from tests.realredis import start_redis

    server = start_redis(tmp_path)
    try:
        yield server
    finally:
        server.stop()
