"""Prometheus metrics, one registry per process, served on its `metrics_port` (0 = off).

Gauges that mirror live state (rows, KV bytes, queue depth) are read when scraped, from the
objects that own that state, so nothing is updated twice.
"""
from __future__ import annotations

from typing import Callable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server

ROUTE_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.1)
LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)


class Metrics:
    def __init__(self, role: str):
        self.role = role
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter("baton_requests", "Requests finished, by finish reason", ["reason"], registry=r)
        self.ttft = Histogram("baton_time_to_first_token_seconds", "Arrival to first token", buckets=LATENCY_BUCKETS,
                              registry=r)
        self.tbt = Histogram("baton_time_between_tokens_seconds", "Time between a request's tokens",
                             buckets=LATENCY_BUCKETS, registry=r)
        self.transfers = Counter("baton_kv_transfers", "KV transfers, by outcome", ["outcome"], registry=r)
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
        self.paused_forwards = Counter("baton_prefill_paused_forwards", "Batch-member prefill forwards paused "
                                       "between layers to prefill interactive prompts first", registry=r)

    def gauge(self, name: str, documentation: str, read: Callable[[], float]) -> None:
        """A gauge whose value is read from its owner at scrape time."""
        Gauge(name, documentation, registry=self.registry).set_function(read)

    def serve(self, port: int, host: str = "0.0.0.0") -> None:
        if port:
            start_http_server(port, addr=host, registry=self.registry)
