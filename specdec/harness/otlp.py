"""A minimal OTLP/gRPC trace receiver for tests and benchmarks: the services export real spans to it.

    with OtlpReceiver() as otlp:
        env = otlp.env()              # OTEL_* variables that point a process at this receiver
        spans = otlp.spans()          # [ReceivedSpan(service.name, span name, trace id hex, ...)]
"""

from __future__ import annotations

import threading
from concurrent import futures
from dataclasses import dataclass

import grpc
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc


@dataclass(frozen=True)
class ReceivedSpan:
    service: str
    name: str
    trace_id: str
    span_id: str
    parent_id: str
    attributes: dict


def attribute_value(v):
    """The Python value of an OTLP ``AnyValue`` (None when unset)."""
    kind = v.WhichOneof("value")
    return getattr(v, kind) if kind else None


class OtlpReceiver(trace_service_pb2_grpc.TraceServiceServicer):
    def __init__(self, host: str = "127.0.0.1"):  # host: the address it listens on (and env() points at)
        self.host = host
        self._lock = threading.Lock()
        self._spans: list[ReceivedSpan] = []
        self.server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
        trace_service_pb2_grpc.add_TraceServiceServicer_to_server(self, self.server)
        self.port = self.server.add_insecure_port(f"{host}:0")

    def Export(self, request, context):
        with self._lock:
            for resource_spans in request.resource_spans:
                attrs = {a.key: attribute_value(a.value) for a in resource_spans.resource.attributes}
                service = attrs.get("service.name", "?")
                for scope_spans in resource_spans.scope_spans:
                    for span in scope_spans.spans:
                        self._spans.append(self.keep(service, span))
        return trace_service_pb2.ExportTraceServiceResponse()

    def keep(self, service: str, span):
        """What ``spans()`` holds for one received protobuf ``Span`` of process ``service``."""
        return ReceivedSpan(service, span.name, span.trace_id.hex(), span.span_id.hex(), span.parent_span_id.hex(),
                            {a.key: attribute_value(a.value) for a in span.attributes})

    def env(self) -> dict[str, str]:
        return {
            "OTEL_TRACES_EXPORTER": "otlp",
            "OTEL_EXPORTER_OTLP_ENDPOINT": f"http://{self.host}:{self.port}",
            "OTEL_EXPORTER_OTLP_INSECURE": "true",
            "OTEL_BSP_SCHEDULE_DELAY": "100",
        }

    def spans(self) -> list:
        with self._lock:
            return list(self._spans)

    def __enter__(self):
        self.server.start()
        return self

    def __exit__(self, *exc):
        self.server.stop(grace=None)
