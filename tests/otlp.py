"""Real OTLP trace receivers for the tests, over HTTP (protobuf bodies on
``POST /v1/traces``) and gRPC (``TraceService/Export``), decoding what they receive with
``opentelemetry-proto``'s own messages into plain :class:`Span` records."""

from __future__ import annotations

import threading
from concurrent import futures
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc
from opentelemetry.proto.common.v1.common_pb2 import AnyValue
from opentelemetry.proto.trace.v1 import trace_pb2

KINDS = {trace_pb2.Span.SPAN_KIND_SERVER: "server", trace_pb2.Span.SPAN_KIND_CLIENT: "client",
         trace_pb2.Span.SPAN_KIND_INTERNAL: "internal"}


def _value(v: AnyValue) -> Any:
    kind = v.WhichOneof("value")
    if kind == "array_value":
        return [_value(item) for item in v.array_value.values]
    return None if kind is None else getattr(v, kind)


@dataclass
class Span:
    """One span as received."""

    name: str
    kind: str
    trace_id: str
    span_id: str
    parent_id: str
    attributes: dict[str, Any]
    events: list[tuple[str, dict[str, Any]]]
    error: bool
    start_ns: int
    end_ns: int
    resource: dict[str, Any] = field(default_factory=dict)

    def event(self, name: str) -> dict[str, Any] | None:
        """The attributes of the first event called ``name``, or ``None``."""
        return next((attrs for n, attrs in self.events if n == name), None)


def decode(request: trace_service_pb2.ExportTraceServiceRequest) -> list[Span]:
    spans = []
    for rs in request.resource_spans:
        resource = {a.key: _value(a.value) for a in rs.resource.attributes}
        for ss in rs.scope_spans:
            for s in ss.spans:
                spans.append(Span(
                    s.name, KINDS.get(s.kind, str(s.kind)), s.trace_id.hex(), s.span_id.hex(),
                    s.parent_span_id.hex(), {a.key: _value(a.value) for a in s.attributes},
                    [(e.name, {a.key: _value(a.value) for a in e.attributes})
                     for e in s.events],
                    s.status.code == trace_pb2.Status.STATUS_CODE_ERROR,
                    s.start_time_unix_nano, s.end_time_unix_nano, resource))
    return spans


class HttpReceiver:
    """OTLP/HTTP on 127.0.0.1: ``endpoint`` is what ``OTEL_EXPORTER_OTLP_ENDPOINT``
    takes (the exporter adds ``/v1/traces``)."""

    def __init__(self) -> None:
        self.spans: list[Span] = []
        self.posts = 0
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802 (http.server's name)
                body = self.rfile.read(int(self.headers.get("content-length", 0)))
                if self.path == "/v1/traces":
                    request = trace_service_pb2.ExportTraceServiceRequest()
                    request.ParseFromString(body)
                    receiver.spans += decode(request)
                    receiver.posts += 1
                reply = trace_service_pb2.ExportTraceServiceResponse().SerializeToString()
                self.send_response(200 if self.path == "/v1/traces" else 404)
                self.send_header("content-type", "application/x-protobuf")
                self.send_header("content-length", str(len(reply)))
                self.end_headers()
                self.wfile.write(reply)

            def log_message(self, *args: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.endpoint = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


class GrpcReceiver:
    """OTLP/gRPC on 127.0.0.1 (plaintext): ``endpoint`` for the exporter."""

    def __init__(self) -> None:
        import grpc

        self.spans: list[Span] = []
        receiver = self

        class Service(trace_service_pb2_grpc.TraceServiceServicer):
            def Export(self, request: Any, context: Any) -> Any:  # noqa: N802 (gRPC's)
                receiver.spans += decode(request)
                return trace_service_pb2.ExportTraceServiceResponse()

        self.server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
        trace_service_pb2_grpc.add_TraceServiceServicer_to_server(Service(), self.server)
        port = self.server.add_insecure_port("127.0.0.1:0")
        self.server.start()
        self.endpoint = f"http://127.0.0.1:{port}"

    def close(self) -> None:
        self.server.stop(0)
