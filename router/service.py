"""The router process: the public API. It validates and tokenizes, then hands each request to the
dispatcher (route by prefix index and load, open the decode stream, start the prefill, relay)."""
from __future__ import annotations

import contextlib
import logging
import os
import uuid

import grpc

from baton.auth import BearerTokenInterceptor, load_token
from baton.config import ClusterSettings, ModelSettings, RouterSettings, TLSSettings
from baton.logs import STARTUP_LOGGER
from baton.metrics import Metrics, cumulative_buckets
from baton.server import GrpcServer, NotReady, cluster_token, run_when_ended
from baton.v1 import router_pb2, router_pb2_grpc
from baton.engine.model_files import load_tokenizer_view
from baton.engine.request import RequestError
from baton.router.admission import DecodeAdmission
from baton.router.batch import BatchRunner
from baton.router.cache_sync import CacheSync
from baton.router.dispatch import DispatchError, Dispatcher
from baton.router.front import RETRY_AFTER_SECONDS, Front, Refused
from baton.router.policy import Picker, RoutingWeights
from baton.router.prefix_index import PrefixIndexConfig, build_prefix_index
from baton.router.progress import StallWatch
from baton.router.discovery import WorkerSet, discovery_from_settings
from baton.router.workers import WorkerPool

log = logging.getLogger(__name__)

MAX_BATCH_REQUESTS = 10_000


