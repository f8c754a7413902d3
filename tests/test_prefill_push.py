"""A prefill worker's KV push to a decode worker that breaks: noticed within about a second,
retried, and when it cannot land, reported to the router as ABORTED (which moves the request).

A real prefill worker (tiny-random model) serves over gRPC on loopback; the "decode worker" is a
KVTransfer receiver for the same model, reached directly or through a proxy that breaks the
first connection. Timing asserts are generous; the measured figures are printed."""
from __future__ import annotations

import socket
import time

import grpc
import pytest
import torch
from breaking_proxy import BreakingProxy
from conftest import TEST_DTYPE

from baton.config import ModelSettings, PrefillSettings
from baton.v1 import common_pb2, kvtransfer_pb2_grpc, workers_pb2, workers_pb2_grpc
from baton.kvtransfer import Receiver, ReceiverConfig, StagingConfig, StagingPool
from baton.kvtransfer.errors import KVPushFailed
from baton.kvtransfer.grpc_transport import KVTransferServer, KVTransferServicer
from baton.kvtransfer.wire import grpc_channel_options, grpc_server_ping_options
from baton.engine.request import GenerationRequest
from baton.engine.executors import make_runner
from baton.sampling import SamplingParams
from baton.prefill_worker.jobs import PrefillJob
from baton.prefill_worker.loop import PrefillLoop
from baton.prefill_worker.service import serve

# 750 KiB of tiny-random KV (512 B a token) in 64 KiB chunks; the proxy breaks after 256 KiB.
PROMPT = [(17 * i) % 1000 + 3 for i in range(1500)]
BREAK_AFTER = 256 << 10


@pytest.fixture(scope="module")
def prefill_worker():
    """(address, PrefillLoop) of a real prefill worker with small KV chunks (many per push)."""
    server, loop = serve(ModelSettings(name="tiny-random", dtype=TEST_DTYPE),
                         PrefillSettings(host="127.0.0.1", port=0, kv_chunk_bytes=64 << 10), block=False)
    try:
        yield f"127.0.0.1:{server.port}", loop
    finally:
        loop.stop()
        server.stop(grace=None)


@pytest.fixture
def decode_receiver(prefill_worker, grpc_server):
    """Start a KVTransfer receiver for the prefill worker's model: (target, pool, landed ids)."""
    _, loop = prefill_worker

    def start():
        landed: list[str] = []
        pool = StagingPool(StagingConfig(capacity_bytes=64 << 20), on_landed=landed.append)
        loaded = loop.runner.loaded
        receiver = Receiver(pool, ReceiverConfig(str(loaded.fingerprint), loaded.kv_shape))
        target = grpc_server(kvtransfer_pb2_grpc.add_KVTransferServicer_to_server, KVTransferServicer(receiver),
                             grpc_channel_options() + grpc_server_ping_options())
        return target, pool, landed

    return start


def prefill(address: str, request_id: str, decode_target: str):
    """Call Prefill as the router does; (reply or RpcError, seconds)."""
    request = workers_pb2.PrefillRequest(request_id=request_id, prompt_token_ids=PROMPT, decode_target=decode_target,
                                         sampling=common_pb2.SamplingParams(max_tokens=4))
    started = time.monotonic()
    with grpc.insecure_channel(address) as channel:
        try:
            reply = workers_pb2_grpc.PrefillWorkerStub(channel).Prefill(request, timeout=60)
        except grpc.RpcError as err:
            return err, time.monotonic() - started
    return reply, time.monotonic() - started


