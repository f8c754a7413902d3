"""chaos: sustained mixed load while workers are killed, stopped, restarted, cut off and pushed at slowly.

A real cluster (two prefill and two decode workers; the tiny random model unless `--model`
says otherwise, so every answer can be checked against `transformers` greedy decoding in this
process). Client threads
send streams (some closed early on purpose), single generates and GenerateBatches of 5-10
prompts for `--duration` seconds, all greedy with a fixed length, while this process, on a
seeded schedule, applies one fault at a time:
- kill: SIGKILL a worker and start it again on the same port (the router's static discovery
  takes it back once it serves);
- stop: SIGSTOP a worker for 2-5 s, then SIGCONT it (alive but silent: a hung peer);
- cut: destroy every TCP connection to and from a worker's port (`ss -K`) a few times over two
  seconds: the router's channels to it and the KV pushes in flight, with the process left up;
- slow-push: from inside the cluster (holding the cluster token), register Decode calls on a
  decode worker and push their KV at 64 KiB every 0.5 s, far below the receiver's minimum rate.
Every request ends in one class: exact (the greedy tokens), wrong (other tokens), refused with a
reason (RESOURCE_EXHAUSTED, UNAVAILABLE, ABORTED: the client is told why and may retry),
cancelled by its own client, lost (a stream ended without a finish, an INTERNAL/UNKNOWN/... error,
a batch member with no answer) or hung (no answer within its deadline plus a margin). The RSS of
every process is sampled through the run, and once the load has stopped every worker must come
back to idle: no rows, queued prompts, staged or parked KV left behind. The goal: 0 wrong, 0 lost,
0 hung, nothing left behind, memory flat.
"""
from __future__ import annotations

import itertools
import random
import shutil
import signal
import subprocess
import threading
import time
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from baton.bench.common import BenchOptions, table

OUTCOMES = ("exact", "wrong", "refused", "cancelled", "lost", "hung")
KINDS = ("stream", "stream-cancel", "generate", "batch member")
FAULTS = ("kill", "stop", "cut", "slow-push")
REFUSED = {"RESOURCE_EXHAUSTED", "UNAVAILABLE", "ABORTED"}  # a status that says why and invites a retry
HUNG = {"DEADLINE_EXCEEDED"}  # the call ran out its whole deadline
REQUEST_TIMEOUT_S = 60.0  # every call's deadline (a whole GenerateBatch's included)
HUNG_MARGIN_S = 15.0  # a call still open this long after its deadline is hung whatever it returns later
MAX_TOKENS = 24
PROMPTS = 32
SAMPLE_EVERY_S = 2.0
RESTART_TIMEOUT_S = 180.0
WARM_UP_S = 60.0  # a process's memory is compared from this long after its first sample (start-up churn settles)
LONG_LIFE_S = 120.0  # a slope is fitted only over lives at least this long
IDLE_WITHIN_S = 15.0  # once the load has stopped, every worker must be idle within this long
DECODE_IDLE = ("rows_in_use", "waiting_for_kv", "staged", "staged_bytes", "parked_bytes")
PREFILL_IDLE = ("queued", "queued_tokens")
PUSH_CUTS = {"ABORTED", "CANCELLED"}  # cut by the receiver: too slow (ABORTED) or silent for 1 s (CANCELLED)


def add_arguments(parser) -> None:
    # The tiny random model unless --model says otherwise: its greedy references cost nothing.
    parser.set_defaults(model="tiny-random")
    parser.add_argument("--duration", type=float, default=None, help="seconds of load (default 300; --quick: 25)")
    parser.add_argument("--seed", type=int, default=None,
                        help="seeds the prompts, the load and the fault schedule (default 7)")
    parser.add_argument("--clients", type=int, default=None, help="client threads (default 4; --quick: 3)")
    parser.add_argument("--fault-every", type=float, default=None,
                        help="mean seconds between the end of one fault and the next (default 12; --quick: 5)")
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


