"""KVDelivery alone, without a model or a compute loop: a prefilled prompt's KV pushed to a real
KVTransfer receiver over gRPC on loopback (whole, without the tokens the decode worker holds, or
streamed while it prefills), a push that cannot land, a cancelled job, the bound on channels and
the senders' priority order."""
from __future__ import annotations

import socket
import threading

import pytest
import torch

from baton.config import PrefillSettings
from baton.metrics import Metrics
from baton.sampling import SamplingParams
from baton.v1 import kvtransfer_pb2_grpc, workers_pb2
from baton.engine.kv import KVShape, SequenceKV
from baton.engine.request import GenerationRequest, PrefilledRequest, RequestError
from baton.kvtransfer import Receiver, ReceiverConfig, StagingConfig, StagingPool
from baton.kvtransfer.errors import KVPushFailed
from baton.kvtransfer.grpc_transport import KVTransferServicer
from baton.kvtransfer.wire import grpc_channel_options, grpc_server_ping_options
from baton.prefill_worker import delivery as delivery_module
from baton.prefill_worker.delivery import KVDelivery, PushSenders
from baton.prefill_worker.jobs import PrefillDone, PrefillJob

SHAPE = KVShape(num_layers=2, num_kv_heads=2, head_dim=8, dtype=torch.float32)
FINGERPRINT = "test-model"
TOKENS = 40


@pytest.fixture
def receiver(grpc_server):
    """(target, pool, landed ids) of a KVTransfer receiver for SHAPE."""
    landed: list[str] = []
    pool = StagingPool(StagingConfig(capacity_bytes=8 << 20), on_landed=landed.append)
    servicer = KVTransferServicer(Receiver(pool, ReceiverConfig(FINGERPRINT, SHAPE)))
    target = grpc_server(kvtransfer_pb2_grpc.add_KVTransferServicer_to_server, servicer,
                         grpc_channel_options() + grpc_server_ping_options())
    return target, pool, landed


def delivery(**settings) -> KVDelivery:
    values = dict(kv_transport="grpc", kv_chunk_bytes=1024, kv_stream=False)
    return KVDelivery(FINGERPRINT, SHAPE, PrefillSettings(**{**values, **settings}), Metrics("prefill"))


def prefilled_job(request_id: str, target: str, skip: int = 0) -> tuple[PrefillJob, PrefilledRequest]:
    """A job as the loop hands it over: marked through its prefill, with its KV and first token."""
    request = GenerationRequest(request_id, list(range(1, TOKENS + 1)), SamplingParams(max_tokens=4))
    for mark in ("arrived", "prefill_start", "prefill_end"):
        request.trace.mark(mark)
    kv = SequenceKV(torch.randn(SHAPE.num_layers, 2, SHAPE.num_kv_heads, TOKENS, SHAPE.head_dim))
    return PrefillJob(request, target, kv_skip_tokens=skip), PrefilledRequest(request, kv, first_token=7, seed=3)


def transports(kv: KVDelivery) -> dict[str, float]:
    return {name: kv.metrics.transfer_transports.labels(name)._value.get() for name in ("grpc", "grpc_stream")}


def test_a_prefilled_prompt_lands_whole_and_its_job_reports_it(receiver):
    target, pool, landed = receiver
    kv = delivery()
    try:
        job, prefilled = prefilled_job("whole", target)
        kv.submit(job, prefilled)
        assert job.sent
        done = job.done.result(timeout=30)
        assert isinstance(done, PrefillDone) and (done.first_token, done.seed, done.computed_tokens) == (7, 3, TOKENS)
        assert landed == ["whole"] and kv.unpushed_bytes == 0
        staged = pool.take("whole")
        assert torch.equal(staged.kv.data, prefilled.kv.data)
        meta = workers_pb2.KVMetadata.FromString(staged.metadata)
        assert (meta.first_token, meta.seed) == (7, 3)
        assert transports(kv) == {"grpc": 1, "grpc_stream": 0}
        assert kv.metrics.transfer_bytes._value.get() == prefilled.kv.nbytes
    finally:
        kv.close()


def test_only_the_tokens_the_decode_worker_lacks_travel(receiver):
    target, pool, _ = receiver
    kv = delivery()
    try:
        job, prefilled = prefilled_job("skip", target, skip=16)
        kv.submit(job, prefilled)
        job.done.result(timeout=30)
        assert torch.equal(pool.take("skip").kv.data, prefilled.kv.data[:, :, :, 16:])
        assert kv.metrics.transfer_bytes._value.get() == (TOKENS - 16) * SHAPE.bytes_per_token()
    finally:
        kv.close()


def test_a_streamed_push_sends_each_chunk_as_it_is_computed(receiver):
    target, pool, landed = receiver
    kv = delivery(kv_stream=True)
    try:
        job, prefilled = prefilled_job("streamed", target)
        stream = kv.open_stream(job, TOKENS)
        assert stream is job.stream is not None
        for end in (10, 25):  # two chunks prefilled: each one's tokens go at once
            stream.put(SequenceKV(prefilled.kv.data[:, :, :, :end]), end)
        assert stream.sent == 25 and not landed
        stream.put(SequenceKV(prefilled.kv.data[:, :, :, 25:]), TOKENS, start=25)  # the last chunk, alone
        kv.submit(job, prefilled)
        job.done.result(timeout=30)
        assert torch.equal(pool.take("streamed").kv.data, prefilled.kv.data)
        assert transports(kv) == {"grpc": 0, "grpc_stream": 1}
    finally:
        kv.close()


