"""The expert server's spans. A call carries the trace context of the dense service's step (or of
one layer call): calls of one step are aggregated into one span that ends with this server's last
layer, unless the call asks for a span of its own. Untraced calls cost one string test."""

from __future__ import annotations

from opentelemetry import trace

from services.common import telemetry

_tracer = telemetry.tracer("tandem.expert_server")


class CallTracer:
    """One per client connection (a shared-memory session or a Compute stream)."""

    def __init__(self, last_layer: int):
        self.last_layer = last_layer
        self._parent = ""
        self._span = None
        self._calls = self._tokens = 0
        self._compute_s = 0.0

    def record(self, traceparent: str, each: bool, layer: int, tokens: int, start_ns: int, end_ns: int) -> None:
        if not traceparent:
            return
        parent = telemetry.context_from({"traceparent": traceparent})
        attributes = {"tandem.layer": layer, "tandem.tokens": tokens}
        if each:
            _tracer.start_span("expert.compute", context=parent, start_time=start_ns, kind=trace.SpanKind.SERVER,
                               attributes=attributes).end(end_time=end_ns)
            return
        if traceparent != self._parent:
            self._close(start_ns)
            self._parent = traceparent
            self._span = _tracer.start_span("expert.step", context=parent, start_time=start_ns,
                                            kind=trace.SpanKind.SERVER)
        self._calls += 1
        self._tokens += tokens
        self._compute_s += (end_ns - start_ns) / 1e9
        if layer >= self.last_layer:
            self._close(end_ns)

    def _close(self, end_ns: int) -> None:
        if self._span is not None:
            self._span.set_attributes({"tandem.calls": self._calls, "tandem.tokens": self._tokens,
                                       "tandem.compute_s": self._compute_s})
            self._span.end(end_time=end_ns)
        self._span, self._parent = None, ""
        self._calls = self._tokens = 0
        self._compute_s = 0.0
