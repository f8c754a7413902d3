"""One request's trip through the cluster, as the router drives it.

Route (prefix index + load) -> open DecodeWorker.Decode (the worker now expects the KV) ->
PrefillWorker.Prefill naming that decode worker (the KV is pushed there) -> relay tokens. A
failed prefill cancels the decode stream at once; a cancelled or expired request cancels both.
"""
from __future__ import annotations

import dataclasses
import threading
import time
from dataclasses import dataclass

import grpc

from baton.block_hash import BlockHasher
from baton.v1 import common_pb2, router_pb2, workers_pb2
from router.policy import NoWorkers, Picker
from router.prefix_index import PrefixIndex
from router.workers import Worker, WorkerPool


class DispatchError(Exception):
    def __init__(self, code: grpc.StatusCode, message: str):
        super().__init__(message)
        self.code = code
        self.message = message


@dataclass
class RoutingStats:
    """How well the prefix index predicted what prefill workers really reused."""

    requests: int = 0
    predicted_tokens: int = 0
    actual_tokens: int = 0
    overlap_tokens: int = 0  # sum of min(predicted, actual)
    union_tokens: int = 0  # sum of max(predicted, actual)

    def record(self, predicted: int, actual: int) -> None:
        self.requests += 1
        self.predicted_tokens += predicted
        self.actual_tokens += actual
        self.overlap_tokens += min(predicted, actual)
        self.union_tokens += max(predicted, actual)

    @property
    def accuracy(self) -> float:
        """1.0 when every prediction was exact; requests with nothing cached on either side count as exact."""
        return self.overlap_tokens / self.union_tokens if self.union_tokens else 1.0


@dataclass
class Route:
    prefill: Worker
    decode: Worker
    predicted_cached_tokens: int


