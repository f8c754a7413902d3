"""route: how often the router's prefix prediction came true, what it saved, and what routing costs.

Issue 16's shape: 200 requests over 12 shared prefixes (256 tokens each, then 32 tokens of their
own, 4 new tokens), concurrency 16, on a real cluster of 2 prefill workers and 1 decode worker;
one prefill worker is SIGKILLed and restarted on the same port after half the requests. Run on:
- memory: the index in the router's process (the default);
- redis: the index in a redis-server this suite starts;
- memory, bounded: `index_max_blocks` below the working set (the prefixes' blocks alone);
- round-robin: the same router with the routing weights at 0 (no load, no cache credit), the
  baseline a cache-blind router gives.
Per run: prediction precision (of the prompt tokens the router predicted cached, the share the
worker really reused) and recall (of the tokens reused, the share predicted), prefill tokens saved
against the optimum (each prefix computed once: what the workload allows at best), the router's
own time per request (its `route` stage: block hashes, index match, pick; no worker time), p50/p99,
and failed requests. Then the routing decision alone, in this process over the same index
contents: the requests per second one router process can route. `--quick` (CI's smoke test):
the tiny model, 40 requests over 4 prefixes, the memory and round-robin runs only.
"""
from __future__ import annotations

import random
import shutil
import subprocess
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from baton.bench.common import NO_LOCAL_PREFILL, BenchOptions, median, ratio, table

PREFIXES = 12
PREFIX_TOKENS = 256
OWN_TOKENS = 32
REQUESTS = 200
CONCURRENCY = 16
MAX_TOKENS = 4
BLOCK = 16


def workload(requests: int, prefixes: int, seed: int = 0) -> list[tuple[int, list[int]]]:
    """(prefix number, prompt) per request, in arrival order."""
    rng = random.Random(seed)
    shared = [[rng.randrange(100, 40000) for _ in range(PREFIX_TOKENS)] for _ in range(prefixes)]
    out = []
    for _ in range(requests):
        k = rng.randrange(prefixes)
        out.append((k, shared[k] + [rng.randrange(100, 40000) for _ in range(OWN_TOKENS)]))
    return out


def optimum_saved_tokens(prompts: list[tuple[int, list[int]]]) -> int:
    """Each prefix computed once, by its first request; every later one reuses its whole blocks
    (all of the prefix: it is a whole number of blocks, and the prompt goes on past it)."""
    seen: set[int] = set()
    saved = 0
    for k, _ in prompts:
        if k in seen:
            saved += PREFIX_TOKENS
        seen.add(k)
    return saved


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(round(q * (len(ordered) - 1))))]


