"""How one request chooses its tokens and when it ends: the one `SamplingParams` the SDK, the
router and the engine all use. Plain Python (no torch), so the SDK installs without it.

Checked on construction: a bad value is a ValueError naming the field, the value and what to
change, whether it came from a Python caller, the command line or a wire message.
"""
from __future__ import annotations

import json
import math
import numbers
from dataclasses import dataclass, fields
from typing import Any

MAX_STOP_STRINGS = 16
MAX_STOP_STRING_CHARS = 256
MAX_STOP_TOKEN_IDS = 256
MAX_SEED = 2**63 - 1
MAX_LOGPROBS = 20  # alternatives per token, as OpenAI's top_logprobs allows
MAX_LOGIT_BIAS = 300  # token ids one request may bias (OpenAI's limit)
MAX_REPETITION_PENALTY = 10.0
# Below this a temperature only amplifies float noise, so it is treated as greedy (as vLLM does).
GREEDY_TEMPERATURE_EPS = 1e-5


MAX_GUIDE_CHARS = 1 << 16  # a schema, pattern or grammar
MAX_CHOICES = 256  # strings a `choice` guide picks from
GUIDE_KINDS = ("json_object", "json_schema", "regex", "choice", "grammar")

UINT32_MAX = 2**32 - 1  # the wire's bound for counts and token ids
INT32_MIN, INT32_MAX = -(2**31), 2**31 - 1


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _int_in(value: Any, low: int, high: int) -> bool:
    return _is_int(value) and low <= value <= high


