"""Per-request sampling parameters and a batched sampler for next-token logits.

Reproducibility contract: a request's token at generation step t depends only on its own
logits row, its SamplingParams, its seed and t. It does not depend on the other rows in the
batch, on its row index, or on which worker sampled the previous tokens: each step reseeds the
request's generator from (seed, t), so a decode worker continuing a request whose first token
the prefill worker sampled (or resuming a preempted one) draws exactly what a single process
would. The same seed, logits and step give the same token on the same device type (CPU and
CUDA random streams differ).
"""
from __future__ import annotations

import secrets
from collections import Counter
from dataclasses import replace
from typing import Collection, Sequence

import torch

# The parameters themselves are plain Python, shared with the SDK and the router.
from baton.sampling import (GREEDY_TEMPERATURE_EPS, MAX_SEED, MAX_STOP_STRING_CHARS, MAX_STOP_STRINGS,  # noqa: F401
                            MAX_STOP_TOKEN_IDS, SamplingParams, TokenLogprob)


def _step_seed(seed: int, step: int) -> int:
    """splitmix64 of (seed, step): independent, well-mixed seeds for consecutive steps."""
    mask = 2**64 - 1
    z = (seed + (step + 1) * 0x9E3779B97F4A7C15) & mask
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & mask
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & mask
    return (z ^ (z >> 31)) & MAX_SEED


class RequestSampler:
    """One request's sampling state: its params, its seed, how many tokens it has drawn, and what
    its penalties read (the tokens so far).

    `tokens_generated` is the step index of the next draw; a worker that takes over a request
    passes the number of tokens already generated so the random stream continues unchanged.
    Penalties need no state carried between workers: `for_request` rebuilds it from the prompt a
    worker is given, whose last `resume_step` tokens are the ones generated before it took over.
    """

    def __init__(self, params: SamplingParams, tokens_generated: int = 0, *, prompt_ids: Sequence[int] = (),
                 output_ids: Sequence[int] = (), suppress_ids: Collection[int] = (), resume_step: int = 0,
                 grammars=None) -> None:
        if tokens_generated < 0:
            raise ValueError(f"tokens_generated must be >= 0 (got {tokens_generated})")
        self.params = params
        self.seed = params.seed if params.seed is not None else secrets.randbits(63)
        self.tokens_generated = tokens_generated
        self.resume_step = resume_step  # min_tokens counts from here (the router lowers it by as much)
        self._generator: torch.Generator | None = None
        # What the logit adjustments read; kept only when the request asks for one.
        self.seen: set[int] = set()  # prompt and output tokens (repetition_penalty)
        self._seen_ids: torch.Tensor | None = None  # the same, as a tensor, while no new token joins
        self.output_counts: Counter[int] = Counter()  # output tokens (presence and frequency penalties)
        self.suppress_ids = sorted(suppress_ids) if params.min_tokens else []  # EOS and stop ids, until min_tokens
        if params.adjusts_logits:
            if params.repetition_penalty != 1.0:
                self.seen.update(prompt_ids)
                self.seen.update(output_ids)
            self.output_counts.update(output_ids)
        # structured output: the grammar's state rebuilt from the tokens so far (engine.grammar)
        self.guide = None
        if params.guide is not None:
            if grammars is None:
                raise ValueError("this request has a guide (structured output) but no grammar engine was given")
            self.guide = grammars.matcher(params.guide, output_ids)

    @classmethod
    def for_request(cls, params: SamplingParams, prompt_ids: Sequence[int], resume_step: int,
                    suppress_ids: Collection[int] = (), seed: int | None = None, drawn: Sequence[int] = (),
                    grammars=None) -> "RequestSampler":
        """The sampler of a request given `prompt_ids` at `resume_step` (its last resume_step
        tokens were generated before, elsewhere), after `drawn` more tokens (a decode worker
        continuing the prefill's first token). grammars: the model's `engine.grammar.Grammars`,
        needed by a request with a guide."""
        if seed is not None:
            params = replace(params, seed=seed)
        split = len(prompt_ids) - resume_step
        outputs = [*prompt_ids[split:], *drawn]
        return cls(params, resume_step + len(drawn), prompt_ids=prompt_ids[:split], output_ids=outputs,
                   suppress_ids=suppress_ids, resume_step=resume_step, grammars=grammars)

    def generator_for_step(self, device: torch.device) -> torch.Generator:
        """This request's generator on `device`, seeded for the current step."""
        if self._generator is None or self._generator.device != device:
            self._generator = torch.Generator(device=device)
        self._generator.manual_seed(_step_seed(self.seed, self.tokens_generated))
        return self._generator

    def record(self, token: int) -> None:
        """One more token drawn (INVALID_TOKEN too: the step still advances)."""
        self.tokens_generated += 1
        if token != INVALID_TOKEN and self.guide is not None:
            self.guide.accept(token)
        if token != INVALID_TOKEN and self.params.adjusts_logits:
            self.output_counts[token] += 1
            if self.params.repetition_penalty != 1.0:
                self.seen.add(token)

    def adjust(self, row: torch.Tensor) -> None:
        """Apply min_tokens, the logit bias and the penalties to this request's logits row, in
        place (vLLM's order: logits processors, then repetition, frequency and presence)."""
        p = self.params
        device = row.device
        if self.suppress_ids and self.tokens_generated - self.resume_step < p.min_tokens:
            row[torch.tensor(self.suppress_ids, device=device)] = float("-inf")
        if p.logit_bias:
            ids, bias = zip(*p.logit_bias)
            row[torch.tensor(ids, device=device)] += torch.tensor(bias, dtype=row.dtype, device=device)
        if p.repetition_penalty != 1.0 and self.seen:
            if self._seen_ids is None or len(self._seen_ids) != len(self.seen) or self._seen_ids.device != device:
                self._seen_ids = torch.tensor(sorted(self.seen), device=device)  # a long prompt: built once
            ids = self._seen_ids
            values = row[ids]
            row[ids] = torch.where(values > 0, values / p.repetition_penalty, values * p.repetition_penalty)
        if (p.presence_penalty or p.frequency_penalty) and self.output_counts:
            ids, counts = zip(*sorted(self.output_counts.items()))
            counts = torch.tensor(counts, dtype=row.dtype, device=device)
            row[torch.tensor(ids, device=device)] -= p.frequency_penalty * counts + p.presence_penalty
        if self.guide is not None:  # last: what the grammar forbids stays forbidden
            self.guide.mask(row)


