"""One request's trip through the cluster, as the router drives it.

Route (prefix index + load) -> open DecodeWorker.Decode (the worker now expects the KV) ->
PrefillWorker.Prefill naming that decode worker (the KV is pushed there) -> relay tokens. A
failed prefill cancels the decode stream at once; a cancelled or expired request cancels both.
A decode worker that drains hands its requests' KV to other decode workers (Handoff); one that
fails loses them, and they are prefilled again elsewhere.

Conditional disaggregation: a decode worker that holds most of a prompt (its KV events are in the
prefix index: a conversation's earlier turns, kept after they finished) gets the request with no
prefill worker when the rest is at most `local_prefill_max_tokens` and costs no more there than on
a prefill worker (`Picker.prefill_here`); it prefills that rest itself (`LocalPrefill`) and nothing
is transferred. The route's reason is in the trace.
"""
from __future__ import annotations

import dataclasses
import functools
import itertools
import logging
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field

import grpc

from baton import tracing
from baton.block_hash import BlockHasher
from baton.v1 import common_pb2, router_pb2, workers_pb2
from baton.router.admission import AdmissionCancelled, AdmissionTimeout, DecodeAdmission
from baton.router.errors import DecodeLost, DispatchError, cause
from baton.router.kv_sources import Handoff, KVSource, LocalPrefill, PrefillChain
from baton.router.policy import NoWorkers, PendingPrefixes, Picker
from baton.router.prefix_index import PrefixIndex
from baton.router.progress import InFlight
from baton.router.workers import Worker, WorkerPool

log = logging.getLogger(__name__)


@dataclass
class RoutingStats:
    """How well the prefix index predicted what prefill workers really reused."""

    requests: int = 0
    predicted_tokens: int = 0
    actual_tokens: int = 0
    overlap_tokens: int = 0  # sum of min(predicted, actual)
    union_tokens: int = 0  # sum of max(predicted, actual)
    prefilled_again: int = 0  # requests that lost their decode worker and were prefilled once more
    pulled_requests: int = 0  # whose prefill read the KV of their prompt's start from the decode worker
    pulled_tokens: int = 0

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
    prefill: Worker | None  # None: the decode worker prefills the prompt itself (`local`)
    decode: Worker
    predicted_cached_tokens: int
    seconds: float = 0.0  # the router's own time choosing
    reason: str = ""
    prompt_tokens: int = 0
    # The workers chosen count the request in flight from the choice on (`Dispatcher.route`) until
    # the calls that take them over count it themselves; then `release`. With each, the prompt
    # tokens it counts (its prefill worker: those it will compute).
    held: list[tuple[Worker, int]] = field(default_factory=list)
    pool: WorkerPool | None = None

    @property
    def local(self) -> bool:
        return self.prefill is None

    @property
    def prefill_tokens(self) -> int:
        """The prompt tokens its prefill worker will compute, as predicted."""
        return max(1, self.prompt_tokens - self.predicted_cached_tokens)

    def hold(self, worker: Worker, tokens: int = 0) -> None:
        self.pool.acquire(worker, tokens)
        self.held.append((worker, tokens))

    def release(self, *workers: Worker) -> None:
        """Stop counting the request on `workers`, or on every chosen one left (idempotent)."""
        gone = [(w, n) for w, n in self.held if not workers or any(w is x for x in workers)]
        self.held = [(w, n) for w, n in self.held if not any(w is g for g, _ in gone)]
        for worker, tokens in gone:
            self.pool.release(worker, tokens)


