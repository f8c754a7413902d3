"""Workers killed with SIGKILL under load: requests move on, none hangs, no token is lost or repeated."""
from __future__ import annotations

import signal
import threading
import time

import grpc
import pytest
import torch

from baton.server import channel as server_channel
from baton.launch.up import LocalCluster
from baton.v1 import common_pb2, kvtransfer_pb2_grpc, workers_pb2, workers_pb2_grpc
from baton.client import BatonClient, BatonError
from baton.engine.kv import SequenceKV
from baton.kvtransfer import encode

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
            # Kill while rows decode on the worker killed and most requests wait: a fixed sleep let
            # a fast machine finish the whole workload first, and counting streams with tokens
            # found them all on the other worker (this one's requests still prefilling).
            with server_channel(cluster.decode_addrs[0], cluster_token=cluster.cluster_token) as ch:
                load, flowing = workers_pb2_grpc.DecodeWorkerStub(ch).GetLoad, time.monotonic() + 60
                while load(common_pb2.LoadRequest(), timeout=5).rows_in_use < 2 and time.monotonic() < flowing:
                    time.sleep(0.005)
            procs[cluster.decode_addrs[0]].send_signal(signal.SIGKILL)
            procs[cluster.prefill_addrs[0]].send_signal(signal.SIGKILL)
            for t in threads:
                t.join(timeout=150)
            assert not any(t.is_alive() for t in threads), "a request hung"
            again = client.cluster_status().routing["prefilled_again"]
        assert 0 < again <= REQUESTS  # the killed decode worker's streams were prefilled once more

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


def test_a_hung_decode_worker_is_noticed_and_its_requests_move(tiny_reference):
    """SIGSTOP: the process is alive but silent (no reset on its sockets). The router's keepalive
    pings break its streams within seconds and the requests continue, exact, on the other one."""
    prompts = [[400 + 13 * i + j for j in range(6 + i % 11)] for i in range(10)]
    # Rows for every request on either worker: a moved request never waits for a row.
    with LocalCluster(prefill=1, decode=2, model="tiny-random", max_rows=len(prompts)) as cluster:
        hung = dict(cluster.procs)[cluster.decode_addrs[0]]
        with BatonClient(cluster.router_address, timeout=120) as client:
            tokens: dict[int, list[int]] = {}
            gaps: dict[int, float] = {}  # each stream's longest wait between two chunks, once flowing

            def run(i: int) -> None:
                tokens[i], last, gaps[i] = [], None, 0.0
                for chunk in client.stream(token_ids=prompts[i], max_tokens=HUNG_MAX_TOKENS, ignore_eos=True):
                    now = time.monotonic()
                    if last is not None and tokens[i]:
                        gaps[i] = max(gaps[i], now - last)
                    last = now
                    tokens[i].extend(chunk.token_ids)

            threads = [threading.Thread(target=run, args=(i,)) for i in range(len(prompts))]
            for t in threads:
                t.start()
            _wait_for_rows(client, cluster.decode_addrs[0])
            hung.send_signal(signal.SIGSTOP)
            try:
                for t in threads:
                    t.join(timeout=90)
                assert not any(t.is_alive() for t in threads), "a request waited on the hung worker"
            finally:
                hung.send_signal(signal.SIGCONT)
    for i, prompt in enumerate(prompts):
        assert tokens[i] == tiny_reference.greedy(prompt, HUNG_MAX_TOKENS), f"request {i}"
    longest = max(gaps.values())
    print(f"\nlongest pause of a stream while its decode worker hung: {longest:.1f} s")
    assert longest < 30, "the hung worker was noticed too late"  # keepalive: about 4 s, plus the move


HUNG_MAX_TOKENS = 400  # long enough that the streams are still running when the worker stops


