"""OpenTelemetry tracing: stage spans from a request's marks, joined by W3C trace context, and one
request's trace across the router, prefill and decode processes, received by a real OTLP/gRPC
collector on loopback."""
from __future__ import annotations

import threading
import time
from concurrent import futures

import grpc
import pytest
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from baton import tracing
from baton.config import load_settings
from baton.engine.request import STAGES, Trace

CALLER_TRACE = "4bf92f3577b34da6a3ce929d0e0e4736"
CALLER = {"traceparent": f"00-{CALLER_TRACE}-00f067aa0ba902b7-01"}


@pytest.fixture
def spans():
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    tracing.use(provider)
    yield exporter
    tracing.use(None)


def marked(**marks: float) -> Trace:
    trace = Trace()
    for event, at in marks.items():
        trace.mark(event, at)
    return trace


def test_stage_spans_join_the_callers_trace_across_processes(spans):
    now = time.monotonic()
    request = tracing.request_span("baton.request", CALLER, **{"baton.request_id": "r1"})
    request.stage("route", now - 1.0, now - 0.999)
    metadata = dict(request.metadata)
    assert metadata["traceparent"].split("-")[1] == CALLER_TRACE
    # what a prefill worker and a decode worker record from the metadata their call carried
    tracing.record_stages(list(metadata.items()), marked(arrived=now - 0.99, prefill_start=now - 0.9,
                                                          prefill_end=now - 0.5, staged=now - 0.45), request_id="r1")
    tracing.record_stages(metadata, marked(arrived=now - 0.99, staged=now - 0.44, admit_start=now - 0.4,
                                           admitted=now - 0.39, finished=now), request_id="r1")
    request.end(**{"baton.finish_reason": "length"})

    by_name = {s.name: s for s in spans.get_finished_spans()}
    assert set(by_name) == {"baton.request", "route", *STAGES}
    root = by_name.pop("baton.request")
    assert f"{root.context.trace_id:032x}" == CALLER_TRACE and root.parent.span_id == 0x00f067aa0ba902b7
    assert root.attributes["baton.finish_reason"] == "length"
    for span in by_name.values():
        assert span.context.trace_id == root.context.trace_id and span.parent.span_id == root.context.span_id
    assert by_name["prefill"].end_time - by_name["prefill"].start_time == pytest.approx(0.4e9, rel=1e-3)
    assert by_name["decode"].end_time - by_name["decode"].start_time == pytest.approx(0.39e9, rel=1e-3)
    assert by_name["queue"].attributes["baton.request_id"] == "r1"


def test_a_request_without_a_callers_context_starts_its_own_trace(spans):
    request = tracing.request_span("baton.request", None)
    request.end(error="UNAVAILABLE: no decode worker")
    (span,) = spans.get_finished_spans()
    assert span.parent is None and span.status.description == "UNAVAILABLE: no decode worker"
    assert dict(request.metadata)["traceparent"].split("-")[1] == f"{span.context.trace_id:032x}"


def test_tracing_off_records_and_sends_nothing():
    tracing.use(None)
    request = tracing.request_span("baton.request", CALLER)
    assert request is tracing.NO_SPAN and request.metadata == ()
    tracing.record_stages(CALLER, marked(arrived=1.0, prefill_start=2.0))  # no error, nothing to do


def test_tracing_settings_are_checked():
    settings = load_settings(env={"BATON_TRACING_OTLP_ENDPOINT": "http://127.0.0.1:4317",
                                  "BATON_TRACING_SAMPLE_RATIO": "0.25"})
    assert (settings.tracing.otlp_endpoint, settings.tracing.sample_ratio) == ("http://127.0.0.1:4317", 0.25)
    with pytest.raises(ValueError, match="sample_ratio must be in"):
        load_settings(env={"BATON_TRACING_SAMPLE_RATIO": "2"})
    with pytest.raises(ValueError, match="http:// or https:// URL"):
        load_settings(env={"BATON_TRACING_OTLP_ENDPOINT": "collector:4317"})


class Collector(trace_service_pb2_grpc.TraceServiceServicer):
    """An OTLP/gRPC trace collector: keeps every span it is sent, with its service's name."""

    def __init__(self):
        self.spans: list[tuple[str, object]] = []
        self.lock = threading.Lock()

    def Export(self, request, context):
        with self.lock:
            for resource_spans in request.resource_spans:
                service = next(a.value.string_value for a in resource_spans.resource.attributes
                               if a.key == "service.name")
                for scope in resource_spans.scope_spans:
                    self.spans += [(service, span) for span in scope.spans]
        return trace_service_pb2.ExportTraceServiceResponse()


@pytest.mark.slow
def test_one_request_is_one_trace_across_router_prefill_and_decode():
    from baton.client import BatonClient
    from baton.launch.up import LocalCluster, free_port

    collector = Collector()
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
    trace_service_pb2_grpc.add_TraceServiceServicer_to_server(collector, server)
    port = server.add_insecure_port(f"127.0.0.1:{free_port()}")
    server.start()
    try:
        env = {"BATON_TRACING_OTLP_ENDPOINT": f"http://127.0.0.1:{port}", "OTEL_BSP_SCHEDULE_DELAY": "100"}
        with LocalCluster(prefill=1, decode=1, model="tiny-random", max_rows=2, extra_env=env) as cluster:
            # The caller traces too: the SDK sends its current span's context with the call.
            with BatonClient(cluster.router_address, timeout=120) as client, \
                    TracerProvider().get_tracer("app").start_as_current_span("caller") as caller:
                result = client.generate(token_ids=[11, 12, 13, 14], max_tokens=5, ignore_eos=True)
            deadline = time.monotonic() + 30
            while time.monotonic() < deadline and len(collector.spans) < 9:
                time.sleep(0.1)
    finally:
        server.stop(0)
    assert len(result.token_ids) == 5
    services = {span.name: service for service, span in collector.spans}
    assert services == {"baton.request": "baton-router", "wait_for_decode": "baton-router", "route": "baton-router",
                        "queue": "baton-prefill",
                        "prefill": "baton-prefill", "transfer": "baton-prefill", "staging": "baton-decode",
                        "admission": "baton-decode", "decode": "baton-decode"}, services
    root = next(span for _, span in collector.spans if span.name == "baton.request")
    assert root.parent_span_id == caller.get_span_context().span_id.to_bytes(8, "big")
    for _, span in collector.spans:
        assert span.trace_id == caller.get_span_context().trace_id.to_bytes(16, "big")
        assert span is root or span.parent_span_id == root.span_id, span.name
        assert span.end_time_unix_nano >= span.start_time_unix_nano
    attributes = {a.key: a.value for a in root.attributes}
    assert attributes["baton.completion_tokens"].int_value == 5
    assert attributes["baton.decode_worker"].string_value == cluster.decode_addrs[0]
