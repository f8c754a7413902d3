"""An interval's Observation, and what each worker's removal would cost, from two readings of the
workers' load reports (the router's ClusterStatus: each worker's counters and gauges). Plain Python.

The counters give the work done between the readings: prompts prefilled (arrivals, once they are
through the queue, which is counted apart), prompt tokens computed, tokens decoded. ITL is read
from the decode workers as the time each spent per token of a row: the interval times its rows
over the tokens it decoded (the mean gap between a stream's tokens while the worker is busy). TTFT
comes from the router's own histogram when the caller has one (planner.service reads it).
"""
from __future__ import annotations

from dataclasses import dataclass

from baton.planner.policy import Observation, WorkerLoad


@dataclass(frozen=True)
class Reading:
    """One ClusterStatus, as {address: load fields} per role, and when it was taken."""

    at: float
    prefill: dict[str, dict]
    decode: dict[str, dict]


def observe(before: Reading, now: Reading, ttft_s: float | None = None) -> Observation:
    seconds = max(now.at - before.at, 1e-3)

    def grown(role: str, key: str) -> int:
        total = 0
        for address, load in getattr(now, role).items():
            current, previous = load.get(key, 0), getattr(before, role).get(address, {}).get(key, 0)
            total += current - previous if current >= previous else current  # restarted: from 0
        return total

    output = grown("decode", "decode_tokens_forwarded")
    gaps = []
    for address, load in now.decode.items():
        tokens = load.get("decode_tokens_forwarded", 0) - before.decode.get(address, {}).get("decode_tokens_forwarded", 0)
        if tokens > 0 and load.get("rows_in_use", 0):
            gaps.append(seconds * load["rows_in_use"] / tokens)
    kv = [load.get("kv_bytes_allocated", 0) / load["kv_budget_bytes"] for load in now.decode.values()
          if load.get("kv_budget_bytes")]
    return Observation(
        seconds=seconds, requests=grown("prefill", "requests_done"),
        prompt_tokens=grown("prefill", "prompt_tokens_forwarded"), output_tokens=output,
        prefill_workers=sum(not load.get("draining") for load in now.prefill.values()),
        decode_workers=sum(not load.get("draining") for load in now.decode.values()),
        prefill_backlog_tokens=sum(load.get("queued_tokens", 0) for load in now.prefill.values()),
        ttft_s=ttft_s, itl_s=max(gaps) if gaps else None, kv_usage=max(kv, default=0.0))


def worker_loads(reading: Reading) -> dict[str, list[WorkerLoad]]:
    """What removing each worker would cost, per pool (policy.choose_removals ranks them)."""
    return {
        "prefill": [WorkerLoad(address, cached_bytes=load.get("prefix_cache_bytes", 0),
                               draining=bool(load.get("draining"))) for address, load in reading.prefill.items()],
        "decode": [WorkerLoad(address, rows=load.get("rows_in_use", 0) + load.get("staged", 0)
                              + load.get("waiting_for_kv", 0), draining=bool(load.get("draining")))
                   for address, load in reading.decode.items()],
    }
