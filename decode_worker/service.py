"""The decode worker process: DecodeWorker and KVTransfer services over one DecodeLoop.

On SIGTERM it drains: no new requests; running ones get `drain_move_after_s` to finish, then
each leaves the batch with its KV, which the router has this worker push (Handoff) straight to
another decode worker, so nothing is prefilled again unless that fails."""
from __future__ import annotations

import logging
import queue
import threading
import time

import grpc

from baton import tracing
from baton.config import ClusterSettings, DecodeSettings, ModelSettings, TLSSettings
from baton.messages import logprob_to_proto, sampling_from_proto, settings_to_proto
from baton.logs import STARTUP_LOGGER
from baton.metrics import Metrics
from baton.resources import Amount, memory_available
from baton.sizing import GPU_ROWS, staging_bytes
from baton.server import GrpcServer, NotReady, channel, cluster_token, run_when_ended
from baton.transport import check_address
from baton.v1 import common_pb2, kvtransfer_pb2_grpc, workers_pb2, workers_pb2_grpc
from baton.block_hash import BlockHasher
from baton.decode_worker.core import DecodeConfig, DecodeCore
from baton.decode_worker.kv_events import HeldBlocks
from baton.decode_worker.kv_pages import RETAINED
from baton.decode_worker.loop import DecodeLoop, Failure, Moving, NotMoving
from baton.decode_worker.scheduler import TAIL
from baton.prefill_worker.cache_events import CacheEventLog
from baton.prefill_worker.service import MAX_CACHE_WATCHERS, watch_cache

from baton.engine.request import GenerationRequest, RequestError, validate_prompt
from baton.engine import threads
from baton.engine.executors import load_runner
from baton.kvtransfer.errors import KVPushFailed
from baton.kvtransfer.grpc_transport import KVTransferServicer, PushRetry
from baton.kvtransfer.push import KVPusher
from baton.kvtransfer.receiver import Receiver, ReceiverConfig
from baton.kvtransfer.sender import encode
from baton.kvtransfer.staging import StagingConfig, StagingPool
from baton.kvtransfer.nixl import NixlWrites
from baton.kvtransfer.shm import ShmKVServer
from baton.kvtransfer.wire import grpc_push_channel_options, grpc_server_ping_options

log = logging.getLogger(__name__)
started_log = logging.getLogger(STARTUP_LOGGER)

HANDOFF_SECONDS = 30.0  # longest a Handoff's KV push may take
READ_WAIT_S = 10.0  # longest a ReadKV waits for the decode loop to copy the KV out (between two steps)
RESERVED_PREFIXES = (RETAINED, TAIL)  # keys of the worker's own page tables and host pool holds
# How a target's refusal of a handed-off KV reads to the Handoff caller.
_HANDOFF_STATUS = {"RESOURCE_EXHAUSTED": grpc.StatusCode.RESOURCE_EXHAUSTED,
                   "FAILED_PRECONDITION": grpc.StatusCode.FAILED_PRECONDITION,  # not expecting it
                   "INVALID_ARGUMENT": grpc.StatusCode.FAILED_PRECONDITION,  # another model or shape
                   "ALREADY_EXISTS": grpc.StatusCode.FAILED_PRECONDITION}


