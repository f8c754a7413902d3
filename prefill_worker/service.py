"""The prefill worker process: queue prompts, prefill them in length-similar batches, push their KV.

Prefill RPCs wait on a bounded queue; one compute thread takes the next batch (prompts of
similar length together, bounded by tokens and count), runs it, samples each first token, and
hands each KV to a sender pool so pushing to decode workers overlaps the next batch's compute.
"""
from __future__ import annotations

import logging
import queue
import threading
import time
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field

import grpc

from baton.config import ClusterSettings, ModelSettings, PrefillSettings, TLSSettings
from baton.messages import sampling_from_proto
from baton.metrics import Metrics
from baton.server import GrpcServer, NotReady, channel, cluster_token
from baton.transport import check_address
from baton.v1 import common_pb2, workers_pb2, workers_pb2_grpc

from baton.engine.request import GenerationRequest, RequestError, validate_prompt
from baton.engine.executors import Runner, load_runner
from baton.kvtransfer.errors import KVPushFailed
from baton.kvtransfer.grpc_transport import PushRetry, push_kv_retrying
from baton.kvtransfer.wire import grpc_push_channel_options
from baton.prefill_worker.batching import PrefillQueue
from baton.prefill_worker.core import PrefillCore

log = logging.getLogger(__name__)

# On SIGTERM: seconds to finish queued prompts before stopping (inside Kubernetes' 30 s grace).
DRAIN_SECONDS = 20.0
# A KV push, retries included, never takes longer than this. It is only the backstop: a broken
# push is noticed within about a second (kvtransfer.wire), and a receiver waiting for staging
# room answers RESOURCE_EXHAUSTED after its own reserve timeout.
PUSH_TIMEOUT_SECONDS = 30.0
PUSH_RETRY = PushRetry(attempts=3, backoff_s=0.2)
# Channels kept open to decode workers; far more than a deployment has, but not unbounded as
# workers are replaced over days. The least recently used one is closed first.
MAX_PUSH_CHANNELS = 64


@dataclass
class PrefillJob:
    request: GenerationRequest
    decode_target: str
    push_token: str = ""  # presented with the KV push; the decode worker registered the same
    done: Future = field(default_factory=Future)
    cancelled: bool = False


