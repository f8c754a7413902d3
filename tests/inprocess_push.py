"""The in-process transport, for tests: the sender's chunks fed straight to a Receiver (the
same encode and receive code as gRPC, minus the socket)."""
from __future__ import annotations

from baton.engine.kv import SequenceKV
from baton.kvtransfer.receiver import ReceiveResult, Receiver
from baton.kvtransfer.sender import encode
from baton.kvtransfer.wire import DEFAULT_CHUNK_BYTES


def push_in_process(
    receiver: Receiver,
    request_id: str,
    fingerprint: str,
    kv: SequenceKV,
    metadata: bytes = b"",
    chunk_bytes: int = DEFAULT_CHUNK_BYTES,
    timeout_s: float | None = None,
) -> ReceiveResult:
    """Raises the receiver's KVTransferError subclass when it refuses the KV."""
    return receiver.receive(encode(request_id, fingerprint, kv, metadata, chunk_bytes), timeout_s=timeout_s)
