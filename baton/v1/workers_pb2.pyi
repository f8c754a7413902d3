from baton.v1 import common_pb2 as _common_pb2
from baton.v1 import kvtransfer_pb2 as _kvtransfer_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class ReadKVRequest(_message.Message):
    __slots__ = ("request_id", "push_token", "num_tokens")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    PUSH_TOKEN_FIELD_NUMBER: _ClassVar[int]
    NUM_TOKENS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    push_token: str
    num_tokens: int
    def __init__(self, request_id: _Optional[str] = ..., push_token: _Optional[str] = ..., num_tokens: _Optional[int] = ...) -> None: ...

class PrefillRequest(_message.Message):
    __slots__ = ("request_id", "prompt_token_ids", "sampling", "decode_target", "model_fingerprint", "resume_step", "push_token", "kv_skip_tokens")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    DECODE_TARGET_FIELD_NUMBER: _ClassVar[int]
    MODEL_FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    RESUME_STEP_FIELD_NUMBER: _ClassVar[int]
    PUSH_TOKEN_FIELD_NUMBER: _ClassVar[int]
    KV_SKIP_TOKENS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    sampling: _common_pb2.SamplingParams
    decode_target: str
    model_fingerprint: str
    resume_step: int
    push_token: str
    kv_skip_tokens: int
    def __init__(self, request_id: _Optional[str] = ..., prompt_token_ids: _Optional[_Iterable[int]] = ..., sampling: _Optional[_Union[_common_pb2.SamplingParams, _Mapping]] = ..., decode_target: _Optional[str] = ..., model_fingerprint: _Optional[str] = ..., resume_step: _Optional[int] = ..., push_token: _Optional[str] = ..., kv_skip_tokens: _Optional[int] = ...) -> None: ...

class PrefillReply(_message.Message):
    __slots__ = ("request_id", "first_token", "cached_tokens", "computed_tokens", "queue_seconds", "prefill_seconds", "transfer_seconds", "seed", "pulled_tokens")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    FIRST_TOKEN_FIELD_NUMBER: _ClassVar[int]
    CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    COMPUTED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    QUEUE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    PREFILL_SECONDS_FIELD_NUMBER: _ClassVar[int]
    TRANSFER_SECONDS_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    PULLED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    first_token: int
    cached_tokens: int
    computed_tokens: int
    queue_seconds: float
    prefill_seconds: float
    transfer_seconds: float
    seed: int
    pulled_tokens: int
    def __init__(self, request_id: _Optional[str] = ..., first_token: _Optional[int] = ..., cached_tokens: _Optional[int] = ..., computed_tokens: _Optional[int] = ..., queue_seconds: _Optional[float] = ..., prefill_seconds: _Optional[float] = ..., transfer_seconds: _Optional[float] = ..., seed: _Optional[int] = ..., pulled_tokens: _Optional[int] = ...) -> None: ...

class PinPrefixRequest(_message.Message):
    __slots__ = ("group_id", "token_ids")
    GROUP_ID_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    group_id: str
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, group_id: _Optional[str] = ..., token_ids: _Optional[_Iterable[int]] = ...) -> None: ...

class PinPrefixReply(_message.Message):
    __slots__ = ("pinned_tokens", "computed_tokens")
    PINNED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    COMPUTED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    pinned_tokens: int
    computed_tokens: int
    def __init__(self, pinned_tokens: _Optional[int] = ..., computed_tokens: _Optional[int] = ...) -> None: ...

class WatchCacheRequest(_message.Message):
    __slots__ = ("epoch", "after_seq")
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    AFTER_SEQ_FIELD_NUMBER: _ClassVar[int]
    epoch: str
    after_seq: int
    def __init__(self, epoch: _Optional[str] = ..., after_seq: _Optional[int] = ...) -> None: ...

class CacheEvent(_message.Message):
    __slots__ = ("epoch", "seq", "snapshot", "stored", "evicted")
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    SEQ_FIELD_NUMBER: _ClassVar[int]
    SNAPSHOT_FIELD_NUMBER: _ClassVar[int]
    STORED_FIELD_NUMBER: _ClassVar[int]
    EVICTED_FIELD_NUMBER: _ClassVar[int]
    epoch: str
    seq: int
    snapshot: bool
    stored: _containers.RepeatedScalarFieldContainer[int]
    evicted: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, epoch: _Optional[str] = ..., seq: _Optional[int] = ..., snapshot: _Optional[bool] = ..., stored: _Optional[_Iterable[int]] = ..., evicted: _Optional[_Iterable[int]] = ...) -> None: ...

class UnpinPrefixRequest(_message.Message):
    __slots__ = ("group_id",)
    GROUP_ID_FIELD_NUMBER: _ClassVar[int]
    group_id: str
    def __init__(self, group_id: _Optional[str] = ...) -> None: ...

class UnpinPrefixReply(_message.Message):
    __slots__ = ("found",)
    FOUND_FIELD_NUMBER: _ClassVar[int]
    found: bool
    def __init__(self, found: _Optional[bool] = ...) -> None: ...

