"""A request's structured output held on every token it samples: one llguidance matcher per
request masks its logits row and follows the tokens drawn.

A matcher's state is the tokens generated so far, so a worker continuing a request (the decode
worker after the prefill's first token, a handoff, a failover's re-prefill, a parked row's
resume) rebuilds it by replaying them: nothing has to travel but the token ids that travel
anyway. One `Grammars` per model holds the llguidance tokenizer (built once, about half a
second); compiled grammars are cached by `baton.guides.grammar_of`.
"""
from __future__ import annotations

import threading
from typing import Sequence

import torch

from baton.guides import grammar_of
from baton.sampling import Guide


_SHIFTS = torch.arange(32, dtype=torch.int32)


class GuideError(ValueError):
    """A grammar this model cannot run (no tokenizer)."""


class Grammars:
    def __init__(self, tokenizer, vocab_size: int, eos_token_ids: Sequence[int]):
        if tokenizer is None:
            raise GuideError("structured outputs need the model's tokenizer; this model was loaded without one")
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.eos_token_ids = sorted(eos_token_ids)
        self._lock = threading.Lock()
        self._lltokenizer = None

    @property
    def lltokenizer(self):
        """llguidance's view of the tokenizer: about 0.6 s to build, most of it holding the GIL, so
        a worker builds it as it starts (`warm_up`) rather than stalling on its first guided request."""
        with self._lock:
            if self._lltokenizer is None:
                import llguidance.hf

                self._lltokenizer = llguidance.hf.from_tokenizer(self.tokenizer, n_vocab=self.vocab_size,
                                                                 eos_token=self.eos_token_ids or None)
            return self._lltokenizer

    def warm_up(self) -> threading.Thread:
        """Build the llguidance tokenizer on a thread of its own, now."""
        thread = threading.Thread(target=lambda: self.lltokenizer, name="grammar-warm-up", daemon=True)
        thread.start()
        return thread

    def matcher(self, guide: Guide, output_ids: Sequence[int] = ()) -> "GuideMatcher":
        return GuideMatcher(self, guide, output_ids)


class GuideMatcher:
    """One request's grammar state: `mask(row)` before it samples, `accept(token)` after. A token
    the grammar refuses (or a grammar gone wrong) never raises on the step: `error` is set and
    every later row is masked whole, so the sampler draws no token and this request alone fails."""

    def __init__(self, grammars: Grammars, guide: Guide, output_ids: Sequence[int] = ()):
        import llguidance

        self.guide = guide
        self.error: str | None = None
        self._matcher = llguidance.LLMatcher(grammars.lltokenizer, grammar_of(guide), log_level=0)
        # one bit a token, 32 to a word, filled by llguidance (not llguidance.torch: it imports
        # torch.compile's machinery, seconds at a worker's first guided request)
        self._words = torch.empty((grammars.vocab_size + 31) // 32, dtype=torch.int32)
        for token in output_ids:  # the state is the tokens so far: replayed wherever the request goes on
            self.accept(token)

    def mask(self, row: torch.Tensor) -> None:
        """Set every token the grammar does not allow next to -inf in `row` ([vocab], in place)."""
        if self.error is None:
            self._matcher.unsafe_compute_mask_ptr(self._words.data_ptr(), self._words.numel() * 4)
            if self._matcher.is_error():
                self.error = f"the {self.guide.kind} guide failed: {self._matcher.get_error()}"
        if self.error is not None:
            row.fill_(float("-inf"))
            return
        # a plain copy: the next mask is written into the same words
        words = self._words.to(row.device)
        allowed = ((words[:, None] >> _SHIFTS.to(row.device)) & 1).view(-1)[:row.shape[0]]  # [vocab]
        row.masked_fill_(allowed == 0, float("-inf"))

    def accept(self, token: int) -> None:
        if self.error is None and not self._matcher.consume_token(token):
            self.error = (f"token {token} does not continue the {self.guide.kind} guide: "
                          f"{self._matcher.get_error() or 'not allowed there'}")
