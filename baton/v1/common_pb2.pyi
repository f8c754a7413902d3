from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class SamplingParams(_message.Message):
    __slots__ = ("max_tokens", "temperature", "top_k", "top_p", "seed", "stop", "stop_token_ids", "ignore_eos", "priority", "logprobs", "presence_penalty", "frequency_penalty", "repetition_penalty", "min_p", "min_tokens", "logit_bias", "guide")
    class LogitBiasEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: int
        value: float
        def __init__(self, key: _Optional[int] = ..., value: _Optional[float] = ...) -> None: ...
    MAX_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    TOP_P_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    STOP_FIELD_NUMBER: _ClassVar[int]
    STOP_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    IGNORE_EOS_FIELD_NUMBER: _ClassVar[int]
    PRIORITY_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    PRESENCE_PENALTY_FIELD_NUMBER: _ClassVar[int]
    FREQUENCY_PENALTY_FIELD_NUMBER: _ClassVar[int]
    REPETITION_PENALTY_FIELD_NUMBER: _ClassVar[int]
    MIN_P_FIELD_NUMBER: _ClassVar[int]
    MIN_TOKENS_FIELD_NUMBER: _ClassVar[int]
    LOGIT_BIAS_FIELD_NUMBER: _ClassVar[int]
    GUIDE_FIELD_NUMBER: _ClassVar[int]
    max_tokens: int
    temperature: float
    top_k: int
    top_p: float
    seed: int
    stop: _containers.RepeatedScalarFieldContainer[str]
    stop_token_ids: _containers.RepeatedScalarFieldContainer[int]
    ignore_eos: bool
    priority: int
    logprobs: int
    presence_penalty: float
    frequency_penalty: float
    repetition_penalty: float
    min_p: float
    min_tokens: int
    logit_bias: _containers.ScalarMap[int, float]
    guide: Guide
    def __init__(self, max_tokens: _Optional[int] = ..., temperature: _Optional[float] = ..., top_k: _Optional[int] = ..., top_p: _Optional[float] = ..., seed: _Optional[int] = ..., stop: _Optional[_Iterable[str]] = ..., stop_token_ids: _Optional[_Iterable[int]] = ..., ignore_eos: _Optional[bool] = ..., priority: _Optional[int] = ..., logprobs: _Optional[int] = ..., presence_penalty: _Optional[float] = ..., frequency_penalty: _Optional[float] = ..., repetition_penalty: _Optional[float] = ..., min_p: _Optional[float] = ..., min_tokens: _Optional[int] = ..., logit_bias: _Optional[_Mapping[int, float]] = ..., guide: _Optional[_Union[Guide, _Mapping]] = ...) -> None: ...

class Guide(_message.Message):
    __slots__ = ("kind", "spec")
    KIND_FIELD_NUMBER: _ClassVar[int]
    SPEC_FIELD_NUMBER: _ClassVar[int]
    kind: str
    spec: str
    def __init__(self, kind: _Optional[str] = ..., spec: _Optional[str] = ...) -> None: ...

class TokenLogprob(_message.Message):
    __slots__ = ("token_id", "logprob", "top_token_ids", "top_logprobs")
    TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    LOGPROB_FIELD_NUMBER: _ClassVar[int]
    TOP_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    TOP_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    token_id: int
    logprob: float
    top_token_ids: _containers.RepeatedScalarFieldContainer[int]
    top_logprobs: _containers.RepeatedScalarFieldContainer[float]
    def __init__(self, token_id: _Optional[int] = ..., logprob: _Optional[float] = ..., top_token_ids: _Optional[_Iterable[int]] = ..., top_logprobs: _Optional[_Iterable[float]] = ...) -> None: ...

class ChatMessage(_message.Message):
    __slots__ = ("role", "content")
    ROLE_FIELD_NUMBER: _ClassVar[int]
    CONTENT_FIELD_NUMBER: _ClassVar[int]
    role: str
    content: str
    def __init__(self, role: _Optional[str] = ..., content: _Optional[str] = ...) -> None: ...