def _wait_for_rows(client: BatonClient, address: str, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        worker = next((w for w in client.cluster_status().workers if w.address == address), None)
        if worker is not None and worker.decode["rows_in_use"] > 0:
            return
        time.sleep(0.05)
    raise AssertionError(f"{address} never took a request")


def test_a_decode_worker_the_prefill_worker_does_not_know_costs_no_request(tiny_reference, capfd):
    """The router and a prefill worker discover decode workers apart, so for a moment (one leaving
    or joining) the router may pick one the prefill worker refuses to push to. The request goes on
    with another decode worker: here the prefill worker knows only the first of two, always."""
    cluster = LocalCluster(prefill=1, decode=2, model="tiny-random", max_rows=4)
    known, unknown = cluster.decode_addrs
    cluster.env["BATON_PREFILL_DECODE_WORKERS"] = known
    prompts = [[40 + 5 * i + j for j in range(4 + i)] for i in range(8)]
    with cluster, BatonClient(cluster.router_address, timeout=120) as client:
        results = client.generate_many([{"token_ids": p, "max_tokens": 8, "ignore_eos": True} for p in prompts])
        again = client.cluster_status().routing["prefilled_again"]
    for prompt, result in zip(prompts, results):
        assert not isinstance(result, BatonError), result
        assert result.token_ids == tiny_reference.greedy(prompt, 8) and result.trace.decode_worker == known
    # the router did pick the unknown one, and moved on; nothing was prefilled twice (it was refused first)
    assert f"refused decode_target {unknown}" in capfd.readouterr().err and again == 0


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

    from baton.launch.up import free_port

    ports = {role: free_port() for role in ("router", "prefill", "decode")}
    with LocalCluster(prefill=1, decode=1, model="tiny-random", max_rows=0,  # rows and the rest sized at start
                      router_args=("--metrics-port", str(ports["router"])),
                      prefill_args=("--metrics-port", str(ports["prefill"])),
                      decode_args=("--metrics-port", str(ports["decode"]))) as cluster:
        with BatonClient(cluster.router_address, timeout=60) as client:
            client.generate(token_ids=[5, 6, 7], max_tokens=4, ignore_eos=True)
            chosen = {address: {s.name: s for s in settings}
                      for address, settings in client.model_info().worker_settings.items()}
        scraped = {role: urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
                   for role, port in ports.items()}
    from prometheus_client.parser import text_string_to_metric_families

    def series(role: str) -> dict:  # (name, other labels) -> value; every series has the model_name label
        out = {}
        for family in text_string_to_metric_families(scraped[role]):
            for sample in family.samples:
                labels = dict(sample.labels)
                assert labels.pop("model_name", None) == "tiny-random", (role, sample)
                out[sample.name, tuple(sorted(labels.items()))] = sample.value
        return out

    router, prefill, decode = series("router"), series("prefill"), series("decode")
    # The sizes each worker chose at start, and how: in GetModelInfo and in /metrics alike
    decoded, prefilled = chosen[cluster.decode_addrs[0]], chosen[cluster.prefill_addrs[0]]
    assert set(decoded) == {"max_rows", "kv_budget_bytes", "staging_bytes", "threads", "tensor_parallel_size"}
    assert set(prefilled) == {"threads", "tensor_parallel_size"}
    assert decoded["tensor_parallel_size"].value == prefilled["tensor_parallel_size"].value == 1
    # Rows per torch thread, or the floor where the worker's share of the cores gives too few (the
    # cluster splits the cores between its two workers: one each on a 2-core machine)
    from baton.sizing import CPU_ROWS_PER_THREAD, MIN_ROWS
    per_thread = CPU_ROWS_PER_THREAD * int(decoded["threads"].value)
    assert decoded["max_rows"].value == max(per_thread, MIN_ROWS)
    assert ("per torch thread" if per_thread >= MIN_ROWS else f"at least {MIN_ROWS}") in decoded["max_rows"].chosen_by
    assert "MemAvailable" in decoded["kv_budget_bytes"].chosen_by or "cgroup" in decoded["kv_budget_bytes"].chosen_by
    assert decoded["staging_bytes"].value >= 512 << 20 and "prompts of" in decoded["staging_bytes"].chosen_by
    for role, workers_chosen in (("decode", decoded), ("prefill", prefilled)):
        served = {dict(labels)["setting"]: (value, dict(labels)["chosen_by"])
                  for (name, labels), value in series(role).items() if name == "baton_setting"}
        assert served == {name: (s.value, s.chosen_by) for name, s in workers_chosen.items()}, role
    assert router["baton_time_to_first_token_seconds_count", ()] == 1.0
    assert router["baton_requests_total", (("reason", "length"),)] == 1.0
    assert prefill["baton_kv_transfers_total", (("outcome", "ok"),)] == 1.0
    assert prefill["baton_kv_transfer_transports_total", (("transport", "shm"),)] == 1.0  # one host: shared memory
    for name in ("baton_decode_rows_in_use", "baton_decode_kv_allocated_bytes", "baton_decode_kv_pages_total",
                 "baton_decode_kv_pages_used", "baton_decode_kv_pages_shared", "baton_decode_kv_allocated_over_useful",
                 "baton_decode_parked_for_memory_total", "baton_decode_resumes_total", "baton_decode_recomputes_total",
                 "baton_decode_staged_bytes", "baton_decode_preemptions_total", "baton_decode_rows_sharing_total",
                 "baton_time_between_tokens_seconds_count"):
        assert (name, ()) in decode, name
    # vLLM's names, where each lives in a disaggregated cluster: the router sees what the user
    # sees, the prefill worker the prompt, the decode worker the tokens and the KV.
    assert router["vllm:time_to_first_token_seconds_count", ()] == 1.0
    assert router["vllm:e2e_request_latency_seconds_count", ()] == 1.0
    assert router["vllm:request_success_total", (("finished_reason", "length"),)] == 1.0
    assert ("vllm:time_to_first_token_seconds_bucket", (("le", "2560.0"),)) in router  # vLLM's buckets
    assert prefill["vllm:prompt_tokens_total", ()] == 3.0 and prefill["vllm:prefix_cache_queries_total", ()] == 3.0
    assert prefill["vllm:request_queue_time_seconds_count", ()] == 1.0
    assert prefill["vllm:num_requests_waiting", ()] == 0.0 and 0 <= prefill["vllm:kv_cache_usage_perc", ()] <= 1
    assert decode["vllm:generation_tokens_total", ()] == 4.0
    assert decode["vllm:inter_token_latency_seconds_count", ()] == 3.0  # 4 tokens, 3 gaps
    assert decode["vllm:num_requests_running", ()] == 0.0 and decode["vllm:num_preemptions_total", ()] == 0.0
    assert 0 <= decode["vllm:kv_cache_usage_perc", ()] <= 1


def test_a_decode_worker_full_of_requests_waiting_for_kv_still_takes_their_kv(tiny_reference):
    """Every request waiting for KV holds its Decode call's server thread. With more of them than
    the server once had threads (64), the KV pushes they wait for, and load polls, must still get in."""
    held = 80
    with LocalCluster(prefill=1, decode=1, model="tiny-random", max_rows=2,
                      extra_env={"BATON_DECODE_MAX_PENDING": str(held + 1)}) as cluster:
        with server_channel(cluster.decode_addrs[0], cluster_token=cluster.cluster_token) as channel:
            stub = workers_pb2_grpc.DecodeWorkerStub(channel)
            waiting = [stub.Decode(workers_pb2.DecodeRequest(request_id=f"held-{i}", prompt_token_ids=[1, 2, 3],
                                                             sampling=common_pb2.SamplingParams(max_tokens=4)),
                                   timeout=60) for i in range(held)]
            try:
                for call in waiting:
                    next(call)  # registered; its KV never comes
                with BatonClient(cluster.router_address, timeout=30) as client:
                    wait_for(lambda: waiting_for_kv(client) == held, 10, "the load poll answered and saw them all")
                    prompt = [7, 8, 9, 10]
                    result = client.generate(token_ids=prompt, max_tokens=8, ignore_eos=True)
                    assert result.token_ids == tiny_reference.greedy(prompt, 8)
            finally:
                for call in waiting:
                    call.cancel()
        with BatonClient(cluster.router_address, timeout=30) as client:
            wait_for(lambda: waiting_for_kv(client) == 0, 10, "the cancelled requests gone")


def waiting_for_kv(client: BatonClient) -> int:
    return next(w.decode for w in client.cluster_status().workers if w.role == "decode")["waiting_for_kv"]


# --- overload past the workers' own bounds ---------------------------------------------------------

def rss_bytes(pid: int) -> int:
    """Resident memory of a process: psutil when installed, else /proc/PID/status (Linux)."""
    try:
        import psutil
    except ImportError:
        psutil = None
    if psutil is not None:
        return psutil.Process(pid).memory_info().rss
    with open(f"/proc/{pid}/status") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"no VmRSS for process {pid}")


