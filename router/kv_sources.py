"""What feeds a decode worker a request's KV: a prefill (retried once on another prefill worker),
the decode worker itself (it holds most of the prompt and prefills the rest), or a draining decode
worker handing it over. The router's dispatch opens the Decode call, then
starts the source; a source that fails for good stops that call (`on_give_up`)."""
from __future__ import annotations

import logging
import secrets
import threading

import grpc

from baton.v1 import workers_pb2
from baton.router.errors import DecodeLost, cause
from baton.router.workers import Worker

log = logging.getLogger(__name__)

# Worker-side failures: another worker may prefill the prompt. CANCELLED is one too: this router's
# own cancel of the call ends the chain before it is looked at, so the worker gave the prompt up
# (chaos once saw a batch member fail CANCELLED during a prefill worker's drain).
PREFILL_RETRYABLE = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.INTERNAL, grpc.StatusCode.UNKNOWN,
                     grpc.StatusCode.CANCELLED)


class KVSource:
    """What feeds a leg's decode worker its KV. Once that worker has sent a token the KV is there,
    and a later failure of the source (say a prefill retry whose push is refused because the first
    try's KV had already landed before its worker died) must not stop the stream."""

    def __init__(self):
        # Handed to both ends: the decode worker stages KV only from the push that carries it.
        self.push_token = secrets.token_hex(16)
        self._lock = threading.Lock()
        self._cancelled = False
        self._delivered = False
        self._give_up = None
        self._failure = None

    def delivered(self) -> None:
        self._delivered = True

    def _failed(self, err) -> None:
        if self._delivered:
            log.info("%s failed after its KV was delivered (%s); ignored", type(self).__name__, err.code().name)
            return
        self._failure = err
        if self._give_up is not None:
            self._give_up()

    def failure(self):
        return self._failure

    def describe(self) -> str:
        """Where its KV is coming from, for a request that stopped moving (router/progress.py)."""
        return type(self).__name__

    def pulse(self) -> object:
        """What changes while its KV is being made (router/progress.py): nothing seen by default."""
        return None


class PrefillChain(KVSource):
    """Prefill on the routed worker; if it fails for a worker-side reason, once more on another.
    When it finally fails, `on_give_up` stops the decode stream waiting for KV that never comes."""

    def __init__(self, dispatcher, route, request_id, prompt, sampling, resume_step, timeout, metadata=()):
        super().__init__()
        self.metadata = metadata or None  # the request's trace context (baton.tracing)
        self.dispatcher = dispatcher
        self.route = route
        self.request_id = request_id
        self.prompt = prompt
        self.sampling = sampling
        self.resume_step = resume_step
        self.timeout = timeout
        self.tries = 0
        self.call = None
        self._acquired = None
        self.skip_tokens = 0  # leading prompt tokens whose KV the decode worker holds already

    def start(self, on_give_up, held_tokens: int = 0) -> None:
        """`held_tokens`: what the decode worker's registration said it holds; not pushed again."""
        self._give_up = on_give_up
        self.skip_tokens = held_tokens if 0 < held_tokens < len(self.prompt) else 0
        self._launch(self.route.prefill)

    def _launch(self, worker: Worker) -> None:
        with self._lock:
            if self._cancelled:
                return
            self.tries += 1
            self._swap_acquired(worker)
            self.call = call = worker.stub.Prefill.future(
                workers_pb2.PrefillRequest(request_id=self.request_id, prompt_token_ids=self.prompt,
                                           sampling=self.sampling, decode_target=self.route.decode.view.address,
                                           model_fingerprint=self.route.decode.fingerprint,
                                           resume_step=self.resume_step, push_token=self.push_token,
                                           kv_skip_tokens=self.skip_tokens),
                timeout=self.timeout, metadata=self.metadata)
        # Outside the lock: a call that already failed (a dead worker fails at once) runs _done
        # right here, and its retry takes the lock again.
        call.add_done_callback(self._done)

    def _swap_acquired(self, worker: Worker) -> None:
        self._release_acquired()
        self._acquired = (worker, self.route.prefill_tokens)
        self.dispatcher.pool.acquire(*self._acquired)

    def _release_acquired(self) -> None:
        """The prefill worker no longer counts this request (its prefill ended, or it was left)."""
        if self._acquired is not None:
            self.dispatcher.pool.release(*self._acquired)
            self._acquired = None

    def _done(self, call) -> None:
        if call.cancelled():
            return
        if call.exception() is None:  # prefilled and pushed: no longer the worker's backlog
            with self._lock:
                if self.call is call:
                    self._release_acquired()
            return
        err = call.exception()
        retry = self.tries < 2 and not self._cancelled and not self._delivered and err.code() in PREFILL_RETRYABLE
        if retry:
            failed = self.route.prefill
            self.dispatcher.pool.mark_failed(failed)
            others = [v for v in self.dispatcher.prefill_views(self.prompt, exclude=failed.view.address) if v.healthy]
            if others:
                chosen = self.dispatcher.picker.pick_prefill(others, len(self.prompt))
                worker = self.dispatcher.pool.get("prefill", chosen.address)
                if worker is not None:
                    log.warning("prefill on %s failed (%s: %s); retrying on %s", failed.view.address,
                                err.code().name, (err.details() or "")[:300], worker.view.address)
                    self.route.prefill = worker
                    self.route.predicted_cached_tokens = chosen.predicted_cached_tokens  # what it holds, not the first
                    self._launch(worker)
                    return
        self._failed(err)

    def lost(self) -> DecodeLost | None:
        """The request must go on with another decode worker. ABORTED: the prompt was prefilled but
        its KV could not be delivered to the decode worker. PERMISSION_DENIED: the prefill worker
        does not count that decode worker among its targets (no longer, or not yet: its discovery
        and this router's disagree while a worker leaves or joins)."""
        failure = self._failure
        if failure is not None and failure.code() in (grpc.StatusCode.ABORTED, grpc.StatusCode.PERMISSION_DENIED):
            return DecodeLost(cause(failure), self.seed(), self.route.decode,
                              prefilled=failure.code() == grpc.StatusCode.ABORTED)
        return None

    def pulse(self) -> object:
        """While its prefill call is out, the prefill worker's forwarded prompt tokens as its last
        polled load says: a long prompt prefilled chunk by chunk (or one queued behind others) is
        moving while they grow; a prefill worker that hangs stops them. Fixed once the call ended."""
        call, worker = self.call, self.route.prefill
        if call is None or call.done():
            return ("ended", self.tries)
        load = worker.last_load
        return (worker.view.address, self.tries, getattr(load, "prompt_tokens_forwarded", None))

    def describe(self) -> str:
        call = self.call
        state = "not started" if call is None else "in flight" if not call.done() else \
            "cancelled" if call.cancelled() else "answered" if call.exception() is None else \
            f"failed ({call.exception().code().name})"
        return f"its KV from prefill worker {self.route.prefill.view.address} (try {self.tries}: {state})"

    def reply(self, last=None) -> workers_pb2.PrefillReply:
        """The prefill's reply, for the usage, trace and prefix index; an empty one when the KV
        arrived but no reply will (its worker died right after the push)."""
        try:
            return self.call.result(timeout=REPLY_WAIT_S)
        except (grpc.RpcError, grpc.FutureTimeoutError, grpc.FutureCancelledError) as exc:
            log.info("request %s finished without its prefill reply (%s)", self.request_id, type(exc).__name__)
            return workers_pb2.PrefillReply()

    def seed(self) -> int | None:
        call = self.call
        if call is not None and call.done() and not call.cancelled() and call.exception() is None:
            return call.result().seed
        return None

    def cancel(self) -> None:
        with self._lock:
            self._cancelled = True
            if self.call is not None and not self.call.done():
                self.call.cancel()
            self._release_acquired()


