"""What the SDK accepts and returns: plain dataclasses, no gRPC.

Sampling options are `baton.sampling.SamplingParams`, the class the router and the engine use,
checked here before any RPC, so a bad value fails at once with a message saying what to change.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from baton.sampling import (INT32_MAX, INT32_MIN, MAX_SEED, SAMPLING_OPTION_NAMES, UINT32_MAX, Guide,  # noqa: F401
                            SamplingParams, TokenLogprob)


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
    prefill_worker: str = ""  # empty where the decode worker prefilled the prompt itself
    decode_worker: str = ""
    route: str = ""  # why the router sent the request where it did


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
    logprobs: list[TokenLogprob] | None = None  # one per token_ids entry, with logprobs=N


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
    logprobs: list[TokenLogprob] | None = None  # one per token_ids entry, with logprobs=N


@dataclass(frozen=True)
class ModelInfo:
    name: str
    max_context: int
    model_fingerprint: str  # architecture, weights hash and dtype; KV only moves between equals
    vocab_size: int
    # What a request leaving max_tokens, temperature, top_k or top_p unset gets from this router
    sampling_defaults: dict[str, float] = field(default_factory=dict)
    # By worker address: the sizes each chose at start (max_rows, kv_budget_bytes, staging_bytes,
    # threads) or was given, and how
    worker_settings: dict[str, list["Setting"]] = field(default_factory=dict)


@dataclass(frozen=True)
class Setting:
    name: str
    value: float
    chosen_by: str  # e.g. "0.25 of 6442450944 bytes: the cgroup memory limit ...", or the config key that set it


@dataclass(frozen=True)
class WorkerStatus:
    address: str
    role: str  # "prefill" or "decode"
    healthy: bool
    decode: dict[str, Any] | None = None  # DecodeLoad fields by name, decode workers only
    prefill: dict[str, Any] | None = None  # PrefillLoad fields by name, prefill workers only
    # the router's prefix index follows this worker's KV events (routing by prefix sees what it holds)
    cache_synced: bool = False


@dataclass(frozen=True)
class ClusterStatus:
    workers: list[WorkerStatus]
    routing: dict[str, Any] = field(default_factory=dict)  # prefix-index predictions vs what workers reused

    def waiting_for(self) -> str | None:
        """Why the router cannot serve a request yet (as its /health says: it needs a healthy prefill
        and a healthy decode worker), or None when it can."""
        gaps = []
        for role in ("prefill", "decode"):
            known = [w for w in self.workers if w.role == role]
            if not any(w.healthy for w in known):
                gaps.append(f"no healthy {role} worker yet ({len(known)} known)")
        return "; ".join(gaps) or None


@dataclass(frozen=True)
class BatchOutcome:
    """What generate_batch returns: per request (input order) a result or its error, and the
    router's summary (BatchLLM prefill token saving planned, optimal and actual; time)."""

    results: list  # GenerationResult | BatonError
    summary: dict[str, Any]


# The SDK's sampling options are the one SamplingParams the router and the engine use too.
SamplingOptions = SamplingParams
