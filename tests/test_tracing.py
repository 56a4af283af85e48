"""OpenTelemetry traces (issue 40), received by real OTLP receivers (tests/otlp.py: over
HTTP and gRPC, decoded with opentelemetry-proto), the gateway configured by the standard
environment variables alone, over the fake llama-server."""

from __future__ import annotations

import asyncio
import logging
from collections import Counter
from collections.abc import Iterator
from typing import Any

import pytest

from gateway.config import ConfigError
from gateway.observe.tracing import tracing_from_env
from gateway.wire.naming import served_name
from tests.otlp import GrpcReceiver, HttpReceiver, Span
from tests.test_predictive import _predictive, _warm

CALLER_TRACE = "4bf92f3577b34da6a3ce929d0e0e4736"
CALLER_SPAN = "00f067aa0ba902b7"
TRACEPARENT = f"00-{CALLER_TRACE}-{CALLER_SPAN}-01"


@pytest.fixture
def http_receiver() -> Iterator[HttpReceiver]:
    receiver = HttpReceiver()
    yield receiver
    receiver.close()


def traced(monkeypatch: pytest.MonkeyPatch, endpoint: str, protocol: str = "http/protobuf"
           ) -> None:
    """The environment an operator sets: the exporter, its endpoint and protocol, the
    service's name, and a short batch delay."""
    monkeypatch.setenv("OTEL_TRACES_EXPORTER", "otlp")
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", endpoint)
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_PROTOCOL", protocol)
    monkeypatch.setenv("OTEL_SERVICE_NAME", "gateway-under-test")
    monkeypatch.setenv("OTEL_BSP_SCHEDULE_DELAY", "50")


async def chat(h: Any, content: str, traceparent: str | None = None, **extra: Any) -> Any:
    body = {"messages": [{"role": "user", "content": content}], **extra}
    headers = {} if traceparent is None else {"traceparent": traceparent}
    return await h.client.post("/v1/chat/completions", json=body, headers=headers)


def by_trace(spans: list[Span]) -> dict[str, list[Span]]:
    out: dict[str, list[Span]] = {}
    for span in spans:
        out.setdefault(span.trace_id, []).append(span)
    return out


def children(spans: list[Span], parent: Span) -> dict[str, Span]:
    return {s.name: s for s in spans if s.parent_id == parent.span_id}


def server_span(spans: list[Span]) -> Span:
    (server,) = [s for s in spans if s.kind == "server"]
    return server


