"""The decode worker's engine loop: one thread owns the DecodeCore; RPC threads talk to it by queue.

Life of a request here: `register` (the router opened Decode: the staging pool now expects its
KV) -> the KV lands (`on_landed` wakes the loop) -> the loop takes it from staging and adds it
to the core -> every step's outputs go to the request's own queue, which its Decode call
streams -> finished, or `cancel`led from any thread, which frees its row and staging bytes.
"""
from __future__ import annotations

import logging
import queue
import threading
import time
from dataclasses import dataclass

from baton.metrics import Metrics
from baton.v1 import workers_pb2
from decode_worker.core import DecodeCore
from engine.request import GenerationRequest, PrefilledRequest, RequestError, RequestOutput
from kvtransfer.staging import StagingPool

log = logging.getLogger(__name__)

_CLOSED = object()  # sentinel: the request ended without a final output (cancelled)


@dataclass(frozen=True)
class Failure:
    """The request was refused after registration (its KV was unusable); the stream says why."""

    message: str


@dataclass
class _Pending:
    request: GenerationRequest
    outputs: "queue.Queue[RequestOutput | object]"


class DecodeLoop:
    def __init__(self, core: DecodeCore, pool: StagingPool, max_pending: int, metrics: Metrics | None = None):
        self.core = core
        self.metrics = metrics or Metrics("decode")
        self._last_token_at: dict[str, float] = {}
        self.pool = pool
        self.max_pending = max_pending
        self._inbox: "queue.Queue[tuple[str, str]]" = queue.Queue()
        self._pending: dict[str, _Pending] = {}  # registered, KV not yet added to the core
        self._streams: dict[str, _Pending] = {}  # every registered request until it ends
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self.draining = threading.Event()
        self._thread = threading.Thread(target=self._run, name="decode-loop", daemon=True)
        core.on_kv_consumed = pool.release

    def start(self) -> "DecodeLoop":
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._inbox.put(("wake", "", None))
        self._thread.join(timeout=10)

    # -- called from RPC threads ---------------------------------------------------------------

    def drain(self, timeout: float) -> bool:
        """Take no new requests; wait (up to timeout) for those in hand to finish. Whatever is
        still running after that is cut off, and the router moves it to another decode worker."""
        self.draining.set()
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if not self._streams:
                return True
            time.sleep(0.1)
        return False

    def register(self, request: GenerationRequest) -> "queue.Queue":
        if self.draining.is_set():
            raise ConnectionAbortedError("this decode worker is draining; send the request elsewhere")
        with self._lock:
            if request.request_id in self._streams:
                raise RequestError(f"request id {request.request_id!r} is already being decoded here")
            if len(self._pending) >= self.max_pending:
                raise OverflowError(f"{self.max_pending} requests are already waiting for KV here; retry later")
            self.core.check_fits(len(request.prompt_token_ids), request.params)
            entry = _Pending(request, queue.Queue())
            self._pending[request.request_id] = entry
            self._streams[request.request_id] = entry
        self.pool.expect(request.request_id)
        return entry.outputs

    def on_landed(self, request_id: str) -> None:
        self._inbox.put(("landed", request_id, None))

    def cancel(self, request_id: str, outputs: "queue.Queue | None" = None) -> None:
        """Cancel a request; with `outputs` (its registration), only that registration, so a late
        callback of a finished call never cancels a new request that reuses the id."""
        self._inbox.put(("cancel", request_id, outputs))

    # -- the loop thread ---------------------------------------------------------------------

    def _run(self) -> None:
        while not self._stop.is_set():
            self._drain_inbox(block=not self.core.has_work())
            if self.core.has_work():
                try:
                    self._deliver(self.core.step())
                except Exception:  # a bug must not silently hang every stream
                    log.exception("decode step failed; aborting running requests")
                    for request_id in list(self.core.live):
                        self._end(request_id)

    def _drain_inbox(self, block: bool) -> None:
        try:
            event, request_id, outputs = self._inbox.get(timeout=0.5) if block else self._inbox.get_nowait()
        except queue.Empty:
            return
        while True:
            if event == "landed":
                self._admit(request_id)
            elif event == "cancel":
                self._end(request_id, outputs)
            try:
                event, request_id, outputs = self._inbox.get_nowait()
            except queue.Empty:
                return

    def _admit(self, request_id: str) -> None:
        with self._lock:
            entry = self._pending.pop(request_id, None)
        if entry is None:  # cancelled before its KV landed
            self.pool.cancel(request_id)
            return
        staged = self.pool.take(request_id)
        trace = entry.request.trace
        try:
            meta = self._check_landed(entry.request, staged)
            trace.cached_tokens = meta.cached_tokens
            trace.mark("staged")
            first = self.core.add(PrefilledRequest(entry.request, staged.kv, meta.first_token, meta.seed))
        except RequestError as exc:
            log.warning("request %s refused at admission: %s", request_id, exc)
            self.pool.release(request_id)
            self._end(request_id, failure=str(exc))
            return
        self._deliver([first])

    def _check_landed(self, request: GenerationRequest, staged) -> workers_pb2.KVMetadata:
        """A landed KV must belong to the prompt registered for it; only this request fails if not."""
        try:
            meta = workers_pb2.KVMetadata.FromString(staged.metadata)
        except Exception:  # protobuf's DecodeError: the sender's bug, not ours to crash on
            raise RequestError("the KV's metadata could not be decoded") from None
        vocab = self.core.runner.loaded.config.vocab_size
        if not 0 <= meta.first_token < vocab:
            raise RequestError(f"the KV's first token {meta.first_token} is outside the vocabulary [0, {vocab})")
        if staged.kv.num_tokens != len(request.prompt_token_ids):
            raise RequestError(f"the KV holds {staged.kv.num_tokens} tokens but the prompt has "
                               f"{len(request.prompt_token_ids)}")
        return meta

    def _deliver(self, outputs: list[RequestOutput]) -> None:
        now = time.monotonic()
        for out in outputs:
            last = self._last_token_at.get(out.request_id)
            if last is not None:
                self.metrics.tbt.observe(now - last)
            self._last_token_at[out.request_id] = now
            if out.finished:
                self._last_token_at.pop(out.request_id, None)
                self.metrics.requests.labels(out.finish_reason).inc()
            entry = self._streams.get(out.request_id)
            if entry is None:
                continue
            entry.outputs.put(out)
            if out.finished:
                with self._lock:
                    self._streams.pop(out.request_id, None)

    def _end(self, request_id: str, outputs: "queue.Queue | None" = None, failure: str | None = None) -> None:
        """Cancel wherever the request is: waiting for KV, staged, or running."""
        with self._lock:
            entry = self._streams.get(request_id)
            if outputs is not None and (entry is None or entry.outputs is not outputs):
                return  # that registration already ended; the id may belong to a new request now
        self._last_token_at.pop(request_id, None)
        with self._lock:
            self._pending.pop(request_id, None)
            entry = self._streams.pop(request_id, None)
        self.core.abort(request_id)
        self.pool.cancel(request_id)
        if entry is not None:
            entry.outputs.put(Failure(failure) if failure else _CLOSED)

    def is_closed(self, item) -> bool:
        return item is _CLOSED

    def num_pending(self) -> int:
        return len(self._pending)