def retried(loop) -> float:
    return loop.metrics.transfers.labels("retried")._value.get()


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["reset", "freeze"])
def test_a_push_broken_mid_way_is_retried_and_lands(prefill_worker, decode_receiver, mode):
    address, loop = prefill_worker
    target, pool, landed = decode_receiver()
    proxy = BreakingProxy(target, mode, after_bytes=BREAK_AFTER)
    before = retried(loop)
    try:
        reply, seconds = prefill(address, f"push-{mode}", proxy.target)
    finally:
        proxy.close()
    assert not isinstance(reply, grpc.RpcError), f"the push was not retried to success: {reply}"
    print(f"\n{mode}: KV pushed after one broken attempt; transfer {reply.transfer_seconds:.2f}s, "
          f"Prefill call {seconds:.2f}s ({retried(loop) - before:.0f} retries)")
    assert proxy.broken_at is not None, "the push never crossed the break: make the prompt longer"
    assert retried(loop) - before >= 1
    assert landed == [f"push-{mode}"]
    staged = pool.take(f"push-{mode}")
    assert staged.kv.num_tokens == len(PROMPT)
    assert workers_pb2.KVMetadata.FromString(staged.metadata).first_token == reply.first_token
    assert reply.transfer_seconds < 10  # ~0 (reset) or ~1-2 s (freeze: keepalive, then a retry), not 30 s


@pytest.mark.slow
def test_a_push_to_a_decode_worker_that_is_gone_is_aborted_within_seconds(prefill_worker):
    address, loop = prefill_worker
    with socket.create_server(("127.0.0.1", 0)) as sock:
        gone = f"127.0.0.1:{sock.getsockname()[1]}"
    before = retried(loop)
    error, seconds = prefill(address, "push-gone", gone)
    print(f"\ndecode worker gone: Prefill answered {error.code().name} after {seconds:.2f}s "
          f"({retried(loop) - before:.0f} retries)")
    assert isinstance(error, grpc.RpcError)
    # ABORTED: the prefill was fine, the KV could not be delivered; the router moves the request.
    assert error.code() == grpc.StatusCode.ABORTED and gone in error.details()
    assert retried(loop) - before == 2
    assert seconds < 10


@pytest.mark.slow
def test_a_push_to_a_decode_worker_that_never_answers_is_aborted_within_seconds(prefill_worker):
    """A peer that accepts TCP and says nothing (a stopped process): each attempt gives up at
    the connect deadline (1 s), not gRPC's 20 s, nor the push's 30 s."""
    address, _ = prefill_worker
    with socket.create_server(("127.0.0.1", 0)) as silent:
        error, seconds = prefill(address, "push-silent", f"127.0.0.1:{silent.getsockname()[1]}")
    print(f"\nsilent decode worker: Prefill answered {error.code().name} after {seconds:.2f}s")
    assert isinstance(error, grpc.RpcError) and error.code() == grpc.StatusCode.ABORTED
    assert seconds < 15


def test_prompts_being_pushed_count_against_the_queue_bound(tiny_model):
    """Each prompt holds its Prefill call's server thread until its push ends, so prompts taken
    off the queue still count: a slow decode worker cannot pile up more than max_queue of them."""
    loop = PrefillLoop(make_runner(tiny_model, attention_backend="torch"), PrefillSettings(max_queue=2)).start()
    with socket.create_server(("127.0.0.1", 0)) as silent:  # each push waits out its connect deadline
        target = f"127.0.0.1:{silent.getsockname()[1]}"

        def job(rid: str) -> PrefillJob:
            return PrefillJob(GenerationRequest(rid, PROMPT[:64], SamplingParams(max_tokens=4)), target)

        try:
            pushing = [loop.submit(job(f"slow-{i}")) for i in range(2)]
            deadline = time.monotonic() + 10
            while (len(loop.queue) or len(loop._inflight) < 2) and time.monotonic() < deadline:
                time.sleep(0.01)
            assert not len(loop.queue) and len(loop._inflight) == 2, "both prompts taken and being pushed"
            with pytest.raises(OverflowError, match="queued or being prefilled"):
                loop.submit(job("one-too-many"))
            for done in pushing:
                assert isinstance(done.exception(timeout=30), Exception)  # the silent target: ABORTED later
        finally:
            loop.stop()


