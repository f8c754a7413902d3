"""The prefill worker process: its gRPC servicer (translation only) and `serve`.

The work itself is `PrefillLoop` (prefill_worker/loop.py); this module checks each call,
hands it to the loop and turns what the loop reports into replies.
"""
from __future__ import annotations

import logging
import threading
import time

import grpc

from baton import tracing
from baton.config import ClusterSettings, ModelSettings, PrefillSettings, TLSSettings
from baton.logs import STARTUP_LOGGER
from baton.messages import sampling_from_proto, settings_to_proto
from baton.metrics import Metrics
from baton.resources import Amount
from baton.server import GrpcServer, NotReady, cluster_token, run_when_ended
from baton.transport import check_address
from baton.v1 import common_pb2, workers_pb2, workers_pb2_grpc

from baton.engine.request import GenerationRequest, RequestError, validate_prompt
from baton.engine import threads
from baton.engine.executors import load_runner
from baton.kvtransfer.errors import KVPushFailed
from baton.prefill_worker.cache_events import CacheEventLog
from baton.prefill_worker.jobs import PrefillDone, PrefillJob
from baton.prefill_worker.loop import PrefillLoop
from baton.prefill_worker.targets import DecodeTargets

log = logging.getLogger(__name__)
started_log = logging.getLogger(STARTUP_LOGGER)


def reply_from(request_id: str, done: PrefillDone) -> workers_pb2.PrefillReply:
    return workers_pb2.PrefillReply(
        request_id=request_id, first_token=done.first_token, seed=done.seed, cached_tokens=done.cached_tokens,
        computed_tokens=done.computed_tokens, queue_seconds=done.queue_seconds,
        prefill_seconds=done.prefill_seconds, transfer_seconds=done.transfer_seconds, pulled_tokens=done.pulled_tokens)


MAX_CACHE_WATCHERS = 16  # routers following the prefix cache at once (each holds a thread)


def watch_cache(events: CacheEventLog, watchers: threading.BoundedSemaphore, request, context):
    """WatchCache's stream (a prefill or decode worker's): `events` from the follower's point on."""
    if not watchers.acquire(blocking=False):
        context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED,
                      f"{MAX_CACHE_WATCHERS} routers already follow this worker's KV events")
    try:
        for event in events.follow(request.epoch, request.after_seq, should_stop=lambda: not context.is_active()):
            yield workers_pb2.CacheEvent(epoch=event.epoch, seq=event.seq, snapshot=event.snapshot,
                                         stored=event.stored, evicted=event.evicted)
    finally:
        watchers.release()


