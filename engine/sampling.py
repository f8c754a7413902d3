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

import math
import numbers
import secrets
from dataclasses import asdict, dataclass, fields
from typing import Any, Sequence

import torch

MAX_STOP_STRINGS = 16
MAX_STOP_STRING_CHARS = 256
MAX_STOP_TOKEN_IDS = 256
MAX_SEED = 2**63 - 1
# Below this a temperature only amplifies float noise, so it is treated as greedy (as vLLM does).
GREEDY_TEMPERATURE_EPS = 1e-5


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


@dataclass(frozen=True)
class SamplingParams:
    """How one request chooses its tokens and when it ends. Validated on construction."""

    max_tokens: int = 256
    temperature: float = 0.0  # 0 = greedy (argmax); top_k / top_p are then irrelevant
    top_k: int = 0  # 0 = off
    top_p: float = 1.0  # 1.0 = off
    seed: int | None = None  # None = a fresh random seed per request
    stop: tuple[str, ...] = ()  # stop strings; not included in the returned text
    stop_token_ids: tuple[int, ...] = ()  # end the request when sampled, like EOS
    ignore_eos: bool = False
    priority: int = 0

    def __post_init__(self) -> None:
        # Normalise JSON-ish input (lists, a single stop string, int temperatures) once here.
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        elif isinstance(self.stop, (list, tuple)):
            object.__setattr__(self, "stop", tuple(self.stop))
        if isinstance(self.stop_token_ids, (list, tuple)):
            object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids))
        for name in ("temperature", "top_p"):
            value = getattr(self, name)
            if isinstance(value, numbers.Real) and not isinstance(value, bool):
                object.__setattr__(self, name, float(value))
        self.validate()

    @property
    def is_greedy(self) -> bool:
        return self.temperature < GREEDY_TEMPERATURE_EPS

    def validate(self) -> None:
        """Raise ValueError naming the bad field, its value and what to change."""
        if not _is_int(self.max_tokens) or self.max_tokens < 1:
            raise ValueError(f"max_tokens must be an integer >= 1 (got {self.max_tokens!r}); "
                             "ask for at least one new token")
        t = self.temperature
        if not isinstance(t, float) or not math.isfinite(t) or t < 0:
            raise ValueError(f"temperature must be a finite number >= 0 (got {t!r}); "
                             "use 0 for greedy decoding or e.g. 0.7 for sampling")
        if not _is_int(self.top_k) or self.top_k < 0:
            raise ValueError(f"top_k must be an integer >= 0 (got {self.top_k!r}); use 0 to turn it off")
        p = self.top_p
        if not isinstance(p, float) or not 0.0 < p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1] (got {p!r}); use 1.0 to turn it off")
        if self.seed is not None and (not _is_int(self.seed) or not 0 <= self.seed <= MAX_SEED):
            raise ValueError(f"seed must be an integer in 0..2**63-1 or null (got {self.seed!r})")
        self._validate_stops()
        if not isinstance(self.ignore_eos, bool):
            raise ValueError(f"ignore_eos must be true or false (got {self.ignore_eos!r})")
        if not _is_int(self.priority):
            raise ValueError(f"priority must be an integer (got {self.priority!r})")

    def _validate_stops(self) -> None:
        if not isinstance(self.stop, tuple):
            raise ValueError(f"stop must be a string or a list of strings (got {self.stop!r})")
        if len(self.stop) > MAX_STOP_STRINGS:
            raise ValueError(f"at most {MAX_STOP_STRINGS} stop strings are allowed (got {len(self.stop)}); "
                             "send fewer stop strings")
        for s in self.stop:
            if not isinstance(s, str) or not s:
                raise ValueError(f"every stop string must be a non-empty string (got {s!r}); "
                                 "remove empty stop strings")
            if len(s) > MAX_STOP_STRING_CHARS:
                raise ValueError(f"stop strings may be at most {MAX_STOP_STRING_CHARS} characters "
                                 f"(got one of {len(s)}); shorten it")
        if not isinstance(self.stop_token_ids, tuple):
            raise ValueError(f"stop_token_ids must be a list of integers (got {self.stop_token_ids!r})")
        if len(self.stop_token_ids) > MAX_STOP_TOKEN_IDS:
            raise ValueError(f"at most {MAX_STOP_TOKEN_IDS} stop_token_ids are allowed "
                             f"(got {len(self.stop_token_ids)}); send fewer")
        for token_id in self.stop_token_ids:
            if not _is_int(token_id) or token_id < 0:
                raise ValueError(f"stop_token_ids must be integers >= 0 (got {token_id!r}); "
                                 "remove negative or non-integer ids")

    def to_dict(self) -> dict[str, Any]:
        """Plain JSON-able form (tuples become lists)."""
        out = asdict(self)
        out["stop"] = list(self.stop)
        out["stop_token_ids"] = list(self.stop_token_ids)
        return out

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "SamplingParams":
        """Inverse of to_dict; missing keys take defaults, unknown keys are refused."""
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ValueError(f"unknown sampling parameter(s) {unknown}; known: {sorted(known)}")
        return cls(**data)


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