def test_a_pin_call_reaching_a_stopped_loop_is_refused_at_once(tiny_model):
    """A drained prefill worker's loop stops while the router may still unpin a batch group's
    prefix: the call fails at once (UNAVAILABLE at the servicer), not waits for a loop that is
    gone (found by chaos's drain fault: the worker's exit waited out its thread bound)."""
    loop = PrefillLoop(make_runner(tiny_model, attention_backend="torch"), PrefillSettings()).start()
    assert loop.call(lambda core: core.unpin("no-such-group"), timeout=10) is False
    loop.stop()
    started = time.monotonic()
    with pytest.raises(ConnectionAbortedError, match="stopped"):
        loop.call(lambda core: core.unpin("no-such-group"), timeout=30)
    assert time.monotonic() - started < 1


def test_prompts_left_queued_by_a_stop_are_refused_not_forgotten(tiny_model):
    """A prompt queued when the loop stops (past a drain's limit, or submitted as the drain ended)
    ends with ConnectionAbortedError, which the servicer answers UNAVAILABLE and the router retries
    elsewhere; once stopped, nothing more is queued."""
    loop = PrefillLoop(make_runner(tiny_model, attention_backend="torch"), PrefillSettings())  # never started
    queued = loop.submit(PrefillJob(GenerationRequest("left", PROMPT[:8], SamplingParams(max_tokens=4)), "127.0.0.1:1"))
    loop.stop()
    assert isinstance(queued.exception(timeout=1), ConnectionAbortedError)
    with pytest.raises(ConnectionAbortedError):
        loop.submit(PrefillJob(GenerationRequest("late", PROMPT[:8], SamplingParams(max_tokens=4)), "127.0.0.1:1"))


def test_a_short_prompt_goes_ahead_of_a_long_one_being_chunked(prefill_worker, decode_receiver):
    """Queued together behind a 1500-token prompt, a short prompt is prefilled after the long one's
    first chunk, not after all of it; the long one's KV lands whole, as one forward makes it."""
    _, worker = prefill_worker
    target, pool, landed = decode_receiver()
    loop = PrefillLoop(worker.runner, PrefillSettings(chunk_tokens=512))  # not started: both queue first
    finished: list[str] = []
    params = SamplingParams(max_tokens=4)
    jobs = [PrefillJob(GenerationRequest(rid, prompt, params), target)
            for rid, prompt in (("long", PROMPT), ("short", PROMPT[:20]))]
    for job in jobs:
        loop.submit(job).add_done_callback(lambda _, rid=job.request.request_id: finished.append(rid))
    loop.start()
    try:
        for job in jobs:
            job.done.result(timeout=60)
    finally:
        loop.stop()
    assert finished == ["short", "long"] and loop.chunks_done == 3  # 1500 tokens in chunks of 512
    # Each iteration's token batch is recorded: the chunks, the second with the short prompt's 4
    # tokens past the block the first chunk cached.
    assert list(loop.iteration_tokens) == [512, 512 + 4, 476]
    assert sorted(landed) == ["long", "short"]
    staged = pool.take("long")
    alone = worker.runner.prefill(PROMPT)
    torch.testing.assert_close(staged.kv.data, alone.kv.data.cpu(), rtol=1e-4, atol=1e-5)
    assert workers_pb2.KVMetadata.FromString(staged.metadata).first_token == int(alone.logits.argmax())
    pool.take("short")


@pytest.mark.parametrize("chunk_tokens", [0, 128])
def test_prompts_sharing_a_new_prefix_compute_it_once(prefill_worker, decode_receiver, chunk_tokens):
    """Queued together, two prompts with the same uncached 320-token prefix do not prefill side by
    side (in one batch, or one in chunks while the other runs): the second waits and reuses it."""
    _, worker = prefill_worker
    target, pool, landed = decode_receiver()
    loop = PrefillLoop(worker.runner, PrefillSettings(chunk_tokens=chunk_tokens))  # not started: both queue first
    prefix = [t + 1 for t in PROMPT[:320]]  # not cached by any other test
    jobs = [PrefillJob(GenerationRequest(rid, prefix + own, SamplingParams(max_tokens=4)), target)
            for rid, own in (("first", PROMPT[900:930]), ("second", PROMPT[1000:1030]))]
    for job in jobs:
        loop.submit(job)
    loop.start()
    try:
        done = [job.done.result(timeout=60) for job in jobs]
    finally:
        loop.stop()
    assert [d.cached_tokens for d in done] == [0, 320]
    for job in jobs:
        staged = pool.take(job.request.request_id)
        alone = worker.runner.prefill(job.request.prompt_token_ids)
        torch.testing.assert_close(staged.kv.data, alone.kv.data.cpu(), rtol=1e-4, atol=1e-5)


