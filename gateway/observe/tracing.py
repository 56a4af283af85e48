"""OpenTelemetry traces of the requests: off unless the standard environment asks for
them, and then one trace per request, joined to the caller's.

**Turning it on.** Only the OpenTelemetry SDK's own environment variables
(``opentelemetry.sdk.environment_variables``), read once when the app is built
(:func:`tracing_from_env`):

* ``OTEL_TRACES_EXPORTER``: ``otlp`` and/or ``console`` (comma-separated); ``none`` or
  unset with no OTLP endpoint: off. Unlike the SDK's default (``otlp``), tracing is off
  unless asked for: an OTLP endpoint alone (``OTEL_EXPORTER_OTLP_ENDPOINT`` or
  ``OTEL_EXPORTER_OTLP_TRACES_ENDPOINT``) turns ``otlp`` on.
* ``OTEL_EXPORTER_OTLP_TRACES_PROTOCOL`` or ``OTEL_EXPORTER_OTLP_PROTOCOL``:
  ``http/protobuf`` (the specification's default) or ``grpc`` (the
  ``opentelemetry-exporter-otlp-proto-grpc`` package, extra ``otlp-grpc``).
* The exporters read their endpoint, headers, timeout and compression; the SDK reads the
  sampler (``OTEL_TRACES_SAMPLER``, ``OTEL_TRACES_SAMPLER_ARG``; default: parent-based,
  always on), the resource (``OTEL_SERVICE_NAME``, ``OTEL_RESOURCE_ATTRIBUTES``) and the
  batch processor's bounds (``OTEL_BSP_*``). ``OTEL_SDK_DISABLED=true`` turns it off.

Spans go out through the SDK's :class:`BatchSpanProcessor`, from its own thread; the
request path only records them. When tracing is off nothing is imported and each request
pays one ``None`` check per step.

**What a trace holds.** A ``SERVER`` span per request (HTTP semantic conventions: named
``POST /v1/chat/completions`` after the route, ``http.request.method``, ``http.route``,
``url.path``, ``http.response.status_code``, ``error.type``), continuing the client's
W3C ``traceparent``/``tracestate``. Its children: ``gateway.count`` (a prompt counted
by the backend, a round trip), ``gateway.queue`` (the wait for a lease: the predicted
wait, the outcome, the rejection reason) and one ``CLIENT`` span per upstream attempt,
in the GenAI semantic conventions (``chat {model}``: ``gen_ai.operation.name``,
``gen_ai.request.model``, ``gen_ai.request.max_tokens``, ``gen_ai.response.model``,
``gen_ai.usage.input_tokens``, ``gen_ai.usage.output_tokens``,
``gen_ai.response.finish_reasons``, a
``gen_ai.first_token`` event), whose context goes upstream in ``traceparent`` so that a
backend that traces joins the trace. Events on the request's span: ``gateway.preempted``,
``gateway.resumed``, ``gateway.failover``, ``gateway.client_left``. The access line
carries the ``trace_id``.

The GenAI conventions are still marked "Development" (their attribute names above are
the ones stable across their renames); see ``docs/observability.md``.
"""

from __future__ import annotations

import os
import time
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

from gateway.config import ConfigError

if TYPE_CHECKING:
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.trace import Span, Tracer

__all__ = ["RequestTrace", "Tracing", "tracing_from_env"]

#: The ``gen_ai.operation.name`` of each generation route.
OPERATIONS = {"chat": "chat", "completions": "text_completion", "completion":
              "text_completion", "infill": "text_completion", "embeddings": "embeddings",
              "embedding": "embeddings", "responses": "chat", "messages": "chat",
              "ollama_chat": "chat", "ollama_generate": "text_completion"}

_PROTOCOLS = ("http/protobuf", "grpc")


def _exporters(environ: Mapping[str, str]) -> list[str]:
    """The span exporters the environment asks for (``[]``: tracing off).

    :raises ConfigError: an exporter or protocol this gateway does not have.
    """
    if environ.get("OTEL_SDK_DISABLED", "").strip().lower() == "true":
        return []
    names = [n.strip().lower() for n in environ.get("OTEL_TRACES_EXPORTER", "").split(",")
             if n.strip()]
    if not names and (environ.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT")
                      or environ.get("OTEL_EXPORTER_OTLP_ENDPOINT")):
        names = ["otlp"]
    names = [n for n in names if n != "none"]
    unknown = [n for n in names if n not in ("otlp", "console")]
    if unknown:
        raise ConfigError(f"OTEL_TRACES_EXPORTER names {', '.join(unknown)}: the gateway "
                          "exports traces with otlp or console (or none)")
    return names


