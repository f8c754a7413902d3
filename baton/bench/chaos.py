"""chaos: sustained mixed load while workers are killed, stopped, restarted and pushed at slowly.

A real cluster (two prefill and two decode workers, tiny random model by default, so every
answer can be checked against `transformers` greedy decoding in this process). Client threads
send streams (some closed early on purpose), single generates and small GenerateBatches for
`--duration` seconds, while a fault thread, on a seeded schedule:
- SIGKILLs a worker and starts it again on the same port (the router's discovery finds it);
- SIGSTOPs a worker for a few seconds, then SIGCONTs it (alive but silent: a hung peer);
- floods a decode worker with KV pushes trickling below the minimum rate, as an insider
  holding the cluster token would (they must be cut, and admitted requests still served).
Every request ends in one class: exact, wrong (tokens differ from greedy), refused with a
reason (RESOURCE_EXHAUSTED, UNAVAILABLE: the client is told to retry), cancelled by its own
client, lost (any other failure) or hung (no answer within its deadline). The goal is 0 wrong,
0 lost, 0 hung, with memory flat: RSS of every process is sampled through the run.
"""
from __future__ import annotations

import random
import signal
import threading
import time
from collections import Counter, defaultdict
from pathlib import Path
from typing import Any

from baton.bench.common import BenchOptions, table

REFUSED = {"RESOURCE_EXHAUSTED", "UNAVAILABLE"}
REQUEST_TIMEOUT_S = 60.0
MAX_TOKENS = 24


def rss_bytes(pid: int) -> int | None:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