class Trace(_message.Message):
    __slots__ = ("stage_seconds", "cached_tokens", "predicted_cached_tokens", "prefill_worker", "decode_worker", "route")
    class StageSecondsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: float
        def __init__(self, key: _Optional[str] = ..., value: _Optional[float] = ...) -> None: ...
    STAGE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    PREDICTED_CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    PREFILL_WORKER_FIELD_NUMBER: _ClassVar[int]
    DECODE_WORKER_FIELD_NUMBER: _ClassVar[int]
    ROUTE_FIELD_NUMBER: _ClassVar[int]
    stage_seconds: _containers.ScalarMap[str, float]
    cached_tokens: int
    predicted_cached_tokens: int
    prefill_worker: str
    decode_worker: str
    route: str
    def __init__(self, stage_seconds: _Optional[_Mapping[str, float]] = ..., cached_tokens: _Optional[int] = ..., predicted_cached_tokens: _Optional[int] = ..., prefill_worker: _Optional[str] = ..., decode_worker: _Optional[str] = ..., route: _Optional[str] = ...) -> None: ...

class Usage(_message.Message):
    __slots__ = ("prompt_tokens", "completion_tokens", "cached_tokens")
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    COMPLETION_TOKENS_FIELD_NUMBER: _ClassVar[int]
    CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int
    def __init__(self, prompt_tokens: _Optional[int] = ..., completion_tokens: _Optional[int] = ..., cached_tokens: _Optional[int] = ...) -> None: ...

class DecodeLoad(_message.Message):
    __slots__ = ("rows_in_use", "max_rows", "kv_bytes_allocated", "kv_bytes_useful", "staged_bytes", "staging_capacity_bytes", "waiting_for_kv", "staged", "prompt_tokens_forwarded", "decode_tokens_forwarded", "requests_finished", "model_fingerprint", "draining", "preemptions", "parked_bytes", "migrations_out", "migrations_failed", "migrations_in", "max_context", "kv_budget_bytes", "kv_bytes_per_token", "settings")
    ROWS_IN_USE_FIELD_NUMBER: _ClassVar[int]
    MAX_ROWS_FIELD_NUMBER: _ClassVar[int]
    KV_BYTES_ALLOCATED_FIELD_NUMBER: _ClassVar[int]
    KV_BYTES_USEFUL_FIELD_NUMBER: _ClassVar[int]
    STAGED_BYTES_FIELD_NUMBER: _ClassVar[int]
    STAGING_CAPACITY_BYTES_FIELD_NUMBER: _ClassVar[int]
    WAITING_FOR_KV_FIELD_NUMBER: _ClassVar[int]
    STAGED_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKENS_FORWARDED_FIELD_NUMBER: _ClassVar[int]
    DECODE_TOKENS_FORWARDED_FIELD_NUMBER: _ClassVar[int]
    REQUESTS_FINISHED_FIELD_NUMBER: _ClassVar[int]
    MODEL_FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    DRAINING_FIELD_NUMBER: _ClassVar[int]
    PREEMPTIONS_FIELD_NUMBER: _ClassVar[int]
    PARKED_BYTES_FIELD_NUMBER: _ClassVar[int]
    MIGRATIONS_OUT_FIELD_NUMBER: _ClassVar[int]
    MIGRATIONS_FAILED_FIELD_NUMBER: _ClassVar[int]
    MIGRATIONS_IN_FIELD_NUMBER: _ClassVar[int]
    MAX_CONTEXT_FIELD_NUMBER: _ClassVar[int]
    KV_BUDGET_BYTES_FIELD_NUMBER: _ClassVar[int]
    KV_BYTES_PER_TOKEN_FIELD_NUMBER: _ClassVar[int]
    SETTINGS_FIELD_NUMBER: _ClassVar[int]
    rows_in_use: int
    max_rows: int
    kv_bytes_allocated: int
    kv_bytes_useful: int
    staged_bytes: int
    staging_capacity_bytes: int
    waiting_for_kv: int
    staged: int
    prompt_tokens_forwarded: int
    decode_tokens_forwarded: int
    requests_finished: int
    model_fingerprint: str
    draining: bool
    preemptions: int
    parked_bytes: int
    migrations_out: int
    migrations_failed: int
    migrations_in: int
    max_context: int
    kv_budget_bytes: int
    kv_bytes_per_token: int
    settings: _containers.RepeatedCompositeFieldContainer[Setting]
    def __init__(self, rows_in_use: _Optional[int] = ..., max_rows: _Optional[int] = ..., kv_bytes_allocated: _Optional[int] = ..., kv_bytes_useful: _Optional[int] = ..., staged_bytes: _Optional[int] = ..., staging_capacity_bytes: _Optional[int] = ..., waiting_for_kv: _Optional[int] = ..., staged: _Optional[int] = ..., prompt_tokens_forwarded: _Optional[int] = ..., decode_tokens_forwarded: _Optional[int] = ..., requests_finished: _Optional[int] = ..., model_fingerprint: _Optional[str] = ..., draining: _Optional[bool] = ..., preemptions: _Optional[int] = ..., parked_bytes: _Optional[int] = ..., migrations_out: _Optional[int] = ..., migrations_failed: _Optional[int] = ..., migrations_in: _Optional[int] = ..., max_context: _Optional[int] = ..., kv_budget_bytes: _Optional[int] = ..., kv_bytes_per_token: _Optional[int] = ..., settings: _Optional[_Iterable[_Union[Setting, _Mapping]]] = ...) -> None: ...