def slope_per_minute(samples: list[tuple[float, float]]) -> float | None:
    """Least-squares slope of (seconds, value) samples, per minute; None under three samples."""
    if len(samples) < 3:
        return None
    n = len(samples)
    mt = sum(t for t, _ in samples) / n
    mv = sum(v for _, v in samples) / n
    var = sum((t - mt) ** 2 for t, _ in samples)
    if var == 0:
        return None
    return 60.0 * sum((t - mt) * (v - mv) for t, v in samples) / var


@dataclass
class Fault:
    kind: str
    target: str
    role: str
    start: float
    end: float = 0.0
    detail: str = ""
    applied: bool = True

    def as_dict(self) -> dict[str, Any]:
        return {"kind": self.kind, "target": self.target, "role": self.role, "start_s": round(self.start, 2),
                "end_s": round(self.end, 2), "detail": self.detail, "applied": self.applied}


@dataclass
class Tally:
    """Every request's outcome, with the details of the ones that were not exact."""

    by_kind: dict[str, Counter] = field(default_factory=lambda: defaultdict(Counter))
    reasons: Counter = field(default_factory=Counter)
    spans: list[tuple[float, float, str]] = field(default_factory=list)  # (start, end, outcome) of each
    notable: list[dict[str, Any]] = field(default_factory=list)  # wrong, lost and hung, in full

    def totals(self) -> Counter:
        total: Counter = Counter()
        for counts in self.by_kind.values():
            total.update(counts)
        return total


