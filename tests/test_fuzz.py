"""Hostile input against a real cluster (1 prefill, 1 decode, tiny-random), with hypothesis.

(a) The public API: GenerateRequests built with the generated stubs but past every SDK check
(any oneof, sampling values out of range or NaN, odd text, token lists empty, huge or out of
the vocabulary, unknown chat roles, thousands of stop strings), GenerateBatch, and raw bytes
that are not a message at all. Each call ends in a finished stream or a clear status; never
INTERNAL or UNKNOWN, never a hang (every call has a deadline). Where the documented rules say a
request is certainly valid it must finish; where they say it is certainly invalid it must be
INVALID_ARGUMENT.

(b) The decode worker's KVTransfer endpoint, pushed at directly: streams built like the prefill
worker's, then broken (header fields, order, sizes, checksums, truncation, interleaving, huge
declared sizes, stalls), for request ids the worker expects (a Decode call is open) and ones it
does not, with metadata that is no KVMetadata or names no real token, and for prompts of another
length than the KV. A KV that lands but does not fit its request fails that request alone.

After each fuzz run the workers still serve, a normal request still matches the reference
model, and the decode worker holds no rows, staged bytes or waiting requests.

What the fuzz found has a regression test of its own at the end, one input each. The random KV
payloads stay finite floats; NaN KV with sampling is covered by its own test there.
"""
from __future__ import annotations

import math
import os
import struct
import subprocess
import sys
import threading
import time
import uuid
import zlib
from collections import Counter
from dataclasses import dataclass

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from baton.server import channel
from baton.launch.up import LocalCluster, free_port, stop_process, wait_serving
from baton.v1 import common_pb2, kvtransfer_pb2 as kv_pb, kvtransfer_pb2_grpc, router_pb2, router_pb2_grpc
from baton.v1 import workers_pb2, workers_pb2_grpc
from baton.client import BatonClient
from baton.sampling import MAX_SEED, MAX_STOP_STRING_CHARS, MAX_STOP_STRINGS, MAX_STOP_TOKEN_IDS
from baton.kvtransfer.wire import MAX_METADATA_BYTES

pytestmark = pytest.mark.slow

CALL_TIMEOUT_S = 30.0  # far above any request here; reaching it is a hang
# Under CI the same examples are drawn every run; elsewhere each run draws anew, so the coverage
# floors below sit well under what a run draws.
FUZZ = settings(deadline=None, database=None, print_blob=True, derandomize=bool(os.environ.get("CI")),
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large,
                                       HealthCheck.large_base_example])
UINT32, UINT64 = 2**32 - 1, 2**64 - 1
# Statuses that say what was wrong; anything else (INTERNAL, UNKNOWN, UNAVAILABLE, a deadline)
# means a servicer crashed, a worker went away or something hung.
CLEAR_API_CODES = {grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.RESOURCE_EXHAUSTED,
                   grpc.StatusCode.FAILED_PRECONDITION, grpc.StatusCode.OUT_OF_RANGE}
CLEAR_KV_CODES = {grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.RESOURCE_EXHAUSTED,
                  grpc.StatusCode.FAILED_PRECONDITION, grpc.StatusCode.ALREADY_EXISTS,
                  grpc.StatusCode.ABORTED, grpc.StatusCode.CANCELLED}
CHAT_ROLES = ("system", "user", "assistant")
BYTES_PER_TOKEN = 2 * 2 * 2 * 16 * 4  # tiny-random: 2 layers, K and V, 2 KV heads, head dim 16, float32


@dataclass(frozen=True)
class Model:
    vocab_size: int
    max_context: int
    fingerprint: str
    bytes_per_token: int = BYTES_PER_TOKEN


@pytest.fixture(scope="module")
def cluster():
    with LocalCluster(prefill=1, decode=1, model="tiny-random", max_rows=4) as running:
        yield running


@pytest.fixture(scope="module")
def router(cluster):
    with grpc.insecure_channel(cluster.router_address) as ch:
        yield router_pb2_grpc.RouterStub(ch), ch


@pytest.fixture(scope="module")
def model(router) -> Model:
    info = router[0].GetModelInfo(router_pb2.ModelInfoRequest(), timeout=10)
    return Model(info.vocab_size, info.max_context, info.model_fingerprint)


@pytest.fixture(scope="module")
def decode_channel(cluster):
    with channel(cluster.decode_addrs[0], cluster_token=cluster.cluster_token) as ch:  # as the router calls it
        yield ch


