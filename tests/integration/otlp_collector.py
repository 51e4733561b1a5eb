"""A real OTLP/gRPC trace collector in the test process (the `TraceService` of opentelemetry-proto)."""

from __future__ import annotations

import threading
import time
from concurrent import futures
from dataclasses import dataclass, field
from typing import Any

import grpc
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc
from opentelemetry.proto.common.v1 import common_pb2


def _value(v: common_pb2.AnyValue) -> Any:
    kind = v.WhichOneof("value")
    if kind == "array_value":
        return [_value(x) for x in v.array_value.values]
    if kind == "kvlist_value":
        return {kv.key: _value(kv.value) for kv in v.kvlist_value.values}
    return getattr(v, kind) if kind else None


def _attrs(kvs) -> dict[str, Any]:
    return {kv.key: _value(kv.value) for kv in kvs}


@dataclass
class Span:
    """One exported span, decoded: ids are hex strings, times nanoseconds since the epoch."""

    service: str
    name: str
    trace_id: str
    span_id: str
    parent_span_id: str
    start: int
    end: int
    attributes: dict[str, Any]
    links: list[tuple[str, str]] = field(default_factory=list)  # (trace id, span id)
    status_code: int = 0


class Collector(trace_service_pb2_grpc.TraceServiceServicer):
    """Receives OTLP exports on a free loopback port and keeps every span."""

    def __init__(self) -> None:
        self.spans: list[Span] = []
        self.exports = 0
        self._lock = threading.Lock()
        self.server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
        trace_service_pb2_grpc.add_TraceServiceServicer_to_server(self, self.server)
        self.port = self.server.add_insecure_port("127.0.0.1:0")
        self.server.start()

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def Export(self, request, context):
        got = []
        for rs in request.resource_spans:
            service = _attrs(rs.resource.attributes).get("service.name", "")
            for ss in rs.scope_spans:
                for s in ss.spans:
                    got.append(
                        Span(
                            service=service,
                            name=s.name,
                            trace_id=s.trace_id.hex(),
                            span_id=s.span_id.hex(),
                            parent_span_id=s.parent_span_id.hex(),
                            start=s.start_time_unix_nano,
                            end=s.end_time_unix_nano,
                            attributes=_attrs(s.attributes),
                            links=[(ln.trace_id.hex(), ln.span_id.hex()) for ln in s.links],
                            status_code=s.status.code,
                        )
                    )
        with self._lock:
            self.spans.extend(got)
            self.exports += 1
        return trace_service_pb2.ExportTraceServiceResponse()

    def snapshot(self) -> list[Span]:
        with self._lock:
            return list(self.spans)

    def trace(self, trace_id: str) -> list[Span]:
        return [s for s in self.snapshot() if s.trace_id == trace_id]

    def wait_for(self, predicate, timeout: float = 20.0) -> list[Span]:
        """Poll until `predicate(spans)` holds (exports are batched); returns the spans."""
        deadline = time.monotonic() + timeout
        while True:
            spans = self.snapshot()
            if predicate(spans) or time.monotonic() > deadline:
                return spans
            time.sleep(0.1)

    def stop(self) -> None:
        self.server.stop(0)