class Chaos:
    def __init__(self, opts: BenchOptions, cluster, prompts: list[list[int]], expected: list[list[int]], seed: int):
        self.opts, self.cluster, self.prompts, self.expected = opts, cluster, prompts, expected
        self.rng = random.Random(seed)
        self.seed = seed
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

    def role_of(self, address: str) -> str:
        if address in self.cluster.prefill_addrs:
            return "prefill"
        if address in self.cluster.decode_addrs:
            return "decode"
        return "router"

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

    def judge_tokens(self, i: int, tokens: list[int], finish_reason: str | None) -> tuple[str, str, str]:
        if finish_reason == "abort":
            return "lost", "finish_reason abort", f"prompt {i}: aborted after {len(tokens)} tokens"
        if tokens == self.expected[i]:
            return "exact", "", ""
        k = next((n for n, (a, b) in enumerate(zip(tokens, self.expected[i])) if a != b),
                 min(len(tokens), len(self.expected[i])))
        return ("wrong", f"differs at token {k}",
                f"prompt {i}: {len(tokens)} tokens (finish {finish_reason}), first difference at {k}: "
                f"got {tokens[k:k + 4]}, greedy {self.expected[i][k:k + 4]}")

    @staticmethod
    def judge_error(exc: BaseException) -> tuple[str, str, str]:
        code = getattr(exc, "code", None)
        if not isinstance(code, str):
            return "lost", type(exc).__name__, f"{type(exc).__name__}: {exc}"
        message = str(getattr(exc, "message", "") or "")
        if code in REFUSED:
            return "refused", f"{code}: {_short(message)}", ""
        if code in HUNG:
            return "hung", code, str(exc)
        return "lost", f"{code}: {_short(message)}", str(exc)

    # ------------------------------------------------------------------------------ the load

    def client_loop(self, k: int) -> None:
        from baton.client import BatonClient

        rng = random.Random(self.seed * 1000 + k)
        with BatonClient(self.cluster.router_address, timeout=REQUEST_TIMEOUT_S) as client:
            while not self.stop.is_set():
                draw = rng.random()
                kind = "stream" if draw < 0.4 else "stream-cancel" if draw < 0.55 else \
                    "generate" if draw < 0.85 else "batch"
                ticket = self.begin(kind)
                results: list[tuple[str, str, str, str]] = []
                try:
                    results = self.one_call(client, kind, rng)
                except Exception as exc:  # noqa: BLE001 - every failure is classified, none stops the load
                    outcome, reason, detail = self.judge_error(exc)
                    results = [(kind if kind != "batch" else "batch member", outcome, reason, detail)]
                finally:
                    self.finish(ticket, results)

    def one_call(self, client, kind: str, rng: random.Random) -> list[tuple[str, str, str, str]]:
        from baton.client import BatonError

        sampling = {"max_tokens": MAX_TOKENS, "ignore_eos": True, "temperature": 0.0}
        i = rng.randrange(len(self.prompts))
        if kind == "stream":
            tokens, finish = [], None
            for chunk in client.stream(token_ids=self.prompts[i], **sampling):
                tokens.extend(chunk.token_ids)
                finish = chunk.finish_reason or finish
            return [(kind, *self.judge_tokens(i, tokens, finish))]
        if kind == "stream-cancel":  # a client that leaves midway: its row and KV must be freed
            leave_after = rng.randrange(1, 4)
            tokens, finish = [], None
            with client.stream(token_ids=self.prompts[i], **sampling) as stream:
                for n, chunk in enumerate(stream, start=1):
                    tokens.extend(chunk.token_ids)
                    finish = chunk.finish_reason or finish
                    if n >= leave_after and finish is None:
                        if tokens != self.expected[i][:len(tokens)]:  # what it saw before leaving must be right
                            return [(kind, *self.judge_tokens(i, tokens, finish))]
                        return [(kind, "cancelled", "", "")]
            return [(kind, *self.judge_tokens(i, tokens, finish))]  # finished before it could leave
        if kind == "generate":
            result = client.generate(token_ids=self.prompts[i], **sampling)
            return [(kind, *self.judge_tokens(i, result.token_ids, result.finish_reason))]
        picks = [rng.randrange(len(self.prompts)) for _ in range(rng.randrange(5, 11))]
        outcome = client.generate_batch([{"token_ids": self.prompts[j], **sampling} for j in picks])
        results = []
        for j, item in zip(picks, outcome.results):
            if item is None:
                results.append(("batch member", "lost", "no answer", f"prompt {j}: the batch ended without it"))
            elif isinstance(item, BatonError):
                results.append(("batch member", *self.judge_error(item)))
            else:
                results.append(("batch member", *self.judge_tokens(j, item.token_ids, item.finish_reason)))
        return results

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
                order = list(FAULTS)
                self.rng.shuffle(order)
            kind = order.pop()
            workers = self.cluster.decode_addrs if kind == "slow-push" else \
                self.cluster.prefill_addrs + self.cluster.decode_addrs
            fault = Fault(kind, self.rng.choice(workers), "", self.now())
            fault.role = self.role_of(fault.target)
            self.faults.append(fault)
            self.opts.progress(f"{fault.start:5.1f}s {kind} {fault.role} {fault.target}")
            try:
                fault.detail = getattr(self, "_" + kind.replace("-", "_"))(fault)
            except Exception as exc:  # noqa: BLE001 - a fault that could not be applied is a failed run
                fault.detail = f"failed: {type(exc).__name__}: {exc}"
                self.problems.append(f"failed: {kind} on {fault.target}: {type(exc).__name__}: {exc}")
            fault.end = self.now()
            if fault.detail:
                self.opts.progress(f"{fault.end:5.1f}s   {fault.detail}")

    def _proc(self, address: str) -> subprocess.Popen:
        return dict(self.cluster.procs)[address]

    def _kill(self, fault: Fault) -> str:
        killed_at = time.monotonic()
        self.cluster.restart_worker(fault.target, RESTART_TIMEOUT_S)
        return f"restarted, serving again after {time.monotonic() - killed_at:.1f} s"

    def _stop(self, fault: Fault) -> str:
        proc = self._proc(fault.target)
        seconds = self.rng.uniform(2.0, 5.0)
        proc.send_signal(signal.SIGSTOP)
        try:
            time.sleep(seconds)
        finally:
            proc.send_signal(signal.SIGCONT)
        return f"stopped for {seconds:.1f} s"

    def _cut(self, fault: Fault) -> str:
        """Destroy every established TCP connection to or from the worker's port, three times
        over two seconds (gRPC redials at once; the second and third cut those redials too)."""
        ss = shutil.which("ss")
        if ss is None:
            fault.applied = False
            return "skipped: no `ss` on this machine"
        port = fault.target.split(":")[1]
        cut = 0
        for n in range(3):
            if n:
                time.sleep(1.0)
            done = subprocess.run([ss, "-K", "-t", "-n", "state", "established",
                                   f"( sport = :{port} or dport = :{port} )"],
                                  capture_output=True, text=True, timeout=10)
            cut += max(0, len([line for line in done.stdout.splitlines() if line.strip()]) - 1)  # less the header
        if cut == 0:
            fault.applied = False
            return "skipped: `ss -K` destroyed no connection (needs CAP_NET_ADMIN and INET_DIAG_DESTROY)"
        return f"{cut} connections destroyed"

    def _slow_push(self, fault: Fault, pushes: int = 4, tokens: int = 1000) -> str:
        """Register `pushes` Decode calls and trickle their KV at 64 KiB every 0.5 s: each push
        must be cut by the receiver, as too slow (ABORTED) a little after its 2 s grace, or as
        silent (CANCELLED) if this busy process let more than 1 s pass between two chunks."""
        import grpc
        import torch

        from baton.engine.kv import SequenceKV
        from baton.kvtransfer import encode
        from baton.server import channel
        from baton.v1 import common_pb2, kvtransfer_pb2_grpc, workers_pb2, workers_pb2_grpc

        shape = self.kv_shape
        kv = SequenceKV(torch.zeros(shape.num_layers, 2, shape.num_kv_heads, tokens, shape.head_dim,
                                    dtype=shape.dtype))
        ends: dict[str, tuple[str, float]] = {}
        with channel(fault.target, self.cluster.tls, cluster_token=self.cluster.cluster_token) as ch:
            decode = workers_pb2_grpc.DecodeWorkerStub(ch)
            fingerprint = decode.GetLoad(common_pb2.LoadRequest(), timeout=5).model_fingerprint
            calls = []
            try:
                for n in range(pushes):
                    rid = f"chaos-slow-push-{time.monotonic_ns()}-{n}"
                    call = decode.Decode(workers_pb2.DecodeRequest(
                        request_id=rid, prompt_token_ids=list(range(1, tokens + 1)), push_token=rid,
                        sampling=common_pb2.SamplingParams(max_tokens=1)), timeout=30)
                    calls.append((rid, call))
                    next(call)  # registered: the worker now expects its KV

                def trickle(rid: str) -> None:
                    def chunks():
                        for k, chunk in enumerate(encode(rid, fingerprint, kv, chunk_bytes=64 << 10, push_token=rid)):
                            if k > 1:
                                time.sleep(0.5)
                            yield chunk
                    started = time.monotonic()
                    try:
                        kvtransfer_pb2_grpc.KVTransferStub(ch).Push(chunks(), timeout=30)
                        ends[rid] = ("OK", time.monotonic() - started)
                    except grpc.RpcError as err:
                        ends[rid] = (err.code().name, time.monotonic() - started)

                pushers = [threading.Thread(target=trickle, args=(rid,), daemon=True) for rid, _ in calls]
                for t in pushers:
                    t.start()
                for t in pushers:
                    t.join(timeout=40)
            finally:
                for _, call in calls:
                    call.cancel()
        codes = Counter(code for code, _ in ends.values())
        slowest = max((s for _, s in ends.values()), default=0.0)
        if sum(codes[c] for c in PUSH_CUTS) != pushes or slowest > 10.0:
            self.problems.append(f"failed: slow pushes into {fault.target} were not all cut within 10 s: "
                                 f"{dict(codes)}, the last after {slowest:.1f} s")
        return f"{pushes} trickling pushes ended {dict(codes)} within {slowest:.1f} s"

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
                role = self.role_of(address)
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
            self.problems.append(f"failed: {self.role_of(address)} {address} still holds {left} "
                                 f"{IDLE_WITHIN_S:.0f} s after the load ended")
        return held

    # ------------------------------------------------------------------------------ memory

    def memory_loop(self) -> None:
        while True:
            t = self.now()
            for address, proc in list(self.cluster.procs):
                rss = rss_bytes(proc.pid)
                if rss is not None and proc.poll() is None:
                    self.memory.append((t, self.role_of(address), address, proc.pid, rss))
            if self.stop.wait(SAMPLE_EVERY_S):
                return


