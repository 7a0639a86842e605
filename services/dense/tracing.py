"""The dense service's spans: one per request (with queue, prefill and decode children, timed after
the fact), and one per engine step that carries traced requests (the expert calls hang off it)."""

from __future__ import annotations

import contextlib
import time

from opentelemetry import trace

from services.common import telemetry

_tracer = telemetry.tracer("tandem.dense")


def start_request(parent, request) -> None:
    """Opens the request's span under the caller's context (from gRPC metadata), if it is traced."""
    attributes = {"tandem.request_id": request.request_id, "gen_ai.usage.input_tokens": len(request.prompt)}
    if request.params.max_tokens is not None:
        attributes["gen_ai.request.max_tokens"] = request.params.max_tokens
    span = _tracer.start_span("generate", context=parent, kind=trace.SpanKind.SERVER, attributes=attributes)
    request.span = span if span.is_recording() else None


def end_request(request, reason: str | None, error) -> None:
    span = request.span
    if span is None:
        return
    request.span = None
    end = time.time_ns()
    ctx = trace.set_span_in_context(span)
    admitted = request.admitted_ns or end
    first = request.first_token_ns or end
    for name, start, stop in (("queue", request.submitted_ns, admitted), ("prefill", admitted, first),
                              ("decode", first, end)):
        if stop > start:
            _tracer.start_span(name, context=ctx, start_time=start).end(end_time=stop)
    span.set_attribute("gen_ai.usage.output_tokens", len(request.generated))
    span.set_attribute("gen_ai.response.finish_reasons", [reason or "error"])
    if error is not None:
        span.set_status(trace.Status(trace.StatusCode.ERROR, str(error)))
    span.end(end_time=end)


@contextlib.contextmanager
def step(requests, tokens: int, stats):
    """A span for this step when one of its requests is traced (children: the expert calls); the
    experts' per-step numbers (`stats()` -> dict) become its attributes."""
    traced = [r.span for r in requests if r.span is not None]
    if not traced:
        yield
        return
    if stats is not None:
        stats()  # start this step's count from zero
    links = [trace.Link(s.get_span_context()) for s in traced[1:]]
    span = _tracer.start_span("step", context=trace.set_span_in_context(traced[0]), links=links,
                              attributes={"tandem.step.tokens": tokens, "tandem.step.sequences": len(requests)})
    with trace.use_span(span, end_on_exit=True):
        yield
        for key, value in (stats() if stats is not None else {}).items():
            span.set_attribute(f"tandem.experts.{key}", value)
