"""Every translation between wire messages and the engine's dataclasses, in one place."""
from __future__ import annotations

from baton.v1 import common_pb2
from baton.resources import Amount
from baton.sampling import Guide, SamplingParams, TokenLogprob

_DEFAULTS = SamplingParams()


def sampling_to_proto(params: SamplingParams) -> common_pb2.SamplingParams:
    msg = common_pb2.SamplingParams(
        max_tokens=params.max_tokens, temperature=params.temperature, top_k=params.top_k, top_p=params.top_p,
        stop=list(params.stop), stop_token_ids=list(params.stop_token_ids), ignore_eos=params.ignore_eos,
        priority=params.priority, presence_penalty=params.presence_penalty,
        frequency_penalty=params.frequency_penalty, repetition_penalty=params.repetition_penalty,
        min_p=params.min_p, min_tokens=params.min_tokens, logit_bias=dict(params.logit_bias),
    )
    if params.seed is not None:
        msg.seed = params.seed
    if params.logprobs is not None:
        msg.logprobs = params.logprobs
    if params.guide is not None:
        msg.guide.kind, msg.guide.spec = params.guide.kind, params.guide.spec
    return msg


def sampling_from_proto(msg: common_pb2.SamplingParams) -> SamplingParams:
    """Raises ValueError (with what to change) for settings no worker could honour, a guide no
    grammar engine could compile among them."""
    params = SamplingParams(
        max_tokens=msg.max_tokens if msg.HasField("max_tokens") else _DEFAULTS.max_tokens,
        temperature=float(msg.temperature), top_k=msg.top_k,
        top_p=msg.top_p if msg.HasField("top_p") else 1.0,
        seed=msg.seed if msg.HasField("seed") else None,
        stop=tuple(msg.stop), stop_token_ids=tuple(msg.stop_token_ids),
        ignore_eos=msg.ignore_eos, priority=msg.priority,
        logprobs=msg.logprobs if msg.HasField("logprobs") else None,
        presence_penalty=msg.presence_penalty, frequency_penalty=msg.frequency_penalty,
        repetition_penalty=msg.repetition_penalty if msg.HasField("repetition_penalty") else 1.0,
        min_p=msg.min_p, min_tokens=msg.min_tokens, logit_bias=tuple(sorted(msg.logit_bias.items())),
        guide=Guide(msg.guide.kind, msg.guide.spec) if msg.HasField("guide") else None,
    )
    if params.guide is not None:
        from baton.guides import grammar_of

        grammar_of(params.guide)
    return params


def logprob_to_proto(lp: TokenLogprob) -> common_pb2.TokenLogprob:
    return common_pb2.TokenLogprob(token_id=lp.token_id, logprob=lp.logprob,
                                   top_token_ids=[t for t, _ in lp.top], top_logprobs=[v for _, v in lp.top])


def logprob_from_proto(msg: common_pb2.TokenLogprob) -> TokenLogprob:
    return TokenLogprob(msg.token_id, msg.logprob, tuple(zip(msg.top_token_ids, msg.top_logprobs)))


def settings_to_proto(chosen: dict[str, Amount]) -> list[common_pb2.Setting]:
    """A worker's sizes chosen at start, for its load report."""
    return [common_pb2.Setting(name=name, value=amount.value, chosen_by=amount.source) for name, amount in chosen.items()]
