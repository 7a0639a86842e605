"""telemetry.traceparent: the W3C header every layer call carries, remembered for the span it last saw."""

from opentelemetry import trace
from opentelemetry.sdk.trace import TracerProvider

from services.common import telemetry

tracer = TracerProvider().get_tracer("test")


def test_a_span_that_is_not_recording_has_no_traceparent():
    assert telemetry.traceparent(trace.INVALID_SPAN) == ""
    assert telemetry.traceparent() == ""  # no current span


def test_each_span_gets_its_own_traceparent_and_the_same_one_again():
    a, b = tracer.start_span("a"), tracer.start_span("b")
    ta, tb = telemetry.traceparent(a), telemetry.traceparent(b)
    assert ta.startswith("00-") and tb.startswith("00-") and ta != tb
    assert f"{a.get_span_context().span_id:016x}" in ta and f"{b.get_span_context().span_id:016x}" in tb
    assert telemetry.traceparent(b) == tb and telemetry.traceparent(a) == ta


def test_the_current_span_is_the_default_and_a_new_current_span_is_seen():
    outer = tracer.start_span("outer")
    with trace.use_span(outer):
        first = telemetry.traceparent()
        inner = tracer.start_span("inner")
        with trace.use_span(inner):
            assert telemetry.traceparent() == telemetry.traceparent(inner) != first
        assert telemetry.traceparent() == first
    assert telemetry.traceparent() == ""
