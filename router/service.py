"""The router process: the public API. It validates and tokenizes, then hands each request to the
dispatcher (route by prefix index and load, open the decode stream, start the prefill, relay)."""
from __future__ import annotations

import contextlib
import logging
import os
import threading
import time
import uuid

import grpc

from baton.auth import BearerTokenInterceptor, load_token
from baton.config import ClusterSettings, ModelSettings, RouterSettings, TLSSettings
from baton.messages import sampling_from_proto
from baton.metrics import Metrics
from baton.server import GrpcServer, NotReady, cluster_token
from baton.v1 import router_pb2, router_pb2_grpc
from baton.engine.model import TokenizerView, load_tokenizer_view
from baton.engine.request import RequestError, validate_prompt
from baton.router.batch import BatchRunner
from baton.router.dispatch import DispatchError, Dispatcher
from baton.router.policy import Picker, RoutingWeights
from baton.router.prefix_index import PrefixIndexConfig, build_prefix_index
from baton.router.discovery import WorkerSet, discovery_from_settings
from baton.router.workers import WorkerPool

log = logging.getLogger(__name__)

MAX_BATCH_REQUESTS = 10_000
# Seconds an overloaded client is told to wait before retrying (trailing metadata `retry-after-s`):
# about how long a decode row or a prefill queue slot takes to free up.
RETRY_AFTER_SECONDS = "1"


