"""fairness: interactive time to first token while an 84-request batch runs, against idle.

A real cluster (one prefill and one decode worker, each on its own core where there are two).
Interactive probes (short chat questions, 8 new tokens, one every PROBE_GAP_S) are timed from the
call to the first token, three times over:
- idle: nothing else runs;
- batch: while an 84-request GenerateBatch runs (batch members run below interactive priority:
  they yield prefill turns and decode rows);
- same priority: while the same 84 requests run as plain concurrent Generates, the load a
  batch would be without its lower priority.
The goal (issue 21) is batch-time p99 within 2x of idle; the same-priority row shows what the
priority buys. Workers share this machine's cores with the client and router, so part of any
slowdown is CPU contention no scheduling can remove.
"""
from __future__ import annotations

import threading
import time
from typing import Any

from baton.bench.common import BenchOptions, median, ratio, table
from baton.bench.workloads import RELAY_QUESTIONS

BATCH_SIZE = 84
PROBE_GAP_S = 0.5
SYSTEM = "You are a helpful assistant. Answer clearly and stay on topic."


def batch_requests(count: int, max_tokens: int) -> list[dict]:
    return [{"messages": [{"role": "system", "content": SYSTEM},
                          {"role": "user", "content": f"{RELAY_QUESTIONS[i % len(RELAY_QUESTIONS)]} (take {i // 30})"}],
             "max_tokens": max_tokens, "ignore_eos": True} for i in range(count)]


def probe_requests(count: int) -> list[dict]:
    return [{"messages": [{"role": "user", "content": f"In one sentence: what is {topic}?"}], "max_tokens": 8}
            for topic in (f"fact number {k}" for k in range(count))]


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(round(q * (len(ordered) - 1))))]


def p99(values: list[float]) -> float:
    return percentile(values, 0.99)


# Where a probe's first token waited: the trace stages before it (the decode worker sends the
# first token as soon as it has the KV, so staging and admission come after), and what is left
# of its TTFT: the router, the network, and a landed KV waiting for the decode loop to take it.
TTFT_STAGES = ("queue", "prefill", "transfer")


def time_probes(client, probes: list[dict], keep_going=lambda: True) -> tuple[list[float], list[dict]]:
    """Seconds to the first token of each probe, one at a time, PROBE_GAP_S apart, and each
    probe's stage seconds. The rest of a probe's stream (its stages come on its last chunk) is
    read by a thread of its own, so the next probe starts PROBE_GAP_S after a first token, as if
    the caller had stopped reading there."""
    times: list[float] = []
    stages: list[dict] = []
    readers = []

    def read_rest(stream, chunks, slot: int) -> None:
        with stream:
            for chunk in chunks:
                if chunk.trace is not None:
                    stages[slot] = {k: chunk.trace.stage_seconds.get(k, 0.0) for k in TTFT_STAGES}

    for probe in probes:
        if not keep_going():
            break
        started = time.monotonic()
        stream = client.stream(**probe)
        chunks = iter(stream)
        for chunk in chunks:
            if chunk.token_ids:
                times.append(time.monotonic() - started)
                stages.append({})
                reader = threading.Thread(target=read_rest, args=(stream, chunks, len(stages) - 1), daemon=True)
                reader.start()
                readers.append(reader)
                break
        else:
            stream.close()
        time.sleep(PROBE_GAP_S)
    for reader in readers:
        reader.join(timeout=120)
    return times, stages


def tail_stages(times: list[float], stages: list[dict], q: float = 0.9) -> dict[str, float]:
    """Mean seconds per stage over the probes at or above the q-quantile TTFT, with the rest as 'other'."""
    cut = percentile(times, q)
    tail = [(t, st) for t, st in zip(times, stages) if t >= cut and st]
    if not tail:
        return {}
    out = {k: sum(st.get(k, 0.0) for _, st in tail) / len(tail) for k in TTFT_STAGES}
    out["other"] = sum(t for t, _ in tail) / len(tail) - sum(out.values())
    return out