def wait_for(predicate, timeout: float, what: str):
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        assert time.monotonic() < deadline, f"not reached within {timeout:.0f}s: {what}"
        time.sleep(0.1)


OVERLOAD_ROWS, OVERLOAD_PENDING, OVERLOAD_QUEUE = 2, 4, 1
OVERLOAD_TOKENS = 96
RSS_GROWTH_LIMIT = 200 << 20


@pytest.mark.all_cores  # clients sharing one core with the cluster could not offer twice its load (CI, pinned)
def test_twice_what_the_workers_hold_gets_resource_exhausted_and_memory_stays_bounded(tiny_reference):
    """The router lets every request through (its own bound, router.decode_queue_per_worker, off: it
    would hold the excess before the workers, and a slow router then sends them one at a time), but
    the decode worker holds 2 rows and 4 requests waiting for KV, and the prefill worker queues 1
    prompt. Twice what they hold, sent for seconds: the excess is refused at once with RESOURCE_EXHAUSTED and the router's retry hint
    (never a timeout), served requests are exact, worker memory and staging stay bounded, and
    afterwards nothing is left behind and a new wave is served normally."""
    hold = OVERLOAD_ROWS + OVERLOAD_PENDING
    clients, rounds = 2 * hold, 5
    prompts = [[400 + 13 * k + j for j in range(24 + 5 * k)] for k in range(8)]
    expected = [tiny_reference.greedy(p, OVERLOAD_TOKENS) for p in prompts]
    with LocalCluster(prefill=1, decode=1, model="tiny-random", max_rows=OVERLOAD_ROWS,
                      prefill_args=("--max-queue", str(OVERLOAD_QUEUE)),
                      extra_env={"BATON_DECODE_MAX_PENDING": str(OVERLOAD_PENDING),
                                 "BATON_ROUTER_DECODE_QUEUE_PER_WORKER": "-1"}) as cluster:
        procs = {address: proc for address, proc in cluster.procs}
        workers = {a: procs[a].pid for a in cluster.prefill_addrs + cluster.decode_addrs}
        with BatonClient(cluster.router_address, timeout=120) as client:
            for prompt, want in zip(prompts, expected):  # warm up: every code path and cache touched once
                assert client.generate(token_ids=prompt, max_tokens=OVERLOAD_TOKENS, ignore_eos=True).token_ids == want
            baseline = {a: rss_bytes(pid) for a, pid in workers.items()}
            peak = dict(baseline)
            samples: list[tuple[dict, dict]] = []
            stop = threading.Event()

            def sample() -> None:
                while not stop.is_set():
                    for a, pid in workers.items():
                        peak[a] = max(peak[a], rss_bytes(pid))
                    status = client.cluster_status().workers
                    samples.append((next(w.decode for w in status if w.role == "decode"),
                                    next(w.prefill for w in status if w.role == "prefill")))
                    time.sleep(0.05)

            outcomes: list[tuple[str, float, object]] = []  # (code or "ok", seconds, detail)
            lock = threading.Lock()
            begin = threading.Barrier(clients)

            def load(c: int) -> None:
                begin.wait()  # the first round arrives as one burst
                for r in range(rounds):
                    k = (c + r) % len(prompts)
                    started = time.monotonic()
                    try:
                        result = client.generate(token_ids=prompts[k], max_tokens=OVERLOAD_TOKENS, ignore_eos=True)
                        outcome = ("ok", time.monotonic() - started, (k, result.token_ids))
                    except BatonError as err:
                        outcome = (err.code, time.monotonic() - started, err)
                    with lock:
                        outcomes.append(outcome)
                    if outcome[0] != "ok":
                        time.sleep(0.05)  # and straight back: the offered load stays at twice the bound

            sampler = threading.Thread(target=sample, daemon=True)
            sampler.start()
            threads = [threading.Thread(target=load, args=(c,)) for c in range(clients)]
            started = time.monotonic()
            for t in threads:
                t.start()
            for t in threads:
                t.join(timeout=300)
            overload_seconds = time.monotonic() - started
            stop.set()
            sampler.join(10)
            assert not any(t.is_alive() for t in threads), "a request hung"

            # Afterwards: nothing held anywhere...
            def drained():
                status = client.cluster_status().workers
                decode = next(w.decode for w in status if w.role == "decode")
                prefill = next(w.prefill for w in status if w.role == "prefill")
                held = (decode["rows_in_use"], decode["staged_bytes"], decode["waiting_for_kv"], decode["staged"],
                        prefill["queued"])
                return held == (0, 0, 0, 0, 0) and (decode, prefill)

            wait_for(drained, 30, "decode rows, staging, requests waiting for KV and the prefill queue all empty")
            # ...and a second wave within what the workers hold (one prompt at a time: two arriving
            # together already overflow the one-prompt prefill queue) is served in full, exactly.
            wave = client.generate_many([{"token_ids": p, "max_tokens": OVERLOAD_TOKENS, "ignore_eos": True}
                                         for p in prompts], max_concurrency=OVERLOAD_QUEUE)
            assert [r.token_ids for r in wave] == expected
            decode, prefill = wait_for(drained, 30, "empty again after the second wave")
            # A GenerateBatch at twice the bound: its refused members carry the retry hint too.
            batch = client.generate_batch([{"token_ids": prompts[k % len(prompts)], "max_tokens": OVERLOAD_TOKENS,
                                            "ignore_eos": True} for k in range(2 * hold)], max_concurrency=2 * hold)
            batch_refused = [r for r in batch.results if isinstance(r, BatonError)]
            assert all(r.code == "RESOURCE_EXHAUSTED" and r.retry_after_s == 1.0 for r in batch_refused), batch_refused
            print(f"\nGenerateBatch of {2 * hold}: {len(batch_refused)} refused with the retry hint")
            assert all(r.token_ids == expected[k % len(prompts)]
                       for k, r in enumerate(batch.results) if not isinstance(r, BatonError))
            wait_for(drained, 30, "empty again after the batch")

    served = [o for o in outcomes if o[0] == "ok"]
    refused = [o for o in outcomes if o[0] != "ok"]
    reasons = {}
    for _, _, err in refused:
        key = "decode: waiting for KV" if "waiting for KV" in err.message else (
            "prefill: queue full" if "queued for prefill" in err.message else err.message)
        reasons[key] = reasons.get(key, 0) + 1
    growth = {a: (peak[a] - baseline[a]) / 2**20 for a in workers}
    max_staged = max(d["staged_bytes"] for d, _ in samples)
    print(f"\n{clients} clients x {rounds} requests over {overload_seconds:.1f}s: {len(served)} served, "
          f"{len(refused)} refused {reasons}; slowest refusal {max((s for _, s, _ in refused), default=0):.3f}s; "
          f"worker RSS baseline {[round(b / 2**20) for b in baseline.values()]} MiB, growth "
          f"{[round(g, 1) for g in growth.values()]} MiB; peak staged {max_staged} B; "
          f"peak waiting_for_kv {max(d['waiting_for_kv'] for d, _ in samples)}, "
          f"peak prefill queue {max(p['queued'] for _, p in samples)} ({len(samples)} samples)")
    assert len(outcomes) == clients * rounds
    assert refused, "twice the load the workers hold was all admitted"
    for code, seconds, err in refused:
        assert code == "RESOURCE_EXHAUSTED", f"overload must be RESOURCE_EXHAUSTED, got {err}"
        assert err.retry_after_s == 1.0, f"no retry hint reached the SDK: {err.trailing_metadata}"
        assert seconds < 10, f"a refusal took {seconds:.1f}s: {err}"
    assert len(served) >= hold
    for _, _, (k, tokens) in served:
        assert tokens == expected[k], f"prompt {k} served with the wrong tokens"
    # Bounded: every queue stays within its bound, staging within capacity, memory does not grow.
    assert samples
    for d, p in samples:
        assert d["staged_bytes"] <= d["staging_capacity_bytes"]
        assert d["waiting_for_kv"] <= OVERLOAD_PENDING and d["rows_in_use"] <= OVERLOAD_ROWS
        assert p["queued"] <= OVERLOAD_QUEUE
    assert all(g * 2**20 < RSS_GROWTH_LIMIT for g in growth.values()), f"worker RSS grew by {growth} MiB"
    assert decode["requests_finished"] >= len(served) + 2 * len(prompts)


