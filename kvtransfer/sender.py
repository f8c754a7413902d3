"""Turn one sequence's KV into the KVChunk stream: header, checksummed data chunks, end; or,
streamed while the prompt is prefilled, header, then spans of tokens as they are computed, end."""
from __future__ import annotations

import queue
from typing import Iterator

import torch

from baton.v1 import kvtransfer_pb2 as pb
from baton.engine.kv import KVShape, SequenceKV
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
    return _header(request_id, fingerprint, kv.shape, kv.num_tokens, metadata, chunk_bytes, push_token,
                   pb.KV_LAYOUT_LAYER_MAJOR)


def _header(request_id: str, fingerprint: str, shape: KVShape, num_tokens: int, metadata: bytes, chunk_bytes: int,
            push_token: str, layout: int) -> pb.KVHeader:
    return pb.KVHeader(
        request_id=request_id,
        model_fingerprint=fingerprint,
        dtype=dtype_name(shape.dtype),
        num_layers=shape.num_layers,
        num_kv_heads=shape.num_kv_heads,
        head_dim=shape.head_dim,
        num_tokens=num_tokens,
        total_bytes=num_tokens * shape.bytes_per_token(),
        chunk_bytes=chunk_bytes,
        layout=layout,
        metadata=metadata,
        push_token=push_token,
    )


def _chunks(
    request_id: str, fingerprint: str, kv: SequenceKV, metadata: bytes, chunk_bytes: int, push_token: str
) -> Iterator[pb.KVChunk]:
    raw = _raw_bytes(kv)  # layer-major, exactly SequenceKV.data
    yield pb.KVChunk(header=kv_header(request_id, fingerprint, kv, metadata, chunk_bytes, push_token))
    yield from _data(raw, chunk_bytes, 0, 0)
    yield pb.KVChunk(end=pb.KVEnd(num_chunks=-(-len(raw) // chunk_bytes), total_bytes=len(raw)))


def _raw_bytes(kv: SequenceKV) -> memoryview:
    """kv's bytes in its [layers, 2, kv_heads, tokens, head_dim] order; view(uint8) keeps bf16 bit-exact."""
    data = kv.data.detach().to("cpu").contiguous()
    return memoryview(data.view(torch.uint8).reshape(-1).numpy())


def _data(raw: memoryview, chunk_bytes: int, seq: int, offset: int) -> Iterator[pb.KVChunk]:
    """`raw` as checksummed data messages of chunk_bytes (the last shorter), numbered from `seq`,
    placed from byte `offset` of the stream."""
    for start in range(0, len(raw), chunk_bytes):
        payload = raw[start:start + chunk_bytes]
        yield pb.KVChunk(data=pb.KVData(seq=seq, offset=offset + start, payload=bytes(payload),
                                        crc32=checksum(payload)))
        seq += 1


class SpanSource:
    """The KV of one prompt as its prefill computes it, for a streamed push (layout TOKEN_SPANS):
    the prefill thread `put`s each new span of tokens and `finish`es with the metadata (or
    `abort`s); the push's thread reads them through `encode_spans`. Thread-safe."""

    def __init__(self, num_tokens: int) -> None:
        self.num_tokens = num_tokens
        self._items: "queue.SimpleQueue[tuple[str, object]]" = queue.SimpleQueue()

    def put(self, kv: SequenceKV) -> None:
        if kv.num_tokens:
            self._items.put(("span", kv))

    def finish(self, metadata: bytes) -> None:
        self._items.put(("end", metadata))

    def abort(self, why: str) -> None:
        self._items.put(("abort", why))

    def take(self) -> tuple[str, object]:
        return self._items.get()


class SpanAborted(Exception):
    """The prompt behind a streamed push stopped (cancelled, failed): the push breaks off."""


def encode_spans(request_id: str, fingerprint: str, shape: KVShape, source: SpanSource,
                 chunk_bytes: int = DEFAULT_CHUNK_BYTES, push_token: str = "") -> Iterator[pb.KVChunk]:
    """The chunk stream of a streamed push: the header at once, each span as `source` gives it
    (blocking until it does), the end with the metadata. Raises SpanAborted, which breaks the call."""
    if not 0 < chunk_bytes <= MAX_CHUNK_BYTES:
        raise ValueError(f"chunk_bytes must be in (0, {MAX_CHUNK_BYTES}], got {chunk_bytes}")
    if source.num_tokens < 1:
        raise ValueError(f"KV for {request_id!r} has no tokens; a prefilled prompt has at least one")
    return _span_chunks(request_id, fingerprint, shape, source, chunk_bytes, push_token)


def _span_chunks(request_id: str, fingerprint: str, shape: KVShape, source: SpanSource, chunk_bytes: int,
                 push_token: str) -> Iterator[pb.KVChunk]:
    yield pb.KVChunk(header=_header(request_id, fingerprint, shape, source.num_tokens, b"", chunk_bytes, push_token,
                                    pb.KV_LAYOUT_TOKEN_SPANS))
    sent = num_chunks = 0
    while True:
        kind, item = source.take()
        if kind == "abort":
            raise SpanAborted(str(item))
        if kind == "end":
            yield pb.KVChunk(end=pb.KVEnd(num_chunks=num_chunks, total_bytes=sent, metadata=item))
            return
        raw = _raw_bytes(item)  # this span's tokens only
        yield pb.KVChunk(span=pb.KVSpan(tokens=item.num_tokens))
        yield from _data(raw, chunk_bytes, num_chunks, sent)
        num_chunks += -(-len(raw) // chunk_bytes)
        sent += len(raw)
