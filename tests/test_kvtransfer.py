"""KV shipping: round trips and refusals over the in-process and real gRPC transports, the pool."""
from __future__ import annotations

import itertools
import socket
import threading
import time
from dataclasses import dataclass, field
from typing import Callable, Iterable, Iterator

import grpc
import pytest
import torch
from breaking_proxy import BreakingProxy

from baton.v1 import kvtransfer_pb2 as pb
from baton.v1 import kvtransfer_pb2_grpc as pb_grpc
from baton.engine.kv import KVShape, SequenceKV
from baton.kvtransfer import (
    KVCancelled,
    KVNotLanded,
    KVPoolFull,
    KVTooLarge,
    KVTransferError,
    Receiver,
    ReceiverConfig,
    StagingConfig,
    StagingPool,
    encode,
)
from baton.bench.kv_pushes import measure_loopback_throughput
from inprocess_push import push_in_process
from baton.kvtransfer.errors import KVPushFailed
from baton.kvtransfer.grpc_transport import (
    KVTransferServer,
    KVTransferServicer,
    PushRetry,
    kvtransfer_channel,
    push_kv,
    push_kv_retrying,
    push_kv_stream,
)
from baton.kvtransfer.sender import SpanSource, encode_spans
from baton.kvtransfer.wire import (
    CHUNK_IDLE_TIMEOUT_S,
    MAX_METADATA_BYTES,
    PUSH_CONNECT_TIMEOUT_MS,
    PUSH_KEEPALIVE_MS,
    SERVER_MIN_PING_INTERVAL_MS,
    STALE_ATTEMPT_HELD_S,
    STREAM_IDLE_TIMEOUT_S,
    grpc_channel_options,
    grpc_server_ping_options,
)

FINGERPRINT = "tiny-llama/weights:0123abcd/float32"
SHAPES = {
    "float32": KVShape(num_layers=2, num_kv_heads=2, head_dim=8, dtype=torch.float32),  # 256 B/token
    "bfloat16": KVShape(num_layers=3, num_kv_heads=1, head_dim=8, dtype=torch.bfloat16),  # 96 B/token
    "float16": KVShape(num_layers=2, num_kv_heads=3, head_dim=4, dtype=torch.float16),  # 96 B/token
}
ODD_CHUNK = 1000  # no per-token size divides it, so chunks split tokens and the last is short


def random_kv(shape: KVShape, num_tokens: int, seed: int = 0) -> SequenceKV:
    generator = torch.Generator().manual_seed(seed)
    dims = (shape.num_layers, 2, shape.num_kv_heads, num_tokens, shape.head_dim)
    return SequenceKV(torch.randn(dims, generator=generator).to(shape.dtype))


def raw_bytes(kv: SequenceKV) -> bytes:
    return kv.data.contiguous().view(torch.uint8).numpy().tobytes()