def test_a_push_that_cannot_land_fails_its_job_and_frees_its_bytes(monkeypatch):
    with socket.socket() as closed:  # a port nothing listens on: every attempt is refused
        closed.bind(("127.0.0.1", 0))
        gone = f"127.0.0.1:{closed.getsockname()[1]}"
    kv = delivery()
    try:
        job, prefilled = prefilled_job("lost", gone)
        kv.submit(job, prefilled)
        with pytest.raises(KVPushFailed):
            job.done.result(timeout=60)
        assert kv.unpushed_bytes == 0
        assert kv.metrics.transfers.labels("failed")._value.get() == 1
        assert kv.metrics.transfers.labels("retried")._value.get() == delivery_module.PUSH_RETRY.attempts - 1
    finally:
        kv.close()


def test_a_cancelled_job_is_not_pushed(receiver):
    target, _, landed = receiver
    kv = delivery()
    try:
        job, prefilled = prefilled_job("cancelled", target)
        job.cancelled = True
        kv.submit(job, prefilled)
        with pytest.raises(RequestError, match="cancelled"):
            job.done.result(timeout=30)
        assert not landed and kv.unpushed_bytes == 0
        assert kv.metrics.transfers.labels("cancelled")._value.get() == 1
    finally:
        kv.close()


def test_bytes_handed_over_count_until_their_push_ends():
    kv = delivery()
    gate = threading.Event()
    try:
        kv._senders.submit(1 << 20, gate.wait)  # noqa: SLF001 -- hold every sender so the push waits
        for _ in range(delivery_module.SENDER_THREADS - 1):
            kv._senders.submit(1 << 20, gate.wait)  # noqa: SLF001
        job, prefilled = prefilled_job("held", "127.0.0.1:1")
        job.cancelled = True  # ends without a network call once a sender is free
        kv.submit(job, prefilled)
        assert kv.unpushed_bytes == prefilled.kv.nbytes
        gate.set()
        with pytest.raises(RequestError):
            job.done.result(timeout=30)
        kv.wait_for_a_push(5)
        assert kv.unpushed_bytes == 0
    finally:
        gate.set()
        kv.close()


def test_push_channels_to_decode_workers_that_came_and_went_are_bounded(monkeypatch):
    monkeypatch.setattr(delivery_module, "MAX_PUSH_CHANNELS", 3)
    kv = delivery()
    try:
        first = kv.channel("127.0.0.1:1")
        for port in range(2, 6):  # four more addresses: the least recently used ones are closed
            kv.channel(f"127.0.0.1:{port}")
            assert len(kv._channels) <= 3  # noqa: SLF001
        assert "127.0.0.1:1" not in kv._channels  # noqa: SLF001
        assert kv.channel("127.0.0.1:5") is kv._channels["127.0.0.1:5"]  # noqa: SLF001 -- reused, not reopened
        assert kv.channel("127.0.0.1:1") is not first
    finally:
        kv.close()


def test_kv_pushes_go_highest_priority_first():
    """An interactive prompt's push does not queue behind batch members' pushes."""
    senders, gate, order = PushSenders(1), threading.Event(), []
    senders.submit(0, gate.wait)  # occupies the only sender
    for name, priority in (("member-1", -65536), ("member-2", -65536), ("interactive", 0), ("member-3", -65536)):
        senders.submit(priority, order.append, name)
    done = threading.Event()
    senders.submit(-(1 << 20), done.set)
    gate.set()
    assert done.wait(5)
    assert order == ["interactive", "member-1", "member-2", "member-3"]
    senders.shutdown()


def test_pushes_to_this_host_go_through_shared_memory_whole_not_streamed():
    """Streaming pays between hosts; to a decode worker on this host the one copy into shared
    memory at the end is cheaper. With kv_stream off nothing streams."""
    job, _ = prefilled_job("local", "127.0.0.1:5999")
    for settings in ({"kv_transport": "auto", "kv_stream": True}, {"kv_stream": False}):
        kv = delivery(**settings)
        try:
            assert kv.open_stream(job, TOKENS) is None and job.stream is None
        finally:
            kv.close()


def test_reads_of_a_decode_workers_kv_go_ahead_until_measured_slower_than_computing():
    from baton.prefill_worker.kv_pull import PullRates

    rates = PullRates()
    assert not rates.worth_pulling(8, min_tokens=16)  # less than a block: the cache could not take it
    assert rates.worth_pulling(64, min_tokens=16)  # nothing measured: read
    rates.computed(100, 1.0)  # 10 ms a token
    assert rates.worth_pulling(64, min_tokens=16)  # reads not measured yet
    rates.pulled(100, 0.1)  # 1 ms a token
    assert rates.worth_pulling(64, min_tokens=16)
    for _ in range(40):  # the link slows to 50 ms a token: the moving mean follows
        rates.pulled(100, 5.0)
    assert not rates.worth_pulling(64, min_tokens=16)
    rates.computed(0, 1.0)
    rates.pulled(10, 0.0)  # nothing computed, or no time: not a measurement
    assert rates.compute_token_s == pytest.approx(0.01) and rates.pull_token_s > 0.04
