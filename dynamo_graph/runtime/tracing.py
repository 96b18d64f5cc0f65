"""Distributed tracing: spans through OpenTelemetry, their context carried across the request plane.

Off unless the process's environment names an OTLP endpoint, in the SDK's own variables
(`OTEL_EXPORTER_OTLP_TRACES_ENDPOINT` or `OTEL_EXPORTER_OTLP_ENDPOINT`; `OTEL_SDK_DISABLED=true`
or `OTEL_TRACES_EXPORTER=none` keep it off). Off, nothing of OpenTelemetry is imported and
`span()` returns one shared no-op, so a request pays a function call per span site. On, `setup`
builds the SDK's tracer provider the standard way: the sampler from `OTEL_TRACES_SAMPLER` /
`OTEL_TRACES_SAMPLER_ARG`, batch export over OTLP/HTTP (`OTEL_BSP_*` set its pace), the resource
from `OTEL_SERVICE_NAME` and `OTEL_RESOURCE_ATTRIBUTES`.

A request's place in its trace travels on its `Context.trace` (an OpenTelemetry context, opaque to
the rest of the runtime): `span(name, context)` opens a child of it, and while entered is the
parent of what runs inside it. On the wire the carrier is the request frame's headers, W3C trace
context (`traceparent`, `tracestate`): a span's `carrier` writes them, `extract` reads them. The runtime
itself opens a client span per request-plane call (each attempt at an instance) and a server span
per request served with a carrier (workers join traces, they never start one, so health checks
make none); what a request means (tokens, routing, prefill) is named in the rooms above.
"""

from __future__ import annotations

import asyncio
import os
import socket
from collections.abc import AsyncIterator, Mapping
from typing import Any

from dynamo_graph.runtime.context import Context

TRACEPARENT = "traceparent"
ON = False
"""True once `setup` configured tracing in this process."""

_tracer: Any = None
_provider: Any = None
_propagator: Any = None
_EMPTY: dict[str, str] = {}
_UNSAMPLED = object()
"""A request's `Context.trace` when its trace is sampled out: its spans are the no-op."""


def configured(env: Mapping[str, str] = os.environ) -> bool:
    """Whether the environment asks for traces: an OTLP endpoint, the SDK not disabled."""
    if env.get("OTEL_SDK_DISABLED", "").strip().lower() == "true":
        return False
    if env.get("OTEL_TRACES_EXPORTER", "").strip().lower() == "none":
        return False
    return bool(env.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT") or env.get("OTEL_EXPORTER_OTLP_ENDPOINT"))


def tracer_provider(service_name: str) -> Any:
    """The SDK's tracer provider as the OTEL_* environment describes it, exporting over
    OTLP/HTTP in batches; `service_name` unless OTEL_SERVICE_NAME names the service."""
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor

    attributes: dict[str, Any] = {"process.pid": os.getpid(), "host.name": socket.gethostname()}
    if not os.environ.get("OTEL_SERVICE_NAME"):
        attributes["service.name"] = service_name
    provider = TracerProvider(resource=Resource.create(attributes))  # its sampler: OTEL_TRACES_SAMPLER
    provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter()))
    return provider


def setup(service_name: str) -> bool:
    """Turn tracing on in this process if the environment asks for it; True when on."""
    global ON, _tracer, _propagator, _provider
    if ON or not configured():
        return ON
    from opentelemetry import trace
    from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

    provider = _provider = tracer_provider(service_name)
    trace.set_tracer_provider(provider)  # engines that trace themselves join the same export
    _tracer = provider.get_tracer("dynamo_graph")
    _propagator = TraceContextTextMapPropagator()
    ON = True
    return True


def shutdown() -> None:
    """Export the spans still waiting in the batch (the process is ending), then stop."""
    global ON
    if ON:
        ON = False
        _provider.shutdown()


def extract(headers: Mapping[str, str]) -> Any:
    """The trace context a caller sent in `headers` (None when it sent none or tracing is off)."""
    if not ON or TRACEPARENT not in headers:
        return None
    return _propagator.extract(headers)


