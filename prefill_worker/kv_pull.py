"""Reading the KV a decode worker holds of a prompt instead of computing it.

A conversation's next turn repeats the earlier turns, whose answers were decoded on a decode
worker: their KV is there (kept after those requests finished), not in this worker's prefix
cache. When the router sends such a turn here (its new message is long, or that decode worker is
busy), the decode worker registered it holding that prefix (`PrefillRequest.kv_skip_tokens`), so
this worker can read the prefix from it (`DecodeWorker.ReadKV`) and compute only the new message.
The pulled KV joins the prefix cache (`PrefillCore.adopt`) before the prompt is planned, and the
push back sends only the tokens after the held prefix, as always.

Reading costs a transfer, computing costs a prefill: `PullRates` compares the two as measured
here (seconds per token of each, moving means); until both are measured, reads go ahead. A read
that fails for any reason is logged and the tokens are computed: the answer is the same.
"""
from __future__ import annotations

import logging
import threading
import time

import grpc

from baton.sizing import moving_mean
from baton.v1 import workers_pb2, workers_pb2_grpc

from baton.engine.kv import KVShape, SequenceKV
from baton.kvtransfer.errors import KVTransferError
from baton.kvtransfer.receiver import Receiver, ReceiverConfig
from baton.kvtransfer.staging import StagingConfig, StagingPool

log = logging.getLogger(__name__)

PULL_TIMEOUT_S = 10.0  # a read never takes longer (a healthy one takes a decode step plus the transfer)
MAX_PULLS = 64  # reads in flight or pulled and not yet adopted, at once


class PullRates:
    """Seconds per prompt token of a prefill here and of a read from a decode worker, measured."""

    def __init__(self) -> None:
        self.compute_token_s: float | None = None
        self.pull_token_s: float | None = None
        self._lock = threading.Lock()

    def computed(self, tokens: int, seconds: float) -> None:
        if tokens > 0 and seconds > 0:
            with self._lock:
                self.compute_token_s = moving_mean(self.compute_token_s, seconds / tokens)

    def pulled(self, tokens: int, seconds: float) -> None:
        if tokens > 0 and seconds > 0:
            with self._lock:
                self.pull_token_s = moving_mean(self.pull_token_s, seconds / tokens)

    def worth_pulling(self, tokens: int, min_tokens: int) -> bool:
        """Read `tokens` rather than compute them: at least `min_tokens` (a cache block: fewer
        would not be cached), and reading measured faster (or not measured yet)."""
        if tokens < min_tokens:
            return False
        with self._lock:
            if self.compute_token_s is None or self.pull_token_s is None:
                return True
            return self.pull_token_s < self.compute_token_s


class KVPuller:
    """Reads a prompt's held KV from its decode worker into host memory bounded by `capacity_bytes`
    (the prefix cache's budget: a read that would not fit in the cache is not worth making)."""

    def __init__(self, fingerprint: str, shape: KVShape, capacity_bytes: int, channel) -> None:
        self.channel = channel  # target -> grpc.Channel (the delivery's, shared with the pushes)
        self.rates = PullRates()
        self.pool = StagingPool(StagingConfig(capacity_bytes=max(capacity_bytes, 1), max_entries=MAX_PULLS,
                                              landed_ttl_s=None))
        # No wait for room (a full pool means reads are already under way: compute instead), and the
        # decode worker copies the KV out of its pages before it sends a byte, so no rate floor either.
        self.receiver = Receiver(self.pool, ReceiverConfig(fingerprint, shape, reserve_timeout_s=0.0,
                                                           min_bytes_per_s=0.0))
        self.pulls_total = 0
        self.pulled_tokens_total = 0
        self.failures_total = 0

    def pull(self, target: str, request_id: str, push_token: str, num_tokens: int,
             timeout_s: float | None) -> SequenceKV | None:
        """The KV of the prompt's first `num_tokens` tokens, read from decode worker `target`; None
        when the read failed (logged: the tokens are computed instead). `release(request_id)` once
        the KV is adopted or no longer needed."""
        timeout = min(PULL_TIMEOUT_S, timeout_s) if timeout_s is not None else PULL_TIMEOUT_S
        started = time.monotonic()
        stub = workers_pb2_grpc.DecodeWorkerStub(self.channel(target))
        call = None
        try:
            call = stub.ReadKV(workers_pb2.ReadKVRequest(request_id=request_id, push_token=push_token,
                                                         num_tokens=num_tokens), timeout=timeout)
            self.receiver.receive(call, timeout)
            kv = self.pool.take(request_id).kv
            if kv.num_tokens != num_tokens:
                self.pool.release(request_id)
                raise ValueError(f"asked for {num_tokens} tokens of KV, got {kv.num_tokens}")
        except (grpc.RpcError, KVTransferError, ValueError) as exc:
            if call is not None:
                call.cancel()
            self.failures_total += 1
            detail = exc.details() if isinstance(exc, grpc.RpcError) else str(exc)
            log.info("reading %d tokens of request %s's KV from %s failed (%s); computing them instead", num_tokens,
                     request_id, target, detail, extra={"request_id": request_id, "decode_target": target})
            return None
        seconds = time.monotonic() - started
        self.rates.pulled(num_tokens, seconds)
        self.pulls_total += 1
        self.pulled_tokens_total += num_tokens
        return kv

    def release(self, request_id: str) -> None:
        self.pool.release(request_id)

    @property
    def held_bytes(self) -> int:
        return self.pool.stats().used_bytes
