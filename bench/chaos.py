"""chaos: sustained mixed load while workers are killed, stopped, restarted, cut off and pushed at slowly.

A real cluster (two prefill and two decode workers; the tiny random model unless `--model`
says otherwise, so every answer can be checked against `transformers` greedy decoding in this
process). Client threads
send streams (some closed early on purpose), single generates, GenerateBatches of 5-10
prompts and conversations (each turn sends the previous turn's prompt, its answer and a new
message: the decode worker holding the conversation prefills the turn itself) for `--duration`
seconds, all greedy with a fixed length, while this process, on a
seeded schedule, applies one fault at a time:
- kill: SIGKILL a worker and start it again on the same port (the router's static discovery
  takes it back once it serves);
- stop: SIGSTOP a worker for 2-5 s, then SIGCONT it (alive but silent: a hung peer);
- cut: destroy every TCP connection to and from a worker's port (`ss -K`) a few times over two
  seconds: the router's channels to it and the KV pushes in flight, with the process left up;
- slow-push: from inside the cluster (holding the cluster token), register Decode calls on a
  decode worker and push their KV at 64 KiB every 0.5 s, far below the receiver's minimum rate;
- drain: SIGTERM a worker (a rollout's), which must exit 0 within its bound: a prefill worker
  finishes its queue, a decode worker moves its rows with their KV to the other and drops its
  retained conversations (with events); then it starts again on the same port.
Every request ends in one class: exact (the greedy tokens), wrong (other tokens), refused with a
reason (RESOURCE_EXHAUSTED, UNAVAILABLE, ABORTED: the client is told why and may retry),
cancelled by its own client, lost (a stream ended without a finish, an INTERNAL/UNKNOWN/... error,
a batch member with no answer) or hung (no answer within its deadline plus a margin). The RSS of
every process is sampled through the run, and once the load has stopped every worker must come
back to idle: no rows, queued prompts, staged or parked KV left behind. The goal: 0 wrong, 0 lost,
0 hung, nothing left behind, memory flat.

Here: the run (its threads, clock and record, the fault schedule, the idle check). The requests
and their judging are bench/chaos_load.py, the faults bench/chaos_faults.py, the tables, memory
figures and plot bench/chaos_report.py.
"""
from __future__ import annotations

import itertools
import random
import signal
import threading
import time
from pathlib import Path
from typing import Any

from baton.bench.chaos_faults import FAULTS, Fault, apply_fault
from baton.bench.chaos_load import (HUNG_MARGIN_S, PROMPTS, REQUEST_TIMEOUT_S, Tally, judge_error, one_call,
                                    references)
from baton.bench.chaos_report import report
from baton.bench.common import BenchOptions

SAMPLE_EVERY_S = 2.0
IDLE_WITHIN_S = 15.0  # once the load has stopped, every worker must be idle within this long
DECODE_IDLE = ("rows_in_use", "waiting_for_kv", "staged", "staged_bytes", "parked_bytes")
PREFILL_IDLE = ("queued", "queued_tokens")


def add_arguments(parser) -> None:
    # The tiny random model unless --model says otherwise: its greedy references cost nothing.
    parser.set_defaults(model="tiny-random")
    parser.add_argument("--duration", type=float, default=None, help="seconds of load (default 300; --quick: 25)")
    parser.add_argument("--seed", type=int, default=None,
                        help="seeds the prompts, the load and the fault schedule (default 7)")
    parser.add_argument("--clients", type=int, default=None, help="client threads (default 4; --quick: 3)")
    parser.add_argument("--fault-every", type=float, default=None,
                        help="mean seconds between the end of one fault and the next (default 12; --quick: 5)")
    parser.add_argument("--faults", default=None,
                        help=f"comma-separated kinds to apply (default all: {','.join(FAULTS)})")
    parser.add_argument("--decode-kv-tokens", type=int, default=None,
                        help="each decode worker's KV in tokens (default: the worker's own default); a few pages "
                             "keep rows parking into the host pool and resuming all through the run")