class RouterServicer(router_pb2_grpc.RouterServicer):
    """gRPC's translation of the router's front: wire messages in, statuses out."""

    def __init__(self, front: Front, cache_synced=lambda address: False):
        """cache_synced(address): whether the prefix index follows that prefill worker's cache."""
        self.front = front
        self.cache_synced = cache_synced
        self.model = front.model
        self.metrics = front.metrics
        self.dispatcher = front.dispatcher
        self.pool = front.pool

    def _prompt_ids(self, request) -> list[int]:
        kind = request.WhichOneof("prompt")
        if kind == "text":
            return self.front.encode_text(request.text)
        if kind == "messages":
            return self.front.encode_chat([{"role": m.role, "content": m.content}
                                           for m in request.messages.messages])
        if kind == "token_ids":
            return list(request.token_ids.ids)
        raise RequestError("no prompt: set one of text, messages or token_ids")

    def _validated(self, request) -> list[int]:
        prompt = self._prompt_ids(request)
        self.front.apply_defaults(request.sampling)
        self.front.validate(prompt, request.sampling)
        return prompt

    @contextlib.contextmanager
    def _admitted(self, count: int, context):
        try:
            with self.front.admitted(count):
                yield
        except Refused as refused:
            if refused.draining:
                context.abort(grpc.StatusCode.UNAVAILABLE, str(refused))
            context.set_trailing_metadata((("retry-after-s", str(RETRY_AFTER_SECONDS)),))
            context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, str(refused))

    def Generate(self, request, context):
        try:
            prompt = self._validated(request)
        except (RequestError, ValueError) as exc:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        with self._admitted(1, context):
            yield from self._relay(request, prompt, context)

    def _relay(self, request, prompt, context):
        try:
            yield from self.front.generate(request.request_id or uuid.uuid4().hex, prompt, request.sampling,
                                           context.time_remaining(), on_done=lambda cancel: run_when_ended(context, cancel),
                                           carrier=context.invocation_metadata())
        except DispatchError as err:
            if err.code == grpc.StatusCode.CANCELLED and not context.is_active():
                return  # the client left; nothing to tell it
            if err.code == grpc.StatusCode.RESOURCE_EXHAUSTED:
                # A worker's bound (prefill queue, decode requests waiting for KV, staging room) was
                # hit: the client hears it as the router's own overload, retry hint included.
                self.metrics.overloaded.inc()
                context.set_trailing_metadata((("retry-after-s", str(RETRY_AFTER_SECONDS)),))
            context.abort(err.code, err.message)

    def GenerateBatch(self, request, context):
        count = len(request.requests)
        if not 0 < count <= MAX_BATCH_REQUESTS:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                          f"a batch needs 1 to {MAX_BATCH_REQUESTS} requests (got {count}); split it")
        prompts = []
        for i, item in enumerate(request.requests):
            try:
                prompts.append(self._validated(item))
            except (RequestError, ValueError) as exc:
                context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"request {i}: {exc}")
        concurrency = request.max_concurrency or max(4, 2 * sum(v.capacity for v in self.pool.views("decode")))
        # A batch holds router slots for its whole run: never more than it has members.
        concurrency = min(concurrency, self.front.settings.max_inflight, count)
        with self._admitted(concurrency, context):
            runner = BatchRunner(self.dispatcher, concurrency)
            outcomes = runner.run(prompts, [r.sampling for r in request.requests], context.time_remaining(),
                                  on_done=lambda cancel: run_when_ended(context, cancel), carrier=context.invocation_metadata())
            # closing() ends the batch's members before the slots below are released
            with contextlib.closing(outcomes):
                for index, outcome in outcomes:
                    if index is None:
                        yield router_pb2.GenerateBatchResponse(summary=outcome)
                    elif isinstance(outcome, DispatchError):
                        overloaded = outcome.code == grpc.StatusCode.RESOURCE_EXHAUSTED
                        yield router_pb2.GenerateBatchResponse(
                            index=index, error_code=outcome.code.name, error_message=outcome.message,
                            retry_after_s=float(RETRY_AFTER_SECONDS) if overloaded else 0.0)
                    else:
                        yield router_pb2.GenerateBatchResponse(index=index, result=outcome)

    def GetModelInfo(self, request, context):
        fingerprints = {w.fingerprint for w in self.pool.all() if w.fingerprint}
        info = router_pb2.ModelInfo(name=self.model.name, max_context=self.front.max_context(),
                                    model_fingerprint=",".join(sorted(fingerprints)), vocab_size=self.model.vocab_size,
                                    sampling_defaults=self.front.sampling_defaults)
        for w in self.pool.all():
            if w.last_load is not None and w.last_load.settings:
                info.workers.add(address=w.view.address, role=w.role, settings=w.last_load.settings)
        return info

    def GetClusterStatus(self, request, context):
        stats = self.dispatcher.stats
        local = self.dispatcher.local_stats
        status = router_pb2.ClusterStatus(routing=router_pb2.RoutingStats(
            requests=stats.requests, predicted_cached_tokens=stats.predicted_tokens,
            actual_cached_tokens=stats.actual_tokens, accuracy=stats.accuracy, prefilled_again=stats.prefilled_again,
            local_requests=local.requests, local_predicted_cached_tokens=local.predicted_tokens,
            local_actual_cached_tokens=local.actual_tokens, local_accuracy=local.accuracy,
            pulled_requests=stats.pulled_requests, pulled_tokens=stats.pulled_tokens))
        for bound, count in cumulative_buckets(self.metrics.vllm_ttft):
            status.routing.ttft_bounds_s.append(bound)
            status.routing.ttft_counts.append(count)
        for w in self.pool.all():
            entry = status.workers.add(address=w.view.address, role=w.role, healthy=w.view.healthy,
                                       cache_synced=self.cache_synced(w.view.address))
            if w.last_load is not None:
                (entry.decode if w.role == "decode" else entry.prefill).CopyFrom(w.last_load)
        return status


