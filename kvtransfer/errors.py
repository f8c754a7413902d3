"""Why a KV transfer was refused, each reason carrying the gRPC status a servicer answers with.

`code` names a `grpc.StatusCode` member as a string so this module (and the staging pool)
stays free of grpc. The mapping is part of the wire contract (see kvtransfer.proto):

    INVALID_ARGUMENT     the stream itself is wrong: malformed, corrupt, foreign, mis-shaped
    RESOURCE_EXHAUSTED   the KV cannot fit: larger than the pool, or no room before the timeout
    FAILED_PRECONDITION  the receiver is not expecting this request id
    PERMISSION_DENIED    the push does not carry the token the request was registered with
    ALREADY_EXISTS       this request id already has KV staged or in flight
    ABORTED              the stream ended early (sender died, network cut) or ran slower than the
                         receiver's minimum rate; safe to retry
    CANCELLED            the request was cancelled on the receiving side
"""
from __future__ import annotations


class KVTransferError(Exception):
    """Base of every refusal; `code` is the gRPC status name to answer with."""

    code = "INTERNAL"


class KVBadStream(KVTransferError):
    """Malformed stream: messages out of order, bad header fields, wrong chunk sizes."""

    code = "INVALID_ARGUMENT"


class KVCorrupt(KVBadStream):
    """A chunk's checksum, sequence number or offset does not match."""


class KVForeignModel(KVBadStream):
    """The KV was computed by a different model (fingerprint mismatch)."""


class KVShapeMismatch(KVBadStream):
    """dtype, layer count, KV heads or head dim differ from what the receiver runs."""


class KVTooLarge(KVTransferError):
    """The KV could never fit: more bytes than the whole pool, or more tokens than allowed."""

    code = "RESOURCE_EXHAUSTED"


class KVPoolFull(KVTransferError):
    """No room (bytes or entries) in the staging pool before the timeout."""

    code = "RESOURCE_EXHAUSTED"


class KVUnexpected(KVTransferError):
    """The receiver has not been told to expect KV for this request id."""

    code = "FAILED_PRECONDITION"


class KVWrongToken(KVTransferError):
    """The push's token is not the one the request's Decode call registered."""

    code = "PERMISSION_DENIED"


class KVDuplicate(KVTransferError):
    """KV for this request id is already staged, in flight, or taken and not yet released."""

    code = "ALREADY_EXISTS"


class KVNoDeviceIPC(KVTransferError):
    """The decode worker cannot open a push's CUDA memory handle (no CUDA, or not that GPU, or
    not permitted): the sender pushes the bytes instead."""

    code = "FAILED_PRECONDITION"


class KVNotLanded(KVTransferError):
    """take() on a request id whose KV has not landed (or was already taken)."""

    code = "FAILED_PRECONDITION"


class KVTruncated(KVTransferError):
    """The stream ended before its KVEnd message."""

    code = "ABORTED"


class KVTooSlow(KVTransferError):
    """The stream fell below the receiver's minimum rate: staging room is not held for a trickle."""

    code = "ABORTED"


class KVCancelled(KVTransferError):
    """The request was cancelled on the receiving side while its KV was waiting or arriving."""

    code = "CANCELLED"


class KVPushFailed(KVTransferError):
    """Client side: the receiver refused a push; `code` is the status it answered with."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(f"{code}: {message}")
        self.code = code
        self.details = message
