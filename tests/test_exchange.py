"""An exchange admits through its AdmitPath (gateway.request.exchange), whatever the path
is: a lone backend (LoneBackend) or a pool's queue (ModelQueue); and the pipeline
(gateway.request.plan) builds it from the parts of the state it names (Planning)."""

from __future__ import annotations

import asyncio
import json
from types import SimpleNamespace
from typing import Any

import httpx
import pytest
from starlette.requests import Request

from gateway.backends.target import Target
from gateway.config import AdmissionSettings, BackendSettings
from gateway.core.capacity import Charge, Layout
from gateway.fleet.pool import AdmitPath, Candidate, LoneBackend, ModelQueue
from gateway.request.exchange import Exchange
from gateway.request.plan import Planning, prepare_exchange
from tests.fakes import ManualClock

pytestmark = pytest.mark.anyio


def _target(clock: ManualClock, name: str = "b") -> Target:
    side = httpx.AsyncClient(transport=httpx.MockTransport(lambda r: httpx.Response(500)))
    target = Target(BackendSettings(name=name, model="m"),
                    AdmissionSettings(max_queue=4, max_queue_wait_s=10.0), side, clock=clock)
    target.admission.set_layout(Layout(2, 1024, pool_tokens=1024))
    target.reachable = True
    return target


def _exchange(path: AdmitPath, candidates: list[Candidate],
              queue: ModelQueue | None = None) -> Exchange:
    first = candidates[0]
    return Exchange(backend=first.backend, route="chat", body=first.body,
                    charge=first.charge, stream=True, started=0.0, headers=[],
                    client_wants_usage=False, admit_path=path, candidates=candidates,
                    queue=queue)


async def settle() -> None:
    for _ in range(5):
        await asyncio.sleep(0)


async def test_a_lone_backends_exchange_waits_reports_its_place_and_binds() -> None:
    clock = ManualClock()
    target = _target(clock)
    hog = target.admission.try_admit(Charge(700, 300))  # the pool is full
    assert hog is not None
    x = _exchange(LoneBackend(target), [Candidate(target, Charge(700, 300), {"n": 1})])
    assert x.try_admit() is None and not x.may_fail_over
    waiting = asyncio.ensure_future(x.admit())
    await settle()
    place = x.queue_progress()
    assert place is not None and place[0] == 1
    target.admission.release(hog, served=True)
    lease = await waiting
    assert x.backend is target and x.body == {"n": 1} and x.queue_progress() is None
    # A continuation comes back with a charge of its own: its place is the new charge's.
    x.charge = Charge(600, 300)
    again = asyncio.ensure_future(x.readmit(front=True))
    await settle()
    place = x.queue_progress()
    assert place is not None and place[0] == 1
    target.admission.release(lease, served=True)
    target.admission.release(await again, served=True)


async def test_a_pools_exchange_binds_the_candidate_granted_and_may_fail_over() -> None:
    clock = ManualClock()
    a, b = _target(clock, "a"), _target(clock, "b")
    queue = ModelQueue([a, b], max_queue=4, max_wait_s=10.0, clock=clock)
    hog = a.admission.try_admit(Charge(700, 300))  # a is full: b is the one that fits
    assert hog is not None
    candidates = [Candidate(a, Charge(700, 300), {"on": "a"}),
                  Candidate(b, Charge(700, 300), {"on": "b"}, tracked=True)]
    x = _exchange(queue, candidates, queue)
    assert x.may_fail_over
    lease = x.try_admit()
    assert lease is not None and x.backend is b and x.body == {"on": "b"} and x.tracked
    x.candidates = candidates[:1]  # b failed it: a is left, and no other
    assert not x.may_fail_over
    waiting = asyncio.ensure_future(x.admit(front=True))
    await settle()
    assert x.queue_progress() == (1, None)
    a.admission.release(hog, served=True)
    b.admission.release(lease, served=True)
    a.admission.release(await waiting, served=True)
    assert x.backend is a


def _request(body: dict[str, Any]) -> Request:
    raw = json.dumps(body).encode()

    async def receive() -> dict[str, Any]:
        return {"type": "http.request", "body": raw, "more_body": False}

    return Request({"type": "http", "method": "POST", "path": "/v1/chat/completions",
                    "query_string": b"", "headers": [
                        (b"content-type", b"application/json"),
                        (b"content-length", str(len(raw)).encode())]}, receive)


async def test_the_pipeline_gives_a_lone_backend_a_lone_backend_path(harness: Any) -> None:
    state = harness.state
    assert isinstance(state, Planning)
    x = await prepare_exchange(state, _request(
        {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 8}), "chat")
    assert isinstance(x.admit_path, LoneBackend) and x.admit_path.backend is x.backend
    assert x.queue is None and not x.may_fail_over
    assert [(c.backend, c.charge, c.body) for c in x.candidates] == [
        (x.backend, x.charge, x.body)]


def test_a_state_without_a_part_the_pipeline_reads_is_no_planning() -> None:
    parts = dict(settings=None, clock=None, fleet=None, tenants=None, metrics=None,
                 draining=False, count_route=lambda *a: None)
    assert isinstance(SimpleNamespace(**parts), Planning)
    del parts["fleet"]
    assert not isinstance(SimpleNamespace(**parts), Planning)
