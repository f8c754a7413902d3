"""The router's prefill chain over real gRPC calls, with the interleavings that once broke it forced."""
from __future__ import annotations

import threading
import time

import grpc
import pytest

from baton.launch.up import free_port
from baton.v1 import common_pb2, workers_pb2, workers_pb2_grpc
from baton.router.dispatch import Dispatcher, Route
from baton.router.errors import DecodeLost
from baton.router.kv_sources import PrefillChain
from baton.router.prefix_index import PrefixIndexConfig, build_prefix_index
from baton.router.workers import WorkerPool


class _PrefillServicer(workers_pb2_grpc.PrefillWorkerServicer):
    """Answers each Prefill once `release` is set: with a reply, or with `fail_with`."""

    def __init__(self, fail_with: grpc.StatusCode | None = None):
        self.fail_with = fail_with
        self.release = threading.Event()
        self.arrived = threading.Event()
        self.requests: list[workers_pb2.PrefillRequest] = []

    def Prefill(self, request, context):
        self.requests.append(request)
        self.arrived.set()
        self.release.wait(10)
        if self.fail_with is not None:
            context.abort(self.fail_with, "the KV could not be delivered")
        return workers_pb2.PrefillReply(request_id=request.request_id, first_token=7, seed=11, cached_tokens=3)


class _SettledFirst:
    """Prefill.future that returns only after the call ended, as it may when the worker is dead
    and the machine busy: gRPC then runs a done callback at once, in the caller's thread."""

    def __init__(self, multicallable):
        self.multicallable = multicallable

    def future(self, *args, **kwargs):
        call = self.multicallable.future(*args, **kwargs)
        call.exception()  # waits for the end
        return call


@pytest.fixture
def prefill_server(grpc_server):
    return lambda servicer: grpc_server(workers_pb2_grpc.add_PrefillWorkerServicer_to_server, servicer)


def _chain(prefill_addresses: list[str]) -> tuple[PrefillChain, WorkerPool]:
    pool = WorkerPool()
    pool.set_workers("prefill", prefill_addresses)
    pool.set_workers("decode", [f"127.0.0.1:{free_port()}"])  # named as the KV's target, never called
    for worker in pool.all():
        worker.view.healthy = True
    dispatcher = Dispatcher(pool, build_prefix_index(PrefixIndexConfig()), block_size=16)
    route = Route(pool.get("prefill", prefill_addresses[0]), pool.all()[-1], 0)
    chain = PrefillChain(dispatcher, route, "r1", [1, 2, 3, 4], common_pb2.SamplingParams(max_tokens=4), 0, 10.0)
    return chain, pool


def _start(chain: PrefillChain) -> threading.Event:
    gave_up = threading.Event()
    starter = threading.Thread(target=chain.start, args=(gave_up.set,), daemon=True)
    starter.start()
    starter.join(timeout=10)
    assert not starter.is_alive(), "starting the prefill chain deadlocked"
    return gave_up


def test_a_prefill_that_failed_before_its_callback_was_added_is_retried_without_deadlock(prefill_server):
    live = _PrefillServicer()
    live.release.set()
    dead = f"127.0.0.1:{free_port()}"  # nothing listens: the call fails at once
    chain, pool = _chain([dead, prefill_server(live)])
    dead_worker = pool.get("prefill", dead)
    dead_worker.stub.Prefill = _SettledFirst(dead_worker.stub.Prefill)
    try:
        gave_up = _start(chain)
        reply = chain.reply()
        chain.cancel()
    finally:
        pool.stop()
    assert [r.request_id for r in live.requests] == ["r1"] and chain.tries == 2
    assert reply.first_token == 7 and not gave_up.is_set()


@pytest.mark.parametrize("delivered", [False, True])
def test_a_prefill_that_fails_after_its_kv_was_delivered_does_not_stop_the_stream(prefill_server, delivered):
    """E.g. a retry whose push is refused because the first try's KV landed before its worker died."""
    servicer = _PrefillServicer(fail_with=grpc.StatusCode.ABORTED)
    chain, pool = _chain([prefill_server(servicer)])
    try:
        gave_up = _start(chain)
        assert servicer.arrived.wait(10)
        if delivered:
            chain.delivered()  # the decode worker sent a token
        servicer.release.set()
        reply = chain.reply()
        if delivered:
            assert reply == workers_pb2.PrefillReply() and chain.lost() is None and not gave_up.is_set()
        else:
            assert gave_up.wait(10) and isinstance(chain.lost(), DecodeLost)
        chain.cancel()
    finally:
        pool.stop()


