"""The same-host shared-memory KV transport (kvtransfer/shm.py): a real Unix socket, real memory
files, a receiver in this process or (for SIGKILL) in its own."""
from __future__ import annotations

import fcntl
import gc
import mmap
import os
import signal
import socket
import struct
import subprocess
import sys
import threading
import time
import zlib
from pathlib import Path

import pytest
import torch

from baton.engine.kv import KVShape, SequenceKV
from baton.kvtransfer import KVPushFailed, Receiver, ReceiverConfig, StagingConfig, StagingPool
from baton.kvtransfer.sender import kv_header
from baton.kvtransfer.shm import (MAGIC, NoSharedMemoryPeer, ShmKVServer, _PREFIX, local_port, push_kv_shm,
                                  socket_name)
from baton.launch.up import free_port

SHAPE = KVShape(num_layers=3, num_kv_heads=2, head_dim=8, dtype=torch.float32)


def make_kv(tokens: int, dtype=torch.float32) -> SequenceKV:
    return SequenceKV(torch.randn(SHAPE.num_layers, 2, SHAPE.num_kv_heads, tokens, SHAPE.head_dim).to(dtype))


def receiver(capacity: int = 1 << 20, dtype=torch.float32) -> Receiver:
    shape = KVShape(SHAPE.num_layers, SHAPE.num_kv_heads, SHAPE.head_dim, dtype)
    pool = StagingPool(StagingConfig(capacity_bytes=capacity, require_expected=True, max_entries=8))
    return Receiver(pool, ReceiverConfig("model-a", shape))


def memfds(pid: int | str = "self") -> list[str]:
    """The Baton KV memory files a process holds open."""
    found = []
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        try:
            link = os.readlink(fd)
        except OSError:
            continue
        if link.startswith("/memfd:baton-kv"):
            found.append(link)
    return found


def mapped_memfds() -> list[str]:
    """The Baton KV memory files this process has mapped."""
    names = set()
    for line in Path("/proc/self/maps").read_text().splitlines():
        if "/memfd:baton-kv" in line:
            names.add(line.split(None, 5)[5].removesuffix(" (deleted)"))
    return sorted(names)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_push_lands_bit_exact_with_its_metadata(dtype):
    recv, port = receiver(dtype=dtype), free_port()
    kv = make_kv(37, dtype)
    recv.pool.expect("r1", "tok")
    with ShmKVServer(recv, port, cluster_token="cluster-secret"):
        reply = push_kv_shm(port, "r1", "model-a", kv, b"meta", push_token="tok", cluster_token="cluster-secret")
    assert reply.bytes_received == kv.nbytes
    staged = recv.pool.take("r1")
    assert staged.metadata == b"meta"
    assert torch.equal(staged.kv.data.view(torch.uint8), kv.data.view(torch.uint8))
    assert memfds() == [], "every memory file is closed once the push returns"
    assert mapped_memfds() == ["/memfd:baton-kv-r1"], "the staged KV is the pushed pages, not a copy"
    recv.pool.release("r1")
    del staged
    gc.collect()
    assert mapped_memfds() == [], "the pages are unmapped (and freed) with the staged KV"


def test_no_listener_means_no_shared_memory_peer_and_nothing_sent():
    with pytest.raises(NoSharedMemoryPeer):
        push_kv_shm(free_port(), "r1", "model-a", make_kv(4))
    assert memfds() == []


def test_refusals_are_gRPC_codes_and_take_no_staging_room():
    recv, port = receiver(), free_port()
    recv.pool.expect("r1", "tok")
    with ShmKVServer(recv, port, cluster_token="cluster-secret"):
        for token, code in ((None, "UNAUTHENTICATED"), ("wrong", "UNAUTHENTICATED")):
            with pytest.raises(KVPushFailed) as refused:
                push_kv_shm(port, "r1", "model-a", make_kv(4), push_token="tok", cluster_token=token)
            assert refused.value.code == code
        with pytest.raises(KVPushFailed) as refused:  # the push token the Decode call registered
            push_kv_shm(port, "r1", "model-a", make_kv(4), push_token="not-tok", cluster_token="cluster-secret")
        assert refused.value.code == "PERMISSION_DENIED"
        with pytest.raises(KVPushFailed) as refused:
            push_kv_shm(port, "r1", "model-b", make_kv(4), push_token="tok", cluster_token="cluster-secret")
        assert refused.value.code == "INVALID_ARGUMENT" and "model-b" in refused.value.details
    assert recv.pool.stats().used_bytes == 0