@dataclass(frozen=True)
class Guide:
    """What a request's output must match (structured outputs), held by a grammar on every token
    the request samples, wherever it samples (engine.grammar). kind and spec:
    - json_object: any JSON object (spec empty);
    - json_schema: spec is a JSON Schema, as JSON text;
    - regex: spec is a regular expression the whole output matches;
    - choice: spec is a JSON list of strings, the output one of them;
    - grammar: spec is a Lark grammar (llguidance's dialect, which embeds JSON schemas with %json).
    Checked here for shape; whether a backend can compile it is checked where it compiles."""

    kind: str
    spec: str = ""

    def __post_init__(self) -> None:
        if self.kind not in GUIDE_KINDS:
            raise ValueError(f"guide kind must be one of {', '.join(GUIDE_KINDS)} (got {self.kind!r})")
        if not isinstance(self.spec, str) or len(self.spec) > MAX_GUIDE_CHARS:
            raise ValueError(f"a {self.kind} guide's spec must be a string of at most {MAX_GUIDE_CHARS} characters")
        if self.kind == "json_object":
            if self.spec:
                raise ValueError("a json_object guide takes no spec; use json_schema to give a schema")
            return
        if not self.spec.strip():
            raise ValueError(f"a {self.kind} guide needs a spec (a {self.kind.replace('_', ' ')})")
        if self.kind in ("json_schema", "choice"):
            try:
                value = json.loads(self.spec)
            except ValueError as exc:
                raise ValueError(f"a {self.kind} guide's spec must be JSON ({exc})") from None
            if self.kind == "json_schema" and not isinstance(value, (dict, bool)):
                raise ValueError("a json_schema guide's spec must be a JSON Schema object")
            if self.kind == "choice" and not (isinstance(value, list) and 0 < len(value) <= MAX_CHOICES and all(
                    isinstance(c, str) and c for c in value)):
                raise ValueError(f"a choice guide's spec must be a JSON list of 1-{MAX_CHOICES} non-empty strings")


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
    # Penalties on tokens already there (OpenAI's and vLLM's): presence and frequency subtract
    # from the logits of tokens generated so far (once, and once per occurrence); repetition
    # divides positive (multiplies negative) logits of tokens in the prompt or the output.
    presence_penalty: float = 0.0  # [-2, 2]
    frequency_penalty: float = 0.0  # [-2, 2]
    repetition_penalty: float = 1.0  # > 0; 1 = off
    min_p: float = 0.0  # drop tokens less likely than min_p times the likeliest one; 0 = off
    min_tokens: int = 0  # EOS, stop_token_ids and stop strings end the request only after this many
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, added to its logit in [-100, 100])
    guide: Guide | None = None  # structured output: what the text must match; None = free text

    def __post_init__(self) -> None:
        # Normalise JSON-ish input (lists, a single stop string, int temperatures) once here.
        if isinstance(self.logit_bias, dict):  # JSON's keys are strings: "50256" is token 50256
            pairs = [(int(k) if isinstance(k, str) and k.isdigit() else k, v) for k, v in self.logit_bias.items()]
            try:
                pairs.sort()
            except TypeError:  # keys that are not token ids: validate() names one
                pass
            object.__setattr__(self, "logit_bias", tuple(pairs))
        elif isinstance(self.logit_bias, list):
            object.__setattr__(self, "logit_bias", tuple(tuple(pair) for pair in self.logit_bias))
        if isinstance(self.guide, dict):  # {"kind": ..., "spec": ...} from JSON or the SDK
            object.__setattr__(self, "guide", Guide(**self.guide))
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        elif isinstance(self.stop, (list, tuple)):
            object.__setattr__(self, "stop", tuple(self.stop))
        if isinstance(self.stop_token_ids, (list, tuple)):
            object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids))
        for name in ("temperature", "top_p", "presence_penalty", "frequency_penalty", "repetition_penalty", "min_p"):
            value = getattr(self, name)
            if isinstance(value, numbers.Real) and not isinstance(value, bool):
                object.__setattr__(self, name, float(value))
        self.validate()

    @property
    def is_greedy(self) -> bool:
        return self.temperature < GREEDY_TEMPERATURE_EPS

    @property
    def adjusts_logits(self) -> bool:
        """Whether the logits change before sampling: penalties, a logit bias, min_tokens or a guide."""
        return bool(self.presence_penalty or self.frequency_penalty or self.repetition_penalty != 1.0
                    or self.logit_bias or self.min_tokens or self.guide)

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
        self._validate_penalties()
        if not isinstance(self.ignore_eos, bool):
            raise ValueError(f"ignore_eos must be true or false (got {self.ignore_eos!r})")
        if not _int_in(self.priority, INT32_MIN, INT32_MAX):
            raise ValueError(f"priority must be a 32-bit integer (got {self.priority!r}); higher runs first")
        if self.guide is not None and not isinstance(self.guide, Guide):
            raise ValueError(f"guide must be a Guide(kind, spec) or null (got {self.guide!r})")
        if self.guide is not None and self.ignore_eos:
            raise ValueError("ignore_eos cannot be combined with a guide: the grammar ends the output with EOS "
                             "once it is complete; drop one of them")
        if self.logprobs is not None and not _int_in(self.logprobs, 0, MAX_LOGPROBS):
            raise ValueError(f"logprobs must be an integer in 0..{MAX_LOGPROBS} or null (got {self.logprobs!r}): "
                             "how many most likely alternatives to return with each token's log probability")

    def _validate_penalties(self) -> None:
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not isinstance(value, float) or not -2.0 <= value <= 2.0:
                raise ValueError(f"{name} must be a number in [-2, 2] (got {value!r}); 0 turns it off")
        r = self.repetition_penalty
        if not isinstance(r, float) or not math.isfinite(r) or not 0.0 < r <= MAX_REPETITION_PENALTY:
            raise ValueError(f"repetition_penalty must be in (0, {MAX_REPETITION_PENALTY:g}] (got {r!r}); "
                             "1 turns it off, above 1 discourages repeats")
        if not isinstance(self.min_p, float) or not 0.0 <= self.min_p <= 1.0:
            raise ValueError(f"min_p must be in [0, 1] (got {self.min_p!r}); 0 turns it off")
        if not _int_in(self.min_tokens, 0, UINT32_MAX) or self.min_tokens > self.max_tokens:
            raise ValueError(f"min_tokens must be an integer in [0, max_tokens={self.max_tokens}] "
                             f"(got {self.min_tokens!r})")
        bias = self.logit_bias
        if not isinstance(bias, tuple) or len(bias) > MAX_LOGIT_BIAS:
            raise ValueError(f"logit_bias must map at most {MAX_LOGIT_BIAS} token ids to biases (got {bias!r})")
        for pair in bias:
            if not (isinstance(pair, tuple) and len(pair) == 2 and _int_in(pair[0], 0, UINT32_MAX)
                    and isinstance(pair[1], (int, float)) and not isinstance(pair[1], bool)
                    and -100.0 <= pair[1] <= 100.0):
                raise ValueError(f"logit_bias maps token ids (integers >= 0) to biases in [-100, 100] "
                                 f"(got {pair!r})")
        if len({token for token, _ in bias}) != len(bias):
            raise ValueError("logit_bias names a token id twice")

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
DEFAULTABLE = ("max_tokens", "temperature", "top_k", "top_p", "repetition_penalty", "min_p")
_GENERATION_CONFIG_NAMES = {"max_new_tokens": "max_tokens", "temperature": "temperature", "top_k": "top_k",
                            "top_p": "top_p", "repetition_penalty": "repetition_penalty", "min_p": "min_p"}
# Set in some generation configs, not applied by Baton: said once in the router's log.
UNAPPLIED_GENERATION_KEYS = ("typical_p", "epsilon_cutoff", "eta_cutoff", "no_repeat_ngram_size")


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
        defaults[name] = float(value) if name not in ("max_tokens", "top_k") else value
    return defaults


def fill_unset(given: dict[str, Any], defaults: dict[str, float | int]) -> dict[str, Any]:
    """A request's sampling keywords (None: left unset) with the unset ones the defaults have."""
    return {**given, **{k: v for k, v in defaults.items() if given.get(k) is None}}