def ending_ids(params: SamplingParams, eos_token_ids: Collection[int]) -> set[int]:
    """The token ids that would end this request: what min_tokens holds back."""
    return set(params.stop_token_ids) | (set() if params.ignore_eos else set(eos_token_ids))


def first_token(request, logits: torch.Tensor, loaded) -> tuple[int, TokenLogprob | None, int]:
    """A prefilled request's first token, drawn from its prompt's last `logits` ([vocab]) where its
    prompt was prefilled (a prefill worker, or a decode worker prefilling it itself): (the token,
    its log probability if asked for, the seed its random stream goes on with). `request`: an
    engine.request.GenerationRequest; `loaded`: its engine.model.LoadedModel."""
    params = request.params
    sampler = RequestSampler.for_request(params, request.prompt_token_ids, request.resume_step,
                                         ending_ids(params, loaded.eos_token_ids),
                                         grammars=loaded.grammars if params.guide else None)
    token = sample(logits[None], [sampler])[0]
    return token, token_logprobs(logits[None], [token], [params])[0], sampler.seed


def sample(logits: torch.Tensor, samplers: Sequence[RequestSampler]) -> list[int]:
    """Next token for each row of `logits` ([n, vocab]), row i drawn with samplers[i].

    A row whose request asks for it first gets its min_tokens, logit bias, penalties and grammar
    mask: in `logits` itself (when they are float32), or on a copy when a row asks for log
    probabilities, which are read from the raw logits. Greedy rows take exactly torch.argmax
    (the first maximum on ties, as transformers does). Other rows: logits / temperature, then
    top-k, then top-p (nucleus; the most likely token always stays), then min-p, then
    torch.multinomial with the row's own generator. Advances every sampler by one step.
    """
    if logits.dim() != 2 or logits.shape[0] != len(samplers):
        raise ValueError(f"logits must be [n, vocab] with one row per sampler; "
                         f"got shape {tuple(logits.shape)} for {len(samplers)} samplers")
    logits = logits.float()  # logits: [n, V]
    adjusted = [i for i, s in enumerate(samplers) if s.params.adjusts_logits]
    if adjusted:
        if any(s.params.logprobs is not None for s in samplers):
            logits = logits.clone()
        for i in adjusted:  # each row by its own request's state only: batch-invariant
            samplers[i].adjust(logits[i])
    if all(s.params.is_greedy for s in samplers):
        tokens = logits.argmax(dim=-1).tolist()
    else:
        tokens = _sample_mixed(logits, samplers)
    for i in adjusted:  # a grammar that allows nothing (or -inf everywhere): no token, this request fails
        if samplers[i].guide is not None and (tokens[i] == INVALID_TOKEN or logits[i, tokens[i]] == float("-inf")):
            tokens[i] = INVALID_TOKEN
    for s, token in zip(samplers, tokens):
        s.record(token)
    return tokens