def rss_bytes(pid: int) -> int | None:
    """VmRSS of a process from /proc (no psutil needed); None once it is gone."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


class Chaos:
    """The run's clock and record (every request's outcome, the faults, the memory samples, the
    problems), and the loops of the threads that fill it."""

    def __init__(self, opts: BenchOptions, cluster, prompts: list[list[int]], expected: list[list[int]], seed: int,
                 conversations=(), kinds: tuple[str, ...] = FAULTS):
        self.opts, self.cluster, self.prompts, self.expected = opts, cluster, prompts, expected
        self.conversations = list(conversations)
        self.rng = random.Random(seed)
        self.seed = seed
        self.kinds = kinds  # the fault kinds applied, in shuffled rounds
        self.tally = Tally()
        self.faults: list[Fault] = []
        self.problems: list[str] = []
        self.preemptions: dict[str, int] = {}  # decode worker -> rows that left their pages, at the idle check
        self.memory: list[tuple[float, str, str, int, int]] = []  # (t, role, address, pid, rss bytes)
        self.lock = threading.Lock()
        self.stop = threading.Event()
        self.inflight: dict[int, tuple[str, float]] = {}
        self.tickets = itertools.count()
        self.kv_shape = None  # the model's KVShape, for the slow pushes
        self.t0 = time.monotonic()

    def now(self) -> float:
        return time.monotonic() - self.t0

    # ------------------------------------------------------------------------------ outcomes

    def begin(self, kind: str) -> int:
        ticket = next(self.tickets)
        with self.lock:
            self.inflight[ticket] = (kind, self.now())
        return ticket

    def finish(self, ticket: int, results: list[tuple[str, str, str, str]]) -> None:
        """results: (kind, outcome, reason, detail) of the call's requests (a batch has several)."""
        end = self.now()
        with self.lock:
            entry = self.inflight.pop(ticket, None)
            if entry is None:  # already counted as hung when the run ended without it
                return
            start = entry[1]
            late = end - start > REQUEST_TIMEOUT_S + HUNG_MARGIN_S
            for kind, outcome, reason, detail in results:
                if late and outcome != "hung":
                    detail = f"answered ({outcome}) only after {end - start:.0f} s: {detail}"
                    outcome, reason = "hung", "past its deadline"
                self._count(kind, outcome, reason, detail, start, end)

    def _count(self, kind: str, outcome: str, reason: str, detail: str, start: float, end: float) -> None:
        self.tally.by_kind[kind][outcome] += 1
        self.tally.spans.append((start, end, outcome))
        if reason:
            self.tally.reasons[f"{outcome} {kind}: {reason}"] += 1
        if outcome in ("wrong", "lost", "hung"):
            self.tally.notable.append({"kind": kind, "outcome": outcome, "reason": reason, "detail": detail[:400],
                                       "start_s": round(start, 2), "end_s": round(end, 2),
                                       "faults_meanwhile": self.faults_during(start, end)})

    def faults_during(self, start: float, end: float) -> list[str]:
        return [f"{f.kind} {f.role} {f.target} at {f.start:.1f}s" for f in list(self.faults)
                if f.applied and f.start <= end and (f.end or self.now()) + 1.0 >= start]

    # ------------------------------------------------------------------------------ the load

    def client_loop(self, k: int) -> None:
        from baton.client import BatonClient

        rng = random.Random(self.seed * 1000 + k)
        with BatonClient(self.cluster.router_address, timeout=REQUEST_TIMEOUT_S) as client:
            while not self.stop.is_set():
                draw = rng.random()
                kind = "stream" if draw < 0.35 else "stream-cancel" if draw < 0.5 else \
                    "generate" if draw < 0.7 else "batch" if draw < 0.85 or not self.conversations else "conversation"
                ticket = self.begin(kind)
                results: list[tuple[str, str, str, str]] = []
                try:
                    results = one_call(client, kind, rng, self.prompts, self.expected, self.conversations)
                except Exception as exc:  # noqa: BLE001 - every failure is classified, none stops the load
                    outcome, reason, detail = judge_error(exc)
                    results = [({"batch": "batch member", "conversation": "conversation turn"}.get(kind, kind),
                                outcome, reason, detail)]
                finally:
                    self.finish(ticket, results)

    # ------------------------------------------------------------------------------ faults

    def fault_loop(self, until: float, every_s: float) -> None:
        """Runs on the main thread: a restarted worker must be a child of the thread that lives
        as long as the cluster (baton.lifeline.die_with_parent ties its death signal to that thread)."""
        order: list[str] = []
        while True:
            pause = self.rng.uniform(0.5, 1.5) * every_s
            if self.now() + pause >= until:
                return
            time.sleep(pause)
            if not order:
                order = list(self.kinds)
                self.rng.shuffle(order)
            kind = order.pop()
            workers = self.cluster.decode_addrs if kind == "slow-push" else \
                self.cluster.prefill_addrs + self.cluster.decode_addrs
            fault = Fault(kind, self.rng.choice(workers), "", self.now())
            fault.role = self.cluster.role_of(fault.target)
            self.faults.append(fault)
            self.opts.progress(f"{fault.start:5.1f}s {kind} {fault.role} {fault.target}")
            try:
                fault.detail = apply_fault(fault, self.cluster, self.rng, self.kv_shape, self.problems)
            except Exception as exc:  # noqa: BLE001 - a fault that could not be applied is a failed run
                fault.detail = f"failed: {type(exc).__name__}: {exc}"
                self.problems.append(f"failed: {kind} on {fault.target}: {type(exc).__name__}: {exc}")
            fault.end = self.now()
            if fault.detail:
                self.opts.progress(f"{fault.end:5.1f}s   {fault.detail}")

    # ------------------------------------------------------------------------------ idle

    def idle_check(self) -> dict[str, dict[str, int]]:
        """Every worker's load once the load has stopped: what is still held after IDLE_WITHIN_S
        (rows, queued prompts, staged or parked KV) was left behind by some request."""
        from baton.server import channel
        from baton.v1 import common_pb2, workers_pb2_grpc

        deadline = time.monotonic() + IDLE_WITHIN_S
        while True:
            held: dict[str, dict[str, int]] = {}
            for address in self.cluster.prefill_addrs + self.cluster.decode_addrs:
                role = self.cluster.role_of(address)
                with channel(address, self.cluster.tls, cluster_token=self.cluster.cluster_token) as ch:
                    stub = (workers_pb2_grpc.DecodeWorkerStub if role == "decode" else
                            workers_pb2_grpc.PrefillWorkerStub)(ch)
                    try:
                        load = stub.GetLoad(common_pb2.LoadRequest(), timeout=5)
                    except Exception as exc:  # noqa: BLE001 - a worker that cannot say is reported
                        held[address] = {"unreachable": 1}
                        self.opts.progress(f"idle check: {address}: {type(exc).__name__}")
                        continue
                fields = DECODE_IDLE if role == "decode" else PREFILL_IDLE
                left = {f: int(getattr(load, f)) for f in fields if getattr(load, f)}
                if role == "decode":
                    self.preemptions[address] = int(load.preemptions)
                if left:
                    held[address] = left
            if not held or time.monotonic() > deadline:
                break
            time.sleep(1.0)
        for address, left in held.items():
            self.problems.append(f"failed: {self.cluster.role_of(address)} {address} still holds {left} "
                                 f"{IDLE_WITHIN_S:.0f} s after the load ended")
        return held

    # ------------------------------------------------------------------------------ memory

    def memory_loop(self) -> None:
        while True:
            t = self.now()
            for address, proc in list(self.cluster.procs):
                rss = rss_bytes(proc.pid)
                if rss is not None and proc.poll() is None:
                    self.memory.append((t, self.cluster.role_of(address), address, proc.pid, rss))
            if self.stop.wait(SAMPLE_EVERY_S):
                return


