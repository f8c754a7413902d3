"""What travels with a request between the parts: the prompt, its sampling, its trace, its output."""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from baton.sampling import SamplingParams, TokenLogprob

if TYPE_CHECKING:  # the router validates requests with this module, without torch
    from baton.engine.kv import SequenceKV

# Stages in the order a request passes them; the trace says how long each took.
STAGES = ("queue", "prefill", "transfer", "staging", "admission", "decode")


class RequestError(ValueError):
    """A request that cannot be served as asked; the message says what to change."""


@dataclass
class Trace:
    """Wall-clock marks (time.monotonic) per event; stage durations derive from them."""

    marks: dict[str, float] = field(default_factory=dict)
    cached_tokens: int = 0  # prompt tokens whose KV came from a prefix cache
    prefill_worker: str = ""
    decode_worker: str = ""

    def mark(self, event: str, at: float | None = None) -> None:
        self.marks[event] = time.monotonic() if at is None else at

    def durations(self) -> dict[str, float]:
        """Seconds per stage: queue (arrival to prefill start), prefill, transfer, staging (landed
        to admitted), admission (embedding into the batch), decode (admitted to finished)."""
        return {stage: max(0.0, end - start) for stage, (start, end) in self.stage_marks().items()}

    def stage_marks(self) -> dict[str, tuple[float, float]]:
        """(start, end) of each stage both of whose marks this process made."""
        m = self.marks
        return {stage: (m[a], m[b]) for stage, (a, b) in STAGE_MARKS.items() if a in m and b in m}


# The marks each stage runs between. A prefill worker marks `staged` when its push is done.
STAGE_MARKS = {
    "queue": ("arrived", "prefill_start"), "prefill": ("prefill_start", "prefill_end"),
    "transfer": ("prefill_end", "staged"), "staging": ("staged", "admit_start"),
    "admission": ("admit_start", "admitted"), "decode": ("admitted", "finished"),
}


@dataclass
class GenerationRequest:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    trace: Trace = field(default_factory=Trace)
    resume_step: int = 0  # tokens generated before this request moved here (continues the random stream)


@dataclass
class PrefilledRequest:
    """A prompt's KV and first sampled token, ready to be embedded into a decode batch."""

    request: GenerationRequest
    kv: SequenceKV  # the prompt's KV after `shared_prefix` (all of it without one): `whole_kv` joins them
    first_token: int
    seed: int  # the seed sampling used, so the decode side continues the same random stream
    cached_tokens: int = 0  # prompt tokens whose KV came from the prefix cache
    first_logprob: TokenLogprob | None = None  # when the request asked for log probabilities
    # A group's shared prefix, referenced by all its members: the whole KV is put together
    # (`whole_kv`) only when it leaves for a decode worker, without the part that worker holds.
    shared_prefix: SequenceKV | None = None

    def whole_kv(self, start: int = 0) -> SequenceKV:
        """The prompt's KV from token `start` on."""
        from baton.engine.kv import joined

        return joined(self.shared_prefix, self.kv, start)


@dataclass
class RequestOutput:
    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int]  # generated so far (all of them once finished)
    text: str  # text so far (final text once finished)
    text_delta: str = ""  # new text since the previous output of this request
    finish_reason: str | None = None  # "stop", "length", "abort" once finished
    trace: Trace | None = None
    logprobs: list[TokenLogprob] = field(default_factory=list)  # one per token_ids entry, if asked for

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


def validate_prompt(prompt_token_ids: list[int], params: SamplingParams, *, max_context: int, vocab_size: int) -> None:
    """Refuse what no worker could serve, with what to change."""
    if not prompt_token_ids:
        raise RequestError("the prompt is empty; send at least one token or a non-empty message")
    if len(prompt_token_ids) >= max_context:
        raise RequestError(
            f"the prompt has {len(prompt_token_ids)} tokens but the context served is {max_context} "
            f"(prompt plus output); "
            f"shorten it to at most {max_context - 1} tokens"
        )
    bad = next((t for t in prompt_token_ids if not 0 <= t < vocab_size), None)
    if bad is not None:
        raise RequestError(f"token id {bad} is outside the model's vocabulary [0, {vocab_size})")
    params.validate()
    bad = next((t for t, _ in params.logit_bias if t >= vocab_size), None)
    if bad is not None:
        raise RequestError(f"logit_bias names token id {bad}, outside the model's vocabulary [0, {vocab_size})")


def effective_max_tokens(prompt_len: int, params: SamplingParams, max_context: int) -> int:
    """New tokens a request may produce: its max_tokens, cut at the model's context."""
    return min(params.max_tokens, max_context - prompt_len)