def test_an_interactive_prompt_pauses_a_batch_members_forward_between_layers(prefill_worker, decode_receiver):
    """A prompt arriving while batch members' forward runs is prefilled inside it, between two of
    its layers, and pushed first; both KVs land equal to forwards run alone."""
    _, worker = prefill_worker
    target, pool, landed = decode_receiver()
    loop = PrefillLoop(worker.runner, PrefillSettings(chunk_tokens=0))  # one whole forward for the member
    member = PrefillJob(GenerationRequest("member", PROMPT[:600], SamplingParams(max_tokens=4, priority=-65536)),
                        target)
    urgent = PrefillJob(GenerationRequest("urgent", PROMPT[700:720], SamplingParams(max_tokens=4)), target)
    serve_urgent = loop._serve_urgent

    def arrives_during_the_forward() -> None:  # the interactive prompt comes in after the first layer
        if urgent.request.trace.marks.get("arrived") is None:
            loop.submit(urgent)
        serve_urgent()

    loop._serve_urgent = arrives_during_the_forward
    loop.submit(member)
    loop.start()
    try:
        for job in (member, urgent):
            job.done.result(timeout=60)
    finally:
        loop.stop()
    marks = {job.request.request_id: job.request.trace.marks for job in (member, urgent)}
    assert marks["member"]["prefill_start"] < marks["urgent"]["prefill_start"]
    assert marks["urgent"]["prefill_end"] < marks["member"]["prefill_end"]  # done inside the member's forward
    assert loop.preemptions == 1 and loop.metrics.paused_forwards._value.get() == 1
    assert worker.runner.between_layers is None  # unhooked once the member's forward ended
    for job in (member, urgent):
        staged = pool.take(job.request.request_id)
        alone = worker.runner.prefill(job.request.prompt_token_ids)
        torch.testing.assert_close(staged.kv.data, alone.kv.data.cpu(), rtol=1e-4, atol=1e-5)
        assert workers_pb2.KVMetadata.FromString(staged.metadata).first_token == int(alone.logits.argmax())


def test_an_interactive_forward_is_never_paused(prefill_worker, decode_receiver):
    _, worker = prefill_worker
    target, _, _ = decode_receiver()
    loop = PrefillLoop(worker.runner, PrefillSettings(chunk_tokens=0))
    calls = []
    loop._serve_urgent = lambda: calls.append(1)
    job = PrefillJob(GenerationRequest("interactive", PROMPT[:100], SamplingParams(max_tokens=4)), target)
    loop.submit(job)
    loop.start()
    try:
        job.done.result(timeout=60)
    finally:
        loop.stop()
    assert calls == [] and loop.preemptions == 0


