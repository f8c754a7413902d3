"""The decode worker's engine loop: one thread runs the DecodeCore; RPC threads talk to it through
a typed inbox, and it answers each request on that request's own output queue.

A request's state lives in the core's scheduler (waiting for KV, staged, running, parked,
moving, finished); the loop keeps only its thread, the inbox and the output queues. Life of a
request here: `register` (the router opened Decode: the scheduler holds it WAITING and the
staging pool now expects its KV) -> the KV lands (`on_landed`, on the receiver's thread: the
first token, sampled by the prefill, goes out at once, without waiting for the decode step in
progress, and the request is staged) -> the loop admits it into a row -> every step's outputs go
to the request's queue, which its Decode call streams -> finished, or `cancel`led from any
thread, which frees its row and staging bytes.

Draining past its grace (`drain(move_after=...)`), the loop evicts every request from the core
with its KV: the stream says `Moving` and waits until the Handoff RPC (`take_moving`, then
`end_moving`) has pushed that KV to another decode worker, or until the call is cancelled.
"""
from __future__ import annotations

import logging
import queue
import threading
import time
from collections import Counter
from concurrent.futures import Future
from dataclasses import dataclass

from baton.metrics import Metrics
from baton.v1 import workers_pb2
from baton.decode_worker.core import DecodeCore, Evicted
from baton.decode_worker.scheduler import Status
from baton.engine.request import GenerationRequest, PrefilledRequest, RequestError, RequestOutput
from baton.messages import logprob_from_proto
from baton.sampling import MAX_LOGPROBS, MAX_SEED
from baton.kvtransfer.errors import KVDuplicate
from baton.kvtransfer.staging import StagingPool

log = logging.getLogger(__name__)

_CLOSED = object()  # sentinel: the request ended without a final output (cancelled)
STANDSTILL_LOG_S = 10.0  # requests waiting for a row while none decodes this long are logged


@dataclass(frozen=True)
class Failure:
    """The request was refused after registration (its KV was unusable); the stream says why."""

    message: str


@dataclass(frozen=True)
class Moving:
    """The request left the batch unfinished (drain); its KV waits for Handoff."""

    seed: int


class NotMoving(Exception):
    """Handoff for a request that is here but not being moved (or whose KV is already on its way)."""


# The inbox: what other threads ask of the loop thread.
@dataclass(frozen=True)
class Cancel:
    request_id: str
    outputs: "queue.Queue | None" = None  # only that registration's (None: whichever is there)


@dataclass(frozen=True)
class EvictAll:
    """Draining past the grace: every request in the batch leaves it with its KV."""


@dataclass(frozen=True)
class Compute:
    """A request registered to be prefilled here (conditional disaggregation): start it."""

    request_id: str


@dataclass(frozen=True)
class ReadHeld:
    """A prefill worker reads the KV held here of a waiting request's prompt (`read_held`)."""

    request_id: str
    num_tokens: int
    reply: Future


@dataclass(frozen=True)
class Wake:
    """Look again: at the stop flag, or at a request just staged."""


Command = Cancel | EvictAll | Compute | ReadHeld | Wake
Outputs = "queue.Queue[RequestOutput | Failure | Moving | object]"

_WHERE = {Status.WAITING: "waiting for KV", Status.STAGED: "waiting for a row", Status.PARKED: "parked on the host",
          Status.RUNNING: "in the batch", Status.MOVING: "evicted, waiting for Handoff"}


