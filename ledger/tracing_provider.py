"""The OpenTelemetry SDK as `ledger.tracing.setup` configures it: the tracer provider (resource, sampler and span
ids) and the filter in front of each batch processor that keeps idle sweeps out of the export. Imported only when
tracing is on (or by a test)."""
from __future__ import annotations

import os


def make_provider(wanted_span_id):
    """A TracerProvider as `setup` configures it (resource and sampler from OTEL_*), with no processor yet;
    `wanted_span_id` is the context variable through which `ledger.tracing` asks for a step span's derived id."""
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.id_generator import RandomIdGenerator

    class _Ids(RandomIdGenerator):
        """Random ids, but for an `execute_tool` span, whose id `step_span_id` derives (so a compensation can link
        to it without anything stored)."""

        def generate_span_id(self) -> int:
            wanted_id = wanted_span_id.get()
            if wanted_id is not None:
                wanted_span_id.set(None)
                return wanted_id
            return super().generate_span_id()

    named = os.environ.get("OTEL_SERVICE_NAME") or "service.name=" in os.environ.get("OTEL_RESOURCE_ATTRIBUTES", "")
    resource = Resource.create({} if named else {"service.name": "unwind"})
    return TracerProvider(resource=resource, id_generator=_Ids())  # sampler: OTEL_TRACES_SAMPLER(_ARG)


def quiet_sweeps(processor, sweep: str):
    """`processor`, but for the span of a sweep that found nothing, which never reaches it: a worker sweeps every
    second or so, and a span per idle tick would bury the ones that matter. A sweep span is kept when the sweep
    claimed or started anything, recorded an event, failed, or has a child span. `sweep` is the sweep span's name.
    (Both are handed in by `ledger.tracing.setup`, so this module imports nothing of it.)"""
    from opentelemetry.sdk.trace import SpanProcessor

    class QuietSweeps(SpanProcessor):
        def __init__(self):
            self.open: dict[int, bool] = {}  # the sweep spans not ended yet in this process → has a child

        def on_start(self, span, parent_context=None):
            if span.name == sweep:
                self.open[span.context.span_id] = False
            elif self.open and span.parent is not None and span.parent.span_id in self.open:
                self.open[span.parent.span_id] = True
            processor.on_start(span, parent_context=parent_context)

        def on_end(self, span):
            if span.name == sweep:
                had_child = self.open.pop(span.context.span_id, False)
                idle = all(value == 0 for value in span.attributes.values() if isinstance(value, int))
                if idle and not had_child and not span.events and span.status.is_unset:
                    return
            processor.on_end(span)

        def _on_ending(self, span):
            processor._on_ending(span)

        def shutdown(self):
            processor.shutdown()

        def force_flush(self, timeout_millis=30000):
            return processor.force_flush(timeout_millis)

    return QuietSweeps()