def test_with_kubernetes_discovery_kv_goes_only_to_decode_workers_the_worker_discovered(
        decode_receiver, tmp_path, monkeypatch):
    """prefill.discovery=kubernetes: the prefill worker watches the decode workers' EndpointSlices
    itself (a loopback API server here) and pushes only to those; one that leaves is refused again."""
    import yaml
    from fake_kube_api import FakeKubeApi, endpoint

    labels = {"app.kubernetes.io/name": "baton", "baton.io/role": "decode"}
    with FakeKubeApi() as kube:
        kubeconfig = {"apiVersion": "v1", "kind": "Config", "current-context": "loopback",
                      "clusters": [{"name": "loopback", "cluster": {"server": kube.url}}],
                      "users": [{"name": "prefill", "user": {"token": "not-checked"}}],
                      "contexts": [{"name": "loopback", "context": {"cluster": "loopback", "user": "prefill"}}]}
        (tmp_path / "config").write_text(yaml.safe_dump(kubeconfig))
        monkeypatch.setenv("KUBECONFIG", str(tmp_path / "config"))
        monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
        target, pool, landed = decode_receiver()
        port = int(target.rsplit(":", 1)[1])
        server, loop = serve(ModelSettings(name="tiny-random", dtype=TEST_DTYPE),
                             PrefillSettings(host="127.0.0.1", port=0, discovery="kubernetes", namespace="serving"),
                             block=False)
        address = f"127.0.0.1:{server.port}"
        try:
            refused, seconds = prefill(address, "before", target)
            assert isinstance(refused, grpc.RpcError) and refused.code() == grpc.StatusCode.PERMISSION_DENIED
            assert "discovered in namespace serving" in refused.details() and seconds >= 1.5  # waited for discovery
            kube.put_slice("decode-a", [endpoint("127.0.0.1")], ports=[{"name": "grpc", "port": port}],
                           labels=labels, namespace="serving")
            reply, _ = prefill(address, "after", target)
            assert not isinstance(reply, grpc.RpcError), reply
            assert reply.request_id == "after" and "after" in landed
            kube.delete_slice("decode-a", namespace="serving")
            assert loop.decode_targets.discovered.wait_for(lambda current: not current["decode"], timeout=5)
            gone, _ = prefill(address, "gone", target)
            assert isinstance(gone, grpc.RpcError) and gone.code() == grpc.StatusCode.PERMISSION_DENIED
        finally:
            loop.stop()
            server.stop(grace=None)
        assert not loop.decode_targets.discovery._threads[0].is_alive()  # the watch stopped with the worker