def _short(text: str, n: int = 90) -> str:
    text = " ".join(text.split())
    return text if len(text) <= n else text[: n - 3] + "..."


# ---------------------------------------------------------------------------------- the run


def references(model: str, dtype: str, seed: int) -> tuple[Any, list[list[int]], list[list[int]]]:
    """Seeded random prompts and their greedy continuations from transformers generate. A prompt
    whose greedy run meets EOS early is dropped (the load sets ignore_eos; generate stops)."""
    import torch

    from baton.engine.model import load_model

    rng = random.Random(seed)
    loaded = load_model(model, dtype=dtype)
    loaded.model.set_attn_implementation("sdpa")
    vocab = loaded.model.config.vocab_size
    prompts, expected = [], []
    with torch.no_grad():
        for _ in range(PROMPTS):
            prompt = [rng.randrange(10, min(vocab, 4000)) for _ in range(rng.randrange(4, 120))]
            out = loaded.model.generate(torch.tensor([prompt]), max_new_tokens=MAX_TOKENS, do_sample=False,
                                        pad_token_id=loaded.model.generation_config.pad_token_id)
            tokens = out[0, len(prompt):].tolist()
            if len(tokens) == MAX_TOKENS:
                prompts.append(prompt)
                expected.append(tokens)
    if not prompts:
        raise RuntimeError("every reference run met EOS early; no prompt to check against")
    return loaded, prompts, expected