class Chaos:
    def __init__(self, opts: BenchOptions, duration: float, seed: int):
        self.opts, self.duration, self.rng = opts, duration, random.Random(seed)
        self.outcomes: Counter = Counter()
        self.reasons: Counter = Counter()
        self.problems: list[str] = []
        self.faults: Counter = Counter()
        self.memory: dict[str, list[tuple[float, int]]] = defaultdict(list)
        self.lock = threading.Lock()
        self.stop = threading.Event()

    # -- the cluster ------------------------------------------------------------------------
    def roles(self, cluster) -> dict[str, str]:
        roles = {a: "prefill" for a in cluster.prefill_addrs}
        roles.update({a: "decode" for a in cluster.decode_addrs})
        return roles

    def restart(self, cluster, address: str) -> None:
        """Start a killed worker again with the command line LocalCluster gave it."""
        from baton.up import wait_serving

        role = self.roles(cluster)[address]
        index = (cluster.prefill_addrs + cluster.decode_addrs).index(address)
        args = [role, "--host", "127.0.0.1", "--port", address.split(":")[1], "--model", cluster.model]
        if role == "decode":
            args += ["--max-rows", str(cluster.max_rows)]
        args += [*cluster.worker_args[index], *(cluster.prefill_args if role == "prefill" else cluster.decode_args)]
        proc = cluster._spawn(*args)
        cluster.procs = [(a, proc if a == address else p) for a, p in cluster.procs]
        wait_serving(address, proc, 120)

    # -- load -------------------------------------------------------------------------------
    def record(self, outcome: str, reason: str = "") -> None:
        with self.lock:
            self.outcomes[outcome] += 1
            if reason:
                self.reasons[f"{outcome}: {reason}"] += 1

    def classify_error(self, exc, what: str) -> None:
        code = getattr(exc, "code", "ERROR")
        if code in REFUSED:
            self.record("refused", code)
        elif code == "DEADLINE_EXCEEDED":
            self.record("hung", what)
            self.problems.append(f"{what}: hung ({exc})")
        else:
            self.record("lost", f"{code}")
            self.problems.append(f"{what}: lost ({exc})")

    def check(self, prompt, tokens, expected, what: str) -> None:
        if tokens == expected[:len(tokens)] and len(tokens) == MAX_TOKENS:
            self.record("exact")
        else:
            self.record("wrong", what)
            self.problems.append(f"{what}: wrong tokens for prompt {prompt[:6]}...: {tokens[:8]} vs {expected[:8]}")

    def client_loop(self, address: str, prompts, expected, seed: int) -> None:
        from baton.client import BatonClient, BatonError

        rng = random.Random(seed)
        with BatonClient(address, timeout=REQUEST_TIMEOUT_S) as client:
            while not self.stop.is_set():
                kind = rng.random()
                i = rng.randrange(len(prompts))
                sampling = {"max_tokens": MAX_TOKENS, "ignore_eos": True}
                try:
                    if kind < 0.45:
                        tokens = []
                        for chunk in client.stream(token_ids=prompts[i], **sampling):
                            tokens.extend(chunk.token_ids)
                        self.check(prompts[i], tokens, expected[i], "stream")
                    elif kind < 0.6:  # a client that leaves midway: its row and KV must be freed
                        with client.stream(token_ids=prompts[i], **sampling) as stream:
                            for n, _ in enumerate(stream):
                                if n >= 2:
                                    break
                        self.record("cancelled")
                    elif kind < 0.85:
                        result = client.generate(token_ids=prompts[i], **sampling)
                        self.check(prompts[i], result.token_ids, expected[i], "generate")
                    else:
                        picks = [rng.randrange(len(prompts)) for _ in range(5)]
                        outcome = client.generate_batch([{"token_ids": prompts[j], **sampling} for j in picks])
                        for j, item in zip(picks, outcome.results):
                            if isinstance(item, BatonError):
                                self.classify_error(item, "batch member")
                            else:
                                self.check(prompts[j], item.token_ids, expected[j], "batch member")
                except BatonError as exc:
                    self.classify_error(exc, "request")
                except Exception as exc:  # noqa: BLE001 - anything else is a lost request
                    self.record("lost", type(exc).__name__)
                    self.problems.append(f"request: {type(exc).__name__}: {exc}")

    # -- faults -----------------------------------------------------------------------------
    def slow_pushes(self, cluster, kv_shape) -> None:
        """Two pushes trickling 64 KiB every 0.9 s into one decode worker, with the cluster token."""
        import grpc
        import torch

        from baton.engine.kv import SequenceKV
        from baton.kvtransfer import encode
        from baton.server import channel
        from baton.v1 import common_pb2, kvtransfer_pb2_grpc, workers_pb2, workers_pb2_grpc

        target = self.rng.choice(cluster.decode_addrs)
        tokens = 1000
        kv = SequenceKV(torch.zeros(kv_shape.num_layers, 2, kv_shape.num_kv_heads, tokens, kv_shape.head_dim,
                                    dtype=kv_shape.dtype))
        with channel(target, cluster_token=cluster.cluster_token) as ch:
            decode = workers_pb2_grpc.DecodeWorkerStub(ch)
            fingerprint = decode.GetLoad(common_pb2.LoadRequest(), timeout=5).model_fingerprint
            calls = []
            for n in range(2):
                rid = f"chaos-flood-{time.monotonic_ns()}-{n}"
                call = decode.Decode(workers_pb2.DecodeRequest(
                    request_id=rid, prompt_token_ids=list(range(1, tokens + 1)), push_token=rid,
                    sampling=common_pb2.SamplingParams(max_tokens=1)), timeout=30)
                next(call)
                calls.append((rid, call))

            def trickle(rid: str) -> None:
                def chunks():
                    for k, chunk in enumerate(encode(rid, fingerprint, kv, chunk_bytes=64 << 10, push_token=rid)):
                        if k > 1:
                            time.sleep(0.9)
                        yield chunk
                try:
                    kvtransfer_pb2_grpc.KVTransferStub(ch).Push(chunks(), timeout=30)
                    self.problems.append("a trickling push was not cut")
                except grpc.RpcError:
                    pass

            pushers = [threading.Thread(target=trickle, args=(rid,)) for rid, _ in calls]
            for t in pushers:
                t.start()
            for t in pushers:
                t.join(timeout=40)
            for _, call in calls:
                call.cancel()

    def fault_loop(self, cluster, kv_shape, every_s: float) -> None:
        while not self.stop.wait(every_s):
            fault = self.rng.choice(["kill", "stop", "slow-push"])
            address = self.rng.choice(cluster.prefill_addrs + cluster.decode_addrs)
            proc = dict(cluster.procs)[address]
            try:
                if fault == "kill":
                    proc.send_signal(signal.SIGKILL)
                    proc.wait()
                    self.opts.progress(f"killed {address}; restarting it")
                    self.restart(cluster, address)
                elif fault == "stop":
                    proc.send_signal(signal.SIGSTOP)
                    self.opts.progress(f"stopped {address} for 3 s")
                    time.sleep(3)
                    proc.send_signal(signal.SIGCONT)
                else:
                    self.opts.progress("slow KV pushes into a decode worker")
                    self.slow_pushes(cluster, kv_shape)
                self.faults[fault] += 1
            except Exception as exc:  # noqa: BLE001 - a fault that could not be applied is reported
                self.problems.append(f"fault {fault} on {address} failed: {type(exc).__name__}: {exc}")

    def memory_loop(self, cluster, start: float) -> None:
        while not self.stop.wait(2.0):
            roles = self.roles(cluster)
            totals: Counter = Counter()
            for address, proc in cluster.procs:
                rss = rss_bytes(proc.pid)
                if rss is not None:
                    totals[roles.get(address, "router")] += rss
            for role, rss in totals.items():
                self.memory[role].append((time.monotonic() - start, rss))


