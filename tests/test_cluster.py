"""End to end with real processes on loopback: router, 2 prefill and 2 decode workers, the SDK."""
from __future__ import annotations

import threading
import time

import grpc
import pytest

from baton.launch.up import LocalCluster
from baton.v1 import common_pb2, router_pb2, router_pb2_grpc
from baton.client import BatonClient
from baton.client.errors import DeadlineExceeded

pytestmark = pytest.mark.slow

QUESTIONS = [
    "What is the capital of France?", "Name three colors.", "Write a haiku about rain.", "What is 7 times 8?",
    "Give me one tip for sleeping well.", "Why do cats purr?", "Translate 'good morning' to Spanish.",
    "What is a prime number?", "Say hello in French.", "List two planets.",
]


@pytest.fixture(scope="module")
def cluster():
    with LocalCluster(prefill=2, decode=2, model="default", max_rows=4) as running:
        yield running


@pytest.fixture(scope="module")
def client(cluster):
    with BatonClient(cluster.router_address, timeout=300) as c:
        yield c


def cluster_loads(client) -> dict[str, object]:
    return {w.address: w for w in client.cluster_status().workers}


def test_concurrent_prompts_match_generate_and_spread_over_workers(cluster, client, default_reference):
    # Greedy asked for: the default model's own default sampling is temperature 0.2, top_p 0.9.
    results = client.generate_many([{"prompt": q, "max_tokens": 16, "temperature": 0} for q in QUESTIONS],
                                   max_concurrency=len(QUESTIONS))
    for question, result in zip(QUESTIONS, results):
        expected = default_reference.greedy(result.prompt_token_ids, 16)
        assert result.token_ids == expected, question
        assert result.finish_reason in ("stop", "length")
        assert result.usage.completion_tokens == len(result.token_ids)
        assert {"queue", "prefill", "transfer", "staging", "admission", "decode"} <= set(result.trace.stage_seconds)
    time.sleep(0.5)  # one load poll
    workers = cluster_loads(client)
    for address in cluster.prefill_addrs:
        assert workers[address].prefill["requests_done"] > 0, f"prefill worker {address} served nothing"
    for address in cluster.decode_addrs:
        load = workers[address].decode
        assert load["requests_finished"] > 0, f"decode worker {address} served nothing"
        assert load["prompt_tokens_forwarded"] == 0, "a decode worker ran a prefill"


def test_cancelled_stream_frees_its_row_while_others_finish(cluster, client):
    finished = {}

    def run(i: int):
        finished[i] = client.generate(QUESTIONS[i], max_tokens=40, ignore_eos=True)

    others = [threading.Thread(target=run, args=(i,)) for i in range(3)]
    for t in others:
        t.start()
    stream = client.stream("Tell me a very long story about a lighthouse.", max_tokens=400, ignore_eos=True)
    received = 0
    for chunk in stream:
        received += len(chunk.token_ids)
        if received >= 5:
            break
    stream.close()  # cancels the RPC
    for t in others:
        t.join(timeout=120)
    assert all(len(finished[i].token_ids) == 40 for i in range(3))
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        loads = [w.decode for w in cluster_loads(client).values() if w.role == "decode"]
        if all(d["rows_in_use"] == 0 and d["staged_bytes"] == 0 and d["waiting_for_kv"] == 0 for d in loads):
            break
        time.sleep(0.2)
    else:
        pytest.fail(f"the cancelled request still holds KV: {loads}")


def test_expired_deadline_is_deadline_exceeded(client):
    with pytest.raises(DeadlineExceeded):
        client.generate("Write a long essay about the sea.", max_tokens=400, ignore_eos=True, timeout=0.3)


@pytest.mark.parametrize("request_fields, message", [
    ({"text": ""}, "empty"),
    ({"token_ids": router_pb2.TokenIds(ids=[1, 10**7])}, "vocabulary"),
    ({"text": "hi", "sampling": common_pb2.SamplingParams(top_p=1.5)}, "top_p"),
    ({"text": "hi", "sampling": common_pb2.SamplingParams(max_tokens=0)}, "max_tokens"),
    ({}, "no prompt"),
])
def test_bad_requests_are_invalid_argument(cluster, request_fields, message):
    """Sent raw, past the SDK's own checks: the router itself must refuse them."""
    with grpc.insecure_channel(cluster.router_address) as channel:
        stub = router_pb2_grpc.RouterStub(channel)
        with pytest.raises(grpc.RpcError) as err:
            list(stub.Generate(router_pb2.GenerateRequest(**request_fields), timeout=30))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert message in err.value.details()
