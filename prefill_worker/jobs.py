"""A prompt's life on the prefill worker, as the compute loop and the delivery share it: the job
it is queued as, and what a job whose KV landed reports (the servicer makes the reply)."""
from __future__ import annotations

from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

from baton.engine.kv import SequenceKV
from baton.engine.request import GenerationRequest


@dataclass
class PrefillDone:
    """A job whose KV landed on its decode worker."""

    first_token: int
    seed: int
    cached_tokens: int
    computed_tokens: int
    queue_seconds: float
    prefill_seconds: float
    transfer_seconds: float = 0.0
    pulled_tokens: int = 0  # of cached_tokens, read from the decode worker (kv_pull) and not cached here before


@dataclass
class PrefillJob:
    request: GenerationRequest
    decode_target: str
    push_token: str = ""  # presented with the KV push; the decode worker registered the same
    kv_skip_tokens: int = 0  # leading prompt tokens whose KV the decode worker holds: not pushed
    pulled: SequenceKV | None = None  # that KV, read from the decode worker, until the cache adopts it
    pulled_tokens: int = 0  # prompt tokens the cache took from it that it lacked
    new_prefix: int | None = None  # while in chunks: its first block the cache lacked (see batching)
    done: Future = field(default_factory=Future)
    cancelled: bool = False
    stream: Any = None  # delivery.StreamedPush: its KV streamed chunk by chunk while it prefills
    sent: bool = False  # prefilled and handed to the delivery: it settles `done`

    def end_stream(self, why: str) -> None:
        """Abort its streamed push, if it has one (the prompt will not be sent that way)."""
        if self.stream is not None:
            self.stream.abort(why)