def wait_until(predicate: Callable[[], bool], timeout_s: float = 5.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, "condition not reached in time"
        time.sleep(0.005)


def assert_pool_empty(pool: StagingPool) -> None:
    stats = pool.stats()
    assert (stats.used_bytes, stats.entries, stats.waiting) == (0, 0, 0), stats


@dataclass
class Link:
    """A sender's view of one receiving decode worker over one transport."""

    pool: StagingPool
    receiver: Receiver
    transport: str
    landed: list[str] = field(default_factory=list)
    target: str = ""

    def push(self, request_id: str, kv: SequenceKV, fingerprint: str = FINGERPRINT, metadata: bytes = b"",
             chunk_bytes: int = ODD_CHUNK, timeout_s: float | None = None):
        if self.transport == "inprocess":
            return push_in_process(self.receiver, request_id, fingerprint, kv, metadata, chunk_bytes, timeout_s)
        return push_kv(self.target, request_id, fingerprint, kv, metadata, chunk_bytes, timeout_s)

    def push_chunks(self, chunks: Iterable[pb.KVChunk]):
        if self.transport == "inprocess":
            return self.receiver.receive(chunks)
        with kvtransfer_channel(self.target) as channel:
            try:
                return pb_grpc.KVTransferStub(channel).Push(iter(chunks), timeout=10)
            except grpc.RpcError as err:
                raise KVPushFailed(err.code().name, err.details()) from None


@pytest.fixture(params=["inprocess", "grpc"])
def make_link(request) -> Iterator[Callable[..., Link]]:
    servers: list[KVTransferServer] = []

    def build(dtype: str = "float32", capacity_bytes: int = 1 << 20, reserve_timeout_s: float = 5.0,
              max_tokens: int | None = None, **pool_options) -> Link:
        landed: list[str] = []
        pool = StagingPool(StagingConfig(capacity_bytes=capacity_bytes, **pool_options), on_landed=landed.append)
        config = ReceiverConfig(FINGERPRINT, SHAPES[dtype], max_tokens=max_tokens, reserve_timeout_s=reserve_timeout_s)
        link = Link(pool, Receiver(pool, config), request.param, landed)
        if request.param == "grpc":
            server = KVTransferServer(link.receiver).start()
            servers.append(server)
            link.target = server.target
        return link

    yield build
    for server in servers:
        server.stop(grace_s=None)


def refusal(push: Callable[[], object]) -> KVTransferError:
    with pytest.raises(KVTransferError) as caught:
        push()
    return caught.value


# -- round trips ------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", list(SHAPES))
@pytest.mark.parametrize("num_tokens", [1, 37])
def test_round_trip_is_bit_exact_with_metadata(make_link, dtype, num_tokens):
    link = make_link(dtype)
    kv = random_kv(SHAPES[dtype], num_tokens, seed=num_tokens)
    metadata = pb.PushReply(request_id="first token 42").SerializeToString()  # any serialized message
    reply = link.push("req-1", kv, metadata=metadata)
    assert reply.request_id == "req-1" and reply.num_chunks == -(-kv.nbytes // ODD_CHUNK)
    assert link.landed == ["req-1"]
    staged = link.pool.take("req-1")
    assert raw_bytes(staged.kv) == raw_bytes(kv) and staged.kv.data.dtype == kv.data.dtype
    assert staged.kv.shape == kv.shape and staged.metadata == metadata
    assert link.pool.stats().taken_bytes == kv.nbytes
    assert link.pool.release("req-1") == kv.nbytes
    assert_pool_empty(link.pool)


def test_bfloat16_nan_inf_and_negative_zero_bits_survive(make_link):
    shape = SHAPES["bfloat16"]
    bits = torch.arange(-32768, 32768, 4, dtype=torch.int32).to(torch.int16)  # every 4th bf16 pattern
    num_tokens = bits.numel() // (2 * shape.num_layers * shape.num_kv_heads * shape.head_dim)
    data = bits[: num_tokens * shape.bytes_per_token() // 2].view(torch.bfloat16)
    kv = SequenceKV(data.reshape(shape.num_layers, 2, shape.num_kv_heads, num_tokens, shape.head_dim))
    link = make_link("bfloat16")
    link.push("bits", kv, chunk_bytes=4096)
    assert raw_bytes(link.pool.take("bits").kv) == raw_bytes(kv)


def test_wire_is_header_then_layer_major_chunks_then_end():
    kv = random_kv(SHAPES["float32"], 37)
    chunks = list(encode("r", FINGERPRINT, kv, b"meta", chunk_bytes=ODD_CHUNK))
    assert [c.WhichOneof("kind") for c in (chunks[0], chunks[-1])] == ["header", "end"]
    header, data = chunks[0].header, [c.data for c in chunks[1:-1]]
    assert (header.dtype, header.num_layers, header.num_kv_heads, header.head_dim, header.num_tokens) == (
        "float32", 2, 2, 8, 37)
    assert header.total_bytes == kv.nbytes and header.chunk_bytes == ODD_CHUNK and header.metadata == b"meta"
    assert b"".join(d.payload for d in data) == raw_bytes(kv)  # exactly SequenceKV.data, layer 0 first
    assert [len(d.payload) for d in data[:-1]] == [ODD_CHUNK] * (len(data) - 1) and 0 < len(data[-1].payload) <= ODD_CHUNK
    assert chunks[-1].end.num_chunks == len(data) and chunks[-1].end.total_bytes == kv.nbytes


def spans_of(kv: SequenceKV, sizes: list[int], metadata: bytes = b"") -> SpanSource:
    """A SpanSource already holding kv in spans of `sizes` tokens, then its end."""
    source, start = SpanSource(kv.num_tokens), 0
    for size in sizes:
        source.put(SequenceKV(kv.data[:, :, :, start:start + size].contiguous()))
        start += size
    source.finish(metadata)
    return source


@pytest.mark.parametrize("dtype", list(SHAPES))
def test_a_streamed_push_lands_its_spans_layer_major_with_the_metadata_from_its_end(make_link, dtype):
    """Layout TOKEN_SPANS: spans of tokens as a prefill computes them (here one of a single token,
    and spans that ODD_CHUNK splits), each sent [layers, 2, heads, span, dim]; the receiver lays
    them out as one push of the whole KV would, and takes the metadata from the end."""
    link = make_link(dtype)
    kv = random_kv(SHAPES[dtype], 37, seed=3)
    sizes = [1, 16, 13, 7]
    chunks = list(encode_spans("streamed", FINGERPRINT, SHAPES[dtype], spans_of(kv, sizes, b"first token"),
                               chunk_bytes=ODD_CHUNK))
    header = chunks[0].header
    assert header.layout == pb.KV_LAYOUT_TOKEN_SPANS and header.metadata == b"" and header.num_tokens == 37
    assert [c.span.tokens for c in chunks if c.WhichOneof("kind") == "span"] == sizes
    link.push_chunks(chunks)
    staged = link.pool.take("streamed")
    assert raw_bytes(staged.kv) == raw_bytes(kv) and staged.metadata == b"first token"


def span_tampered(chunks: list[pb.KVChunk], how: str) -> list[pb.KVChunk]:
    kinds = [c.WhichOneof("kind") for c in chunks]
    second_span = [i for i, kind in enumerate(kinds) if kind == "span"][1]
    if how == "data before any span":
        del chunks[1]
    elif how == "a span before the last one's bytes":
        del chunks[second_span - 1]
        for i, chunk in enumerate(c for c in chunks if c.WhichOneof("kind") == "data"):
            chunk.data.seq = i
        offset = 0
        for chunk in chunks:
            if chunk.WhichOneof("kind") == "data":
                chunk.data.offset, offset = offset, offset + len(chunk.data.payload)
    elif how == "a span past the last token":
        chunks[second_span].span.tokens = 1000
    elif how == "an empty span":
        chunks.insert(second_span, pb.KVChunk(span=pb.KVSpan(tokens=0)))
    elif how == "truncated: no end":
        chunks = chunks[:-1]
    elif how == "metadata too large":
        chunks[-1].end.metadata = b"x" * (MAX_METADATA_BYTES + 1)
    return chunks


@pytest.mark.parametrize("how, code", [
    ("data before any span", "INVALID_ARGUMENT"),
    ("a span before the last one's bytes", "INVALID_ARGUMENT"),
    ("a span past the last token", "INVALID_ARGUMENT"),
    ("an empty span", "INVALID_ARGUMENT"),
    ("truncated: no end", "ABORTED"),
    ("metadata too large", "INVALID_ARGUMENT"),
])
def test_a_damaged_streamed_push_is_refused_and_frees_its_bytes(make_link, how, code):
    link = make_link()
    kv = random_kv(SHAPES["float32"], 37)
    chunks = list(encode_spans("r", FINGERPRINT, SHAPES["float32"], spans_of(kv, [20, 17]), chunk_bytes=ODD_CHUNK))
    assert refusal(lambda: link.push_chunks(span_tampered(chunks, how))).code == code
    assert_pool_empty(link.pool)
    assert link.landed == []


def test_a_streamed_push_may_pause_between_spans_past_the_idle_limit_of_a_whole_one():
    """Over gRPC: the sender computes between spans, so a TOKEN_SPANS stream may pause longer than
    CHUNK_IDLE_TIMEOUT_S; a whole push pausing as long is cut off. A sender that aborts breaks the call."""
    pool = StagingPool(StagingConfig(capacity_bytes=1 << 20))
    receiver = Receiver(pool, ReceiverConfig(FINGERPRINT, SHAPES["float32"]))
    kv = random_kv(SHAPES["float32"], 8)
    with KVTransferServer(receiver) as server, kvtransfer_channel(server.target) as channel:
        source = SpanSource(8)
        source.put(SequenceKV(kv.data[:, :, :, :4].contiguous()))
        later = threading.Timer(CHUNK_IDLE_TIMEOUT_S + 0.5, lambda: (
            source.put(SequenceKV(kv.data[:, :, :, 4:].contiguous())), source.finish(b"m")))
        later.start()
        push_kv_stream(channel, "paused", FINGERPRINT, SHAPES["float32"], source, ODD_CHUNK, timeout_s=10)
        assert raw_bytes(pool.take("paused").kv) == raw_bytes(kv)
        pool.release("paused")
        broken = SpanSource(8)
        broken.put(SequenceKV(kv.data[:, :, :, :4].contiguous()))
        broken.abort("the prompt was cancelled")
        with pytest.raises(KVPushFailed) as caught:
            push_kv_stream(channel, "aborted", FINGERPRINT, SHAPES["float32"], broken, ODD_CHUNK, timeout_s=10)
        assert caught.value.code == "CANCELLED"
        wait_until(lambda: pool.stats().used_bytes == 0)  # the aborted push's room is freed
    later.join()


def test_chunks_above_grpc_default_message_limit_pass(make_link):
    kv = random_kv(SHAPES["float32"], 40 * 1024)  # 10 MiB
    link = make_link(capacity_bytes=kv.nbytes, max_entries=1)
    assert link.push("big", kv, chunk_bytes=8 << 20).num_chunks == 2
    assert raw_bytes(link.pool.take("big").kv) == raw_bytes(kv)


def test_zero_tokens_are_refused(make_link):
    with pytest.raises(ValueError, match="no tokens"):
        encode("empty", FINGERPRINT, random_kv(SHAPES["float32"], 0))
    link = make_link()
    header = pb.KVHeader(request_id="empty", model_fingerprint=FINGERPRINT, dtype="float32", num_layers=2,
                         num_kv_heads=2, head_dim=8, num_tokens=0, total_bytes=0, chunk_bytes=ODD_CHUNK,
                         layout=pb.KV_LAYOUT_LAYER_MAJOR)
    error = refusal(lambda: link.push_chunks([pb.KVChunk(header=header), pb.KVChunk(end=pb.KVEnd())]))
    assert error.code == "INVALID_ARGUMENT" and "no tokens" in str(error)
    assert_pool_empty(link.pool)


# -- refused streams free everything ----------------------------------------------------------
def tampered(chunks: list[pb.KVChunk], how: str) -> list[pb.KVChunk]:
    if how == "truncated: no end":
        return chunks[:-1]
    if how == "truncated: last data and end":
        return chunks[:-2]
    if how == "byte flipped":
        payload = bytearray(chunks[3].data.payload)
        payload[17] ^= 0x01
        chunks[3].data.payload = bytes(payload)
    elif how == "chunk dropped":
        del chunks[2]
    elif how == "chunk repeated":
        chunks.insert(2, chunks[2])
    elif how == "message after end":
        chunks.append(chunks[1])
    elif how == "bytes miscounted":
        chunks[0].header.total_bytes += 4
    elif how == "no header":
        del chunks[0]
    return chunks


@pytest.mark.parametrize("how, code", [
    ("truncated: no end", "ABORTED"),
    ("truncated: last data and end", "ABORTED"),
    ("byte flipped", "INVALID_ARGUMENT"),
    ("chunk dropped", "INVALID_ARGUMENT"),
    ("chunk repeated", "INVALID_ARGUMENT"),
    ("message after end", "INVALID_ARGUMENT"),
    ("bytes miscounted", "INVALID_ARGUMENT"),
    ("no header", "INVALID_ARGUMENT"),
])
def test_damaged_stream_is_refused_and_frees_its_bytes(make_link, how, code):
    link = make_link()
    chunks = tampered(list(encode("r", FINGERPRINT, random_kv(SHAPES["float32"], 37), chunk_bytes=ODD_CHUNK)), how)
    assert refusal(lambda: link.push_chunks(chunks)).code == code
    assert_pool_empty(link.pool)
    assert link.landed == [] and link.pool.stats().peak_used_bytes <= link.pool.config.capacity_bytes


def test_foreign_model_is_refused(make_link):
    link = make_link()
    error = refusal(lambda: link.push("r", random_kv(SHAPES["float32"], 3), fingerprint="other-model"))
    assert error.code == "INVALID_ARGUMENT" and "other-model" in str(error) and FINGERPRINT in str(error)
    assert_pool_empty(link.pool)
    assert link.pool.stats().peak_used_bytes == 0  # refused before reserving anything


@pytest.mark.parametrize("wrong", [
    KVShape(num_layers=3, num_kv_heads=2, head_dim=8, dtype=torch.float32),
    KVShape(num_layers=2, num_kv_heads=1, head_dim=8, dtype=torch.float32),
    KVShape(num_layers=2, num_kv_heads=2, head_dim=8, dtype=torch.bfloat16),
])
def test_wrong_shape_or_dtype_is_refused(make_link, wrong):
    link = make_link("float32")
    error = refusal(lambda: link.push("r", random_kv(wrong, 5)))
    assert error.code == "INVALID_ARGUMENT" and "this worker needs" in str(error)
    assert_pool_empty(link.pool)


def test_kv_larger_than_pool_is_refused_at_once(make_link):
    link = make_link(capacity_bytes=4096, reserve_timeout_s=30.0)
    started = time.monotonic()
    error = refusal(lambda: link.push("huge", random_kv(SHAPES["float32"], 17)))  # 4352 bytes
    assert error.code == "RESOURCE_EXHAUSTED" and "holds only 4096" in str(error)
    assert time.monotonic() - started < 5.0  # no waiting for room that can never exist
    assert_pool_empty(link.pool)
    assert link.pool.stats().peak_used_bytes == 0


def test_more_tokens_than_the_worker_admits_are_refused(make_link):
    link = make_link(capacity_bytes=4 << 20, max_tokens=4096)
    error = refusal(lambda: link.push("long", random_kv(SHAPES["float32"], 4097)))
    assert error.code == "RESOURCE_EXHAUSTED" and "at most 4096" in str(error)


# -- waiting for room -------------------------------------------------------------------------
def test_kv_waits_for_room_then_lands_without_over_allocating(make_link):
    kv = random_kv(SHAPES["float32"], 10)  # 2560 bytes
    link = make_link(capacity_bytes=4000)
    link.push("first", kv)
    outcome: list[object] = []
    pusher = threading.Thread(target=lambda: outcome.append(link.push("second", kv, timeout_s=10)))
    pusher.start()
    wait_until(lambda: link.pool.stats().waiting == 1)
    assert link.pool.stats().used_bytes == kv.nbytes  # the waiter holds nothing yet
    link.pool.release(link.pool.take("first").request_id)
    pusher.join(10)
    assert outcome and link.landed == ["first", "second"]
    assert raw_bytes(link.pool.take("second").kv) == raw_bytes(kv)
    assert link.pool.stats().peak_used_bytes == kv.nbytes <= 4000


def test_kv_without_room_is_refused_after_its_timeout(make_link):
    kv = random_kv(SHAPES["float32"], 10)
    link = make_link(capacity_bytes=4000, reserve_timeout_s=0.2)
    link.push("first", kv)
    error = refusal(lambda: link.push("second", kv))
    assert error.code == "RESOURCE_EXHAUSTED" and "retry later" in str(error)
    stats = link.pool.stats()
    assert (stats.landed_bytes, stats.reserved_bytes, stats.waiting, stats.peak_used_bytes) == (kv.nbytes, 0, 0, kv.nbytes)


def test_grpc_deadline_bounds_the_wait_for_room():
    pool = StagingPool(StagingConfig(capacity_bytes=4000))
    receiver = Receiver(pool, ReceiverConfig(FINGERPRINT, SHAPES["float32"], reserve_timeout_s=30.0))
    kv = random_kv(SHAPES["float32"], 10)
    with KVTransferServer(receiver) as server:
        push_kv(server.target, "first", FINGERPRINT, kv)
        started = time.monotonic()
        error = refusal(lambda: push_kv(server.target, "second", FINGERPRINT, kv, timeout_s=0.3))
        assert error.code in ("DEADLINE_EXCEEDED", "RESOURCE_EXHAUSTED")
        assert time.monotonic() - started < 5.0
        wait_until(lambda: pool.stats().waiting == 0)
        assert pool.stats().used_bytes == kv.nbytes


# -- cancellation and lifecycle ---------------------------------------------------------------
def paused_stream(kv: SequenceKV, request_id: str, sent_two: threading.Event, resume: threading.Event,
                  yielded: list[int] | None = None):
    for index, chunk in enumerate(encode(request_id, FINGERPRINT, kv, chunk_bytes=ODD_CHUNK)):
        if index == 2:
            sent_two.set()
            resume.wait(10)
        if yielded is not None:
            yielded.append(index)
        yield chunk


def test_cancel_stops_an_arriving_kv_and_frees_it(make_link):
    link = make_link()
    sent_two, resume = threading.Event(), threading.Event()
    errors: list[KVTransferError] = []
    yielded: list[int] = []

    def push() -> None:
        try:
            link.push_chunks(paused_stream(random_kv(SHAPES["float32"], 37), "r", sent_two, resume, yielded))
        except KVTransferError as err:
            errors.append(err)

    pusher = threading.Thread(target=push)
    pusher.start()
    assert sent_two.wait(10)
    wait_until(lambda: link.pool.stats().reserved_entries == 1)
    assert link.pool.cancel("r") == 37 * 256
    resume.set()
    pusher.join(10)
    assert [e.code for e in errors] == ["CANCELLED"] and link.landed == []
    if link.transport == "inprocess":
        assert yielded[-1] == 2  # stopped at the first chunk after the cancel, not at the end
    assert_pool_empty(link.pool)


def test_sender_hanging_up_mid_stream_frees_the_reservation():
    pool = StagingPool(StagingConfig(capacity_bytes=1 << 20))
    receiver = Receiver(pool, ReceiverConfig(FINGERPRINT, SHAPES["float32"]))
    sent_two, resume = threading.Event(), threading.Event()
    with KVTransferServer(receiver) as server, kvtransfer_channel(server.target) as channel:
        stream = paused_stream(random_kv(SHAPES["float32"], 37), "r", sent_two, resume)
        call = pb_grpc.KVTransferStub(channel).Push.future(stream)
        assert sent_two.wait(10)
        wait_until(lambda: pool.stats().reserved_entries == 1)
        call.cancel()
        resume.set()
        wait_until(lambda: pool.stats().entries == 0)
    assert_pool_empty(pool)


def test_cancel_frees_landed_taken_and_waiting_kv():
    pool = StagingPool(StagingConfig(capacity_bytes=3000))
    receiver = Receiver(pool, ReceiverConfig(FINGERPRINT, SHAPES["float32"]))
    kv = random_kv(SHAPES["float32"], 10)
    push_in_process(receiver, "landed", FINGERPRINT, kv)
    errors: list[KVTransferError] = []
    waiter = threading.Thread(target=lambda: errors.append(refusal(lambda: push_in_process(receiver, "waiting", FINGERPRINT, kv))))
    waiter.start()
    wait_until(lambda: pool.stats().waiting == 1)
    assert pool.cancel("waiting") == 0
    waiter.join(10)
    assert [type(e) for e in errors] == [KVCancelled]
    assert pool.cancel("landed") == kv.nbytes
    push_in_process(receiver, "taken", FINGERPRINT, kv)
    pool.take("taken")
    assert pool.cancel("taken") == kv.nbytes and pool.cancel("taken") == 0
    assert_pool_empty(pool)


def test_duplicate_and_unexpected_request_ids(make_link):
    link = make_link(require_expected=True)
    kv = random_kv(SHAPES["float32"], 2)
    assert refusal(lambda: link.push("stranger", kv)).code == "FAILED_PRECONDITION"
    link.pool.expect("r")
    link.push("r", kv)
    assert refusal(lambda: link.push("r", kv)).code == "ALREADY_EXISTS"
    link.pool.take("r")
    link.pool.release("r")
    assert not link.pool.is_expected("r")  # released means done: a late duplicate is refused
    assert refusal(lambda: link.push("r", kv)).code == "FAILED_PRECONDITION"
    assert_pool_empty(link.pool)


def test_a_push_must_carry_the_token_its_request_registered(make_link):
    """Only the push the router meant for a request takes its staging room."""
    link = make_link(require_expected=True)
    kv = random_kv(SHAPES["float32"], 3)
    link.pool.expect("r", "s3cret")
    for token in ("", "wrong"):
        assert refusal(lambda: link.push_chunks(encode("r", FINGERPRINT, kv, push_token=token))).code == \
            "PERMISSION_DENIED"
        assert link.pool.stats().entries == 0 and link.pool.is_expected("r")
    link.push_chunks(encode("r", FINGERPRINT, kv, push_token="s3cret"))
    assert link.landed == ["r"]
    assert raw_bytes(link.pool.take("r").kv) == raw_bytes(kv)


def test_a_push_slower_than_the_minimum_rate_is_cut_and_its_room_freed():
    """A chunk every 0.2 s never trips the idle cut-off; the rate floor ends it after the grace."""
    pool = StagingPool(StagingConfig(capacity_bytes=1 << 20))
    receiver = Receiver(pool, ReceiverConfig(FINGERPRINT, SHAPES["float32"], min_bytes_per_s=64 << 10,
                                             rate_grace_s=0.5))
    kv = random_kv(SHAPES["float32"], 1024)  # 256 KiB, sent 1 KiB at a time: 5 KiB/s

    def trickle():
        for i, chunk in enumerate(encode("r", FINGERPRINT, kv, chunk_bytes=1024)):
            if i > 1:
                time.sleep(0.2)
            yield chunk

    with KVTransferServer(receiver) as server, kvtransfer_channel(server.target) as channel:
        started = time.monotonic()
        with pytest.raises(grpc.RpcError) as err:
            pb_grpc.KVTransferStub(channel).Push(trickle(), timeout=30)
        cut = time.monotonic() - started
        assert err.value.code() == grpc.StatusCode.ABORTED and "minimum" in err.value.details()
        wait_until(lambda: pool.stats().entries == 0)
        push_kv(channel, "r", FINGERPRINT, kv)  # at full speed the same request lands
    print(f"\na trickling push was cut after {cut:.2f}s (grace 0.5 s, floor 64 KiB/s)")
    assert cut < 3.0
    assert raw_bytes(pool.take("r").kv) == raw_bytes(kv)


def test_take_release_protocol_errors():
    pool = StagingPool(StagingConfig(capacity_bytes=1000))
    reservation = pool.reserve("r", 600, timeout_s=0)
    with pytest.raises(KVNotLanded):
        pool.take("r")
    with pytest.raises(KVNotLanded, match="still arriving"):
        pool.release("r")
    pool.land(reservation, random_kv(SHAPES["float32"], 2), b"")
    pool.take("r")
    with pytest.raises(KVNotLanded, match="taken"):
        pool.take("r")
    assert pool.release("r") == 600 and pool.release("r") == 0
    pool.abort(reservation)  # stale handle: must not free anything new
    assert_pool_empty(pool)


def test_parked_kv_holds_room_in_the_same_bound_and_never_jumps_waiting_pushes():
    pool = StagingPool(StagingConfig(capacity_bytes=1000))
    assert pool.hold("parked", 700) and pool.stats().taken_bytes == 700
    assert not pool.hold("another", 400)  # over the bound: refused at once, no waiting
    with pytest.raises(KVPoolFull):
        pool.reserve("push", 400, timeout_s=0)
    waiting = threading.Thread(target=lambda: pool.reserve("push", 400, timeout_s=5))
    waiting.start()
    while not pool.stats().waiting:
        time.sleep(0.01)
    assert not pool.hold("small", 100)  # room exists, but a push waits for room: it goes first
    assert pool.release("parked") == 700
    waiting.join(timeout=5)
    assert pool.stats().reserved_bytes == 400
    pool.cancel("push")
    assert_pool_empty(pool)


def test_yielding_holds_give_their_room_to_anything_else_oldest_first():
    """A retained conversation's KV moved to the host is held as yielding: a push, a parked row or
    a newer retained entry takes its room back, oldest first, and the consumer is told which."""
    taken = []
    pool = StagingPool(StagingConfig(capacity_bytes=1000), on_yield=taken.append)
    assert pool.hold("old", 300, yields=True) and pool.hold("new", 300, yields=True)
    assert pool.stats().yielding_bytes == 600 and pool.stats().needed_bytes == 0
    assert pool.hold("newest", 500, yields=True) and taken == ["old"]  # a newer one takes the oldest's room
    reservation = pool.reserve("push", 400, timeout_s=0)  # at once: no waiting for room it can take back
    assert taken == ["old", "new"] and pool.stats().yielding_bytes == 500
    assert pool.hold("parked", 500) and taken == ["old", "new", "newest"]
    assert not pool.hold("too much", 200, yields=True)  # never takes what is not yielding
    assert pool.release("parked") == 500
    pool.abort(reservation)
    assert_pool_empty(pool)


def test_landed_kv_nobody_takes_expires():
    pool = StagingPool(StagingConfig(capacity_bytes=1000, landed_ttl_s=0.05))
    pool.land(pool.reserve("r", 512, timeout_s=0), random_kv(SHAPES["float32"], 2), b"")
    time.sleep(0.1)
    assert pool.stats().expired_total == 1
    assert_pool_empty(pool)


def test_failing_landed_hook_does_not_undo_the_landing():
    def explode(request_id: str) -> None:
        raise RuntimeError("scheduler hook bug")

    pool = StagingPool(StagingConfig(capacity_bytes=1000), on_landed=explode)
    receiver = Receiver(pool, ReceiverConfig(FINGERPRINT, SHAPES["float32"]))
    push_in_process(receiver, "r", FINGERPRINT, random_kv(SHAPES["float32"], 2))
    assert pool.landed_ids() == ["r"]


# -- pool invariants under concurrency --------------------------------------------------------
def test_concurrent_reservations_never_exceed_capacity():
    capacity = 10_000
    pool = StagingPool(StagingConfig(capacity_bytes=capacity, max_entries=5))
    violations: list[int] = []
    stop = threading.Event()

    def probe() -> None:
        while not stop.is_set():
            stats = pool.stats()
            if stats.used_bytes > capacity or stats.entries > 5:
                violations.append(stats.used_bytes)

    small_kv = random_kv(SHAPES["float32"], 2)  # 512 bytes, fits every reservation below

    def worker(index: int) -> None:
        for step in range(40):
            request_id = f"w{index}-{step}"
            try:
                reservation = pool.reserve(request_id, 1000 + 997 * ((index * 7 + step) % 9), timeout_s=2)
            except KVPoolFull:
                continue
            time.sleep(0.0005)
            if step % 3 == 0:
                pool.cancel(request_id)
            elif step % 3 == 1:
                pool.abort(reservation)
            else:
                pool.land(reservation, small_kv, b"")
                pool.take(request_id)
                pool.release(request_id)

    probe_thread = threading.Thread(target=probe)
    workers = [threading.Thread(target=worker, args=(i,)) for i in range(8)]
    probe_thread.start()
    for thread in workers:
        thread.start()
    for thread in workers:
        thread.join(30)
    stop.set()
    probe_thread.join(5)
    assert violations == [] and pool.stats().peak_used_bytes <= capacity
    assert_pool_empty(pool)


def test_large_waiter_is_not_starved_by_small_ones():
    pool = StagingPool(StagingConfig(capacity_bytes=1000))
    pool.reserve("small-0", 400, timeout_s=0)
    got_large = threading.Event()
    large = threading.Thread(target=lambda: (pool.reserve("large", 1000, timeout_s=5), got_large.set()))
    large.start()
    wait_until(lambda: pool.stats().waiting == 1)
    with pytest.raises(KVPoolFull):  # would fit, but must queue behind the large one
        pool.reserve("small-1", 400, timeout_s=0.05)
    pool.cancel("small-0")
    large.join(5)
    assert got_large.is_set() and pool.stats().reserved_bytes == 1000


def test_waiting_transfers_are_bounded_too():
    pool = StagingPool(StagingConfig(capacity_bytes=1000, max_entries=1))
    pool.reserve("held", 100, timeout_s=0)
    waiter = threading.Thread(target=lambda: refusal(lambda: pool.reserve("queued", 100, timeout_s=5)))
    waiter.start()
    wait_until(lambda: pool.stats().waiting == 1)
    with pytest.raises(KVPoolFull, match="already wait"):
        pool.reserve("one-too-many", 100, timeout_s=5)
    pool.cancel("queued")
    waiter.join(5)
    assert pool.stats().waiting == 0


def test_oversized_reservation_is_refused_without_waiting():
    pool = StagingPool(StagingConfig(capacity_bytes=1000))
    started = time.monotonic()
    with pytest.raises(KVTooLarge):
        pool.reserve("r", 1001, timeout_s=5)
    assert time.monotonic() - started < 1.0
    assert_pool_empty(pool)


def test_loopback_benchmark_reports_positive_times():
    transfer_s, memcpy_s = measure_loopback_throughput(1 << 20, repeats=1, receiver_process=False)
    assert transfer_s > 0 and memcpy_s > 0


# -- broken transfers: noticed within about a second, and retried --------------------------------
# Timing asserts are generous (the machine may be busy); the measured figures are printed.
BIG_TOKENS = 16384  # 4 MiB of float32 KV: many chunks, so the proxy's break (after 1 MiB) lands mid-stream


class FlakyServicer(KVTransferServicer):
    """A receiver that drops its first `drops` streams mid-way: it reads the header and a few
    chunks, then the stream ends early, as if cut (the Receiver refuses it: ABORTED)."""

    def __init__(self, receiver: Receiver, drops: int = 1):
        super().__init__(receiver)
        self.drops = drops
        self.calls = 0
        self.dropped_at: list[float] = []

    def Push(self, request_iterator, context):
        self.calls += 1
        if self.calls <= self.drops:
            truncated = itertools.islice(request_iterator, 4)

            def noted():
                yield from truncated
                self.dropped_at.append(time.monotonic())

            request_iterator = noted()
        return super().Push(request_iterator, context)


def big_receiver(capacity_bytes: int = 64 << 20) -> tuple[StagingPool, Receiver, list[str]]:
    landed: list[str] = []
    pool = StagingPool(StagingConfig(capacity_bytes=capacity_bytes), on_landed=landed.append)
    return pool, Receiver(pool, ReceiverConfig(FINGERPRINT, SHAPES["float32"])), landed


@pytest.fixture
def kv_server(grpc_server):
    """A KVTransfer gRPC server around a given servicer (as a decode worker's, pings welcome)."""
    return lambda servicer: grpc_server(pb_grpc.add_KVTransferServicer_to_server, servicer,
                                        grpc_channel_options() + grpc_server_ping_options())


def retrying_push(target: str, kv: SequenceKV, request_id: str = "r", **kwargs):
    """push_kv_retrying, noting when each retry was decided."""
    retried_at: list[tuple[float, str]] = []
    with kvtransfer_channel(target) as channel:
        outcome = push_kv_retrying(channel, request_id, FINGERPRINT, kv, chunk_bytes=64 << 10, timeout_s=30,
                                   on_retry=lambda attempt, failure: retried_at.append((time.monotonic(), failure.code)),
                                   **kwargs)
    return outcome, retried_at


def test_the_server_options_welcome_the_senders_keepalive_pings():
    from baton.transport import SERVER_OPTIONS

    assert ("grpc.http2.min_ping_interval_without_data_ms", SERVER_MIN_PING_INTERVAL_MS) in SERVER_OPTIONS
    assert SERVER_MIN_PING_INTERVAL_MS <= PUSH_KEEPALIVE_MS / 2


@pytest.mark.parametrize("mode", ["reset", "freeze"])
def test_a_connection_broken_mid_push_is_noticed_within_a_second_and_the_retry_lands(kv_server, mode):
    """reset: the peer's socket is reset (a crash); freeze: nothing more arrives and nothing
    says so (a hung peer, a cut network), which only the keepalive pings reveal. Either way the
    sender knows within about a second and the retry, on a new connection, lands bit-exact."""
    pool, receiver, landed = big_receiver()
    proxy = BreakingProxy(kv_server(KVTransferServicer(receiver)), mode)
    kv = random_kv(SHAPES["float32"], BIG_TOKENS, seed=3)
    try:
        started = time.monotonic()
        outcome, retried_at = retrying_push(proxy.target, kv)
        total = time.monotonic() - started
    finally:
        proxy.close()
    noticed = retried_at[0][0] - proxy.broken_at
    print(f"\n{mode}: the broken push was noticed {noticed:.3f}s after the break; landed after "
          f"{outcome.attempts} attempts ({[code for _, code in retried_at]}) in {total:.2f}s")
    assert outcome.attempts >= 2 and outcome.failures[0].code == "UNAVAILABLE"
    assert noticed < 5.0  # about 1 s for a freeze (500 ms keepalive + 500 ms timeout), ~0 for a reset
    assert landed == ["r"] and proxy.connections >= 2
    assert raw_bytes(receiver.pool.take("r").kv) == raw_bytes(kv)
    pool.release("r")
    # The broken attempt left nothing behind on the receiver (a freeze: cut off by its idle deadline).
    wait_until(lambda: pool.stats().entries == 0, timeout_s=10)
    assert_pool_empty(pool)


def test_a_streamed_push_whose_sender_is_cut_off_is_dropped_by_the_receivers_pings(kv_server):
    """A streamed push may pause for STREAM_IDLE_TIMEOUT_S between spans (its sender prefills), so
    a sender cut off by the network mid-stream (nothing resets the connection) is noticed by the
    receiver's own keepalive pings: its staging room is free again within seconds, not 30."""
    pool, receiver, _ = big_receiver()
    proxy = BreakingProxy(kv_server(KVTransferServicer(receiver)), "freeze", after_bytes=256 << 10)
    kv = random_kv(SHAPES["float32"], BIG_TOKENS, seed=7)
    source = SpanSource(kv.num_tokens)
    source.put(SequenceKV(kv.data[:, :, :, :BIG_TOKENS // 2].contiguous()))  # then no end: still prefilling
    with kvtransfer_channel(proxy.target) as channel:
        call = pb_grpc.KVTransferStub(channel).Push.future(encode_spans("r", FINGERPRINT, SHAPES["float32"],
                                                                        source, 64 << 10), timeout=60)
        try:
            wait_until(lambda: proxy.broken_at is not None and pool.stats().reserved_entries == 1, timeout_s=10)
            wait_until(lambda: pool.stats().entries == 0, timeout_s=STREAM_IDLE_TIMEOUT_S / 3)
            freed = time.monotonic() - proxy.broken_at
        finally:
            source.abort("test over")
            call.cancel()
            proxy.close()
    print(f"\nthe cut-off stream's staging room was freed {freed:.2f}s after the break")
    assert freed <= STALE_ATTEMPT_HELD_S + 1.0
    assert_pool_empty(pool)


def test_a_receiver_dropping_the_stream_mid_way_is_retried_at_once(kv_server):
    pool, receiver, landed = big_receiver()
    flaky = FlakyServicer(receiver, drops=1)
    target = kv_server(flaky)
    kv = random_kv(SHAPES["float32"], BIG_TOKENS, seed=4)
    outcome, retried_at = retrying_push(target, kv)
    noticed = retried_at[0][0] - flaky.dropped_at[0]
    print(f"\nthe dropped stream was reported to the sender {1000 * noticed:.1f} ms after the receiver cut it")
    assert [f.code for f in outcome.failures] == ["ABORTED"] and outcome.attempts == 2
    assert "ended after" in outcome.failures[0].details  # the receiver's own words: truncated
    assert noticed < 5.0
    assert landed == ["r"] and raw_bytes(pool.take("r").kv) == raw_bytes(kv)
    pool.release("r")
    assert_pool_empty(pool)


def test_a_push_finding_a_dead_senders_attempt_still_held_waits_it_out_and_lands(kv_server):
    """A prefill worker killed mid-push leaves its attempt held until the receiver's idle cut-off;
    the worker the prompt is given to next finds the id ALREADY_EXISTS on its very first push."""
    pool, receiver, landed = big_receiver()
    target = kv_server(KVTransferServicer(receiver))
    kv = random_kv(SHAPES["float32"], BIG_TOKENS, seed=6)
    messages = list(encode("r", FINGERPRINT, kv, b"", 64 << 10))
    dead = threading.Event()

    def killed_mid_push():
        yield from messages[:2]  # the header and one chunk, then silence: the sender is gone
        dead.wait(30)

    with kvtransfer_channel(target) as channel:
        stalled = pb_grpc.KVTransferStub(channel).Push.future(killed_mid_push(), timeout=30)
        try:
            wait_until(lambda: pool.stats().reserved_entries == 1, timeout_s=10)
            outcome, retried_at = retrying_push(target, kv)
        finally:
            dead.set()
            stalled.cancel()
    print(f"\nthe stale attempt was waited out: landed after {outcome.attempts} attempts "
          f"({[code for _, code in retried_at]})")
    assert outcome.failures[0].code == "ALREADY_EXISTS" and landed == ["r"]
    assert raw_bytes(pool.take("r").kv) == raw_bytes(kv)
    pool.release("r")
    assert_pool_empty(pool)


def test_retries_stop_at_the_attempt_limit_and_report_the_last_failure(kv_server):
    pool, receiver, landed = big_receiver()
    target = kv_server(FlakyServicer(receiver, drops=10))
    started = time.monotonic()
    with pytest.raises(KVPushFailed) as caught:
        retrying_push(target, random_kv(SHAPES["float32"], 1024), retry=PushRetry(attempts=3, backoff_s=0.05))
    elapsed = time.monotonic() - started
    print(f"\nthree dropped streams reported after {elapsed:.2f}s")
    assert caught.value.code == "ABORTED" and "attempt 3" in caught.value.details
    assert elapsed < 5.0 and landed == []
    assert_pool_empty(pool)


def test_refusals_of_the_kv_itself_are_not_retried(kv_server):
    pool, receiver, landed = big_receiver(capacity_bytes=1000)
    target = kv_server(KVTransferServicer(receiver))
    with pytest.raises(KVPushFailed) as caught:
        retrying_push(target, random_kv(SHAPES["float32"], 64))  # 16 KiB: larger than the whole pool
    assert caught.value.code == "RESOURCE_EXHAUSTED" and "attempt" not in caught.value.details
    with pytest.raises(KVPushFailed) as caught:
        with kvtransfer_channel(target) as channel:
            push_kv_retrying(channel, "r", "another-model", random_kv(SHAPES["float32"], 2), on_retry=pytest.fail)
    assert caught.value.code == "INVALID_ARGUMENT"


def test_a_push_to_a_receiver_that_is_gone_fails_within_a_second():
    with socket.create_server(("127.0.0.1", 0)) as sock:
        gone = f"127.0.0.1:{sock.getsockname()[1]}"  # closed again: connections are refused
    kv = random_kv(SHAPES["float32"], 64)
    with kvtransfer_channel(gone) as channel:
        started = time.monotonic()
        with pytest.raises(KVPushFailed) as caught:
            push_kv(channel, "r", FINGERPRINT, kv, timeout_s=30)
        first = time.monotonic() - started
        started = time.monotonic()
        with pytest.raises(KVPushFailed) as retried:
            push_kv_retrying(channel, "r", FINGERPRINT, kv, timeout_s=30)
        total = time.monotonic() - started
    print(f"\nreceiver gone: refused after {1000 * first:.1f} ms; with two retries reported after {total:.2f}s")
    assert caught.value.code == "UNAVAILABLE" and retried.value.code == "UNAVAILABLE"
    assert first < 5.0 and total < 5.0


def test_a_receiver_that_never_answers_the_handshake_fails_within_the_connect_timeout():
    """A peer that accepts the TCP connection and then says nothing (a stopped process, a dead
    pod whose address still answers): given up after PUSH_CONNECT_TIMEOUT_MS, not gRPC's 20 s."""
    with socket.create_server(("127.0.0.1", 0)) as silent:
        target = f"127.0.0.1:{silent.getsockname()[1]}"
        with kvtransfer_channel(target) as channel:
            started = time.monotonic()
            with pytest.raises(KVPushFailed) as caught:
                push_kv(channel, "r", FINGERPRINT, random_kv(SHAPES["float32"], 64), timeout_s=30)
            elapsed = time.monotonic() - started
    print(f"\nsilent receiver: the push failed after {elapsed:.2f}s (connect timeout {PUSH_CONNECT_TIMEOUT_MS} ms)")
    assert caught.value.code == "UNAVAILABLE" and elapsed < 5.0


def test_a_sender_gone_silent_mid_stream_is_cut_off_and_its_staging_bytes_freed():
    """The receiver's half: waiting for the next message longer than CHUNK_IDLE_TIMEOUT_S ends
    the stream and frees its reservation, so a retry of the same request id is not refused."""
    pool = StagingPool(StagingConfig(capacity_bytes=1 << 20))
    receiver = Receiver(pool, ReceiverConfig(FINGERPRINT, SHAPES["float32"]))
    sent_two, never = threading.Event(), threading.Event()
    kv = random_kv(SHAPES["float32"], 37)
    with KVTransferServer(receiver) as server, kvtransfer_channel(server.target) as channel:
        call = pb_grpc.KVTransferStub(channel).Push.future(paused_stream(kv, "r", sent_two, never))
        assert sent_two.wait(10)
        wait_until(lambda: pool.stats().reserved_entries == 1)
        reserved = time.monotonic()
        wait_until(lambda: pool.stats().entries == 0, timeout_s=10)
        freed = time.monotonic() - reserved
        with pytest.raises(grpc.RpcError):
            call.result(timeout=10)
        push_kv(channel, "r", FINGERPRINT, kv)  # the same request id lands now
        never.set()
    print(f"\na silent sender's reservation was freed after {freed:.2f}s (idle deadline {CHUNK_IDLE_TIMEOUT_S}s)")
    assert freed < 5.0
    assert raw_bytes(pool.take("r").kv) == raw_bytes(kv)


# -- prefill.kv_chunk_bytes: refused at settings load unless a chunk fits the wire and a message ----
def test_kv_chunk_bytes_out_of_range_is_refused_when_settings_load(tmp_path):
    from baton.config import load_settings
    from baton.transport import MAX_MESSAGE_BYTES
    from baton.kvtransfer.wire import MAX_CHUNK_BYTES, max_chunk_bytes_within

    limit = max_chunk_bytes_within(MAX_MESSAGE_BYTES)
    assert 0 < limit <= MAX_CHUNK_BYTES
    for bad in (0, -1, limit + 1, MAX_CHUNK_BYTES, MAX_CHUNK_BYTES + 1):
        with pytest.raises(ValueError, match=rf"prefill\.kv_chunk_bytes is {bad}; it must be in \(0, {limit}\]"):
            load_settings(env={"BATON_PREFILL_KV_CHUNK_BYTES": str(bad)})
    config = tmp_path / "baton.yaml"
    config.write_text(f"prefill:\n  kv_chunk_bytes: {MAX_CHUNK_BYTES + 1}\n")
    with pytest.raises(ValueError, match=r"prefill\.kv_chunk_bytes"):
        load_settings(str(config), env={})
    for good in (1, 2 << 20, limit):
        assert load_settings(env={"BATON_PREFILL_KV_CHUNK_BYTES": str(good)}).prefill.kv_chunk_bytes == good


def test_a_prefill_worker_with_a_bad_kv_chunk_bytes_exits_2_before_loading_the_model(tmp_path, capsys):
    from baton.cli import main

    config = tmp_path / "baton.yaml"
    config.write_text("prefill:\n  kv_chunk_bytes: 0\n")
    started = time.monotonic()
    assert main(["prefill", "--config", str(config), "--port", "0", "--model", "tiny-random"]) == 2
    assert "prefill.kv_chunk_bytes is 0" in capsys.readouterr().err
    assert time.monotonic() - started < 10  # refused at settings load, not after the model


def test_the_largest_allowed_kv_chunk_fits_a_baton_server_and_one_byte_more_would_not():
    """The bound is the real one: a decode worker's server (GrpcServer, 16 MiB messages) takes
    chunks of the largest allowed kv_chunk_bytes; the wire's own maximum would not fit."""
    from baton.server import GrpcServer, channel
    from baton.transport import MAX_MESSAGE_BYTES
    from baton.kvtransfer.wire import MAX_CHUNK_BYTES, max_chunk_bytes_within

    limit = max_chunk_bytes_within(MAX_MESSAGE_BYTES)
    pool = StagingPool(StagingConfig(capacity_bytes=64 << 20))
    receiver = Receiver(pool, ReceiverConfig(FINGERPRINT, SHAPES["float32"]))
    server = GrpcServer("127.0.0.1", 0)
    pb_grpc.add_KVTransferServicer_to_server(KVTransferServicer(receiver), server.server)
    server.start()
    kv = random_kv(SHAPES["float32"], (MAX_CHUNK_BYTES + (1 << 20)) // 256, seed=5)  # 17 MiB
    try:
        with channel(f"127.0.0.1:{server.port}") as ch:
            push_kv(ch, "fits", FINGERPRINT, kv, chunk_bytes=limit, timeout_s=60)
            error = refusal(lambda: push_kv(ch, "too-big", FINGERPRINT, kv, chunk_bytes=MAX_CHUNK_BYTES, timeout_s=60))
    finally:
        server.stop(grace=None)
    assert raw_bytes(pool.take("fits").kv) == raw_bytes(kv)
    assert error.code == "RESOURCE_EXHAUSTED"  # gRPC: message larger than the limit
