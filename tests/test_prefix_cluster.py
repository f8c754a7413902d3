"""Prefix reuse across the cluster: cache-aware routing through a shared Redis index, and a
BatchLLM-shaped batch through `GenerateBatch`, with real processes (tiny model, for speed)."""
from __future__ import annotations

import random

import pytest

from baton.launch.up import LocalCluster
from baton.client import BatonClient
from redis_server import redis_server_fixture
from baton.router.batch_planner import shared_document_batch, simulate_lru_prefix_cache, synthetic_batch

pytestmark = pytest.mark.slow

redis_server = redis_server_fixture(scope="module")

BLOCK = 16
TINY_BYTES_PER_TOKEN = 512  # tiny-random: 2 layers x 2 (K, V) x 2 heads x 16 dims x 4 bytes


def test_two_routers_sharing_redis_send_a_repeated_prefix_to_its_holder(redis_server):
    rng = random.Random(1)
    # the decode worker holds each prefix too, after the first request: never prefilled there, so
    # that prefill workers are routed to by what they hold
    with LocalCluster(prefill=2, decode=1, model="tiny-random", routers=2,
                      router_args=("--prefix-index", "redis", "--redis-url", redis_server.url,
                                   "--local-prefill-max-tokens", "0")) as cluster:
        first, second = (BatonClient(a, timeout=60) for a in cluster.router_addresses)
        with first, second:
            # ready means each router's index follows both prefill workers' caches already
            for client in (first, second):
                prefill = [w for w in client.cluster_status().workers if w.role == "prefill"]
                assert len(prefill) == 2 and all(w.cache_synced for w in prefill)
            holders = set()
            for _ in range(4):
                prefix = [rng.randrange(100, 40000) for _ in range(5 * BLOCK)]
                seen = first.generate(token_ids=prefix + [rng.randrange(100, 40000)], max_tokens=2)
                again = second.generate(token_ids=prefix + [7, 8, 9], max_tokens=2)
                assert again.trace.prefill_worker == seen.trace.prefill_worker
                assert again.trace.cached_tokens == 5 * BLOCK
                assert again.trace.predicted_cached_tokens == again.trace.cached_tokens
                holders.add(seen.trace.prefill_worker)
            routing = second.cluster_status().routing
            assert routing["accuracy"] == 1.0 and routing["requests"] == 4
            # its TTFT histogram, cumulative (what the planner reads): the 4 requests it served
            assert routing["ttft_bounds_s"][-1] == float("inf") and routing["ttft_counts"][-1] == 4
            assert routing["ttft_counts"] == sorted(routing["ttft_counts"])
            # A client of both routers (what a headless Service resolves to) spreads its calls.
            both = "ipv4:" + ",".join(cluster.router_addresses)
            with BatonClient(both, timeout=60, load_balancing="round_robin") as spread:
                for i in range(4):
                    spread.generate(token_ids=[300 + i, 301, 302], max_tokens=2)
            counts = [client.cluster_status().routing["requests"] for client in (first, second)]
            assert counts[0] >= 4 + 1 and counts[1] >= 4 + 1 and sum(counts) == 8 + 4, counts
    assert holders, "no prefill worker held a prefix"


