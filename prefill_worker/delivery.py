"""Delivery of prefilled KV to decode workers, apart from the compute loop that makes it.

The loop hands each finished prompt to `KVDelivery.submit`; sender threads push it (shared
memory on one host, the transfer library or gRPC between hosts, with retries), highest priority
first, and settle the job's future with a `PrefillDone` or the push's error. A prompt prefilled
in chunks may instead stream its KV while it is computed (`open_stream`): each chunk's tokens go
as soon as they exist, so only the last chunk is left to send at the end. The delivery owns the
channels to decode workers and counts the KV bytes handed to it and not yet pushed, which the
loop holds under `prefill.kv_memory_bytes` (BatchLLM's memory threshold).
"""
from __future__ import annotations

import itertools
import logging
import queue
import threading
from collections import OrderedDict
from concurrent.futures import Future

import grpc

from baton.config import PrefillSettings, TLSSettings
from baton.messages import logprob_to_proto
from baton.metrics import Metrics
from baton.server import channel
from baton.v1 import workers_pb2

from baton.engine.kv import KVShape, SequenceKV, after, ready_event
from baton.engine.request import RequestError
from baton.kvtransfer.errors import KVPushFailed
from baton.kvtransfer.grpc_transport import PushRetry, push_kv_stream
from baton.kvtransfer.push import KVPusher
from baton.kvtransfer.sender import SpanSource
from baton.kvtransfer.wire import grpc_push_channel_options
from baton.prefill_worker.jobs import PrefillDone, PrefillJob

log = logging.getLogger(__name__)

# A KV push, retries included, never takes longer than this. It is only the backstop: a broken
# push is noticed within about a second (kvtransfer.wire), and a receiver waiting for staging
# room answers RESOURCE_EXHAUSTED after its own reserve timeout.
PUSH_TIMEOUT_SECONDS = 30.0
PUSH_RETRY = PushRetry(attempts=3, backoff_s=0.2)
# Channels kept open to decode workers; far more than a deployment has, but not unbounded as
# workers are replaced over days. The least recently used one is closed first.
MAX_PUSH_CHANNELS = 64
SENDER_THREADS = 4


class StreamedPush:
    """A chunked prompt's KV sent to its decode worker while the prompt is prefilled: each chunk's
    tokens go as soon as they are computed (layout TOKEN_SPANS), so the transfer overlaps the next
    chunks' compute. One attempt, on a thread of its own (it lasts as long as the prefill): should
    it break, the whole KV is pushed after the prefill the usual way, with its retries."""

    def __init__(self, delivery: "KVDelivery", job: PrefillJob, num_tokens: int) -> None:
        self.source = SpanSource(num_tokens)
        self.sent = job.kv_skip_tokens  # prompt tokens handed to the stream (or held by the decode worker)
        self.outcome: Future = Future()
        self._thread = threading.Thread(target=self._run, args=(delivery, job), daemon=True,
                                        name=f"kv-stream-{job.request.request_id}")
        self._thread.start()

    def _run(self, delivery: "KVDelivery", job: PrefillJob) -> None:
        try:
            push_kv_stream(delivery.channel(job.decode_target), job.request.request_id, delivery.fingerprint,
                           delivery.kv_shape, self.source, delivery.settings.kv_chunk_bytes,
                           PUSH_TIMEOUT_SECONDS + 3600.0, job.push_token)  # bounded by the prefill, then the push
            self.outcome.set_result(True)
        except Exception as exc:  # noqa: BLE001 -- the KV goes the usual way instead
            if isinstance(exc, KVPushFailed):
                delivery._unreachable(job.decode_target, exc)
            log.info("streamed KV push of request %s to %s broke off (%s); the whole KV is pushed after its prefill",
                     job.request.request_id, job.decode_target, exc)
            self.outcome.set_result(False)

    def put(self, kv, end: int, start: int = 0) -> None:
        """The prompt's KV of tokens [start, end) (`kv`): the tokens not yet sent go."""
        if end > self.sent and not self.outcome.done():
            # a copy of these tokens alone: a queued view would hold the whole KV so far alive
            self.source.put(SequenceKV(kv.data[:, :, :, self.sent - start:end - start].contiguous()))
            self.sent = end

    def finish(self, metadata: bytes, timeout_s: float) -> bool:
        """Close the stream with the metadata; whether the KV landed."""
        self.source.finish(metadata)
        try:
            return self.outcome.result(timeout_s)
        except TimeoutError:
            self.abort("the streamed push did not end in time")
            return False

    def abort(self, why: str) -> None:
        self.source.abort(why)