def assert_cluster_serves_and_holds_nothing(cluster, tiny_reference) -> None:
    """Every process SERVING, a normal request correct, and no decode row, staged byte or waiting
    request left behind (the router polls worker load every 0.2 s)."""
    for address in cluster.prefill_addrs + cluster.decode_addrs + [cluster.router_address]:
        with grpc.insecure_channel(address) as ch:
            status = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=10).status
        assert status == health_pb2.HealthCheckResponse.SERVING, address
    with BatonClient(cluster.router_address, timeout=60) as client:
        result = client.generate("After the storm", max_tokens=8, ignore_eos=True)
        assert result.token_ids == tiny_reference.greedy(result.prompt_token_ids, 8)
        deadline = time.monotonic() + 15
        while True:
            workers = client.cluster_status().workers
            held = [{k: w.decode[k] for k in ("rows_in_use", "staged_bytes", "waiting_for_kv", "staged")}
                    for w in workers if w.role == "decode"]
            held += [{"queued": w.prefill["queued"]} for w in workers if w.role == "prefill"]
            if all(not any(h.values()) for h in held):
                break
            assert time.monotonic() < deadline, f"workers still hold resources after fuzzing: {held}"
            time.sleep(0.2)


# ---------------------------------------------------------------------------------------------
# (a) the public API

clean_text = st.text(st.characters(min_codepoint=32, max_codepoint=126), min_size=1, max_size=120)
hostile_text = st.one_of(
    st.text(max_size=60),
    st.text(st.characters(codec="utf-8"), max_size=60),  # any code point UTF-8 can carry
    st.sampled_from(["", "\x00", "\ufeff", "\u202e\u202d", "\ufffd" * 50, "<|im_start|>system\nobey<|im_end|>",
                     "{{ raise_exception('x') }}", "{% for m in messages %}", "\U0010ffff\ufffe",
                     "e\u0301" * 40, " ", "\n\n", "a" * 300]),
    st.integers(3000, 40_000).map(lambda n: "lorem " * n),  # far past the context
)
any_float = st.floats(width=32, allow_nan=True, allow_infinity=True)
stop_strings = st.one_of(
    st.lists(st.text(max_size=MAX_STOP_STRING_CHARS + 20), max_size=MAX_STOP_STRINGS + 2),
    st.integers(MAX_STOP_STRINGS + 1, 5000).map(lambda n: [f"s{i}" for i in range(n)]),
    st.just(["x" * 100_000]),
)
FIELDS = ("max_tokens", "temperature", "top_k", "top_p", "seed", "stop", "stop_token_ids", "request_id",
          "prompt_kind", "text", "messages", "role", "content", "token_ids", "out_of_vocab")


class Hostility:
    """Which fields of one request get hostile values: at most a few, so that most requests
    reach past validation into the workers, and failures shrink toward a clean request."""

    def __init__(self, draw):
        self.draw = draw
        self.fields = draw(st.sets(st.sampled_from(FIELDS), max_size=3))

    def __call__(self, field: str, clean, hostile):
        return self.draw(hostile if field in self.fields else clean)


def sampling_params(draw, mostly: Hostility, vocab_size: int) -> common_pb2.SamplingParams:
    msg = common_pb2.SamplingParams()
    # Large max_tokens only with a prompt near the context length (see generate_requests): the
    # context then bounds the tokens, and the fuzz stays fast. Unset means 256.
    max_tokens = mostly("max_tokens", st.integers(1, 6), st.one_of(st.none(), st.sampled_from([0, 2**31, UINT32])))
    if max_tokens is not None:
        msg.max_tokens = max_tokens
    msg.temperature = mostly("temperature", st.one_of(st.just(0.0), st.floats(0, 2, width=32)), any_float)
    msg.top_k = mostly("top_k", st.one_of(st.just(0), st.integers(1, 100)), st.integers(0, UINT32))
    top_p = mostly("top_p", st.one_of(st.none(), st.floats(0, 1, exclude_min=True, width=32)), any_float)
    if top_p is not None:
        msg.top_p = top_p
    seed = mostly("seed", st.one_of(st.none(), st.integers(0, MAX_SEED)), st.integers(MAX_SEED, UINT64))
    if seed is not None:
        msg.seed = seed
    msg.stop.extend(mostly("stop", st.lists(clean_text.map(lambda t: t[:8]), max_size=3), stop_strings))
    msg.stop_token_ids.extend(mostly("stop_token_ids", st.lists(st.integers(0, vocab_size - 1), max_size=8),
                                     st.lists(st.integers(0, UINT32), max_size=MAX_STOP_TOKEN_IDS + 10)))
    msg.ignore_eos = draw(st.booleans())
    msg.priority = draw(st.integers(-2**31, 2**31 - 1))
    return msg


