"""The router's prefix index: one suite, run against both backends (Redis: a real server)."""
from __future__ import annotations

import subprocess
import sys
import uuid

import pytest
import redis
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from redis_server import redis_server_fixture

from baton.block_hash import BlockHasher
from baton.router.prefix_index import (InMemoryPrefixIndex, PrefixIndexConfig, RedisPrefixIndex,
                                 build_prefix_index)

redis_server = redis_server_fixture()
HASHER = BlockHasher("test-model", block_size=1)  # one token per block keeps chains readable


def chain(*tokens: int) -> list[int]:
    return HASHER.hash_prompt(list(tokens))


class ManualClock:
    """Time that moves only when told (plus 1 ms per reading, so touches are ordered)."""

    def __init__(self, start: float = 1_000.0):
        self.now = start

    def __call__(self) -> float:
        self.now += 0.001
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


@pytest.fixture(params=["memory", "redis"])
def make_index(request):
    """Build indexes of the parametrized backend, each empty (Redis: a fresh namespace)."""
    clock = ManualClock()
    built = []

    def make(**kwargs):
        kwargs.setdefault("clock", clock)
        if request.param == "memory":
            index = InMemoryPrefixIndex(**kwargs)
        else:
            server = request.getfixturevalue("redis_server")
            namespace = f"test-{uuid.uuid4().hex[:12]}"
            client = server.client()
            built.append(client)
            index = RedisPrefixIndex(client, namespace=namespace, **kwargs)
        return index

    make.clock = clock
    yield make
    for client in built:
        client.close()


A = chain(1, 2, 3, 4, 5, 6)
B = chain(1, 2, 9, 9)  # shares A's first two blocks
C = chain(7, 7, 7)


def test_an_empty_index_matches_nothing(make_index):
    index = make_index()
    assert index.match(A) == {}
    assert index.match([]) == {}
    assert index.workers() == set()
    stats = index.stats()
    assert (stats.blocks, stats.block_workers, stats.workers) == (0, 0, 0)


def test_match_counts_each_workers_longest_contiguous_prefix(make_index):
    index = make_index()
    index.apply_event("w1", stored=A[:4])
    index.apply_event("w2", stored=A[:2])
    index.apply_event("w3", stored=B)
    index.apply_event("w4", stored=C)
    assert index.match(A) == {"w1": 4, "w2": 2, "w3": 2}
    assert index.match(B) == {"w1": 2, "w2": 2, "w3": 4}
    assert index.match(C[:2]) == {"w4": 2}
    assert index.match(chain(8)) == {}
    assert index.workers() == {"w1", "w2", "w3", "w4"}


def test_events_may_arrive_in_pieces_and_match_stops_at_a_gap(make_index):
    index = make_index()
    index.apply_event("w1", stored=A[:2])
    index.apply_event("w1", stored=A[2:3])
    index.apply_event("w1", stored=A[4:])  # A[3] missing: the match cannot pass it
    assert index.match(A) == {"w1": 3}
    index.apply_event("w2", stored=A[1:])  # without the first block, nothing matches
    assert index.match(A) == {"w1": 3}


def test_evictions_shorten_matches_and_a_worker_with_nothing_left_is_gone(make_index):
    index = make_index()
    index.apply_event("w1", stored=A)
    index.apply_event("w2", stored=A[:3])
    index.apply_event("w1", evicted=A[3:])
    assert index.match(A) == {"w1": 3, "w2": 3}
    index.apply_event("w2", evicted=A[:3])
    assert index.match(A) == {"w1": 3}
    assert index.workers() == {"w1"}
    assert index.stats().blocks == 3


def test_events_are_idempotent_and_stored_then_evicted_ends_absent(make_index):
    index = make_index()
    index.apply_event("w1", stored=A[:3])
    index.apply_event("w1", stored=A[:3])
    index.apply_event("w1", evicted=C)  # never stored: no-op
    assert index.stats().block_workers == 3
    index.apply_event("w1", stored=A[3:4], evicted=A[3:4])
    assert index.match(A) == {"w1": 3}
    assert index.stats().block_workers == 3