def test_prefill_stops_at_the_kv_memory_threshold_until_pushes_free_memory(prefill_worker, grpc_server):
    """BatchLLM's M_threshold: a decode side that takes one prompt's KV at a time holds the worker to
    prefilled-but-unpushed KV under prefill.kv_memory_bytes; the rest waits queued, then all land.
    (Without the threshold, p2 and p3 are prefilled and held too: 3 prompts' KV.)"""
    _, worker = prefill_worker
    loaded = worker.runner.loaded
    prompt_bytes = 200 * loaded.kv_shape.bytes_per_token()
    landed: list[str] = []
    pool = StagingPool(StagingConfig(capacity_bytes=prompt_bytes), on_landed=landed.append)
    receiver = Receiver(pool, ReceiverConfig(str(loaded.fingerprint), loaded.kv_shape, reserve_timeout_s=30))
    target = grpc_server(kvtransfer_pb2_grpc.add_KVTransferServicer_to_server, KVTransferServicer(receiver),
                         grpc_channel_options() + grpc_server_ping_options())
    settings = PrefillSettings(kv_memory_bytes=prompt_bytes * 3 // 2, kv_transport="grpc", max_batch_size=1)
    loop = PrefillLoop(worker.runner, settings)
    params = SamplingParams(max_tokens=4)
    jobs = [PrefillJob(GenerationRequest(f"p{i}", [(7 * i + j) % 900 + 5 for j in range(200)], params), target)
            for i in range(4)]
    for job in jobs:
        loop.submit(job)
    loop.start()
    try:
        deadline = time.monotonic() + 30
        while len(landed) < 1 or loop.unpushed_kv_bytes < prompt_bytes:
            assert time.monotonic() < deadline, "p0 should land and p1's push wait for staging room"
            time.sleep(0.05)
        time.sleep(0.5)  # room for a wrong third prefill to happen
        assert loop.unpushed_kv_bytes == prompt_bytes and len(loop.queue) == 2, "p2 and p3 wait for memory"
        for i in range(4):  # the decode side takes each landed KV; the next push lands, then the next prefill
            while f"p{i}" not in landed:
                assert time.monotonic() < deadline + 30, f"p{i} never landed"
                time.sleep(0.05)
            assert loop.unpushed_kv_bytes <= prompt_bytes * 3 // 2
            pool.release(pool.take(f"p{i}").request_id)
        for job in jobs:
            job.done.result(timeout=30)
    finally:
        loop.stop()
    assert loop.unpushed_kv_bytes == 0


def transports(loop) -> dict[str, float]:
    return {name: loop.metrics.transfer_transports.labels(name)._value.get() for name in ("grpc", "grpc_stream")}


@pytest.mark.parametrize("stream", [True, False])
def test_a_chunked_prompt_streams_its_kv_while_it_prefills(prefill_worker, decode_receiver, stream):
    """Over gRPC, a prompt prefilled in chunks sends each chunk's KV as it is computed (layout
    TOKEN_SPANS) and its first token with the end; the decode worker lands exactly the KV of one
    whole prefill. Off (`kv_stream: false`), the KV is pushed after the prefill, as before."""
    _, worker = prefill_worker
    target, pool, landed = decode_receiver()
    loop = PrefillLoop(worker.runner, PrefillSettings(chunk_tokens=256, kv_transport="grpc", kv_stream=stream,
                                                      kv_chunk_bytes=32 << 10)).start()
    before = transports(loop)
    try:
        job = PrefillJob(GenerationRequest("streamed", PROMPT, SamplingParams(max_tokens=4)), target)
        done = loop.submit(job).result(timeout=60)
    finally:
        loop.stop()
    assert loop.chunks_done == 6 and landed == ["streamed"]  # 1500 tokens in chunks of 256
    used = {name: count - before[name] for name, count in transports(loop).items()}
    assert used == ({"grpc": 0, "grpc_stream": 1} if stream else {"grpc": 1, "grpc_stream": 0})
    staged = pool.take("streamed")
    alone = worker.runner.prefill(PROMPT)
    torch.testing.assert_close(staged.kv.data, alone.kv.data.cpu(), rtol=1e-4, atol=1e-5)
    assert workers_pb2.KVMetadata.FromString(staged.metadata).first_token == done.first_token == int(
        alone.logits.argmax())


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["reset", "freeze"])
def test_a_stream_that_breaks_mid_prefill_is_pushed_whole_after_it(prefill_worker, decode_receiver, mode):
    """The proxy resets the streamed push part-way through the prompt's chunks, or stops passing
    its bytes either way (a partition: nothing tells the decode worker, which would hold the
    stream's staging room for STREAM_IDLE_TIMEOUT_S but for its keepalive pings): the prefill goes
    on, and its whole KV is pushed after it the usual way (with retries), landing once, exact."""
    _, worker = prefill_worker
    target, pool, landed = decode_receiver()
    proxy = BreakingProxy(target, mode, after_bytes=BREAK_AFTER)
    loop = PrefillLoop(worker.runner, PrefillSettings(chunk_tokens=256, kv_transport="grpc",
                                                      kv_chunk_bytes=32 << 10)).start()
    before = transports(loop)
    try:
        job = PrefillJob(GenerationRequest("rebuilt", PROMPT, SamplingParams(max_tokens=4)), proxy.target)
        done = loop.submit(job).result(timeout=60)
    finally:
        loop.stop()
        proxy.close()
    print(f"\n{mode}: the stream broke, then the whole KV landed {done.transfer_seconds:.2f}s after the prefill")
    assert proxy.broken_at is not None and landed == ["rebuilt"]
    used = {name: count - before[name] for name, count in transports(loop).items()}
    assert used == {"grpc": 1, "grpc_stream": 0}
    staged = pool.take("rebuilt")
    alone = worker.runner.prefill(PROMPT)
    torch.testing.assert_close(staged.kv.data, alone.kv.data.cpu(), rtol=1e-4, atol=1e-5)
    assert workers_pb2.KVMetadata.FromString(staged.metadata).first_token == done.first_token


