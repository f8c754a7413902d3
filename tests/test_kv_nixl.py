"""KV pushes through NIXL (kvtransfer/nixl.py): the real library on its UCX backend over TCP, its
control calls over real gRPC on loopback, the receiver's checks as a Push's. Across hosts:
test_hosts.py."""
from __future__ import annotations

import os
import subprocess
import sys
import time
import zlib
from concurrent import futures
from pathlib import Path

import grpc
import pytest
import torch

from baton.engine.kv import KVShape, SequenceKV
from baton.kvtransfer import Receiver, ReceiverConfig, StagingConfig, StagingPool
from baton.kvtransfer.grpc_transport import KVTransferServicer, kvtransfer_channel
from baton.kvtransfer.nixl import NixlSender, NixlWrites, nixl_installed
from baton.kvtransfer.push import KVPusher
from baton.kvtransfer.sender import kv_header
from baton.kvtransfer.wire import grpc_channel_options, grpc_server_ping_options
from baton.v1 import kvtransfer_pb2 as pb
from baton.v1 import kvtransfer_pb2_grpc as pb_grpc

pytestmark = pytest.mark.skipif(not nixl_installed(), reason="the nixl extra is not installed")

SHAPE = KVShape(num_layers=3, num_kv_heads=2, head_dim=8, dtype=torch.float32)


@pytest.fixture(autouse=True)
def tcp_only(monkeypatch):
    monkeypatch.setenv("UCX_TLS", "tcp")  # the path between hosts, not UCX's same-host shortcuts


class Decode:
    """A receiver behind a real gRPC server that takes NIXL writes (or, with takes_writes=False, none)."""

    def __init__(self, dtype=torch.float32, takes_writes: bool = True, idle_timeout_s: float = 1.0) -> None:
        shape = KVShape(SHAPE.num_layers, SHAPE.num_kv_heads, SHAPE.head_dim, dtype)
        self.pool = StagingPool(StagingConfig(capacity_bytes=1 << 20, require_expected=True, max_entries=8))
        self.receiver = Receiver(self.pool, ReceiverConfig("model-a", shape))
        self.writes = NixlWrites(self.receiver, idle_timeout_s) if takes_writes else None
        self.server = grpc.server(futures.ThreadPoolExecutor(4),
                                  options=grpc_channel_options() + grpc_server_ping_options())
        pb_grpc.add_KVTransferServicer_to_server(KVTransferServicer(self.receiver, writes=self.writes), self.server)
        self.target = f"127.0.0.1:{self.server.add_insecure_port('127.0.0.1:0')}"
        self.server.start()
        self.channel = kvtransfer_channel(self.target)
        self.stub = pb_grpc.KVTransferStub(self.channel)

    def close(self) -> None:
        self.channel.close()
        self.server.stop(0).wait()
        if self.writes is not None:
            self.writes.stop()

    def held_bytes(self) -> int:
        stats = self.pool.stats()
        return stats.reserved_bytes + stats.landed_bytes


@pytest.fixture
def decode():
    made: list[Decode] = []

    def make(**kwargs) -> Decode:
        made.append(Decode(**kwargs))
        return made[-1]

    yield make
    for d in made:
        d.close()


def make_kv(tokens: int, dtype=torch.float32) -> SequenceKV:
    return SequenceKV(torch.randn(SHAPE.num_layers, 2, SHAPE.num_kv_heads, tokens, SHAPE.head_dim).to(dtype))


def push(pusher: KVPusher, d: Decode, rid: str, kv: SequenceKV, token: str = "tok") -> str:
    return pusher.push(d.target, lambda: d.channel, rid, "model-a", kv, b"meta", timeout_s=20, push_token=token)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_push_through_nixl_lands_bit_exact(decode, dtype):
    d, pusher = decode(dtype=dtype), KVPusher(shared_memory=False, library="nixl")
    for i, tokens in enumerate((1, 37, 500)):
        kv = make_kv(tokens, dtype)
        d.pool.expect(f"r{i}", "tok")
        assert push(pusher, d, f"r{i}", kv) == "nixl"
        staged = d.pool.take(f"r{i}")
        assert staged.metadata == b"meta"
        assert torch.equal(staged.kv.data.view(torch.uint8), kv.data.view(torch.uint8))
        d.pool.release(f"r{i}")
    assert d.held_bytes() == 0 and d.writes._rooms == {}


def test_a_write_is_refused_before_any_room_is_taken(decode):
    """The header's checks are a Push's: the push token, the model, the size."""
    d = decode()
    kv = make_kv(10)
    d.pool.expect("r", "right")
    refusals = {
        "PERMISSION_DENIED": kv_header("r", "model-a", kv, push_token="wrong"),
        "INVALID_ARGUMENT": kv_header("r", "model-b", kv, push_token="right"),
    }
    for code, header in refusals.items():
        with pytest.raises(grpc.RpcError) as refused:
            d.stub.OpenWrite(pb.WriteOpen(header=header, library="nixl"), timeout=10)
        assert refused.value.code().name == code
        assert d.held_bytes() == 0
    with pytest.raises(grpc.RpcError) as refused:
        d.stub.OpenWrite(pb.WriteOpen(header=kv_header("r", "model-a", kv, push_token="right"), library="rdma-x"))
    assert refused.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert refused.value.details().startswith("library:")