def run(opts: BenchOptions) -> dict[str, Any]:
    import torch

    from baton.engine.model import load_model
    from baton.up import LocalCluster

    duration = float(opts.extra.get("duration") or (40 if opts.quick else 300))
    seed = int(opts.extra.get("seed") or 7)
    model = "tiny-random" if opts.model == "default" else opts.model
    rng = random.Random(seed)
    reference = load_model(model)
    reference.model.set_attn_implementation("sdpa")
    prompts = [[rng.randrange(10, 4000) for _ in range(rng.randrange(4, 40))] for _ in range(24)]
    expected = []
    with torch.no_grad():
        for prompt in prompts:
            out = reference.model.generate(torch.tensor([prompt]), max_new_tokens=MAX_TOKENS, do_sample=False,
                                           pad_token_id=reference.model.generation_config.pad_token_id)
            expected.append(out[0, len(prompt):].tolist())
    chaos = Chaos(opts, duration, seed)
    clients = 3 if opts.quick else 4
    opts.progress(f"{duration:.0f} s of load from {clients} clients with a fault every "
                  f"{8 if opts.quick else 15} s ({model})")
    with LocalCluster(prefill=2, decode=2, model=model, max_rows=4, extra_env=opts.worker_env()) as cluster:
        start = time.monotonic()
        threads = [threading.Thread(target=chaos.client_loop, args=(cluster.router_address, prompts, expected, seed + k))
                   for k in range(clients)]
        threads.append(threading.Thread(target=chaos.fault_loop, args=(cluster, reference.kv_shape,
                                                                       8.0 if opts.quick else 15.0)))
        threads.append(threading.Thread(target=chaos.memory_loop, args=(cluster, start)))
        for t in threads:
            t.start()
        time.sleep(duration)
        chaos.stop.set()
        for t in threads:
            t.join(timeout=REQUEST_TIMEOUT_S + 60)
        stuck = sum(t.is_alive() for t in threads)
        if stuck:
            chaos.outcomes["hung"] += stuck
            chaos.problems.append(f"{stuck} load threads did not finish")
        for _, proc in cluster.procs:  # nothing left stopped for the shutdown
            if proc.poll() is None:
                proc.send_signal(signal.SIGCONT)
        elapsed = time.monotonic() - start

    total = sum(chaos.outcomes.values())
    opts.say(f"\nChaos run: {elapsed:.0f} s, {clients} clients, faults {dict(chaos.faults)}, seed {seed}")
    opts.say(table(["outcome", "requests", "share"],
                   [[k, chaos.outcomes.get(k, 0), f"{100 * chaos.outcomes.get(k, 0) / max(total, 1):.1f}%"]
                    for k in ("exact", "wrong", "refused", "cancelled", "lost", "hung")]))
    if chaos.reasons:
        opts.say("reasons: " + ", ".join(f"{k} x{v}" for k, v in sorted(chaos.reasons.items())))
    memory_rows = []
    for role, samples in sorted(chaos.memory.items()):
        mib = [rss / (1 << 20) for _, rss in samples]
        memory_rows.append([role, f"{mib[0]:.0f}", f"{mib[-1]:.0f}", f"{max(mib):.0f}"])
    opts.say(table(["role (all processes)", "RSS start MiB", "RSS end MiB", "RSS max MiB"], memory_rows))
    for problem in chaos.problems[:20]:
        opts.say(f"  problem: {problem}")
    return {"duration_s": elapsed, "seed": seed, "model": model, "clients": clients,
            "outcomes": dict(chaos.outcomes), "reasons": dict(chaos.reasons), "faults": dict(chaos.faults),
            "memory": {role: samples for role, samples in chaos.memory.items()},
            "problems": {str(i): p for i, p in enumerate(chaos.problems)} if chaos.problems else {}}


def add_arguments(parser) -> None:
    parser.add_argument("--duration", type=float, default=None, help="seconds of load (default 300; --quick: 40)")
    parser.add_argument("--seed", type=int, default=None, help="seeds the prompts, the load and the faults (default 7)")