def test_a_slow_push_flood_cannot_starve_the_decode_worker(tiny_model, tiny_reference):
    """Eight pushes trickling 64 KiB every 0.9 s once filled both decode workers' staging pools for
    a minute and every normal request was refused. Now a push below the receiver's minimum rate is
    cut after its grace and its room freed, so the requests the router admitted still land. The
    flood comes from inside (it holds the cluster token and registers its own Decode calls): the
    worst case, since outsiders cannot reach the port at all."""
    flood, kv_tokens = 8, 2000
    kv_bytes = kv_tokens * tiny_model.kv_shape.bytes_per_token()
    env = {"BATON_DECODE_STAGING_BYTES": str(flood * kv_bytes), "BATON_DECODE_MAX_PENDING": "32"}
    prompts = [[700 + 9 * i + j for j in range(6 + i)] for i in range(6)]
    with LocalCluster(prefill=1, decode=1, model="tiny-random", max_rows=4, extra_env=env) as cluster, \
            server_channel(cluster.decode_addrs[0], cluster_token=cluster.cluster_token) as ch:
        decode = workers_pb2_grpc.DecodeWorkerStub(ch)
        fingerprint = decode.GetLoad(common_pb2.LoadRequest(), timeout=10).model_fingerprint
        held = [decode.Decode(workers_pb2.DecodeRequest(
            request_id=f"flood-{i}", prompt_token_ids=list(range(1, kv_tokens + 1)), push_token=f"token-{i}",
            sampling=common_pb2.SamplingParams(max_tokens=1)), timeout=120) for i in range(flood)]
        for call in held:
            next(call)  # registered: staging room will be granted to its push
        kv = SequenceKV(torch.zeros(tiny_model.kv_shape.num_layers, 2, tiny_model.kv_shape.num_kv_heads, kv_tokens,
                                    tiny_model.kv_shape.head_dim, dtype=tiny_model.kv_shape.dtype))
        outcomes: dict[int, tuple[str, float]] = {}

        def trickle(i: int) -> None:
            def chunks():
                for n, chunk in enumerate(encode(f"flood-{i}", fingerprint, kv, chunk_bytes=64 << 10,
                                                 push_token=f"token-{i}")):
                    if n > 1:
                        time.sleep(0.9)
                    yield chunk
            started = time.monotonic()
            try:
                kvtransfer_pb2_grpc.KVTransferStub(ch).Push(chunks(), timeout=120)
                outcomes[i] = ("OK", time.monotonic() - started)
            except grpc.RpcError as err:
                outcomes[i] = (err.code().name, time.monotonic() - started)

        pushers = [threading.Thread(target=trickle, args=(i,)) for i in range(flood)]
        for t in pushers:
            t.start()
        time.sleep(1.0)  # the flood holds every byte of staging now
        started = time.monotonic()
        try:
            with BatonClient(cluster.router_address, timeout=60) as client:
                results = client.generate_many([{"token_ids": p, "max_tokens": 12, "ignore_eos": True}
                                                for p in prompts])
        finally:
            served_after = time.monotonic() - started
            for t in pushers:
                t.join(timeout=60)
            for call in held:
                call.cancel()
    print(f"\nnormal requests served {served_after:.1f}s into the flood; pushes ended {sorted(outcomes.values())}")
    for prompt, result in zip(prompts, results):
        assert result.token_ids == tiny_reference.greedy(prompt, 12)
    assert all(code == "ABORTED" and seconds < 6 for code, seconds in outcomes.values()), outcomes
    assert len(outcomes) == flood