class DecodeLoop:
    def __init__(self, core: DecodeCore, pool: StagingPool, metrics: Metrics | None = None):
        self.core = core
        self.pool = pool
        self.metrics = metrics or Metrics("decode")
        self._last_token_at: dict[str, float] = {}  # for the inter-token histogram
        self._inbox: "queue.Queue[Command]" = queue.Queue()
        self._streams: dict[str, Outputs] = {}  # every registered request's output queue, until it ends
        self._evicting = False  # the loop thread's: evict whatever is in the batch (drain)
        self.migrations: Counter[str] = Counter()  # sent, failed, received
        self._standstill_since: float | None = None  # the loop thread's: see _watch_standstill
        self._standstill_told = False
        self.reads_total = 0  # held KV read by prefill workers (ReadKV), and its tokens
        self.read_tokens_total = 0
        self._lock = threading.Lock()  # guards _streams; taken before the scheduler's, never after
        self._stop = threading.Event()
        self.draining = threading.Event()
        self._thread = threading.Thread(target=self._run, name="decode-loop", daemon=True)
        core.on_kv_consumed = pool.release
        core.hold_parked, core.release_parked = pool.hold, pool.release  # one host bound for staged and parked KV
        core.hold_retained = self._hold_retained
        pool.on_yield = core.host_taken_back

    def _hold_retained(self, key: str, nbytes: int) -> bool:
        """Host room for a retained entry whose pages were needed, lent until anything needs it."""
        try:
            return self.pool.hold(key, nbytes, yields=True)
        except KVDuplicate:  # already held there (cannot happen with the router's unique ids)
            return False

    def start(self) -> "DecodeLoop":
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._inbox.put(Wake())
        self._thread.join(timeout=10)
        while True:  # reads the loop never reached are refused, not left waiting
            try:
                command = self._inbox.get_nowait()
            except queue.Empty:
                break
            if isinstance(command, ReadHeld) and command.reply.set_running_or_notify_cancel():
                command.reply.set_exception(ConnectionAbortedError("this decode worker stopped"))

    # -- called from RPC threads ---------------------------------------------------------------

    def drain(self, timeout: float, move_after: float | None = None) -> bool:
        """Take no new requests; wait (up to timeout) for those in hand to finish.

        After `move_after` seconds (None: never) every request still here leaves the batch with
        its KV, its stream says `moving`, and the router hands it, KV and all, to another decode
        worker (Handoff); a request whose KV lands later goes the same way. Whatever is still here
        at timeout is cut off, and the router prefills it again elsewhere."""
        self.draining.set()
        dropped = self.core.release_retained()  # its KV events tell the routers at once
        if dropped:
            log.info("draining: released %d retained conversations' KV", dropped)
        started = time.monotonic()
        evicting = False
        while (now := time.monotonic()) < started + timeout:
            if not self._streams:
                return True
            if not evicting and move_after is not None and now >= started + move_after:
                self._inbox.put(EvictAll())
                evicting = True
            time.sleep(0.1)
        log.warning("drain timed out after %.0fs; still here: %s", timeout, self._held())
        return False

    def _held(self) -> dict[str, str]:
        """Where each request still here is, for the log of a drain that timed out."""
        with self._lock:
            streams = list(self._streams)
        statuses = self.core.scheduler.statuses()
        return {rid: _WHERE.get(statuses.get(rid), "being handed off") for rid in streams}

    def register(self, request: GenerationRequest, push_token: str = "", local: bool = False) -> Outputs:
        """`local`: its prompt is prefilled here, on top of the KV this worker holds of it; else its
        KV is pushed here."""
        if self.draining.is_set():
            raise ConnectionAbortedError("this decode worker is draining; send the request elsewhere")
        with self._lock:
            if request.request_id in self._streams:  # also while its KV is being handed off
                raise RequestError(f"request id {request.request_id!r} is already being decoded here")
            self.core.register(request, local=local)
            outputs = self._streams[request.request_id] = queue.Queue()
        if local:
            self._inbox.put(Compute(request.request_id))
        else:
            self.pool.expect(request.request_id, push_token)  # only the push carrying it takes staging room
        return outputs

    def read_held(self, request_id: str, push_token: str, num_tokens: int) -> Future:
        """The KV held here of a waiting request's first `num_tokens` prompt tokens, copied out
        between two steps; only for the caller presenting the request's push token. The future
        holds a SequenceKV, or LookupError / ValueError (see DecodeCore.held_kv)."""
        if not self.pool.expects_token(request_id, push_token):
            raise PermissionError(f"no request {request_id!r} registered here with that push token")
        reply: Future = Future()
        self._inbox.put(ReadHeld(request_id, num_tokens, reply))
        if self._stop.is_set():  # the loop may have ended before it saw this
            reply.set_exception(ConnectionAbortedError("this decode worker stopped"))
        return reply

    def on_landed(self, request_id: str) -> None:
        """A KV is in the staging pool (the receiver's thread): send its first token and stage it."""
        self._admit(request_id)
        self._inbox.put(Wake())  # an idle loop blocks on the inbox

    def take_moving(self, request_id: str) -> tuple[Outputs, Evicted]:
        """The evicted KV of a moving request, for Handoff to push; once. LookupError if the
        request is not here, NotMoving if it is but is not being moved."""
        with self._lock:
            outputs = self._streams.get(request_id)
        try:
            seq = self.core.scheduler.take_moving(request_id)
        except (LookupError, ValueError):
            if outputs is None:
                raise LookupError(f"no request {request_id!r} on this decode worker") from None
            raise NotMoving(f"request {request_id!r} is not being moved (it is decoding here, or its KV is "
                            "already being handed off); Handoff follows a Decode response with moving set") from None
        return outputs, seq.engine.evicted

    def end_moving(self, request_id: str, outputs: Outputs, ok: bool) -> None:
        """Handoff is done with a request's KV (pushed, or failed to): its stream ends."""
        self._count_migration("sent" if ok else "failed")
        with self._lock:
            if self._streams.get(request_id) is outputs:
                del self._streams[request_id]
        outputs.put(_CLOSED)

    def _count_migration(self, outcome: str) -> None:
        self.migrations[outcome] += 1
        self.metrics.migrations.labels(outcome).inc()

    def cancel(self, request_id: str, outputs: Outputs | None = None) -> None:
        """Cancel a request; with `outputs` (its registration), only that registration, so a late
        callback of a finished call never cancels a new request that reuses the id."""
        self._inbox.put(Cancel(request_id, outputs))

    def is_closed(self, item) -> bool:
        return item is _CLOSED

    def num_waiting(self) -> int:
        """Requests registered whose KV has not landed."""
        return self.core.scheduler.num_waiting

    # -- the loop thread ---------------------------------------------------------------------

    def _run(self) -> None:
        while not self._stop.is_set():
            self._drain_inbox(block=not self.core.has_work())
            self._watch_standstill()
            try:
                if self._evicting:
                    self._evict_all()
                if self.core.computing:  # a chunk of a prompt prefilled here, then the step
                    self._deliver(self.core.advance_local())
                if self.core.has_work():
                    self._deliver(self.core.step())
            except Exception:  # a bug must not silently hang every stream
                log.exception("decode step failed; aborting running requests")
                for request_id in self.core.scheduler.ids(Status.STAGED, Status.PARKED, Status.RUNNING):
                    self._end(request_id)
                for seq in self.core.computing:
                    self._end(seq.request_id)

    def _watch_standstill(self) -> None:
        """Requests waiting for a row while none decodes for STANDSTILL_LOG_S: logged once, with
        who holds the pages they cannot get (a hang shows in the logs before its deadline)."""
        if self.core.computing:
            return
        why = self.core.scheduler.standstill()
        if why is None:
            self._standstill_since, self._standstill_told = None, False
        elif self._standstill_since is None:
            self._standstill_since = time.monotonic()
        elif not self._standstill_told and time.monotonic() - self._standstill_since >= STANDSTILL_LOG_S:
            self._standstill_told = True
            log.warning("for %.0f s %s", time.monotonic() - self._standstill_since, why)

    def _drain_inbox(self, block: bool) -> None:
        try:
            command = self._inbox.get(timeout=0.5) if block else self._inbox.get_nowait()
        except queue.Empty:
            return
        while True:
            match command:
                case Cancel(request_id, outputs):
                    self._end(request_id, outputs)
                case EvictAll():
                    self._evicting = True
                case Compute(request_id):
                    self.core.compute(request_id)
                case ReadHeld(request_id, num_tokens, reply):
                    if reply.set_running_or_notify_cancel():
                        try:
                            reply.set_result(self.core.held_kv(request_id, num_tokens))
                            self.reads_total += 1
                            self.read_tokens_total += num_tokens
                        except Exception as exc:  # noqa: BLE001 - the reader is told; the loop goes on
                            reply.set_exception(exc)
            try:
                command = self._inbox.get_nowait()
            except queue.Empty:
                return

    def _admit(self, request_id: str) -> None:
        """Land a request's KV in the core, send its first token, then stage it for a row. Runs
        beside the loop thread: none of it touches the batch."""
        request = self.core.waiting(request_id)
        if request is None:  # cancelled before its KV landed
            self.pool.cancel(request_id)
            return
        trace = request.trace
        try:
            staged = self.pool.take(request_id)
            meta = self._check_landed(request, staged)
            trace.cached_tokens = meta.cached_tokens
            trace.mark("staged")
            first_logprob = logprob_from_proto(meta.first_logprob) if meta.HasField("first_logprob") else None
            first = self.core.land(PrefilledRequest(request, staged.kv, meta.first_token, meta.seed,
                                                    first_logprob=first_logprob))
        except LookupError:  # cancelled while it landed: the cancel freed all but the staging bytes
            self.pool.cancel(request_id)
            return
        except Exception as exc:  # this request alone fails (its stream says why); the batch goes on
            if isinstance(exc, RequestError):
                log.warning("request %s refused at admission: %s", request_id, exc)
            else:
                log.exception("request %s could not be admitted", request_id)
            self._end(request_id, failure=f"its KV could not be admitted: {exc}")
            return
        if meta.handoff:
            self._count_migration("received")
        self._deliver([first])
        if not first.finished:
            try:
                self.core.stage(request_id)
            except ValueError:  # cancelled since it landed: the cancel freed everything but staging
                self.pool.cancel(request_id)

    def _evict_all(self) -> None:
        """Every request in the batch leaves it with its KV; its stream says it is moving."""
        for request_id in self.core.scheduler.ids(Status.STAGED, Status.PARKED, Status.RUNNING):
            evicted = self.core.evict(request_id)
            self._last_token_at.pop(request_id, None)
            with self._lock:
                outputs = self._streams.get(request_id)
            if outputs is None:  # nobody will hand it off
                self.core.abort(request_id)
            else:
                outputs.put(Moving(evicted.seed))

    def _check_landed(self, request: GenerationRequest, staged) -> workers_pb2.KVMetadata:
        """A landed KV must belong to the prompt registered for it; only this request fails if not."""
        try:
            meta = workers_pb2.KVMetadata.FromString(staged.metadata)
        except Exception:  # protobuf's DecodeError: the sender's bug, not ours to crash on
            raise RequestError("the KV's metadata could not be decoded") from None
        vocab = self.core.runner.loaded.config.vocab_size
        if not 0 <= meta.first_token < vocab:
            raise RequestError(f"the KV's first token {meta.first_token} is outside the vocabulary [0, {vocab})")
        if meta.seed > MAX_SEED:  # a uint64 on the wire; every sampler seed is below 2**63
            raise RequestError(f"the KV's seed {meta.seed} is outside 0..2**63-1")
        if meta.HasField("first_logprob") and (meta.first_logprob.token_id != meta.first_token or len(
                meta.first_logprob.top_token_ids) != len(meta.first_logprob.top_logprobs) or len(
                meta.first_logprob.top_token_ids) > MAX_LOGPROBS):
            raise RequestError("the KV's first-token log probability does not match its first token")
        prompt_len, held = len(request.prompt_token_ids), self.core.held_tokens(request.request_id)
        if staged.kv.num_tokens not in (prompt_len, prompt_len - held):
            raise RequestError(f"the KV holds {staged.kv.num_tokens} tokens but the prompt has {prompt_len}"
                               + (f" ({held} of them held here already)" if held else ""))
        return meta

    def _deliver(self, outputs: list[RequestOutput]) -> None:
        now = time.monotonic()
        for out in outputs:
            last = self._last_token_at.get(out.request_id)
            if last is not None:
                self.metrics.tbt.observe(now - last)
                self.metrics.vllm_itl.observe(now - last)
            self._last_token_at[out.request_id] = now
            if out.finished:
                self._last_token_at.pop(out.request_id, None)
                self.metrics.requests.labels(out.finish_reason).inc()
                self.metrics.vllm_generation_tokens.inc(len(out.token_ids))
            stream = self._streams.get(out.request_id)
            if stream is None:
                continue
            stream.put(out)
            if out.finished:
                with self._lock:
                    self._streams.pop(out.request_id, None)

    def _end(self, request_id: str, outputs: Outputs | None = None, failure: str | None = None) -> None:
        """Cancel wherever the request is: waiting for KV, staged, running, parked or moving."""
        with self._lock:
            current = self._streams.get(request_id)
            if outputs is not None and current is not outputs:
                return  # that registration already ended; the id may belong to a new request now
            self._streams.pop(request_id, None)
        self._last_token_at.pop(request_id, None)
        self.core.abort(request_id)
        self.pool.cancel(request_id)
        if current is not None:
            current.put(Failure(failure) if failure else _CLOSED)
