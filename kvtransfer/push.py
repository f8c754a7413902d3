"""One KV push by the best way its target allows: to a decode worker on this host, a CUDA IPC
handle where both hold KV in CUDA memory (kvtransfer.cuda_ipc), else shared memory
(kvtransfer.shm); to any other, a NIXL write where both workers take them (`library="nixl"`,
kvtransfer.nixl), else gRPC; and gRPC's retries when either of the others breaks."""
from __future__ import annotations

import logging
import threading
import time
from typing import Callable

import grpc

from baton.engine.kv import SequenceKV
import baton.kvtransfer.cuda_ipc as cuda_ipc
from baton.kvtransfer.errors import KVPushFailed
from baton.kvtransfer.grpc_transport import RETRYABLE_PUSH_CODES, PushRetry, push_kv_retrying
from baton.kvtransfer.nixl import LIBRARY, NixlSender
from baton.kvtransfer.sender import kv_header
from baton.kvtransfer.shm import NoDeviceIPC, NoSharedMemoryPeer, local_port, push_kv_shm
from baton.kvtransfer.wire import DEFAULT_CHUNK_BYTES
from baton.v1 import kvtransfer_pb2 as pb
from baton.v1 import kvtransfer_pb2_grpc as pb_grpc

log = logging.getLogger(__name__)

# A target found without a shared-memory listener, or one that takes no library writes (or that
# the library could not reach), is tried that way again this late.
RECHECK_SHM_AFTER_S = 60.0


class _NoLibrary(Exception):
    """The target takes no writes through the library, or the library cannot reach it."""