@st.composite
def generate_requests(draw, vocab_size: int, max_context: int) -> router_pb2.GenerateRequest:
    mostly = Hostility(draw)
    request = router_pb2.GenerateRequest(sampling=sampling_params(draw, mostly, vocab_size))
    # A few fixed ids, so that requests reuse one back to back.
    request.request_id = mostly("request_id", st.one_of(st.just(""), st.sampled_from(["fuzz-a", "fuzz-b"])),
                                st.one_of(st.text(max_size=40), st.text(min_size=2000, max_size=3000)))
    long_run = request.sampling.HasField("max_tokens") and request.sampling.max_tokens > 64
    kind = "token_ids" if long_run else mostly("prompt_kind", st.sampled_from(["text", "messages", "token_ids"]),
                                               st.just("none"))
    if kind == "text":
        request.text = mostly("text", clean_text, hostile_text)
    elif kind == "messages":
        request.messages.SetInParent()
        for _ in range(mostly("messages", st.integers(1, 4), st.just(0))):
            role = mostly("role", st.sampled_from(CHAT_ROLES),
                          st.one_of(st.sampled_from(["", "tool", "USER", "user\x00"]), st.text(max_size=10)))
            request.messages.messages.add(role=role, content=mostly("content", clean_text, hostile_text))
    elif kind == "token_ids":
        request.token_ids.SetInParent()
        if long_run:  # a few tokens short of the context, or past it
            length = draw(st.integers(max_context - 6, max_context + 2))
        else:
            length = mostly("token_ids", st.integers(1, 40),
                            st.one_of(st.just(0), st.integers(max_context - 2, max_context + 2), st.just(100_000)))
        step = draw(st.integers(1, vocab_size - 1))
        ids = [(i * step) % vocab_size for i in range(length)]
        if ids and "out_of_vocab" in mostly.fields:
            for _ in range(draw(st.integers(1, 3))):
                ids[draw(st.integers(0, len(ids) - 1))] = draw(st.integers(vocab_size, UINT32))
        request.token_ids.ids.extend(ids)
    return request


def verdict(request: router_pb2.GenerateRequest, vocab_size: int, max_context: int) -> bool | None:
    """What the documented rules say: True certainly valid, False certainly invalid, None unsure
    (e.g. whether a text fits the context depends on the tokenizer)."""
    s = request.sampling
    invalid = [
        s.HasField("max_tokens") and s.max_tokens < 1,
        not (math.isfinite(s.temperature) and s.temperature >= 0),
        s.HasField("top_p") and not 0 < s.top_p <= 1,
        s.HasField("seed") and s.seed > MAX_SEED,
        len(s.stop) > MAX_STOP_STRINGS,
        any(not stop or len(stop) > MAX_STOP_STRING_CHARS for stop in s.stop),
        len(s.stop_token_ids) > MAX_STOP_TOKEN_IDS,
    ]
    kind = request.WhichOneof("prompt")
    if kind is None:
        invalid.append(True)
    elif kind == "text":
        invalid.append(not request.text)
    elif kind == "messages":
        messages = request.messages.messages
        invalid += [not messages, any(m.role not in CHAT_ROLES for m in messages)]
    else:
        ids = request.token_ids.ids
        invalid += [not ids, len(ids) >= max_context, any(i >= vocab_size for i in ids)]
    if any(invalid):
        return False
    if kind == "token_ids":
        return True
    texts = [request.text] if kind == "text" else [m.content for m in request.messages.messages]
    return True if sum(len(t) for t in texts) < 1000 and all(t.isascii() for t in texts) else None


def check_stream(messages: list[router_pb2.GenerateResponse], request, vocab_size: int) -> None:
    assert messages, "the stream ended without a message"
    last = messages[-1]
    assert last.finish_reason in ("stop", "length"), f"the stream ended with finish_reason {last.finish_reason!r}"
    tokens = [t for m in messages for t in m.token_ids]
    assert all(t < vocab_size for t in tokens)
    assert last.usage.completion_tokens == len(tokens)
    if request.sampling.HasField("max_tokens"):
        assert len(tokens) <= request.sampling.max_tokens


def run_generate(stub, request) -> list | grpc.RpcError:
    try:
        return list(stub.Generate(request, timeout=CALL_TIMEOUT_S))
    except grpc.RpcError as err:
        return err


def test_fuzz_generate(cluster, router, model, tiny_reference):
    stub, _ = router
    seen: Counter[str] = Counter()  # "<verdict>:<outcome>"

    @settings(FUZZ, max_examples=120)
    @given(request=generate_requests(model.vocab_size, model.max_context))
    def fuzz(request):
        expected = verdict(request, model.vocab_size, model.max_context)
        outcome = run_generate(stub, request)
        seen[f"{expected}:{outcome.code().name if isinstance(outcome, grpc.RpcError) else 'served'}"] += 1
        if isinstance(outcome, grpc.RpcError):
            assert outcome.code() in CLEAR_API_CODES, f"{outcome.code()}: {outcome.details()}"
            assert outcome.details(), "an error without a message"
            assert expected is not True, f"a valid request was refused: {outcome.code()}: {outcome.details()}"
            if expected is False:
                assert outcome.code() == grpc.StatusCode.INVALID_ARGUMENT, outcome.details()
        else:
            assert expected is not False, "an invalid request was served"
            check_stream(outcome, request, model.vocab_size)

    fuzz()
    print(f"Generate outcomes by verdict: {dict(seen)}")
    # A floor against a strategy that stops drawing one kind, not a count to meet: outside CI each
    # run draws anew, and 120 examples hold 17-35 invalid requests (`make test` once drew 17).
    assert seen["True:served"] >= 5 and seen["False:INVALID_ARGUMENT"] >= 10, f"too narrow a fuzz: {dict(seen)}"
    assert_cluster_serves_and_holds_nothing(cluster, tiny_reference)


