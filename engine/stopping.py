"""Per-request stop detection and streaming detokenization.

A request ends with finish reason "stop" when it samples one of the model's EOS ids (unless
ignore_eos), one of its stop_token_ids, or when its text contains one of its stop strings; and
with "length" when it reaches max_tokens or the model's context limit. Semantics follow OpenAI
and vLLM:

- The returned text ends before the stop string, and never includes the text of an EOS or stop
  token id.
- The token ids are kept as generated, up to and including the token that ended the request
  (the one that completed the stop string, or the EOS / stop id itself).
- Streamed deltas never contain a partial UTF-8 character, nor any text that could be the start
  of a stop string until the following text rules the stop string out; so the concatenated
  deltas are always a prefix of the final text.
"""
from __future__ import annotations

from dataclasses import dataclass
from enum import Enum
from typing import Callable, Collection, Sequence

from baton.sampling import SamplingParams

Decode = Callable[[Sequence[int]], str]

# Prompt tokens decoded in front of the first output token, so tokenizers that render a token
# differently at the start of a text (SentencePiece's leading space) give the right first delta.
PROMPT_CONTEXT_TOKENS = 5
# A window is re-anchored after this many tokens even while it still ends inside a character,
# which happens when every token of a run ends mid-character (byte-level BPE on CJK text).
MAX_HELD_TOKENS = 6
REPLACEMENT_CHAR = "\ufffd"


class FinishReason(str, Enum):
    STOP = "stop"
    LENGTH = "length"


class IncrementalDetokenizer:
    """Turns a stream of token ids into text deltas, decoding only a short window.

    The window is the tokens of the previous step (the prefix, decoded for context: SentencePiece
    renders a word's leading space only after other text) plus the tokens since. Each push decodes
    the window and emits its text past what was already emitted, except a trailing run of U+FFFD:
    that is an incomplete UTF-8 character, held until the next tokens complete it. When the
    window ends on a whole character the window slides forward, so each step decodes a few
    tokens, not the whole output.

    A run of tokens that all end inside a character never gives such a boundary; after
    MAX_HELD_TOKENS the window slides anyway and starts mid-character. That relies on the bytes
    before a window's first whole character decoding to U+FFFD whatever follows them, as lossy
    UTF-8 decoding (byte-level BPE) does.
    """

    def __init__(self, decode: Decode, context_ids: Sequence[int] = ()) -> None:
        self._decode = decode
        self._ids = list(context_ids)
        self._read_offset = len(self._ids)  # ids before this offset are the window's prefix
        self._emitted_chars = len(decode(self._ids)) if self._ids else 0  # of decode(self._ids)

    def push(self, token_id: int) -> str:
        """Add one token; return the newly complete text (possibly "")."""
        self._ids.append(token_id)
        return self._advance(force=False)

    def flush(self) -> str:
        """Release all held text (an incomplete trailing character decodes as U+FFFD)."""
        return self._advance(force=True)

    def _advance(self, force: bool) -> str:
        pending = len(self._ids) - self._read_offset
        if pending == 0:
            return ""
        window = self._decode(self._ids)
        safe_end = len(window) if force else len(window.rstrip(REPLACEMENT_CHAR))
        delta = window[self._emitted_chars:safe_end]
        self._emitted_chars = max(self._emitted_chars, safe_end)
        all_emitted = safe_end == len(window)
        if all_emitted or pending >= MAX_HELD_TOKENS:
            self._slide(all_emitted)
        return delta

    def _slide(self, all_emitted: bool) -> None:
        # The tokens since the last slide become the prefix; their held tail stays held.
        self._ids = self._ids[self._read_offset:]
        self._read_offset = len(self._ids)
        prefix_text = self._decode(self._ids)
        self._emitted_chars = len(prefix_text if all_emitted else prefix_text.rstrip(REPLACEMENT_CHAR))


@dataclass(frozen=True)
class StepOutput:
    text_delta: str  # text safe to stream now; "" when everything new is held back
    finish_reason: FinishReason | None = None  # None while the request goes on