class KVPusher:
    """Thread-safe; one per worker. `shared_memory=False` (kv_transport: grpc) always uses gRPC."""

    def __init__(self, cluster_token: str | None = None, shared_memory: bool = True, library: str | None = None) -> None:
        if library not in (None, LIBRARY):
            raise ValueError(f"unknown KV transfer library {library!r}; Baton writes through {LIBRARY!r}")
        self.cluster_token = cluster_token
        self.shared_memory = shared_memory
        self.library = library
        self._sender = NixlSender() if library else None
        if self._sender is not None:
            self._sender.start()
        self._lock = threading.Lock()
        self._no_listener: dict[str, float] = {}  # target -> when it had no shared-memory listener
        self._no_library: dict[str, float] = {}  # target -> when it took no library writes
        self._no_device: dict[str, float] = {}  # target -> when it could not open a CUDA IPC handle

    def push(self, target: str, channel: Callable[[], grpc.Channel], request_id: str, fingerprint: str,
             kv: SequenceKV, metadata: bytes = b"", *, timeout_s: float, retry: PushRetry = PushRetry(),
             should_stop: Callable[[], bool] = lambda: False,
             on_retry: Callable[[int, KVPushFailed], None] | None = None, push_token: str = "",
             chunk_bytes: int = DEFAULT_CHUNK_BYTES) -> str:
        """Push kv to the decode worker at `target`; returns the transport that landed it ("cuda_ipc",
        "shm", "nixl" or "grpc"). `channel()` gives the gRPC channel to `target` when gRPC is needed, asked
        again before each retry. Raises the last KVPushFailed."""
        deadline = time.monotonic() + timeout_s
        port = self._shm_port(target)
        if port is not None:
            try:
                if cuda_ipc.exportable(kv.data) and not self._recently_refused(self._no_device, target):
                    try:
                        push_kv_shm(port, request_id, fingerprint, kv, metadata, push_token, self.cluster_token,
                                    timeout_s, device=True)
                        return "cuda_ipc"
                    except NoDeviceIPC as refusal:
                        log.info("decode worker %s cannot open this worker's CUDA memory (%s): pushing KV bytes "
                                 "to it through shared memory", target, refusal)
                        with self._lock:
                            self._no_device[target] = time.monotonic()
                push_kv_shm(port, request_id, fingerprint, kv, metadata, push_token, self.cluster_token,
                            max(0.001, deadline - time.monotonic()))
                return "shm"
            except NoSharedMemoryPeer:
                with self._lock:
                    self._no_listener[target] = time.monotonic()
            except KVPushFailed as failure:
                if failure.code not in RETRYABLE_PUSH_CODES or should_stop():
                    raise
                if on_retry is not None:  # the shared-memory attempt counts as the first
                    on_retry(1, failure)
        elif self._takes_library(target):
            try:
                self._write(channel(), request_id, fingerprint, kv, metadata, push_token, chunk_bytes, deadline)
                return LIBRARY
            except _NoLibrary:
                with self._lock:
                    self._no_library[target] = time.monotonic()
            except KVPushFailed as failure:
                if failure.code not in RETRYABLE_PUSH_CODES or should_stop():
                    raise
                if on_retry is not None:  # the library's attempt counts as the first
                    on_retry(1, failure)
        push_kv_retrying(channel, request_id, fingerprint, kv, metadata, chunk_bytes=chunk_bytes,
                         timeout_s=max(0.001, deadline - time.monotonic()), retry=retry, should_stop=should_stop,
                         on_retry=on_retry, push_token=push_token)
        return "grpc"

    def _write(self, channel: grpc.Channel, request_id: str, fingerprint: str, kv: SequenceKV, metadata: bytes,
               push_token: str, chunk_bytes: int, deadline: float) -> pb.PushReply:
        """One push through the library: the receiver opens a room, the library writes into it,
        the receiver checks and lands it. Raises _NoLibrary (push another way) or KVPushFailed."""
        stub = pb_grpc.KVTransferStub(channel)
        header = kv_header(request_id, fingerprint, kv, metadata, chunk_bytes, push_token)
        try:
            target = stub.OpenWrite(pb.WriteOpen(header=header, library=LIBRARY),
                                    timeout=max(0.001, deadline - time.monotonic()))
        except grpc.RpcError as err:
            if err.code() == grpc.StatusCode.UNIMPLEMENTED or (
                    err.code() == grpc.StatusCode.FAILED_PRECONDITION and (err.details() or "").startswith("library:")):
                raise _NoLibrary(err.details()) from None
            raise KVPushFailed(err.code().name, err.details() or "") from None
        try:
            crc = self._sender.write(kv, target, deadline)
        except KVPushFailed as failure:
            try:  # free the room now rather than when the receiver gives it up
                stub.CloseWrite(pb.WriteClose(transfer_id=target.transfer_id, abandon=True), timeout=1.0)
            except grpc.RpcError:
                pass
            if failure.code == "UNAVAILABLE":  # the library cannot reach it: gRPC may
                raise _NoLibrary(failure.details) from None
            raise
        try:
            return stub.CloseWrite(pb.WriteClose(transfer_id=target.transfer_id, crc32=crc),
                                   timeout=max(0.001, deadline - time.monotonic()))
        except grpc.RpcError as err:
            raise KVPushFailed(err.code().name, err.details() or "") from None

    def _takes_library(self, target: str) -> bool:
        return self._sender is not None and not self._recently_refused(self._no_library, target)

    def _recently_refused(self, refused: dict[str, float], target: str) -> bool:
        """Whether `target` refused a way (no listener, no library) within RECHECK_SHM_AFTER_S."""
        with self._lock:
            since = refused.get(target)
            if since is not None:
                if time.monotonic() - since < RECHECK_SHM_AFTER_S:
                    return True
                del refused[target]
            if len(refused) > 1024:  # decode workers come and go: bounded
                refused.clear()
        return False

    def uses_shared_memory(self, target: str) -> bool:
        """Whether a push to `target` would try shared memory first (a decode worker on this host)."""
        return self._shm_port(target) is not None

    def _shm_port(self, target: str) -> int | None:
        if not self.shared_memory or self._recently_refused(self._no_listener, target):
            return None
        return local_port(target)