def serve(model: ModelSettings, settings: RouterSettings, tls: TLSSettings | None = None, *,
          cluster: ClusterSettings | None = None, block: bool = True):
    token = load_token(settings.auth_token_file, os.environ)
    if token and not (tls is not None and tls.enabled):
        log.warning("the bearer token reaches this router in plaintext: set tls.cert_file/key_file, "
                    "or terminate TLS in front of it")
    server = GrpcServer(settings.host, settings.port, tls=tls, long_calls=settings.max_inflight,
                        require_client_cert=settings.require_client_cert,
                        interceptors=[BearerTokenInterceptor(token)] if token else [])
    api = NotReady()
    router_pb2_grpc.add_RouterServicer_to_server(api, server.server)
    server.add_service("baton.v1.Router")
    server.start()
    view = load_tokenizer_view(model.name, model.generation_config, model.override_generation_config)
    if settings.chat_template:
        from baton.router.openai_api.server import load_chat_template

        view.tokenizer.chat_template = load_chat_template(settings.chat_template)
    index = build_prefix_index(PrefixIndexConfig(backend=settings.prefix_index, max_blocks=settings.index_max_blocks,
                                                 ttl_s=settings.index_ttl_s or None,
                                                 redis_url=settings.redis_url or "redis://127.0.0.1:6379/0",
                                                 namespace=settings.index_namespace,
                                                 redis_password=settings.redis_password))
    metrics = Metrics("router", settings.served_model_name or model.name)
    sync = CacheSync(index, refresh_s=settings.index_ttl_s / 3 if settings.index_ttl_s else None,
                     on_event=lambda address, kind: metrics.cache_events.labels(kind).inc()).start()
    pool = WorkerPool(tls, settings.load_poll_seconds, cluster_token(cluster, "router"))
    pool.on_joined, pool.on_left = sync.follow, sync.forget
    workers = WorkerSet()
    workers.subscribe(lambda role, added, removed: pool.set_workers(role, workers.get(role)))
    discovery = discovery_from_settings(settings)
    discovery.start(workers)
    pool.poll_once()
    pool.start()
    picker = Picker(RoutingWeights(load=settings.load_weight, cached_tokens=settings.cache_weight))
    dispatcher = Dispatcher(pool, index, settings.block_size, picker, on_route=metrics.route_seconds.observe,
                            pending_max_blocks=settings.pending_max_blocks,
                            admission=DecodeAdmission(settings.decode_queue_per_worker),
                            local_prefill_max_tokens=settings.local_prefill_max_tokens)
    sync.on_lost = dispatcher.pending.forget  # what we sent a worker that died is not being computed
    stalls = StallWatch(dispatcher.inflight, settings.stall_log_s).start()
    server.extra_stops.append(stalls.stop)
    front = Front(view, dispatcher, settings, metrics)
    api.target = RouterServicer(front, sync.synced)
    metrics.gauge("baton_router_inflight", "Requests in flight through this router", lambda: front.inflight)
    metrics.gauge("baton_router_stalled_requests", "Requests that have not moved (no row, no KV, no token) for "
                  "router.stall_log_s", lambda: len(dispatcher.inflight.stalled(settings.stall_log_s)))
    metrics.gauge("baton_router_waiting_for_decode", "Requests waiting, before their prefill, for a decode row "
                  "(router.decode_queue_per_worker)", lambda: dispatcher.admission.waiting)
    metrics.gauge("baton_router_routing_accuracy", "Predicted vs actual cached prompt tokens of requests routed to "
                  "a prefill worker",
                  lambda: front.dispatcher.stats.accuracy)
    metrics.counter("baton_router_prefilled_again", "Requests that lost their decode worker and were prefilled "
                    "once more (a drain moves them with their KV instead)", lambda: dispatcher.stats.prefilled_again)
    metrics.counter("baton_router_local_prefills", "Requests prefilled on the decode worker holding most of their "
                    "prompt (conditional disaggregation)", lambda: dispatcher.local_stats.requests)
    metrics.gauge("baton_router_local_routing_accuracy", "Predicted vs actual cached prompt tokens of requests "
                  "prefilled on their decode worker", lambda: dispatcher.local_stats.accuracy)
    metrics.serve(settings.metrics_port, settings.host)
    http = None
    if settings.http_port:
        from baton.router.openai_api.protocol import served_names
        from baton.router.openai_api.server import OpenAIServer

        http = OpenAIServer(front, host=settings.host, port=settings.http_port,
                            served=served_names(model.name, settings.served_model_name), token=token or "", tls=tls,
                            require_client_cert=settings.require_client_cert, max_threads=settings.max_inflight,
                            timeout=settings.http_request_timeout_s)
        http.start()
        server.extra_stops.append(http.stop)
    server.extra_stops.append(sync.stop)  # however it stops (signal, or a caller of block=False)
    server.set_serving()
    logging.getLogger(STARTUP_LOGGER).info(
        "router serving on port %d (%s, %s)%s", server.port, "TLS" if tls is not None and tls.enabled else "plaintext",
        "bearer token" if token else "no auth", f", OpenAI API on port {http.port}" if http else "")
    if not block:
        return server, pool
    server.wait_for_signal(on_stop=lambda: (discovery.stop(), sync.stop(), pool.stop()),
                           drain=lambda: front.drain(settings.drain_timeout_s), drain_timeout_s=settings.drain_timeout_s)
