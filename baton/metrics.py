"""Prometheus metrics, one registry per process, served on its `metrics_port` (0 = off).

Gauges that mirror live state (rows, KV bytes, queue depth) are read when scraped, from the
objects that own that state, so nothing is updated twice; so are counters kept by their owners
(`counter`), which stay counters. Next to Baton's own series, each role exposes vLLM's names,
labels and buckets for what it shares with vLLM (`vllm:time_to_first_token_seconds`,
`vllm:num_requests_waiting`, `vllm:kv_cache_usage_perc`, ...), so the Gateway API Inference
Extension's endpoint picker, KEDA triggers and vLLM dashboards read a Baton cluster as they read
vLLM. Every series served carries the `model_name` label.
"""
from __future__ import annotations

from typing import Callable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server
from prometheus_client.core import CounterMetricFamily
from prometheus_client.registry import Collector

from baton.resources import Amount

# vLLM's bucket boundaries (vllm/v1/metrics/loggers.py), so its dashboards' quantiles line up.
VLLM_TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                     20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
VLLM_ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
                    40.0, 80.0)
VLLM_REQUEST_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0,
                        240.0, 480.0, 960.0, 1920.0, 7680.0)

ROUTE_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.1)
ITERATION_TOKEN_BUCKETS = (16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192)
LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)


