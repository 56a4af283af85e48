"""One classification of a backend's failure: the kind is set on the exception when it
is raised (UpstreamKind), and the count, the access line and the log read that one value
(review P7: a backend's HTTP 500 was counted status_5xx but logged stream_aborted)."""

from __future__ import annotations

import logging
from typing import Any

import httpx
import pytest

from gateway.backends import kind_class
from gateway.backends.base import SideCalls
from gateway.backends.upstream import map_upstream_errors, upstream_error_kind
from gateway.config import load_settings
from gateway.errors import (
    BackendNotReady,
    GatewayError,
    RateLimited,
    RejectionReason,
    UpstreamError,
    UpstreamKind,
    describe,
)
from gateway.observe.metrics import GatewayMetrics, PreemptionReason, ResumeOutcome
from tests.fakes import FakeLlamaServer
from tests.test_fleet import Fleet


def _dialect(kind: str) -> Any:
    settings = load_settings(backends=[{"name": "x", "url": "http://x:8080", "kind": kind}])
    entry = settings.backends[0]
    return kind_class(entry.kind)(entry, SideCalls(entry, httpx.AsyncClient()))


@pytest.mark.parametrize("kind", ["llama.cpp", "ollama", "vllm"])
def test_every_dialect_gives_a_5xx_its_kind_on_the_exception(kind: str) -> None:
    dialect = _dialect(kind)
    exc = dialect.translate_error(500, b'{"error": {"message": "boom"}}', None,
                                  retry_after_s=1.0)
    assert isinstance(exc, UpstreamError) and exc.upstream_kind is UpstreamKind.status_5xx
    assert "status_5xx" in describe(exc) and "stream_aborted" not in describe(exc)
    busy = dialect.translate_error(503, b'{"error": {"message": "loading"}}', "2",
                                   retry_after_s=1.0)
    assert isinstance(busy, BackendNotReady) and busy.upstream_kind is UpstreamKind.status_5xx
    refused = dialect.translate_error(404, b"", None, retry_after_s=1.0)
    assert isinstance(refused, GatewayError) and refused.upstream_kind is None


def test_the_kind_is_per_instance_and_the_class_keeps_its_default() -> None:
    answered = UpstreamError("backend said 500", kind=UpstreamKind.status_5xx)
    broke = UpstreamError("the connection broke")
    assert answered.upstream_kind == "status_5xx" and broke.upstream_kind == "stream_aborted"
    assert UpstreamError.upstream_kind is UpstreamKind.stream_aborted
    assert BackendNotReady("not ready yet").upstream_kind is None  # the gateway's own 503


def test_a_transport_failure_is_classified_with_the_enum() -> None:
    request = httpx.Request("POST", "http://x:8080/v1/chat/completions")
    refused = httpx.ConnectError("refused", request=request)
    assert upstream_error_kind(refused) is UpstreamKind.connect
    assert upstream_error_kind(httpx.ReadTimeout("slow", request=request)) is \
        UpstreamKind.timeout
    broke = httpx.RemoteProtocolError("closed", request=request)
    assert upstream_error_kind(broke) is UpstreamKind.stream_aborted
    with pytest.raises(UpstreamError) as info, map_upstream_errors("x"):
        raise broke
    assert info.value.upstream_kind is UpstreamKind.stream_aborted


def test_a_rejection_reason_is_one_of_the_vocabulary() -> None:
    limited = RateLimited("over", reason="max_queued", retry_after_s=1.0)
    assert limited.rejection_reason is RejectionReason.max_queued
    with pytest.raises(ValueError):
        RateLimited("over", reason="max_queud", retry_after_s=1.0)


def test_every_kind_of_each_vocabulary_is_primed_at_zero() -> None:
    from prometheus_client import CollectorRegistry

    registry = CollectorRegistry()
    metrics = GatewayMetrics(registry, lambda: [])
    metrics.prime(["x"], [("t", "p")])
    for kind in UpstreamKind:
        assert registry.get_sample_value("gateway_upstream_errors_total",
                                         {"backend": "x", "kind": kind}) == 0
    for reason in PreemptionReason:
        assert registry.get_sample_value("gateway_preemptions_total",
                                         {"backend": "x", "reason": reason}) == 0
    for outcome in ResumeOutcome:
        assert registry.get_sample_value("gateway_resumes_total",
                                         {"backend": "x", "outcome": outcome}) == 0


@pytest.mark.anyio
async def test_a_backends_500_is_counted_and_logged_under_one_kind(
        caplog: pytest.LogCaptureFixture) -> None:
    fakes = {"a": FakeLlamaServer(), "b": FakeLlamaServer()}
    fleet = Fleet(fakes, [{"name": "a", "model": "m"}, {"name": "b", "model": "m"}])
    await fleet.discover()
    fakes["a"].mode = "boom"  # answers 500
    try:
        with caplog.at_level(logging.WARNING):
            r = await fleet.chat(model="m", max_tokens=3)
    finally:
        await fleet.client.aclose()
    assert r.status_code == 200, r.text  # b answered
    registry = fleet.state.metrics.registry
    counted = [kind for kind in UpstreamKind if registry.get_sample_value(
        "gateway_upstream_errors_total", {"backend": "a", "kind": kind})]
    assert counted == [UpstreamKind.status_5xx]
    logged = [rec.getMessage() for rec in caplog.records
              if "before answering" in rec.getMessage()]
    assert len(logged) == 1, logged
    assert f"(UpstreamError upstream_error {counted[0]} 502)" in logged[0], logged[0]