def under_load(client, probes: list[dict], load, wait_busy) -> tuple[tuple[list[float], list[dict]], float]:
    """Probe TTFTs (and stages) while `load()` runs in a thread; also the load's own wall time."""
    done = threading.Event()
    elapsed = [0.0]

    def run_load() -> None:
        started = time.monotonic()
        try:
            load()
        finally:
            elapsed[0] = time.monotonic() - started
            done.set()

    thread = threading.Thread(target=run_load, daemon=True)
    thread.start()
    wait_busy(done)
    times = time_probes(client, probes, keep_going=lambda: not done.is_set())
    thread.join()
    return times, elapsed[0]


def run(opts: BenchOptions) -> dict[str, Any]:
    from baton.client import BatonClient
    from baton.launch.up import LocalCluster

    probes_n = int(opts.extra.get("probes") or (6 if opts.quick else 30))
    batch_n = 12 if opts.quick else BATCH_SIZE
    max_tokens = 16 if opts.quick else 64
    model = opts.model
    requests = batch_requests(batch_n, max_tokens)
    with LocalCluster(prefill=1, decode=1, model=model, max_rows=8, extra_env=opts.worker_env(),
                      share_cores=True) as cluster, BatonClient(cluster.router_address, timeout=600) as client:
        decode = cluster.decode_addrs[0]

        def wait_busy(load_done: threading.Event) -> None:  # until the load holds decode rows (or is over)
            deadline = time.monotonic() + 120
            while time.monotonic() < deadline and not load_done.is_set():
                worker = next((w for w in client.cluster_status().workers if w.address == decode), None)
                if worker is not None and worker.decode.get("rows_in_use", 0) > 0:
                    return
                time.sleep(0.05)

        client.generate("warm up", max_tokens=2)
        opts.progress("idle probes")
        idle, idle_stages = time_probes(client, probe_requests(probes_n))
        opts.progress(f"probes during a {batch_n}-request batch")
        (batch, batch_stages), batch_s = under_load(client, probe_requests(probes_n),
                                    lambda: client.generate_batch(requests, max_concurrency=batch_n), wait_busy)
        opts.progress(f"probes during {batch_n} same-priority requests")
        (same, same_stages), same_s = under_load(client, probe_requests(probes_n),
                                  lambda: client.generate_many(requests, max_concurrency=batch_n), wait_busy)

    rows, tails = [], []
    results: dict[str, Any] = {"model": model, "batch_size": batch_n, "max_tokens": max_tokens, "probes": {}}
    for name, times, stages, wall in (("idle", idle, idle_stages, None),
                                      ("batch (low priority)", batch, batch_stages, batch_s),
                                      ("same priority", same, same_stages, same_s)):
        rows.append([name, len(times), median(times) if times else None,
                     percentile(times, 0.9) if times else None, p99(times) if times else None,
                     ratio(p99(times), p99(idle)) if times and idle else None, wall])
        tail = tail_stages(times, stages) if times else {}
        tails.append([name] + [tail.get(k) for k in (*TTFT_STAGES, "other")])
        results["probes"][name] = {"ttft_s": times, "stage_s": stages, "tail_stage_s": tail, "load_wall_s": wall}
    results["p99_ratio_batch_vs_idle"] = ratio(p99(batch), p99(idle)) if batch and idle else None
    results["p99_ratio_same_priority_vs_idle"] = ratio(p99(same), p99(idle)) if same and idle else None
    opts.say(f"\nInteractive TTFT ({model}, {probes_n} probes each, one every {PROBE_GAP_S}s; load: {batch_n} "
             f"requests x {max_tokens} tokens)")
    opts.say(table(["while", "probes", "TTFT p50 s", "TTFT p90 s", "TTFT p99 s", "p99 / idle", "load wall s"], rows))
    opts.say("goal: batch p99 within 2x of idle")
    opts.say("\nWhere the slowest 10% of probes waited for their first token (mean seconds; other: the router, "
             "the network, and a landed KV waiting for the decode loop)")
    opts.say(table(["while", *TTFT_STAGES, "other"], tails, digits=3))
    return results


def add_arguments(parser) -> None:
    parser.add_argument("--probes", type=int, default=None, help="interactive probes per phase (default 30; --quick 6)")