def token_logprobs(logits: torch.Tensor, tokens: Sequence[int],
                   params: Sequence[SamplingParams]) -> list[TokenLogprob | None]:
    """Each sampled token's log probability and its row's `params.logprobs` most likely tokens,
    from the same logits it was sampled from (raw: before temperature, top-k and top-p, as vLLM
    reports them); None for rows that did not ask or whose token is INVALID_TOKEN. Only the rows
    that ask pay for the log-softmax."""
    out: list[TokenLogprob | None] = [None] * len(tokens)
    rows = [i for i, p in enumerate(params) if p.logprobs is not None and tokens[i] != INVALID_TOKEN]
    if not rows:
        return out
    index = torch.tensor(rows, device=logits.device)
    logp = torch.log_softmax(logits[index].float(), dim=-1)  # [m, V]
    chosen = logp.gather(1, torch.tensor([[tokens[i]] for i in rows], device=logits.device)).squeeze(1).tolist()
    k = max(params[i].logprobs for i in rows)
    top_values, top_ids = (logp.topk(k, dim=-1) if k else (logp[:, :0], logp[:, :0].long()))
    top_values, top_ids = top_values.tolist(), top_ids.tolist()
    for j, i in enumerate(rows):
        n = params[i].logprobs
        out[i] = TokenLogprob(tokens[i], chosen[j], tuple(zip(top_ids[j][:n], top_values[j][:n])))
    return out


def _sample_mixed(logits: torch.Tensor, samplers: Sequence[RequestSampler]) -> list[int]:
    # Each row takes a path chosen by its own params only, so batch composition never changes
    # how a row is computed (and therefore never changes which token its seed draws).
    greedy, plain, filtered = [], [], []
    for i, s in enumerate(samplers):
        p = s.params
        if p.is_greedy:
            greedy.append(i)
        elif p.top_k == 0 and p.top_p >= 1.0 and p.min_p == 0.0:
            plain.append(i)
        else:
            filtered.append(i)
    device = logits.device
    tokens = torch.empty(len(samplers), dtype=torch.long, device=device)
    if greedy:
        rows = torch.tensor(greedy, device=device)
        tokens[rows] = logits[rows].argmax(dim=-1)
    if plain:
        rows = torch.tensor(plain, device=device)
        probs = torch.softmax(logits[rows] / _temperatures(samplers, plain, device), dim=-1)
        tokens[rows] = _draw(probs, [samplers[i] for i in plain])
    if filtered:
        rows = torch.tensor(filtered, device=device)
        sorted_probs, sorted_ids = _filtered_sorted_probs(logits[rows], [samplers[i].params for i in filtered])
        positions = _draw(sorted_probs, [samplers[i] for i in filtered])
        tokens[rows] = sorted_ids.gather(1, positions.unsqueeze(1)).squeeze(1)
    return tokens.tolist()


def _temperatures(samplers: Sequence[RequestSampler], rows: list[int], device: torch.device) -> torch.Tensor:
    return torch.tensor([[samplers[i].params.temperature] for i in rows], dtype=torch.float32, device=device)


def _filtered_sorted_probs(logits: torch.Tensor, params: list[SamplingParams]) -> tuple[torch.Tensor, torch.Tensor]:
    """Probabilities after temperature, top-k, top-p and min-p (transformers' order), in
    descending-logit order.

    logits: [m, V]. Returns (probs [m, V] with dropped tokens at 0, vocab ids [m, V]).
    A stable sort keeps equal logits in vocab order, so top_k=1 picks what argmax picks.
    """
    m, vocab = logits.shape
    device = logits.device
    temps = torch.tensor([[p.temperature] for p in params], dtype=torch.float32, device=device)
    sorted_logits, sorted_ids = torch.sort(logits / temps, dim=-1, descending=True, stable=True)
    positions = torch.arange(vocab, device=device).expand(m, vocab)  # [m, V]
    top_k = torch.tensor([[p.top_k if p.top_k > 0 else vocab] for p in params], device=device)
    sorted_logits = sorted_logits.masked_fill(positions >= top_k, float("-inf"))
    probs = torch.softmax(sorted_logits, dim=-1)
    # Keep the smallest prefix whose mass reaches top_p: drop a token once the mass before it does.
    top_p = torch.tensor([[p.top_p] for p in params], dtype=torch.float32, device=device)
    mass_before = torch.cumsum(probs, dim=-1) - probs
    drop = (mass_before >= top_p) & (top_p < 1.0) & (positions > 0)
    # Min-p: below min_p times the likeliest token's probability (the ratio top-k and top-p keep).
    min_p = torch.tensor([[p.min_p] for p in params], dtype=torch.float32, device=device)
    drop |= probs < min_p * probs[:, :1]
    return probs.masked_fill(drop, 0.0), sorted_ids


INVALID_TOKEN = -1  # a row whose distribution is not finite (NaN/inf logits): no token can be drawn


def _draw(probs: torch.Tensor, samplers: Sequence[RequestSampler]) -> torch.Tensor:
    """One multinomial draw per row ([m, V] -> [m]), each with its request's generator; a row
    with non-finite probabilities gets INVALID_TOKEN, so only its own request fails."""
    valid = torch.isfinite(probs).all(dim=-1) & (probs.sum(dim=-1) > 0)
    draws = [torch.multinomial(probs[i], 1, generator=s.generator_for_step(probs.device)) if valid[i]
             else torch.tensor([INVALID_TOKEN], device=probs.device) for i, s in enumerate(samplers)]
    return torch.cat(draws)
