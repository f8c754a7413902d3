"""What the SDK accepts and returns: plain dataclasses, no gRPC.

`SamplingOptions` mirrors `engine.sampling.SamplingParams` field for field and is checked
here, before any RPC, so a bad value fails at once with a message saying what to change.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field, fields
from typing import Any

UINT32_MAX = 2**32 - 1
INT32_MIN, INT32_MAX = -(2**31), 2**31 - 1
MAX_SEED = 2**63 - 1  # the engine's bound; the wire field is wider


@dataclass(frozen=True)
class Usage:
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0  # prompt tokens the prefill worker reused instead of computing


@dataclass(frozen=True)
class Trace:
    """Where a request's time went (seconds per stage) and how much of its prompt was cached."""

    stage_seconds: dict[str, float] = field(default_factory=dict)  # queue, prefill, transfer, ...
    cached_tokens: int = 0
    predicted_cached_tokens: int = 0  # what the router's prefix index expected
    prefill_worker: str = ""
    decode_worker: str = ""


@dataclass(frozen=True)
class GenerationResult:
    """One finished request. finish_reason is "stop", "length" or "abort"."""

    request_id: str
    text: str
    token_ids: list[int]
    prompt_token_ids: list[int]
    finish_reason: str
    usage: Usage
    trace: Trace


@dataclass(frozen=True)
class StreamChunk:
    """One message of a token stream: the tokens and text new since the previous chunk.

    finish_reason, usage and trace are set on the last chunk only; prompt_token_ids on the
    first only."""

    request_id: str
    token_ids: list[int]
    text_delta: str
    finish_reason: str | None = None
    usage: Usage | None = None
    trace: Trace | None = None
    prompt_token_ids: list[int] | None = None


@dataclass(frozen=True)
class ModelInfo:
    name: str
    max_context: int
    model_fingerprint: str  # architecture, weights hash and dtype; KV only moves between equals
    vocab_size: int


@dataclass(frozen=True)
class WorkerStatus:
    address: str
    role: str  # "prefill" or "decode"
    healthy: bool
    decode: dict[str, Any] | None = None  # DecodeLoad fields by name, decode workers only
    prefill: dict[str, Any] | None = None  # PrefillLoad fields by name, prefill workers only


@dataclass(frozen=True)
class ClusterStatus:
    workers: list[WorkerStatus]
    routing: dict[str, Any] = field(default_factory=dict)  # prefix-index predictions vs what workers reused


@dataclass(frozen=True)
class BatchOutcome:
    """What generate_batch returns: per request (input order) a result or its error, and the
    router's summary (BatchLLM prefill token saving planned, optimal and actual; time)."""

    results: list  # GenerationResult | BatonError
    summary: dict[str, Any]


@dataclass(frozen=True)
class SamplingOptions:
    """How a request chooses its tokens and when it ends. None / defaults leave the server's
    defaults (max_tokens 256, greedy, top_p 1, a fresh random seed)."""

    max_tokens: int | None = None
    temperature: float = 0.0  # 0 = greedy
    top_p: float | None = None  # (0, 1]
    top_k: int = 0  # 0 = off
    seed: int | None = None  # same seed, same tokens
    stop: tuple[str, ...] = ()  # stop strings, not included in the text
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    priority: int = 0  # higher runs first under pressure

    def __post_init__(self) -> None:
        # Accept a single stop string, lists, and int temperatures; store one normal form.
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        elif isinstance(self.stop, (list, tuple)):
            object.__setattr__(self, "stop", tuple(self.stop))
        if isinstance(self.stop_token_ids, (list, tuple)):
            object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids))
        for name in ("temperature", "top_p"):
            value = getattr(self, name)
            if _is_int(value):
                object.__setattr__(self, name, float(value))
        self._validate()

    @classmethod
    def from_kwargs(cls, kwargs: dict[str, Any]) -> "SamplingOptions":
        """Build from keyword arguments; an unknown name is a TypeError listing the known ones."""
        unknown = sorted(set(kwargs) - SAMPLING_OPTION_NAMES)
        if unknown:
            raise TypeError(f"unknown sampling option(s) {', '.join(unknown)}; "
                            f"known: {', '.join(sorted(SAMPLING_OPTION_NAMES))}")
        return cls(**kwargs)

    def _validate(self) -> None:
        if self.max_tokens is not None and not _int_in(self.max_tokens, 1, UINT32_MAX):
            raise ValueError(f"max_tokens must be an integer >= 1 (got {self.max_tokens!r}); "
                             "ask for at least one new token, or leave it unset for the server default")
        t = self.temperature
        if not isinstance(t, float) or not math.isfinite(t) or t < 0:
            raise ValueError(f"temperature must be a finite number >= 0 (got {t!r}); "
                             "use 0 for greedy decoding or e.g. 0.7 for sampling")
        p = self.top_p
        if p is not None and (not isinstance(p, float) or not 0.0 < p <= 1.0):
            raise ValueError(f"top_p must be in (0, 1] (got {p!r}); use 1.0 or leave it unset to turn it off")
        if not _int_in(self.top_k, 0, UINT32_MAX):
            raise ValueError(f"top_k must be an integer >= 0 (got {self.top_k!r}); use 0 to turn it off")
        if self.seed is not None and not _int_in(self.seed, 0, MAX_SEED):
            raise ValueError(f"seed must be an integer in 0..2**63-1 or None (got {self.seed!r})")
        if not isinstance(self.stop, tuple) or not all(isinstance(s, str) and s for s in self.stop):
            raise ValueError(f"stop must be a non-empty string or a list of them (got {self.stop!r})")
        if not isinstance(self.stop_token_ids, tuple) or not all(
                _int_in(t, 0, UINT32_MAX) for t in self.stop_token_ids):
            raise ValueError(f"stop_token_ids must be a list of token ids >= 0 (got {self.stop_token_ids!r})")
        if not isinstance(self.ignore_eos, bool):
            raise ValueError(f"ignore_eos must be True or False (got {self.ignore_eos!r})")
        if not _int_in(self.priority, INT32_MIN, INT32_MAX):
            raise ValueError(f"priority must be a 32-bit integer (got {self.priority!r}); higher runs first")


SAMPLING_OPTION_NAMES = frozenset(f.name for f in fields(SamplingOptions))


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _int_in(value: Any, low: int, high: int) -> bool:
    return _is_int(value) and low <= value <= high