def _protocol(environ: Mapping[str, str]) -> str:
    protocol = (environ.get("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL")
                or environ.get("OTEL_EXPORTER_OTLP_PROTOCOL") or "http/protobuf").strip()
    if protocol not in _PROTOCOLS:
        raise ConfigError(f"OTLP protocol {protocol!r}: the gateway sends traces over "
                          f"{' or '.join(_PROTOCOLS)}")
    return protocol


class Tracing:
    """The gateway's traces: :meth:`begin` one per request; ``None`` from it when off.

    :param provider: the SDK's tracer provider with its processors, or ``None`` (off).
    """

    def __init__(self, provider: TracerProvider | None = None) -> None:
        self.provider = provider
        self.tracer: Tracer | None = None
        if provider is not None:
            from importlib.metadata import PackageNotFoundError, version

            try:
                mine: str | None = version("llm-admission-gateway")
            except PackageNotFoundError:  # (run from a source tree)
                mine = None
            self.tracer = provider.get_tracer("llm-gateway", mine)

    @property
    def on(self) -> bool:
        """Traces are recorded and exported."""
        return self.tracer is not None

    def begin(self, method: str, path: str, route: str | None,
              headers: list[tuple[bytes, bytes]]) -> RequestTrace | None:
        """The trace of a request arriving now (``None`` when off), continuing the
        caller's W3C trace context from ``headers``."""
        if self.tracer is None:
            return None
        from opentelemetry.propagate import extract
        from opentelemetry.trace import SpanKind

        carrier = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in headers
                   if k.lower() in (b"traceparent", b"tracestate")}
        name = f"{method} {route}" if route else method
        attributes: dict[str, Any] = {"http.request.method": method, "url.path": path}
        if route:
            attributes["http.route"] = route
        span = self.tracer.start_span(name, context=extract(carrier) if carrier else None,
                                      kind=SpanKind.SERVER, attributes=attributes)
        return RequestTrace(self.tracer, span)

    def shutdown(self) -> None:
        """Export what is buffered and stop (the app's shutdown)."""
        if self.provider is not None:
            self.provider.shutdown()


def tracing_from_env(environ: Mapping[str, str] | None = None) -> Tracing:
    """The gateway's traces as the OpenTelemetry environment variables ask (see the
    module's docstring): off (nothing imported) unless an exporter is asked for.

    :raises ConfigError: an exporter or OTLP protocol the gateway does not have, or the
        gRPC exporter's package is not installed.
    """
    env = os.environ if environ is None else environ
    names = _exporters(env)
    if not names:
        return Tracing()
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor, ConsoleSpanExporter

    resource = Resource.create({"service.name": env.get("OTEL_SERVICE_NAME") or "llm-gateway"})
    provider = TracerProvider(resource=resource)
    for name in names:
        if name == "console":
            provider.add_span_processor(BatchSpanProcessor(ConsoleSpanExporter()))
            continue
        if _protocol(env) == "grpc":
            try:
                from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import (
                    OTLPSpanExporter as GrpcExporter,
                )
            except ImportError as exc:
                raise ConfigError(
                    "OTLP over gRPC needs the opentelemetry-exporter-otlp-proto-grpc package "
                    "(pip install 'llm-admission-gateway[otlp-grpc]'), or set "
                    "OTEL_EXPORTER_OTLP_PROTOCOL=http/protobuf") from exc
            provider.add_span_processor(BatchSpanProcessor(GrpcExporter()))
        else:
            from opentelemetry.exporter.otlp.proto.http.trace_exporter import (
                OTLPSpanExporter as HttpExporter,
            )

            provider.add_span_processor(BatchSpanProcessor(HttpExporter()))
    return Tracing(provider)


def _present(attributes: Mapping[str, Any]) -> dict[str, Any]:
    """``attributes`` without those that are ``None`` (a span takes no ``None``)."""
    return {k: v for k, v in attributes.items() if v is not None}


def _ns_ago(seconds: float) -> int:
    """The wall-clock time, ns, ``seconds`` before now (spans take wall-clock times)."""
    return time.time_ns() - int(max(0.0, seconds) * 1e9)