class DecodeWorkerServicer(workers_pb2_grpc.DecodeWorkerServicer):
    def __init__(self, loop: DecodeLoop, address: str, tls: TLSSettings | None = None,
                 cluster_token: str | None = None, shared_memory: bool = True, library: str | None = None,
                 chosen: dict[str, Amount] | None = None, events: CacheEventLog | None = None):
        self.loop = loop
        self.events = events or CacheEventLog()  # the blocks of KV held here, for routers to follow
        self._watchers = threading.BoundedSemaphore(MAX_CACHE_WATCHERS)
        self.settings = settings_to_proto(chosen or {})  # the sizes chosen at start, for load reports
        self.address = address
        self.tls = tls
        self.cluster_token = cluster_token
        self.pusher = KVPusher(cluster_token, shared_memory, library)

    def Decode(self, request, context):
        loaded = self.loop.core.runner.loaded
        try:
            if not request.request_id:
                raise RequestError("request_id is required")
            if request.request_id.startswith(RESERVED_PREFIXES):
                raise RequestError(f"request ids beginning with {' or '.join(RESERVED_PREFIXES)} are this worker's own")
            params = sampling_from_proto(request.sampling)
            prompt = list(request.prompt_token_ids)
            validate_prompt(prompt, params, max_context=loaded.max_context, vocab_size=loaded.config.vocab_size)
            gen = GenerationRequest(request.request_id, prompt, params, resume_step=request.resume_step)
            gen.trace.mark("arrived")
            outputs = self.loop.register(gen, request.push_token, local=request.prefill_here)
        except (RequestError, ValueError) as exc:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        except OverflowError as exc:
            context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, str(exc))
        except ConnectionAbortedError as exc:
            context.abort(grpc.StatusCode.UNAVAILABLE, str(exc))
        request_id = request.request_id
        if not run_when_ended(context, lambda: self.loop.cancel(request_id, outputs)):
            return  # the call ended (cancelled, its connection cut) before it was registered
        # Registered: the router may start the prefill now, pushing only the KV not held here.
        yield workers_pb2.DecodeResponse(held_prefix_tokens=self.loop.core.held_tokens(request_id))
        sent = 0
        while True:
            try:
                item = outputs.get(timeout=0.5)
            except queue.Empty:
                if not context.is_active():
                    return
                continue
            if self.loop.is_closed(item):
                return
            if isinstance(item, Failure):
                context.abort(grpc.StatusCode.INVALID_ARGUMENT, item.message)
            if isinstance(item, Moving):  # draining: the stream stays open until Handoff is done
                yield workers_pb2.DecodeResponse(moving=True, seed=item.seed)
                continue
            msg = workers_pb2.DecodeResponse(token_ids=item.token_ids[sent:], text_delta=item.text_delta,
                                             logprobs=[logprob_to_proto(lp) for lp in item.logprobs[sent:]])
            sent = len(item.token_ids)
            if item.finished:
                msg.finish_reason = item.finish_reason
                durations = item.trace.durations()
                msg.stage_seconds.update(durations)
                if request.prefill_here:
                    msg.cached_tokens = item.trace.cached_tokens
                    msg.prefill_seconds = durations.get("prefill", 0.0)
                tracing.record_stages(context.invocation_metadata(), item.trace, request_id=request_id,
                                      completion_tokens=len(item.token_ids), finish_reason=item.finish_reason)
            yield msg
            if item.finished:
                return

    def WatchCache(self, request, context):
        yield from watch_cache(self.events, self._watchers, request, context)

    def Handoff(self, request, context):
        request_id, target, target_id = request.request_id, request.target, request.target_request_id
        if not (request_id and target and target_id):
            context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                          "request_id, target (host:port of another decode worker) and target_request_id are required")
        try:
            check_address(target, "target")
        except ValueError as exc:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        if target == self.address:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"target {target} is this decode worker; name another one")
        try:
            outputs, evicted = self.loop.take_moving(request_id)
        except LookupError as exc:
            context.abort(grpc.StatusCode.NOT_FOUND, str(exc))
        except NotMoving as exc:
            context.abort(grpc.StatusCode.FAILED_PRECONDITION, str(exc))
        meta = workers_pb2.KVMetadata(first_token=evicted.token_ids[-1], seed=evicted.seed, handoff=True)
        if evicted.last_logprob is not None:
            meta.first_logprob.CopyFrom(logprob_to_proto(evicted.last_logprob))
        remaining = context.time_remaining()
        started = time.monotonic()
        failure = None
        kv_tokens, kv_bytes = evicted.kv.num_tokens, evicted.kv.nbytes
        try:  # the KV is freed whatever happens: a failed handoff falls back to a new prefill
            # The prefill push's liveness settings and retries: a dead target is known within seconds.
            with channel(target, self.tls, extra_options=grpc_push_channel_options(),
                         cluster_token=self.cluster_token) as ch:
                self.pusher.push(target, lambda: ch, target_id, str(self.loop.core.runner.loaded.fingerprint),
                                 evicted.kv, meta.SerializeToString(),
                                 timeout_s=min(HANDOFF_SECONDS, remaining or HANDOFF_SECONDS),
                                 retry=PushRetry(attempts=2, backoff_s=0.2), push_token=request.push_token)
        except KVPushFailed as exc:
            failure = (exc.code, str(exc))  # not the exception: its traceback's frames hold the KV
        finally:
            self.loop.end_moving(request_id, outputs, ok=failure is None)
            # gRPC keeps an aborted call's traceback, and with it this frame: drop the KV first.
            del evicted
        if failure is not None:
            log.warning("handing request %s to %s failed: %s", request_id, target, failure[1])
            code = _HANDOFF_STATUS.get(failure[0], grpc.StatusCode.UNAVAILABLE)
            context.abort(code, f"the KV of request {request_id} could not be handed to {target}: {failure[1]}")
        return workers_pb2.HandoffReply(kv_tokens=kv_tokens, kv_bytes=kv_bytes, seconds=time.monotonic() - started)

    def ReadKV(self, request, context):
        if not (request.request_id and request.push_token and request.num_tokens):
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, "request_id, push_token and num_tokens > 0 are required")
        remaining = context.time_remaining()
        try:
            reply = self.loop.read_held(request.request_id, request.push_token, request.num_tokens)
            kv = reply.result(timeout=min(READ_WAIT_S, remaining or READ_WAIT_S))
        except PermissionError as exc:
            context.abort(grpc.StatusCode.PERMISSION_DENIED, str(exc))
        except LookupError as exc:
            context.abort(grpc.StatusCode.NOT_FOUND, str(exc))
        except ValueError as exc:
            context.abort(grpc.StatusCode.FAILED_PRECONDITION, str(exc))
        except ConnectionAbortedError as exc:
            context.abort(grpc.StatusCode.UNAVAILABLE, str(exc))
        except TimeoutError:
            reply.cancel()  # still in the inbox: the loop skips it
            context.abort(grpc.StatusCode.UNAVAILABLE, f"the decode loop did not reach the read within {READ_WAIT_S}s")
        yield from encode(request.request_id, str(self.loop.core.runner.loaded.fingerprint), kv)

    def GetLoad(self, request, context):
        core, pool = self.loop.core, self.loop.pool
        stats, kv = pool.stats(), core.scheduler.kv_usage()
        return common_pb2.DecodeLoad(
            rows_in_use=core.scheduler.num_running, max_rows=core.config.max_rows,
            kv_bytes_allocated=kv.used * core.kv.page_bytes, kv_bytes_useful=kv.tokens * core.kv.shape.bytes_per_token(),
            staged_bytes=stats.needed_bytes, staging_capacity_bytes=stats.capacity_bytes,
            waiting_for_kv=self.loop.num_waiting(), staged=core.scheduler.num_staged,
            prompt_tokens_forwarded=core.runner.prompt_tokens_forwarded,
            decode_tokens_forwarded=core.runner.decode_tokens_forwarded,
            requests_finished=core.finished_total, model_fingerprint=str(core.runner.loaded.fingerprint),
            draining=self.loop.draining.is_set(), preemptions=core.scheduler.parked_total,
            parked_bytes=core.parked_bytes(), migrations_out=self.loop.migrations["sent"],
            migrations_failed=self.loop.migrations["failed"], migrations_in=self.loop.migrations["received"],
            max_context=core.max_context, kv_budget_bytes=core.kv_budget_bytes,
            kv_bytes_per_token=core.kv.shape.bytes_per_token(), settings=self.settings,
        )