class PushSenders:
    """Threads that push prefilled KV, highest priority first: an interactive prompt's KV does not
    queue behind a batch's members' (the order is FIFO within one priority)."""

    def __init__(self, threads: int) -> None:
        self._queue: "queue.PriorityQueue[tuple]" = queue.PriorityQueue()
        self._order = itertools.count()
        self._threads = [threading.Thread(target=self._run, name=f"kv-push-{i}", daemon=True) for i in range(threads)]
        for thread in self._threads:
            thread.start()

    def submit(self, priority: int, fn, *args) -> None:
        self._queue.put((-priority, next(self._order), fn, args))

    def shutdown(self) -> None:
        """Drop the pushes not started; the threads end after the ones under way."""
        while True:
            try:
                self._queue.get_nowait()
            except queue.Empty:
                break
        for _ in self._threads:
            self._queue.put((float("inf"), next(self._order), None, ()))

    def _run(self) -> None:
        while True:
            _, _, fn, args = self._queue.get()
            if fn is None:
                return
            try:
                fn(*args)
            except Exception:  # noqa: BLE001 - a push reports its own failures; a sender must outlive one
                log.exception("a KV push failed unexpectedly")


class KVDelivery:
    """Pushes each prefilled prompt's KV to its decode worker and settles the prompt's job."""

    def __init__(self, fingerprint: str, kv_shape: KVShape, settings: PrefillSettings, metrics: Metrics,
                 tls: TLSSettings | None = None, cluster_token: str | None = None) -> None:
        self.fingerprint = fingerprint
        self.kv_shape = kv_shape
        self.settings = settings
        self.metrics = metrics
        self.tls = tls
        self.cluster_token = cluster_token
        self._pusher = KVPusher(cluster_token, shared_memory=settings.kv_transport != "grpc",
                                library="nixl" if settings.kv_transport == "nixl" else None)
        self._senders = PushSenders(SENDER_THREADS)
        self._channels: "OrderedDict[str, grpc.Channel]" = OrderedDict()  # most recently used last
        self._lock = threading.Lock()
        self._unpushed = 0  # bytes of prefilled KV handed over, not yet pushed (or given up)
        self._pushed = threading.Event()  # a push ended: memory under the threshold may be free again

    @property
    def unpushed_bytes(self) -> int:
        with self._lock:
            return self._unpushed

    def wait_for_a_push(self, timeout: float) -> None:
        """Until a push ends (memory may be free again), at most `timeout` seconds."""
        self._pushed.wait(timeout)
        self._pushed.clear()

    def open_stream(self, job: PrefillJob, num_tokens: int) -> StreamedPush | None:
        """Stream `job`'s KV while it prefills, where that pays: not through shared memory on one host,
        whose single copy at the end is cheaper than a stream of small ones."""
        if self.settings.kv_stream and not self._pusher.uses_shared_memory(job.decode_target):
            job.stream = StreamedPush(self, job, num_tokens)
        return job.stream

    def submit(self, job: PrefillJob, prefilled) -> None:
        """Push `prefilled` (its first token and KV) for `job` on a sender thread; `job.done` settles."""
        job.sent = True
        with self._lock:  # its own KV: a group's shared prefix is one tensor for all its members
            self._unpushed += prefilled.kv.nbytes
        ready = ready_event(prefilled.kv.data)  # here, on the compute thread, where the KV was made
        self._senders.submit(job.request.params.priority, self._push_counted, job, prefilled, ready)

    def close(self) -> None:
        """Pushes not started are dropped (their Prefill calls end with the process); those under way end."""
        self._senders.shutdown()

    def channel(self, target: str) -> grpc.Channel:
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

    def _unreachable(self, target: str, failure: KVPushFailed) -> None:
        """A push to `target` could not reach it: the next one (a retry, or a push after the decode
        worker restarted at its address) opens a new channel and connects at once, where this one
        would fail every call until its reconnect backoff ends. Calls still open on the old channel
        keep it until they end."""
        if failure.code == "UNAVAILABLE":
            with self._lock:
                self._channels.pop(target, None)

    def _push_counted(self, job: PrefillJob, prefilled, ready=None) -> None:
        try:
            with after(ready, prefilled.kv.data.device):  # not behind the compute thread's next forward
                self._push(job, prefilled)
        finally:
            with self._lock:
                self._unpushed -= prefilled.kv.nbytes
            self._pushed.set()

    def _push(self, job: PrefillJob, prefilled) -> None:
        trace = job.request.trace
        meta = workers_pb2.KVMetadata(
            first_token=prefilled.first_token, seed=prefilled.seed, cached_tokens=prefilled.cached_tokens,
            queue_seconds=trace.marks["prefill_start"] - trace.marks["arrived"],
            prefill_seconds=trace.marks["prefill_end"] - trace.marks["prefill_start"],
        )
        if prefilled.first_logprob is not None:
            meta.first_logprob.CopyFrom(logprob_to_proto(prefilled.first_logprob))
        done = PrefillDone(
            first_token=prefilled.first_token, seed=prefilled.seed, cached_tokens=prefilled.cached_tokens,
            computed_tokens=len(job.request.prompt_token_ids) - prefilled.cached_tokens,
            queue_seconds=meta.queue_seconds, prefill_seconds=meta.prefill_seconds,
            pulled_tokens=min(job.pulled_tokens, prefilled.cached_tokens),
        )
        self._count_prompt(meta, len(job.request.prompt_token_ids), prefilled.cached_tokens)

        def retrying(attempt: int, failure: KVPushFailed) -> None:
            self._unreachable(job.decode_target, failure)
            self.metrics.transfers.labels("retried").inc()
            log.warning("KV push of request %s to %s failed (attempt %d): %s; retrying", job.request.request_id,
                        job.decode_target, attempt, failure)

        try:
            if job.cancelled:
                job.end_stream("cancelled")
                raise RequestError("cancelled")
            # The decode worker may hold the first tokens (kv_skip_tokens): only the rest travels.
            metadata = meta.SerializeToString()
            nbytes = (len(job.request.prompt_token_ids) - job.kv_skip_tokens) * prefilled.kv.shape.bytes_per_token()
            if job.stream is not None and job.stream.finish(metadata, PUSH_TIMEOUT_SECONDS):
                transport = "grpc_stream"
            else:  # joined only for a whole push: a streamed one sent its spans as they came
                transport = self._pusher.push(
                    job.decode_target, lambda: self.channel(job.decode_target), job.request.request_id,
                    self.fingerprint, prefilled.whole_kv(job.kv_skip_tokens), metadata,
                    chunk_bytes=self.settings.kv_chunk_bytes, timeout_s=PUSH_TIMEOUT_SECONDS, retry=PUSH_RETRY,
                    should_stop=lambda: job.cancelled, on_retry=retrying, push_token=job.push_token)
            trace.mark("staged")  # the decode worker holds the KV now
            done.transfer_seconds = trace.durations()["transfer"]
            self.metrics.transfers.labels("ok").inc()
            self.metrics.transfer_transports.labels(transport).inc()
            self.metrics.transfer_bytes.inc(nbytes)
            self.metrics.prefix_actual.inc(prefilled.cached_tokens)
            job.done.set_result(done)
        except Exception as exc:
            if isinstance(exc, KVPushFailed):
                self._unreachable(job.decode_target, exc)
            self.metrics.transfers.labels("cancelled" if job.cancelled else "failed").inc()
            # Its traceback's frames hold the KV; the Prefill call re-raises it and aborts, and
            # gRPC keeps an aborted call's traceback: hand over the error alone.
            exc.__traceback__ = exc.__context__ = exc.__cause__ = None
            job.done.set_exception(exc)

    def _count_prompt(self, meta, prompt_tokens: int, cached_tokens: int) -> None:
        """vLLM's per-request metrics, as it names them, for a prompt prefilled here."""
        self.metrics.vllm_queue.observe(meta.queue_seconds)
        self.metrics.vllm_prefill.observe(meta.prefill_seconds)
        self.metrics.vllm_prompt_tokens.inc(prompt_tokens)
        self.metrics.vllm_prefix_queries.inc(prompt_tokens)
        self.metrics.vllm_prefix_hits.inc(cached_tokens)