def open_and_write(d: Decode, rid: str, kv: SequenceKV) -> tuple[pb.WriteTarget, int]:
    d.pool.expect(rid, "tok")
    target = d.stub.OpenWrite(pb.WriteOpen(header=kv_header(rid, "model-a", kv, push_token="tok"), library="nixl"))
    assert d.held_bytes() == kv.nbytes
    return target, NixlSender().write(kv, target, time.monotonic() + 10)


def test_damaged_bytes_are_refused_and_their_room_freed(decode):
    d = decode()
    kv = make_kv(20)
    target, crc = open_and_write(d, "r", kv)
    assert crc == zlib.crc32(kv.data.view(torch.uint8).reshape(-1).numpy())
    with pytest.raises(grpc.RpcError) as refused:
        d.stub.CloseWrite(pb.WriteClose(transfer_id=target.transfer_id, crc32=crc ^ 1))
    assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "checksum" in refused.value.details()
    assert d.held_bytes() == 0 and d.writes._rooms == {}
    with pytest.raises(grpc.RpcError) as again:  # a closed write cannot be closed again
        d.stub.CloseWrite(pb.WriteClose(transfer_id=target.transfer_id, crc32=crc))
    assert again.value.code() == grpc.StatusCode.ABORTED


def test_rooms_abandoned_never_written_or_never_closed_are_freed(decode):
    d = decode(idle_timeout_s=0.2)
    kv = make_kv(20)
    target, _ = open_and_write(d, "abandoned", kv)
    assert d.stub.CloseWrite(pb.WriteClose(transfer_id=target.transfer_id, abandon=True)) == pb.PushReply()
    assert d.held_bytes() == 0
    d.pool.expect("unwritten", "tok")
    target = d.stub.OpenWrite(pb.WriteOpen(header=kv_header("unwritten", "model-a", kv, push_token="tok"),
                                           library="nixl"))
    with pytest.raises(grpc.RpcError) as refused:  # closed, but nothing was written: no notification came
        d.stub.CloseWrite(pb.WriteClose(transfer_id=target.transfer_id, crc32=0))
    assert refused.value.code() == grpc.StatusCode.ABORTED and "before its bytes arrived" in refused.value.details()
    assert d.held_bytes() == 0
    open_and_write(d, "unclosed", kv)  # the sender died before closing: the room goes after its time
    deadline = time.monotonic() + 10
    while d.held_bytes() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert d.held_bytes() == 0 and d.writes._rooms == {}
    d.pool.expect("after", "tok")  # and the request may be pushed again
    assert push(KVPusher(shared_memory=False, library="nixl"), d, "after", kv) == "nixl"


def test_a_worker_that_takes_no_writes_gets_grpc_and_is_not_asked_again_at_once(decode):
    d, pusher = decode(takes_writes=False), KVPusher(shared_memory=False, library="nixl")
    kv = make_kv(30)
    for rid in ("r1", "r2"):
        d.pool.expect(rid, "tok")
        assert push(pusher, d, rid, kv) == "grpc"
        assert torch.equal(d.pool.take(rid).kv.data, kv.data)
        d.pool.release(rid)
    assert d.target in pusher._no_library
    assert push_without_library(d, kv) == "grpc"


def push_without_library(d: Decode, kv: SequenceKV) -> str:
    d.pool.expect("plain", "tok")
    return push(KVPusher(shared_memory=False), d, "plain", kv)


def test_pushes_in_parallel_each_land_their_own_kv(decode):
    d, pusher = decode(), KVPusher(shared_memory=False, library="nixl")
    kvs = {f"r{i}": make_kv(40 + i) for i in range(6)}
    for rid in kvs:
        d.pool.expect(rid, "tok")
    with futures.ThreadPoolExecutor(6) as pool:
        ways = list(pool.map(lambda rid: push(pusher, d, rid, kvs[rid]), kvs))
    assert ways == ["nixl"] * len(kvs)
    for rid, kv in kvs.items():
        assert torch.equal(d.pool.take(rid).kv.data, kv.data)


def test_a_process_that_pushed_through_nixl_exits_cleanly(tmp_path):
    """UCX's InfiniBand modules, loaded on a host without such a device, crashed the process as it
    exited (SIGSEGV in the libnl they bundle): a worker's exit status must stay its own. And what
    ran after NIXL in the same process must not crash either (the test run loads protoc later)."""
    code = ("import sys; sys.path.insert(0, %r)\n"
            "import test_kv_nixl as t\n"
            "from baton.kvtransfer.push import KVPusher\n"
            "d = t.Decode(); d.pool.expect('r', 'tok')\n"
            "assert t.push(KVPusher(shared_memory=False, library='nixl'), d, 'r', t.make_kv(8)) == 'nixl'\n"
            "d.close()\n"
            # protoc's compiler, loaded after NIXL in one process, crashed it (their abseils met):
            # baton.protogen runs it in a process of its own
            "from pathlib import Path; from baton.protogen import find_stale\n"
            "assert find_stale(Path(%r)) == []\n") % (str(Path(__file__).parent), str(Path(__file__).parents[1]))
    env = {k: v for k, v in os.environ.items() if k != "UCX_MODULES"}
    done = subprocess.run([sys.executable, "-c", code], env={**env, "UCX_TLS": "tcp"}, capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