class StopChecker:
    """One request's stop state: feed each sampled token to `append`, stream its deltas.

    `decode` turns token ids into text (e.g. `lambda ids: tok.decode(ids, skip_special_tokens=True)`).
    `prompt_ids` gives the context limit's starting length and the detokenizer's first context.
    """

    def __init__(self, params: SamplingParams, decode: Decode, *, eos_token_ids: Collection[int] = (),
                 prompt_ids: Sequence[int] = (), max_model_len: int | None = None) -> None:
        if max_model_len is not None and max_model_len < 1:
            raise ValueError(f"max_model_len must be >= 1 or None (got {max_model_len})")
        self.params = params
        self._detokenizer = IncrementalDetokenizer(decode, list(prompt_ids[-PROMPT_CONTEXT_TOKENS:]))
        self._eos_ids = frozenset() if params.ignore_eos else frozenset(eos_token_ids)
        self._stop_ids = frozenset(params.stop_token_ids)
        self._max_stop_chars = max((len(s) for s in params.stop), default=0)
        self._prompt_len = len(prompt_ids)
        self._max_model_len = max_model_len
        self._token_ids: list[int] = []
        self._text = ""  # all complete text decoded so far (cut at the stop string once found)
        self._emitted = 0  # characters of _text already returned as deltas
        self.finish_reason: FinishReason | None = None
        self.stop_reason: str | int | None = None  # the stop string or token id that matched

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    @property
    def token_ids(self) -> tuple[int, ...]:
        return tuple(self._token_ids)

    @property
    def text(self) -> str:
        """The text streamed so far; once finished, the whole final text."""
        return self._text[:self._emitted]

    def append(self, token_id: int) -> StepOutput:
        """Record one sampled token; return the text to stream and whether the request ended."""
        if self.finished:
            raise RuntimeError(f"request already finished ({self.finish_reason.value}); "
                               "stop feeding it tokens")
        self._token_ids.append(token_id)
        # Before min_tokens nothing ends the request but its length (the sampler holds these ids back).
        early = len(self._token_ids) <= self.params.min_tokens
        ends_by_id = not early and (token_id in self._eos_ids or token_id in self._stop_ids)
        if ends_by_id:
            new_text = self._detokenizer.flush()  # the ending token's own text is not output
        else:
            new_text = self._detokenizer.push(token_id)
            if self._length_reached():
                new_text += self._detokenizer.flush()
        old_len = len(self._text)
        self._text += new_text
        stop_at = self._find_stop_string(old_len)
        if stop_at is not None:
            self._text = self._text[:stop_at]
            self.finish_reason = FinishReason.STOP
        elif ends_by_id:
            self.finish_reason, self.stop_reason = FinishReason.STOP, token_id
        elif self._length_reached():
            self.finish_reason = FinishReason.LENGTH
        return StepOutput(self._take_delta(), self.finish_reason)

    def _length_reached(self) -> bool:
        generated = len(self._token_ids)
        if generated >= self.params.max_tokens:
            return True
        return self._max_model_len is not None and self._prompt_len + generated >= self._max_model_len

    def _find_stop_string(self, old_len: int) -> int | None:
        """Start of the earliest stop string ending in the new text, or None."""
        if not self.params.stop or len(self._text) == old_len or len(self._token_ids) < self.params.min_tokens:
            return None
        # A match absent before this step must end in the new text, so search only near it.
        start = max(0, old_len - self._max_stop_chars + 1)
        best: int | None = None
        for stop in self.params.stop:
            at = self._text.find(stop, start)
            if at != -1 and (best is None or at < best):
                best, self.stop_reason = at, stop
        return best

    def _take_delta(self) -> str:
        end = len(self._text)
        if not self.finished:
            end -= self._partial_stop_len()
        # A held-back suffix never reaches into text already emitted; max() guards that invariant.
        end = max(end, self._emitted)
        delta = self._text[self._emitted:end]
        self._emitted = end
        return delta

    def _partial_stop_len(self) -> int:
        """Length of the longest end of the text that is the start of some stop string."""
        if not self.params.stop or not self._text:
            return 0
        tail = self._text[-(self._max_stop_chars - 1):] if self._max_stop_chars > 1 else ""
        longest = 0
        for stop in self.params.stop:
            for k in range(min(len(stop) - 1, len(tail)), longest, -1):
                if stop[k - 1] == tail[-1] and tail.endswith(stop[:k]):
                    longest = k
                    break
        return longest
