"""How close KV shipping gets to a plain memory copy of the same bytes: over gRPC loopback, and
through shared memory (kvtransfer.shm) as a prefill worker does to a decode worker on its host;
with CUDA, also from GPU memory: through shared memory (the KV copied to the host first) and by
CUDA IPC handle (kvtransfer.cuda_ipc, the receiver copying into pinned staging).

    python -m baton.bench.kv_pushes --mbytes 64                 # receiver in its own process
    python -m baton.bench.kv_pushes --mbytes 64 --same-process  # sender and receiver share one GIL

Between two hosts (what `baton bench hosts` runs in two network namespaces), gRPC against NIXL:

    python -m baton.bench.kv_pushes --serve 10.0.0.2            # prints its address; stops at EOF
    python -m baton.bench.kv_pushes --push 10.0.0.2:PORT --mbytes 47,189 --transports grpc,nixl
"""
from __future__ import annotations

import argparse
import json
import multiprocessing
import sys
import time
from contextlib import contextmanager
from typing import Iterator

import torch

from baton.engine.kv import KVShape, SequenceKV
from baton.kvtransfer.grpc_transport import KVTransferServer, kvtransfer_channel, push_kv
from baton.kvtransfer.receiver import Receiver, ReceiverConfig
from baton.kvtransfer.shm import ShmKVServer, push_kv_shm
from baton.kvtransfer.staging import StagingConfig, StagingPool
from baton.kvtransfer.wire import DEFAULT_CHUNK_BYTES

# Llama-like shape whose per-token KV (32 KiB) divides round byte counts.
BENCH_SHAPE = KVShape(num_layers=32, num_kv_heads=4, head_dim=64, dtype=torch.float16)
BENCH_FINGERPRINT = "bench-model"


