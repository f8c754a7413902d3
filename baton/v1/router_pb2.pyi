from baton.v1 import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class ChatMessages(_message.Message):
    __slots__ = ("messages",)
    MESSAGES_FIELD_NUMBER: _ClassVar[int]
    messages: _containers.RepeatedCompositeFieldContainer[_common_pb2.ChatMessage]
    def __init__(self, messages: _Optional[_Iterable[_Union[_common_pb2.ChatMessage, _Mapping]]] = ...) -> None: ...

class TokenIds(_message.Message):
    __slots__ = ("ids",)
    IDS_FIELD_NUMBER: _ClassVar[int]
    ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, ids: _Optional[_Iterable[int]] = ...) -> None: ...

class GenerateRequest(_message.Message):
    __slots__ = ("request_id", "text", "messages", "token_ids", "sampling")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    MESSAGES_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    text: str
    messages: ChatMessages
    token_ids: TokenIds
    sampling: _common_pb2.SamplingParams
    def __init__(self, request_id: _Optional[str] = ..., text: _Optional[str] = ..., messages: _Optional[_Union[ChatMessages, _Mapping]] = ..., token_ids: _Optional[_Union[TokenIds, _Mapping]] = ..., sampling: _Optional[_Union[_common_pb2.SamplingParams, _Mapping]] = ...) -> None: ...

class GenerateResponse(_message.Message):
    __slots__ = ("request_id", "token_ids", "text_delta", "finish_reason", "usage", "trace", "prompt_token_ids", "logprobs")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    TEXT_DELTA_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    USAGE_FIELD_NUMBER: _ClassVar[int]
    TRACE_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    text_delta: str
    finish_reason: str
    usage: _common_pb2.Usage
    trace: _common_pb2.Trace
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    logprobs: _containers.RepeatedCompositeFieldContainer[_common_pb2.TokenLogprob]
    def __init__(self, request_id: _Optional[str] = ..., token_ids: _Optional[_Iterable[int]] = ..., text_delta: _Optional[str] = ..., finish_reason: _Optional[str] = ..., usage: _Optional[_Union[_common_pb2.Usage, _Mapping]] = ..., trace: _Optional[_Union[_common_pb2.Trace, _Mapping]] = ..., prompt_token_ids: _Optional[_Iterable[int]] = ..., logprobs: _Optional[_Iterable[_Union[_common_pb2.TokenLogprob, _Mapping]]] = ...) -> None: ...

class GenerateBatchRequest(_message.Message):
    __slots__ = ("requests", "max_concurrency")
    REQUESTS_FIELD_NUMBER: _ClassVar[int]
    MAX_CONCURRENCY_FIELD_NUMBER: _ClassVar[int]
    requests: _containers.RepeatedCompositeFieldContainer[GenerateRequest]
    max_concurrency: int
    def __init__(self, requests: _Optional[_Iterable[_Union[GenerateRequest, _Mapping]]] = ..., max_concurrency: _Optional[int] = ...) -> None: ...

class BatchSummary(_message.Message):
    __slots__ = ("requests", "failed", "prompt_tokens", "planned_saved_tokens", "cached_tokens", "planned_saving_ratio", "optimum_saving_ratio", "actual_saving_ratio", "groups", "seconds", "routing_accuracy", "pinned_computed_tokens")
    REQUESTS_FIELD_NUMBER: _ClassVar[int]
    FAILED_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    PLANNED_SAVED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    PLANNED_SAVING_RATIO_FIELD_NUMBER: _ClassVar[int]
    OPTIMUM_SAVING_RATIO_FIELD_NUMBER: _ClassVar[int]
    ACTUAL_SAVING_RATIO_FIELD_NUMBER: _ClassVar[int]
    GROUPS_FIELD_NUMBER: _ClassVar[int]
    SECONDS_FIELD_NUMBER: _ClassVar[int]
    ROUTING_ACCURACY_FIELD_NUMBER: _ClassVar[int]
    PINNED_COMPUTED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    requests: int
    failed: int
    prompt_tokens: int
    planned_saved_tokens: int
    cached_tokens: int
    planned_saving_ratio: float
    optimum_saving_ratio: float
    actual_saving_ratio: float
    groups: int
    seconds: float
    routing_accuracy: float
    pinned_computed_tokens: int
    def __init__(self, requests: _Optional[int] = ..., failed: _Optional[int] = ..., prompt_tokens: _Optional[int] = ..., planned_saved_tokens: _Optional[int] = ..., cached_tokens: _Optional[int] = ..., planned_saving_ratio: _Optional[float] = ..., optimum_saving_ratio: _Optional[float] = ..., actual_saving_ratio: _Optional[float] = ..., groups: _Optional[int] = ..., seconds: _Optional[float] = ..., routing_accuracy: _Optional[float] = ..., pinned_computed_tokens: _Optional[int] = ...) -> None: ...

class GenerateBatchResponse(_message.Message):
    __slots__ = ("index", "result", "error_code", "error_message", "summary", "retry_after_s")
    INDEX_FIELD_NUMBER: _ClassVar[int]
    RESULT_FIELD_NUMBER: _ClassVar[int]
    ERROR_CODE_FIELD_NUMBER: _ClassVar[int]
    ERROR_MESSAGE_FIELD_NUMBER: _ClassVar[int]
    SUMMARY_FIELD_NUMBER: _ClassVar[int]
    RETRY_AFTER_S_FIELD_NUMBER: _ClassVar[int]
    index: int
    result: GenerateResponse
    error_code: str
    error_message: str
    summary: BatchSummary
    retry_after_s: float
    def __init__(self, index: _Optional[int] = ..., result: _Optional[_Union[GenerateResponse, _Mapping]] = ..., error_code: _Optional[str] = ..., error_message: _Optional[str] = ..., summary: _Optional[_Union[BatchSummary, _Mapping]] = ..., retry_after_s: _Optional[float] = ...) -> None: ...

class ModelInfoRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ModelInfo(_message.Message):
    __slots__ = ("name", "max_context", "model_fingerprint", "vocab_size", "sampling_defaults", "workers")
    class SamplingDefaultsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: float
        def __init__(self, key: _Optional[str] = ..., value: _Optional[float] = ...) -> None: ...
    NAME_FIELD_NUMBER: _ClassVar[int]
    MAX_CONTEXT_FIELD_NUMBER: _ClassVar[int]
    MODEL_FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    VOCAB_SIZE_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_DEFAULTS_FIELD_NUMBER: _ClassVar[int]
    WORKERS_FIELD_NUMBER: _ClassVar[int]
    name: str
    max_context: int
    model_fingerprint: str
    vocab_size: int
    sampling_defaults: _containers.ScalarMap[str, float]
    workers: _containers.RepeatedCompositeFieldContainer[WorkerSettings]
    def __init__(self, name: _Optional[str] = ..., max_context: _Optional[int] = ..., model_fingerprint: _Optional[str] = ..., vocab_size: _Optional[int] = ..., sampling_defaults: _Optional[_Mapping[str, float]] = ..., workers: _Optional[_Iterable[_Union[WorkerSettings, _Mapping]]] = ...) -> None: ...

class WorkerSettings(_message.Message):
    __slots__ = ("address", "role", "settings")
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    ROLE_FIELD_NUMBER: _ClassVar[int]
    SETTINGS_FIELD_NUMBER: _ClassVar[int]
    address: str
    role: str
    settings: _containers.RepeatedCompositeFieldContainer[_common_pb2.Setting]
    def __init__(self, address: _Optional[str] = ..., role: _Optional[str] = ..., settings: _Optional[_Iterable[_Union[_common_pb2.Setting, _Mapping]]] = ...) -> None: ...

class ClusterStatusRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class WorkerStatus(_message.Message):
    __slots__ = ("address", "role", "healthy", "decode", "prefill", "cache_synced")
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    ROLE_FIELD_NUMBER: _ClassVar[int]
    HEALTHY_FIELD_NUMBER: _ClassVar[int]
    DECODE_FIELD_NUMBER: _ClassVar[int]
    PREFILL_FIELD_NUMBER: _ClassVar[int]
    CACHE_SYNCED_FIELD_NUMBER: _ClassVar[int]
    address: str
    role: str
    healthy: bool
    decode: _common_pb2.DecodeLoad
    prefill: _common_pb2.PrefillLoad
    cache_synced: bool
    def __init__(self, address: _Optional[str] = ..., role: _Optional[str] = ..., healthy: _Optional[bool] = ..., decode: _Optional[_Union[_common_pb2.DecodeLoad, _Mapping]] = ..., prefill: _Optional[_Union[_common_pb2.PrefillLoad, _Mapping]] = ..., cache_synced: _Optional[bool] = ...) -> None: ...

class RoutingStats(_message.Message):
    __slots__ = ("requests", "predicted_cached_tokens", "actual_cached_tokens", "accuracy", "local_requests", "local_predicted_cached_tokens", "local_actual_cached_tokens", "local_accuracy", "ttft_bounds_s", "ttft_counts", "prefilled_again", "pulled_requests", "pulled_tokens")
    REQUESTS_FIELD_NUMBER: _ClassVar[int]
    PREDICTED_CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    ACTUAL_CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    ACCURACY_FIELD_NUMBER: _ClassVar[int]
    LOCAL_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    LOCAL_PREDICTED_CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    LOCAL_ACTUAL_CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    LOCAL_ACCURACY_FIELD_NUMBER: _ClassVar[int]
    TTFT_BOUNDS_S_FIELD_NUMBER: _ClassVar[int]
    TTFT_COUNTS_FIELD_NUMBER: _ClassVar[int]
    PREFILLED_AGAIN_FIELD_NUMBER: _ClassVar[int]
    PULLED_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    PULLED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    requests: int
    predicted_cached_tokens: int
    actual_cached_tokens: int
    accuracy: float
    local_requests: int
    local_predicted_cached_tokens: int
    local_actual_cached_tokens: int
    local_accuracy: float
    ttft_bounds_s: _containers.RepeatedScalarFieldContainer[float]
    ttft_counts: _containers.RepeatedScalarFieldContainer[int]
    prefilled_again: int
    pulled_requests: int
    pulled_tokens: int
    def __init__(self, requests: _Optional[int] = ..., predicted_cached_tokens: _Optional[int] = ..., actual_cached_tokens: _Optional[int] = ..., accuracy: _Optional[float] = ..., local_requests: _Optional[int] = ..., local_predicted_cached_tokens: _Optional[int] = ..., local_actual_cached_tokens: _Optional[int] = ..., local_accuracy: _Optional[float] = ..., ttft_bounds_s: _Optional[_Iterable[float]] = ..., ttft_counts: _Optional[_Iterable[int]] = ..., prefilled_again: _Optional[int] = ..., pulled_requests: _Optional[int] = ..., pulled_tokens: _Optional[int] = ...) -> None: ...

class ClusterStatus(_message.Message):
    __slots__ = ("workers", "routing")
    WORKERS_FIELD_NUMBER: _ClassVar[int]
    ROUTING_FIELD_NUMBER: _ClassVar[int]
    workers: _containers.RepeatedCompositeFieldContainer[WorkerStatus]
    routing: RoutingStats
    def __init__(self, workers: _Optional[_Iterable[_Union[WorkerStatus, _Mapping]]] = ..., routing: _Optional[_Union[RoutingStats, _Mapping]] = ...) -> None: ...