def run(opts: BenchOptions) -> dict[str, Any]:
    from baton.launch.up import LocalCluster

    duration = float(opts.extra.get("duration") or (25 if opts.quick else 300))
    seed = 7 if opts.extra.get("seed") is None else int(opts.extra["seed"])
    clients = int(opts.extra.get("clients") or (3 if opts.quick else 4))
    every = float(opts.extra.get("fault_every") or (5 if opts.quick else 12))
    model = opts.model  # tiny-random unless --model default (SmolLM2-135M) or a directory is given
    opts.progress(f"chaos: greedy references for {PROMPTS} seeded prompts ({model})")
    loaded, prompts, expected = references(model, opts.dtype, seed)

    opts.progress(f"chaos: starting 2 prefill + 2 decode workers and a router ({model})")
    env = opts.worker_env()
    kv_tokens = opts.extra.get("decode_kv_tokens")
    if kv_tokens:
        env["BATON_DECODE_KV_BUDGET_BYTES"] = str(int(kv_tokens) * loaded.kv_shape.bytes_per_token())
    with LocalCluster(prefill=2, decode=2, model=model, max_rows=4, extra_env=env) as cluster:
        chaos = Chaos(opts, cluster, prompts, expected, seed)
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
                chaos._count("batch member" if kind == "batch" else kind, "hung", "never answered",
                             f"still open {chaos.now() - start:.0f} s after it was sent", start, chaos.now())
        memory.join(timeout=10)
        for _, proc in cluster.procs:  # nothing left stopped for the shutdown
            if proc.poll() is None:
                proc.send_signal(signal.SIGCONT)
        left_behind = chaos.idle_check()
        elapsed = chaos.now()
    return report(opts, chaos, duration=load_ended, elapsed=elapsed, seed=seed, model=model, clients=clients,
                  every=every, left_behind=left_behind, decode_kv_tokens=kv_tokens,
                  decode_preemptions=dict(chaos.preemptions))


