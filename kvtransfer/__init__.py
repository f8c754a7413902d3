"""KV cache shipping from prefill to decode workers: wire format, sender, receiver, staging pool.

    prefill worker                                   decode worker
    encode(rid, fingerprint, kv, metadata)  --->  Receiver.receive(chunks)
      header, data chunks (crc32), end              validates, reserves staging bytes,
    over push_kv (gRPC), or a sealed memfd          assembles, lands in StagingPool -> on_landed
    (push_kv_shm, same host), or a CUDA IPC         (Receiver.receive_whole for a memfd,
    handle to the KV on the GPU (cuda_ipc)           receive_device for a CUDA IPC handle)

Refusals are `KVTransferError` subclasses whose `.code` names the gRPC status (errors.py).
"""
from baton.kvtransfer.errors import (
    KVBadStream,
    KVCancelled,
    KVCorrupt,
    KVDuplicate,
    KVForeignModel,
    KVNoDeviceIPC,
    KVNotLanded,
    KVPoolFull,
    KVPushFailed,
    KVShapeMismatch,
    KVTooLarge,
    KVTransferError,
    KVTruncated,
    KVUnexpected,
)
from baton.kvtransfer.receiver import ReceiveResult, Receiver, ReceiverConfig
from baton.kvtransfer.sender import encode
from baton.kvtransfer.staging import StagedKV, StagingConfig, StagingPool, StagingStats
from baton.kvtransfer.wire import DEFAULT_CHUNK_BYTES, MAX_CHUNK_BYTES

__all__ = [
    "DEFAULT_CHUNK_BYTES",
    "MAX_CHUNK_BYTES",
    "KVBadStream",
    "KVCancelled",
    "KVCorrupt",
    "KVDuplicate",
    "KVForeignModel",
    "KVNoDeviceIPC",
    "KVNotLanded",
    "KVPoolFull",
    "KVPushFailed",
    "KVShapeMismatch",
    "KVTooLarge",
    "KVTransferError",
    "KVTruncated",
    "KVUnexpected",
    "ReceiveResult",
    "Receiver",
    "ReceiverConfig",
    "StagedKV",
    "StagingConfig",
    "StagingPool",
    "StagingStats",
    "encode",
]