def test_a_decode_worker_going_silent_while_its_kv_is_pushed_loses_no_request(default_reference):
    """SIGSTOP right after the decode worker registered a request and before the prefill worker
    pushes its KV (a long prompt takes about a second to prefill): the push meets a silent peer.
    The request must move (another decode worker, prefilled again) and finish exact."""
    prompt_text = " ".join(f"Item {i}: the quick brown fox jumps over the lazy dog." for i in range(120))
    with LocalCluster(prefill=1, decode=2, model="default", max_rows=2) as cluster:
        procs = dict(cluster.procs)
        with BatonClient(cluster.router_address, timeout=120) as client:
            client.generate("warm up both decode workers", max_tokens=2)
            client.generate("and the second one too", max_tokens=2)
            outcome: dict[str, object] = {}

            def run() -> None:
                try:
                    outcome["result"] = client.generate(prompt_text, max_tokens=16, ignore_eos=True, temperature=0)
                except BatonError as exc:
                    outcome["error"] = exc

            thread = threading.Thread(target=run)
            thread.start()
            silenced = None
            deadline = time.monotonic() + 60
            while silenced is None and time.monotonic() < deadline:  # the request is registered: stop its worker
                for worker in client.cluster_status().workers:
                    if worker.role == "decode" and worker.decode.get("waiting_for_kv", 0) > 0:
                        silenced, silenced_address = procs[worker.address], worker.address
                        silenced.send_signal(signal.SIGSTOP)
                        stopped_at = time.monotonic()
                        break
                time.sleep(0.01)
            assert silenced is not None, "the request never reached a decode worker"
            try:
                thread.join(timeout=90)
                finished = time.monotonic() - stopped_at
            finally:
                silenced.send_signal(signal.SIGCONT)
    assert "error" not in outcome, outcome.get("error")
    result = outcome["result"]
    assert result.token_ids == default_reference.greedy(result.prompt_token_ids, 16)
    print(f"\nthe request finished {finished:.1f}s after its decode worker went silent, on {result.trace.decode_worker}")
    assert result.trace.decode_worker != silenced_address
