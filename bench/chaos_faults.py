"""The faults the chaos suite applies to a live cluster's workers, one at a time (what each does
and why is in bench/chaos.py): kill and restart, SIGSTOP for a while, cut its TCP connections,
push KV into it too slowly, drain it (SIGTERM) and start it again. Each says in a line what it did; a fault that could not act here
(no `ss`, no right to destroy sockets) marks itself not applied."""
from __future__ import annotations

import random
import shutil
import signal
import subprocess
import threading
import time
from collections import Counter
from dataclasses import dataclass
from typing import Any

FAULTS = ("kill", "stop", "cut", "slow-push", "drain")
RESTART_TIMEOUT_S = 180.0
# a drained worker exits within its drain (20 s) and the stops' bound (lifeline.STOP_S, 40 s)
DRAIN_EXIT_S = 90.0
PUSH_CUTS = {"ABORTED", "CANCELLED"}  # cut by the receiver: too slow (ABORTED) or silent for 1 s (CANCELLED)


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


def apply_fault(fault: Fault, cluster, rng: random.Random, kv_shape, problems: list[str]) -> str:
    """Applies `fault` to its target and says what it did; a slow push the receiver did not cut
    in time is also a problem. kv_shape: the model's KVShape, for the slow pushes."""
    if fault.kind == "kill":
        return _kill(cluster, fault)
    if fault.kind == "stop":
        return _stop(cluster, fault, rng)
    if fault.kind == "cut":
        return _cut(fault)
    if fault.kind == "drain":
        return _drain(cluster, fault, problems)
    return _slow_push(cluster, fault, kv_shape, problems)


def _kill(cluster, fault: Fault) -> str:
    killed_at = time.monotonic()
    cluster.restart(fault.target, RESTART_TIMEOUT_S)
    return f"restarted, serving again after {time.monotonic() - killed_at:.1f} s"


def _drain(cluster, fault: Fault, problems: list[str]) -> str:
    """SIGTERM: a prefill worker finishes and pushes its queue, a decode worker moves its rows
    with their KV to the other (its retained conversations' KV dropped, with events); it must
    exit 0 within its bound. Then it starts again on the same port, as a rolled pod would."""
    proc = dict(cluster.procs)[fault.target]
    drained_at = time.monotonic()
    proc.send_signal(signal.SIGTERM)
    try:
        status = proc.wait(DRAIN_EXIT_S)
    except subprocess.TimeoutExpired:
        problems.append(f"drain: {fault.role} {fault.target} still running {DRAIN_EXIT_S:.0f} s after SIGTERM")
        proc.kill()
        status = proc.wait()
    exited = time.monotonic() - drained_at
    if status != 0:
        problems.append(f"drain: {fault.role} {fault.target} exited with {status}")
    cluster.restart(fault.target, RESTART_TIMEOUT_S)
    return f"drained, exited {status} after {exited:.1f} s; serving again after {time.monotonic() - drained_at:.1f} s"


def _stop(cluster, fault: Fault, rng: random.Random) -> str:
    proc = dict(cluster.procs)[fault.target]
    seconds = rng.uniform(2.0, 5.0)
    proc.send_signal(signal.SIGSTOP)
    try:
        time.sleep(seconds)
    finally:
        proc.send_signal(signal.SIGCONT)
    return f"stopped for {seconds:.1f} s"


def _cut(fault: Fault) -> str:
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


def _slow_push(cluster, fault: Fault, shape, problems: list[str], pushes: int = 4, tokens: int = 1000) -> str:
    """Register `pushes` Decode calls for prompts of `tokens` tokens, or as many as the worker's
    context holds, and trickle their KV a sixteenth (at most 64 KiB) every 0.5 s: each push
    must be cut by the receiver, as too slow (ABORTED) a little after its 2 s grace, or as
    silent (CANCELLED) if this busy process let more than 1 s pass between two chunks."""
    import grpc
    import torch

    from baton.engine.kv import SequenceKV
    from baton.kvtransfer import encode
    from baton.server import channel
    from baton.v1 import common_pb2, kvtransfer_pb2_grpc, workers_pb2, workers_pb2_grpc

    ends: dict[str, tuple[str, float]] = {}
    with channel(fault.target, cluster.tls, cluster_token=cluster.cluster_token) as ch:
        decode = workers_pb2_grpc.DecodeWorkerStub(ch)
        load = decode.GetLoad(common_pb2.LoadRequest(), timeout=5)
        fingerprint = load.model_fingerprint
        tokens = min(tokens, load.max_context - 2) if load.max_context > 2 else tokens
        kv = SequenceKV(torch.zeros(shape.num_layers, 2, shape.num_kv_heads, tokens, shape.head_dim,
                                    dtype=shape.dtype))
        chunk_bytes = max(1024, min(64 << 10, kv.nbytes // 16))
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
                    for k, chunk in enumerate(encode(rid, fingerprint, kv, chunk_bytes=chunk_bytes, push_token=rid)):
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
        problems.append(f"failed: slow pushes into {fault.target} were not all cut within 10 s: "
                        f"{dict(codes)}, the last after {slowest:.1f} s")
    return f"{pushes} trickling pushes ended {dict(codes)} within {slowest:.1f} s"
