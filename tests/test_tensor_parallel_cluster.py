"""Tensor-parallel workers in a cluster of real processes (gloo on this CPU): a prefill worker at
one degree pushes KV to decode workers at others, a drain moves KV between decode workers of
different degrees, and every request ends with `generate`'s tokens in fp32. A rank killed
mid-stream takes its worker down, and the router's failover loses no request."""
from __future__ import annotations

import os
import signal
import threading
import time
from pathlib import Path

import pytest

from conftest import TEST_DTYPE
from test_migration import busy_decode_worker, drain_one_mid_stream

from baton.client import BatonClient
from baton.engine.tensor_parallel import RANK_LOST_EXIT
from baton.launch.up import LocalCluster

pytestmark = pytest.mark.slow
PROMPTS = [[100 + 9 * i + j for j in range(5 + 3 * i)] for i in range(8)]
MAX_TOKENS = 96


def tp_cluster(prefill_tp: int, decode_tps: list[int], **kwargs) -> LocalCluster:
    """One prefill worker and a decode worker per entry of decode_tps, each at its degree."""
    cluster = LocalCluster(prefill=1, decode=len(decode_tps), model="tiny-random", max_rows=4, **kwargs)
    cluster.worker_args = [("--tensor-parallel-size", str(size)) for size in (prefill_tp, *decode_tps)]
    return cluster


def ranks_of(pid: int) -> list[int]:
    """The processes a worker started: its other ranks."""
    return [int(p) for p in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]


def test_tp_workers_answer_as_generate_and_a_drain_moves_kv_across_degrees(tiny_reference):
    """Both pools at TP 2 and a decode pool of TP 2 and TP 1: the prefill worker pushes to either
    degree, and the drained decode worker's KV moves to the other degree."""
    assert TEST_DTYPE == "float32"
    prefill_tp, decode_tps = 2, [2, 1]
    with tp_cluster(prefill_tp, decode_tps, decode_args=("--drain-move-after-s", "0")) as cluster:
        procs = dict(cluster.procs)
        for address, size in zip(cluster.prefill_addrs + cluster.decode_addrs, (prefill_tp, *decode_tps)):
            assert len(ranks_of(procs[address].pid)) == size - 1, f"{address} runs {size} ranks"
        with BatonClient(cluster.router_address, timeout=120) as client:
            degrees = {address: {s.name: s.value for s in settings}["tensor_parallel_size"]
                       for address, settings in client.model_info().worker_settings.items()}
            assert degrees == dict(zip(cluster.prefill_addrs + cluster.decode_addrs, (prefill_tp, *decode_tps)))
            run = drain_one_mid_stream(cluster, client, PROMPTS, MAX_TOKENS)
            time.sleep(1.0)  # a load poll after the last request finished
            status = {w.address: w for w in client.cluster_status().workers}
    for i, prompt in enumerate(PROMPTS):
        assert run["outcome"].get(i) == "length", f"request {i}: {run['outcome'].get(i)!r}"
        assert run["streamed"][i] == tiny_reference.greedy(prompt, MAX_TOKENS), f"request {i}"
    assert status[run["target"]].decode["migrations_in"] > 0, "the drain moved no KV"
    assert status[cluster.prefill_addrs[0]].prefill["requests_done"] == len(PROMPTS), "a request was prefilled twice"


def test_a_killed_rank_takes_its_worker_down_and_no_request_is_lost(tiny_reference):
    """A TP 1 prefill worker pushing to TP 2 decode workers, one of which loses a rank."""
    with tp_cluster(1, [2, 2]) as cluster:
        procs = dict(cluster.procs)
        with BatonClient(cluster.router_address, timeout=120) as client:
            results, flowing = {}, threading.Semaphore(0)

            def run(i: int) -> None:
                tokens = []
                try:
                    for chunk in client.stream(token_ids=PROMPTS[i], max_tokens=MAX_TOKENS, ignore_eos=True):
                        if chunk.token_ids and not tokens:
                            flowing.release()
                        tokens.extend(chunk.token_ids)
                    results[i] = tokens
                except Exception as exc:  # noqa: BLE001 - reported below
                    results[i] = exc

            threads = [threading.Thread(target=run, args=(i,)) for i in range(len(PROMPTS))]
            for t in threads:
                t.start()
            for _ in range(4):
                assert flowing.acquire(timeout=60), "the streams did not start"
            victim = busy_decode_worker(cluster)
            rank, = ranks_of(procs[victim].pid)
            os.kill(rank, signal.SIGKILL)
            assert procs[victim].wait(timeout=30) == RANK_LOST_EXIT, "the worker outlived its rank"
            for t in threads:
                t.join(timeout=150)
            assert not any(t.is_alive() for t in threads), "a request hung"
            assert client.cluster_status().routing["prefilled_again"] > 0  # the dead worker's rows moved
    for i, prompt in enumerate(PROMPTS):
        assert results[i] == tiny_reference.greedy(prompt, MAX_TOKENS), f"request {i}: {results[i]!r}"


def test_in_bf16_tp_workers_answer_as_a_tp1_engine():
    """bf16 has no `generate` to equal, but any TP degree computes TP 1's bits: a P2-D1 cluster
    answers as Baton's own TP 1 engine."""
    from baton.decode_worker.core import DecodeConfig
    from baton.engine.model import load_model
    from baton.launch.local import LocalEngine
    from baton.sampling import SamplingParams

    engine = LocalEngine(load_model("tiny-random", dtype="bfloat16", module=False), DecodeConfig(max_rows=4))
    expected = [o.token_ids for o in engine.generate(PROMPTS, SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True))]
    with tp_cluster(2, [1], extra_env={"BATON_MODEL_DTYPE": "bfloat16"}) as cluster:
        with BatonClient(cluster.router_address, timeout=120) as client:
            results = client.generate_many([{"token_ids": p, "max_tokens": MAX_TOKENS, "ignore_eos": True}
                                            for p in PROMPTS], max_concurrency=len(PROMPTS))
    assert [r.token_ids for r in results] == expected