def test_a_prefill_the_worker_cancelled_is_retried_on_another_and_one_the_router_cancelled_is_not(prefill_server):
    """CANCELLED that this router did not ask for is the worker giving the prompt up (a drain): the
    prompt goes to another worker. The router's own cancel ends the chain: nothing is retried."""
    gave_up_on = _PrefillServicer(fail_with=grpc.StatusCode.CANCELLED)
    gave_up_on.release.set()
    live = _PrefillServicer()
    live.release.set()
    chain, pool = _chain([prefill_server(gave_up_on), prefill_server(live)])
    try:
        gave_up = _start(chain)
        assert live.arrived.wait(10), "the prompt was not sent to the other worker"
        # the retried call's reply (the worker may see the call before the chain holds it)
        assert settles(lambda: chain.reply().first_token, 7)
        reply = chain.reply()
        chain.cancel()
    finally:
        pool.stop()
    assert chain.tries == 2 and [r.request_id for r in live.requests] == ["r1"]
    assert reply.first_token == 7 and not gave_up.is_set() and chain.failure() is None

    held = _PrefillServicer()
    other = _PrefillServicer()
    other.release.set()
    chain, pool = _chain([prefill_server(held), prefill_server(other)])
    try:
        gave_up = _start(chain)
        assert held.arrived.wait(10)
        chain.cancel()  # the request's client left
        held.release.set()
        assert chain.call.cancelled()
    finally:
        pool.stop()
    assert chain.tries == 1 and other.requests == [] and not gave_up.is_set()


def test_routing_before_any_worker_reported_its_model_predicts_nothing_rather_than_failing():
    """Block hashes need the model's fingerprint, which workers report with their load; a request
    routed before the first report goes without a prefix prediction instead of failing."""
    pool = WorkerPool()
    pool.set_workers("prefill", [f"127.0.0.1:{free_port()}"])
    pool.set_workers("decode", [f"127.0.0.1:{free_port()}"])
    for worker in pool.all():
        worker.view.healthy = True
    index = build_prefix_index(PrefixIndexConfig())
    dispatcher = Dispatcher(pool, index, block_size=16)
    try:
        prompt = list(range(100, 140))
        assert dispatcher.block_hashes(prompt) == []
        assert dispatcher.route(prompt).predicted_cached_tokens == 0
        prefill = pool.all()[0]
        prefill.fingerprint = "model-a"  # its first load report
        hashes = dispatcher.block_hashes(prompt)
        assert len(hashes) == 2
        index.apply_event(prefill.view.address, stored=hashes)  # its cache events
        assert dispatcher.route(prompt).predicted_cached_tokens == 32
    finally:
        pool.stop()


def _views_pool(prefill: int, decode: int) -> WorkerPool:
    pool = WorkerPool()
    pool.set_workers("prefill", [f"127.0.0.1:{free_port()}" for _ in range(prefill)])
    pool.set_workers("decode", [f"127.0.0.1:{free_port()}" for _ in range(decode)])
    for worker in pool.all():
        worker.view.healthy = True
        worker.fingerprint = "model-a"
    return pool


def test_two_requests_with_the_same_new_prefix_meet_on_one_prefill_worker():
    """Once the first one's prefill is done but before its cache events arrive, the second is
    steered to the worker that computed the prefix (a pending entry), and told to expect it there."""
    pool = _views_pool(prefill=2, decode=1)
    dispatcher = Dispatcher(pool, build_prefix_index(PrefixIndexConfig()), block_size=16)
    try:
        prompt = list(range(100, 150))  # 3 whole blocks and 2 tokens
        first = dispatcher.route(prompt)
        first.release()  # its calls ended
        second = dispatcher.route(prompt + [7])
        assert first.predicted_cached_tokens == 0
        assert second.prefill is first.prefill and second.predicted_cached_tokens == 48
        assert dispatcher.route([5] + prompt).predicted_cached_tokens == 0  # another prefix
    finally:
        pool.stop()


def test_a_burst_routed_before_any_call_began_spreads_over_the_idle_workers():
    """Requests count on the workers chosen for them from the choice on: ten prompts sharing a
    system prompt's block, routed together before any of their calls started, go to both prefill
    and both decode workers, not all to the one that the pending prefix made look cheapest."""
    pool = _views_pool(prefill=2, decode=2)
    dispatcher = Dispatcher(pool, build_prefix_index(PrefixIndexConfig()), block_size=16)
    try:
        system = list(range(1000, 1016))  # one whole block in common
        routes = [dispatcher.route(system + [2000 + i] * 19) for i in range(10)]
        assert all(r.reason and r.prompt_tokens == 35 for r in routes)  # why, and for how many tokens
        prefills = [r.prefill.view.address for r in routes]
        decodes = [r.decode.view.address for r in routes]
        assert sorted(prefills.count(w.view.address) for w in pool.all() if w.role == "prefill") == [5, 5]
        assert sorted(decodes.count(w.view.address) for w in pool.all() if w.role == "decode") == [5, 5]
        assert all(w.view.inflight == 5 for w in pool.all())
        routes[0].release(routes[0].decode)  # one of its workers
        assert routes[0].decode.view.inflight == 4 and routes[0].prefill.view.inflight == 5
        for route in routes:
            route.release()
            route.release()  # once only
        assert all(w.view.inflight == 0 for w in pool.all())
    finally:
        pool.stop()


def settles(read, expected, timeout_s: float = 5.0) -> bool:
    """Whether read() comes to equal `expected` within timeout_s (a callback on another thread)."""
    deadline = time.monotonic() + timeout_s
    while read() != expected and time.monotonic() < deadline:
        time.sleep(0.005)
    return read() == expected


