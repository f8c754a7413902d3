"""OpenTelemetry tracing: a request's stages as spans of one trace across router, prefill and decode.

Off unless `tracing.otlp_endpoint` is set. The router opens a span per request (a child of the
caller's `traceparent`, if one came with the call) and sends its W3C trace context to the
workers as gRPC metadata; each process then records the stages it saw (route; queue, prefill,
transfer; staging, admission, decode) as children of that span once its part of the request is
over, from the marks its `Trace` holds anyway: nothing is added to the hot path.

The opentelemetry packages are imported only when tracing is on.
"""
from __future__ import annotations

import logging
import time
from collections.abc import Iterable, Mapping

log = logging.getLogger(__name__)

TRACE_HEADERS = ("traceparent", "tracestate")  # W3C trace context, as gRPC metadata or HTTP headers

_tracer = None  # set by configure() or use()


def configure(settings, role: str) -> bool:
    """Export spans over OTLP/gRPC as `settings` (a TracingSettings) says; False when tracing is off."""
    if not settings.otlp_endpoint:
        use(None)
        return False
    try:
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor
        from opentelemetry.sdk.trace.sampling import ParentBased, TraceIdRatioBased
    except ImportError as exc:
        raise ValueError(f"tracing.otlp_endpoint is set but the OpenTelemetry SDK is missing ({exc.name}): "
                         "pip install 'baton-serve[server]', or clear tracing.otlp_endpoint") from None
    # A worker follows the router's sampling decision (it travels in the trace context).
    provider = TracerProvider(resource=Resource.create({"service.name": settings.service_name or f"baton-{role}",
                                                        "service.namespace": "baton"}),
                              sampler=ParentBased(TraceIdRatioBased(settings.sample_ratio)))
    # The batch processor exports from its own thread, and flushes at exit.
    provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter(endpoint=settings.otlp_endpoint)))
    use(provider)
    log.info("tracing to %s (sampling %.0f%% of requests)", settings.otlp_endpoint, 100 * settings.sample_ratio)
    return True


def use(provider) -> None:
    """Trace through `provider` (an SDK TracerProvider; None: off). Tests hand it an in-memory one."""
    global _tracer
    _tracer = provider.get_tracer("baton") if provider is not None else None


def enabled() -> bool:
    return _tracer is not None


class _NoSpan:
    """What a request carries while tracing is off: nothing to send, nothing to record."""

    metadata: tuple = ()

    def stage(self, name: str, start: float, end: float, **attributes) -> None:
        pass

    def end(self, error: str | None = None, **attributes) -> None:
        pass


NO_SPAN = _NoSpan()


class RequestSpan:
    """The router's span of one request; `metadata` carries its context to the workers."""

    def __init__(self, span, context):
        self._span = span
        self._context = context
        carrier: dict[str, str] = {}
        _propagator().inject(carrier, context=context)
        self.metadata = tuple(carrier.items())

    def stage(self, name: str, start: float, end: float, **attributes) -> None:
        """A stage that ran from `start` to `end` (time.monotonic) in this process."""
        _stage(name, start, end, self._context, attributes)

    def end(self, error: str | None = None, **attributes) -> None:
        from opentelemetry.trace import Status, StatusCode

        self._span.set_attributes({k: v for k, v in attributes.items() if v is not None})
        if error is not None:
            self._span.set_status(Status(StatusCode.ERROR, error))
        self._span.end()


def request_span(name: str, carrier: Mapping[str, str] | None, **attributes):
    """A span for one request, the child of the trace context in `carrier` (incoming metadata or
    headers) if there is one; NO_SPAN while tracing is off."""
    if _tracer is None:
        return NO_SPAN
    from opentelemetry import trace
    from opentelemetry.trace import SpanKind

    span = _tracer.start_span(name, context=_extract(carrier), kind=SpanKind.SERVER,
                              attributes={k: v for k, v in attributes.items() if v is not None})
    return RequestSpan(span, trace.set_span_in_context(span))


def record_stages(carrier: Mapping[str, str] | Iterable[tuple[str, str]] | None, trace, **attributes) -> None:
    """This process's stages of a request (from its engine.request.Trace marks), as children of the
    span whose context came in `carrier` (the call's metadata)."""
    if _tracer is None:
        return
    context = _extract(carrier)
    for name, (start, end) in trace.stage_marks().items():
        _stage(name, start, end, context, attributes)


def error_text(exc: BaseException) -> str:
    """How a failed request's span describes its end: the status code (a DispatchError's) and message."""
    return f"{getattr(getattr(exc, 'code', None), 'name', type(exc).__name__)}: {exc}"


def _stage(name: str, start: float, end: float, context, attributes: dict) -> None:
    span = _tracer.start_span(name, context=context, start_time=_wall_ns(start),
                              attributes={f"baton.{k}": v for k, v in attributes.items() if v is not None})
    span.end(end_time=_wall_ns(max(start, end)))


def _extract(carrier):
    if not carrier:
        return None
    items = carrier.items() if isinstance(carrier, Mapping) else carrier
    found = {k.lower(): v for k, v in items if isinstance(k, str) and k.lower() in TRACE_HEADERS}
    return _propagator().extract(found) if found else None


def _propagator():
    from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

    return TraceContextTextMapPropagator()


def _wall_ns(monotonic: float) -> int:
    """A time.monotonic() reading as the wall-clock nanoseconds spans are stamped with."""
    return time.time_ns() - int((time.monotonic() - monotonic) * 1e9)