def run(opts: BenchOptions) -> dict[str, Any]:
    from baton.launch.up import LocalCluster

    duration = float(opts.extra.get("duration") or (25 if opts.quick else 300))
    seed = 7 if opts.extra.get("seed") is None else int(opts.extra["seed"])
    clients = int(opts.extra.get("clients") or (3 if opts.quick else 4))
    every = float(opts.extra.get("fault_every") or (5 if opts.quick else 12))
    model = opts.model  # tiny-random unless --model default (SmolLM2-135M) or a directory is given
    kv_tokens = opts.extra.get("decode_kv_tokens")
    kinds = tuple(k.strip() for k in (opts.extra.get("faults") or ",".join(FAULTS)).split(",") if k.strip())
    if not kinds or set(kinds) - set(FAULTS):
        raise SystemExit(f"chaos: --faults takes some of {', '.join(FAULTS)} (got {opts.extra.get('faults')!r})")
    opts.progress(f"chaos: greedy references for {PROMPTS} seeded prompts and conversations ({model})")
    loaded, prompts, expected, conversations = references(model, opts.dtype, seed,
                                                          int(kv_tokens) - 8 if kv_tokens else None)

    opts.progress(f"chaos: starting 2 prefill + 2 decode workers and a router ({model})")
    env = opts.worker_env()
    if kv_tokens:
        env["BATON_DECODE_KV_BUDGET_BYTES"] = str(int(kv_tokens) * loaded.kv_shape.bytes_per_token())
    with LocalCluster(prefill=2, decode=2, model=model, max_rows=4, extra_env=env) as cluster:
        chaos = Chaos(opts, cluster, prompts, expected, seed, conversations, kinds)
        chaos.kv_shape = loaded.kv_shape
        opts.progress(f"chaos: {duration:.0f} s of load from {clients} clients, a fault every ~{every:.0f} s")
        memory = threading.Thread(target=chaos.memory_loop, daemon=True)
        memory.start()
        loaders = [threading.Thread(target=chaos.client_loop, args=(k,), daemon=True) for k in range(clients)]
        for t in loaders:
            t.start()
        chaos.fault_loop(until=duration - 2.0, every_s=every)
        chaos.stop.wait(max(0.0, duration - chaos.now()))
        chaos.stop.set()
        load_ended = chaos.now()
        limit = time.monotonic() + REQUEST_TIMEOUT_S + HUNG_MARGIN_S
        for t in loaders:
            t.join(timeout=max(0.0, limit - time.monotonic()))
        with chaos.lock:  # what is still open now has outlived its deadline and the margin
            for ticket, (kind, start) in list(chaos.inflight.items()):
                chaos.inflight.pop(ticket)
                chaos._count({"batch": "batch member", "conversation": "conversation turn"}.get(kind, kind), "hung",
                             "never answered",
                             f"still open {chaos.now() - start:.0f} s after it was sent", start, chaos.now())
        memory.join(timeout=10)
        for _, proc in cluster.procs:  # nothing left stopped for the shutdown
            if proc.poll() is None:
                proc.send_signal(signal.SIGCONT)
        left_behind = chaos.idle_check()
        elapsed = chaos.now()
        routing = {}
        try:
            from baton.client import BatonClient

            with BatonClient(cluster.router_address, timeout=10) as client:
                routing = client.cluster_status().routing
        except Exception as exc:  # noqa: BLE001 - the report says it could not be read
            chaos.problems.append(f"the router's routing figures could not be read: {exc}")
    return report(opts, chaos, duration=load_ended, elapsed=elapsed, seed=seed, model=model, clients=clients,
                  every=every, left_behind=left_behind, decode_kv_tokens=kv_tokens, routing=routing,
                  decode_preemptions=dict(chaos.preemptions))
