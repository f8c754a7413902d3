"""The prefill worker's compute loop: queue prompts and prefill them in batches.

Prefill calls wait on a bounded queue; one compute thread takes the next batch (highest priority
first, then prompts of similar length, bounded by tokens and count), runs it, samples each first
token, and hands each KV to the delivery (`KVDelivery`), whose threads push it to decode workers
while the next batch computes. A prompt with more uncached tokens than `prefill.chunk_tokens` is prefilled a chunk per
iteration instead (Sarathi's chunked prefill), each iteration running the queued prompts first:
a short prompt arriving behind a long one waits for one chunk, not for the whole prompt. While a
forward runs only batch members (below priority 0), interactive prompts that arrive do not wait
for it: between two of its layers the compute thread prefills them (a nested forward) and sends
their KV, then the members' forward goes on. What a finished job reports is a plain
`PrefillDone`; the servicer makes the reply.
"""
from __future__ import annotations

import contextlib
import logging
import queue
import threading
import time
from collections import deque
from concurrent.futures import Future

from baton.config import PrefillSettings, TLSSettings
from baton.metrics import Metrics

from baton.engine.request import RequestError
from baton.engine.executors import Runner
from baton.prefill_worker.batching import BACKGROUND_BATCH_TOKENS, URGENT_PRIORITY, PrefillQueue
from baton.prefill_worker.cache_events import CacheEventLog
from baton.prefill_worker.core import Chunked, PrefillCore
from baton.prefill_worker.delivery import KVDelivery
from baton.prefill_worker.jobs import PrefillJob
from baton.prefill_worker.kv_pull import KVPuller
from baton.prefill_worker.targets import DecodeTargets

log = logging.getLogger(__name__)