class PrefillWorkerServicer(workers_pb2_grpc.PrefillWorkerServicer):
    def __init__(self, loop: PrefillLoop, chosen: dict[str, Amount] | None = None):
        self.loop = loop
        self.settings = settings_to_proto(chosen or {})  # the sizes chosen at start, for load reports
        self._watchers = threading.BoundedSemaphore(MAX_CACHE_WATCHERS)

    def Prefill(self, request, context):
        loaded = self.loop.runner.loaded
        try:
            if not request.request_id or not request.decode_target:
                raise RequestError("request_id and decode_target are required")
            check_address(request.decode_target, "decode_target")
            targets = self.loop.decode_targets
            if not targets.allows(request.decode_target):
                # Not a port scanner: KV goes only to decode workers of this cluster.
                log.warning("refused decode_target %s: not among %s", request.decode_target, targets.describe(),
                            extra={"decode_target": request.decode_target})
                context.abort(grpc.StatusCode.PERMISSION_DENIED,
                              f"decode_target {request.decode_target} is not one of this cluster's decode workers "
                              f"({targets.source})")
            if request.model_fingerprint and request.model_fingerprint != self.loop.fingerprint:
                raise RequestError(f"this worker serves model {self.loop.fingerprint}, "
                                   f"not {request.model_fingerprint}; route to a worker of that model")
            params = sampling_from_proto(request.sampling)
            prompt = list(request.prompt_token_ids)
            validate_prompt(prompt, params, max_context=loaded.max_context, vocab_size=loaded.config.vocab_size)
            if request.kv_skip_tokens >= len(prompt):
                raise RequestError(f"kv_skip_tokens={request.kv_skip_tokens} leaves none of the {len(prompt)}-token "
                                   "prompt's KV to push; it must be less than the prompt's length")
            job = PrefillJob(GenerationRequest(request.request_id, prompt, params, resume_step=request.resume_step),
                             request.decode_target, request.push_token, kv_skip_tokens=request.kv_skip_tokens)
            self.loop.pull_held(job, context.time_remaining())
            done = self.loop.submit(job)
        except (RequestError, ValueError) as exc:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        except OverflowError as exc:
            context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, str(exc))
        except ConnectionAbortedError as exc:
            context.abort(grpc.StatusCode.UNAVAILABLE, str(exc))
        run_when_ended(context, lambda: self.loop.cancel(request.request_id, job))
        while True:
            remaining = context.time_remaining()
            try:
                result = done.result(timeout=min(0.5, remaining) if remaining is not None else 0.5)
                tracing.record_stages(context.invocation_metadata(), job.request.trace, request_id=request.request_id,
                                      prompt_tokens=len(prompt), cached_tokens=result.cached_tokens)
                return reply_from(request.request_id, result)
            except TimeoutError:
                if not context.is_active():
                    self.loop.cancel(request.request_id, job)
                    return workers_pb2.PrefillReply()
            except KVPushFailed as exc:
                # ABORTED tells the router the prefill itself was fine: move the request to another
                # decode worker. Overload stays RESOURCE_EXHAUSTED.
                code = grpc.StatusCode.RESOURCE_EXHAUSTED if exc.code == "RESOURCE_EXHAUSTED" else grpc.StatusCode.ABORTED
                context.abort(code, f"KV transfer to {request.decode_target} failed: {exc}")
            except ConnectionAbortedError as exc:  # stopped before its turn: another worker may take it
                context.abort(grpc.StatusCode.UNAVAILABLE, str(exc))
            except Exception as exc:  # noqa: BLE001 - reported to the caller, worker stays up
                if done.cancelled():
                    context.abort(grpc.StatusCode.CANCELLED, "prefill cancelled")
                context.abort(grpc.StatusCode.INTERNAL, f"prefill failed: {exc}")

    def PinPrefix(self, request, context):
        if not request.group_id or not request.token_ids:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, "group_id and a non-empty token_ids are required")
        try:
            pinned, computed = self.loop.call(lambda core: core.pin(request.group_id, list(request.token_ids)),
                                              timeout=context.time_remaining())
        except ValueError as exc:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        except OverflowError as exc:
            context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, str(exc))
        except ConnectionAbortedError as exc:
            context.abort(grpc.StatusCode.UNAVAILABLE, str(exc))
        return workers_pb2.PinPrefixReply(pinned_tokens=pinned, computed_tokens=computed)

    def UnpinPrefix(self, request, context):
        try:
            found = self.loop.call(lambda core: core.unpin(request.group_id), timeout=context.time_remaining())
        except ConnectionAbortedError as exc:  # stopped: its pins went with it
            context.abort(grpc.StatusCode.UNAVAILABLE, str(exc))
        return workers_pb2.UnpinPrefixReply(found=found)

    def WatchCache(self, request, context):
        yield from watch_cache(self.loop.cache_events, self._watchers, request, context)

    def Cancel(self, request, context):
        return workers_pb2.CancelReply(found=self.loop.cancel(request.request_id))

    def GetLoad(self, request, context):
        loop = self.loop
        return common_pb2.PrefillLoad(
            queued=len(loop.queue), max_queue=loop.settings.max_queue, queued_tokens=loop.queue.queued_tokens,
            prompt_tokens_forwarded=loop.runner.prompt_tokens_forwarded, requests_done=loop.requests_done,
            model_fingerprint=loop.fingerprint, block_size=loop.core.block_size,
            cached_tokens_total=loop.core.cached_tokens_total, prefix_cache_bytes=loop.settings.prefix_cache_bytes,
            draining=loop.draining.is_set(), epoch=loop.epoch, settings=self.settings, pulls_kv=loop.puller is not None,
        )