class PrefillLoop:
    """One compute thread owns the PrefillCore (prefix cache included); RPC threads reach it only
    through the job queue and the control queue (pin/unpin), which it serves between batches."""

    def __init__(self, runner: Runner, settings: PrefillSettings, tls: TLSSettings | None = None,
                 block_size: int = 16, metrics: Metrics | None = None, cluster_token: str | None = None):
        self.runner = runner
        self.metrics = metrics or Metrics("prefill")
        self.core = PrefillCore(runner, prefix_cache_bytes=settings.prefix_cache_bytes, block_size=block_size,
                                max_pins=settings.max_pins, pin_ttl_s=settings.pin_ttl_s)
        self.settings = settings
        self.tls = tls
        self.cluster_token = cluster_token
        self.decode_workers = frozenset(settings.decode_workers)
        self.queue = PrefillQueue(settings.max_queue, settings.max_batch_tokens, settings.max_batch_size)
        self.fingerprint = str(runner.loaded.fingerprint)
        self.requests_done = 0
        self._senders = ThreadPoolExecutor(max_workers=4, thread_name_prefix="kv-push")
        self._channels: "OrderedDict[str, grpc.Channel]" = OrderedDict()  # most recently used last
        self._lock = threading.Lock()
        self._control: "queue.Queue[tuple]" = queue.Queue()
        self._stop = threading.Event()
        self.draining = threading.Event()
        self._inflight: set[Future] = set()  # taken from the queue, not yet pushed
        self._thread = threading.Thread(target=self._run, name="prefill-loop", daemon=True)

    def start(self) -> "PrefillLoop":
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self.queue.close()
        self._thread.join(timeout=10)
        self._senders.shutdown(wait=False, cancel_futures=True)

    def drain(self, timeout: float) -> bool:
        """Take no new prompts; finish (and push) the queued ones, up to timeout."""
        self.draining.set()
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if not len(self.queue) and not self._inflight:
                return True
            time.sleep(0.1)
        return False

    def submit(self, job: PrefillJob) -> Future:
        if self.draining.is_set():
            raise ConnectionAbortedError("this prefill worker is draining; send the prompt elsewhere")
        if len(self.queue) + len(self._inflight) >= self.settings.max_queue:
            # Prompts being prefilled or pushed count too: each holds its Prefill call's thread.
            raise OverflowError(f"{self.settings.max_queue} prompts are already queued or being prefilled here; "
                                "retry later")
        job.request.trace.mark("arrived")
        # Raises OverflowError when full; higher priorities (interactive requests) prefill first.
        self.queue.put(job, len(job.request.prompt_token_ids), job.request.params.priority)
        return job.done

    def cancel(self, request_id: str, job: PrefillJob | None = None) -> bool:
        job = self.queue.remove(request_id, job)
        if job is not None:
            job.cancelled = True
            job.done.cancel()
            return True
        return False

    def call(self, fn, *args, timeout: float | None = None):
        """Run fn(core, *args) on the compute thread, between batches; returns its result."""
        done: Future = Future()
        self._control.put((fn, args, done))
        return done.result(timeout=timeout)

    def _serve_control(self) -> None:
        while True:
            try:
                fn, args, done = self._control.get_nowait()
            except queue.Empty:
                return
            try:
                done.set_result(fn(self.core, *args))
            except Exception as exc:
                done.set_exception(exc)

    def _run(self) -> None:
        while not self._stop.is_set():
            self._serve_control()
            if self.core.pins:
                for group_id in self.core.expire_pins():
                    log.warning("pin of group %s expired after prefill.pin_ttl_s=%ss without an unpin", group_id,
                                self.core.pin_ttl_s)
            jobs = self.queue.take_batch(timeout=0.05)
            if not jobs:
                continue
            jobs = [j for j in jobs if not j.cancelled and j.done.set_running_or_notify_cancel()]
            if not jobs:
                continue
            for job in jobs:
                self._inflight.add(job.done)
                job.done.add_done_callback(self._inflight.discard)
            try:
                self._prefill(jobs)
            except Exception as exc:  # one bad batch must not take the worker down
                log.exception("prefill batch failed")
                for job in jobs:
                    if not job.done.done():
                        job.done.set_exception(exc)

    def _prefill(self, jobs: list[PrefillJob]) -> None:
        prefilled = self.core.prefill([j.request for j in jobs])
        events = self.core.drain_events()
        for i, (job, done) in enumerate(zip(jobs, prefilled)):
            # The batch's KV events ride on its first reply; the router applies them.
            self._senders.submit(self._push, job, done, events if i == 0 else None)
        self.requests_done += len(jobs)

    def _push(self, job: PrefillJob, prefilled, events) -> None:
        trace = job.request.trace
        meta = workers_pb2.KVMetadata(
            first_token=prefilled.first_token, seed=prefilled.seed, cached_tokens=prefilled.cached_tokens,
            queue_seconds=trace.marks["prefill_start"] - trace.marks["arrived"],
            prefill_seconds=trace.marks["prefill_end"] - trace.marks["prefill_start"],
        )
        reply = workers_pb2.PrefillReply(
            request_id=job.request.request_id, first_token=prefilled.first_token, seed=prefilled.seed,
            cached_tokens=prefilled.cached_tokens,
            computed_tokens=len(job.request.prompt_token_ids) - prefilled.cached_tokens,
            queue_seconds=meta.queue_seconds, prefill_seconds=meta.prefill_seconds,
        )
        if events is not None:
            reply.stored_blocks.extend(events.stored)
            reply.evicted_blocks.extend(events.evicted)

        def retrying(attempt: int, failure: KVPushFailed) -> None:
            self.metrics.transfers.labels("retried").inc()
            log.warning("KV push of request %s to %s failed (attempt %d): %s; retrying", job.request.request_id,
                        job.decode_target, attempt, failure)

        try:
            if job.cancelled:
                raise RequestError("cancelled")
            push_kv_retrying(self._channel(job.decode_target), job.request.request_id, self.fingerprint, prefilled.kv,
                             meta.SerializeToString(), chunk_bytes=self.settings.kv_chunk_bytes,
                             timeout_s=PUSH_TIMEOUT_SECONDS, retry=PUSH_RETRY, should_stop=lambda: job.cancelled,
                             on_retry=retrying, push_token=job.push_token)
            reply.transfer_seconds = time.monotonic() - trace.marks["prefill_end"]
            self.metrics.transfers.labels("ok").inc()
            self.metrics.transfer_bytes.inc(prefilled.kv.nbytes)
            self.metrics.prefix_actual.inc(prefilled.cached_tokens)
            job.done.set_result(reply)
        except Exception as exc:
            self.metrics.transfers.labels("cancelled" if job.cancelled else "failed").inc()
            job.done.set_exception(exc)

    def _channel(self, target: str) -> grpc.Channel:
        with self._lock:
            if target in self._channels:
                self._channels.move_to_end(target)
                return self._channels[target]
            # Keepalive pings and a connect deadline: a push to a dead decode worker fails fast.
            self._channels[target] = channel(target, self.tls, extra_options=grpc_push_channel_options(),
                                             cluster_token=self.cluster_token)
            while len(self._channels) > MAX_PUSH_CHANNELS:  # decode workers come and go (pod IPs): bounded
                self._channels.popitem(last=False)[1].close()
            return self._channels[target]