# How long a finished request waits for its prefill's reply; it normally comes with the KV.
REPLY_WAIT_S = 10.0


class LocalPrefill(KVSource):
    """The decode worker prefills the prompt itself, on top of the KV it holds of it (the Decode
    call says `prefill_here`): nothing to start, push or retry. If that worker fails, the request
    is routed again like any other whose decode worker was lost."""

    def start(self, on_give_up, held_tokens: int = 0) -> None:
        self._give_up = on_give_up

    def describe(self) -> str:
        return "the decode worker prefills it itself"

    def lost(self) -> DecodeLost | None:
        return None

    def reply(self, last=None) -> workers_pb2.PrefillReply:
        """The prefill's figures, from the decode stream's last message."""
        if last is None:
            return workers_pb2.PrefillReply()
        return workers_pb2.PrefillReply(cached_tokens=last.cached_tokens, prefill_seconds=last.prefill_seconds)

    def seed(self) -> int | None:
        return None

    def cancel(self) -> None:
        self._cancelled = True


class Handoff(KVSource):
    """A leg's KV source after the previous decode worker began draining: that worker pushes the
    request's KV to this leg's worker (`DecodeWorker.Handoff`). Its Decode call there stays open
    until then, holding the KV; cancelling it frees whatever is left."""

    def __init__(self, source: Worker, source_call, source_request_id: str, target: Worker, target_request_id: str,
                 seed: int, timeout: float | None):
        super().__init__()
        self.source = source
        self.source_call = source_call
        self.request = workers_pb2.HandoffRequest(request_id=source_request_id, target=target.view.address,
                                                  target_request_id=target_request_id, push_token=self.push_token)
        self._seed = seed
        self.timeout = timeout
        self.call = None

    def start(self, on_give_up, held_tokens: int = 0) -> None:
        """A handoff pushes the whole KV (`held_tokens` is not used: the receiver takes that too)."""
        self._give_up = on_give_up
        with self._lock:
            if self._cancelled:
                return
            self.call = self.source.stub.Handoff.future(self.request, timeout=self.timeout)
        self.call.add_done_callback(self._done)

    def _done(self, call) -> None:
        self.source_call.cancel()  # the handoff is over: nothing is left there to hold
        if call.cancelled() or call.exception() is None:
            return
        err = call.exception()
        log.warning("%s could not hand request %s to %s (%s: %s)", self.source.view.address, self.request.request_id,
                    self.request.target, err.code().name, err.details())
        self._failed(err)

    def describe(self) -> str:
        call = self.call
        state = "not started" if call is None else "in flight" if not call.done() else "ended"
        return f"its KV handed over from decode worker {self.source.view.address} ({state})"

    def lost(self) -> DecodeLost | None:
        """Any failure: the KV did not arrive, so the request is prefilled again."""
        failure = self._failure
        return None if failure is None else DecodeLost(cause(failure), self._seed, self.source)

    def seed(self) -> int:
        return self._seed

    def cancel(self) -> None:
        with self._lock:
            self._cancelled = True
            if self.call is not None and not self.call.done():
                self.call.cancel()
        self.source_call.cancel()
