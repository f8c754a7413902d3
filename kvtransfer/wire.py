"""Wire-format constants and the few conversions both ends share (dtype names, checksums)."""
from __future__ import annotations

import sys
import zlib

import torch

DEFAULT_CHUNK_BYTES = 2 * 1024 * 1024
# A receiver refuses larger chunks, so one KVChunk message never exceeds this plus framing.
MAX_CHUNK_BYTES = 16 * 1024 * 1024
MAX_METADATA_BYTES = 64 * 1024
# Header fields, protobuf framing and metadata on top of the largest payload.
_MESSAGE_OVERHEAD_BYTES = MAX_METADATA_BYTES + 64 * 1024

# The raw bytes are sent as this host holds them; every platform we run on is little-endian,
# and the proto promises little-endian, so refuse to run rather than send misordered bytes.
if sys.byteorder != "little":
    raise ImportError("kvtransfer sends raw little-endian tensor bytes; this host is big-endian")

_DTYPES_BY_NAME: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
}


def dtype_name(dtype: torch.dtype) -> str:
    for name, candidate in _DTYPES_BY_NAME.items():
        if candidate == dtype:
            return name
    raise ValueError(f"KV dtype {dtype} cannot be sent; supported: {', '.join(_DTYPES_BY_NAME)}")


def dtype_from_name(name: str) -> torch.dtype | None:
    """None for a name this side does not know."""
    return _DTYPES_BY_NAME.get(name)


def checksum(payload: bytes | memoryview) -> int:
    return zlib.crc32(payload)


def grpc_message_limit(chunk_bytes: int = MAX_CHUNK_BYTES) -> int:
    """gRPC max message length that fits one KVChunk carrying chunk_bytes of payload."""
    return chunk_bytes + _MESSAGE_OVERHEAD_BYTES


def grpc_channel_options(chunk_bytes: int = MAX_CHUNK_BYTES) -> list[tuple[str, int]]:
    """Options for both the sending channel and the receiving server."""
    limit = grpc_message_limit(chunk_bytes)
    return [("grpc.max_send_message_length", limit), ("grpc.max_receive_message_length", limit)]