def test_remove_worker_forgets_only_that_worker(make_index):
    index = make_index()
    index.apply_event("w1", stored=A)
    index.apply_event("w2", stored=A[:2])
    index.apply_event("w2", stored=C)
    index.remove_worker("w1")
    index.remove_worker("never-seen")
    assert index.match(A) == {"w2": 2}
    assert index.match(C) == {"w2": 3}
    assert index.workers() == {"w2"}
    stats = index.stats()
    assert (stats.blocks, stats.block_workers, stats.workers) == (5, 5, 1)


def test_max_blocks_drops_the_least_recently_touched_deepest_blocks_first(make_index):
    index = make_index(max_blocks=4)
    index.apply_event("w1", stored=A[:3])
    index.apply_event("w2", stored=C)
    # 6 entries for 4 places: w1's chain is older; its deepest blocks go first.
    assert index.match(A) == {"w1": 1}
    assert index.match(C) == {"w2": 3}
    stats = index.stats()
    assert (stats.blocks, stats.capacity_evictions, stats.max_blocks) == (4, 2, 4)


def test_a_match_touches_what_it_walks_so_popular_prefixes_stay(make_index):
    index = make_index(max_blocks=4)
    index.apply_event("w1", stored=A[:2])
    index.apply_event("w1", stored=C[:2])
    assert index.match(A) == {"w1": 2}  # A is now more recent than C
    index.apply_event("w2", stored=B[2:3])
    assert index.match(A) == {"w1": 2}
    assert index.match(C) == {"w1": 1}


def test_one_event_larger_than_the_bound_keeps_the_chain_head(make_index):
    index = make_index(max_blocks=4)
    index.apply_event("w1", stored=A)
    assert index.match(A) == {"w1": 4}
    assert index.stats().blocks == 4


def test_entries_untouched_for_ttl_expire(make_index):
    index = make_index(ttl_s=10.0)
    index.apply_event("w1", stored=A[:3])
    make_index.clock.advance(6)
    index.apply_event("w2", stored=C)
    make_index.clock.advance(3)
    assert index.match(A[:2]) == {"w1": 2}  # refreshes A[0:2], not A[2]
    make_index.clock.advance(8)
    assert index.match(A) == {"w1": 2}
    assert index.match(C) == {}
    assert index.workers() == {"w1"}
    assert index.stats().expirations == 4


def test_match_many_answers_each_prompt(make_index):
    index = make_index()
    index.apply_event("w1", stored=A[:4])
    index.apply_event("w2", stored=C)
    assert index.match_many([A, [], C, chain(5)]) == [{"w1": 4}, {}, {"w2": 3}, {}]
    assert index.match_many([]) == []


@pytest.mark.parametrize("call", [
    lambda index: index.apply_event("", stored=A),
    lambda index: index.apply_event(7, stored=A),
    lambda index: index.apply_event("w1", stored=[-1]),
    lambda index: index.apply_event("w1", stored=[2**64]),
    lambda index: index.match([1.0]),
    lambda index: index.match("abc"),
    lambda index: index.remove_worker(None),
])
def test_bad_input_is_refused_with_a_clear_error(make_index, call):
    with pytest.raises((ValueError, TypeError), match="worker_id|block hash|list of block hashes"):
        call(make_index())


def test_bad_bounds_are_refused(make_index):
    with pytest.raises(ValueError, match="max_blocks"):
        make_index(max_blocks=0)
    with pytest.raises(ValueError, match="ttl_s"):
        make_index(ttl_s=0)


PROMPTS = st.lists(st.integers(0, 2), min_size=1, max_size=5).map(lambda t: chain(*t))


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.lists(st.tuples(st.sampled_from(["w1", "w2", "w3"]), st.booleans(), PROMPTS), max_size=20),
       st.lists(PROMPTS, min_size=1, max_size=5))
def test_match_agrees_with_a_per_worker_set_model(make_index, events, queries):
    index = make_index()
    held: dict[str, set[int]] = {}
    for worker_id, store, prompt in events:
        if store:
            index.apply_event(worker_id, stored=prompt)
            held.setdefault(worker_id, set()).update(prompt)
        else:
            index.apply_event(worker_id, evicted=prompt)
            held.setdefault(worker_id, set()).difference_update(prompt)
    for prompt in queries:
        expected = {}
        for worker_id, blocks in held.items():
            depth = next((i for i, h in enumerate(prompt) if h not in blocks), len(prompt))
            if depth:
                expected[worker_id] = depth
        assert index.match(prompt) == expected
    assert index.workers() == {w for w, blocks in held.items() if blocks}
    index.remove_worker("w1")
    index.remove_worker("w2")
    index.remove_worker("w3")
    assert index.stats().block_workers == 0


