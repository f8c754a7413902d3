"""The planner on real processes: a `dynamic` LocalCluster (its router and prefill workers follow a
workers file) whose workers the planner's LocalScaler starts and drains, under real load."""
from __future__ import annotations

import threading
import time

import pytest

from baton.client import BatonClient
from baton.planner.policy import Objectives, Planner, PlannerConfig, Profile
from baton.planner.service import LocalScaler, PlannerLoop, reading_from
from baton.launch.up import LocalCluster
from test_migration import busy_decode_worker

pytestmark = pytest.mark.slow
MAX_TOKENS = 1024


def stream_all(client, prompts: dict[int, list[int]], max_tokens, results, started=None):
    """Stream each prompt on a thread of its own; results[i] = tokens or the exception."""
    def run(i):
        tokens = []
        try:
            for chunk in client.stream(token_ids=prompts[i], max_tokens=max_tokens, ignore_eos=True):
                if started is not None and chunk.token_ids and not tokens:
                    started.release()
                tokens.extend(chunk.token_ids)
            results[i] = tokens
        except Exception as exc:  # noqa: BLE001 - checked by the caller
            results[i] = exc

    threads = [threading.Thread(target=run, args=(i,)) for i in prompts]
    for t in threads:
        t.start()
    return threads


def prefilled(client) -> int:
    return sum(w.prefill["requests_done"] for w in client.cluster_status().workers if w.prefill)


def test_workers_added_serve_and_a_busy_one_removed_moves_its_streams(tiny_reference):
    with LocalCluster(prefill=1, decode=1, model="tiny-random", max_rows=4, dynamic=True,
                      decode_args=("--drain-move-after-s", "0")) as cluster, \
            BatonClient(cluster.router_address, timeout=120) as client:
        scaler = LocalScaler(cluster)
        scaler.scale("decode", 2)
        scaler.scale("prefill", 2)
        assert (scaler.replicas("prefill"), scaler.replicas("decode")) == (2, 2)
        deadline = time.monotonic() + 30
        while {w.address for w in client.cluster_status().workers} != {*cluster.prefill_addrs, *cluster.decode_addrs}:
            assert time.monotonic() < deadline, "the router never saw the added workers"
            time.sleep(0.2)
        prompts = [[100 + 9 * i + j for j in range(5 + 3 * i)] for i in range(8)]
        results, flowing = {}, threading.Semaphore(0)
        # 1024 tokens: the scaler waits 0.6 s for the router to stop sending there before its
        # SIGTERM, and with 256 the busy worker once finished everything first (CI, loaded).
        threads = stream_all(client, dict(enumerate(prompts)), MAX_TOKENS, results, flowing)
        for _ in range(2):
            assert flowing.acquire(timeout=60)
        busy = busy_decode_worker(cluster)
        scaler.scale("decode", 1, remove=[busy])  # returns once it drained and exited
        for t in threads:
            t.join(timeout=150)
        assert cluster.decode_addrs != [busy] and len(cluster.decode_addrs) == 1
        deadline = time.monotonic() + 15  # the router's load polls lag on a busy machine: wait for one
        while True:
            status = {w.address: w for w in client.cluster_status().workers}
            if status[cluster.decode_addrs[0]].decode["migrations_in"] or time.monotonic() > deadline:
                break
            time.sleep(0.2)
        done = prefilled(client)  # both prefill workers still there
        scaler.scale("prefill", 1)
        after = client.generate(token_ids=[7, 8, 9], max_tokens=8, ignore_eos=True)
        again = client.cluster_status().routing["prefilled_again"]
        left = set(cluster.prefill_addrs + cluster.decode_addrs)
    for i, prompt in enumerate(prompts):
        assert results[i] == tiny_reference.greedy(prompt, MAX_TOKENS), f"request {i}: {results[i]!r}"[:300]
    assert after.token_ids == tiny_reference.greedy([7, 8, 9], 8)
    assert status[cluster.decode_addrs[0]].decode["migrations_in"] > 0  # moved with their KV ...
    assert done == len(prompts) and again == 0  # ... and not prefilled again
    assert len(left) == 2 and cluster.procs == []


def test_the_planner_adds_workers_as_load_rises_and_removes_them_as_it_falls(tiny_reference):
    """The profile says a worker gives little (20 tokens a second within ITL, a prompt in 0.2 s), so
    six streams at once need both pools' maximum, and an idle cluster their minimum."""
    profile = Profile(prefill=((1, 0.05), (64, 0.5)), step=((1, 0.05), (4, 0.2)), max_rows=4)
    config = PlannerConfig(Objectives(ttft_s=1.0, itl_s=0.05), max_prefill=2, max_decode=2, interval_s=1.0,
                           scale_down_after=2, cooldown_s=2.0, smoothing=1.0, trend_smoothing=0.0, startup_s=3.0)
    with LocalCluster(prefill=1, decode=1, model="tiny-random", max_rows=4, dynamic=True) as cluster, \
            BatonClient(cluster.router_address, timeout=120) as client:
        loop = PlannerLoop(Planner(config, profile), lambda: reading_from(client.cluster_status(), time.monotonic()),
                           LocalScaler(cluster))
        prompts = [[50 + 7 * i + j for j in range(4 + (i % 5))] for i in range(36)]
        results: dict[int, object] = {}
        def waves() -> None:  # six streams at a time, six times over
            for wave in range(6):
                for t in stream_all(client, {i: prompts[i] for i in range(6 * wave, 6 * wave + 6)}, 64, results):
                    t.join()

        load = threading.Thread(target=waves)
        load.start()
        counts, ttfts = [], []
        deadline = time.monotonic() + 120
        while (load.is_alive() or not counts or counts[-1] != (1, 1)) and time.monotonic() < deadline:
            loop.step()  # in this thread: it started the cluster's processes (lifeline)
            counts.append((len(cluster.prefill_addrs), len(cluster.decode_addrs)))
            ttfts.append(loop.registry.get_sample_value("baton_planner_input", {"name": "ttft_s"}))
            time.sleep(config.interval_s)
        load.join()
        again = client.cluster_status().routing["prefilled_again"]
    print(f"\nworkers (prefill, decode) each interval: {counts}")
    assert again == 0  # no scale-down made a request prefill again
    assert max(c[1] for c in counts) == 2, counts  # it grew under load ...
    assert counts[-1] == (1, 1), counts  # ... and shrank back when it ended
    assert max(t or 0 for t in ttfts) > 0, ttfts  # it read TTFT from the router's histogram
    for i, prompt in enumerate(prompts):
        assert results[i] == tiny_reference.greedy(prompt, 64), f"request {i}: {results[i]!r}"[:300]
    assert cluster.procs == []
