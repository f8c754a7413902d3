"""Consume one KVChunk stream, verify every part of it, and land the KV in the staging pool.

Transport-free: the gRPC servicer and the in-process transport both call `Receiver.receive`.
Staging bytes are reserved when the header is accepted and the data is copied straight into
a tensor allocated then; any failure (bad header, checksum, order, truncation, cancel, or an
exception from the transport's iterator) aborts the reservation before the error propagates.
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Iterable, Iterator

import torch

from baton.v1 import kvtransfer_pb2 as pb
from baton.engine.kv import KVShape, SequenceKV, host_tensor
import baton.kvtransfer.cuda_ipc as cuda_ipc
from baton.kvtransfer.errors import (
    KVBadStream,
    KVCancelled,
    KVCorrupt,
    KVForeignModel,
    KVShapeMismatch,
    KVTooLarge,
    KVTooSlow,
    KVTruncated,
)
from baton.kvtransfer.staging import Reservation, StagingPool
from baton.kvtransfer.wire import (MAX_CHUNK_BYTES, MAX_METADATA_BYTES, MIN_PUSH_BYTES_PER_S, PUSH_RATE_GRACE_S, checksum,
                                   dtype_from_name)


@dataclass(frozen=True)
class ReceiverConfig:
    fingerprint: str  # of the model this decode worker runs
    shape: KVShape  # layers, KV heads, head dim and dtype it runs with
    max_tokens: int | None = None  # longest sequence it would admit; None: bounded by the pool
    reserve_timeout_s: float = 10.0  # longest wait for staging room before RESOURCE_EXHAUSTED
    max_chunk_bytes: int = MAX_CHUNK_BYTES
    # Once staging room is held, the KV must keep coming at least this fast (after a grace):
    # a push trickling a chunk a second would otherwise hold its room for as long as it likes.
    min_bytes_per_s: float = MIN_PUSH_BYTES_PER_S
    rate_grace_s: float = PUSH_RATE_GRACE_S
    # Land KV in page-locked memory (a CUDA decode worker's): its copy into the batch is then
    # asynchronous and at full bus speed.
    pin_memory: bool = False


@dataclass(frozen=True)
class ReceiveResult:
    request_id: str
    nbytes: int
    num_chunks: int
    staging_wait_seconds: float  # header accepted -> staging room reserved
    receive_seconds: float  # header accepted -> KV landed


@dataclass(frozen=True)
class OpenKV:
    """KV being written in one piece by a transfer library: its staging room is held."""
    header: pb.KVHeader
    reservation: Reservation
    data: torch.Tensor  # [layers, 2, kv_heads, tokens, head_dim], the bytes land here
    started: float
    reserved: float


class Receiver:
    """Stateless apart from its config and pool, so one instance serves concurrent pushes."""

    def __init__(self, pool: StagingPool, config: ReceiverConfig) -> None:
        self.pool = pool
        self.config = config

    def receive(self, chunks: Iterable[pb.KVChunk], timeout_s: float | None = None) -> ReceiveResult:
        """Land one stream's KV; timeout_s (e.g. the RPC's remaining deadline) caps the staging wait."""
        stream = iter(chunks)
        first = next(stream, None)
        if first is None:
            raise KVTruncated("KV stream was empty; expected a header first")
        if first.WhichOneof("kind") != "header":
            raise KVBadStream(f"KV stream must start with a header, got {first.WhichOneof('kind')!r}")
        header = first.header
        started = time.monotonic()
        self._check_header(header)
        assemble = self._assemble_spans if header.layout == pb.KV_LAYOUT_TOKEN_SPANS else self._assemble
        return self._land(header, started, timeout_s, lambda reservation: assemble(header, stream, reservation))

    def receive_whole(self, header: pb.KVHeader, payload, crc32: int, timeout_s: float | None = None,
                      adopt: bool = False) -> ReceiveResult:
        """Land KV that arrived in one piece (a shared-memory push): `payload` is a buffer of
        `header.total_bytes` whose checksum must be `crc32`, checked before staging room is taken.
        The pool gets a copy, or with `adopt` (and no pinned memory asked for) the payload itself:
        a writable buffer no one else changes, such as a private mapping of a sealed memory file."""
        started = time.monotonic()
        self._check_whole(header, "arrived whole")
        rid = header.request_id
        if len(payload) != header.total_bytes:
            raise KVTruncated(f"KV for {rid!r} holds {len(payload)} bytes; its header declares {header.total_bytes}")
        if checksum(payload) != crc32:
            raise KVCorrupt(f"KV for {rid!r}: checksum mismatch; the data was damaged")

        def fill(_reservation) -> tuple[SequenceKV, int, bytes]:
            if adopt and not self.config.pin_memory:
                dims = self._kv_dims(header.num_tokens)
                kv = torch.frombuffer(payload, dtype=torch.uint8).view(self.config.shape.dtype).view(dims)
                return SequenceKV(kv), 1, bytes(header.metadata)
            data = self._new_kv(header.num_tokens)
            source = memoryview(payload)
            memoryview(data.view(torch.uint8).reshape(-1).numpy())[:] = (
                source if source.format == "B" else source.cast("B"))  # a ctypes buffer says '<B'
            return SequenceKV(data), 1, bytes(header.metadata)

        return self._land(header, started, timeout_s, fill)

    def receive_device(self, header: pb.KVHeader, description: dict, timeout_s: float | None = None,
                       on_opened=lambda: None) -> ReceiveResult:
        """Land KV that a process on this host holds in CUDA memory (kvtransfer.cuda_ipc): the
        header is checked, the handle opened (`on_opened` told) and the digest checked on the
        device before staging room is taken; the KV is then copied into host staging memory
        (pinned for a CUDA worker) and the handle closed when this returns. KVNoDeviceIPC, before
        anything is reserved, where it cannot open."""
        started = time.monotonic()
        self._check_whole(header, "arrived whole")
        rid = header.request_id
        with cuda_ipc.opened(description, header.total_bytes) as (data, expected):
            on_opened()
            if cuda_ipc.digest(data) != expected:
                raise KVCorrupt(f"KV for {rid!r}: its digest on the device does not match the sender's; the "
                                "handle or the data was damaged")

            def fill(_reservation) -> tuple[SequenceKV, int, bytes]:
                kv = self._new_kv(header.num_tokens)
                kv.view(torch.uint8).reshape(-1).copy_(data)  # waits for the copy (pinned or not)
                return SequenceKV(kv), 1, bytes(header.metadata)

            return self._land(header, started, timeout_s, fill)

    def open_whole(self, header: pb.KVHeader, timeout_s: float | None = None) -> "OpenKV":
        """Take KV that a transfer library will write in one piece straight into memory: check the
        header, reserve its staging room (waiting up to timeout_s) and allocate the tensor it lands
        in. Then `land_opened` once the bytes are written, or `abort_opened`."""
        started = time.monotonic()
        self._check_whole(header, "is written whole")
        wait = self.config.reserve_timeout_s if timeout_s is None else min(timeout_s, self.config.reserve_timeout_s)
        reservation = self.pool.reserve(header.request_id, header.total_bytes, wait, header.push_token)
        try:
            data = self._new_kv(header.num_tokens)
        except BaseException:
            self.pool.abort(reservation)
            raise
        return OpenKV(header, reservation, data, started, time.monotonic())

    def land_opened(self, opened: "OpenKV", crc32: int) -> ReceiveResult:
        """Land KV whose bytes were written into `opened.data`, if their checksum is `crc32`; the
        reservation is freed on any failure."""
        rid = opened.header.request_id
        try:
            if opened.reservation.cancelled:
                raise KVCancelled(f"request {rid!r} was cancelled while its KV arrived")
            if checksum(memoryview(opened.data.view(torch.uint8).reshape(-1).numpy())) != crc32:
                raise KVCorrupt(f"KV for {rid!r}: checksum mismatch; the data was damaged")
            self.pool.land(opened.reservation, SequenceKV(opened.data), bytes(opened.header.metadata))
        except BaseException:
            self.pool.abort(opened.reservation)
            raise
        return ReceiveResult(rid, opened.header.total_bytes, 1, opened.reserved - opened.started,
                             time.monotonic() - opened.started)

    def abort_opened(self, opened: "OpenKV") -> None:
        self.pool.abort(opened.reservation)

    def _land(self, header: pb.KVHeader, started: float, timeout_s: float | None, fill) -> ReceiveResult:
        """Reserve staging room for a checked header, let `fill(reservation)` make the KV (with its
        message count and metadata), land it; the reservation is aborted if anything fails."""
        wait = self.config.reserve_timeout_s if timeout_s is None else min(timeout_s, self.config.reserve_timeout_s)
        reservation = self.pool.reserve(header.request_id, header.total_bytes, wait, header.push_token)
        reserved = time.monotonic()
        try:
            kv, messages, metadata = fill(reservation)
            self.pool.land(reservation, kv, metadata)
        except BaseException:
            self.pool.abort(reservation)
            raise
        return ReceiveResult(header.request_id, header.total_bytes, messages, reserved - started,
                             time.monotonic() - started)

    def _kv_dims(self, num_tokens: int) -> tuple[int, ...]:
        shape = self.config.shape
        return (shape.num_layers, 2, shape.num_kv_heads, num_tokens, shape.head_dim)

    def _new_kv(self, num_tokens: int) -> torch.Tensor:
        """Host memory for one sequence's KV (pinned for a CUDA worker)."""
        return host_tensor(self._kv_dims(num_tokens), self.config.shape.dtype, self.config.pin_memory)

    def _check_whole(self, header: pb.KVHeader, how: str) -> None:
        """`_check_header` for KV that comes in one piece (`how`), which is LAYER_MAJOR."""
        self._check_header(header)
        if header.layout != pb.KV_LAYOUT_LAYER_MAJOR:
            raise KVBadStream(f"KV for {header.request_id!r} {how}, so it must be LAYER_MAJOR (got layout "
                              f"{header.layout})")

    def _check_header(self, header: pb.KVHeader) -> None:
        rid = header.request_id
        if not rid:
            raise KVBadStream("KV header has an empty request_id")
        if header.layout not in (pb.KV_LAYOUT_LAYER_MAJOR, pb.KV_LAYOUT_TOKEN_SPANS):
            raise KVBadStream(f"KV for {rid!r} has layout {header.layout}; this receiver reads LAYER_MAJOR and "
                              "TOKEN_SPANS")
        if header.model_fingerprint != self.config.fingerprint:
            raise KVForeignModel(
                f"KV for {rid!r} comes from model {header.model_fingerprint!r} but this decode worker runs "
                f"{self.config.fingerprint!r}; route it to a worker serving the same model"
            )
        expected = self.config.shape
        dtype = dtype_from_name(header.dtype)
        got = (dtype, header.num_layers, header.num_kv_heads, header.head_dim)
        want = (expected.dtype, expected.num_layers, expected.num_kv_heads, expected.head_dim)
        if got != want:
            raise KVShapeMismatch(
                f"KV for {rid!r} is (dtype, layers, kv_heads, head_dim) = ({header.dtype}, {header.num_layers}, "
                f"{header.num_kv_heads}, {header.head_dim}); this worker needs "
                f"({str(expected.dtype).removeprefix('torch.')}, {want[1]}, {want[2]}, {want[3]})"
            )
        if header.num_tokens == 0:
            raise KVBadStream(f"KV for {rid!r} has no tokens; a prefilled prompt has at least one")
        max_tokens = self.config.max_tokens
        if max_tokens is not None and header.num_tokens > max_tokens:
            raise KVTooLarge(f"KV for {rid!r} has {header.num_tokens} tokens; this worker admits at most {max_tokens}")
        want_bytes = header.num_tokens * expected.bytes_per_token()
        if header.total_bytes != want_bytes:
            raise KVBadStream(
                f"KV for {rid!r} declares {header.total_bytes} bytes but {header.num_tokens} tokens of this shape "
                f"are {want_bytes}"
            )
        if not 0 < header.chunk_bytes <= self.config.max_chunk_bytes:
            raise KVBadStream(f"KV for {rid!r} has chunk_bytes {header.chunk_bytes}; allowed (0, {self.config.max_chunk_bytes}]")
        if len(header.metadata) > MAX_METADATA_BYTES:
            raise KVBadStream(f"KV for {rid!r} carries {len(header.metadata)} metadata bytes; max {MAX_METADATA_BYTES}")

    def _assemble(
        self, header: pb.KVHeader, stream: Iterator[pb.KVChunk], reservation: Reservation
    ) -> tuple[SequenceKV, int, bytes]:
        rid, total, chunk_bytes = header.request_id, header.total_bytes, header.chunk_bytes
        data = self._new_kv(header.num_tokens)  # [layers, 2, kv_heads, tokens, head_dim], filled as bytes
        target = memoryview(data.view(torch.uint8).reshape(-1).numpy())
        received = num_chunks = 0
        started = time.monotonic()
        for message in stream:
            if reservation.cancelled:
                raise KVCancelled(f"request {rid!r} was cancelled while its KV arrived")
            kind = message.WhichOneof("kind")
            if kind == "data":
                chunk = message.data
                if received >= total:
                    raise KVBadStream(f"KV for {rid!r}: data chunk {chunk.seq} after all {total} bytes arrived")
                _check_order(rid, chunk, num_chunks, received)
                payload = chunk.payload  # each attribute read copies the bytes out of upb; read once
                size = min(chunk_bytes, total - received)
                if len(payload) != size:
                    raise KVBadStream(f"KV for {rid!r}: chunk {chunk.seq} has {len(payload)} bytes, expected {size}")
                _check_sum(rid, chunk, payload)
                target[received : received + size] = payload
                received += size
                num_chunks += 1
                late = time.monotonic() - started - self.config.rate_grace_s
                if late > 0 and received < total and received < self.config.min_bytes_per_s * late:
                    raise KVTooSlow(f"KV for {rid!r} arrived at {received / (late + self.config.rate_grace_s):.0f} "
                                    f"bytes/s, below this receiver's minimum of {self.config.min_bytes_per_s:.0f}; "
                                    "its staging room was freed (retry the push)")
            elif kind == "end":
                end = message.end
                if received != total or end.num_chunks != num_chunks or end.total_bytes != total:
                    raise KVCorrupt(
                        f"KV for {rid!r}: end says {end.num_chunks} chunks / {end.total_bytes} bytes, "
                        f"received {num_chunks} chunks / {received} of {total} bytes"
                    )
                _expect_no_more(stream, rid)
                return SequenceKV(data), num_chunks, bytes(header.metadata)
            else:
                raise KVBadStream(f"KV for {rid!r}: unexpected {kind!r} message inside the data stream")
        raise KVTruncated(f"KV stream for {rid!r} ended after {received} of {total} bytes without an end message")

    def _assemble_spans(
        self, header: pb.KVHeader, stream: Iterator[pb.KVChunk], reservation: Reservation
    ) -> tuple[SequenceKV, int, bytes]:
        """A streamed push: spans of tokens as the sender's prefill computes them. Each span's bytes
        are gathered in a buffer of its own shape, then copied to its tokens' place. No rate floor:
        the sender computes between spans (the transport allows it longer pauses)."""
        rid, total, chunk_bytes, num_tokens = header.request_id, header.total_bytes, header.chunk_bytes, header.num_tokens
        shape = self.config.shape
        data = self._new_kv(num_tokens)
        received = num_chunks = position = 0
        span: torch.Tensor | None = None  # the span being received: [layers, 2, kv_heads, tokens, head_dim]
        target, filled = memoryview(b""), 0
        for message in stream:
            if reservation.cancelled:
                raise KVCancelled(f"request {rid!r} was cancelled while its KV arrived")
            kind = message.WhichOneof("kind")
            if kind == "span":
                tokens = message.span.tokens
                if span is not None:
                    raise KVBadStream(f"KV for {rid!r}: a span began before the previous one's bytes all arrived")
                if not 0 < tokens <= num_tokens - position:
                    raise KVBadStream(f"KV for {rid!r}: a span of {tokens} tokens at token {position} of {num_tokens}")
                span = torch.empty(self._kv_dims(tokens), dtype=shape.dtype)
                target, filled = memoryview(span.view(torch.uint8).reshape(-1).numpy()), 0
            elif kind == "data":
                chunk = message.data
                if span is None:
                    raise KVBadStream(f"KV for {rid!r}: data chunk {chunk.seq} outside any span")
                _check_order(rid, chunk, num_chunks, received)
                payload = chunk.payload
                size = len(payload)
                if not 0 < size <= min(chunk_bytes, len(target) - filled):
                    raise KVBadStream(f"KV for {rid!r}: chunk {chunk.seq} has {size} bytes; its span has "
                                      f"{len(target) - filled} left and chunks are at most {chunk_bytes}")
                _check_sum(rid, chunk, payload)
                target[filled:filled + size] = payload
                filled += size
                received += size
                num_chunks += 1
                if filled == len(target):  # the span is whole: to its tokens' place
                    data[:, :, :, position:position + span.shape[3]] = span
                    position += span.shape[3]
                    span = None
            elif kind == "end":
                end = message.end
                if span is not None or received != total or end.num_chunks != num_chunks or end.total_bytes != total:
                    raise KVCorrupt(f"KV for {rid!r}: end says {end.num_chunks} chunks / {end.total_bytes} bytes, "
                                    f"received {num_chunks} chunks / {received} of {total} bytes")
                if len(end.metadata) > MAX_METADATA_BYTES:
                    raise KVBadStream(f"KV for {rid!r} carries {len(end.metadata)} metadata bytes; max {MAX_METADATA_BYTES}")
                _expect_no_more(stream, rid)
                return SequenceKV(data), num_chunks, bytes(end.metadata)
            else:
                raise KVBadStream(f"KV for {rid!r}: unexpected {kind!r} message inside the data stream")
        raise KVTruncated(f"KV stream for {rid!r} ended after {received} of {total} bytes without an end message")


def _check_order(rid: str, chunk: pb.KVData, num_chunks: int, received: int) -> None:
    """A data chunk must be the next one: numbered after the last, placed where it ended."""
    if chunk.seq != num_chunks or chunk.offset != received:
        raise KVCorrupt(f"KV for {rid!r}: got chunk seq={chunk.seq} offset={chunk.offset}, "
                        f"expected seq={num_chunks} offset={received}")


def _check_sum(rid: str, chunk: pb.KVData, payload: bytes) -> None:
    if checksum(payload) != chunk.crc32:
        raise KVCorrupt(f"KV for {rid!r}: checksum mismatch in chunk {chunk.seq}; the data was damaged")


def _expect_no_more(stream: Iterator[pb.KVChunk], rid: str) -> None:
    extra = next(stream, None)
    if extra is not None:
        raise KVBadStream(f"KV for {rid!r}: {extra.WhichOneof('kind')!r} message after end")
