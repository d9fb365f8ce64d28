"""OpenTelemetry set-up: one tracer provider per process, gRPC instrumentation, exporter from OTEL_*
(docs/observability.md "Traces"; ``OTEL_TRACES_EXPORTER`` defaults to ``otlp`` with an OTLP endpoint set)."""

from __future__ import annotations

import base64
import json
import logging
import os

import grpc
from opentelemetry import trace
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import (
    BatchSpanProcessor, ConsoleSpanExporter, SimpleSpanProcessor, SpanExporter, SpanExportResult,
)

_configured: TracerProvider | None = None
_instrumented = False


class _DetachNoise(logging.Filter):
    """Drops OpenTelemetry's "Failed to detach context" error: the gRPC aio server instrumentation
    ends a streaming handler's span from another asyncio context when the stream is closed or
    cancelled (open-telemetry/opentelemetry-python#2606). The span is still ended and exported."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "Failed to detach context" not in record.getMessage()


class OtlpJsonFileExporter(SpanExporter):
    """Appends spans to ``path`` as OTLP JSON lines (the Collector file exporter's format, spec
    "OTLP/JSON"); one appending ``write`` per export, so several processes can share the file."""

    def __init__(self, path: str):
        self.path = path

    def export(self, spans) -> SpanExportResult:
        from google.protobuf import json_format
        from opentelemetry.exporter.otlp.proto.common.trace_encoder import encode_spans

        document = json_format.MessageToDict(encode_spans(spans), use_integers_for_enums=True)
        for resource_spans in document.get("resourceSpans", []):
            for scope_spans in resource_spans.get("scopeSpans", []):
                for span in scope_spans.get("spans", []):
                    _hex_ids(span)
                    for link in span.get("links", []):
                        _hex_ids(link)
        try:
            with open(self.path, "a", encoding="utf-8") as f:
                f.write(json.dumps(document, separators=(",", ":")) + "\n")
        except OSError as exc:
            logging.getLogger(__name__).warning("SPECDEC_TRACES_FILE %s: %s", self.path, exc)
            return SpanExportResult.FAILURE
        return SpanExportResult.SUCCESS


def _hex_ids(span: dict) -> None:
    """protobuf's JSON mapping writes bytes as base64; OTLP JSON wants trace / span ids in hex."""
    for key in ("traceId", "spanId", "parentSpanId"):
        if span.get(key):
            span[key] = base64.b64decode(span[key]).hex()


def _env_exporter() -> SpanExporter | None:
    choice = os.environ.get("OTEL_TRACES_EXPORTER")
    if choice is None:
        endpoint = os.environ.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT") or os.environ.get("OTEL_EXPORTER_OTLP_ENDPOINT")
        choice = "otlp" if endpoint else "none"
    choice = choice.split(",")[0].strip().lower()
    if choice == "none":
        return None
    if choice == "console":
        return ConsoleSpanExporter()
    if choice == "otlp_json_file":
        path = os.environ.get("SPECDEC_TRACES_FILE")
        if not path:
            raise ValueError("SPECDEC_TRACES_FILE: OTEL_TRACES_EXPORTER=otlp_json_file needs the file to append spans to")
        return OtlpJsonFileExporter(path)
    if choice == "otlp":
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter

        return OTLPSpanExporter()
    raise ValueError(f"OTEL_TRACES_EXPORTER: unsupported exporter {choice!r} (otlp, console, otlp_json_file or none)")


def setup_tracing(service_name: str, exporter: SpanExporter | None = None, simple: bool = False,
                  export_delay_ms: int | None = None) -> TracerProvider | None:
    """Install this process's tracer provider (once) and instrument gRPC (client and server, aio).
    exporter: overrides the OTEL_* choice; simple: export each span at once (blocking: avoid with OTLP on
    an event loop); export_delay_ms: the batch processor's delay (None = the SDK's). Returns the
    provider, or None when disabled. Raises ValueError for an unknown OTEL_TRACES_EXPORTER."""
    global _configured, _instrumented
    if os.environ.get("OTEL_SDK_DISABLED", "").lower() == "true":
        return None
    if _configured is None:
        exporter = exporter if exporter is not None else _env_exporter()
        provider = TracerProvider(resource=Resource.create({"service.name": os.environ.get("OTEL_SERVICE_NAME", service_name)}))
        if exporter is not None:
            provider.add_span_processor(_processor(exporter, simple, export_delay_ms))
        trace.set_tracer_provider(provider)
        _configured = provider
    elif exporter is not None:
        _configured.add_span_processor(_processor(exporter, simple, export_delay_ms))
    if not _instrumented:
        logging.getLogger("opentelemetry.context").addFilter(_DetachNoise())
        from opentelemetry.instrumentation.grpc import GrpcAioInstrumentorClient, GrpcAioInstrumentorServer, filters

        # not grpc's health servicer: the aio interceptor cannot wrap its read/write-style Watch (ends UNKNOWN)
        GrpcAioInstrumentorServer(filter_=filters.negate(filters.health_check())).instrument()
        GrpcAioInstrumentorClient().instrument()
        _instrumented = True
    return _configured


def _processor(exporter: SpanExporter, simple: bool, export_delay_ms: int | None):
    if simple:
        return SimpleSpanProcessor(exporter)
    return BatchSpanProcessor(exporter, **({} if export_delay_ms is None else {"schedule_delay_millis": export_delay_ms}))


class CancelThrough(grpc.aio.UnaryUnaryClientInterceptor, grpc.aio.StreamUnaryClientInterceptor):
    """Lets a cancelled unary call reach the server while the gRPC client instrumentation is on: that
    interceptor's ``await call.code()`` swallows the cancel (open-telemetry/opentelemetry-python-contrib#3271);
    innermost, this one awaits the call itself, so grpc.aio cancels it."""

    async def intercept_unary_unary(self, continuation, client_call_details, request):
        return await _awaited(await continuation(client_call_details, request))

    async def intercept_stream_unary(self, continuation, client_call_details, request_iterator):
        return await _awaited(await continuation(client_call_details, request_iterator))


async def _awaited(call):
    """``call`` once it ended; its failure stays in the call (the instrumentation reads its status
    and records the error on the client span; the caller's ``await`` raises it)."""
    try:
        await call
    except grpc.aio.AioRpcError:
        pass
    return call


def shutdown_tracing() -> None:
    """Flush and stop the exporter (call before a process exits)."""
    if _configured is not None:
        _configured.shutdown()


def tracer(name: str) -> trace.Tracer:
    return trace.get_tracer(name)
