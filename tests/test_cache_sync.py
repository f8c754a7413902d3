"""The router's prefix index following prefill workers' cache changes over real gRPC (WatchCache):
at once, whatever happens to the request; across a worker restart, a gap, a worker leaving and a
Redis restart, with no stale entry left."""
from __future__ import annotations

import time
from concurrent import futures
from types import SimpleNamespace

import grpc
import pytest
from conftest import TEST_DTYPE
from redis_server import redis_server_fixture

from baton.block_hash import BlockHasher
from baton.config import ModelSettings, PrefillSettings
from baton.launch.up import free_port
from baton.v1 import common_pb2, workers_pb2, workers_pb2_grpc
from baton.prefill_worker.cache_events import CacheEventLog
from baton.prefill_worker.service import PrefillWorkerServicer, serve
from baton.router.cache_sync import CacheSync
from baton.router.prefix_index import InMemoryPrefixIndex, RedisPrefixIndex
from baton.router.workers import WorkerPool

redis_server = redis_server_fixture(scope="function")  # restarted by a test


def eventually(check, timeout: float = 5.0):
    """check() once it holds (its value), failing after timeout; returns the seconds it took."""
    started = time.monotonic()
    while True:
        if check():
            return time.monotonic() - started
        if time.monotonic() - started > timeout:
            pytest.fail(f"not within {timeout}s: {check.__doc__ or check}")
        time.sleep(0.01)


class Worker:
    """The prefill worker's real servicer on a port of our choosing, its cache reduced to the event log."""

    def __init__(self, port: int, log: CacheEventLog | None = None):
        self.log = log or CacheEventLog()
        self.server = grpc.server(futures.ThreadPoolExecutor(max_workers=8))
        workers_pb2_grpc.add_PrefillWorkerServicer_to_server(PrefillWorkerServicer(SimpleNamespace(cache_events=self.log)),
                                                             self.server)
        assert self.server.add_insecure_port(f"127.0.0.1:{port}") == port
        self.server.start()

    def stop(self) -> None:
        self.log.close()
        self.server.stop(None)


@pytest.fixture
def router():
    """(pool, sync, index) wired as the router's serve() wires them; stopped after."""
    made = []

    def make(index=None):
        index = index or InMemoryPrefixIndex()
        sync = CacheSync(index, check_s=0.1).start()
        pool = WorkerPool()
        pool.on_joined, pool.on_left = sync.follow, sync.forget
        made.append((pool, sync))
        return pool, sync, index

    yield make
    for pool, sync in made:
        sync.stop()
        pool.stop()


def test_changes_reach_the_index_at_once_and_a_worker_that_leaves_is_forgotten(router):
    port = free_port()
    worker = Worker(port)
    pool, sync, index = router()
    address = f"127.0.0.1:{port}"
    try:
        worker.log.publish(stored=[1, 2])  # before the router follows: comes with the snapshot
        pool.set_workers("prefill", [address])
        eventually(lambda: index.match([1, 2]) == {address: 2})
        worker.log.publish(stored=[3, 4])
        seconds = eventually(lambda: index.match([1, 2, 3, 4]) == {address: 4})
        print(f"a change reached the index {seconds * 1000:.1f} ms after it was published")
        assert seconds < 1.0
        worker.log.publish(evicted=[4, 3])
        eventually(lambda: index.match([1, 2, 3, 4]) == {address: 2})
        pool.set_workers("prefill", [])
        assert index.match([1, 2]) == {} and not sync.synced(address)
    finally:
        worker.stop()


def test_a_restarted_worker_leaves_no_stale_entry(router):
    port = free_port()
    address = f"127.0.0.1:{port}"
    first = Worker(port)
    pool, sync, index = router()
    pool.set_workers("prefill", [address])
    first.log.publish(stored=[1, 2, 3])
    eventually(lambda: index.match([1, 2, 3]) == {address: 3})
    first.stop()
    eventually(lambda: index.match([1, 2, 3]) == {})  # its stream broke: nothing claimed while it is away
    second = Worker(port)  # the same address, a new process: a new epoch, an empty cache
    try:
        second.log.publish(stored=[1, 9])
        eventually(lambda: index.match([1, 2, 3]) == {address: 1} and index.match([1, 9]) == {address: 2})
        assert index.stats().block_workers == 2
    finally:
        second.stop()