class NoSpan:
    """What every span site gets while tracing is off."""

    __slots__ = ()
    carrier = _EMPTY
    recording = False

    def __enter__(self) -> NoSpan:
        return self

    def __exit__(self, *exc: object) -> None:
        return None

    def set(self, key: str, value: Any) -> None:
        return None

    def event(self, name: str, attributes: Mapping[str, Any] | None = None) -> None:
        return None

    def fail(self, exc: BaseException) -> None:
        return None

    def end(self) -> None:
        return None


NO_SPAN = NoSpan()


class Span:
    """One OpenTelemetry span under a request's `Context`. Entered, it is the parent of spans
    opened on that context until it exits; `end()` closes one that was never entered."""

    __slots__ = ("_context", "_saved", "span")

    def __init__(self, name: str, context: Context | None, parent: Any, kind: str, attributes: Any) -> None:
        from opentelemetry.trace import SpanKind

        self.span = _tracer.start_span(
            name, context=parent, kind=SpanKind[kind.upper()], attributes=attributes
        )
        self._context = context
        self._saved: Any = None

    @property
    def recording(self) -> bool:
        """False for a span its trace's sampling dropped (what runs inside it makes none)."""
        return self.span.is_recording()

    @property
    def carrier(self) -> dict[str, str]:
        """This span as the parent a request frame carries (W3C trace context headers)."""
        from opentelemetry.trace import set_span_in_context

        carrier: dict[str, str] = {}
        _propagator.inject(carrier, context=set_span_in_context(self.span))
        return carrier

    def __enter__(self) -> Span:
        context = self._context
        if context is not None:
            from opentelemetry.trace import set_span_in_context

            self._saved = context.trace
            sampled = self.span.is_recording()
            context.trace = set_span_in_context(self.span, context.trace) if sampled else _UNSAMPLED
        return self

    def __exit__(self, exc_type: object, exc: BaseException | None, tb: object) -> None:
        if exc is not None:
            self.fail(exc)
        self.end()
        if self._context is not None:
            self._context.trace = self._saved

    def set(self, key: str, value: Any) -> None:
        self.span.set_attribute(key, value)

    def event(self, name: str, attributes: Mapping[str, Any] | None = None) -> None:
        self.span.add_event(name, attributes)

    def fail(self, exc: BaseException) -> None:
        """Mark the span failed by `exc`; a cancelled or abandoned stream is only cancelled."""
        if isinstance(exc, (GeneratorExit, asyncio.CancelledError)):
            self.span.set_attribute("cancelled", True)
            return
        from opentelemetry.trace import Status, StatusCode

        self.span.record_exception(exc)
        self.span.set_status(Status(StatusCode.ERROR, f"{type(exc).__name__}: {exc}"))

    def end(self) -> None:
        self.span.end()


def span(
    name: str,
    context: Context | None = None,
    attributes: Mapping[str, Any] | None = None,
    *,
    kind: str = "internal",
    headers: Mapping[str, str] | None = None,
) -> Span | NoSpan:
    """A child of the request's current span (of the trace in `headers` when given: a server
    span's caller); the shared no-op while tracing is off or the request's trace is sampled out."""
    if not ON:
        return NO_SPAN
    if headers is not None:
        parent = extract(headers)
    else:
        parent = None if context is None else context.trace
        if parent is _UNSAMPLED:
            return NO_SPAN
    return Span(name, context, parent, kind, attributes)


def event(context: Context, name: str, attributes: Mapping[str, Any] | None = None) -> None:
    """An event on the request's current span (a migration, a fallback): a moment, not a span."""
    if not ON or context.trace is None or context.trace is _UNSAMPLED:
        return
    from opentelemetry.trace import get_current_span

    get_current_span(context.trace).add_event(name, attributes)


async def served(
    name: str, stream: AsyncIterator[Any], headers: Mapping[str, str], context: Context
) -> AsyncIterator[Any]:
    """A served request's responses inside a server span that continues the caller's trace
    (only called for requests whose headers carry one)."""
    with span(name, context, {"request.id": context.id}, kind="server", headers=headers):
        async for item in stream:
            yield item
