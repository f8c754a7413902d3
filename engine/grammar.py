"""A request's structured output held on every token it samples: one llguidance matcher per
request masks its logits row and follows the tokens drawn.

A matcher's state is the tokens generated so far, so a worker continuing a request (the decode
worker after the prefill's first token, a handoff, a failover's re-prefill, a parked row's
resume) rebuilds it by replaying them: nothing has to travel but the token ids that travel
anyway. One `Grammars` per model holds the llguidance tokenizer (built once, about half a
second); compiled grammars are cached by `baton.guides.grammar_of`.

A mask is computed beside the step, not in series with it: as soon as a matcher accepts a token
it starts the next mask on the model's mask thread (llguidance drops the GIL while it computes),
so the mask is ready when the next step's logits are and the sampler only applies it.
"""
from __future__ import annotations

import threading
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Sequence

import torch

from baton.guides import grammar_of
from baton.sampling import Guide


# A byte of the mask (8 tokens, lowest bit first) -> what those tokens' logits get added: 0 where
# allowed, -inf where not. Applying it is one gather and one add (~40 us for a 49k vocabulary on
# one core; unpacking bits and masked_fill took 330 us).
_BYTE_BIAS = torch.where(((torch.arange(256)[:, None] >> torch.arange(8)) & 1).bool(), 0.0, float("-inf"))
_byte_bias: dict[tuple[torch.device, torch.dtype], torch.Tensor] = {}


def _bias_table(device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    table = _byte_bias.get((device, dtype))
    if table is None:
        table = _byte_bias[(device, dtype)] = _BYTE_BIAS.to(device=device, dtype=dtype)
    return table


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
        # one thread: a mask takes tens of microseconds, a step tens of milliseconds
        self.mask_thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="grammar-mask")

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
        """Build the llguidance tokenizer on a thread of its own, now. Not a daemon: the interpreter
        waits for it at exit (under a second), where a daemon thread still inside llguidance is
        unwound through its Rust frames by pthread_exit and the process dies of SIGSEGV (3 exits
        in 8 on one core)."""
        thread = threading.Thread(target=lambda: self.lltokenizer, name="grammar-warm-up")
        thread.start()
        return thread

    def matcher(self, guide: Guide, output_ids: Sequence[int] = ()) -> "GuideMatcher":
        return GuideMatcher(self, guide, output_ids)


class GuideMatcher:
    """One request's grammar state: `mask(row)` before it samples, `accept(token)` after. A token
    the grammar refuses (or a grammar gone wrong) never raises on the step: `error` is set and
    every later row is masked whole, so the sampler draws no token and this request alone fails.

    The next mask is computed on the mask thread from `accept` on; `mask` waits for it. The matcher
    and its words are never touched while that runs: `accept` and `mask` both wait first."""

    def __init__(self, grammars: Grammars, guide: Guide, output_ids: Sequence[int] = ()):
        import llguidance

        self.guide = guide
        self.error: str | None = None
        self._matcher = llguidance.LLMatcher(grammars.lltokenizer, grammar_of(guide), log_level=0)
        # one bit a token, 32 to a word, filled by llguidance (not llguidance.torch: it imports
        # torch.compile's machinery, seconds at a worker's first guided request)
        self._words = torch.empty((grammars.vocab_size + 31) // 32, dtype=torch.int32)
        self._thread = grammars.mask_thread
        self._next: Future | None = None  # the next mask, being computed into _words
        for token in output_ids:  # the state is the tokens so far: replayed wherever the request goes on
            self._consume(token)
        self._start_next()

    def _start_next(self) -> None:
        if self.error is None:
            self._next = self._thread.submit(self._compute)

    def _compute(self) -> None:
        self._matcher.unsafe_compute_mask_ptr(self._words.data_ptr(), self._words.numel() * 4)

    def _wait(self) -> None:
        """The mask being computed, finished (its words ready, the matcher free)."""
        if self._next is not None:
            next_, self._next = self._next, None
            try:
                next_.result()
            except Exception as exc:  # noqa: BLE001 -- this request fails, not the step
                self.error = f"the {self.guide.kind} guide failed: {exc}"
            if self.error is None and self._matcher.is_error():
                self.error = f"the {self.guide.kind} guide failed: {self._matcher.get_error()}"

    def mask(self, row: torch.Tensor) -> None:
        """Set every token the grammar does not allow next to -inf in `row` ([vocab], in place)."""
        if self._next is None:  # not started (a mask asked for twice without a token between)
            self._start_next()
        self._wait()
        if self.error is not None:
            row.fill_(float("-inf"))
            return
        # the words' bytes in memory order are tokens 8b..8b+7, lowest bit first (little-endian)
        mask_bytes = self._words.view(torch.uint8).to(row.device).int()
        bias = _bias_table(row.device, row.dtype).index_select(0, mask_bytes).view(-1)  # [vocab rounded up]
        row.add_(bias[:row.shape[0]])

    def accept(self, token: int) -> None:
        """The token drawn: the state moves on and the next mask starts."""
        self._wait()
        self._consume(token)
        self._start_next()

    def _consume(self, token: int) -> None:
        if self.error is None and not self._matcher.consume_token(token):
            self.error = (f"token {token} does not continue the {self.guide.kind} guide: "
                          f"{self._matcher.get_error() or 'not allowed there'}")