class Metrics:
    def __init__(self, role: str, model_name: str = ""):
        self.role = role
        self.model_name = model_name
        self.registry = CollectorRegistry()
        r = self.registry
        # vLLM's series (its names; prometheus_client adds _total to counters).
        self.vllm_ttft = Histogram("vllm:time_to_first_token_seconds", "Time to first token (vLLM's name)",
                                   buckets=VLLM_TTFT_BUCKETS, registry=r)
        self.vllm_itl = Histogram("vllm:inter_token_latency_seconds", "Time between a request's tokens (vLLM's name)",
                                  buckets=VLLM_ITL_BUCKETS, registry=r)
        self.vllm_e2e = Histogram("vllm:e2e_request_latency_seconds", "Arrival to last token (vLLM's name)",
                                  buckets=VLLM_REQUEST_BUCKETS, registry=r)
        self.vllm_queue = Histogram("vllm:request_queue_time_seconds", "Time a prompt waited for prefill (vLLM's "
                                    "name)", buckets=VLLM_REQUEST_BUCKETS, registry=r)
        self.vllm_prefill = Histogram("vllm:request_prefill_time_seconds", "Prefill compute time (vLLM's name)",
                                      buckets=VLLM_REQUEST_BUCKETS, registry=r)
        self.vllm_success = Counter("vllm:request_success", "Finished requests by finish reason (vLLM's name)",
                                    ["finished_reason"], registry=r)
        self.vllm_prompt_tokens = Counter("vllm:prompt_tokens", "Prompt tokens prefilled, cached ones included "
                                          "(vLLM's name)", registry=r)
        self.vllm_generation_tokens = Counter("vllm:generation_tokens", "Tokens generated (vLLM's name)", registry=r)
        self.vllm_prefix_queries = Counter("vllm:prefix_cache_queries", "Prompt tokens looked up in the prefix "
                                           "cache (vLLM's name)", registry=r)
        self.vllm_prefix_hits = Counter("vllm:prefix_cache_hits", "Prompt tokens found in the prefix cache (vLLM's "
                                        "name)", registry=r)
        self.requests = Counter("baton_requests", "Requests finished, by finish reason", ["reason"], registry=r)
        self.ttft = Histogram("baton_time_to_first_token_seconds", "Arrival to first token", buckets=LATENCY_BUCKETS,
                              registry=r)
        self.tbt = Histogram("baton_time_between_tokens_seconds", "Time between a request's tokens",
                             buckets=LATENCY_BUCKETS, registry=r)
        self.transfers = Counter("baton_kv_transfers", "KV transfers, by outcome", ["outcome"], registry=r)
        self.transfer_transports = Counter("baton_kv_transfer_transports", "KV transfers landed, by transport (shm: "
                                           "shared memory to a decode worker on the same host; grpc)", ["transport"],
                                           registry=r)
        self.transfer_bytes = Counter("baton_kv_transfer_bytes", "KV bytes pushed or received", registry=r)
        self.prefix_predicted = Counter("baton_prefix_predicted_tokens", "Cached prompt tokens the router predicted",
                                        registry=r)
        self.prefix_actual = Counter("baton_prefix_cached_tokens", "Prompt tokens served from a prefix cache",
                                     registry=r)
        self.migrations = Counter("baton_kv_migrations", "Requests moved with their KV between decode workers on "
                                  "drain, by outcome (sent, failed, received)", ["outcome"], registry=r)
        self.overloaded = Counter("baton_overloaded", "Requests refused with RESOURCE_EXHAUSTED", registry=r)
        self.cache_events = Counter("baton_router_cache_events", "Prefill workers' prefix cache changes applied to the "
                                    "router's index, by kind (change, snapshot, gap, error)", ["kind"], registry=r)
        self.route_seconds = Histogram("baton_router_route_seconds", "Router time choosing a request's workers "
                                       "(block hashes, prefix index match, pick); no worker time",
                                       buckets=ROUTE_BUCKETS, registry=r)
        self.iteration_tokens = Histogram("baton_prefill_iteration_tokens", "Prompt tokens computed per prefill "
                                          "iteration (chunks and whole prompts; BatchLLM's token batches, whose dips "
                                          "are its valleys)", buckets=ITERATION_TOKEN_BUCKETS, registry=r)
        self.paused_forwards = Counter("baton_prefill_paused_forwards", "Batch-member prefill forwards paused "
                                       "between layers to prefill interactive prompts first", registry=r)

    def gauge(self, name: str, documentation: str, read: Callable[[], float]) -> None:
        """A gauge whose value is read from its owner at scrape time."""
        Gauge(name, documentation, registry=self.registry).set_function(read)

    def counter(self, name: str, documentation: str, read: Callable[[], float]) -> None:
        """A counter its owner keeps (it only grows), read at scrape time; served as `name_total`."""
        self.registry.register(_ReadCounter(name, documentation, read))

    def settings(self, chosen: dict[str, Amount]) -> None:
        """`baton_setting{setting, chosen_by}`: each size this process chose at start (or was given),
        with how, as /metrics shows them to a dashboard."""
        family = Gauge("baton_setting", "A size this worker chose at start where its config left it at 0, or was "
                       "given; chosen_by says how", ["setting", "chosen_by"], registry=self.registry)
        for name, amount in chosen.items():
            family.labels(setting=name, chosen_by=amount.source).set(amount.value)

    def served_registry(self) -> CollectorRegistry:
        """What `serve` exposes: every series of `registry` with the `model_name` label added."""
        served = CollectorRegistry()
        served.register(_WithLabel(self.registry, "model_name", self.model_name))
        return served

    def serve(self, port: int, host: str = "0.0.0.0") -> None:
        if port:
            start_http_server(port, addr=host, registry=self.served_registry())


def cumulative_buckets(histogram: Histogram) -> list[tuple[float, int]]:
    """(upper bound, requests at or under it) for each bucket of an unlabelled histogram, +Inf last."""
    return [(float(sample.labels["le"]), int(sample.value)) for family in histogram.collect()
            for sample in family.samples if sample.name.endswith("_bucket")]


class _ReadCounter(Collector):
    def __init__(self, name: str, documentation: str, read: Callable[[], float]):
        self.name, self.documentation, self.read = name, documentation, read

    def collect(self):
        yield CounterMetricFamily(self.name, self.documentation, value=float(self.read()))


class _WithLabel(Collector):
    """Another registry's series, each with one more label (prometheus_client has no constant labels)."""

    def __init__(self, inner: CollectorRegistry, name: str, value: str):
        self.inner, self.name, self.value = inner, name, value

    def collect(self):
        for family in self.inner.collect():  # fresh objects on every collect: ours to change
            family.samples = [s._replace(labels={self.name: self.value, **s.labels}) for s in family.samples]
            yield family