class RequestTrace:
    """One request's trace: its server span, and the spans and events of its steps.

    :param tracer: the gateway's tracer.
    :param span: the request's ``SERVER`` span (started).
    """

    def __init__(self, tracer: Tracer, span: Span) -> None:
        self.tracer = tracer
        self.span = span
        self.attempt: Span | None = None  # the upstream attempt under way, or the last
        self.attempt_end_ns: int | None = None  # when it ended (its span ends later)
        self.attempts = 0

    @property
    def trace_id(self) -> str:
        """The trace's id, 32 hex digits (the access line's ``trace_id``)."""
        return format(self.span.get_span_context().trace_id, "032x")

    def _context(self, span: Span) -> Any:
        from opentelemetry.trace import set_span_in_context

        return set_span_in_context(span)

    def step(self, name: str, seconds: float, attributes: Mapping[str, Any]) -> None:
        """A child span for a step that ended now after ``seconds`` (counting, the
        queue)."""
        child = self.tracer.start_span(name, context=self._context(self.span),
                                       start_time=_ns_ago(seconds),
                                       attributes=_present(attributes))
        child.end()

    def event(self, name: str, **attributes: Any) -> None:
        """An event on the request's span (preempted, resumed, failover, client left)."""
        self.span.add_event(name, _present(attributes))

    def attempt_begins(self, operation: str, model: str | None, backend: str, url: str,
                       max_tokens: int | None, stream: bool) -> list[tuple[bytes, bytes]]:
        """Start the ``CLIENT`` span of an upstream attempt (the last one ends); return
        the headers that carry its context upstream (``traceparent``, ``tracestate``)."""
        from urllib.parse import urlsplit

        from opentelemetry.propagate import inject
        from opentelemetry.trace import SpanKind

        self._close_attempt()
        self.attempts += 1
        where = urlsplit(url)
        self.attempt = self.tracer.start_span(
            f"{operation} {model}" if model else operation, context=self._context(self.span),
            kind=SpanKind.CLIENT, attributes=_present({
                "gen_ai.operation.name": operation, "gen_ai.request.model": model,
                "gen_ai.request.max_tokens": max_tokens, "server.address": where.hostname,
                "server.port": where.port, "gateway.backend": backend,
                "gateway.attempt": self.attempts, "gateway.stream": stream}))
        carrier: dict[str, str] = {}
        inject(carrier, context=self._context(self.attempt))
        return [(k.encode(), v.encode()) for k, v in carrier.items()]

    def first_token(self, ttft_s: float) -> None:
        """The attempt's first output token reached the client, ``ttft_s`` seconds
        after the request arrived."""
        if self.attempt is not None:
            self.attempt.add_event("gen_ai.first_token", {"gateway.ttft_s": ttft_s})

    def attempt_ends(self, status: int | None = None, error: str | None = None) -> None:
        """The attempt under way ended now, with the client's ``status`` and the
        failure ``error`` (a ``gateway_upstream_errors_total`` kind), if any. Its span
        ends with the next attempt or the request, which may add the answer's usage."""
        span = self.attempt
        if span is None or self.attempt_end_ns is not None:
            return
        self.attempt_end_ns = time.time_ns()
        if status:
            span.set_attribute("http.response.status_code", status)
        if error:
            span.set_attribute("error.type", error)
        if error or (status or 0) >= 500:
            from opentelemetry.trace import Status, StatusCode

            span.set_status(Status(StatusCode.ERROR, error))

    def _close_attempt(self) -> None:
        span, self.attempt = self.attempt, None
        if span is not None:
            span.end(end_time=self.attempt_end_ns)
        self.attempt_end_ns = None

    def answered(self, model: str | None, input_tokens: int | None,
                 output_tokens: int | None, finish_reasons: Sequence[str] = ()) -> None:
        """What the answer was, on the last attempt's span (the GenAI usage, and
        ``gen_ai.response.finish_reasons`` as the backend named them)."""
        if self.attempt is not None:
            self.attempt.set_attributes(_present({
                "gen_ai.response.model": model, "gen_ai.usage.input_tokens": input_tokens,
                "gen_ai.usage.output_tokens": output_tokens,
                "gen_ai.response.finish_reasons": list(finish_reasons) or None}))

    def end(self, status: int, reason: str | None, backend: str | None,
            request_id: str) -> None:
        """End the request's span with the status it is counted as and its rejection
        ``reason``, if any."""
        self._close_attempt()
        span = self.span
        span.set_attribute("http.response.status_code", status)
        span.set_attribute("gateway.request_id", request_id)
        if backend:
            span.set_attribute("gateway.backend", backend)
        if reason:
            span.set_attribute("gateway.rejection_reason", reason)
        if status >= 500:
            from opentelemetry.trace import Status, StatusCode

            span.set_attribute("error.type", str(status))
            span.set_status(Status(StatusCode.ERROR, reason))
        span.end()