def raw_push(port: int, header, payload: bytes, crc: int, seal: bool = True) -> str:
    """A hand-made push (what a buggy or hostile sender could send); the receiver's answer."""
    import json

    fd = os.memfd_create("baton-kv-test", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    try:
        os.write(fd, payload)
        if seal:
            fcntl.fcntl(fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_SEAL | fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW
                        | fcntl.F_SEAL_WRITE)
        with socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET) as sock:
            sock.connect(socket_name(port))
            socket.send_fds(sock, [_PREFIX.pack(MAGIC, crc, 0) + header.SerializeToString()], [fd])
            sock.settimeout(5)
            while True:
                reply = json.loads(sock.recv(4096))
                if not reply.get("waiting"):
                    return reply.get("code", "OK") + ": " + reply.get("details", "")
    finally:
        os.close(fd)


def test_a_corrupt_short_or_unsealed_memory_file_is_refused():
    recv, port = receiver(), free_port()
    kv = make_kv(5)
    payload = kv.data.numpy().tobytes()
    header = kv_header("r1", "model-a", kv, push_token="tok")
    recv.pool.expect("r1", "tok")
    with ShmKVServer(recv, port):
        assert raw_push(port, header, payload, zlib.crc32(payload) ^ 1).startswith("INVALID_ARGUMENT: KV for 'r1': checksum")
        assert "holds" in raw_push(port, header, payload[:-4], zlib.crc32(payload[:-4]))
        assert "sealed" in raw_push(port, header, payload, zlib.crc32(payload), seal=False)
        with open(__file__, "rb") as not_a_memfd:  # any other descriptor is refused the same way
            with socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET) as sock:
                sock.connect(socket_name(port))
                socket.send_fds(sock, [_PREFIX.pack(MAGIC, 0, 0) + header.SerializeToString()], [not_a_memfd.fileno()])
                sock.settimeout(5)
                assert b"INVALID_ARGUMENT" in sock.recv(4096)
        assert recv.pool.stats().used_bytes == 0
        assert raw_push(port, header, payload, zlib.crc32(payload)).startswith("OK")
    assert torch.equal(recv.pool.take("r1").kv.data, kv.data)


def test_a_silent_receiver_is_given_up_within_about_a_second():
    port = free_port()
    with socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET) as listener:  # accepts, never answers
        listener.bind(socket_name(port))
        listener.listen(1)
        started = time.monotonic()
        with pytest.raises(KVPushFailed) as failed:
            push_kv_shm(port, "r1", "model-a", make_kv(4))
        assert failed.value.code == "UNAVAILABLE" and "silent" in failed.value.details
        assert time.monotonic() - started < 3


def test_a_push_waiting_for_staging_room_is_kept_alive_and_lands_when_room_frees():
    kv = make_kv(16)
    recv, port = receiver(capacity=kv.nbytes), free_port()
    recv.pool.expect("first", "")
    recv.pool.expect("second", "")
    with ShmKVServer(recv, port):
        push_kv_shm(port, "first", "model-a", kv)
        threading.Timer(2.5, lambda: recv.pool.release(recv.pool.take("first").request_id)).start()
        started = time.monotonic()
        push_kv_shm(port, "second", "model-a", kv)  # waits 2.5 s, past the 1 s idle cut-off
        assert time.monotonic() - started > 2
    assert torch.equal(recv.pool.take("second").kv.data, kv.data)


def test_a_second_server_for_the_same_port_is_refused():
    recv, port = receiver(), free_port()
    with ShmKVServer(recv, port):
        with pytest.raises(OSError):
            ShmKVServer(recv, port)


def test_local_port_accepts_only_addresses_of_this_host():
    assert local_port("127.0.0.1:5000") == 5000
    assert local_port("localhost:5001") == 5001
    assert local_port("[::1]:5002") == 5002
    assert local_port("203.0.113.9:5003") is None  # TEST-NET-3: never ours
    assert local_port("decode-0.baton:5004") is None  # names are not resolved on the push path
    assert local_port("no-port") is None