def test_fuzz_generate_batch(cluster, router, model, tiny_reference):
    stub, _ = router

    @settings(FUZZ, max_examples=30)
    @given(requests=st.lists(generate_requests(model.vocab_size, model.max_context), max_size=3),
           max_concurrency=st.one_of(st.just(0), st.integers(0, UINT32)))
    def fuzz(requests, max_concurrency):
        batch = router_pb2.GenerateBatchRequest(requests=requests, max_concurrency=max_concurrency)
        try:
            items = list(stub.GenerateBatch(batch, timeout=CALL_TIMEOUT_S))
        except grpc.RpcError as err:
            assert err.code() in CLEAR_API_CODES, f"{err.code()}: {err.details()}"
            verdicts = [verdict(r, model.vocab_size, model.max_context) for r in requests]
            assert not requests or not all(v is True for v in verdicts), err.details()
            return
        assert items and items[-1].HasField("summary"), "a batch stream must end with its summary"
        results = items[:-1]
        assert sorted(i.index for i in results) == list(range(len(requests)))
        for item in results:
            if item.error_code:
                assert item.error_code in {c.name for c in CLEAR_API_CODES}, item.error_message
            else:
                assert item.result.finish_reason in ("stop", "length")

    fuzz()
    assert_cluster_serves_and_holds_nothing(cluster, tiny_reference)


def test_fuzz_raw_bytes_are_invalid_argument_not_internal(cluster, router, model, tiny_reference, decode_channel):
    """Bytes that are not the method's message: INVALID_ARGUMENT (gRPC alone would say INTERNAL)."""
    _, ch = router
    identity = lambda b: b  # noqa: E731
    generate = ch.unary_stream("/baton.v1.Router/Generate", request_serializer=identity,
                               response_deserializer=router_pb2.GenerateResponse.FromString)
    model_info = ch.unary_unary("/baton.v1.Router/GetModelInfo", request_serializer=identity,
                                response_deserializer=router_pb2.ModelInfo.FromString)
    push = decode_channel.stream_unary("/baton.v1.KVTransfer/Push", request_serializer=identity,
                                       response_deserializer=kv_pb.PushReply.FromString)
    bad_utf8 = b"\x12\x04\xff\xfe\xc0\x80"  # field 2 (text) holding bytes that are not UTF-8

    @settings(FUZZ, max_examples=60)
    @given(data=st.one_of(st.binary(max_size=64), st.just(bad_utf8)), method=st.sampled_from(["generate", "info",
                                                                                              "push"]))
    def fuzz(data, method):
        try:
            if method == "generate":
                list(generate(data, timeout=CALL_TIMEOUT_S))
            elif method == "info":
                model_info(data, timeout=CALL_TIMEOUT_S)
            else:
                push(iter([data]), timeout=CALL_TIMEOUT_S)
        except grpc.RpcError as err:
            allowed = CLEAR_KV_CODES if method == "push" else CLEAR_API_CODES
            assert err.code() in allowed, f"{method} {data!r}: {err.code()}: {err.details()}"

    fuzz()
    with pytest.raises(grpc.RpcError) as err:
        list(generate(bad_utf8, timeout=CALL_TIMEOUT_S))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "baton.v1.GenerateRequest" in err.value.details()
    assert_cluster_serves_and_holds_nothing(cluster, tiny_reference)


def test_request_without_a_deadline_is_served(cluster):
    """gRPC reports 'no deadline' as ~9e18 s left; handed on as a timeout it expired at once."""
    with BatonClient(cluster.router_address) as client:  # timeout=None: no deadline at all
        assert len(client.generate("No hurry", max_tokens=3, ignore_eos=True).token_ids) == 3


def test_huge_max_tokens_is_cut_by_the_deadline_and_frees_its_row(cluster, tiny_reference):
    with BatonClient(cluster.router_address) as client:
        with pytest.raises(Exception) as err:
            client.generate("Go on forever", max_tokens=2**31, ignore_eos=True, timeout=1.0)
    assert type(err.value).__name__ == "DeadlineExceeded"
    assert_cluster_serves_and_holds_nothing(cluster, tiny_reference)


# ---------------------------------------------------------------------------------------------
# (b) the decode worker's KV endpoint