def serve(model: ModelSettings, settings: DecodeSettings, tls: TLSSettings | None = None, *,
          cluster: ClusterSettings | None = None, block: bool = True):
    token = cluster_token(cluster, "decode", settings.host)
    server = GrpcServer(settings.host, settings.port, tls=tls,
                        long_calls=settings.max_pending + (settings.max_rows or GPU_ROWS), cluster_token=token,
                        options=grpc_server_ping_options())
    decode_api, kv_api = NotReady(), NotReady()
    workers_pb2_grpc.add_DecodeWorkerServicer_to_server(decode_api, server.server)
    kvtransfer_pb2_grpc.add_KVTransferServicer_to_server(kv_api, server.server)
    server.add_service("baton.v1.DecodeWorker")
    server.add_service("baton.v1.KVTransfer")
    server.start()  # health answers NOT_SERVING while the model loads
    started = time.monotonic()
    runner = load_runner(model)
    loaded = runner.loaded
    events = CacheEventLog()
    core = DecodeCore(runner, DecodeConfig(max_rows=settings.max_rows, kv_budget_bytes=settings.kv_budget_bytes,
                                           page_size=settings.page_size,
                                           growth_reserve_tokens=settings.growth_reserve_tokens,
                                           high_watermark_bytes=settings.kv_high_watermark_bytes,
                                           low_watermark_bytes=settings.kv_low_watermark_bytes,
                                           max_waiting=settings.max_pending,
                                           share_min_tokens=settings.share_min_tokens, retain=settings.retain_kv,
                                           local_chunk_tokens=settings.local_prefill_chunk_tokens),
                      listener=HeldBlocks(BlockHasher(str(loaded.fingerprint), settings.block_size), events))
    staging = staging_bytes(settings.staging_bytes, memory_available(), loaded.kv_shape.bytes_per_token(),
                            core.max_row_tokens)
    if not settings.staging_bytes:
        started_log.info("host KV pool %d bytes (%s)", staging.value, staging.source,
                         extra={"setting": "staging_bytes", "value": staging.value, "chosen_by": staging.source})
    pool = StagingPool(StagingConfig(capacity_bytes=staging.value, require_expected=True,
                                     max_entries=settings.max_pending + core.config.max_rows),
                       on_landed=lambda request_id: loop.on_landed(request_id))
    metrics = Metrics("decode", model.name)
    loop = DecodeLoop(core, pool, metrics).start()
    chosen = {**core.chosen, "staging_bytes": staging, "threads": threads.chosen(),
              "tensor_parallel_size": Amount(getattr(runner, "tensor_parallel_size", 1), "model.tensor_parallel_size")}
    metrics.settings(chosen)
    kv_usage, page_bytes, token_bytes = core.scheduler.kv_usage, core.kv.page_bytes, core.kv.shape.bytes_per_token()
    metrics.gauge("baton_decode_rows_in_use", "Decode batch rows occupied", lambda: core.scheduler.num_running)
    metrics.gauge("baton_decode_kv_pages_total", "KV pages rows can hold (decode.kv_budget_bytes / page bytes)",
                  lambda: kv_usage().total)
    metrics.gauge("baton_decode_kv_pages_used", "KV pages held by a row or a waiting request", lambda: kv_usage().used)
    metrics.gauge("baton_decode_kv_pages_shared", "KV pages of prompt prefixes held by more than one request",
                  lambda: kv_usage().shared)
    metrics.counter("baton_decode_rows_sharing", "Rows admitted onto prompt pages another request holds",
                    lambda: core.scheduler.rows_sharing_total)
    metrics.gauge("baton_decode_kv_pages_retained", "KV pages only finished requests' retained KV holds (free for "
                  "the taking)", lambda: kv_usage().retained)
    metrics.counter("baton_decode_retained", "Finished requests whose KV pages stayed for a next turn",
                    lambda: core.scheduler.retained_total)
    metrics.counter("baton_decode_retained_reclaimed", "Retained KV released because pages were needed",
                    lambda: core.scheduler.reclaimed_total)
    metrics.counter("baton_decode_held_pages_given_up", "Landed requests whose held prompt pages went (their KV to "
                    "the host) so the request ahead of them could start", lambda: core.scheduler.unheld_total)
    metrics.counter("baton_decode_kv_reads", "Prompts whose held KV a prefill worker read instead of computing it "
                    "(ReadKV)", lambda: loop.reads_total)
    metrics.counter("baton_decode_kv_read_tokens", "Prompt tokens of KV read by prefill workers",
                    lambda: loop.read_tokens_total)
    metrics.counter("baton_decode_local_prefills", "Prompts prefilled here on top of KV held here (conditional "
                    "disaggregation)", lambda: core.local_prefills_total)
    metrics.counter("baton_decode_local_prefill_tokens", "Prompt tokens prefilled here", lambda: core.local_tokens_total)
    metrics.counter("baton_decode_local_cached_tokens", "Prompt tokens of local prefills whose KV was held here",
                    lambda: core.local_cached_tokens_total)
    metrics.gauge("baton_decode_kv_allocated_bytes", "KV bytes of the pages in use", lambda: kv_usage().used * page_bytes)
    metrics.gauge("baton_decode_kv_useful_bytes", "KV bytes holding real tokens (a shared page once)",
                  lambda: kv_usage().tokens * token_bytes)
    metrics.gauge("baton_decode_kv_allocated_over_useful", "Page slots in use per token they hold (1 = no waste)",
                  lambda: kv_usage().allocated_over_useful)
    metrics.gauge("baton_decode_staged_bytes", "Host KV pool bytes in use: staged KV and parked rows, within "
                  "decode.staging_bytes", lambda: pool.stats().needed_bytes)
    metrics.gauge("baton_decode_retained_host_bytes", "Host KV pool bytes lent to retained KV whose pages were "
                  "needed (taken back whenever anything else needs them)", lambda: pool.stats().yielding_bytes)
    metrics.gauge("baton_decode_waiting_for_kv", "Requests whose KV has not landed", loop.num_waiting)
    metrics.gauge("baton_decode_queue_depth", "Landed requests waiting for a row", lambda: core.scheduler.num_staged)
    metrics.counter("baton_decode_preemptions", "Rows that left their pages (for priority or memory)",
                    lambda: core.scheduler.parked_total)
    metrics.counter("baton_decode_parked_for_memory", "Rows that left their pages because pages ran out (or past "
                    "the high watermark)", lambda: core.scheduler.parked_for_memory_total)
    metrics.counter("baton_decode_resumes", "Parked rows back in a row", lambda: core.scheduler.resumed_total)
    metrics.counter("baton_decode_recomputes", "Rows whose KV was computed again: dropped when the host pool was "
                    "full", lambda: core.recomputed_total)
    # vLLM's names for the same state (what an endpoint picker or autoscaler reads).
    metrics.gauge("vllm:num_requests_running", "Requests holding a decode row", lambda: core.scheduler.num_running)
    metrics.gauge("vllm:num_requests_waiting", "Requests waiting for their KV or for a row",
                  lambda: loop.num_waiting() + core.scheduler.num_staged)
    metrics.gauge("vllm:kv_cache_usage_perc", "Share of the KV pages in use (1 = full)",
                  lambda: kv_usage().used / kv_usage().total)
    metrics.counter("vllm:num_preemptions", "Rows parked on the host", lambda: core.scheduler.parked_total)
    metrics.gauge("baton_decode_parked_bytes", "KV of parked rows held in host memory (part of the host pool)",
                  core.parked_bytes)
    metrics.counter("baton_decode_park_refused", "Rows not parked with their KV because the host KV pool was full",
                    lambda: core.scheduler.park_refused_total)
    metrics.serve(settings.metrics_port, settings.host)
    receiver = Receiver(pool, ReceiverConfig(str(loaded.fingerprint), loaded.kv_shape, max_tokens=core.max_row_tokens,
                                             pin_memory=loaded.device.type == "cuda"))
    decode_api.target = DecodeWorkerServicer(loop, settings.advertise or f"{settings.host}:{server.port}", tls, token,
                                             shared_memory=settings.kv_transport != "grpc",
                                             library="nixl" if settings.kv_transport == "nixl" else None,
                                             chosen=chosen, events=events)
    # The agent starts on the first write, or now where this worker is told to use the library.
    writes = NixlWrites(receiver) if settings.kv_transport != "grpc" else None
    kv_api.target = KVTransferServicer(receiver, writes=writes)
    if writes is not None:
        server.extra_stops.append(writes.stop)
        if settings.kv_transport == "nixl":
            writes.start()
    if settings.kv_transport != "grpc":  # prefill workers on this host push through shared memory
        try:
            server.extra_stops.append(ShmKVServer(receiver, server.port, token).start().stop)
        except OSError as exc:
            log.warning("shared-memory KV pushes are off (%s); KV arrives over gRPC only", exc)
    server.set_serving()
    started_log.info("decode worker serving on port %d, %.1fs after start (model %s)", server.port,
                     time.monotonic() - started, loaded.fingerprint)
    if not block:
        return server, loop
    server.wait_for_signal(on_stop=loop.stop,
                           drain=lambda: loop.drain(settings.drain_timeout_s, move_after=settings.drain_move_after_s),
                           drain_timeout_s=settings.drain_timeout_s)
