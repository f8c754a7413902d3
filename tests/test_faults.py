"""Workers killed with SIGKILL under load: requests move on, none hangs, no token is lost or repeated."""
from __future__ import annotations

import signal
import threading
import time

import pytest

from baton.up import LocalCluster
from client import BatonClient, BatonError

pytestmark = pytest.mark.slow

REQUESTS = 50
MAX_TOKENS = 48


def test_killing_a_decode_and_a_prefill_worker_loses_no_token(tiny_reference):
    prompts = [[100 + 7 * i + j for j in range(5 + i % 23)] for i in range(REQUESTS)]
    with LocalCluster(prefill=2, decode=2, model="tiny-random", max_rows=4) as cluster:
        procs = dict(cluster.procs)
        streamed: dict[int, list[int]] = {}
        outcome: dict[int, object] = {}
        started = threading.Barrier(REQUESTS + 1)

        def run(i: int, client: BatonClient) -> None:
            tokens = streamed.setdefault(i, [])
            begun = time.monotonic()
            try:
                stream = client.stream(token_ids=prompts[i], max_tokens=MAX_TOKENS, ignore_eos=True)
                started.wait()
                for chunk in stream:
                    tokens.extend(chunk.token_ids)
                    if chunk.finish_reason:
                        outcome[i] = chunk.finish_reason
            except BatonError as err:
                outcome[i] = err
            except threading.BrokenBarrierError:
                outcome[i] = "barrier"
            outcome.setdefault(i, "ended without finish")
            outcome[(i, "seconds")] = time.monotonic() - begun

        with BatonClient(cluster.router_address, timeout=120) as client:
            threads = [threading.Thread(target=run, args=(i, client)) for i in range(REQUESTS)]
            for t in threads:
                t.start()
            started.wait()
            time.sleep(1.0)  # streams are flowing on both decode workers
            procs[cluster.decode_addrs[0]].send_signal(signal.SIGKILL)
            procs[cluster.prefill_addrs[0]].send_signal(signal.SIGKILL)
            for t in threads:
                t.join(timeout=150)
            assert not any(t.is_alive() for t in threads), "a request hung"

    exact = failed = 0
    for i in range(REQUESTS):
        result = outcome[i]
        if isinstance(result, BatonError):
            failed += 1
            assert result.code in ("UNAVAILABLE", "ABORTED", "RESOURCE_EXHAUSTED", "DEADLINE_EXCEEDED"), result
            assert outcome[(i, "seconds")] < 60, f"request {i} failed slowly: {result}"
            continue
        assert result == "length", f"request {i}: {result}"
        expected = tiny_reference.greedy(prompts[i], MAX_TOKENS)
        assert streamed[i] == expected, f"request {i} lost or repeated tokens"
        exact += 1
    print(f"\n{exact} requests completed with the exact greedy tokens, {failed} failed fast")
    assert exact + failed == REQUESTS and exact >= REQUESTS // 2


def test_sigterm_drains_workers_without_failing_requests(tiny_reference):
    prompts = [[300 + 11 * i + j for j in range(4 + i % 17)] for i in range(20)]
    with LocalCluster(prefill=2, decode=2, model="tiny-random", max_rows=4) as cluster:
        procs = dict(cluster.procs)
        with BatonClient(cluster.router_address, timeout=120) as client:
            results = {}

            def run(i: int) -> None:
                results[i] = client.generate(token_ids=prompts[i], max_tokens=MAX_TOKENS, ignore_eos=True)

            threads = [threading.Thread(target=run, args=(i,)) for i in range(len(prompts))]
            for t in threads:
                t.start()
            time.sleep(1.0)
            drained = [procs[cluster.decode_addrs[0]], procs[cluster.prefill_addrs[0]]]
            for proc in drained:
                proc.send_signal(signal.SIGTERM)
            for t in threads:
                t.join(timeout=150)
            assert all(proc.wait(timeout=60) == 0 for proc in drained), "a drained worker did not exit cleanly"
            # After the drain, new work goes to the workers still up.
            after = client.generate(token_ids=prompts[0], max_tokens=MAX_TOKENS, ignore_eos=True)
    assert len(results) == len(prompts)
    for i, prompt in enumerate(prompts):
        assert results[i].token_ids == tiny_reference.greedy(prompt, MAX_TOKENS), f"request {i}"
    assert after.token_ids == results[0].token_ids


def test_twice_the_load_gets_resource_exhausted_not_timeouts():
    """Past its in-flight bound the router refuses at once with a retry hint; the rest complete."""
    with LocalCluster(prefill=1, decode=1, model="tiny-random", max_rows=4,
                      router_args=("--max-inflight", "8")) as cluster:
        with BatonClient(cluster.router_address, timeout=120) as client:
            outcomes = client.generate_many(
                [{"token_ids": [200 + i, 201, 202], "max_tokens": 64, "ignore_eos": True} for i in range(16)],
                max_concurrency=16, return_exceptions=True)
            refused = [o for o in outcomes if isinstance(o, BatonError)]
            served = [o for o in outcomes if not isinstance(o, BatonError)]
            assert refused and all(o.code == "RESOURCE_EXHAUSTED" and o.retry_after_s for o in refused)
            assert len(served) >= 8 and all(len(o.token_ids) == 64 for o in served)
            decode = next(w.decode for w in client.cluster_status().workers if w.role == "decode")
            assert decode["staged_bytes"] <= decode["staging_capacity_bytes"]


def test_every_process_serves_prometheus_metrics():
    import urllib.request

    from baton.up import free_port

    ports = {role: free_port() for role in ("router", "prefill", "decode")}
    with LocalCluster(prefill=1, decode=1, model="tiny-random",
                      router_args=("--metrics-port", str(ports["router"])),
                      prefill_args=("--metrics-port", str(ports["prefill"])),
                      decode_args=("--metrics-port", str(ports["decode"]))) as cluster:
        with BatonClient(cluster.router_address, timeout=60) as client:
            client.generate(token_ids=[5, 6, 7], max_tokens=4, ignore_eos=True)
        scraped = {role: urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
                   for role, port in ports.items()}
    assert "baton_time_to_first_token_seconds_count 1.0" in scraped["router"]
    assert 'baton_requests_total{reason="length"} 1.0' in scraped["router"]
    assert 'baton_kv_transfers_total{outcome="ok"} 1.0' in scraped["prefill"]
    for name in ("baton_decode_rows_in_use", "baton_decode_kv_allocated_bytes", "baton_decode_staged_bytes",
                 "baton_decode_preemptions_total", "baton_time_between_tokens_seconds_count"):
        assert name in scraped["decode"], name