class Dispatcher:
    def __init__(self, pool: WorkerPool, index: PrefixIndex, block_size: int, picker: Picker | None = None,
                 on_route: Callable[[float], None] = lambda seconds: None, pending_max_blocks: int = 65_536,
                 admission: DecodeAdmission | None = None, local_prefill_max_tokens: int = 0):
        self.pool = pool
        # A decode worker holding a prompt's prefix prefills a rest this short itself (0: never).
        self.local_prefill_max_tokens = local_prefill_max_tokens
        # Requests wait here, before their prefill, while the decode workers' rows are taken
        # (router.admission); None: every request is prefilled at once.
        self.admission = admission or DecodeAdmission(-1)
        self.on_route = on_route  # told how long each routing decision took
        self.index = index
        self.block_size = block_size
        self.picker = picker or Picker()
        # Prefixes sent to a prefill worker, not yet in its events (router.pending_max_blocks).
        self.pending = PendingPrefixes(max_entries=pending_max_blocks)
        self.stats = RoutingStats()  # requests routed to a prefill worker
        self.local_stats = RoutingStats()  # requests prefilled on the decode worker holding their prefix
        self._stats_lock = threading.Lock()
        self._hashers: dict[str, BlockHasher] = {}
        self.inflight = InFlight()  # how far each request has come (router/progress.py)
        self._routing = threading.Lock()  # a choice and its workers' in-flight counts, together

    def block_hashes(self, prompt: list[int]) -> list[int]:
        """The prompt's chained block hashes under the served model's fingerprint; none before any
        worker has reported it (the request then routes without a prefix prediction)."""
        fingerprint = next((w.fingerprint for w in self.pool.all() if w.fingerprint), "")
        if not fingerprint:
            return []
        if fingerprint not in self._hashers:
            self._hashers[fingerprint] = BlockHasher(fingerprint, self.block_size)
        return self._hashers[fingerprint].hash_prompt(prompt)

    def usable_tokens(self, blocks: int, prompt_len: int) -> int:
        # The prefill worker always computes the prompt's last token (it needs its logits).
        return min(blocks, (prompt_len - 1) // self.block_size) * self.block_size

    def prefill_views(self, prompt: list[int], hashes: list[int] | None = None, exclude: str = "",
                      matches: dict[str, int] | None = None) -> list:
        """The prefill workers' views, each with the prompt tokens the index (or a pending prefix)
        says it holds cached."""
        hashes = self.block_hashes(prompt) if hashes is None else hashes
        matches = dict(self.index.match(hashes) if matches is None else matches)
        for address, blocks in self.pending.match(hashes).items():
            matches[address] = max(matches.get(address, 0), blocks)
        return self._predicted(self.pool.views("prefill"), matches, len(prompt), exclude)

    def _predicted(self, views, matches: dict[str, int], prompt_len: int, exclude: str = "") -> list:
        return [dataclasses.replace(v, predicted_cached_tokens=self.usable_tokens(matches.get(v.address, 0), prompt_len))
                for v in views if v.address != exclude]

    def route(self, prompt: list[int], prefill_address: str | None = None, avoid: set[str] = frozenset(),
              allow_local: bool = False) -> Route:
        """allow_local: the request may be prefilled on a decode worker that holds most of it.

        The workers chosen count the request in flight at once (`Route.held`; the caller releases
        it once its calls count the request themselves): a burst of requests routed before the
        first one's calls began all saw the same idle worker, and went there together."""
        with self._routing:
            route = self._route(prompt, prefill_address, avoid, allow_local)
            route.pool, route.prompt_tokens = self.pool, len(prompt)
            if route.prefill is not None:
                route.hold(route.prefill, route.prefill_tokens)
            route.hold(route.decode)
        return route

    def _route(self, prompt: list[int], prefill_address: str | None, avoid: set[str], allow_local: bool) -> Route:
        started = time.perf_counter()
        hashes = self.block_hashes(prompt)
        matches = self.index.match(hashes) if hashes else {}
        decode_views = self._predicted([v for v in self.pool.views("decode") if v.address not in avoid], matches,
                                       len(prompt))
        holder = self.picker.pick_holder(decode_views, len(prompt)) if prefill_address is None else None
        views = self.prefill_views(prompt, hashes, matches=matches)
        try:
            if prefill_address is not None:
                prefill_view = next(v for v in views if v.address == prefill_address)
            else:
                prefill_view = self.picker.pick_prefill(views, len(prompt))
        except (NoWorkers, StopIteration) as exc:
            if holder is None or not allow_local:
                raise DispatchError(grpc.StatusCode.UNAVAILABLE, str(exc) or "the pinned prefill worker left") from None
            prefill_view = None  # the decode worker holding the prompt can still prefill it
        reason = "least loaded decode worker; prefill worker by cached prefix and queue"
        if holder is not None:
            here, reason = self.picker.prefill_here(holder, prefill_view, len(prompt), self.local_prefill_max_tokens)
            decode = self.pool.get("decode", holder.address)
            if decode is not None and allow_local and here:
                seconds = time.perf_counter() - started
                self.on_route(seconds)
                return Route(None, decode, holder.predicted_cached_tokens, seconds=seconds, reason=reason)
            if prefill_view is None:
                raise DispatchError(grpc.StatusCode.UNAVAILABLE, "no healthy prefill worker is available")
        try:
            decode_view = holder or self.picker.pick_decode(decode_views, len(prompt))
        except NoWorkers as exc:
            raise DispatchError(grpc.StatusCode.UNAVAILABLE, str(exc)) from None
        prefill = self.pool.get("prefill", prefill_view.address)
        decode = self.pool.get("decode", decode_view.address)
        if prefill is None or decode is None:
            raise DispatchError(grpc.StatusCode.UNAVAILABLE, "a chosen worker just left; retry")
        # The worker caches the prompt's whole blocks; until its events say so, say it here.
        self.pending.add(prefill_view.address, hashes[:(len(prompt) - 1) // self.block_size])
        seconds = time.perf_counter() - started
        self.on_route(seconds)
        return Route(prefill, decode, prefill_view.predicted_cached_tokens, seconds=seconds, reason=reason)

    def run(self, request_id: str, prompt: list[int], sampling, timeout: float | None, on_done,
            prefill_address: str | None = None, pinned_tokens: int = 0, span=tracing.NO_SPAN):
        """Yield GenerateResponses; `on_done(cancel)` lets the caller register cancellation.
        `prefill_address` forces the prefill worker (a batch group's pin holds `pinned_tokens` there).
        `span` (baton.tracing) records the routing and sends its trace context to the workers.

        When the decode worker fails mid-stream, the request continues on another one: the prompt
        plus the tokens already sent is prefilled again, and the stream goes on from there with
        no token lost or repeated (the sampler resumes at the same step of the same seed). A
        draining decode worker hands its requests' KV itself to another one instead (see
        `_attempt`); only when that fails is the request prefilled again.

        `request_id` is the caller's label, echoed in the responses; on the workers the request goes
        by the router's own unique id, so two callers choosing the same id never meet there (one's
        cancel cannot end the other's request)."""
        key = uuid.uuid4().hex
        log.debug("request %s runs as %s", request_id, key)
        arrived = time.monotonic()
        deadline = None if timeout is None else arrived + timeout
        sent: list[int] = []
        avoid: set[str] = set()
        sampling = common_pb2.SamplingParams.FromString(sampling.SerializeToString())  # our own copy
        yield router_pb2.GenerateResponse(request_id=request_id, prompt_token_ids=prompt)
        cancelled = threading.Event()
        on_done(cancelled.set)
        waiting = time.monotonic()
        self.inflight.begin(key, request_id, "waiting for a decode row (router.decode_queue_per_worker)")
        try:
            try:
                self.admission.enter(lambda: self.pool.views("decode"), sampling.priority, deadline, cancelled)
            except AdmissionTimeout as exc:
                raise DispatchError(grpc.StatusCode.DEADLINE_EXCEEDED, str(exc)) from None
            except AdmissionCancelled as exc:
                raise DispatchError(grpc.StatusCode.CANCELLED, str(exc)) from None
            span.stage("wait_for_decode", waiting, time.monotonic())  # the decode worker has its own "admission"
            try:
                yield from self._attempts(request_id, key, prompt, sent, avoid, sampling, deadline, on_done, arrived,
                                          prefill_address, pinned_tokens, span)
            finally:
                self.admission.leave()
        finally:
            self.inflight.end(key)

    def _route_around(self, prompt: list[int], pinned: str | None, avoid: set[str], allow_local: bool,
                      deadline: float | None) -> Route:
        """A route that avoids the decode workers this request lost; where every decode worker is
        among them, the same ones again once the pool's polls count one healthy (a push that failed
        is not a dead worker: a request with one decode worker to go to was lost to 'no healthy
        decode worker' while that worker ran on). A worker really gone stays unhealthy: the request
        then fails as before, within a few polls."""
        try:
            return self.route(prompt, pinned, avoid, allow_local=allow_local)
        except DispatchError:
            decode = self.pool.views("decode")
            if not decode or not all(v.address in avoid for v in decode):
                raise
        give_up = time.monotonic() + max(1.0, REVISIT_POLLS * self.pool.poll_seconds)
        if deadline is not None:
            give_up = min(give_up, deadline)
        while True:
            try:
                return self.route(prompt, pinned, frozenset(), allow_local=allow_local)
            except DispatchError:
                if time.monotonic() >= give_up:
                    raise
                time.sleep(self.pool.poll_seconds / 2)

    def _attempts(self, request_id, key, prompt, sent, avoid, sampling, deadline, on_done, arrived, prefill_address,
                  pinned_tokens, span):
        for attempt in range(MAX_ATTEMPTS):
            routing = time.monotonic()
            pinned = prefill_address if attempt == 0 else None
            route = self._route_around(prompt + sent, pinned, avoid, allow_local=pinned is None, deadline=deadline)
            span.stage("route", routing, time.monotonic(), prefill_worker=route.prefill.view.address if route.prefill else "",
                       decode_worker=route.decode.view.address, predicted_cached_tokens=route.predicted_cached_tokens,
                       reason=route.reason)
            if pinned_tokens and attempt == 0 and len(prompt) - 1 >= pinned_tokens:
                route.predicted_cached_tokens = max(route.predicted_cached_tokens, pinned_tokens)
            attempt_id = key if attempt == 0 else f"{key}~{attempt}"
            try:
                track = functools.partial(self.inflight.moved, key)
                for out in self._attempt(attempt_id, prompt, sent, sampling, deadline, route, on_done, arrived,
                                         span.metadata, track):
                    out.request_id = request_id
                    yield out
                return
            except DecodeLost as lost:
                self.pool.mark_failed(lost.worker)
                avoid.add(lost.worker.view.address)
                if attempt + 1 == MAX_ATTEMPTS:
                    raise lost.error from None
                if lost.seed is not None and not sampling.HasField("seed"):
                    sampling.seed = lost.seed  # so the moved request keeps its random stream
                self.stats.prefilled_again += lost.prefilled
                log.warning("request %s (%s) lost its decode worker %s after %d tokens (%s); prefilling it %s",
                            request_id, key, lost.worker.view.address, len(sent), lost.error.message,
                            "again" if lost.prefilled else "for another")
            finally:
                route.release()  # if its calls did not take it over (they failed to start)

    def _attempt(self, request_id, prompt, sent: list[int], sampling, deadline, route: Route, on_done, arrived,
                 metadata=(), track=lambda **progress: None):
        """One try: the prompt (plus the tokens already sent) is prefilled for the routed decode
        worker, whose stream is relayed; the prefill is retried on another worker if it fails.

        A decode worker that drains says `moving` on the stream: the request then continues on
        another decode worker, opened for prompt + sent[:-1] at step len(sent) - 1, and fed by the
        draining worker pushing the request's KV there (`Handoff`) instead of by a prefill."""
        prefill = LocalPrefill() if route.local else PrefillChain(
            self, route, request_id, prompt + sent, _left(sampling, len(sent)), len(sent), _until(deadline), metadata)
        leg = _Leg(route.decode, request_id, prompt + sent, len(sent), prefill, on_counted=route.release)
        sources = [prefill]  # kept until the end: the prefill reply gives the usage and trace

        def finish(out, msg, decode: Worker) -> None:
            self._finish(out, msg, prefill.reply(msg), route, decode, len(prompt), len(sent), arrived)

        try:
            for handoffs in itertools.count(1):
                moving = yield from self._relay(leg, sent, sampling, deadline, on_done, finish, metadata, track)
                if moving is None:
                    return
                seed, source_call = moving
                if not sampling.HasField("seed"):
                    sampling.seed = seed  # the random stream goes on wherever the request goes
                leg = self._handoff_leg(leg, source_call, f"{request_id}~h{handoffs}", prompt, sent, seed, deadline)
                sources.append(leg.source)
        finally:
            for source in sources:
                source.cancel()

    def _relay(self, leg: "_Leg", sent: list[int], sampling, deadline, on_done, finish, metadata=(),
               track=lambda **progress: None):
        """Stream one decode worker's part of the request. Returns None once the request finished,
        or (seed, call) when the worker began handing it off; that call then stays open (it holds
        the request's KV there) until the handoff is over. `track` is told each step it makes."""
        self.pool.acquire(leg.worker)
        leg.on_counted(leg.worker)  # counted by this call now, not twice while it registers
        call, handing_off = None, False
        repeat = leg.resume_step < len(sent)  # after a handoff its first token is the last one sent
        where = f"decode worker {leg.worker.view.address}"
        track(stage=f"registering on {where}")
        try:
            call = leg.worker.stub.Decode(
                workers_pb2.DecodeRequest(request_id=leg.request_id, prompt_token_ids=leg.prompt,
                                          sampling=_left(sampling, leg.resume_step), resume_step=leg.resume_step,
                                          push_token=leg.source.push_token,
                                          prefill_here=isinstance(leg.source, LocalPrefill)),
                timeout=_until(deadline), metadata=metadata or None)
            registered = next(call)  # its KV will be accepted
            leg.source.start(on_give_up=call.cancel, held_tokens=registered.held_prefix_tokens)
            leg.on_counted()  # the KV source counts it on its prefill worker now
            on_done(lambda: (call.cancel(), leg.source.cancel()))
            track(stage=f"waiting for its first token from {where}", detail=leg.source.describe,
                  pulse=leg.source.pulse)
            for msg in call:
                if msg.moving:
                    handing_off = True
                    track(stage=f"{where} is draining: handing it off")
                    return msg.seed, call
                tokens, text, logprobs = list(msg.token_ids), msg.text_delta, list(msg.logprobs)
                if tokens:
                    leg.source.delivered()
                if repeat and tokens:
                    if tokens[0] != sent[-1]:
                        raise DispatchError(grpc.StatusCode.INTERNAL, f"request {leg.request_id} resumed on "
                                            f"{leg.worker.view.address} at token {tokens[0]}, not {sent[-1]}")
                    tokens, text, logprobs, repeat = tokens[1:], "", logprobs[1:], False  # its text went out before too
                sent.extend(tokens)
                track(stage=f"decoding on {where}", tokens=len(sent))
                out = router_pb2.GenerateResponse(request_id=leg.request_id, token_ids=tokens, text_delta=text,
                                                  finish_reason=msg.finish_reason, logprobs=logprobs)
                if msg.finish_reason:
                    # Done: a stream that breaks after its last message (a cut connection) must not
                    # send the finished request elsewhere, with no token left to ask for.
                    finish(out, msg, leg.worker)
                    yield out
                    return None
                if tokens or text:
                    yield out
            return None
        except grpc.RpcError as err:
            lost = leg.source.lost()
            if lost is not None:
                raise lost from None
            failure = leg.source.failure()
            if failure is None and err.code() in DECODE_LOST and call is not None:
                raise DecodeLost(self._cause(err), leg.source.seed(), leg.worker) from None
            raise self._cause(failure or err) from None
        finally:
            if call is not None and not handing_off:
                call.cancel()
            self.pool.release(leg.worker)

    def _handoff_leg(self, leg: "_Leg", source_call, request_id: str, prompt, sent: list[int], seed: int,
                     deadline) -> "_Leg":
        """The next part of a request whose decode worker (`leg.worker`) is draining: another decode
        worker, fed by the draining one pushing the KV of prompt + sent[:-1] to it."""
        others = [v for v in self.pool.views("decode") if v.address != leg.worker.view.address]
        try:
            if not sent:
                raise NoWorkers(f"{leg.worker.view.address} moved request {request_id} before its first token")
            target = self.pool.get("decode", self.picker.pick_decode(others, len(prompt) + len(sent)).address)
            if target is None:
                raise NoWorkers("the chosen decode worker just left")
        except NoWorkers as exc:
            source_call.cancel()  # frees the KV there
            raise DecodeLost(DispatchError(grpc.StatusCode.UNAVAILABLE, f"no handoff: {exc}"), seed,
                              leg.worker) from None
        log.info("decode worker %s is draining; handing request %s to %s after %d tokens", leg.worker.view.address,
                 leg.request_id, target.view.address, len(sent))
        source = Handoff(leg.worker, source_call, leg.request_id, target, request_id, seed, _until(deadline))
        return _Leg(target, request_id, prompt + sent[:-1], len(sent) - 1, source)

    def _finish(self, out, msg, reply, route: Route, decode: Worker, prompt_len: int, completion: int,
                arrived: float) -> None:
        with self._stats_lock:
            # The index predicts what a worker holds itself: KV read from the decode worker is not that.
            (self.local_stats if route.local else self.stats).record(route.predicted_cached_tokens,
                                                                     reply.cached_tokens - reply.pulled_tokens)
            if reply.pulled_tokens:
                self.stats.pulled_requests += 1
                self.stats.pulled_tokens += reply.pulled_tokens
        stages = dict(msg.stage_seconds)
        stages.update(route=route.seconds, queue=reply.queue_seconds, prefill=reply.prefill_seconds, transfer=reply.transfer_seconds,
                      total=time.monotonic() - arrived)
        out.usage.CopyFrom(common_pb2.Usage(prompt_tokens=prompt_len, completion_tokens=completion,
                                            cached_tokens=reply.cached_tokens))
        out.trace.CopyFrom(common_pb2.Trace(
            stage_seconds=stages, cached_tokens=reply.cached_tokens,
            predicted_cached_tokens=route.predicted_cached_tokens,
            prefill_worker=route.prefill.view.address if route.prefill else "", decode_worker=decode.view.address,
            route=route.reason + (f"; the prefill worker read the KV of {reply.pulled_tokens} prompt tokens it lacked from "
                                  f"decode worker {decode.view.address}" if reply.pulled_tokens else "")))

    _cause = staticmethod(cause)


MAX_ATTEMPTS = 3  # tries per request across workers
REVISIT_POLLS = 5  # load polls a request waits for a decode worker it lost to be counted healthy again
# The decode stream broke because its worker went away (not because of the request itself).
DECODE_LOST = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.INTERNAL, grpc.StatusCode.UNKNOWN)


DEFAULT_MAX_TOKENS = 256  # engine.sampling.SamplingParams' default, for requests that set none


def _left(sampling, done: int):
    """A copy of `sampling` for the rest of a request that already has `done` tokens."""
    rest = common_pb2.SamplingParams.FromString(sampling.SerializeToString())
    if done:
        rest.max_tokens = (sampling.max_tokens if sampling.HasField("max_tokens") else DEFAULT_MAX_TOKENS) - done
        rest.min_tokens = max(0, sampling.min_tokens - done)
    return rest


def _until(deadline: float | None) -> float | None:
    return None if deadline is None else max(0.001, deadline - time.monotonic())


@dataclass
class _Leg:
    """One decode worker's part of a request: a Decode call there, fed by one KV source."""

    worker: Worker
    request_id: str  # its id on that worker
    prompt: list[int]  # the tokens whose KV it gets
    resume_step: int  # tokens generated before; after a handoff, its first token is the last of them again
    source: "KVSource"
    on_counted: Callable[..., None] = lambda *workers: None  # told as its calls count the request on workers
