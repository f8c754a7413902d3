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
from typing import Sequence

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
    """One request's sampling state: its params, its seed and how many tokens it has drawn.

    `tokens_generated` is the step index of the next draw; a worker that takes over a request
    passes the number of tokens already generated so the random stream continues unchanged.
    """

    def __init__(self, params: SamplingParams, tokens_generated: int = 0) -> None:
        if tokens_generated < 0:
            raise ValueError(f"tokens_generated must be >= 0 (got {tokens_generated})")
        self.params = params
        self.seed = params.seed if params.seed is not None else secrets.randbits(63)
        self.tokens_generated = tokens_generated
        self._generator: torch.Generator | None = None

    def generator_for_step(self, device: torch.device) -> torch.Generator:
        """This request's generator on `device`, seeded for the current step."""
        if self._generator is None or self._generator.device != device:
            self._generator = torch.Generator(device=device)
        self._generator.manual_seed(_step_seed(self.seed, self.tokens_generated))
        return self._generator


def sample(logits: torch.Tensor, samplers: Sequence[RequestSampler]) -> list[int]:
    """Next token for each row of `logits` ([n, vocab]), row i drawn with samplers[i].

    Greedy rows take exactly torch.argmax (the first maximum on ties, as transformers does).
    Other rows: logits / temperature, then top-k, then top-p (nucleus; the most likely token
    always stays), then torch.multinomial with the row's own generator. Advances every
    sampler's step counter by one.
    """
    if logits.dim() != 2 or logits.shape[0] != len(samplers):
        raise ValueError(f"logits must be [n, vocab] with one row per sampler; "
                         f"got shape {tuple(logits.shape)} for {len(samplers)} samplers")
    logits = logits.float()  # logits: [n, V]
    if all(s.params.is_greedy for s in samplers):
        tokens = logits.argmax(dim=-1).tolist()
    else:
        tokens = _sample_mixed(logits, samplers)
    for s in samplers:
        s.tokens_generated += 1
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
        elif p.top_k == 0 and p.top_p >= 1.0:
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
    """Probabilities after temperature, top-k and top-p, in descending-logit order.

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
    return probs.masked_fill(drop, 0.0), sorted_ids


INVALID_TOKEN = -1  # a row whose distribution is not finite (NaN/inf logits): no token can be drawn


def _draw(probs: torch.Tensor, samplers: Sequence[RequestSampler]) -> torch.Tensor:
    """One multinomial draw per row ([m, V] -> [m]), each with its request's generator; a row
    with non-finite probabilities gets INVALID_TOKEN, so only its own request fails."""
    valid = torch.isfinite(probs).all(dim=-1) & (probs.sum(dim=-1) > 0)
    draws = [torch.multinomial(probs[i], 1, generator=s.generator_for_step(probs.device)) if valid[i]
             else torch.tensor([INVALID_TOKEN], device=probs.device) for i, s in enumerate(samplers)]
    return torch.cat(draws)
