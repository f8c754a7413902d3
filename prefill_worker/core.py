"""Prefill without networking: run a prompt, sample its first token, hand back its KV."""
from __future__ import annotations

from engine.request import GenerationRequest, PrefilledRequest
from engine.runner import ModelRunner
from engine.sampling import RequestSampler, sample


class PrefillCore:
    def __init__(self, runner: ModelRunner):
        self.runner = runner

    def prefill(self, request: GenerationRequest) -> PrefilledRequest:
        request.trace.mark("prefill_start")
        out = self.runner.prefill(request.prompt_token_ids)
        sampler = RequestSampler(request.params)
        first_token = sample(out.logits[None], [sampler])[0]
        request.trace.mark("prefill_end")
        return PrefilledRequest(request, out.kv, first_token, sampler.seed)