class _DecodeServicer(workers_pb2_grpc.DecodeWorkerServicer):
    """Registers each Decode once `register` is set, then finishes it once its Prefill arrived."""

    def __init__(self, prefill: _PrefillServicer):
        self.prefill = prefill
        self.register = threading.Event()
        self.arrived = threading.Event()
        self.finish = threading.Event()  # its last token waits for it
        self.finish.set()
        self.decoding = threading.Event()  # set once its first token went out

    def Decode(self, request, context):
        self.arrived.set()
        self.register.wait(10)
        yield workers_pb2.DecodeResponse()
        self.prefill.arrived.wait(10)
        yield workers_pb2.DecodeResponse(token_ids=[7])
        self.decoding.set()
        self.finish.wait(10)
        yield workers_pb2.DecodeResponse(token_ids=[8], finish_reason="length")


def _one_request_through_one_worker_each(prefill_server, grpc_server, prompt: list[int]):
    """A prefill and a decode worker (the servicers above, on real gRPC) and a thread, not yet
    started, that sends `prompt` through a Dispatcher over them (its replies land in `out`)."""
    prefill = _PrefillServicer()
    decode = _DecodeServicer(prefill)
    pool = WorkerPool()
    pool.set_workers("prefill", [prefill_server(prefill)])
    pool.set_workers("decode", [grpc_server(workers_pb2_grpc.add_DecodeWorkerServicer_to_server, decode)])
    for worker in pool.all():
        worker.view.healthy = True
    dispatcher = Dispatcher(pool, build_prefix_index(PrefixIndexConfig()), block_size=16)
    out = []
    runner = threading.Thread(target=lambda: out.extend(dispatcher.run(
        "r1", prompt, common_pb2.SamplingParams(max_tokens=2), 10.0, lambda cancel: None)), daemon=True)
    return prefill, decode, pool, out, runner


def test_a_request_counts_once_on_each_worker_while_its_calls_take_over_the_routes_hold(prefill_server,
                                                                                         grpc_server):
    """From the choice to the end, a request is one in flight on its decode worker and on its
    prefill worker: the route's hold passes to the Decode call as it begins (not once it is
    registered, which a busy worker can take long over) and to the prefill as it starts."""
    prefill, decode, pool, out, runner = _one_request_through_one_worker_each(prefill_server, grpc_server, [1, 2, 3, 4])
    inflight = lambda: {w.role: w.view.inflight for w in pool.all()}
    try:
        runner.start()
        assert decode.arrived.wait(10)
        assert inflight() == {"prefill": 1, "decode": 1}  # registering: the route holds the prefill worker
        decode.register.set()
        assert prefill.arrived.wait(10)
        # prefilling: the calls count it (the prefill's count begins a moment before the route's ends)
        assert settles(inflight, {"prefill": 1, "decode": 1})
        prefill.release.set()
        runner.join(10)
        assert not runner.is_alive() and out[-1].finish_reason == "length"
        assert inflight() == {"prefill": 0, "decode": 0}
    finally:
        prefill.release.set()
        decode.register.set()
        pool.stop()


def test_a_prefill_worker_counts_a_request_until_its_prefill_ends_not_while_it_decodes(prefill_server, grpc_server):
    """A prefill worker's backlog is prompts to compute: a request it prefilled that is still
    decoding elsewhere no longer counts there, in requests or in prompt tokens (it counted for the
    whole request, so a worker whose earlier prompts decoded long looked busy and lost the prompts
    whose prefix it held)."""
    prefill, decode, pool, out, runner = _one_request_through_one_worker_each(prefill_server, grpc_server,
                                                                              list(range(1, 41)))
    decode.finish.clear()
    counted = lambda role: next((w.view.inflight, w.view.inflight_tokens) for w in pool.all() if w.role == role)
    try:
        runner.start()
        decode.register.set()
        assert prefill.arrived.wait(10)
        assert settles(lambda: counted("prefill"), (1, 40))  # prefilling its 40 tokens
        prefill.release.set()
        assert decode.decoding.wait(10)
        assert settles(lambda: counted("prefill"), (0, 0)) and counted("decode") == (1, 0)  # decoding
        decode.finish.set()
        runner.join(10)
        assert not runner.is_alive() and out[-1].finish_reason == "length"
        assert counted("prefill") == (0, 0) and counted("decode") == (0, 0)
    finally:
        prefill.release.set()
        decode.register.set()
        decode.finish.set()
        pool.stop()


def test_the_pending_prefix_bound_comes_from_the_config():
    from baton.config import load_settings

    settings = load_settings(env={"BATON_ROUTER_PENDING_MAX_BLOCKS": "7"}).router
    dispatcher = Dispatcher(WorkerPool(), build_prefix_index(PrefixIndexConfig()), block_size=16,
                            pending_max_blocks=settings.pending_max_blocks)
    assert dispatcher.pending.max_entries == 7
    with pytest.raises(ValueError, match="router.pending_max_blocks must be >= 1"):
        load_settings(env={"BATON_ROUTER_PENDING_MAX_BLOCKS": "0"})
