"""An OpenTelemetry trace receiver for the tests, on 127.0.0.1: OTLP over HTTP (POST /v1/traces, protobuf) and over
gRPC (the TraceService), decoding what arrives with opentelemetry-proto as a collector would (the collector binary
cannot be installed here). Spans are kept flattened: ids as hex, attributes and events as plain values."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from concurrent import futures
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc


@dataclass
class Span:
    name: str
    trace_id: str
    span_id: str
    parent_span_id: str
    kind: int
    attributes: dict[str, Any]
    events: list[tuple[str, dict[str, Any]]]
    resource: dict[str, Any]
    status_code: int

    def event(self, name: str) -> dict[str, Any] | None:
        return next((attrs for n, attrs in self.events if n == name), None)


def _value(v: Any) -> Any:
    kind = v.WhichOneof("value")
    if kind == "array_value":
        return [_value(x) for x in v.array_value.values]
    return getattr(v, kind) if kind else None


def _attrs(items: Any) -> dict[str, Any]:
    return {a.key: _value(a.value) for a in items}


@dataclass
class OtlpReceiver:
    spans: list[Span] = field(default_factory=list)
    requests: int = 0
    _lock: threading.Lock = field(default_factory=threading.Lock)
    _stops: list[Callable[[], None]] = field(default_factory=list)

    def take(self, body: bytes) -> bytes:
        request = trace_service_pb2.ExportTraceServiceRequest.FromString(body)
        self.collect(request)
        return trace_service_pb2.ExportTraceServiceResponse().SerializeToString()

    def collect(self, request: Any) -> None:
        found = []
        for rs in request.resource_spans:
            resource = _attrs(rs.resource.attributes)
            for ss in rs.scope_spans:
                for s in ss.spans:
                    found.append(Span(s.name, s.trace_id.hex(), s.span_id.hex(), s.parent_span_id.hex(), s.kind,
                                      _attrs(s.attributes), [(e.name, _attrs(e.attributes)) for e in s.events],
                                      resource, s.status.code))
        with self._lock:
            self.spans.extend(found)
            self.requests += 1

    def start_http(self) -> str:
        """Serve OTLP/HTTP; its traces URL."""
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802 - http.server's name
                body = self.rfile.read(int(self.headers.get("content-length", 0)))
                if self.path != "/v1/traces" or self.headers.get("content-type") != "application/x-protobuf":
                    self.send_response(400)
                    self.end_headers()
                    return
                answer = receiver.take(body)
                self.send_response(200)
                self.send_header("content-type", "application/x-protobuf")
                self.send_header("content-length", str(len(answer)))
                self.end_headers()
                self.wfile.write(answer)

            def log_message(self, *_: Any) -> None:
                pass

        server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        threading.Thread(target=server.serve_forever, daemon=True).start()
        self._stops += [server.shutdown, server.server_close]  # its listening socket closed too
        return f"http://127.0.0.1:{server.server_address[1]}/v1/traces"

    def start_grpc(self) -> str:
        """Serve OTLP/gRPC; its host:port."""
        import grpc

        receiver = self

        class Service(trace_service_pb2_grpc.TraceServiceServicer):
            def Export(self, request: Any, context: Any) -> Any:  # noqa: N802 - the service's name
                receiver.collect(request)
                return trace_service_pb2.ExportTraceServiceResponse()

        server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
        trace_service_pb2_grpc.add_TraceServiceServicer_to_server(Service(), server)
        port = server.add_insecure_port("127.0.0.1:0")
        server.start()
        self._stops.append(lambda: server.stop(0))
        return f"127.0.0.1:{port}"

    def stop(self) -> None:
        for stop in self._stops:
            stop()

    def wait_for(self, match: Callable[[Span], bool], timeout: float = 30.0) -> Span:
        """The first span that matches, waiting for the server's batch to arrive."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            with self._lock:
                found = next((s for s in self.spans if match(s)), None)
            if found is not None:
                return found
            time.sleep(0.1)
        with self._lock:
            names = [s.name for s in self.spans]
        raise AssertionError(f"no matching span within {timeout:.0f} s; received: {names}")