class ScriptedWorker(workers_pb2_grpc.PrefillWorkerServicer):
    """A worker whose first stream skips a number: the router must ask again for a snapshot."""

    def __init__(self):
        self.requests: list[workers_pb2.WatchCacheRequest] = []

    def WatchCache(self, request, context):
        self.requests.append(request)
        if len(self.requests) == 1:
            yield workers_pb2.CacheEvent(epoch="e", seq=1, snapshot=True, stored=[1])
            yield workers_pb2.CacheEvent(epoch="e", seq=3, stored=[2])  # seq 2 lost
        else:
            yield workers_pb2.CacheEvent(epoch="e", seq=3, snapshot=True, stored=[1, 5])
        while context.is_active():
            time.sleep(0.05)


def test_a_gap_in_the_numbers_makes_the_router_start_again_from_a_snapshot(router, grpc_server):
    worker = ScriptedWorker()
    address = grpc_server(workers_pb2_grpc.add_PrefillWorkerServicer_to_server, worker)
    pool, sync, index = router()
    pool.set_workers("prefill", [address])
    eventually(lambda: index.match([1, 5]) == {address: 2})
    assert index.match([1, 2]) == {address: 1}  # the change after the gap was not applied
    assert [r.epoch for r in worker.requests] == ["", ""]


def test_a_redis_restart_is_refilled_from_the_workers(router, redis_server):
    port = free_port()
    address = f"127.0.0.1:{port}"
    worker = Worker(port)
    pool, sync, index = router(RedisPrefixIndex.from_url(redis_server.url, namespace="sync"))
    try:
        pool.set_workers("prefill", [address])
        worker.log.publish(stored=[1, 2, 3])
        eventually(lambda: index.match([1, 2, 3]) == {address: 3})
        redis_server.restart()  # the same port, empty
        eventually(lambda: index.match([1, 2, 3]) == {address: 3}, timeout=10)
        worker.log.publish(evicted=[3])
        eventually(lambda: index.match([1, 2, 3]) == {address: 2})
    finally:
        worker.stop()
        index.close()


def test_a_failed_request_s_prefix_still_reaches_the_index(router):
    """The cache changes no longer ride on the Prefill reply: a prefill whose KV push cannot land
    (its decode worker is gone) still tells the router, within a second, what it cached."""
    server, loop = serve(ModelSettings(name="tiny-random", dtype=TEST_DTYPE),
                         PrefillSettings(host="127.0.0.1", port=0), block=False)
    address = f"127.0.0.1:{server.port}"
    pool, sync, index = router()
    try:
        pool.set_workers("prefill", [address])
        eventually(lambda: sync.synced(address))
        prompt = [(7 * i) % 500 + 3 for i in range(70)]  # 4 whole blocks and a few tokens
        hashes = BlockHasher(loop.fingerprint, loop.core.block_size).hash_prompt(prompt)
        request = workers_pb2.PrefillRequest(request_id="r1", prompt_token_ids=prompt,
                                             decode_target=f"127.0.0.1:{free_port()}",  # nothing listens
                                             sampling=common_pb2.SamplingParams(max_tokens=4))
        with grpc.insecure_channel(address) as channel:
            call = workers_pb2_grpc.PrefillWorkerStub(channel).Prefill.future(request, timeout=60)
            seconds = eventually(lambda: index.match(hashes) == {address: len(hashes)})
            print(f"the prefix reached the router's index {seconds:.2f} s after the Prefill call")
            assert seconds < 1.0 + 1.0  # the tiny model's forward, then the change within a second
            with pytest.raises(grpc.RpcError):
                call.result()
        assert index.match(hashes) == {address: len(hashes)}
    finally:
        loop.stop()
        server.stop(grace=None)