RECEIVER_PROCESS = """
import sys, torch
from baton.engine.kv import KVShape, SequenceKV
from baton.kvtransfer import Receiver, ReceiverConfig, StagingConfig, StagingPool
from baton.kvtransfer.shm import ShmKVServer
shape = KVShape(3, 2, 8, torch.float32)
nbytes = int(sys.argv[2])
pool = StagingPool(StagingConfig(capacity_bytes=nbytes, max_entries=4))
pool.land(pool.reserve("occupant", nbytes, 1), SequenceKV(torch.zeros(3, 2, 2, nbytes // 384, 8)), b"")
ShmKVServer(Receiver(pool, ReceiverConfig("model-a", shape)), int(sys.argv[1])).start()
print("ready", flush=True)
sys.stdin.read()
"""


def test_sigkill_of_a_receiver_mid_transfer_leaves_no_memory_behind():
    """The receiver holds the KV's memory file while it waits for staging room; killed there, the
    kernel frees the memory (no name anywhere), and the sender is told at once."""
    kv, port = make_kv(16), free_port()
    proc = subprocess.Popen([sys.executable, "-c", RECEIVER_PROCESS, str(port), str(kv.nbytes)],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "ready"
        shm_before = set(os.listdir("/dev/shm"))
        outcome = {}

        def push():
            try:
                push_kv_shm(port, "r1", "model-a", kv)
            except KVPushFailed as failure:
                outcome["failure"] = failure

        pusher = threading.Thread(target=push)
        pusher.start()
        deadline = time.monotonic() + 10
        while not memfds(proc.pid) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert memfds(proc.pid), "the receiver should hold the KV's memory file while it waits for room"
        proc.send_signal(signal.SIGKILL)
        pusher.join(timeout=5)
        assert outcome["failure"].code == "UNAVAILABLE"
        proc.wait(timeout=10)
        assert memfds() == [] and set(os.listdir("/dev/shm")) == shm_before
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


@pytest.mark.parametrize("transport", ["auto", "grpc"])
def test_a_local_cluster_pushes_through_shared_memory_unless_told_grpc(transport, tiny_reference):
    """Real processes on one host: `auto` (the default) lands every KV through shared memory,
    `grpc` through gRPC; the tokens are the same greedy ones either way."""
    import urllib.request

    from prometheus_client.parser import text_string_to_metric_families

    from baton.client import BatonClient
    from baton.launch.up import LocalCluster

    metrics_port = free_port()
    prompts = [[300 + 11 * i + j for j in range(6 + 5 * i)] for i in range(4)]
    with LocalCluster(prefill=1, decode=1, model="tiny-random", max_rows=4,
                      prefill_args=("--metrics-port", str(metrics_port), "--kv-transport", transport),
                      decode_args=("--kv-transport", transport)) as cluster:
        with BatonClient(cluster.router_address, timeout=60) as client:
            results = [client.generate(token_ids=p, max_tokens=12, ignore_eos=True) for p in prompts]
        scraped = urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=10).read().decode()
    assert [r.token_ids for r in results] == [tiny_reference.greedy(p, 12) for p in prompts]
    landed = {s.labels["transport"]: s.value for f in text_string_to_metric_families(scraped)
              for s in f.samples if s.name == "baton_kv_transfer_transports_total"}
    assert landed == {"shm" if transport == "auto" else "grpc": len(prompts)}


def test_a_receiver_asked_for_pinned_memory_copies_the_pushed_pages():
    """A CUDA decode worker's receiver (pin_memory) copies the pages into host memory of its own
    (pinned where CUDA is present) instead of staging them: the path the GPU run exercises."""
    shape = KVShape(SHAPE.num_layers, SHAPE.num_kv_heads, SHAPE.head_dim, torch.float32)
    pool = StagingPool(StagingConfig(capacity_bytes=1 << 20, require_expected=True, max_entries=8))
    recv, port = Receiver(pool, ReceiverConfig("model-a", shape, pin_memory=True)), free_port()
    kv = make_kv(21)
    pool.expect("r1", "")
    with ShmKVServer(recv, port):
        push_kv_shm(port, "r1", "model-a", kv)
    assert mapped_memfds() == [], "copied, not mapped"
    staged = pool.take("r1").kv.data
    assert torch.equal(staged, kv.data) and staged.is_pinned() == torch.cuda.is_available()


# -- KV in CUDA memory, handed over by handle (kvtransfer/cuda_ipc.py) ----------------------------
# A device push needs two CUDA processes (test_cuda.py runs one); here the protocol around it runs:
# a CPU receiver refuses the handle before reserving anything, and the sender pushes the bytes.

