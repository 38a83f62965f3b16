"""A small OTLP/HTTP trace receiver for tests: real components export to it over loopback as
they would to a collector (POST /v1/traces, protobuf), and the test reads the spans back."""

from __future__ import annotations

import gzip
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)
from opentelemetry.proto.common.v1.common_pb2 import AnyValue


@dataclass(frozen=True)
class ReceivedSpan:
    service: str
    name: str
    trace_id: str
    span_id: str
    parent_span_id: str  # "" for a root
    kind: int
    attributes: dict[str, object]
    # (trace id, span id) of each linked span.
    links: tuple[tuple[str, str], ...]


def _value(value: AnyValue) -> object:
    kind = value.WhichOneof("value")
    return getattr(value, kind) if kind else None


@dataclass
class SpanSink:
    spans: list[ReceivedSpan] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def add(self, request: ExportTraceServiceRequest) -> None:
        received = []
        for resource_spans in request.resource_spans:
            resource = {a.key: _value(a.value) for a in resource_spans.resource.attributes}
            service = str(resource.get("service.name", ""))
            for scope_spans in resource_spans.scope_spans:
                for span in scope_spans.spans:
                    received.append(
                        ReceivedSpan(
                            service=service,
                            name=span.name,
                            trace_id=span.trace_id.hex(),
                            span_id=span.span_id.hex(),
                            parent_span_id=span.parent_span_id.hex(),
                            kind=span.kind,
                            attributes={a.key: _value(a.value) for a in span.attributes},
                            links=tuple(
                                (link.trace_id.hex(), link.span_id.hex()) for link in span.links
                            ),
                        )
                    )
        with self.lock:
            self.spans.extend(received)

    def snapshot(self) -> list[ReceivedSpan]:
        with self.lock:
            return list(self.spans)

    def wait_for(
        self, done: Callable[[list[ReceivedSpan]], bool], timeout: float
    ) -> list[ReceivedSpan]:
        """The spans once `done(spans)` holds; the spans so far after `timeout` seconds."""
        deadline = time.monotonic() + timeout
        while True:
            spans = self.snapshot()
            if done(spans) or time.monotonic() > deadline:
                return spans
            time.sleep(0.2)


def in_one_tree(spans: list[ReceivedSpan]) -> tuple[list[ReceivedSpan], list[ReceivedSpan]]:
    """The roots of `spans` and the spans whose parent is not among them."""
    ids = {s.span_id for s in spans}
    roots = [s for s in spans if not s.parent_span_id]
    orphans = [s for s in spans if s.parent_span_id and s.parent_span_id not in ids]
    return roots, orphans


def trace_of(spans: list[ReceivedSpan], name: str, workflow_id: str) -> list[ReceivedSpan]:
    """The spans of the trace holding the workflow's span `name` ([] while there is none)."""
    found = [
        s for s in spans if s.name == name and s.attributes.get("temporalWorkflowID") == workflow_id
    ]
    return [s for s in spans if found and s.trace_id == found[0].trace_id]


def _handler(sink: SpanSink) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
            if self.headers.get("Content-Encoding") == "gzip":
                body = gzip.decompress(body)
            if self.path != "/v1/traces":
                self.send_response(404)
                self.end_headers()
                return
            request = ExportTraceServiceRequest()
            request.ParseFromString(body)
            sink.add(request)
            answer = ExportTraceServiceResponse().SerializeToString()
            self.send_response(200)
            self.send_header("Content-Type", "application/x-protobuf")
            self.send_header("Content-Length", str(len(answer)))
            self.end_headers()
            self.wfile.write(answer)

        def log_message(self, format: str, *args: object) -> None:
            pass

    return Handler


@contextmanager
def otlp_receiver() -> Iterator[tuple[str, SpanSink]]:
    """An OTLP/HTTP endpoint (`http://127.0.0.1:<port>`, the port the kernel gave) and what
    it received."""
    sink = SpanSink()
    server = ThreadingHTTPServer(("127.0.0.1", 0), _handler(sink))
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}", sink
    finally:
        server.shutdown()
        server.server_close()
        thread.join(timeout=5)