def report(opts: BenchOptions, chaos: Chaos, **run_facts: Any) -> dict[str, Any]:
    tally = chaos.tally
    totals = tally.totals()
    total = sum(totals.values())
    applied = Counter(f.kind for f in chaos.faults if f.applied)
    opts.say(f"\nchaos: {run_facts['duration']:.0f} s of load, {run_facts['clients']} clients, seed "
             f"{run_facts['seed']}, model {run_facts['model']}; {total} requests, faults "
             + ", ".join(f"{applied[k]} {k}" for k in FAULTS))
    if run_facts.get("decode_kv_tokens"):
        opts.say(f"decode KV: {run_facts['decode_kv_tokens']} tokens a worker; rows that left their pages (priority "
                 f"or memory) since each decode worker's last start: {run_facts['decode_preemptions']}")
    kinds = [k for k in KINDS if k in tally.by_kind]
    rows = [[o, *[tally.by_kind[k].get(o, 0) for k in kinds], totals.get(o, 0),
             f"{100 * totals.get(o, 0) / max(total, 1):.1f}%"] for o in OUTCOMES]
    opts.say(table(["outcome", *kinds, "all", "share"], rows))
    if tally.reasons:
        opts.say("\nreasons:")
        for reason, n in sorted(tally.reasons.items(), key=lambda kv: -kv[1]):
            opts.say(f"  {n:6d}  {reason}")

    fault_rows = []
    per_fault: dict[str, Counter] = {}
    for kind in FAULTS:
        windows = [(f.start, f.end + 1.0) for f in chaos.faults if f.kind == kind and f.applied]
        seen: Counter = Counter()
        for start, end, outcome in tally.spans:
            if any(s <= end and start <= e for s, e in windows):
                seen[outcome] += 1
        per_fault[kind] = seen
        fault_rows.append([kind, applied[kind], sum(seen.values()), seen["exact"], seen["refused"],
                           seen["cancelled"], seen["wrong"], seen["lost"], seen["hung"]])
    opts.say()
    opts.say(table(["fault", "applied", "requests in flight", "exact", "refused", "cancelled", "wrong", "lost",
                    "hung"], fault_rows))
    for f in chaos.faults:
        opts.say(f"  {f.start:6.1f}s  {f.kind:<9} {f.role:<7} {f.target:<16} {f.detail}")

    memory = memory_summary(chaos.memory)
    opts.say()
    opts.say(table(["role (its processes)", "RSS start MiB", "RSS end MiB", "RSS max MiB",
                    "slopes of its processes MiB/min"],
                   [[role, m["start_mib"], m["end_mib"], m["max_mib"], _slopes(m["process_slopes_mib_per_min"])]
                    for role, m in memory.items()], digits=1))
    lives = process_lives(chaos.memory)
    if any(x["slope_mib_per_min"] is not None for x in lives):
        opts.say()
        opts.say(table([f"process (lives of {LONG_LIFE_S:.0f} s or more)", "alive s", f"RSS at +{WARM_UP_S:.0f}s MiB",
                        "RSS end MiB", "RSS max MiB", f"slope after +{WARM_UP_S:.0f}s MiB/min"],
                       [[f"{x['role']} {x['address']}", f"{x['from_s']:.0f}-{x['to_s']:.0f}", x["warm_mib"],
                         x["end_mib"], x["max_mib"], f"{x['slope_mib_per_min']:+.2f}"]
                        for x in lives if x["slope_mib_per_min"] is not None], digits=1))
    left = run_facts["left_behind"]
    opts.say("\nonce the load stopped: " + ("; ".join(f"{a} still holds {v}" for a, v in left.items()) if left else
                                          "every worker idle (no rows, queued prompts, staged or parked KV)"))
    for problem in chaos.problems:
        opts.say(f"  problem: {problem}")
    for n in tally.notable[:20]:
        opts.say(f"  {n['outcome']}: {n['kind']} at {n['start_s']:.1f}-{n['end_s']:.1f}s: {n['reason']}; "
                 f"{n['detail']} (faults meanwhile: {'; '.join(n['faults_meanwhile']) or 'none'})")
    if len(tally.notable) > 20:
        opts.say(f"  ... {len(tally.notable) - 20} more in the JSON")

    bad = {o: totals.get(o, 0) for o in ("wrong", "lost", "hung")}
    problems = {str(i): p for i, p in enumerate(chaos.problems)}
    if any(bad.values()):
        problems["goal"] = "failed: " + ", ".join(f"{n} {o}" for o, n in bad.items())
    files = plot_memory(opts, chaos)
    series: dict[str, list[list[float]]] = defaultdict(list)
    for t, role, _, _, rss in chaos.memory:
        if series[role] and series[role][-1][0] == round(t, 2):
            series[role][-1][1] += rss
        else:
            series[role].append([round(t, 2), rss])
    return {**run_facts, "requests": total, "outcomes": {o: totals.get(o, 0) for o in OUTCOMES},
            "by_kind": {k: dict(v) for k, v in tally.by_kind.items()}, "reasons": dict(tally.reasons),
            "faults": dict(applied), "fault_log": [f.as_dict() for f in chaos.faults],
            "outcomes_during_faults": {k: dict(v) for k, v in per_fault.items()},
            "notable": tally.notable, "memory_summary": memory, "memory": dict(series),
            "memory_processes": _per_process(chaos.memory), "memory_lives": lives, "problems": problems,
            "plots": files}


