from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class KVLayout(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    KV_LAYOUT_UNSPECIFIED: _ClassVar[KVLayout]
    KV_LAYOUT_LAYER_MAJOR: _ClassVar[KVLayout]
    KV_LAYOUT_TOKEN_SPANS: _ClassVar[KVLayout]
KV_LAYOUT_UNSPECIFIED: KVLayout
KV_LAYOUT_LAYER_MAJOR: KVLayout
KV_LAYOUT_TOKEN_SPANS: KVLayout

class KVHeader(_message.Message):
    __slots__ = ("request_id", "model_fingerprint", "dtype", "num_layers", "num_kv_heads", "head_dim", "num_tokens", "total_bytes", "chunk_bytes", "layout", "metadata", "push_token")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    MODEL_FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    NUM_LAYERS_FIELD_NUMBER: _ClassVar[int]
    NUM_KV_HEADS_FIELD_NUMBER: _ClassVar[int]
    HEAD_DIM_FIELD_NUMBER: _ClassVar[int]
    NUM_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TOTAL_BYTES_FIELD_NUMBER: _ClassVar[int]
    CHUNK_BYTES_FIELD_NUMBER: _ClassVar[int]
    LAYOUT_FIELD_NUMBER: _ClassVar[int]
    METADATA_FIELD_NUMBER: _ClassVar[int]
    PUSH_TOKEN_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    model_fingerprint: str
    dtype: str
    num_layers: int
    num_kv_heads: int
    head_dim: int
    num_tokens: int
    total_bytes: int
    chunk_bytes: int
    layout: KVLayout
    metadata: bytes
    push_token: str
    def __init__(self, request_id: _Optional[str] = ..., model_fingerprint: _Optional[str] = ..., dtype: _Optional[str] = ..., num_layers: _Optional[int] = ..., num_kv_heads: _Optional[int] = ..., head_dim: _Optional[int] = ..., num_tokens: _Optional[int] = ..., total_bytes: _Optional[int] = ..., chunk_bytes: _Optional[int] = ..., layout: _Optional[_Union[KVLayout, str]] = ..., metadata: _Optional[bytes] = ..., push_token: _Optional[str] = ...) -> None: ...

class KVData(_message.Message):
    __slots__ = ("seq", "offset", "payload", "crc32")
    SEQ_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    PAYLOAD_FIELD_NUMBER: _ClassVar[int]
    CRC32_FIELD_NUMBER: _ClassVar[int]
    seq: int
    offset: int
    payload: bytes
    crc32: int
    def __init__(self, seq: _Optional[int] = ..., offset: _Optional[int] = ..., payload: _Optional[bytes] = ..., crc32: _Optional[int] = ...) -> None: ...

class KVSpan(_message.Message):
    __slots__ = ("tokens",)
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    tokens: int
    def __init__(self, tokens: _Optional[int] = ...) -> None: ...

class KVEnd(_message.Message):
    __slots__ = ("num_chunks", "total_bytes", "metadata")
    NUM_CHUNKS_FIELD_NUMBER: _ClassVar[int]
    TOTAL_BYTES_FIELD_NUMBER: _ClassVar[int]
    METADATA_FIELD_NUMBER: _ClassVar[int]
    num_chunks: int
    total_bytes: int
    metadata: bytes
    def __init__(self, num_chunks: _Optional[int] = ..., total_bytes: _Optional[int] = ..., metadata: _Optional[bytes] = ...) -> None: ...

class KVChunk(_message.Message):
    __slots__ = ("header", "data", "end", "span")
    HEADER_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    END_FIELD_NUMBER: _ClassVar[int]
    SPAN_FIELD_NUMBER: _ClassVar[int]
    header: KVHeader
    data: KVData
    end: KVEnd
    span: KVSpan
    def __init__(self, header: _Optional[_Union[KVHeader, _Mapping]] = ..., data: _Optional[_Union[KVData, _Mapping]] = ..., end: _Optional[_Union[KVEnd, _Mapping]] = ..., span: _Optional[_Union[KVSpan, _Mapping]] = ...) -> None: ...

class PushReply(_message.Message):
    __slots__ = ("request_id", "bytes_received", "num_chunks", "staging_wait_seconds", "receive_seconds")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    BYTES_RECEIVED_FIELD_NUMBER: _ClassVar[int]
    NUM_CHUNKS_FIELD_NUMBER: _ClassVar[int]
    STAGING_WAIT_SECONDS_FIELD_NUMBER: _ClassVar[int]
    RECEIVE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    bytes_received: int
    num_chunks: int
    staging_wait_seconds: float
    receive_seconds: float
    def __init__(self, request_id: _Optional[str] = ..., bytes_received: _Optional[int] = ..., num_chunks: _Optional[int] = ..., staging_wait_seconds: _Optional[float] = ..., receive_seconds: _Optional[float] = ...) -> None: ...

class WriteOpen(_message.Message):
    __slots__ = ("header", "library")
    HEADER_FIELD_NUMBER: _ClassVar[int]
    LIBRARY_FIELD_NUMBER: _ClassVar[int]
    header: KVHeader
    library: str
    def __init__(self, header: _Optional[_Union[KVHeader, _Mapping]] = ..., library: _Optional[str] = ...) -> None: ...

class WriteTarget(_message.Message):
    __slots__ = ("transfer_id", "agent", "agent_metadata", "descriptors")
    TRANSFER_ID_FIELD_NUMBER: _ClassVar[int]
    AGENT_FIELD_NUMBER: _ClassVar[int]
    AGENT_METADATA_FIELD_NUMBER: _ClassVar[int]
    DESCRIPTORS_FIELD_NUMBER: _ClassVar[int]
    transfer_id: str
    agent: str
    agent_metadata: bytes
    descriptors: bytes
    def __init__(self, transfer_id: _Optional[str] = ..., agent: _Optional[str] = ..., agent_metadata: _Optional[bytes] = ..., descriptors: _Optional[bytes] = ...) -> None: ...

class WriteClose(_message.Message):
    __slots__ = ("transfer_id", "crc32", "abandon")
    TRANSFER_ID_FIELD_NUMBER: _ClassVar[int]
    CRC32_FIELD_NUMBER: _ClassVar[int]
    ABANDON_FIELD_NUMBER: _ClassVar[int]
    transfer_id: str
    crc32: int
    abandon: bool
    def __init__(self, transfer_id: _Optional[str] = ..., crc32: _Optional[int] = ..., abandon: _Optional[bool] = ...) -> None: ...