def test_batchllm_batch_saves_near_optimal_prefill_tokens():
    prompts = synthetic_batch(num_prefixes=36, prompts_per_prefix=7, prefix_len=96, distinct_len=20, seed=0,
                              vocab=40000)
    cache_bytes = 4096 * TINY_BYTES_PER_TOKEN  # room for 4096 tokens of prefix KV
    with LocalCluster(prefill=1, decode=1, model="tiny-random", max_rows=8,
                      prefill_args=("--prefix-cache-bytes", str(cache_bytes))) as cluster:
        with BatonClient(cluster.router_address, timeout=600) as client:
            outcome = client.generate_batch([{"token_ids": p, "max_tokens": 2} for p in prompts], max_concurrency=8)
    summary = outcome.summary
    assert summary["failed"] == 0 and all(r.finish_reason for r in outcome.results)
    assert summary["requests"] == len(prompts) >= 250
    optimum = summary["optimum_saving_ratio"]
    actual = summary["actual_saving_ratio"]
    lru = simulate_lru_prefix_cache(prompts, block_size=BLOCK, capacity_blocks=4096 // BLOCK)
    lru_ratio = lru.saved_tokens / sum(map(len, prompts))
    print(f"prefill tokens saved: baton batch {actual:.4f}, optimum {optimum:.4f}, LRU {lru_ratio:.4f}; "
          f"routing accuracy {summary['routing_accuracy']:.4f}")
    assert actual >= 0.995 * optimum, f"saved {actual:.3f} of prompt tokens, optimum {optimum:.3f}"
    assert lru_ratio < actual
    assert summary["routing_accuracy"] >= 0.95


def test_a_shuffled_shared_document_batch_saves_the_multi_level_optimum():
    """Issue 17's shape: 12 documents behind one chat header, 7 questions each, shuffled. The
    header is shared across groups and is not a whole number of blocks: pinned as a level above
    the groups, it is reused to the token, so the saving the workers report reaches the optimum
    that computes every shared level once."""
    prompts = shared_document_batch(12, 7, header_len=30, document_len=200, question_len=12, seed=3, vocab=40000)
    with LocalCluster(prefill=1, decode=1, model="tiny-random", max_rows=8,
                      prefill_args=("--prefix-cache-bytes", str(4096 * TINY_BYTES_PER_TOKEN))) as cluster:
        with BatonClient(cluster.router_address, timeout=600) as client:
            outcome = client.generate_batch([{"token_ids": p, "max_tokens": 2} for p in prompts], max_concurrency=8)
    summary = outcome.summary
    assert summary["failed"] == 0 and summary["requests"] == 84
    optimum, actual = summary["optimum_saving_ratio"], summary["actual_saving_ratio"]
    print(f"shared documents: saved {actual:.4f} of prompt tokens, optimum {optimum:.4f} ({actual / optimum:.4f})")
    assert actual >= 0.995 * optimum
    assert summary["routing_accuracy"] >= 0.95


def test_the_asyncio_client_runs_a_planned_batch_like_the_blocking_one(tiny_reference):
    """AsyncBatonClient.generate_batch against a real cluster: the same plan, results in input
    order equal to generate's greedy tokens and to the blocking client's, each reported to a
    coroutine as it finishes; a bad entry is refused before anything is sent."""
    import asyncio

    from baton.client import AsyncBatonClient, BatonError

    prompts = synthetic_batch(num_prefixes=3, prompts_per_prefix=4, prefix_len=2 * BLOCK, distinct_len=6, seed=5,
                              vocab=40000)
    entries = [{"token_ids": p, "max_tokens": 4, "temperature": 0} for p in prompts]
    seen: list[int] = []

    async def report(index, result):
        await asyncio.sleep(0)
        assert not isinstance(result, BatonError), result
        seen.append(index)

    async def run(address: str):
        async with AsyncBatonClient(address, timeout=120) as client:
            with pytest.raises(ValueError, match=r"requests\[1\]"):
                await client.generate_batch([entries[0], {"token_ids": []}])
            assert (await client.generate_batch([])).results == []
            return await client.generate_batch(entries, max_concurrency=4, on_result=report)

    with LocalCluster(prefill=1, decode=1, model="tiny-random", max_rows=4) as cluster:
        outcome = asyncio.run(run(cluster.router_address))
        with BatonClient(cluster.router_address, timeout=120) as client:
            blocking = client.generate_batch(entries, max_concurrency=4)
    assert outcome.summary["failed"] == 0 and outcome.summary["requests"] == len(prompts)
    assert outcome.summary["actual_saving_ratio"] > 0  # the shared prefixes were computed once
    assert sorted(seen) == list(range(len(prompts)))
    for i, prompt in enumerate(prompts):
        assert outcome.results[i].token_ids == tiny_reference.greedy(prompt, 4), i
        assert outcome.results[i].token_ids == blocking.results[i].token_ids


def test_requests_continuing_a_prefix_held_in_the_decode_batch_push_only_their_own_kv(tiny_reference):
    """Two running requests share a 160-token document, so the decode worker holds its KV once; a
    request for the same document registered then is told so, and its prefill pushes only the
    tokens after it. Every request's tokens equal generate's; the bytes pushed say what travelled."""
    import urllib.request

    from prometheus_client.parser import text_string_to_metric_families

    from test_kv_shm import free_port

    rng = random.Random(29)
    document = [rng.randrange(100, 40000) for _ in range(160)]
    long_ones = [document + [rng.randrange(100, 40000) for _ in range(5)] for _ in range(2)]
    short_ones = [document + [rng.randrange(100, 40000) for _ in range(rng.randint(2, 8))] for _ in range(3)]
    metrics_port = free_port()
    # a short rest would be prefilled on the decode worker itself (tests/test_conversations.py):
    # here every prompt goes through the prefill worker, to see what its pushes carry
    with LocalCluster(prefill=1, decode=1, model="tiny-random", max_rows=8,
                      router_args=("--local-prefill-max-tokens", "0"),
                      prefill_args=("--metrics-port", str(metrics_port))) as cluster:
        with BatonClient(cluster.router_address, timeout=120) as client:
            streams = [client.stream(token_ids=p, max_tokens=1200, ignore_eos=True) for p in long_ones]
            for stream in streams:  # both rows are decoding, so the document is shared
                for _, chunk in zip(range(3), stream):
                    pass
            shorts = [client.generate(token_ids=p, max_tokens=8, ignore_eos=True) for p in short_ones]
            longs = [stream.result() for stream in streams]
        scraped = urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=10).read().decode()
    assert [r.token_ids for r in shorts] == [tiny_reference.greedy(p, 8) for p in short_ones]
    assert [r.token_ids for r in longs] == [tiny_reference.greedy(p, 1200) for p in long_ones]
    pushed = sum(s.value for f in text_string_to_metric_families(scraped) for s in f.samples
                 if s.name == "baton_kv_transfer_bytes_total")
    held = len(document)  # the two long prompts have the document, then their own first tokens differ
    expected = sum(map(len, long_ones)) + sum(len(p) - held for p in short_ones)
    assert pushed == expected * TINY_BYTES_PER_TOKEN