def test_the_device_digest_changes_with_a_bit_a_words_place_or_the_length():
    from baton.kvtransfer.cuda_ipc import ROW_WORDS, digest

    data = torch.randint(0, 256, (4 * (3 * ROW_WORDS + 7),), dtype=torch.uint8)
    assert digest(data) == digest(data.clone())
    changed = []
    flipped = data.clone()
    flipped[4 * ROW_WORDS + 1] ^= 4
    changed.append(flipped)
    in_a_row = data.clone().view(torch.int32)
    in_a_row[[3, 9]] = in_a_row[[9, 3]]
    changed.append(in_a_row.view(torch.uint8))
    across_rows = data.clone().view(torch.int32)
    across_rows[[5, ROW_WORDS + 5]] = across_rows[[ROW_WORDS + 5, 5]]
    changed.append(across_rows.view(torch.uint8))
    in_the_tail = data.clone().view(torch.int32)
    in_the_tail[[-1, -2]] = in_the_tail[[-2, -1]]
    changed.append(in_the_tail.view(torch.uint8))
    changed.append(data[:-4])
    for other in changed:
        if not torch.equal(other, data):  # a swap of equal words changes nothing
            assert digest(other) != digest(data)
    assert digest(data[:-1]) != digest(data[:-2])  # lengths that are not whole words


def _cpu_description(kv: torch.Tensor, gpu: str = "GPU-00000000-0000-0000-0000-000000000000") -> dict:
    """What `cuda_ipc.export` describes, for KV that is not on a GPU: a receiver without CUDA (or
    without that GPU) must refuse it before reserving anything."""
    import base64

    from baton.kvtransfer.cuda_ipc import digest

    raw = kv.reshape(-1).view(torch.uint8)
    return {"gpu": gpu, "handle": base64.b64encode(b"h" * 64).decode(), "storage_bytes": raw.numel(),
            "storage_offset": 0, "offset": 0, "ref_counter": base64.b64encode(b"/torch_1_2").decode(),
            "ref_offset": 0, "event": "", "event_sync": False, "digest": digest(raw)}


def test_a_cuda_handle_a_receiver_cannot_open_is_refused_unreserved_and_the_pusher_sends_bytes(monkeypatch):
    from baton.kvtransfer import cuda_ipc
    from baton.kvtransfer.push import KVPusher
    from baton.kvtransfer.shm import NoDeviceIPC

    exported, released = [], []

    def export(data):  # CUDA's part: a description like the one for a device copy
        exported.append(data)
        return _cpu_description(data), data.clone()

    monkeypatch.setattr(cuda_ipc, "export", export)
    monkeypatch.setattr(cuda_ipc, "release", released.append)
    monkeypatch.setattr(cuda_ipc, "exportable", lambda data: True)
    recv, port = receiver(), free_port()
    kv = make_kv(19)
    with ShmKVServer(recv, port, cluster_token="secret"):
        recv.pool.expect("r1", "tok")
        with pytest.raises(NoDeviceIPC, match="no CUDA device" if not torch.cuda.is_available() else "not visible"):
            push_kv_shm(port, "r1", "model-a", kv, push_token="tok", cluster_token="secret", device=True)
        assert recv.pool.stats().used_bytes == 0 and recv.pool.is_expected("r1")
        pusher = KVPusher("secret")
        for rid in ("r1", "r2"):
            recv.pool.expect(rid, "tok")
            landed_by = pusher.push(f"127.0.0.1:{port}", lambda: None, rid, "model-a", kv, b"m", timeout_s=10,
                                    push_token="tok")
            assert landed_by == "shm"
            assert torch.equal(recv.pool.take(rid).kv.data, kv.data)
    assert len(exported) == 2, "once by hand, once by the pusher: it then remembers the receiver cannot open them"
    # never opened there, so the sender gave up the receiver's reference itself (torch would keep
    # each copy on the sender's GPU for good)
    assert len(released) == 2
    with pytest.raises(NoSharedMemoryPeer):  # never sent at all: the same
        push_kv_shm(free_port(), "r3", "model-a", kv, device=True)
    assert len(released) == 3


