"""Prefill and BATON decode in one process: the local engine behind `baton generate --local`.

Prefill never runs inside the decode batch: each iteration prefills just enough waiting prompts
to fill the rows that are free, stages their KV, and the decode core embeds them at its next
iteration while the other rows keep decoding.
"""
from __future__ import annotations

import itertools
from collections import deque

from baton.decode_worker.core import DecodeConfig, DecodeCore
from baton.engine.model import LoadedModel
from baton.engine.request import GenerationRequest, RequestError, RequestOutput, validate_prompt
from baton.engine.executors import Runner, make_runner
from baton.sampling import SamplingParams
from baton.prefill_worker.batching import pick_batch
from baton.prefill_worker.core import PrefillCore


class LocalEngine:
    def __init__(self, loaded: LoadedModel, decode_config: DecodeConfig = DecodeConfig(),
                 attention_backend: str = "auto", max_waiting: int = 100_000, prefix_cache_bytes: int = 0,
                 executor: str = "auto", cuda_graphs: bool = True, batch_invariant: bool = True,
                 runner: Runner | None = None):
        """runner: an executor already made for `loaded` (else made from the other arguments)."""
        self.loaded = loaded
        # one model serves both phases
        self.runner = runner or make_runner(loaded, executor, attention_backend, cuda_graphs, batch_invariant)
        self.prefill = PrefillCore(self.runner, prefix_cache_bytes=prefix_cache_bytes)
        self.decode = DecodeCore(self.runner, decode_config)
        self.max_waiting = max_waiting
        self.max_prefill_tokens = 8192
        self.waiting: deque[GenerationRequest] = deque()
        self._ids = itertools.count()

    def submit(self, prompt_token_ids: list[int], params: SamplingParams = SamplingParams(),
               request_id: str | None = None) -> str:
        """Queue a prompt; raises RequestError (nothing queued) if it cannot be served."""
        validate_prompt(prompt_token_ids, params, max_context=self.decode.max_context,
                        vocab_size=self.loaded.config.vocab_size)
        if len(self.waiting) >= self.max_waiting:
            raise RequestError(f"{self.max_waiting} requests are already waiting; retry later")
        request_id = request_id or f"local-{next(self._ids)}"
        request = GenerationRequest(request_id, list(prompt_token_ids), params)
        request.trace.mark("arrived")
        self.waiting.append(request)
        return request_id

    def abort(self, request_id: str) -> RequestOutput | None:
        for request in self.waiting:
            if request.request_id == request_id:
                self.waiting.remove(request)
                return RequestOutput(request_id, request.prompt_token_ids, [], "", "", "abort", request.trace)
        return self.decode.abort(request_id)

    def has_work(self) -> bool:
        return bool(self.waiting) or self.decode.has_work()

    def step(self) -> list[RequestOutput]:
        """Prefill for the free rows, then one decode iteration; returns every output produced."""
        outputs = []
        todo = self._next_prefills()
        while todo:  # padding is wasted work: prefill length-similar prompts together
            picked = pick_batch([len(r.prompt_token_ids) for r in todo], self.max_prefill_tokens, len(todo))
            batch = [todo[i] for i in picked]
            todo = [r for i, r in enumerate(todo) if i not in set(picked)]
            outputs.extend(self.decode.add(p) for p in self.prefill.prefill(batch))
        outputs.extend(self.decode.step())
        return outputs

    def _next_prefills(self) -> list[GenerationRequest]:
        """Enough waiting prompts, highest priority first, to fill the free rows; when none is free,
        those that outrank a running row (the decode core will park that row for them)."""
        sched = self.decode.scheduler
        free_rows = sched.config.max_rows - sched.num_running - sched.num_staged
        ordered = sorted(self.waiting, key=lambda r: -r.params.priority)
        if free_rows > 0:
            chosen = ordered[:free_rows]
        elif sched.rows and not sched.staged:
            lowest = min(s.priority for s in sched.rows)
            chosen = [r for r in ordered if r.params.priority > lowest][:sched.config.max_rows]
        else:
            chosen = []
        for request in chosen:
            self.waiting.remove(request)
        return chosen

    def generate(self, prompts: list[list[int]], params: SamplingParams | list[SamplingParams] = SamplingParams()
                 ) -> list[RequestOutput]:
        """Run prompts to completion; final outputs in the order given."""
        per_prompt = params if isinstance(params, list) else [params] * len(prompts)
        ids = [self.submit(p, sp) for p, sp in zip(prompts, per_prompt)]
        finals: dict[str, RequestOutput] = {}
        while self.has_work():
            for out in self.step():
                if out.finished:
                    finals[out.request_id] = out
        return [finals[i] for i in ids]