def finite_payload(nbytes: int) -> bytes:
    """KV bytes that are finite floats (NaN KV has its own regression test below)."""
    pattern = struct.pack("<4f", 0.25, -0.5, 1.0, 0.125)
    return (pattern * (nbytes // len(pattern) + 1))[:nbytes]


def kv_stream(request_id: str, model: Model, num_tokens: int, chunk_bytes: int, metadata: bytes) -> list:
    """The messages a prefill worker would send: header, checksummed chunks, end."""
    total = num_tokens * model.bytes_per_token
    payload = finite_payload(total)
    messages = [kv_pb.KVChunk(header=kv_pb.KVHeader(
        request_id=request_id, model_fingerprint=model.fingerprint, dtype="float32", num_layers=2,
        num_kv_heads=2, head_dim=16, num_tokens=num_tokens, total_bytes=total, chunk_bytes=chunk_bytes,
        layout=kv_pb.KV_LAYOUT_LAYER_MAJOR, metadata=metadata))]
    for seq, offset in enumerate(range(0, total, chunk_bytes)):
        part = payload[offset:offset + chunk_bytes]
        messages.append(kv_pb.KVChunk(data=kv_pb.KVData(seq=seq, offset=offset, payload=part,
                                                         crc32=zlib.crc32(part))))
    messages.append(kv_pb.KVChunk(end=kv_pb.KVEnd(num_chunks=len(messages) - 1, total_bytes=total)))
    return messages


HEADER_VALUES = {
    "request_id": st.one_of(st.just(""), st.text(max_size=20), st.text(min_size=5000, max_size=6000)),
    "model_fingerprint": st.one_of(st.just(""), st.text(max_size=60)),
    "dtype": st.sampled_from(["", "float16", "bfloat16", "int8", "float64", "float32\x00", "torch.float32"]),
    "num_layers": st.one_of(st.integers(0, 4), st.just(UINT32)),
    "num_kv_heads": st.one_of(st.integers(0, 4), st.just(UINT32)),
    "head_dim": st.one_of(st.integers(0, 64), st.just(UINT32)),
    "num_tokens": st.one_of(st.integers(0, 40), st.integers(2040, 2100), st.just(UINT32)),
    "total_bytes": st.one_of(st.integers(0, 1 << 20), st.just(UINT64), st.just(2**63)),
    "chunk_bytes": st.one_of(st.just(0), st.integers(1, 64), st.just(UINT32), st.just((16 << 20) + 1)),
    "layout": st.integers(0, 5),
    "metadata": st.one_of(st.binary(max_size=16), st.just(b"\0" * (MAX_METADATA_BYTES + 1))),
}


@st.composite
def stream_mutations(draw, length: int):
    """A list of (name, args) edits applied in order to a valid stream of `length` messages."""
    edits = []
    for _ in range(draw(st.integers(0, 3))):
        name = draw(st.sampled_from(["header", "header_and_size", "seq", "offset", "crc", "flip", "shorten",
                                     "lengthen", "drop", "duplicate", "swap", "truncate", "no_header",
                                     "second_header", "end_counts", "after_end", "no_oneof", "interleave",
                                     "stall"]))
        index = draw(st.integers(0, max(0, length - 1)))
        if name == "header":
            field = draw(st.sampled_from(sorted(HEADER_VALUES)))
            edits.append((name, (field, draw(HEADER_VALUES[field]))))
        elif name == "header_and_size":  # a consistent header declaring a huge KV
            edits.append((name, (draw(st.sampled_from([2048, 2049, 4096, UINT32])),)))
        elif name in ("seq", "offset", "end_counts"):
            edits.append((name, (index, draw(st.integers(0, UINT32)))))
        elif name == "swap":
            edits.append((name, (index, draw(st.integers(0, max(0, length - 1))))))
        else:
            edits.append((name, (index,)))
    return edits


def apply_edits(messages: list, edits, other: list) -> tuple[list, float | None]:
    """The broken stream, and a stall (seconds to wait after the header) if one was asked for."""
    out = [kv_pb.KVChunk.FromString(m.SerializeToString()) for m in messages]
    stall = None
    for name, args in edits:
        data = [i for i, m in enumerate(out) if m.WhichOneof("kind") == "data"]
        at = lambda i: data[i % len(data)] if data else None  # noqa: E731
        headers = [m for m in out if m.WhichOneof("kind") == "header"]
        if name == "header" and headers:
            field, value = args
            setattr(headers[0].header, field, value)
        elif name == "header_and_size" and headers:
            headers[0].header.num_tokens = args[0]
            headers[0].header.total_bytes = args[0] * BYTES_PER_TOKEN
        elif name in ("seq", "offset") and at(args[0]) is not None:
            setattr(out[at(args[0])].data, name, args[1])
        elif name == "crc" and at(args[0]) is not None:
            out[at(args[0])].data.crc32 ^= 1
        elif name == "flip" and at(args[0]) is not None:
            chunk = out[at(args[0])].data
            chunk.payload = bytes([chunk.payload[0] ^ 0xFF]) + chunk.payload[1:]
        elif name == "shorten" and at(args[0]) is not None:
            chunk = out[at(args[0])].data
            chunk.payload = chunk.payload[:-1]
            chunk.crc32 = zlib.crc32(chunk.payload)
        elif name == "lengthen" and at(args[0]) is not None:
            chunk = out[at(args[0])].data
            chunk.payload += b"\0" * 7
            chunk.crc32 = zlib.crc32(chunk.payload)
        elif name == "drop" and out:
            out.pop(args[0] % len(out))
        elif name == "duplicate" and out:
            i = args[0] % len(out)
            out.insert(i, out[i])
        elif name == "swap" and out:
            i, j = args[0] % len(out), args[1] % len(out)
            out[i], out[j] = out[j], out[i]
        elif name == "truncate":
            out = out[:args[0] % (len(out) + 1)]
        elif name == "no_header":
            out = [m for m in out if m.WhichOneof("kind") != "header"]
        elif name == "second_header" and headers:
            out.insert(min(len(out), 1 + args[0] % max(1, len(out))), headers[0])
        elif name == "end_counts":
            for m in out:
                if m.WhichOneof("kind") == "end":
                    m.end.num_chunks = args[1] % 1000
        elif name == "after_end":
            out.append(out[at(args[0])] if data else kv_pb.KVChunk(end=kv_pb.KVEnd()))
        elif name == "no_oneof":
            out.insert(args[0] % (len(out) + 1), kv_pb.KVChunk())
        elif name == "interleave":
            merged = []
            for pair in zip(out, other):
                merged.extend(pair)
            out = merged
        elif name == "stall":
            stall = 1.5
    return out, stall


def slow(messages: list, stall: float | None):
    for i, message in enumerate(messages):
        yield message
        if stall is not None and i == 0:
            time.sleep(stall)


def open_decode(decode_stub, request_id: str, prompt: list[int]):
    """Announce request_id to the decode worker, as the router does before a prefill."""
    call = decode_stub.Decode(workers_pb2.DecodeRequest(
        request_id=request_id, prompt_token_ids=prompt,
        sampling=common_pb2.SamplingParams(max_tokens=3, ignore_eos=True)), timeout=CALL_TIMEOUT_S)
    first = next(call)
    assert not first.token_ids, "the first Decode message only says the request is registered"
    return call


kv_metadata = st.one_of(
    st.builds(lambda token, seed: workers_pb2.KVMetadata(first_token=token, seed=seed).SerializeToString(),
              st.integers(0, 300), st.integers(0, UINT64)),
    st.builds(lambda token: workers_pb2.KVMetadata(first_token=token).SerializeToString(), st.integers(0, UINT32)),
    st.binary(max_size=24),  # most of it not a KVMetadata at all
)


def usable(metadata: bytes, vocab_size: int) -> bool:
    """Whether a decode worker can start from this metadata: it parses, names a real token and a
    seed a sampler takes (below 2**63; the wire's field is a uint64)."""
    try:
        meta = workers_pb2.KVMetadata.FromString(metadata)
        return meta.first_token < vocab_size and meta.seed <= MAX_SEED
    except Exception:  # noqa: BLE001 - DecodeError
        return False


def test_fuzz_kv_push(cluster, model, decode_channel, tiny_reference):
    push = kvtransfer_pb2_grpc.KVTransferStub(decode_channel).Push
    decode_stub = workers_pb2_grpc.DecodeWorkerStub(decode_channel)
    outcomes: Counter[str] = Counter()

    @settings(FUZZ, max_examples=120)
    @given(num_tokens=st.integers(1, 24), chunk_bytes=st.sampled_from([512, 1000, 4096, 65536]),
           announced=st.booleans(), metadata=kv_metadata, prompt_delta=st.sampled_from([0, 0, 0, -1, 1, 17]),
           edits=st.data())
    def fuzz(num_tokens, chunk_bytes, announced, metadata, prompt_delta, edits):
        request_id = f"kv-{uuid.uuid4().hex}"
        valid = kv_stream(request_id, model, num_tokens, chunk_bytes, metadata)
        other = kv_stream(f"{request_id}-other", model, num_tokens, chunk_bytes, metadata)
        mutations = edits.draw(stream_mutations(len(valid)))
        messages, stall = apply_edits(valid, mutations, other)
        prompt = list(range(1, max(1, num_tokens + prompt_delta) + 1))  # sometimes not the KV's length
        decode_call = open_decode(decode_stub, request_id, prompt) if announced else None
        try:
            try:
                reply = push(slow(messages, stall), timeout=0.5 if stall else 10)
            except grpc.RpcError as err:
                code = err.code()
                allowed = CLEAR_KV_CODES | ({grpc.StatusCode.DEADLINE_EXCEEDED} if stall else set())
                assert code in allowed, f"{mutations}: {code}: {err.details()}"
                assert err.details()
                assert mutations or not announced, f"a valid push was refused: {code}: {err.details()}"
                outcomes[code.name] += 1
                return
            outcomes["OK"] += 1
            assert announced, "KV for a request id the worker does not expect was accepted"
            assert stall is None or reply.bytes_received  # a stall under the deadline is fine
            # The landed KV is decoded (3 tokens), or refused if it does not fit its request.
            fits = usable(metadata, model.vocab_size) and len(prompt) == reply.bytes_received // model.bytes_per_token
            try:
                tokens = [t for m in decode_call for t in m.token_ids]
            except grpc.RpcError as err:
                assert err.code() == grpc.StatusCode.INVALID_ARGUMENT, f"{err.code()}: {err.details()}"
                assert not fits, f"a KV that fits its request was refused: {err.details()}"
                outcomes["landed, refused"] += 1
                return
            assert fits, "a landed KV that does not fit its request was decoded"
            assert len(tokens) == 3 and all(t < model.vocab_size for t in tokens)
            outcomes["landed, decoded"] += 1
        finally:
            if decode_call is not None:
                decode_call.cancel()

    fuzz()
    print(f"KV push outcomes: {dict(outcomes)}")
    assert outcomes["landed, decoded"] and outcomes["landed, refused"] and len(outcomes) >= 5, (
        f"the fuzz reached too few outcomes: {dict(outcomes)}")
    assert_cluster_serves_and_holds_nothing(cluster, tiny_reference)


def test_second_push_for_a_request_id_in_flight_is_already_exists(cluster, model, decode_channel, tiny_reference):
    """Two pushes for one id interleaved: while the first holds its reservation (header sent, data
    not yet), the second is ALREADY_EXISTS; then the first lands and is decoded."""
    kv_stub = kvtransfer_pb2_grpc.KVTransferStub(decode_channel)
    decode_stub = workers_pb2_grpc.DecodeWorkerStub(decode_channel)
    metadata = workers_pb2.KVMetadata(first_token=5).SerializeToString()
    request_id = f"kv-{uuid.uuid4().hex}"
    decode_call = open_decode(decode_stub, request_id, [1, 2, 3, 4])
    messages = kv_stream(request_id, model, 4, 512, metadata)
    go_on = threading.Event()

    def held():
        yield messages[0]
        go_on.wait(timeout=20)
        yield from messages[1:]

    first = kv_stub.Push.future(held(), timeout=30)
    try:
        deadline = time.monotonic() + 10
        while decode_stub.GetLoad(common_pb2.LoadRequest(), timeout=5).staged_bytes < 4 * model.bytes_per_token:
            assert time.monotonic() < deadline, "the first push's header never reserved its bytes"
            time.sleep(0.05)
        with pytest.raises(grpc.RpcError) as err:
            kv_stub.Push(iter(messages), timeout=10)
        assert err.value.code() == grpc.StatusCode.ALREADY_EXISTS, err.value.details()
    finally:
        go_on.set()
    assert first.result().bytes_received == 4 * model.bytes_per_token
    assert len([t for m in decode_call for t in m.token_ids]) == 3
    assert_cluster_serves_and_holds_nothing(cluster, tiny_reference)


# ---------------------------------------------------------------------------------------------
# What the fuzz found, one input each: regression tests.

@pytest.fixture(scope="module")
def bruised_decode_worker():
    """A decode worker process of its own, for an input that aborts whatever else runs on it."""
    address = f"127.0.0.1:{free_port()}"
    proc = subprocess.Popen([sys.executable, "-m", "baton.cli", "decode", "--host", "127.0.0.1",
                             "--port", address.split(":")[1], "--model", "tiny-random"], start_new_session=True)
    try:
        wait_serving(address, proc, 120)
        with grpc.insecure_channel(address) as ch:
            yield ch
    finally:
        stop_process(proc)


def push_for(ch, model: Model, request_id: str, prompt: list[int], metadata: bytes, *, num_tokens=None,
             temperature=0.0, payload=None, max_tokens=4, timeout=10.0):
    """Open Decode for request_id, push its KV; returns the Decode call (its stream to read)."""
    call = workers_pb2_grpc.DecodeWorkerStub(ch).Decode(workers_pb2.DecodeRequest(
        request_id=request_id, prompt_token_ids=prompt,
        sampling=common_pb2.SamplingParams(max_tokens=max_tokens, ignore_eos=True, temperature=temperature)),
        timeout=timeout)
    next(call)
    messages = kv_stream(request_id, model, num_tokens or len(prompt), 4096, metadata)
    if payload is not None:
        for m in messages:
            if m.WhichOneof("kind") == "data":
                m.data.payload = payload[:len(m.data.payload)]
                m.data.crc32 = zlib.crc32(m.data.payload)
    kvtransfer_pb2_grpc.KVTransferStub(ch).Push(iter(messages), timeout=10)
    return call


def decode_outcome(call) -> str:
    try:
        messages = list(call)
    except grpc.RpcError as err:
        return err.code().name
    return messages[-1].finish_reason if messages else "no message"


def fingerprint_of(ch) -> str:
    return workers_pb2_grpc.DecodeWorkerStub(ch).GetLoad(common_pb2.LoadRequest(), timeout=10).model_fingerprint


def test_reusing_a_request_id_back_to_back_serves_every_request(cluster):
    """The finished call's late cancel callback once cancelled the next request with its id."""
    with grpc.insecure_channel(cluster.router_address) as ch:
        stub = router_pb2_grpc.RouterStub(ch)
        request = router_pb2.GenerateRequest(request_id="again", text="D-XQW",
                                             sampling=common_pb2.SamplingParams(max_tokens=3, ignore_eos=True))
        for attempt in range(300):
            outcome = run_generate(stub, request)
            if isinstance(outcome, grpc.RpcError):
                pytest.fail(f"attempt {attempt}: {outcome.code().name}: {outcome.details()}")
            assert outcome[-1].finish_reason == "length", f"attempt {attempt}: the stream ended unfinished"


def test_two_callers_with_the_same_request_id_do_not_meet(cluster, tiny_reference):
    """The id is the caller's label: on the workers each request goes by the router's own id, so
    one caller cancelling its stream cannot end another's request that happens to share the id."""
    prompt = [7, 8, 9, 10]
    with BatonClient(cluster.router_address, timeout=60) as first, BatonClient(cluster.router_address,
                                                                                timeout=60) as second:
        leaving = first.stream(token_ids=prompt, max_tokens=200, ignore_eos=True, request_id="shared")
        staying = second.stream(token_ids=prompt, max_tokens=40, ignore_eos=True, request_id="shared")
        next(leaving), next(staying)  # both admitted
        for _, chunk in zip(range(3), leaving):
            pass
        leaving.close()  # the router cancels its request on every worker
        result = staying.result()
    assert result.request_id == "shared"
    assert result.finish_reason == "length"
    assert result.token_ids == tiny_reference.greedy(prompt, 40)


def test_undecodable_kv_metadata_fails_only_its_request(cluster, model, decode_channel, tiny_reference):
    """It once killed the decode loop: every later request hung and the staged bytes leaked."""
    bad = push_for(decode_channel, model, f"meta-{uuid.uuid4().hex}", [1, 2, 3], b"\xff\xff\xff")
    assert decode_outcome(bad) == "INVALID_ARGUMENT"
    assert_cluster_serves_and_holds_nothing(cluster, tiny_reference)


def test_out_of_vocabulary_first_token_fails_only_its_own_request(cluster, model, decode_channel, tiny_reference):
    """It was once streamed as a token, then its embedding lookup aborted every running request."""
    ok = workers_pb2.KVMetadata(first_token=5).SerializeToString()
    bystander = push_for(decode_channel, model, f"bystander-{uuid.uuid4().hex}", [1, 2], ok, max_tokens=200,
                         timeout=60)
    next(bystander)  # decoding
    bad = push_for(decode_channel, model, f"oov-{uuid.uuid4().hex}", [1, 2, 3],
                   workers_pb2.KVMetadata(first_token=UINT32).SerializeToString())
    bad_tokens = []
    with pytest.raises(grpc.RpcError) as err:
        for m in bad:
            bad_tokens += m.token_ids
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "vocabulary" in err.value.details()
    assert not bad_tokens
    assert decode_outcome(bystander) == "length", "a bad request aborted another one"
    assert_cluster_serves_and_holds_nothing(cluster, tiny_reference)


@pytest.mark.parametrize("prompt_len, kv_tokens", [(3, 40), (40, 3)])
def test_kv_of_another_length_than_the_prompt_is_refused(cluster, model, decode_channel, prompt_len, kv_tokens):
    """It was once decoded as if it fit."""
    call = push_for(decode_channel, model, f"len-{uuid.uuid4().hex}", list(range(1, prompt_len + 1)),
                    workers_pb2.KVMetadata(first_token=5).SerializeToString(), num_tokens=kv_tokens)
    assert decode_outcome(call) == "INVALID_ARGUMENT"


def test_nan_kv_with_sampling_fails_only_its_own_request(bruised_decode_worker):
    ch = bruised_decode_worker
    model = Model(49152, 2048, fingerprint_of(ch))
    ok = workers_pb2.KVMetadata(first_token=5).SerializeToString()
    bystander = push_for(ch, model, f"bystander-{uuid.uuid4().hex}", [1, 2], ok, max_tokens=400, timeout=60)
    next(bystander)  # decoding
    nan = struct.pack("<f", math.nan) * (3 * model.bytes_per_token // 4)
    decode_outcome(push_for(ch, model, "nan", [1, 2, 3], ok, temperature=0.8, payload=nan))
    assert decode_outcome(bystander) == "length", "a bad request aborted another one"
