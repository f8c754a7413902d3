"""One KV push by the best way its target allows: shared memory to a decode worker on this host
(kvtransfer.shm), gRPC to any other, and gRPC's retries when a shared-memory push breaks."""
from __future__ import annotations

import threading
import time
from typing import Callable

import grpc

from baton.engine.kv import SequenceKV
from baton.kvtransfer.errors import KVPushFailed
from baton.kvtransfer.grpc_transport import RETRYABLE_PUSH_CODES, PushRetry, push_kv_retrying
from baton.kvtransfer.shm import NoSharedMemoryPeer, local_port, push_kv_shm
from baton.kvtransfer.wire import DEFAULT_CHUNK_BYTES

RECHECK_SHM_AFTER_S = 60.0  # a target found without a shared-memory listener is tried again this late


class KVPusher:
    """Thread-safe; one per worker. `shared_memory=False` (kv_transport: grpc) always uses gRPC."""

    def __init__(self, cluster_token: str | None = None, shared_memory: bool = True) -> None:
        self.cluster_token = cluster_token
        self.shared_memory = shared_memory
        self._lock = threading.Lock()
        self._no_listener: dict[str, float] = {}  # target -> when it had no shared-memory listener

    def push(self, target: str, channel: Callable[[], grpc.Channel], request_id: str, fingerprint: str,
             kv: SequenceKV, metadata: bytes = b"", *, timeout_s: float, retry: PushRetry = PushRetry(),
             should_stop: Callable[[], bool] = lambda: False,
             on_retry: Callable[[int, KVPushFailed], None] | None = None, push_token: str = "",
             chunk_bytes: int = DEFAULT_CHUNK_BYTES) -> str:
        """Push kv to the decode worker at `target`; returns the transport that landed it ("shm" or
        "grpc"). `channel()` gives the gRPC channel to `target` when gRPC is needed. Raises the
        last KVPushFailed."""
        deadline = time.monotonic() + timeout_s
        port = self._shm_port(target)
        if port is not None:
            try:
                push_kv_shm(port, request_id, fingerprint, kv, metadata, push_token, self.cluster_token, timeout_s)
                return "shm"
            except NoSharedMemoryPeer:
                with self._lock:
                    self._no_listener[target] = time.monotonic()
            except KVPushFailed as failure:
                if failure.code not in RETRYABLE_PUSH_CODES or should_stop():
                    raise
                if on_retry is not None:  # the shared-memory attempt counts as the first
                    on_retry(1, failure)
        push_kv_retrying(channel(), request_id, fingerprint, kv, metadata, chunk_bytes=chunk_bytes,
                         timeout_s=max(0.001, deadline - time.monotonic()), retry=retry, should_stop=should_stop,
                         on_retry=on_retry, push_token=push_token)
        return "grpc"

    def uses_shared_memory(self, target: str) -> bool:
        """Whether a push to `target` would try shared memory first (a decode worker on this host)."""
        return self._shm_port(target) is not None

    def _shm_port(self, target: str) -> int | None:
        if not self.shared_memory:
            return None
        with self._lock:
            since = self._no_listener.get(target)
            if since is not None:
                if time.monotonic() - since < RECHECK_SHM_AFTER_S:
                    return None
                del self._no_listener[target]
            if len(self._no_listener) > 1024:  # decode workers come and go: bounded
                self._no_listener.clear()
        return local_port(target)