class Dispatcher:
    def __init__(self, pool: WorkerPool, index: PrefixIndex, block_size: int, picker: Picker | None = None):
        self.pool = pool
        self.index = index
        self.block_size = block_size
        self.picker = picker or Picker()
        self.stats = RoutingStats()
        self._stats_lock = threading.Lock()
        self._hashers: dict[str, BlockHasher] = {}

    def block_hashes(self, prompt: list[int]) -> list[int]:
        fingerprint = next((w.fingerprint for w in self.pool.all() if w.fingerprint), "")
        if fingerprint not in self._hashers:
            self._hashers[fingerprint] = BlockHasher(fingerprint, self.block_size)
        return self._hashers[fingerprint].hash_prompt(prompt)

    def usable_tokens(self, blocks: int, prompt_len: int) -> int:
        # The prefill worker always computes the prompt's last token (it needs its logits).
        return min(blocks, (prompt_len - 1) // self.block_size) * self.block_size

    def route(self, prompt: list[int], prefill_address: str | None = None) -> Route:
        matches = self.index.match(self.block_hashes(prompt))
        views = [dataclasses.replace(v, predicted_cached_tokens=self.usable_tokens(matches.get(v.address, 0), len(prompt)))
                 for v in self.pool.views("prefill")]
        try:
            decode_view = self.picker.pick_decode(self.pool.views("decode"))
            if prefill_address is not None:
                prefill_view = next(v for v in views if v.address == prefill_address)
            else:
                prefill_view = self.picker.pick_prefill(views, len(prompt))
        except (NoWorkers, StopIteration) as exc:
            raise DispatchError(grpc.StatusCode.UNAVAILABLE, str(exc) or "the pinned prefill worker left") from None
        prefill = self.pool.get("prefill", prefill_view.address)
        decode = self.pool.get("decode", decode_view.address)
        if prefill is None or decode is None:
            raise DispatchError(grpc.StatusCode.UNAVAILABLE, "a chosen worker just left; retry")
        return Route(prefill, decode, prefill_view.predicted_cached_tokens)

    def apply_events(self, worker: Worker, stored, evicted) -> None:
        if stored or evicted:
            self.index.apply_event(worker.view.address, stored=list(stored), evicted=list(evicted))

    def run(self, request_id: str, prompt: list[int], sampling, timeout: float | None, on_done,
            prefill_address: str | None = None, pinned_tokens: int = 0):
        """Yield GenerateResponses; `on_done(cancel)` lets the caller register cancellation.
        `prefill_address` forces the prefill worker (a batch group's pin holds `pinned_tokens` there)."""
        arrived = time.monotonic()
        route = self.route(prompt, prefill_address)
        if pinned_tokens and len(prompt) - 1 >= pinned_tokens:
            route.predicted_cached_tokens = max(route.predicted_cached_tokens, pinned_tokens)
        decode, prefill = route.decode, route.prefill
        self.pool.acquire(decode)
        self.pool.acquire(prefill)
        decode_call = prefill_call = None
        try:
            decode_call = decode.stub.Decode(
                workers_pb2.DecodeRequest(request_id=request_id, prompt_token_ids=prompt, sampling=sampling),
                timeout=timeout)
            next(decode_call)  # registered: its KV will be accepted
            prefill_call = prefill.stub.Prefill.future(
                workers_pb2.PrefillRequest(request_id=request_id, prompt_token_ids=prompt, sampling=sampling,
                                           decode_target=decode.view.address, model_fingerprint=decode.fingerprint),
                timeout=timeout)
            # A failed prefill means the KV never comes: stop waiting for it at once.
            prefill_call.add_done_callback(
                lambda f: not f.cancelled() and f.exception() is not None and decode_call.cancel())
            on_done(lambda: (decode_call.cancel(), prefill_call.cancel()))
            yield router_pb2.GenerateResponse(request_id=request_id, prompt_token_ids=prompt)
            completion = 0
            for msg in decode_call:
                completion += len(msg.token_ids)
                out = router_pb2.GenerateResponse(request_id=request_id, token_ids=msg.token_ids,
                                                  text_delta=msg.text_delta, finish_reason=msg.finish_reason)
                if msg.finish_reason:
                    self._finish(out, msg, prefill_call.result(timeout=10), route, len(prompt), completion, arrived)
                yield out
        except grpc.RpcError as err:
            raise self._cause(err, prefill_call) from None
        finally:
            if decode_call is not None:
                decode_call.cancel()
            if prefill_call is not None and not prefill_call.done():
                prefill_call.cancel()
            self.pool.release(decode)
            self.pool.release(prefill)

    def _finish(self, out, msg, reply, route: Route, prompt_len: int, completion: int, arrived: float) -> None:
        self.apply_events(route.prefill, reply.stored_blocks, reply.evicted_blocks)
        with self._stats_lock:
            self.stats.record(route.predicted_cached_tokens, reply.cached_tokens)
        stages = dict(msg.stage_seconds)
        stages.update(queue=reply.queue_seconds, prefill=reply.prefill_seconds, transfer=reply.transfer_seconds,
                      total=time.monotonic() - arrived)
        out.usage.CopyFrom(common_pb2.Usage(prompt_tokens=prompt_len, completion_tokens=completion,
                                            cached_tokens=reply.cached_tokens))
        out.trace.CopyFrom(common_pb2.Trace(
            stage_seconds=stages, cached_tokens=reply.cached_tokens,
            predicted_cached_tokens=route.predicted_cached_tokens,
            prefill_worker=route.prefill.view.address, decode_worker=route.decode.view.address))

    @staticmethod
    def _cause(err: grpc.RpcError, prefill_call) -> DispatchError:
        """The first real cause: a failed prefill explains a cancelled decode stream."""
        if prefill_call is not None and prefill_call.done() and not prefill_call.cancelled():
            failure = prefill_call.exception()
            if failure is not None:
                err = failure
        code = err.code() if hasattr(err, "code") else grpc.StatusCode.INTERNAL
        details = err.details() if hasattr(err, "details") else str(err)
        return DispatchError(code, details or code.name)
