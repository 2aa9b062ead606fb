"""Traces of gateway requests (SPEC GW-9): OTLP/HTTP spans, with the OpenTelemetry SDK.

One span per request (continuing the client's ``traceparent`` when it sent one), with a child for
each stage a slow request may have spent its time in: admission (key, limits, budget), the wait in
the fair queue, each engine attempt (with the replica it went to; ``traceparent`` is passed to the
engine, so an engine that traces joins the same trace), and handing the usage record over.

Off (no endpoint, or a sample ratio of 0) it costs a request nothing but a few attribute checks:
every call returns a shared no-op. The provider is this router's own, never OpenTelemetry's
process-wide one, and its exporter runs on the SDK's batch thread, so a slow collector never holds
a request.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping
from contextvars import Token
from typing import Any

import msgspec
from opentelemetry import context as otel_context
from opentelemetry import trace
from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, SpanExporter
from opentelemetry.sdk.trace.sampling import ParentBased, TraceIdRatioBased
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

_PROPAGATOR = TraceContextTextMapPropagator()
_OFF = contextlib.nullcontext()


class Active(msgspec.Struct, kw_only=True):
    """A request's span while it is handled, and the context token that makes it the current one."""

    span: Any
    token: Token[Any]


class Tracing:
    """Spans of one router. ``endpoint``: the collector's OTLP/HTTP traces URL
    (``http://collector:4318/v1/traces``); None or a ``ratio`` of 0 turns tracing off."""

    def __init__(
        self,
        endpoint: str | None,
        ratio: float = 1.0,
        *,
        instance: str = "",
        export_delay_s: float = 2.0,
        exporter: SpanExporter | None = None,
    ) -> None:
        self.provider: TracerProvider | None = None
        self.tracer: trace.Tracer | None = None
        if (endpoint is None and exporter is None) or ratio <= 0:
            return
        resource = Resource.create({"service.name": "llmgw-gateway", "service.instance.id": instance})
        # A client's decision is kept (its sampled flag); a trace that starts here is sampled at ``ratio``.
        self.provider = TracerProvider(resource=resource, sampler=ParentBased(TraceIdRatioBased(min(ratio, 1.0))))
        self.provider.add_span_processor(
            BatchSpanProcessor(
                exporter or OTLPSpanExporter(endpoint=endpoint, timeout=5),
                schedule_delay_millis=int(export_delay_s * 1000),
            )
        )
        self.tracer = self.provider.get_tracer("llmgw.gateway")

    @property
    def enabled(self) -> bool:
        return self.tracer is not None

    def start_request(self, headers: Mapping[str, str], name: str, attributes: dict[str, Any]) -> Active | None:
        """The request's span, made current (its children and the engine's ``traceparent`` follow it);
        None when tracing is off. End it with :meth:`end_request`."""
        if self.tracer is None:
            return None
        parent = _PROPAGATOR.extract(carrier=headers)
        span = self.tracer.start_span(name, context=parent, kind=trace.SpanKind.SERVER, attributes=attributes)
        return Active(span=span, token=otel_context.attach(trace.set_span_in_context(span, parent)))

    def end_request(self, active: Active | None, status: int, attributes: dict[str, Any]) -> None:
        if active is None:
            return
        span = active.span
        span.set_attribute("http.response.status_code", status)
        for name, value in attributes.items():
            if value is not None:
                span.set_attribute(name, value)
        if status >= 500:
            span.set_status(trace.StatusCode.ERROR)
        span.end()
        otel_context.detach(active.token)

    def span(self, name: str, **attributes: Any) -> contextlib.AbstractContextManager[Any]:
        """A child of the current span for one stage (a no-op when tracing is off)."""
        if self.tracer is None:
            return _OFF
        return self._child(name, attributes)

    def attempt(self, replica_id: str, attempt: int, model: str) -> contextlib.AbstractContextManager[Any]:
        """The span of one engine attempt (its attributes built only when tracing is on)."""
        if self.tracer is None:
            return _OFF
        return self._child(
            "engine attempt", {"llmgw.replica": replica_id, "llmgw.attempt": attempt, "llmgw.model": model}
        )

    @contextlib.contextmanager
    def _child(self, name: str, attributes: dict[str, Any]) -> Iterator[Any]:
        assert self.tracer is not None
        with self.tracer.start_as_current_span(
            name, kind=trace.SpanKind.CLIENT if name == "engine attempt" else trace.SpanKind.INTERNAL
        ) as span:
            for key, value in attributes.items():
                if value is not None:
                    span.set_attribute(key, value)
            yield span

    def inject(self, headers: dict[str, str]) -> None:
        """``traceparent`` (and ``tracestate``) of the current span into ``headers`` for an engine."""
        if self.tracer is not None:
            _PROPAGATOR.inject(carrier=headers)

    def flush(self, timeout_s: float = 5.0) -> bool:
        return self.provider is None or self.provider.force_flush(int(timeout_s * 1000))

    def shutdown(self) -> None:
        if self.provider is not None:
            self.provider.shutdown()
