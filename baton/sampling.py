"""How one request chooses its tokens and when it ends: the one `SamplingParams` the SDK, the
router and the engine all use. Plain Python (no torch), so the SDK installs without it.

Checked on construction: a bad value is a ValueError naming the field, the value and what to
change, whether it came from a Python caller, the command line or a wire message.
"""
from __future__ import annotations

import math
import numbers
from dataclasses import dataclass, fields
from typing import Any

MAX_STOP_STRINGS = 16
MAX_STOP_STRING_CHARS = 256
MAX_STOP_TOKEN_IDS = 256
MAX_SEED = 2**63 - 1
MAX_LOGPROBS = 20  # alternatives per token, as OpenAI's top_logprobs allows
# Below this a temperature only amplifies float noise, so it is treated as greedy (as vLLM does).
GREEDY_TEMPERATURE_EPS = 1e-5


UINT32_MAX = 2**32 - 1  # the wire's bound for counts and token ids
INT32_MIN, INT32_MAX = -(2**31), 2**31 - 1


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _int_in(value: Any, low: int, high: int) -> bool:
    return _is_int(value) and low <= value <= high


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
    logprobs: int | None = None  # each token's log probability and this many alternatives; None = off

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
        if not _int_in(self.max_tokens, 1, UINT32_MAX):
            raise ValueError(f"max_tokens must be an integer >= 1 (got {self.max_tokens!r}); "
                             "ask for at least one new token")
        t = self.temperature
        if not isinstance(t, float) or not math.isfinite(t) or t < 0:
            raise ValueError(f"temperature must be a finite number >= 0 (got {t!r}); "
                             "use 0 for greedy decoding or e.g. 0.7 for sampling")
        if not _int_in(self.top_k, 0, UINT32_MAX):
            raise ValueError(f"top_k must be an integer >= 0 (got {self.top_k!r}); use 0 to turn it off")
        p = self.top_p
        if not isinstance(p, float) or not 0.0 < p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1] (got {p!r}); use 1.0 to turn it off")
        if self.seed is not None and (not _is_int(self.seed) or not 0 <= self.seed <= MAX_SEED):
            raise ValueError(f"seed must be an integer in 0..2**63-1 or null (got {self.seed!r})")
        self._validate_stops()
        if not isinstance(self.ignore_eos, bool):
            raise ValueError(f"ignore_eos must be true or false (got {self.ignore_eos!r})")
        if not _int_in(self.priority, INT32_MIN, INT32_MAX):
            raise ValueError(f"priority must be a 32-bit integer (got {self.priority!r}); higher runs first")
        if self.logprobs is not None and not _int_in(self.logprobs, 0, MAX_LOGPROBS):
            raise ValueError(f"logprobs must be an integer in 0..{MAX_LOGPROBS} or null (got {self.logprobs!r}): "
                             "how many most likely alternatives to return with each token's log probability")

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
            if not _int_in(token_id, 0, UINT32_MAX):
                raise ValueError(f"stop_token_ids must be integers >= 0 (got {token_id!r}); "
                                 "remove negative or non-integer ids")

    @classmethod
    def from_kwargs(cls, kwargs: dict[str, Any]) -> "SamplingParams":
        """Build from keyword arguments (the SDK's): None leaves a default; an unknown name is a
        TypeError listing the known ones."""
        unknown = sorted(set(kwargs) - SAMPLING_OPTION_NAMES)
        if unknown:
            raise TypeError(f"unknown sampling option(s) {', '.join(unknown)}; "
                            f"known: {', '.join(sorted(SAMPLING_OPTION_NAMES))}")
        return cls(**{name: value for name, value in kwargs.items() if value is not None})


@dataclass(frozen=True)
class TokenLogprob:
    """One generated token's log probability under the model (log-softmax of the raw logits, before
    temperature, top-k or top-p) and the most likely tokens at that step, most likely first."""

    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()  # (token id, log probability)


SAMPLING_OPTION_NAMES = frozenset(f.name for f in fields(SamplingParams))


# -- a model's default sampling ---------------------------------------------------------------------

# What a model may default for requests that leave it unset, as vLLM applies a model's
# generation_config: Hugging Face's names (generation_config.json) map onto Baton's.
DEFAULTABLE = ("max_tokens", "temperature", "top_k", "top_p")
_GENERATION_CONFIG_NAMES = {"max_new_tokens": "max_tokens", "temperature": "temperature", "top_k": "top_k",
                            "top_p": "top_p"}
# Set in some generation configs, not (yet) applied by Baton: said once in the router's log.
UNAPPLIED_GENERATION_KEYS = ("repetition_penalty", "min_p", "presence_penalty", "frequency_penalty")


def sampling_defaults(values: dict[str, Any], source: str, *, strict: bool = True) -> dict[str, float | int]:
    """Checked default sampling from a generation config (`max_new_tokens`, `temperature`, `top_k`,
    `top_p`, or Baton's `max_tokens`); other keys are refused naming `source` when `strict` (an
    operator's override), else skipped (a model's generation_config.json holds much else).
    Values are checked as a request's would be; ValueError says which and where."""
    if not isinstance(values, dict):
        raise ValueError(f"{source}: expected a JSON object such as {{\"temperature\": 0.7, \"top_p\": 0.9}} "
                         f"(got {values!r})")
    defaults: dict[str, float | int] = {}
    for key, value in values.items():
        name = _GENERATION_CONFIG_NAMES.get(key, key if key in DEFAULTABLE else None)
        if name is None:
            if strict:
                raise ValueError(f"{source}: {key!r} is not a sampling default Baton applies; use "
                                 f"{', '.join(sorted({*_GENERATION_CONFIG_NAMES, *DEFAULTABLE}))}")
            continue
        if value is None:
            continue
        try:
            SamplingParams(**{name: value})
        except ValueError as exc:
            raise ValueError(f"{source}: {exc}") from None
        defaults[name] = float(value) if name in ("temperature", "top_p") else value
    return defaults


def fill_unset(given: dict[str, Any], defaults: dict[str, float | int]) -> dict[str, Any]:
    """A request's sampling keywords (None: left unset) with the unset ones the defaults have."""
    return {**given, **{k: v for k, v in defaults.items() if given.get(k) is None}}