def serve(model: ModelSettings, settings: PrefillSettings, tls: TLSSettings | None = None, *,
          cluster: ClusterSettings | None = None, block: bool = True):
    for address in settings.decode_workers:
        check_address(address, "prefill.decode_workers entries")
    token = cluster_token(cluster, "prefill", settings.host)
    server = GrpcServer(settings.host, settings.port, tls=tls, long_calls=settings.max_queue + MAX_CACHE_WATCHERS,
                        cluster_token=token)
    api = NotReady()
    workers_pb2_grpc.add_PrefillWorkerServicer_to_server(api, server.server)
    server.add_service("baton.v1.PrefillWorker")
    server.start()  # NOT_SERVING until the model is loaded
    started = time.monotonic()
    targets = DecodeTargets.from_settings(settings)  # before the model: a missing kubeconfig fails at once
    metrics = Metrics("prefill", model.name)
    runner = load_runner(model)
    loaded = runner.loaded
    loop = PrefillLoop(runner, settings, tls, settings.block_size, metrics, cluster_token=token,
                       decode_targets=targets).start()
    metrics.gauge("baton_prefill_queue_depth", "Prompts waiting for prefill", lambda: len(loop.queue))
    metrics.gauge("baton_prefill_unpushed_kv_bytes", "KV prefilled and not yet pushed, held under "
                  "prefill.kv_memory_bytes", lambda: loop.unpushed_kv_bytes)
    metrics.gauge("baton_prefill_queued_tokens", "Prompt tokens waiting for prefill", lambda: loop.queue.queued_tokens)
    if loop.puller is not None:
        puller = loop.puller
        metrics.counter("baton_prefill_kv_pulls", "Prompts whose leading KV was read from their decode worker "
                        "instead of computed (prefill.pull_kv)", lambda: puller.pulls_total)
        metrics.counter("baton_prefill_kv_pulled_tokens", "Prompt tokens of KV read from decode workers",
                        lambda: puller.pulled_tokens_total)
        metrics.counter("baton_prefill_kv_pull_failures", "Reads of a decode worker's KV that failed (those tokens "
                        "were computed)", lambda: puller.failures_total)
    metrics.gauge("baton_prefill_chunking", "Long prompts being prefilled a chunk per iteration",
                  lambda: loop.chunking)
    metrics.gauge("baton_prefill_prefix_cache_bytes", "Prefix KV cache bytes in use",
                  lambda: loop.core.cache.used_bytes if loop.core.cache else 0)
    # vLLM's names for the same state (what an endpoint picker or autoscaler reads).
    metrics.gauge("vllm:num_requests_waiting", "Prompts waiting for prefill", lambda: len(loop.queue))
    metrics.gauge("vllm:num_requests_running", "Prompts being prefilled or pushed", lambda: loop.running)
    metrics.gauge("vllm:kv_cache_usage_perc", "Share of the prefix cache in use (1 = full)",
                  lambda: loop.core.cache.used_bytes / max(1, loop.core.cache.capacity_bytes) if loop.core.cache else 0)
    chosen = {"threads": threads.chosen(),
              "tensor_parallel_size": Amount(getattr(runner, "tensor_parallel_size", 1), "model.tensor_parallel_size")}
    metrics.settings(chosen)
    metrics.serve(settings.metrics_port, settings.host)
    api.target = PrefillWorkerServicer(loop, chosen)
    server.set_serving()
    started_log.info("prefill worker serving on port %d, %.1fs after start (model %s)", server.port,
                     time.monotonic() - started, loaded.fingerprint)
    if not block:
        return server, loop
    server.wait_for_signal(on_stop=loop.stop, drain=lambda: loop.drain(settings.drain_timeout_s),
                           drain_timeout_s=settings.drain_timeout_s)