def test_a_prompt_cancelled_mid_stream_breaks_its_push_and_frees_the_decode_workers_room(prefill_worker,
                                                                                          decode_receiver):
    _, worker = prefill_worker
    target, pool, landed = decode_receiver()
    loop = PrefillLoop(worker.runner, PrefillSettings(chunk_tokens=256, kv_transport="grpc"))  # stepped by hand
    job = PrefillJob(GenerationRequest("cancelled", PROMPT, SamplingParams(max_tokens=4)), target)
    try:
        assert loop._chunk(job) and job.stream is not None
        loop._next_chunk()  # the first chunk's KV is on its way: the decode worker holds room for it all
        deadline = time.monotonic() + 10
        while pool.stats().used_bytes == 0 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert pool.stats().used_bytes > 0
        job.cancelled = True
        loop._next_chunk()
        assert job.stream.outcome.result(timeout=10) is False
        with pytest.raises(Exception, match="cancelled"):
            job.done.result(timeout=1)
        deadline = time.monotonic() + 10
        while pool.stats().used_bytes and time.monotonic() < deadline:
            time.sleep(0.01)
        assert pool.stats().used_bytes == 0 and landed == []
    finally:
        loop.stop()


def test_a_streamed_push_sends_the_cached_prefix_first_and_skips_what_the_decode_worker_holds(prefill_worker,
                                                                                              decode_receiver):
    """A prompt sharing 688 tokens (43 blocks) with one prefilled before: its cached prefix is the
    stream's first span, sent before its first chunk runs; the 100 tokens the decode worker says it
    holds (kv_skip_tokens) are not sent at all. What lands is exactly tokens 100: of one whole prefill."""
    _, worker = prefill_worker
    target, pool, landed = decode_receiver()
    loop = PrefillLoop(worker.runner, PrefillSettings(chunk_tokens=256, kv_transport="grpc")).start()
    sharing = PROMPT[:700] + [(31 * i) % 900 + 5 for i in range(700)]
    try:
        loop.submit(PrefillJob(GenerationRequest("first", PROMPT, SamplingParams(max_tokens=4)), target)).result(60)
        job = PrefillJob(GenerationRequest("sharing", sharing, SamplingParams(max_tokens=4)), target,
                         kv_skip_tokens=100)
        done = loop.submit(job).result(timeout=60)
    finally:
        loop.stop()
    assert done.cached_tokens == 688 and job.stream is not None and job.stream.sent == len(sharing)
    assert transports(loop)["grpc_stream"] >= 2
    staged = pool.take("sharing")
    alone = worker.runner.prefill(sharing)
    assert staged.kv.num_tokens == len(sharing) - 100
    torch.testing.assert_close(staged.kv.data, alone.kv.data[:, :, :, 100:].cpu(), rtol=1e-4, atol=1e-5)
    pool.take("first")


def test_a_decode_worker_restarted_at_its_address_takes_the_next_push_at_once(prefill_worker):
    """A decode worker that stopped and came back on the same address (a container restart keeps
    its pod IP): the push after its return lands on its first attempt. gRPC would otherwise fail
    every call on a channel that was refused, at once, until its reconnect backoff ran out."""
    _, worker = prefill_worker
    loaded = worker.runner.loaded

    def receiver(port: int = 0) -> tuple[KVTransferServer, list[str]]:
        landed: list[str] = []
        pool = StagingPool(StagingConfig(capacity_bytes=64 << 20), on_landed=landed.append)
        return KVTransferServer(Receiver(pool, ReceiverConfig(str(loaded.fingerprint), loaded.kv_shape)),
                                port=port).start(), landed

    loop = PrefillLoop(worker.runner, PrefillSettings(kv_transport="grpc")).start()
    first, landed = receiver()
    try:
        def push(request_id: str):
            job = PrefillJob(GenerationRequest(request_id, PROMPT[:200], SamplingParams(max_tokens=4)), first.target)
            return loop.submit(job).exception(timeout=60)

        assert push("before") is None and landed == ["before"]
        first.stop(grace_s=None)
        assert isinstance(push("while-down"), KVPushFailed)  # refused three times
        again, landed = receiver(first.port)
        try:
            before = retried(loop)
            assert push("after") is None and landed == ["after"]
            assert retried(loop) == before, "the push after the restart was refused first"
        finally:
            again.stop(grace_s=None)
    finally:
        loop.stop()