class PrefillLoop:
    """One compute thread owns the PrefillCore (prefix cache included); RPC threads reach it only
    through the job queue and the control queue (pin/unpin), which it serves between batches."""

    def __init__(self, runner: Runner, settings: PrefillSettings, tls: TLSSettings | None = None,
                 block_size: int = 16, metrics: Metrics | None = None, cluster_token: str | None = None,
                 decode_targets: DecodeTargets | None = None):
        self.runner = runner
        self.metrics = metrics or Metrics("prefill")
        self.core = PrefillCore(runner, prefix_cache_bytes=settings.prefix_cache_bytes, block_size=block_size,
                                max_pins=settings.max_pins, pin_ttl_s=settings.pin_ttl_s)
        self.settings = settings
        self.decode_targets = decode_targets or DecodeTargets(settings.decode_workers)
        # Members' forwards are short only where urgent prompts cannot pause them between layers.
        self.pausable = hasattr(runner, "between_layers")
        self.queue = PrefillQueue(settings.max_queue, settings.max_batch_tokens, settings.max_batch_size,
                                  background_tokens=None if self.pausable else BACKGROUND_BATCH_TOKENS)
        self.fingerprint = str(runner.loaded.fingerprint)
        # The prefix cache's changes, numbered; routers follow them (WatchCache). Its epoch is this
        # process's: a new one tells a router our cache began empty.
        self.cache_events = CacheEventLog()
        self.epoch = self.cache_events.epoch
        self.requests_done = 0
        self.delivery = KVDelivery(self.fingerprint, runner.loaded.kv_shape, settings, self.metrics, tls,
                                   cluster_token)
        self._kv_bytes_per_token = runner.loaded.kv_shape.bytes_per_token()
        # Reads a decode worker's KV of a prompt's earlier turns rather than computing it (kv_pull).
        self.puller = KVPuller(self.fingerprint, runner.loaded.kv_shape, settings.prefix_cache_bytes,
                               self.delivery.channel) if settings.pull_kv and self.core.cache is not None else None
        self._lock = threading.Lock()
        self._admitting = threading.Lock()  # a prompt is queued, or refused as draining, never both
        self._control: "queue.Queue[tuple]" = queue.Queue()
        self._stop = threading.Event()
        self.draining = threading.Event()
        self._inflight: set[Future] = set()  # taken from the queue, not yet pushed
        self._running: dict[str, PrefillJob] = {}  # the same jobs by request id, so a Cancel reaches them
        self._chunking: "deque[tuple[PrefillJob, Chunked]]" = deque()  # long prompts, a chunk per iteration
        self.chunks_done = 0
        self.iteration_tokens: deque[int] = deque(maxlen=4096)  # prompt tokens computed per iteration, latest last
        self.preemptions = 0  # background forwards paused for urgent prompts
        self._urgent_running = False  # the compute thread's: serving urgent prompts inside a paused forward
        self._thread = threading.Thread(target=self._run, name="prefill-loop", daemon=True)

    @property
    def running(self) -> int:
        """Prompts taken from the queue and not yet pushed."""
        return len(self._inflight)

    @property
    def chunking(self) -> int:
        """Long prompts part-way through their chunks."""
        return len(self._chunking)

    def start(self) -> "PrefillLoop":
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self.cache_events.close()
        for job in self.queue.close():  # queued after a drain, or a stop without one: another worker takes them
            job.end_stream("the prefill worker stopped")
            if not job.done.done():
                job.done.set_exception(ConnectionAbortedError("this prefill worker stopped"))
        if self._thread.ident is not None:  # a loop never started has nothing to join
            self._thread.join(timeout=10)
        self._refuse_control()
        while self._chunking and not self._thread.is_alive():
            job, _ = self._chunking.popleft()
            job.end_stream("the prefill worker stopped")
            job.done.set_exception(ConnectionAbortedError("this prefill worker stopped"))
        self.delivery.close()
        self.decode_targets.stop()

    def drain(self, timeout: float) -> bool:
        """Take no new prompts; finish (and push) the queued ones, up to timeout."""
        with self._admitting:  # a submit past its draining check has queued its prompt by now
            self.draining.set()
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if not len(self.queue) and not self._inflight:
                return True
            time.sleep(0.1)
        return False

    def submit(self, job: PrefillJob) -> Future:
        try:
            return self._queue(job)
        except BaseException:
            self._drop_pulled(job)  # refused: nothing will adopt what was read for it
            raise

    def _queue(self, job: PrefillJob) -> Future:
        with self._admitting:
            if self.draining.is_set():
                raise ConnectionAbortedError("this prefill worker is draining; send the prompt elsewhere")
            if len(self.queue) + len(self._inflight) >= self.settings.max_queue:
                # Prompts being prefilled or pushed count too: each holds its Prefill call's thread.
                raise OverflowError(f"{self.settings.max_queue} prompts are already queued or being prefilled "
                                    "here; retry later")
            job.request.trace.mark("arrived")
            # Raises OverflowError when full; higher priorities (interactive requests) prefill first.
            self.queue.put(job, len(job.request.prompt_token_ids), job.request.params.priority)
        if self.puller is not None:
            job.done.add_done_callback(self._measure)
        return job.done

    def pull_held(self, job: PrefillJob, timeout_s: float | None) -> None:
        """Before `submit` (the RPC thread): read the KV the job's decode worker holds of its prompt
        (its first kv_skip_tokens tokens) when this worker's cache lacks it and reading is measured
        faster than computing; the compute thread adopts it into the cache when the job's turn comes."""
        puller = self.puller
        if puller is None or not job.kv_skip_tokens or self.draining.is_set():
            return
        prompt, b = job.request.prompt_token_ids, self.core.block_size
        wanted = min(job.kv_skip_tokens, len(prompt) - 1) // b * b  # whole blocks: what the cache can take
        here = self.core.cached_tokens(prompt[:wanted])
        if not puller.rates.worth_pulling(wanted - here, b):
            return
        request_id = job.request.request_id
        kv = puller.pull(job.decode_target, request_id, job.push_token, wanted, timeout_s)
        if kv is not None:
            job.pulled = kv
            job.done.add_done_callback(lambda _: self._drop_pulled(job))  # cancelled while queued

    def _measure(self, done: Future) -> None:
        """A prefill's seconds per computed token, against which reads are weighed."""
        if not done.cancelled() and done.exception() is None:
            result = done.result()
            self.puller.rates.computed(result.computed_tokens, result.prefill_seconds)

    def _adopt(self, job: PrefillJob) -> None:
        """The compute thread: KV read from the job's decode worker joins the prefix cache."""
        if job.pulled is not None:
            job.pulled_tokens = self.core.adopt(job.request.prompt_token_ids, job.pulled)
            self._drop_pulled(job)

    def _drop_pulled(self, job: PrefillJob) -> None:
        if job.pulled is not None:
            job.pulled = None
            self.puller.release(job.request.request_id)

    def cancel(self, request_id: str, job: PrefillJob | None = None) -> bool:
        """Drop a queued job; one already taken stops at its next chunk or before its push."""
        queued = self.queue.remove(request_id, job)
        if queued is not None:
            queued.cancelled = True
            queued.done.cancel()
            return True
        with self._lock:
            running = self._running.get(request_id)
        if running is not None and (job is None or running is job):
            running.cancelled = True
            return True
        return False

    def call(self, fn, *args, timeout: float | None = None):
        """Run fn(core, *args) on the compute thread, between batches; returns its result.
        ConnectionAbortedError once the loop has stopped (a drained worker's last pin calls)."""
        done: Future = Future()
        self._control.put((fn, args, done))
        if self._stop.is_set():  # the loop may have ended before it saw this call
            self._refuse_control()
        return done.result(timeout=timeout)

    def _pending_control(self):
        """The control calls waiting now, taken one by one."""
        while True:
            try:
                yield self._control.get_nowait()
            except queue.Empty:
                return

    def _refuse_control(self) -> None:
        for _, _, done in self._pending_control():
            done.set_exception(ConnectionAbortedError("this prefill worker stopped"))

    def _serve_control(self) -> None:
        for fn, args, done in self._pending_control():
            try:
                result = fn(self.core, *args)
                self._publish_cache_changes()
                done.set_result(result)
            except Exception as exc:
                self._publish_cache_changes()
                done.set_exception(exc)

    def _publish_cache_changes(self) -> None:
        """Send the prefix cache's changes since the last call to the routers following them."""
        events = self.core.drain_events()
        self.cache_events.publish(events.stored, events.evicted)

    def _run(self) -> None:
        while not self._stop.is_set():
            forwarded = self.runner.prompt_tokens_forwarded
            self._iterate()
            computed = self.runner.prompt_tokens_forwarded - forwarded
            if computed:  # the token batch this iteration ran (urgent prompts it let in included)
                self.iteration_tokens.append(computed)
                self.metrics.iteration_tokens.observe(computed)

    def _iterate(self) -> None:
        """One iteration: control calls, then a batch of whole prompts within the memory threshold
        and the token budget, and one chunk of a long prompt."""
        self._serve_control()
        if self.core.pins:
            for group_id in self.core.expire_pins():
                log.warning("pin of group %s expired after prefill.pin_ttl_s=%ss without an unpin", group_id,
                            self.core.pin_ttl_s)
        room, held = self._kv_room()
        if held and room is not None and room <= 0:
            self.delivery.wait_for_a_push(0 if self._chunking else 0.05)  # the memory threshold: pushes free it
        else:
            self._run_jobs(self.queue.take_batch(timeout=0 if self._chunking else 0.05, key=self._new_prefix,
                                                 busy=self._prefixes_in_chunks(), max_tokens=room,
                                                 at_least_one=not held))
        if self._chunking:
            self._next_chunk()
        self._publish_cache_changes()  # whatever changed it (a failed forward, an expired pin)

    def _kv_room(self) -> tuple[int | None, int]:
        """(prompt tokens the next batch may prefill within prefill.kv_memory_bytes, None without
        a limit; KV bytes held now): BatchLLM's M_threshold over the KV prefilled and not yet
        pushed plus the chunked prompts' KV (each allocated for its whole prompt, and what a
        tensor-parallel rank keeps of its heads). With nothing held, a lone prompt always goes."""
        held = self.unpushed_kv_bytes + sum(c.held_bytes for _, c in self._chunking) + self.core.kept_chunk_bytes
        limit = self.settings.kv_memory_bytes
        return (None if not limit else (limit - held) // self._kv_bytes_per_token), held

    @property
    def unpushed_kv_bytes(self) -> int:
        """KV prefilled here and not yet pushed (or given up)."""
        return self.delivery.unpushed_bytes

    def _new_prefix(self, job: PrefillJob) -> int | None:
        # Compute thread only (the cache is not thread-safe): take_batch runs here.
        return self.core.first_new_block(job.request.prompt_token_ids)

    def _prefixes_in_chunks(self) -> set[int]:
        """The first new block of every prompt being prefilled in chunks: its blocks are not cached
        yet, so a prompt sharing it waits rather than compute it too."""
        return {job.new_prefix for job, _ in self._chunking if job.new_prefix is not None}

    def _run_jobs(self, jobs: list[PrefillJob]) -> None:
        """Prefill what take_batch gave: long prompts join the chunked ones, the rest run now."""
        jobs = [j for j in jobs if not j.cancelled and j.done.set_running_or_notify_cancel()]
        for job in jobs:
            self._track(job)
            self._adopt(job)
        whole = [j for j in jobs if not self._chunk(j)]
        if whole:
            try:
                with self._preemptible(whole):
                    self._prefill(whole)
            except Exception as exc:  # one bad batch must not take the worker down
                log.exception("prefill batch failed")
                for job in whole:
                    if not job.sent and not job.done.done():  # a prompt already sent stays sent
                        job.done.set_exception(exc)

    @contextlib.contextmanager
    def _preemptible(self, jobs: list[PrefillJob]):
        """While a forward of batch members only runs, urgent prompts may pause it between layers."""
        background = all(j.request.params.priority < URGENT_PRIORITY for j in jobs)
        if not self.pausable or not background or self._urgent_running:
            yield  # the transformers fallback cannot pause: its batch members take short forwards
            return
        self.runner.between_layers = self._serve_urgent
        try:
            yield
        finally:
            self.runner.between_layers = None

    def _serve_urgent(self) -> None:
        """Between two layers of a background forward: prefill the urgent prompts queued now (a
        nested forward on this thread; long ones join the chunked prompts instead)."""
        if self._urgent_running:
            return
        jobs = self.queue.take_batch(timeout=0, min_priority=URGENT_PRIORITY, key=self._new_prefix,
                                     busy=self._prefixes_in_chunks())
        if not jobs:
            return
        self._urgent_running = True
        self.preemptions += 1
        self.metrics.paused_forwards.inc()
        try:
            self._run_jobs(jobs)
        except Exception as exc:  # never into the paused forward: it belongs to other requests
            log.exception("urgent prefill failed")
            for job in jobs:
                if not job.done.done():
                    job.done.set_exception(exc)
        finally:
            self._urgent_running = False

    def _track(self, job: PrefillJob) -> None:
        request_id = job.request.request_id
        with self._lock:
            self._running[request_id] = job
        self._inflight.add(job.done)

        def forget(done: Future) -> None:
            self._inflight.discard(done)
            with self._lock:
                if self._running.get(request_id) is job:
                    del self._running[request_id]
        job.done.add_done_callback(forget)

    def _budget(self, job: PrefillJob) -> int:
        """Tokens per chunk: where forwards cannot pause, batch members (below priority 0) take the
        short forwards they take unchunked, so an interactive prompt never waits long behind them."""
        budget = self.settings.chunk_tokens
        return min(budget, BACKGROUND_BATCH_TOKENS) if job.request.params.priority < 0 and not self.pausable else budget

    def _chunk(self, job: PrefillJob) -> bool:
        """Queue `job` for chunked prefill if its uncached part is longer than one chunk."""
        prompt, budget = job.request.prompt_token_ids, self._budget(job)
        if not budget or len(prompt) <= budget:  # no chunks, or too short to need them: no hashing
            return False
        plan = self.core.reuse_for(prompt)
        if len(prompt) - plan.tokens <= budget:
            return False
        job.new_prefix = self._new_prefix(job)
        chunked = self.core.begin_chunks(job.request, plan)
        self._chunking.append((job, chunked))
        stream = self.delivery.open_stream(job, len(prompt) - job.kv_skip_tokens)
        if stream is not None and chunked.kv is not None:  # the cached prefix goes at once
            stream.put(chunked.kv, chunked.done)
        return True

    def _next_chunk(self) -> None:
        """One chunk of the highest-priority (then oldest) chunked prompt; after its last chunk,
        its KV is pushed."""
        pick = max(range(len(self._chunking)), key=lambda i: (self._chunking[i][0].request.params.priority, -i))
        job, chunked = self._chunking[pick]
        if job.cancelled:
            del self._chunking[pick]
            self.core.end_chunks(chunked)
            job.end_stream("cancelled")
            job.done.set_exception(RequestError("cancelled"))
            return
        try:
            with self._preemptible([job]):
                prefilled = self.core.advance(chunked, self._budget(job))
        except Exception as exc:  # this prompt alone fails
            log.exception("chunked prefill of request %s failed", job.request.request_id)
            del self._chunking[pick]
            self.core.end_chunks(chunked)
            job.end_stream("its prefill failed")
            job.done.set_exception(exc)
            return
        self.chunks_done += 1
        if prefilled is None:
            job.new_prefix = self._new_prefix(job)  # its blocks so far are cached now
            if job.stream is not None:
                job.stream.put(chunked.kv, chunked.done)
        else:
            if job.stream is not None:  # the rest, without joining the whole KV first
                job.stream.put(prefilled.whole_kv(job.stream.sent), chunked.done, start=job.stream.sent)
            del self._chunking[pick]
            self._publish_cache_changes()
            self.delivery.submit(job, prefilled)
            self.requests_done += 1

    def _prefill(self, jobs: list[PrefillJob]) -> None:
        def finished(i: int, done) -> None:  # each prompt's KV leaves as soon as its first token is known
            self._publish_cache_changes()  # before its push: routers learn of the new blocks at once
            self.delivery.submit(jobs[i], done)

        self.core.prefill([j.request for j in jobs], on_finished=finished)
        self.requests_done += len(jobs)
