"""DecodeWorker.ReadKV over real gRPC: a prefill worker reads the KV a decode worker holds of a
registered request's prompt (tests/test_conversations.py runs it in a cluster). Here: only the
holder of the request's push token reads, only what the registration holds, and a refused read
leaves the reader computing instead, its memory bound untouched."""
from __future__ import annotations

import time

import grpc
import pytest

from conftest import TEST_DTYPE

from baton.config import DecodeSettings, ModelSettings
from baton.v1 import common_pb2, workers_pb2, workers_pb2_grpc


@pytest.fixture(scope="module")
def decode_worker():
    from baton.decode_worker.service import serve

    server, loop = serve(ModelSettings(name="tiny-random", dtype=TEST_DTYPE), DecodeSettings(host="127.0.0.1", port=0),
                         block=False)
    try:
        yield f"127.0.0.1:{server.port}", loop
    finally:
        loop.stop()
        server.stop(0)


def test_only_the_requests_own_push_token_reads_and_only_what_is_held(decode_worker):
    address, loop = decode_worker
    with grpc.insecure_channel(address) as ch:
        stub = workers_pb2_grpc.DecodeWorkerStub(ch)
        waiting = stub.Decode(workers_pb2.DecodeRequest(request_id="r", prompt_token_ids=list(range(40, 80)),
                                                        push_token="secret"), timeout=30)
        assert next(waiting).held_prefix_tokens == 0  # registered, holding nothing of its prompt
        cases = [
            (workers_pb2.ReadKVRequest(request_id="r", num_tokens=16), "INVALID_ARGUMENT", "required"),
            (workers_pb2.ReadKVRequest(request_id="r", push_token="guess", num_tokens=16), "PERMISSION_DENIED",
             "push token"),
            (workers_pb2.ReadKVRequest(request_id="other", push_token="secret", num_tokens=16), "PERMISSION_DENIED",
             "push token"),
            (workers_pb2.ReadKVRequest(request_id="r", push_token="secret", num_tokens=16), "FAILED_PRECONDITION",
             "holds the KV of 0"),
        ]
        for request, code, words in cases:
            with pytest.raises(grpc.RpcError) as err:
                list(stub.ReadKV(request, timeout=10))
            assert err.value.code().name == code and words in err.value.details(), err.value.details()
        waiting.cancel()
        with pytest.raises(grpc.RpcError) as err:  # cancelled: no longer registered with that token
            list(stub.ReadKV(workers_pb2.ReadKVRequest(request_id="r", push_token="secret", num_tokens=16), timeout=10))
        # the loop forgets it first and the staging pool a moment later: a read between the two finds
        # no request (NOT_FOUND), one after no registration for the token (PERMISSION_DENIED)
        assert err.value.code() in (grpc.StatusCode.PERMISSION_DENIED, grpc.StatusCode.NOT_FOUND), err.value.details()
        deadline = time.monotonic() + 10
        while loop.pool.expects_token("r", "secret") and time.monotonic() < deadline:
            time.sleep(0.01)
        with pytest.raises(grpc.RpcError) as err:
            list(stub.ReadKV(workers_pb2.ReadKVRequest(request_id="r", push_token="secret", num_tokens=16), timeout=10))
        assert err.value.code() == grpc.StatusCode.PERMISSION_DENIED
        load = stub.GetLoad(common_pb2.LoadRequest(), timeout=10)
        assert load.waiting_for_kv == 0 and loop.reads_total == 0


def test_a_refused_read_leaves_the_prefill_worker_computing(decode_worker):
    from baton.server import channel
    from baton.prefill_worker.kv_pull import KVPuller

    address, loop = decode_worker
    shape = loop.core.runner.loaded.kv_shape
    puller = KVPuller(str(loop.core.runner.loaded.fingerprint), shape, 1 << 20, lambda target: channel(target))
    with grpc.insecure_channel(address) as ch:
        waiting = workers_pb2_grpc.DecodeWorkerStub(ch).Decode(
            workers_pb2.DecodeRequest(request_id="p", prompt_token_ids=list(range(40, 80)), push_token="t"), timeout=30)
        next(waiting)
        assert puller.pull(address, "p", "t", 16, timeout_s=5) is None  # it holds none of the prompt
        assert puller.pull(address, "p", "wrong", 16, timeout_s=5) is None
        assert puller.pull("127.0.0.1:1", "p", "t", 16, timeout_s=5) is None  # nobody there
        waiting.cancel()
    assert (puller.failures_total, puller.pulls_total, puller.held_bytes) == (3, 0, 0)