class PrefillLoad(_message.Message):
    __slots__ = ("queued", "max_queue", "queued_tokens", "prompt_tokens_forwarded", "requests_done", "model_fingerprint", "block_size", "cached_tokens_total", "prefix_cache_bytes", "draining", "epoch", "settings", "pulls_kv")
    QUEUED_FIELD_NUMBER: _ClassVar[int]
    MAX_QUEUE_FIELD_NUMBER: _ClassVar[int]
    QUEUED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKENS_FORWARDED_FIELD_NUMBER: _ClassVar[int]
    REQUESTS_DONE_FIELD_NUMBER: _ClassVar[int]
    MODEL_FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    CACHED_TOKENS_TOTAL_FIELD_NUMBER: _ClassVar[int]
    PREFIX_CACHE_BYTES_FIELD_NUMBER: _ClassVar[int]
    DRAINING_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    SETTINGS_FIELD_NUMBER: _ClassVar[int]
    PULLS_KV_FIELD_NUMBER: _ClassVar[int]
    queued: int
    max_queue: int
    queued_tokens: int
    prompt_tokens_forwarded: int
    requests_done: int
    model_fingerprint: str
    block_size: int
    cached_tokens_total: int
    prefix_cache_bytes: int
    draining: bool
    epoch: str
    settings: _containers.RepeatedCompositeFieldContainer[Setting]
    pulls_kv: bool
    def __init__(self, queued: _Optional[int] = ..., max_queue: _Optional[int] = ..., queued_tokens: _Optional[int] = ..., prompt_tokens_forwarded: _Optional[int] = ..., requests_done: _Optional[int] = ..., model_fingerprint: _Optional[str] = ..., block_size: _Optional[int] = ..., cached_tokens_total: _Optional[int] = ..., prefix_cache_bytes: _Optional[int] = ..., draining: _Optional[bool] = ..., epoch: _Optional[str] = ..., settings: _Optional[_Iterable[_Union[Setting, _Mapping]]] = ..., pulls_kv: _Optional[bool] = ...) -> None: ...

class Setting(_message.Message):
    __slots__ = ("name", "value", "chosen_by")
    NAME_FIELD_NUMBER: _ClassVar[int]
    VALUE_FIELD_NUMBER: _ClassVar[int]
    CHOSEN_BY_FIELD_NUMBER: _ClassVar[int]
    name: str
    value: float
    chosen_by: str
    def __init__(self, name: _Optional[str] = ..., value: _Optional[float] = ..., chosen_by: _Optional[str] = ...) -> None: ...

class LoadRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...
