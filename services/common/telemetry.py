"""OpenTelemetry tracing, set up once per process from its __main__.

Off unless an OTLP endpoint is configured (the standard OTEL_EXPORTER_OTLP_[TRACES_]ENDPOINT; the
SDK reads the other OTEL_* variables itself: service name, sampler, headers) or a span file is
asked for (TANDEM_TRACE_FILE, JSON lines: used by the tests). Trace context crosses processes as
W3C traceparent: gRPC metadata between services, a field of the shared-memory segment or of the
Compute message for per-layer expert calls.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Mapping
from dataclasses import dataclass

from opentelemetry import context as otel_context
from opentelemetry import trace
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

_PROPAGATOR = TraceContextTextMapPropagator()


@dataclass(frozen=True)
class TracingConfig:
    otlp: bool = False  # export over OTLP (endpoint and the rest from OTEL_* variables)
    file: str = ""  # also write spans as JSON lines here ("{service}" is replaced)
    each_expert_call: bool = False  # a span per layer call instead of one per step
    record_content: bool = False  # prompt and completion text as span attributes

    @property
    def enabled(self) -> bool:
        return self.otlp or bool(self.file)

    @staticmethod
    def from_env(env: Mapping[str, str]) -> "TracingConfig":
        """Read in __main__ only (one place per process reads the environment)."""
        return TracingConfig(
            otlp=bool(env.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT") or env.get("OTEL_EXPORTER_OTLP_ENDPOINT")),
            file=env.get("TANDEM_TRACE_FILE", ""),
            each_expert_call=env.get("TANDEM_TRACE_EXPERT_CALLS", "") == "1",
            record_content=env.get("TANDEM_TRACE_CONTENT", "") == "1",
        )


class JsonLinesExporter:
    """A span exporter that appends one JSON object per span to a file."""

    def __init__(self, path: str):
        self._file = open(path, "a", buffering=1)
        self._lock = threading.Lock()

    def export(self, spans):
        from opentelemetry.sdk.trace.export import SpanExportResult

        with self._lock:
            for span in spans:
                self._file.write(json.dumps(json.loads(span.to_json())) + "\n")
        return SpanExportResult.SUCCESS

    def shutdown(self):
        self._file.close()

    def force_flush(self, timeout_millis: int = 30000) -> bool:
        self._file.flush()
        return True


def setup(service: str, cfg: TracingConfig) -> None:
    """Installs this process's tracer provider (nothing when tracing is off: the API's no-op stays)."""
    if not cfg.enabled:
        return
    from opentelemetry.sdk.resources import SERVICE_NAME, Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor, SimpleSpanProcessor

    provider = TracerProvider(resource=Resource.create({SERVICE_NAME: service}))
    if cfg.otlp:
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter

        provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter()))
    if cfg.file:
        provider.add_span_processor(SimpleSpanProcessor(JsonLinesExporter(cfg.file.replace("{service}", service))))
    trace.set_tracer_provider(provider)


def shutdown() -> None:
    provider = trace.get_tracer_provider()
    if hasattr(provider, "shutdown"):
        provider.shutdown()


def tracer(name: str) -> trace.Tracer:
    return trace.get_tracer(name)


_last_traceparent: tuple[object, str] = (trace.INVALID_SPAN, "")  # (span, its traceparent): every layer call asks


def traceparent(span: trace.Span | None = None) -> str:
    """The W3C traceparent of a span (default: the current one); "" when it is not recording."""
    global _last_traceparent
    span = span or trace.get_current_span()
    last, value = _last_traceparent
    if span is last:
        return value
    value = ""
    if span.get_span_context().is_valid:
        carrier: dict[str, str] = {}
        _PROPAGATOR.inject(carrier, context=trace.set_span_in_context(span))
        value = carrier.get("traceparent", "")
    _last_traceparent = (span, value)
    return value


def metadata(span: trace.Span) -> tuple[tuple[str, str], ...]:
    """gRPC metadata carrying a span's context."""
    value = traceparent(span)
    return (("traceparent", value),) if value else ()


def context_from(carrier: Mapping[str, str] | None) -> otel_context.Context:
    """The remote parent in a carrier (gRPC metadata or {"traceparent": ...}); empty when absent."""
    return _PROPAGATOR.extract(dict(carrier or {}))
