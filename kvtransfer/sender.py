"""Turn one sequence's KV into the KVChunk stream: header, checksummed data chunks, end."""
from __future__ import annotations

from typing import Iterator

import torch

from baton.v1 import kvtransfer_pb2 as pb
from baton.engine.kv import SequenceKV
from baton.kvtransfer.wire import DEFAULT_CHUNK_BYTES, MAX_CHUNK_BYTES, MAX_METADATA_BYTES, checksum, dtype_name


def encode(
    request_id: str,
    fingerprint: str,
    kv: SequenceKV,
    metadata: bytes = b"",
    chunk_bytes: int = DEFAULT_CHUNK_BYTES,
    push_token: str = "",
) -> Iterator[pb.KVChunk]:
    """The chunk stream for kv; chunks are cut lazily so only one is in memory at a time.

    metadata is opaque here: a serialized message the consumer on the other side parses.
    kv is read as the chunks are cut: leave it unmodified until the push has returned.
    Raises ValueError at call time, before any chunk exists, for KV no receiver could accept.
    """
    _check_sendable(request_id, kv, metadata, chunk_bytes)
    return _chunks(request_id, fingerprint, kv, metadata, chunk_bytes, push_token)


def _check_sendable(request_id: str, kv: SequenceKV, metadata: bytes, chunk_bytes: int) -> None:
    if not request_id:
        raise ValueError("request_id must be non-empty")
    if kv.num_tokens == 0:
        raise ValueError(f"KV for {request_id!r} has no tokens; a prefilled prompt has at least one")
    if not 0 < chunk_bytes <= MAX_CHUNK_BYTES:
        raise ValueError(f"chunk_bytes must be in (0, {MAX_CHUNK_BYTES}], got {chunk_bytes}")
    if len(metadata) > MAX_METADATA_BYTES:
        raise ValueError(f"metadata is {len(metadata)} bytes; at most {MAX_METADATA_BYTES} fit in a header")
    dtype_name(kv.data.dtype)  # raises for a dtype the wire cannot name


def kv_header(request_id: str, fingerprint: str, kv: SequenceKV, metadata: bytes = b"",
              chunk_bytes: int = DEFAULT_CHUNK_BYTES, push_token: str = "") -> pb.KVHeader:
    """What every push of kv declares before its bytes, whatever carries them."""
    shape = kv.shape
    return pb.KVHeader(
        request_id=request_id,
        model_fingerprint=fingerprint,
        dtype=dtype_name(shape.dtype),
        num_layers=shape.num_layers,
        num_kv_heads=shape.num_kv_heads,
        head_dim=shape.head_dim,
        num_tokens=kv.num_tokens,
        total_bytes=kv.nbytes,
        chunk_bytes=chunk_bytes,
        layout=pb.KV_LAYOUT_LAYER_MAJOR,
        metadata=metadata,
        push_token=push_token,
    )


def _chunks(
    request_id: str, fingerprint: str, kv: SequenceKV, metadata: bytes, chunk_bytes: int, push_token: str
) -> Iterator[pb.KVChunk]:
    # Layer-major raw bytes, exactly SequenceKV.data; view(uint8) keeps bf16 bit-exact.
    data = kv.data.detach().to("cpu").contiguous()
    raw = memoryview(data.view(torch.uint8).reshape(-1).numpy())
    yield pb.KVChunk(header=kv_header(request_id, fingerprint, kv, metadata, chunk_bytes, push_token))
    num_chunks = 0
    for offset in range(0, len(raw), chunk_bytes):
        payload = raw[offset : offset + chunk_bytes]
        yield pb.KVChunk(data=pb.KVData(seq=num_chunks, offset=offset, payload=bytes(payload), crc32=checksum(payload)))
        num_chunks += 1
    yield pb.KVChunk(end=pb.KVEnd(num_chunks=num_chunks, total_bytes=len(raw)))
