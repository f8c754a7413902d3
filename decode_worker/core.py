"""The decode worker without networking: staged KV in, one BATON iteration per `step`, outputs out.

Single-threaded by design: the transport layer feeds `add`/`abort` from its own threads only
through a queue drained by the loop that calls `step`.
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field, replace
from typing import Callable

import torch

from baton.logs import STARTUP_LOGGER
from baton.resources import Amount
from baton.sizing import decode_rows, local_chunk_tokens, moving_mean

from baton.decode_worker.host_retained import HostRetained
from baton.decode_worker.scheduler import DecodeScheduler, DecodeSequence, KVListener, SchedulerConfig, Status
from baton.engine.kv import SequenceKV, joined, to_host
from baton.engine.paged_kv import DecodeStep, PagedKV, default_kv_budget
from baton.engine.request import GenerationRequest, PrefilledRequest, RequestError, RequestOutput, effective_max_tokens
from baton.engine.executors import Runner
from baton.engine.sampling import (INVALID_TOKEN, RequestSampler, SamplingParams, ending_ids, first_token, sample,
                                   token_logprobs)
from baton.engine.stopping import FinishReason, StopChecker
from baton.sampling import TokenLogprob

log = logging.getLogger(__name__)
started_log = logging.getLogger(STARTUP_LOGGER)


@dataclass(frozen=True)
class DecodeConfig:
    # A cap: how many rows run is what kv_budget_bytes allows. 0: sized from the device, the
    # threads and the KV budget (baton.sizing.decode_rows).
    max_rows: int = 8
    # The paged decode KV, allocated once (engine.paged_kv); 0: derived from the device's free
    # memory. Rows join while what they hold (plus a growth reserve) fits; when pages run out,
    # the latest lowest-priority row is parked in the host pool.
    kv_budget_bytes: int = 0
    page_size: int = 8  # tokens a KV page holds (docs/bench.md: 8 wastes half of 16, at the same step time)
    growth_reserve_tokens: int = 32  # room a joining row must find beyond its KV
    # Used-KV watermarks: above high, rows are parked on the host; new rows are admitted only
    # while the used pages stay at or below low. 0 turns them off (pages running out still parks).
    high_watermark_bytes: int = 0
    low_watermark_bytes: int = 0
    # Requests registered whose KV has not landed (0: unbounded, as in-process engines want); a
    # worker also refuses beyond max_waiting + max_rows requests in all.
    max_waiting: int = 0
    # Rows whose prompts begin with at least this many equal tokens share those full pages; 0
    # turns sharing off.
    share_min_tokens: int = 64
    # A finished request's pages stay (its prompt's and answer's KV) until pages are needed: the
    # next turn of a conversation finds them. Needs sharing (share_min_tokens > 0).
    retain: bool = True
    # Prompts computed here (conditional disaggregation) run a chunk between decode steps: at most
    # this many tokens, and while rows decode, what takes about one step (baton.sizing).
    local_chunk_tokens: int = 128

    def __post_init__(self):
        if self.max_rows < 0:
            raise ValueError(f"max_rows must be >= 0 (got {self.max_rows}; 0 sizes it from the device)")
        if self.kv_budget_bytes < 0:
            raise ValueError(f"kv_budget_bytes must be >= 0 (got {self.kv_budget_bytes}; 0 derives it from the "
                             "device's memory)")
        if self.page_size < 1 or self.growth_reserve_tokens < 0:
            raise ValueError(f"page_size must be >= 1 and growth_reserve_tokens >= 0 (got {self.page_size}, "
                             f"{self.growth_reserve_tokens})")
        if self.max_waiting < 0:
            raise ValueError(f"max_waiting must be >= 0 (got {self.max_waiting})")
        if self.share_min_tokens < 0:
            raise ValueError(f"share_min_tokens must be >= 0 (got {self.share_min_tokens}; 0 turns sharing off)")
        if self.local_chunk_tokens < 1:
            raise ValueError(f"local_chunk_tokens must be >= 1 (got {self.local_chunk_tokens})")


@dataclass
class _Live:
    """What the core keeps for one request (its `DecodeSequence.engine`) from registration to end."""

    request: GenerationRequest
    sampler: RequestSampler | None = None  # from the moment its KV lands
    checker: StopChecker | None = None
    # Staged: the prefill's KV (staging bytes, released once embedded); parked: the row's KV in
    # host memory; moving: the KV to hand off. None while in a row.
    kv: SequenceKV | None = None
    kv_start: int = 0  # the first token `kv` holds (the prefill sends none of the held shared pages)
    logprobs: list[TokenLogprob] = field(default_factory=list)  # one per generated token, if asked for
    evicted: "Evicted | None" = None  # while moving
    computing: "_Computing | None" = None  # its prompt's rest being prefilled here
    host_prefix: tuple[int, SequenceKV] | None = None  # a local prefill's start found in host memory


@dataclass
class _Computing:
    """A prompt prefilled here on top of the KV this worker holds: `buffer` has the KV of its first
    `done` tokens (held pages and a retained tail, copied; then each chunk run)."""

    buffer: torch.Tensor  # [layers, 2, kv heads, prompt tokens, head dim], host
    held: int  # tokens of held pages: the KV written into the row starts there
    done: int
    cached: int  # tokens whose KV was found here (held pages and the tail)


@dataclass
class Evicted:
    """A request taken out of a core unfinished, to go on elsewhere. Its KV (host memory) covers
    the prompt and every generated token but the last, which is its next input: exactly what a
    decode worker embeds for a prompt of `prompt_token_ids + token_ids[:-1]` whose prefill sampled
    `token_ids[-1]` at step `len(token_ids) - 1` of the random stream of `seed`."""

    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int]  # generated so far, at least one
    kv: SequenceKV
    seed: int
    last_logprob: TokenLogprob | None = None  # token_ids[-1]'s, if asked for (its next worker repeats it)


_STATUS = {FinishReason.STOP: Status.FINISHED_STOPPED, FinishReason.LENGTH: Status.FINISHED_LENGTH}


class DecodeCore:
    """One decode batch and the scheduler that owns its requests' lives. Registering, landing and
    staging a request (none of which touches the batch) and lookups may come from any thread;
    everything else is the decode loop's."""

    def __init__(self, runner: Runner, config: DecodeConfig = DecodeConfig(),
                 on_kv_consumed: Callable[[str], None] | None = None, listener: KVListener | None = None):
        self.runner = runner
        self.config = config
        # Told when a request's staged KV is no longer needed (embedded or dropped), so the
        # staging pool can take its bytes back.
        self.on_kv_consumed = on_kv_consumed or (lambda request_id: None)
        # A parked row's KV lives in the same host pool, inside the same byte bound: hold_parked
        # claims its bytes (False: no room, the row is not parked), release_parked returns them.
        self.hold_parked: Callable[[str, int], bool] = lambda request_id, nbytes: True
        self.release_parked: Callable[[str], None] = lambda request_id: None
        # A retained entry whose pages were needed moves to host memory if the host pool lends it
        # room (False: none; it is forgotten), room the pool takes back when it needs it
        # (`host_taken_back`); release_parked returns it.
        self.hold_retained: Callable[[str, int], bool] = lambda key, nbytes: False
        self.host = HostRetained()
        loaded = runner.loaded
        shape = loaded.kv_shape
        per_token = shape.bytes_per_token()
        if config.kv_budget_bytes:
            self.kv_budget_bytes, how = config.kv_budget_bytes, "decode.kv_budget_bytes"
        else:
            chosen = default_kv_budget(loaded.device)
            self.kv_budget_bytes, how = chosen.value, chosen.source
        started_log.info("KV budget %d bytes (%s): %d tokens of %d bytes", self.kv_budget_bytes, how,
                         self.kv_budget_bytes // per_token, per_token,
                         extra={"setting": "kv_budget_bytes", "value": self.kv_budget_bytes, "chosen_by": how})
        if hasattr(runner, "paged_kv"):  # tensor-parallel: every rank holds its heads of each page
            self.kv = runner.paged_kv(shape, self.kv_budget_bytes, config.page_size)
        else:
            self.kv = PagedKV.within(shape, self.kv_budget_bytes, config.page_size, device=loaded.device)
        rows = decode_rows(config.max_rows, loaded.device.type, torch.get_num_threads(),
                           (self.kv.num_pages - 1) * config.page_size)
        if not config.max_rows:
            started_log.info("decode rows %d (%s)", rows.value, rows.source,
                             extra={"setting": "max_rows", "value": rows.value, "chosen_by": rows.source})
        config = self.config = replace(config, max_rows=rows.value)
        # what this worker chose at start, and how: its /metrics and the router's GetModelInfo show them
        self.chosen = {"kv_budget_bytes": Amount(self.kv_budget_bytes, how), "max_rows": rows}
        page_bytes = self.kv.page_bytes
        self.scheduler = DecodeScheduler(SchedulerConfig(
            config.max_rows, self.kv.num_pages, config.page_size,
            # one row may take every page: a long request runs alone, short ones many at a time
            max_row_tokens=min(loaded.max_context - 1, (self.kv.num_pages - 1) * config.page_size),
            growth_reserve_tokens=config.growth_reserve_tokens,
            high_watermark_pages=config.high_watermark_bytes // page_bytes,
            low_watermark_pages=config.low_watermark_bytes // page_bytes, max_waiting=config.max_waiting,
            max_requests=config.max_waiting + config.max_rows if config.max_waiting else 0,
            share_min_tokens=config.share_min_tokens, retain=config.retain and config.share_min_tokens > 0),
            can_park=lambda seq: self.hold_parked(seq.request_id, seq.num_kv_tokens * per_token), listener=listener)
        self.computing: list[DecodeSequence] = []  # prompts prefilled here, first come first served (loop thread)
        self.local_prefills_total = 0
        self.local_tokens_total = 0  # prompt tokens computed here
        self.local_cached_tokens_total = 0  # and found here (held pages, retained tails)
        # Measured, to size local prefill chunks: a decode step's seconds, a prefilled token's.
        self.step_s: float | None = None
        self.local_token_s: float | None = None
        self.recomputed_total = 0  # rows whose KV was computed again (dropped when the host pool was full)

    @property
    def finished_total(self) -> int:
        return self.scheduler.finished_total

    def parked_bytes(self) -> int:
        """Host bytes of parked rows' KV (any thread: a row the loop is parking right now counts
        once its KV is out of the batch)."""
        return sum(kv.nbytes for seq in list(self.scheduler.staged)
                   if seq.status is Status.PARKED and (kv := seq.engine.kv) is not None)

    @property
    def max_row_tokens(self) -> int:
        """KV tokens one request may hold here."""
        return self.scheduler.max_row_tokens

    @property
    def max_context(self) -> int:
        """Prompt plus generated tokens one request may reach here: the model's context, or less when
        the KV budget buys fewer tokens (the last token's KV is never stored). max_tokens beyond it
        is cut, as at the model's own context."""
        return min(self.runner.loaded.max_context, self.max_row_tokens + 1)

    def check_fits(self, prompt_len: int, params: SamplingParams) -> None:
        """Refuse early a prompt that leaves no room here for even one new token."""
        if prompt_len >= self.max_context:
            raise RequestError(
                f"the prompt has {prompt_len} tokens but this deployment serves a context of {self.max_context} "
                f"tokens (prompt plus output); shorten it to at most {self.max_context - 1} tokens")

    def register(self, request: GenerationRequest, local: bool = False) -> None:
        """Expect `request`, whose KV is on its way (any thread); `local`: its KV is computed here
        instead, on top of what this worker holds of its prompt (`compute`). RequestError or
        ValueError if it cannot be served here, OverflowError while this worker is full."""
        prompt_len = len(request.prompt_token_ids)
        self.check_fits(prompt_len, request.params)
        seq = DecodeSequence(request.request_id, prompt_len,
                             effective_max_tokens(prompt_len, request.params, self.max_context), [],
                             priority=request.params.priority, engine=_Live(request),
                             prompt_ids=request.prompt_token_ids, local=local)
        self.scheduler.register(seq)
        if local:
            found = self.host.find(request.prompt_token_ids, prompt_len - 1)
            here = seq.held_tokens + (seq.tail[1] if seq.tail else 0)
            if found is not None and found[0] > here:
                seq.engine.host_prefix = found

    # -- retained KV in host memory -------------------------------------------------------------

    def host_taken_back(self, key: str) -> None:
        """The host pool took a retained entry's room back (any thread): it is gone."""
        if self.host.pop(key):
            self.scheduler.forget(key)

    def release_retained(self) -> int:
        """Forget every retained entry, on the device and on the host (a draining worker)."""
        dropped = self.scheduler.release_retained()
        for key in self.host.keys():
            if self.host.pop(key):
                self.release_parked(key)
                self.scheduler.forget(key)
                dropped += 1
        return dropped

    # -- conditional disaggregation: a prompt's short rest prefilled here ----------------------

    def compute(self, request_id: str) -> None:
        """Start prefilling a request registered `local` (the loop thread): the KV this worker holds
        of its prompt is copied out now, then `advance_local` runs a chunk per step."""
        seq = self.scheduler.find(request_id)
        if seq is None or not seq.local or seq.status is not Status.WAITING or seq.engine.computing is not None:
            return  # cancelled meanwhile
        live: _Live = seq.engine
        prompt = live.request.prompt_token_ids
        shape = self.runner.loaded.kv_shape
        buffer = torch.empty(shape.num_layers, 2, shape.num_kv_heads, len(prompt), shape.head_dim,
                             dtype=shape.dtype, device=self.runner.device)
        held = seq.held_tokens
        done = held
        if held:
            buffer[:, :, :, :held].copy_(self.kv.read(self.scheduler.pages.page_table(request_id), held).data)
        if live.host_prefix is not None:  # more of it in host memory than in pages
            done, kv = live.host_prefix
            buffer[:, :, :, held:done].copy_(kv.data[:, :, :, held:done])
            live.host_prefix = None
        elif seq.tail is not None:
            page, count = seq.tail
            buffer[:, :, :, held:held + count].copy_(self.kv.read([page], count).data)
            done += count
        if seq.tail is not None:
            self.scheduler.untail(seq)
        live.computing = _Computing(buffer, held, done, done)
        live.request.trace.mark("prefill_start")
        self.computing.append(seq)

    def advance_local(self) -> list[RequestOutput]:
        """One chunk of the oldest prompt being prefilled here; its first output once it is done."""
        while self.computing and self.computing[0].status is not Status.WAITING:
            self.computing.pop(0)  # cancelled
        if not self.computing:
            return []
        seq = self.computing[0]
        live: _Live = seq.engine
        work, request = live.computing, live.request
        prompt = request.prompt_token_ids
        chunk = local_chunk_tokens(self.config.local_chunk_tokens, self.scheduler.num_running, self.step_s,
                                   self.local_token_s)
        end = min(len(prompt), work.done + chunk)
        prefix = SequenceKV(work.buffer[:, :, :, :work.done]) if work.done else None
        started = time.perf_counter()
        out = self.runner.prefill_batch([prompt[:end]], prefix)[0]
        work.buffer[:, :, :, work.done:end].copy_(joined(out.prefix, out.own, work.done).data)
        if work.buffer.is_cuda:
            torch.cuda.synchronize(work.buffer.device)  # its time, not its launch's
        self.local_token_s = moving_mean(self.local_token_s, (time.perf_counter() - started) / (end - work.done))
        self.local_tokens_total += end - work.done
        work.done = end
        if end < len(prompt):
            return []
        self.computing.pop(0)
        live.computing = None
        self.local_prefills_total += 1
        self.local_cached_tokens_total += work.cached
        request.trace.cached_tokens = work.cached
        request.trace.mark("prefill_end")
        token, logprob, seed = first_token(request, out.logits, self.runner.loaded)
        prefilled = PrefilledRequest(request, SequenceKV(work.buffer[:, :, :, work.held:]), token, seed, work.cached,
                                     logprob)
        output = self.land(prefilled)
        if not output.finished:
            self.stage(seq.request_id)
        return [output]

    def waiting(self, request_id: str) -> GenerationRequest | None:
        """The registered request still waiting for its KV, if any (any thread)."""
        seq = self.scheduler.find(request_id)
        return seq.engine.request if seq is not None and seq.status is Status.WAITING else None

    def add(self, prefilled: PrefilledRequest) -> RequestOutput:
        """Its KV landed (registering the request first if nobody did): `land`, then `stage` unless
        the first token was enough. Returns its first output."""
        if self.scheduler.find(prefilled.request.request_id) is None:
            self.register(prefilled.request)
        first = self.land(prefilled)
        if not first.finished:
            self.stage(prefilled.request.request_id)
        return first

    def land(self, prefilled: PrefilledRequest) -> RequestOutput:
        """Take a registered request's KV and first token; returns its first output, final if one
        token was enough. The caller sends that output, then `stage`s the request: a step cannot
        decode its second token before the first is out. LookupError if the request is not (or no
        longer) here: a cancel may race with its landing."""
        req = prefilled.request
        seq = self.scheduler.find(req.request_id)
        if seq is None:
            raise LookupError(f"request {req.request_id!r} is not registered here")
        if seq.status is not Status.WAITING or seq.engine.request is not req or seq.output_ids:
            raise RequestError(f"request id {req.request_id!r} is already being decoded here")
        loaded = self.runner.loaded
        live: _Live = seq.engine
        live.checker = StopChecker(req.params, loaded.decode, eos_token_ids=loaded.eos_token_ids,
                                   prompt_ids=req.prompt_token_ids, max_model_len=self.max_context)
        step = live.checker.append(prefilled.first_token)
        req.trace.mark("staged")
        seq.output_ids.append(prefilled.first_token)
        # Continue the random stream the prefill's first draw started.
        live.sampler = RequestSampler.for_request(req.params, req.prompt_token_ids, req.resume_step,
                                                  ending_ids(req.params, loaded.eos_token_ids), seed=prefilled.seed,
                                                  drawn=[prefilled.first_token],
                                                  grammars=loaded.grammars if req.params.guide else None)
        live.kv = prefilled.whole_kv()
        live.kv_start = seq.num_kv_tokens - live.kv.num_tokens  # the held shared pages' tokens
        if prefilled.first_logprob is not None:
            live.logprobs.append(prefilled.first_logprob)
        if step.finish_reason is not None:
            req.trace.mark("admitted")
            req.trace.mark("finished")
            self._finish(seq, _STATUS[step.finish_reason])
            return self._output(live, step.text_delta, step.finish_reason.value)
        return self._output(live, step.text_delta, None)

    def stage(self, request_id: str) -> None:
        """Queue a landed request for a row. ValueError if it ended meanwhile (cancelled)."""
        seq = self.scheduler.find(request_id)
        if seq is None or not seq.output_ids:
            raise ValueError(f"request {request_id!r} is not landed here (cancelled meanwhile?)")
        self.scheduler.add_staged(seq)

    def abort(self, request_id: str) -> RequestOutput | None:
        """Cancel a request wherever it is; its row and KV are freed at once."""
        seq = self.scheduler.find(request_id)
        if seq is None:
            return None
        try:
            self._finish(seq, Status.FINISHED_ABORTED)
        except LookupError:  # a handoff took it meanwhile
            return None
        return self._output(seq.engine, "", "abort")

    def evict(self, request_id: str) -> Evicted | None:
        """Take a request out of the batch unfinished, wherever it is (running, parked or staged),
        with its KV, so that it can go on on another worker: it stays here MOVING, holding that KV,
        until `scheduler.take_moving` hands it off (or `abort` drops it). Its row and staging bytes
        are freed; it does not count as finished."""
        seq = self.scheduler.find(request_id)
        if seq is None or seq.status not in (Status.STAGED, Status.PARKED, Status.RUNNING):
            return None
        live: _Live = seq.engine
        was = seq.status
        kv = self._whole_kv(seq)
        assert kv.num_tokens == seq.num_kv_tokens, f"{kv.num_tokens} KV tokens for {seq.num_kv_tokens}"
        self.scheduler.move(seq)
        self._drop_kv(seq, was)
        live.evicted = Evicted(request_id, list(live.request.prompt_token_ids), list(seq.output_ids), kv,
                               live.sampler.seed, live.logprobs[-1] if live.logprobs else None)
        return live.evicted

    def has_work(self) -> bool:
        return self.scheduler.has_work() or bool(self.computing)

    def step(self) -> list[RequestOutput]:
        """One BATON iteration: park rows and write admitted rows' KV into their pages, decode every
        row once, free finished rows' pages."""
        plan = self.scheduler.schedule()
        for parked in plan.parked:  # read before any write: their pages may be an admitted row's now
            parked.seq.engine.kv = self.kv.read(parked.table, parked.tokens)
            parked.seq.engine.kv_start = 0
        for unheld in plan.unheld:  # the held pages' KV goes in front of the staged KV
            live = unheld.seq.engine
            if live.kv_start:
                front = self.kv.read(unheld.table, live.kv_start)
                live.kv, live.kv_start = SequenceKV(torch.cat([front.data, to_host(live.kv.data)], dim=3)), 0
        for seq in plan.dropped:  # the host pool was full: computed again when it resumes
            seq.engine.kv = None
        for demoted in plan.demoted:  # read before any write too
            self._demote(demoted)
        for admitted in plan.admitted:
            seq, live = admitted.seq, admitted.seq.engine
            first = seq not in plan.resumed
            if first:
                live.request.trace.mark("admit_start")
            had_host_kv = not first and not seq.recompute  # a parked row's: its host bytes go back once written
            if seq.recompute:
                live.kv, live.kv_start, seq.recompute = self._recompute(seq), 0, False
            skip = admitted.shared_tokens - live.kv_start  # tokens the shared pages hold already
            if skip < live.kv.num_tokens:
                own = live.kv if skip == 0 else SequenceKV(live.kv.data[:, :, :, skip:])
                self.kv.write(admitted.table, own, start=admitted.shared_tokens)
            live.kv = None
            if first:  # the prefill's KV: its staging bytes go back
                self.on_kv_consumed(seq.request_id)
                live.request.trace.mark("admitted")
            elif had_host_kv:
                self.release_parked(seq.request_id)
        if not plan.running:
            return []
        started = time.perf_counter()
        logits = self.runner.decode(self.kv, DecodeStep(plan.tables, plan.lengths), [s.next_input for s in plan.running])
        lives: list[_Live] = [s.engine for s in plan.running]
        tokens = sample(logits, [live.sampler for live in lives])  # on the host: the step is done
        self.step_s = moving_mean(self.step_s, time.perf_counter() - started)
        logprobs = token_logprobs(logits, tokens, [live.sampler.params for live in lives])
        self.scheduler.append_tokens(tokens)
        outputs = []
        for seq, live, token, logprob in zip(plan.running, lives, tokens, logprobs):
            if logprob is not None:
                live.logprobs.append(logprob)
            if token == INVALID_TOKEN:  # this request's logits went non-finite: it alone ends
                live.request.trace.mark("finished")
                self._finish(seq, Status.FINISHED_ABORTED)
                outputs.append(self._output(live, "", "abort"))
                continue
            step = live.checker.append(token)
            reason = step.finish_reason
            if reason is not None:
                live.request.trace.mark("finished")
                self._finish(seq, _STATUS[reason])
            outputs.append(self._output(live, step.text_delta, reason.value if reason else None))
        return outputs

    def _demote(self, demoted) -> None:
        """A retained entry's pages were needed: its KV to host memory if the host pool lends room."""
        kv = self.kv.read(demoted.table, len(demoted.tokens))
        if self.hold_retained(demoted.key, kv.nbytes):
            self.host.add(demoted.key, demoted.tokens, kv)
        else:
            self.scheduler.forget(demoted.key)

    def held_tokens(self, request_id: str) -> int:
        """Leading prompt tokens of a registered request whose KV this worker holds (shared pages,
        kept for it): its prefill need push only the KV after them."""
        return self.scheduler.held_tokens(request_id)

    def held_kv(self, request_id: str, num_tokens: int) -> SequenceKV:
        """A host copy of the KV of a waiting request's first `num_tokens` prompt tokens, from the
        pages held for it (the loop thread: a tensor-parallel read is a collective), for the
        prefill worker that computes the rest (it reads rather than recomputes them). LookupError:
        no such request waits for KV here; ValueError: it holds fewer tokens."""
        seq = self.scheduler.find(request_id)
        if seq is None or seq.status is not Status.WAITING or seq.local:
            raise LookupError(f"no request {request_id!r} waits for KV on this decode worker")
        if not 0 < num_tokens <= seq.held_tokens:
            raise ValueError(f"request {request_id!r} holds the KV of {seq.held_tokens} prompt tokens here, "
                             f"not {num_tokens}")
        return self.kv.read(self.scheduler.pages.page_table(request_id), num_tokens)

    def _whole_kv(self, seq: DecodeSequence) -> SequenceKV:
        """A request's KV, all seq.num_kv_tokens tokens, in host memory: read from its pages while it
        has a row; else its staged or parked KV, with the held shared pages' tokens read in front."""
        live: _Live = seq.engine
        table = self.scheduler.pages.page_table(seq.request_id)
        if seq.row is not None:
            return self.kv.read(table, seq.num_kv_tokens)
        if live.kv is None:  # dropped for memory: computed again
            return self._recompute(seq)
        if live.kv_start == 0:
            return live.kv
        front = self.kv.read(table, live.kv_start)
        return SequenceKV(torch.cat([front.data, to_host(live.kv.data)], dim=3))

    def _recompute(self, seq: DecodeSequence) -> SequenceKV:
        """The KV of a row that dropped it, computed again from its tokens (the next input excluded)."""
        self.recomputed_total += 1
        tokens = list(seq.engine.request.prompt_token_ids) + seq.output_ids[:-1]
        return SequenceKV(to_host(self.runner.prefill(tokens).kv.data))

    def _finish(self, seq: DecodeSequence, status: Status) -> None:
        """End a request: free its row, pages or KV and forget it. LookupError if it had already ended."""
        was = seq.status
        self.scheduler.finish(seq, status)
        self._drop_kv(seq, was)

    def _drop_kv(self, seq: DecodeSequence, status: Status) -> None:
        live: _Live = seq.engine
        if live.kv is not None:
            if status in (Status.WAITING, Status.STAGED):  # the prefill's KV: its staging bytes go back
                self.on_kv_consumed(seq.request_id)
            elif status is Status.PARKED:  # a parked row's KV: its host bytes go back
                self.release_parked(seq.request_id)
            live.kv = None

    def _output(self, live: _Live, delta: str, finish_reason: str | None) -> RequestOutput:
        req = live.request
        checker = live.checker  # None until its KV landed
        return RequestOutput(req.request_id, req.prompt_token_ids, list(checker.token_ids) if checker else [],
                             checker.text if checker else "", delta, finish_reason, req.trace, list(live.logprobs))