class CancelRequest(_message.Message):
    __slots__ = ("request_id",)
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    def __init__(self, request_id: _Optional[str] = ...) -> None: ...

class CancelReply(_message.Message):
    __slots__ = ("found",)
    FOUND_FIELD_NUMBER: _ClassVar[int]
    found: bool
    def __init__(self, found: _Optional[bool] = ...) -> None: ...

class DecodeRequest(_message.Message):
    __slots__ = ("request_id", "prompt_token_ids", "sampling", "resume_step", "push_token", "prefill_here")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    RESUME_STEP_FIELD_NUMBER: _ClassVar[int]
    PUSH_TOKEN_FIELD_NUMBER: _ClassVar[int]
    PREFILL_HERE_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    sampling: _common_pb2.SamplingParams
    resume_step: int
    push_token: str
    prefill_here: bool
    def __init__(self, request_id: _Optional[str] = ..., prompt_token_ids: _Optional[_Iterable[int]] = ..., sampling: _Optional[_Union[_common_pb2.SamplingParams, _Mapping]] = ..., resume_step: _Optional[int] = ..., push_token: _Optional[str] = ..., prefill_here: _Optional[bool] = ...) -> None: ...

class DecodeResponse(_message.Message):
    __slots__ = ("token_ids", "text_delta", "finish_reason", "stage_seconds", "moving", "seed", "logprobs", "held_prefix_tokens", "cached_tokens", "prefill_seconds")
    class StageSecondsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: float
        def __init__(self, key: _Optional[str] = ..., value: _Optional[float] = ...) -> None: ...
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    TEXT_DELTA_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    STAGE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    MOVING_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    HELD_PREFIX_TOKENS_FIELD_NUMBER: _ClassVar[int]
    CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    PREFILL_SECONDS_FIELD_NUMBER: _ClassVar[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    text_delta: str
    finish_reason: str
    stage_seconds: _containers.ScalarMap[str, float]
    moving: bool
    seed: int
    logprobs: _containers.RepeatedCompositeFieldContainer[_common_pb2.TokenLogprob]
    held_prefix_tokens: int
    cached_tokens: int
    prefill_seconds: float
    def __init__(self, token_ids: _Optional[_Iterable[int]] = ..., text_delta: _Optional[str] = ..., finish_reason: _Optional[str] = ..., stage_seconds: _Optional[_Mapping[str, float]] = ..., moving: _Optional[bool] = ..., seed: _Optional[int] = ..., logprobs: _Optional[_Iterable[_Union[_common_pb2.TokenLogprob, _Mapping]]] = ..., held_prefix_tokens: _Optional[int] = ..., cached_tokens: _Optional[int] = ..., prefill_seconds: _Optional[float] = ...) -> None: ...

class HandoffRequest(_message.Message):
    __slots__ = ("request_id", "target", "target_request_id", "push_token")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    TARGET_FIELD_NUMBER: _ClassVar[int]
    TARGET_REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    PUSH_TOKEN_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    target: str
    target_request_id: str
    push_token: str
    def __init__(self, request_id: _Optional[str] = ..., target: _Optional[str] = ..., target_request_id: _Optional[str] = ..., push_token: _Optional[str] = ...) -> None: ...

class HandoffReply(_message.Message):
    __slots__ = ("kv_tokens", "kv_bytes", "seconds")
    KV_TOKENS_FIELD_NUMBER: _ClassVar[int]
    KV_BYTES_FIELD_NUMBER: _ClassVar[int]
    SECONDS_FIELD_NUMBER: _ClassVar[int]
    kv_tokens: int
    kv_bytes: int
    seconds: float
    def __init__(self, kv_tokens: _Optional[int] = ..., kv_bytes: _Optional[int] = ..., seconds: _Optional[float] = ...) -> None: ...

class KVMetadata(_message.Message):
    __slots__ = ("first_token", "seed", "cached_tokens", "queue_seconds", "prefill_seconds", "handoff", "first_logprob")
    FIRST_TOKEN_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    QUEUE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    PREFILL_SECONDS_FIELD_NUMBER: _ClassVar[int]
    HANDOFF_FIELD_NUMBER: _ClassVar[int]
    FIRST_LOGPROB_FIELD_NUMBER: _ClassVar[int]
    first_token: int
    seed: int
    cached_tokens: int
    queue_seconds: float
    prefill_seconds: float
    handoff: bool
    first_logprob: _common_pb2.TokenLogprob
    def __init__(self, first_token: _Optional[int] = ..., seed: _Optional[int] = ..., cached_tokens: _Optional[int] = ..., queue_seconds: _Optional[float] = ..., prefill_seconds: _Optional[float] = ..., handoff: _Optional[bool] = ..., first_logprob: _Optional[_Union[_common_pb2.TokenLogprob, _Mapping]] = ...) -> None: ...