def _per_process(samples) -> dict[str, list[list[float]]]:
    out: dict[str, list[list[float]]] = defaultdict(list)
    for t, role, address, pid, rss in samples:
        out[f"{role} {address} pid {pid}"].append([round(t, 2), round(rss / (1 << 20), 1)])
    return dict(out)


def process_lives(samples) -> list[dict[str, Any]]:
    """Each process's own life (a worker started again is a new life): its span, its RSS once
    warmed up, at its end and at most, and the least-squares slope after the warm-up."""
    lives = []
    for name, life in _per_process(samples).items():
        role, address, _, pid = name.split()
        span = life[-1][0] - life[0][0]
        warm = [(t, v) for t, v in life if t - life[0][0] >= WARM_UP_S]
        lives.append({"role": role, "address": address, "pid": int(pid), "from_s": life[0][0], "to_s": life[-1][0],
                      "warm_mib": warm[0][1] if warm else None, "end_mib": life[-1][1],
                      "max_mib": max(v for _, v in life),
                      "slope_mib_per_min": slope_per_minute(warm) if span >= LONG_LIFE_S else None})
    return sorted(lives, key=lambda x: (x["role"], x["address"], x["from_s"]))


def memory_summary(samples) -> dict[str, dict[str, Any]]:
    """Per role: RSS of its processes together at the first and last sample and the most; and the
    slopes of its long-lived processes over their own lives, after their warm-up (a worker killed
    and started again begins small, so the slope of the sum says little)."""
    by_time: dict[str, dict[float, int]] = defaultdict(lambda: defaultdict(int))
    for t, role, _, _, rss in samples:
        by_time[role][t] += rss
    lives = process_lives(samples)
    out = {}
    for role in sorted(by_time):
        mib = [(t, v / (1 << 20)) for t, v in sorted(by_time[role].items())]
        slopes = sorted(x["slope_mib_per_min"] for x in lives
                        if x["role"] == role and x["slope_mib_per_min"] is not None)
        out[role] = {"start_mib": mib[0][1], "end_mib": mib[-1][1], "max_mib": max(v for _, v in mib),
                     "process_slopes_mib_per_min": slopes, "samples": len(mib)}
    return out


def _slopes(values: list[float]) -> str:
    if not values:
        return "-"
    lo, hi = min(values), max(values)
    return f"{lo:+.2f}" if len(values) == 1 else f"{lo:+.2f}..{hi:+.2f}"


def plot_memory(opts: BenchOptions, chaos: Chaos) -> list[str]:
    if not chaos.memory:
        return []
    try:
        from baton.bench import plots
    except ImportError:  # matplotlib missing: the table and JSON still say it all
        return []
    plt = plots.plt
    fig, ax = plt.subplots(figsize=(10, 4.5))
    colors = {"router": "tab:gray", "prefill": "tab:blue", "decode": "tab:green"}
    for name, life in sorted(_per_process(chaos.memory).items()):
        role = name.split()[0]
        ax.plot([t for t, _ in life], [v for _, v in life], color=colors.get(role), linewidth=1,
                label=role if not any(line.get_label() == role for line in ax.get_lines()) else None)
    marks = {"kill": "tab:red", "stop": "tab:orange", "cut": "tab:purple", "slow-push": "tab:brown"}
    for kind, color in marks.items():
        for n, f in enumerate(f for f in chaos.faults if f.kind == kind and f.applied):
            ax.axvspan(f.start, max(f.end, f.start + 0.5), color=color, alpha=0.15, label=kind if n == 0 else None)
    ax.set_xlabel("seconds into the run")
    ax.set_ylabel("RSS per process (MiB)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8, loc="upper right", ncol=2)
    ax.set_title("chaos: memory of every Baton process under load and faults")
    return [str(plots._save(fig, opts.plot_path("chaos_memory.png")))]