@pytest.mark.parametrize("spoil, said", [
    (lambda d: d.pop("handle"), "malformed"),
    (lambda d: d.update(handle="not base64!"), "malformed"),
    (lambda d: d.update(offset=-1), "malformed"),
    (lambda d: d.update(storage_bytes=8), "covers 8 bytes"),
    (lambda d: d.update(digest=[1, 2]), "three sums"),
    (lambda d: d.update(ref_counter="Ly4uL2V0Yy9wYXNzd2Q="), "plain shared-memory name"),  # /../etc/passwd
    (lambda d: d.clear(), "malformed"),
])
def test_a_malformed_cuda_handle_description_is_refused_as_a_bad_push(monkeypatch, spoil, said):
    from baton.kvtransfer import cuda_ipc

    def export(data):
        description = _cpu_description(data)
        spoil(description)
        return description, data

    released = []
    monkeypatch.setattr(cuda_ipc, "export", export)
    monkeypatch.setattr(cuda_ipc, "release", released.append)
    recv, port = receiver(), free_port()
    recv.pool.expect("r1", "")
    with ShmKVServer(recv, port):
        with pytest.raises(KVPushFailed, match=said) as refused:
            push_kv_shm(port, "r1", "model-a", make_kv(6), device=True)
        assert refused.value.code == "INVALID_ARGUMENT" and len(released) == 1  # refused before opening
        push_kv_shm(port, "r1", "model-a", make_kv(6))  # the server took the next push as ever
    assert recv.pool.stats().used_bytes > 0


def test_a_device_push_frame_carrying_a_memory_file_or_no_description_is_refused():
    import json

    from baton.kvtransfer.shm import DEVICE_MAGIC, _DESCRIPTION

    recv, port = receiver(), free_port()
    kv = make_kv(3)
    header = kv_header("r1", "model-a", kv).SerializeToString()
    blob = json.dumps(_cpu_description(kv.data)).encode()
    frames = {
        "comes as a handle, not a file": (_PREFIX.pack(DEVICE_MAGIC, 0, 0) + _DESCRIPTION.pack(len(blob)) + blob + header,
                                          True),
        "missing or too long": (_PREFIX.pack(DEVICE_MAGIC, 0, 0) + _DESCRIPTION.pack(1 << 20) + header, False),
        "not JSON": (_PREFIX.pack(DEVICE_MAGIC, 0, 0) + _DESCRIPTION.pack(3) + b"{{{" + header, False),
    }
    recv.pool.expect("r1", "")
    with ShmKVServer(recv, port):
        for said, (frame, with_file) in frames.items():
            fd = os.memfd_create("baton-kv-test", os.MFD_CLOEXEC)
            try:
                with socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET) as sock:
                    sock.connect(socket_name(port))
                    socket.send_fds(sock, [frame], [fd] if with_file else [])
                    sock.settimeout(5)
                    reply = json.loads(sock.recv(4096))
            finally:
                os.close(fd)
            assert reply["code"] == "INVALID_ARGUMENT" and said in reply["details"], reply
    assert recv.pool.stats().used_bytes == 0


def test_a_write_seal_the_kernel_refuses_for_a_moment_is_asked_for_again(monkeypatch):
    """EBUSY from F_ADD_SEALS (a page of the file briefly holding another reference) is retried;
    any other error, or EBUSY that lasts, still fails the memory file (and the push goes by gRPC)."""
    import errno

    import baton.kvtransfer.shm as shm

    real, refusals = fcntl.fcntl, []

    def busy_then_real(fd, cmd, arg=0):
        if cmd == fcntl.F_ADD_SEALS and len(refusals) < 2:
            refusals.append(cmd)
            raise OSError(errno.EBUSY, "Device or resource busy")
        return real(fd, cmd, arg)

    monkeypatch.setattr(shm.fcntl, "fcntl", busy_then_real)
    fd, crc = shm._sealed_copy(make_kv(3), "r-busy")
    try:
        assert len(refusals) == 2 and real(fd, fcntl.F_GET_SEALS) & fcntl.F_SEAL_WRITE
    finally:
        os.close(fd)

    def always_busy(fd, cmd, arg=0):
        if cmd == fcntl.F_ADD_SEALS:
            raise OSError(errno.EBUSY, "Device or resource busy")
        return real(fd, cmd, arg)

    monkeypatch.setattr(shm.fcntl, "fcntl", always_busy)
    monkeypatch.setattr(shm.time, "sleep", lambda s: None)
    with pytest.raises(OSError) as failed:
        shm._sealed_copy(make_kv(3), "r-busy")
    assert failed.value.errno == errno.EBUSY