# -- Redis only ------------------------------------------------------------------------------

def test_two_routers_sharing_one_redis_see_each_others_events(redis_server):
    router_a = RedisPrefixIndex.from_url(redis_server.url, namespace="shared")
    router_b = RedisPrefixIndex.from_url(redis_server.url, namespace="shared")
    router_a.apply_event("w1", stored=A[:3])
    router_b.apply_event("w2", stored=A)
    assert router_a.match(A) == {"w1": 3, "w2": 6} == router_b.match(A)
    router_b.remove_worker("w1")
    assert router_a.match(A) == {"w2": 6}
    assert router_a.stats() == router_b.stats()
    router_a.close()
    router_b.close()


def test_a_password_kept_out_of_the_url_reaches_redis(redis_server):
    """The chart's Redis requires a password (a Secret, BATON_ROUTER_REDIS_PASSWORD): passed beside
    the URL, it needs no escaping; without it the index cannot start."""
    password = "s3cret/with:odd@chars"
    with redis_server.client() as admin:
        admin.config_set("requirepass", password)
    try:
        with pytest.raises(redis.AuthenticationError):
            RedisPrefixIndex.from_url(redis_server.url, namespace="locked")
        index = RedisPrefixIndex.from_url(redis_server.url, password=password, namespace="locked")
        index.apply_event("w1", stored=A)
        assert index.match(A) == {"w1": 6}
        index.close()
    finally:
        with redis.Redis(port=redis_server.port, password=password) as admin:
            admin.config_set("requirepass", "")


def test_namespaces_keep_deployments_apart(redis_server):
    with redis_server.client() as client:
        model_a = RedisPrefixIndex(client, namespace="model-a")
        model_b = RedisPrefixIndex(client, namespace="model-b")
        model_a.apply_event("w1", stored=A)
        assert model_b.match(A) == {}
        assert model_b.workers() == set()
        with pytest.raises(ValueError, match="namespace"):
            RedisPrefixIndex(client, namespace="{x}")


class CountingConnection(redis.Connection):
    """A real connection that counts requests written to the socket."""

    requests = 0

    def send_packed_command(self, command, check_health=True):
        type(self).requests += 1
        super().send_packed_command(command, check_health)


def test_match_is_one_round_trip_even_after_a_script_flush(redis_server):
    pool = redis.ConnectionPool(host="127.0.0.1", port=redis_server.port, decode_responses=True,
                                connection_class=CountingConnection)
    index = RedisPrefixIndex(redis.Redis(connection_pool=pool), namespace="trips")
    index.apply_event("w1", stored=A)
    CountingConnection.requests = 0
    assert index.match(A) == {"w1": 6}
    assert CountingConnection.requests == 1
    CountingConnection.requests = 0
    assert index.match_many([A, C, B]) == [{"w1": 6}, {}, {"w1": 2}]
    assert CountingConnection.requests == 1
    with redis_server.client() as admin:
        admin.script_flush()  # as after a Redis restart: reloaded, still answers
        assert index.match_many([A]) == [{"w1": 6}]
        admin.script_flush()
        assert index.match(A) == {"w1": 6}
        admin.script_flush()
        index.apply_event("w2", stored=C)
        assert index.workers() == {"w1", "w2"}
    pool.disconnect()


def test_build_prefix_index_from_config(redis_server):
    memory = build_prefix_index(PrefixIndexConfig(max_blocks=10))
    assert isinstance(memory, InMemoryPrefixIndex) and memory.max_blocks == 10
    shared = build_prefix_index(PrefixIndexConfig(backend="redis", redis_url=redis_server.url,
                                                  namespace="cfg", ttl_s=30.0))
    assert isinstance(shared, RedisPrefixIndex) and shared.ttl_s == 30.0
    shared.close()
    with pytest.raises(ValueError, match="backend"):
        PrefixIndexConfig(backend="etcd")


def test_policy_modules_import_no_heavy_dependencies():
    code = ("import sys, baton.block_hash, router.prefix_index, prefill_worker.prefix_cache; "
            "heavy = {'torch', 'grpc', 'redis', 'kubernetes'} & set(sys.modules); "
            "assert not heavy, heavy")
    subprocess.run([sys.executable, "-c", code], check=True)