def bench_kv(nbytes: int) -> SequenceKV:
    """Random KV of BENCH_SHAPE holding at least nbytes (rounded up to whole tokens)."""
    per_token = BENCH_SHAPE.bytes_per_token()
    num_tokens = max(1, -(-nbytes // per_token))
    shape = (BENCH_SHAPE.num_layers, 2, BENCH_SHAPE.num_kv_heads, num_tokens, BENCH_SHAPE.head_dim)
    return SequenceKV(torch.randn(shape, dtype=BENCH_SHAPE.dtype))


def measure_loopback_throughput(
    nbytes: int, chunk_bytes: int = DEFAULT_CHUNK_BYTES, repeats: int = 5, receiver_process: bool = True
) -> tuple[float, float]:
    """(seconds to push nbytes of KV over gRPC on 127.0.0.1 until landed, seconds to memcpy them)."""
    times = measure_transports(nbytes, chunk_bytes, repeats, receiver_process)
    return times["grpc"], times["memcpy"]


def measure_transports(
    nbytes: int, chunk_bytes: int = DEFAULT_CHUNK_BYTES, repeats: int = 5, receiver_process: bool = True
) -> dict[str, float]:
    """Seconds to land nbytes of KV in a receiver's staging pool over gRPC on 127.0.0.1 ("grpc")
    and through shared memory ("shm"), and to memcpy them ("memcpy"); with CUDA, of KV in GPU
    memory through shared memory ("shm_from_gpu") and by CUDA IPC handle ("cuda_ipc").

    Each is the best of `repeats`, after one warm-up push that opens the connection. A push
    covers everything a worker's does: encoding or the sealed memory file, both checksums, the
    socket, assembly and landing. receiver_process=True runs the receiver in its own process, as
    a decode worker would; False shares this process (and its GIL).
    """
    kv = bench_kv(nbytes)
    server = _receiver_in_subprocess(kv.nbytes) if receiver_process else _receiver_here(kv.nbytes)
    on_gpu = SequenceKV(kv.data.cuda()) if torch.cuda.is_available() else None
    times: dict[str, list[float]] = {}
    with server as target:
        port = int(target.rpartition(":")[2])
        channel = kvtransfer_channel(target)
        pushes = {"grpc": lambda rid: push_kv(channel, rid, BENCH_FINGERPRINT, kv, chunk_bytes=chunk_bytes),
                  "shm": lambda rid: push_kv_shm(port, rid, BENCH_FINGERPRINT, kv)}
        if on_gpu is not None:
            pushes["shm_from_gpu"] = lambda rid: push_kv_shm(port, rid, BENCH_FINGERPRINT, on_gpu)
            pushes["cuda_ipc"] = lambda rid: push_kv_shm(port, rid, BENCH_FINGERPRINT, on_gpu, device=True)
        try:
            for attempt in range(repeats + 1):
                for transport, push in pushes.items():
                    started = time.perf_counter()
                    push(f"bench-{transport}-{attempt}")
                    if attempt > 0:
                        times.setdefault(transport, []).append(time.perf_counter() - started)
        finally:
            channel.close()
    return {**{transport: min(seconds) for transport, seconds in times.items()},
            "memcpy": _memcpy_seconds(kv.data, repeats)}


def _recycling_receiver(capacity_bytes: int) -> Receiver:
    """A receiver whose landed KVs are taken and released at once, as a fast consumer would."""
    pool: StagingPool

    def consume(request_id: str) -> None:
        pool.take(request_id)
        pool.release(request_id)

    pool = StagingPool(StagingConfig(capacity_bytes=capacity_bytes, max_entries=1), on_landed=consume)
    # pinned staging where a decode worker would have it: on a CUDA host
    return Receiver(pool, ReceiverConfig(fingerprint=BENCH_FINGERPRINT, shape=BENCH_SHAPE,
                                         pin_memory=torch.cuda.is_available()))


@contextmanager
def _receiver_here(capacity_bytes: int) -> Iterator[str]:
    receiver = _recycling_receiver(capacity_bytes)
    with KVTransferServer(receiver) as server, ShmKVServer(receiver, server.port):
        yield server.target


def _serve_until_told(capacity_bytes: int, connection) -> None:
    receiver = _recycling_receiver(capacity_bytes)
    with KVTransferServer(receiver) as server, ShmKVServer(receiver, server.port):
        connection.send(server.target)
        connection.recv()  # any message means stop


@contextmanager
def _receiver_in_subprocess(capacity_bytes: int) -> Iterator[str]:
    context = multiprocessing.get_context("spawn")  # no forked grpc or torch threads
    ours, theirs = context.Pipe()
    process = context.Process(target=_serve_until_told, args=(capacity_bytes, theirs), daemon=True)
    process.start()
    try:
        if not ours.poll(60):
            raise RuntimeError("benchmark receiver process did not start within 60 s")
        yield ours.recv()
    finally:
        if process.is_alive():
            ours.send("stop")
        process.join(10)
        if process.is_alive():
            process.kill()


def serve(host: str, capacity_bytes: int) -> None:
    """A receiver taking gRPC pushes and NIXL writes on host; prints its target, stops at EOF."""
    from baton.kvtransfer.nixl import NixlWrites

    receiver = _recycling_receiver(capacity_bytes)
    writes = NixlWrites(receiver)
    writes.start()
    with KVTransferServer(receiver, host=host, writes=writes) as server:
        print(server.target, flush=True)
        sys.stdin.read()


def push_seconds(target: str, nbytes: int, transports: list[str], repeats: int) -> dict[str, float]:
    """The best of `repeats` pushes of nbytes to `target` by each transport ("grpc", "nixl"), after
    one warm-up each: from the first byte sent until the receiver landed the KV."""
    from baton.kvtransfer.push import KVPusher

    kv = bench_kv(nbytes)
    channel = kvtransfer_channel(target)
    pushers = {"grpc": KVPusher(shared_memory=False), "nixl": KVPusher(shared_memory=False, library="nixl")}
    best: dict[str, float] = {}
    try:
        for transport in transports:
            times = []
            for attempt in range(repeats + 1):
                started = time.perf_counter()
                how = pushers[transport].push(target, lambda: channel, f"bench-{transport}-{nbytes}-{attempt}",
                                              BENCH_FINGERPRINT, kv, timeout_s=600)
                if how != transport:
                    raise RuntimeError(f"a {transport} push went by {how}")
                if attempt > 0:
                    times.append(time.perf_counter() - started)
            best[transport] = min(times)
    finally:
        channel.close()
    return best


def _memcpy_seconds(source: torch.Tensor, repeats: int) -> float:
    target = torch.empty_like(source)
    target.copy_(source)  # touch the pages once so the timing excludes page faults
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        target.copy_(source)
        times.append(time.perf_counter() - started)
    return min(times)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mbytes", default="64", help="KV sizes in MiB, comma-separated (with --push: MB)")
    parser.add_argument("--chunk-kib", type=int, default=DEFAULT_CHUNK_BYTES // 1024)
    parser.add_argument("--same-process", action="store_true", help="run the receiver in this process")
    parser.add_argument("--serve", metavar="HOST", help="be the receiver between hosts, on HOST")
    parser.add_argument("--push", metavar="TARGET", help="push to the receiver at TARGET; prints JSON")
    parser.add_argument("--transports", default="grpc,nixl")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args(argv)
    if args.serve:
        serve(args.serve, 1 << 31)
        return
    if args.push:
        sizes = [int(float(m) * 1e6) for m in args.mbytes.split(",")]
        print(json.dumps({n: push_seconds(args.push, n, args.transports.split(","), args.repeats) for n in sizes}))
        return
    for size in args.mbytes.split(","):
        nbytes = int(size) * 1024 * 1024
        times = measure_transports(nbytes, chunk_bytes=args.chunk_kib * 1024, receiver_process=not args.same_process,
                                   repeats=args.repeats)
        mib = nbytes / 2**20
        where = "same process" if args.same_process else "separate processes"
        print(f"KV {mib:.0f} MiB, chunks {args.chunk_kib} KiB, sender and receiver in {where}")
        for name, label in (("grpc", "gRPC loopback:"), ("shm", "shared memory:"), ("memcpy", "memcpy:"),
                            ("shm_from_gpu", "GPU via shm:"), ("cuda_ipc", "CUDA IPC:")):
            if name in times:
                print(f"{label:15s}{times[name] * 1e3:8.1f} ms  {mib / times[name]:8.0f} MiB/s")
        print(f"shared memory is {times['grpc'] / times['shm']:.1f}x faster than the gRPC push; "
              f"memcpy {times['shm'] / times['memcpy']:.1f}x faster than shared memory")
        if "cuda_ipc" in times:
            print(f"from GPU memory, the CUDA IPC handle is {times['shm_from_gpu'] / times['cuda_ipc']:.1f}x faster "
                  "than shared memory")


if __name__ == "__main__":
    main()