async def test_a_chat_and_a_stream_over_otlp_http_continue_the_callers_trace(
        harness_factory: Any, fake: Any, http_receiver: HttpReceiver,
        monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    traced(monkeypatch, http_receiver.endpoint)
    h = await harness_factory()
    caplog.set_level(logging.INFO, logger="gateway.access")
    whole = await chat(h, "hello there", TRACEPARENT, max_tokens=50)
    stream = await h.chat("tell me more", max_tokens=60, stream=True)
    assert whole.status_code == 200 and stream.status_code == 200
    upstream = [r for r in fake.requests if r.url.path == "/v1/chat/completions"]
    await h.aclose()  # the app's shutdown exports what is buffered

    traces = by_trace(http_receiver.spans)
    assert len(traces) == 2
    mine = traces[CALLER_TRACE]  # the caller's trace, continued
    server = server_span(mine)
    assert server.parent_id == CALLER_SPAN
    assert server.name == "POST /v1/chat/completions"
    assert server.attributes["http.route"] == "/v1/chat/completions"
    assert server.attributes["http.response.status_code"] == 200
    assert server.resource["service.name"] == "gateway-under-test"
    steps = children(mine, server)
    assert steps["gateway.count"].attributes["gateway.count.source"] == "backend"
    assert steps["gateway.queue"].attributes["gateway.queue.outcome"] == "granted"
    attempt = steps[f"chat {served_name(h.backend.model)}"]
    assert attempt.kind == "client"
    a = attempt.attributes
    assert a["gen_ai.operation.name"] == "chat" and a["gen_ai.request.model"] == "fake"
    assert a["gen_ai.request.max_tokens"] == 50 and a["gen_ai.response.model"] == "fake"
    assert a["gen_ai.usage.output_tokens"] == fake.tokens and a["gen_ai.usage.input_tokens"] > 0
    assert a["gen_ai.response.finish_reasons"] == ["length"]  # as the backend said
    assert a["http.response.status_code"] == 200 and not attempt.error
    # The upstream request carried the attempt's context: a backend that traces joins.
    assert upstream[0].headers["traceparent"] == f"00-{CALLER_TRACE}-{attempt.span_id}-01"
    # The stream: a trace of its own (no caller context), its first token an event.
    (other,) = [t for t in traces if t != CALLER_TRACE]
    streamed = traces[other]
    first = children(streamed, server_span(streamed))[f"chat {served_name(h.backend.model)}"]
    assert first.attributes["gateway.stream"] is True
    assert first.event("gen_ai.first_token") is not None
    assert first.attributes["gen_ai.response.finish_reasons"] == ["length"]
    for span in http_receiver.spans:  # children inside their request's time
        assert span.start_ns <= span.end_ns
    ids = [getattr(r, "trace_id", None) for r in caplog.records if r.name == "gateway.access"]
    assert CALLER_TRACE in ids and other in ids, ids  # the access line names the trace


async def test_otlp_grpc_receives_the_same_trace(harness_factory: Any,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    receiver = GrpcReceiver()
    try:
        traced(monkeypatch, receiver.endpoint, "grpc")
        monkeypatch.setenv("OTEL_EXPORTER_OTLP_INSECURE", "true")
        h = await harness_factory()
        r = await chat(h, "hello there", TRACEPARENT, max_tokens=20)
        assert r.status_code == 200
        await h.aclose()
        spans = by_trace(receiver.spans)[CALLER_TRACE]
        names = {s.name for s in spans}
        assert {"POST /v1/chat/completions", "gateway.queue",
                f"chat {served_name(h.backend.model)}"} <= names
    finally:
        receiver.close()


async def test_a_queued_request_a_timeout_and_a_refusal(
        harness_factory: Any, fake: Any, http_receiver: HttpReceiver,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """One slot: a request queued behind another is granted when it ends (its queue span
    says how long it waited); one that waits past max_queue_wait_s gets 503 and its
    queue span the reason; one that finds the queue full is refused at arrival (its
    request span says why; it never queued)."""
    traced(monkeypatch, http_receiver.endpoint)
    fake.hold, fake.slots = asyncio.Event(), 1
    h = await harness_factory({"max_queue": 1, "max_queue_wait_s": 0.5})
    first = asyncio.ensure_future(h.chat("one", max_tokens=100))
    await asyncio.sleep(0.05)
    queued = asyncio.ensure_future(h.chat("two", max_tokens=100))
    await asyncio.sleep(0.2)
    fake.hold.set()
    assert (await first).status_code == 200 and (await queued).status_code == 200
    fake.hold = asyncio.Event()
    blocker = asyncio.ensure_future(h.chat("three", max_tokens=100))
    await asyncio.sleep(0.05)
    late = asyncio.ensure_future(h.chat("four", max_tokens=100))
    await asyncio.sleep(0.05)
    full = await h.chat("five", max_tokens=100)  # the queue's one place is taken
    assert full.status_code == 503 and (await late).status_code == 503
    fake.hold.set()
    assert (await blocker).status_code == 200
    await h.aclose()

    rows = []
    for spans in by_trace(http_receiver.spans).values():
        server = server_span(spans)
        rows.append((server, children(spans, server).get("gateway.queue")))
    outcomes = Counter((q.attributes["gateway.queue.outcome"] if q else "-",
                        s.attributes.get("gateway.rejection_reason", "-"),
                        s.attributes["http.response.status_code"]) for s, q in rows)
    assert outcomes == Counter({("granted", "-", 200): 3,
                                ("queue_timeout", "queue_timeout", 503): 1,
                                ("-", "queue_full", 503): 1}), outcomes
    waits = sorted(q.attributes["gateway.queue.wait_s"] for s, q in rows
                   if q is not None and "gateway.queue.wait_s" in q.attributes)
    assert len(waits) == 3 and waits[-1] >= 0.15  # the queued one waited its turn
    for server, queue in rows:
        if server.attributes["http.response.status_code"] == 503:
            assert server.error
        if queue is not None and queue.attributes["gateway.queue.outcome"] == "queue_timeout":
            assert queue.end_ns - queue.start_ns >= 0.45e9


async def test_a_preempted_answer_is_resumed_in_its_trace(
        harness_factory: Any, fake: Any, http_receiver: HttpReceiver,
        monkeypatch: pytest.MonkeyPatch) -> None:
    traced(monkeypatch, http_receiver.endpoint)
    fake.pool, fake.n_ctx, fake.token_delay, fake.tokens = 600, 600, 0.001, 10**6
    h = await _predictive(harness_factory, fake)
    await _warm(h)
    results = await asyncio.gather(*(h.chat(f"go answer=150 n{i}", max_tokens=500,
                                            stream=True) for i in range(3)))
    assert all(r.status_code == 200 for r in results)
    preempted = h.sample("gateway_preemptions_total", backend="local", reason="pool_pressure")
    assert preempted > 0
    await h.aclose()
    servers = [s for s in http_receiver.spans if s.kind == "server"]
    events = [name for s in servers for name, _ in s.events]
    assert events.count("gateway.preempted") == preempted
    assert events.count("gateway.resumed") == preempted
    for server in servers:  # each attempt its own client span, numbered
        attempts = [s for s in http_receiver.spans
                    if s.parent_id == server.span_id and s.kind == "client"]
        numbers = sorted(a.attributes["gateway.attempt"] for a in attempts)
        assert numbers == list(range(1, len(attempts) + 1))
        preempts = sum(1 for name, _ in server.events if name == "gateway.preempted")
        assert len(attempts) == 1 + preempts


async def test_nothing_is_traced_or_sent_when_tracing_is_off(
        harness_factory: Any, fake: Any, http_receiver: HttpReceiver,
        monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    # An endpoint alone would turn OTLP on; "none" keeps it off.
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", http_receiver.endpoint)
    monkeypatch.setenv("OTEL_TRACES_EXPORTER", "none")
    h = await harness_factory()
    assert not h.app.state.tracing.on
    caplog.set_level(logging.INFO, logger="gateway.access")
    assert (await h.chat("hello", max_tokens=10)).status_code == 200
    await h.aclose()
    assert http_receiver.posts == 0
    assert "traceparent" not in fake.requests[-1].headers
    ids = [getattr(r, "trace_id", "") for r in caplog.records if r.name == "gateway.access"]
    assert ids and not any(ids)


def test_the_environment_turns_tracing_on_and_bad_values_are_refused() -> None:
    assert not tracing_from_env({}).on
    assert not tracing_from_env({"OTEL_TRACES_EXPORTER": "none"}).on
    assert not tracing_from_env({"OTEL_SDK_DISABLED": "true",
                                 "OTEL_TRACES_EXPORTER": "otlp"}).on
    on = tracing_from_env({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://127.0.0.1:9"})
    assert on.on
    on.shutdown()
    with pytest.raises(ConfigError, match="zipkin"):
        tracing_from_env({"OTEL_TRACES_EXPORTER": "zipkin"})
    with pytest.raises(ConfigError, match="http/json"):
        tracing_from_env({"OTEL_TRACES_EXPORTER": "otlp",
                          "OTEL_EXPORTER_OTLP_PROTOCOL": "http/json"})