class RouterServicer(router_pb2_grpc.RouterServicer):
    def __init__(self, model: TokenizerView, dispatcher: Dispatcher, settings: RouterSettings,
                 metrics: Metrics | None = None):
        self.model = model
        self.metrics = metrics or Metrics("router")
        self.dispatcher = dispatcher
        self.pool = dispatcher.pool
        self.settings = settings
        self._inflight = 0
        self._lock = threading.Lock()
        self._idle = threading.Condition(self._lock)
        self._draining = False

    # -- translating the request ----------------------------------------------------------

    def _prompt_ids(self, request) -> list[int]:
        kind = request.WhichOneof("prompt")
        if kind == "text":
            if not request.text:
                raise RequestError("text is empty; send a non-empty prompt")
            return self.model.encode_text(request.text)
        if kind == "messages":
            messages = [{"role": m.role, "content": m.content} for m in request.messages.messages]
            if not messages:
                raise RequestError("messages is empty; send at least one chat message")
            bad = [m["role"] for m in messages if m["role"] not in ("system", "user", "assistant")]
            if bad:
                raise RequestError(f"unknown chat role {bad[0]!r}; use system, user or assistant")
            return self.model.encode_chat(messages)
        if kind == "token_ids":
            return list(request.token_ids.ids)
        raise RequestError("no prompt: set one of text, messages or token_ids")

    # -- the public API -----------------------------------------------------------------------

    def _validated(self, request) -> list[int]:
        prompt = self._prompt_ids(request)
        params = sampling_from_proto(request.sampling)
        validate_prompt(prompt, params, max_context=self.max_context(), vocab_size=self.model.vocab_size)
        return prompt

    def max_context(self) -> int:
        """The context this cluster serves: the model's, or the smallest a decode worker reports
        (its KV budget may buy fewer columns); what GetModelInfo advertises and prompts are held to."""
        served = [w.last_load.max_context for w in self.pool.all()
                  if w.role == "decode" and w.view.healthy and w.last_load is not None and w.last_load.max_context]
        return min([self.model.max_context, *served])

    def _admit(self, count: int, context) -> None:
        with self._lock:
            if self._draining:
                context.abort(grpc.StatusCode.UNAVAILABLE, "this router is draining (shutting down); retry on "
                                                           "another router replica")
            if self._inflight + count > self.settings.max_inflight:
                self.metrics.overloaded.inc()
                context.set_trailing_metadata((("retry-after-s", RETRY_AFTER_SECONDS),))
                context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED,
                              f"the router has {self._inflight} of {self.settings.max_inflight} requests in flight; "
                              "retry later")
            self._inflight += count

    def _leave(self, count: int) -> None:
        with self._lock:
            self._inflight -= count
            if self._inflight == 0:
                self._idle.notify_all()

    def drain(self, timeout: float) -> bool:
        """Refuse new requests and wait up to `timeout` seconds for those in flight to finish;
        True when none is left. The worker channels stay open until then."""
        with self._lock:
            self._draining = True
            if self._inflight:
                log.info("draining: %d request(s) in flight", self._inflight)
            finished = self._idle.wait_for(lambda: self._inflight == 0, timeout)
        if not finished:
            log.warning("drain timed out after %.0fs with %d request(s) still in flight", timeout, self._inflight)
        return finished

    def Generate(self, request, context):
        try:
            prompt = self._validated(request)
        except (RequestError, ValueError) as exc:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        self._admit(1, context)
        started = time.monotonic()
        first = True
        try:
            for msg in self.dispatcher.run(request.request_id or uuid.uuid4().hex, prompt, request.sampling,
                                           context.time_remaining(), on_done=context.add_callback):
                if first and msg.token_ids:
                    self.metrics.ttft.observe(time.monotonic() - started)
                    first = False
                if msg.finish_reason:
                    self.metrics.requests.labels(msg.finish_reason).inc()
                    self.metrics.prefix_predicted.inc(msg.trace.predicted_cached_tokens)
                    self.metrics.prefix_actual.inc(msg.trace.cached_tokens)
                yield msg
        except DispatchError as err:
            if err.code == grpc.StatusCode.CANCELLED and not context.is_active():
                return  # the client left; nothing to tell it
            if err.code == grpc.StatusCode.RESOURCE_EXHAUSTED:
                # A worker's bound (prefill queue, decode requests waiting for KV, staging room) was
                # hit: the client hears it as the router's own overload, retry hint included.
                self.metrics.overloaded.inc()
                context.set_trailing_metadata((("retry-after-s", RETRY_AFTER_SECONDS),))
            context.abort(err.code, err.message)
        finally:
            self._leave(1)

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
        concurrency = min(concurrency, self.settings.max_inflight, count)
        self._admit(concurrency, context)
        try:
            runner = BatchRunner(self.dispatcher, concurrency)
            outcomes = runner.run(prompts, [r.sampling for r in request.requests], context.time_remaining(),
                                  on_done=context.add_callback)
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
        finally:
            self._leave(concurrency)

    def GetModelInfo(self, request, context):
        fingerprints = {w.fingerprint for w in self.pool.all() if w.fingerprint}
        return router_pb2.ModelInfo(name=self.model.name, max_context=self.max_context(),
                                    model_fingerprint=",".join(sorted(fingerprints)), vocab_size=self.model.vocab_size)

    def GetClusterStatus(self, request, context):
        stats = self.dispatcher.stats
        status = router_pb2.ClusterStatus(routing=router_pb2.RoutingStats(
            requests=stats.requests, predicted_cached_tokens=stats.predicted_tokens,
            actual_cached_tokens=stats.actual_tokens, accuracy=stats.accuracy))
        for w in self.pool.all():
            entry = status.workers.add(address=w.view.address, role=w.role, healthy=w.view.healthy)
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
    view = load_tokenizer_view(model.name)
    index = build_prefix_index(PrefixIndexConfig(backend=settings.prefix_index, max_blocks=settings.index_max_blocks,
                                                 redis_url=settings.redis_url or "redis://127.0.0.1:6379/0",
                                                 namespace=settings.index_namespace))
    pool = WorkerPool(tls, settings.load_poll_seconds, cluster_token(cluster, "router"))
    workers = WorkerSet()
    workers.subscribe(lambda role, added, removed: pool.set_workers(role, workers.get(role)))
    discovery = discovery_from_settings(settings)
    discovery.start(workers)
    pool.poll_once()
    pool.start()
    picker = Picker(RoutingWeights(load=settings.load_weight, cached_tokens=settings.cache_weight))
    metrics = Metrics("router")
    api.target = RouterServicer(view, Dispatcher(pool, index, settings.block_size, picker), settings, metrics)
    metrics.gauge("baton_router_inflight", "Requests in flight through this router", lambda: api.target._inflight)
    metrics.gauge("baton_router_routing_accuracy", "Predicted vs actual cached prompt tokens",
                  lambda: api.target.dispatcher.stats.accuracy)
    metrics.serve(settings.metrics_port, settings.host)
    server.set_serving()
    log.info("router serving on port %d (%s, %s)", server.port,
             "TLS" if tls is not None and tls.enabled else "plaintext", "bearer token" if token else "no auth")
    if not block:
        return server, pool
    server.wait_for_signal(on_stop=lambda: (discovery.stop(), pool.stop()),
                           drain=lambda: api.target.drain(settings.drain_timeout_s))