class PrefillWorkerServicer(workers_pb2_grpc.PrefillWorkerServicer):
    def __init__(self, loop: PrefillLoop):
        self.loop = loop

    def Prefill(self, request, context):
        loaded = self.loop.runner.loaded
        try:
            if not request.request_id or not request.decode_target:
                raise RequestError("request_id and decode_target are required")
            check_address(request.decode_target, "decode_target")
            if self.loop.decode_workers and request.decode_target not in self.loop.decode_workers:
                # Not a port scanner: KV goes only to decode workers of this cluster.
                context.abort(grpc.StatusCode.PERMISSION_DENIED,
                              f"decode_target {request.decode_target} is not one of this cluster's decode workers")
            if request.model_fingerprint and request.model_fingerprint != self.loop.fingerprint:
                raise RequestError(f"this worker serves model {self.loop.fingerprint}, "
                                   f"not {request.model_fingerprint}; route to a worker of that model")
            params = sampling_from_proto(request.sampling)
            prompt = list(request.prompt_token_ids)
            validate_prompt(prompt, params, max_context=loaded.max_context, vocab_size=loaded.config.vocab_size)
            job = PrefillJob(GenerationRequest(request.request_id, prompt, params, resume_step=request.resume_step),
                             request.decode_target, request.push_token)
            done = self.loop.submit(job)
        except (RequestError, ValueError) as exc:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        except OverflowError as exc:
            context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, str(exc))
        except ConnectionAbortedError as exc:
            context.abort(grpc.StatusCode.UNAVAILABLE, str(exc))
        context.add_callback(lambda: self.loop.cancel(request.request_id, job))
        while True:
            remaining = context.time_remaining()
            try:
                return done.result(timeout=min(0.5, remaining) if remaining is not None else 0.5)
            except TimeoutError:
                if not context.is_active():
                    self.loop.cancel(request.request_id, job)
                    return workers_pb2.PrefillReply()
            except KVPushFailed as exc:
                # ABORTED tells the router the prefill itself was fine: move the request to another
                # decode worker. Overload stays RESOURCE_EXHAUSTED.
                code = grpc.StatusCode.RESOURCE_EXHAUSTED if exc.code == "RESOURCE_EXHAUSTED" else grpc.StatusCode.ABORTED
                context.abort(code, f"KV transfer to {request.decode_target} failed: {exc}")
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
            events = self.loop.call(lambda core: core.drain_events())
        except ValueError as exc:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        except OverflowError as exc:
            context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, str(exc))
        return workers_pb2.PinPrefixReply(pinned_tokens=pinned, computed_tokens=computed,
                                          stored_blocks=events.stored, evicted_blocks=events.evicted)

    def UnpinPrefix(self, request, context):
        return workers_pb2.UnpinPrefixReply(found=self.loop.call(lambda core: core.unpin(request.group_id)))

    def Cancel(self, request, context):
        return workers_pb2.CancelReply(found=self.loop.cancel(request.request_id))

    def GetLoad(self, request, context):
        loop = self.loop
        return common_pb2.PrefillLoad(
            queued=len(loop.queue), max_queue=loop.settings.max_queue, queued_tokens=loop.queue.queued_tokens,
            prompt_tokens_forwarded=loop.runner.prompt_tokens_forwarded, requests_done=loop.requests_done,
            model_fingerprint=loop.fingerprint, block_size=loop.core.block_size,
            cached_tokens_total=loop.core.cached_tokens_total, prefix_cache_bytes=loop.settings.prefix_cache_bytes,
            draining=loop.draining.is_set(),
        )


def serve(model: ModelSettings, settings: PrefillSettings, tls: TLSSettings | None = None, *,
          cluster: ClusterSettings | None = None, block: bool = True):
    for address in settings.decode_workers:
        check_address(address, "prefill.decode_workers entries")
    token = cluster_token(cluster, "prefill")
    server = GrpcServer(settings.host, settings.port, tls=tls, long_calls=settings.max_queue, cluster_token=token)
    api = NotReady()
    workers_pb2_grpc.add_PrefillWorkerServicer_to_server(api, server.server)
    server.add_service("baton.v1.PrefillWorker")
    server.start()  # NOT_SERVING until the model is loaded
    started = time.monotonic()
    metrics = Metrics("prefill")
    runner = load_runner(model)
    loaded = runner.loaded
    loop = PrefillLoop(runner, settings, tls, settings.block_size, metrics, cluster_token=token).start()
    metrics.gauge("baton_prefill_queue_depth", "Prompts waiting for prefill", lambda: len(loop.queue))
    metrics.gauge("baton_prefill_queued_tokens", "Prompt tokens waiting for prefill", lambda: loop.queue.queued_tokens)
    metrics.gauge("baton_prefill_prefix_cache_bytes", "Prefix KV cache bytes in use",
                  lambda: loop.core.cache.used_bytes if loop.core.cache else 0)
    metrics.serve(settings.metrics_port, settings.host)
    api.target = PrefillWorkerServicer(loop)
    server.set_serving()
    log.info("prefill worker serving on port %d (model %s loaded in %.1fs)", server.port, loaded.fingerprint,
             time.monotonic() - started)
    if not block:
        return server, loop
    server.wait_for_signal(on_stop=loop.stop, drain=lambda: loop.drain(DRAIN_SECONDS))