class RedisProcess:
    """A throwaway redis-server on a free loopback port, no persistence."""

    def __init__(self):
        from baton.launch.up import free_port

        binary = shutil.which("redis-server")
        if binary is None:
            raise FileNotFoundError("redis-server is not installed (apt-get install redis-server, or `make setup`)")
        self.port = free_port()
        self.dir = tempfile.mkdtemp(prefix="baton-bench-redis-")
        self.proc = subprocess.Popen([binary, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "",
                                      "--appendonly", "no", "--dir", self.dir],
                                     stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        import redis

        client = redis.Redis(port=self.port)
        deadline = time.monotonic() + 10
        while True:
            try:
                client.ping()
                break
            except redis.exceptions.ConnectionError:
                if time.monotonic() > deadline or self.proc.poll() is not None:
                    self.stop()
                    raise RuntimeError("redis-server did not start") from None
                time.sleep(0.05)
        client.close()

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            self.proc.wait(10)
        shutil.rmtree(self.dir, ignore_errors=True)


def run_cluster(opts: BenchOptions, model: str, prompts, router_config: dict, router_args: tuple[str, ...],
                restart: bool) -> dict[str, Any]:
    import yaml

    from baton.client import BatonClient
    from baton.launch.up import LocalCluster

    with tempfile.TemporaryDirectory() as tmp:
        config = Path(tmp) / "router.yaml"
        config.write_text(yaml.safe_dump({"router": router_config}))
        # the prefill workers' routing is measured: no prompt is prefilled on the decode worker
        env = {**opts.worker_env(), **NO_LOCAL_PREFILL}
        with LocalCluster(prefill=2, decode=1, model=model, max_rows=CONCURRENCY, extra_env=env,
                          share_cores=True, log_level="ERROR", router_args=("--config", str(config), *router_args)) as cluster, \
                BatonClient(cluster.router_address, timeout=600) as client:
            results: list[Any] = [None] * len(prompts)
            done = threading.Semaphore(0)
            restarted_at = None

            def one(i: int) -> None:
                try:
                    results[i] = client.generate(token_ids=prompts[i][1], max_tokens=MAX_TOKENS, ignore_eos=True,
                                                     temperature=0)
                except Exception as exc:  # noqa: BLE001 - counted as failed
                    results[i] = exc
                done.release()

            started = time.monotonic()
            with ThreadPoolExecutor(CONCURRENCY) as pool:
                for i in range(len(prompts)):
                    pool.submit(one, i)
                if restart:
                    for _ in range(len(prompts) // 2):
                        done.acquire()
                    victim = cluster.prefill_addrs[1]
                    opts.progress(f"restarting prefill worker {victim} after {len(prompts) // 2} requests")
                    restarted_at = time.monotonic() - started
                    cluster.restart(victim)
            wall = time.monotonic() - started
            status = client.cluster_status()
    ok = [r for r in results if not isinstance(r, Exception)]
    predicted = [r.trace.predicted_cached_tokens for r in ok]
    actual = [r.trace.cached_tokens for r in ok]
    overlap = sum(min(p, a) for p, a in zip(predicted, actual))
    route_s = [r.trace.stage_seconds.get("route", 0.0) for r in ok]
    return {
        "requests": len(prompts), "failed": len(prompts) - len(ok),
        "failures": sorted({f"{type(r).__name__}: {r}"[:160] for r in results if isinstance(r, Exception)}),
        "predicted_tokens": sum(predicted), "reused_tokens": sum(actual),
        "precision": overlap / sum(predicted) if sum(predicted) else None,
        "recall": overlap / sum(actual) if sum(actual) else None,
        "over_predicted_requests": sum(p > a for p, a in zip(predicted, actual)),
        "route_s_p50": median(route_s) if route_s else None, "route_s_p99": percentile(route_s, 0.99) if route_s else None,
        "wall_s": wall, "requests_per_s": len(ok) / wall, "restarted_at_s": restarted_at,
        "per_worker": _per_worker(ok), "router_routing": status.routing,
        "per_request": [None if isinstance(r, Exception) else
                        [k, r.trace.prefill_worker, r.trace.predicted_cached_tokens, r.trace.cached_tokens]
                        for (k, _), r in zip(prompts, results)],
    }


def _per_worker(results) -> dict[str, int]:
    counts: dict[str, int] = {}
    for r in results:
        counts[r.trace.prefill_worker] = counts.get(r.trace.prefill_worker, 0) + 1
    return counts


def routing_rate(prompts, index, seconds: float) -> dict[str, Any]:
    """Route decisions per second in this process: hashing, index match, pick, over `index`
    holding every prompt's blocks on one of two workers (no RPC: the workers are views only)."""
    from baton.router.dispatch import Dispatcher
    from baton.router.workers import WorkerPool

    pool = WorkerPool()
    try:
        pool.set_workers("prefill", ["10.0.0.1:1", "10.0.0.2:1"])
        pool.set_workers("decode", ["10.0.0.3:1"])
        for worker in pool.all():
            worker.view.healthy = True
            worker.fingerprint = "bench-model"
        dispatcher = Dispatcher(pool, index, BLOCK)
        for i, (_, prompt) in enumerate(prompts):
            index.apply_event(f"10.0.0.{1 + i % 2}:1", stored=dispatcher.block_hashes(prompt))
        count, started = 0, time.perf_counter()
        while time.perf_counter() - started < seconds:
            dispatcher.route(prompts[count % len(prompts)][1]).release()  # as if its calls took it over
            count += 1
        elapsed = time.perf_counter() - started
        return {"routes": count, "seconds": elapsed, "routes_per_s": count / elapsed,
                "us_per_route": elapsed / count * 1e6}
    finally:
        pool.stop()
        index.close()


def run(opts: BenchOptions) -> dict[str, Any]:
    from baton.router.prefix_index import InMemoryPrefixIndex, RedisPrefixIndex

    quick = opts.quick
    model = opts.model
    n = int(opts.extra.get("requests") or (40 if quick else REQUESTS))
    prompts = workload(n, 4 if quick else PREFIXES)
    optimum = optimum_saved_tokens(prompts)
    bound = max(1, (4 if quick else PREFIXES) * PREFIX_TOKENS // BLOCK // 2)  # half the prefixes' blocks
    redis = None
    try:
        redis = None if quick else RedisProcess()  # --quick: a smoke test of the suite, two runs
    except (FileNotFoundError, RuntimeError) as exc:
        opts.progress(f"no redis run: {exc}")
    runs = [("memory", {}, ()),
            ("redis", {}, ("--prefix-index", "redis", "--redis-url", redis.url, "--index-namespace", "bench"))
            if redis else None,
            None if quick else (f"memory, bounded ({bound} blocks)", {"index_max_blocks": bound}, ()),
            ("round-robin", {"load_weight": 0.0, "cache_weight": 0.0}, ())]
    results: dict[str, Any] = {"model": model, "requests": n, "prefixes": 4 if quick else PREFIXES,
                               "prefix_tokens": PREFIX_TOKENS, "own_tokens": OWN_TOKENS, "concurrency": CONCURRENCY,
                               "optimum_saved_tokens": optimum, "runs": {}}
    try:
        for entry in runs:
            if entry is None:
                continue
            name, config, args = entry
            opts.progress(f"{name}: {n} requests, a prefill worker restarted half way")
            results["runs"][name] = run_cluster(opts, model, prompts, config, args, restart=True)
        opts.progress("routing decisions alone, in this process")
        seconds = 0.5 if quick else 3.0
        results["routing_rate"] = {"memory": routing_rate(prompts, InMemoryPrefixIndex(), seconds)}
        if redis:
            results["routing_rate"]["redis"] = routing_rate(
                prompts, RedisPrefixIndex.from_url(redis.url, namespace="bench-rate"), seconds)
    finally:
        if redis:
            redis.stop()

    rows = []
    for name, r in results["runs"].items():
        rows.append([name, r["requests"] - r["failed"], r["failed"], r["precision"], r["recall"],
                     r["reused_tokens"], ratio(r["reused_tokens"], optimum), r["route_s_p50"] * 1e3,
                     r["route_s_p99"] * 1e3, r["requests_per_s"]])
    opts.say(f"\nRouting ({model}; {n} requests over {results['prefixes']} prefixes of {PREFIX_TOKENS} tokens + "
             f"{OWN_TOKENS} own, concurrency {CONCURRENCY}, 2 prefill workers, one restarted half way)")
    opts.say(table(["index", "served", "failed", "precision", "recall", "tokens reused", "of optimum",
                    "route p50 ms", "route p99 ms", "req/s"], rows, digits=3))
    opts.say(f"optimum: {optimum} prompt tokens reused (each prefix computed once); goal: precision >= 0.95")
    rate_rows = [[name, r["routes_per_s"], r["us_per_route"]] for name, r in results["routing_rate"].items()]
    opts.say("\nRouting decisions one router process makes per second (hash, match, pick; no RPC)")
    opts.say(table(["index", "routes/s", "us/route"], rate_rows, digits=1))
    return results


def add_arguments(parser) -> None:
    parser.add_argument("--requests", type=int, default=None, help=f"requests per run (default {REQUESTS}; --quick 40)")
