"""An interval's Observation, and what each worker's removal would cost, from two readings of the
workers' load reports (the router's ClusterStatus: each worker's counters and gauges). Plain Python.

The counters give the work done between the readings: prompts prefilled and their tokens computed
(with what the queues grew by, what arrived: a saturated pool's throughput is not the demand),
tokens decoded, requests finished. ITL is read from the decode workers as the time each spent per
token of a row: the interval times its rows over the tokens it decoded (the mean gap between a
stream's tokens while the worker is busy). TTFT is the 90th percentile of the router's own
histogram over the interval (ClusterStatus carries it; with several routers, the one the planner's
connection reaches: a sample of the traffic).
"""
from __future__ import annotations

from dataclasses import dataclass

from baton.planner.policy import Observation, WorkerLoad


@dataclass(frozen=True)
class Reading:
    """One ClusterStatus, as {address: load fields} per role, the router's TTFT histogram
    ((bound, cumulative count), +Inf last), and when it was taken."""

    at: float
    prefill: dict[str, dict]
    decode: dict[str, dict]
    ttft: tuple[tuple[float, int], ...] = ()


def interval_quantile(before: tuple[tuple[float, int], ...], now: tuple[tuple[float, int], ...],
                      q: float) -> float | None:
    """The q-quantile of what a cumulative histogram gained between two readings, interpolated
    within its bucket as Prometheus' histogram_quantile does (None: nothing observed; past the last
    finite bound: that bound)."""
    same_buckets = [bound for bound, _ in before] == [bound for bound, _ in now]
    previous = dict(before) if same_buckets else {}
    gained = [(bound, count - previous.get(bound, 0)) for bound, count in now]
    if any(count < 0 for _, count in gained):  # the router restarted: its counts began again
        gained = list(now)
    if not gained or gained[-1][1] <= 0:
        return None
    rank, lower, below = q * gained[-1][1], 0.0, 0
    for bound, count in gained:
        if count >= rank:
            if bound == float("inf"):
                return lower
            return lower + (bound - lower) * (rank - below) / max(count - below, 1)
        lower, below = bound, count
    return lower


def observe(before: Reading, now: Reading) -> Observation:
    seconds = max(now.at - before.at, 1e-3)

    def grown(role: str, key: str) -> int:
        total = 0
        for address, load in getattr(now, role).items():
            current, previous = load.get(key, 0), getattr(before, role).get(address, {}).get(key, 0)
            total += current - previous if current >= previous else current  # restarted: from 0
        return total

    def queue_grew(key: str) -> int:  # over the workers there now (one restarted began with none)
        total = 0
        for address, load in now.prefill.items():
            previous = before.prefill.get(address, {})
            restarted = load.get("requests_done", 0) < previous.get("requests_done", 0)
            total += load.get(key, 0) - (0 if restarted else previous.get(key, 0))
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
        seconds=seconds,
        requests=max(0, grown("prefill", "requests_done") + queue_grew("queued")),
        prompt_tokens=max(0, grown("prefill", "prompt_tokens_forwarded") + queue_grew("queued_tokens")),
        output_tokens=output, finished=grown("decode", "requests_finished"),
        # streams in rows and landed ones waiting for a row; not those whose KV is still to come (the
        # router opens a stream before its prefill: they are the prefill pool's queue)
        decode_streams=sum(load.get("rows_in_use", 0) + load.get("staged", 0) for load in now.decode.values()),
        prefill_workers=sum(not load.get("draining") for load in now.prefill.values()),
        decode_workers=sum(not load.get("draining") for load in now.decode.values()),
        prefill_backlog_tokens=sum(load.get("queued_tokens", 0) for load in now.prefill.values()),
        ttft_s=interval_quantile(before.ttft, now.ttft, 0.9), itl_s=max(gaps) if gaps else None,
        kv_usage=max(kv, default=0.0))


def worker_loads(reading: Reading) -> dict[str, list[WorkerLoad]]:
    """What removing each worker would cost, per pool (policy.choose_removals ranks them)."""
    return {
        "prefill": [WorkerLoad(address, cached_bytes=load.get("prefix_cache_bytes", 0),
                               draining=bool(load.get("draining"))) for address, load in reading.prefill.items()],
        "decode": [WorkerLoad(address, rows=load.get("rows_in_use", 0) + load.get("staged", 0)
                              + load.get("waiting_for_kv", 0), draining=bool(load.get("draining")))
                   for address, load in reading.decode.items()],
    }
