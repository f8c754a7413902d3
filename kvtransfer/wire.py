"""Wire-format constants and the few conversions both ends share (dtype names, checksums)."""
from __future__ import annotations

import sys
import zlib

import torch

# The size limits live with the other gRPC settings, which the configuration also checks against.
from baton.transport import (  # noqa: F401 - part of the wire format's surface
    _MESSAGE_OVERHEAD_BYTES, DEFAULT_CHUNK_BYTES, MAX_CHUNK_BYTES, MAX_METADATA_BYTES, RECONNECT_OPTIONS,
    SERVER_MIN_PING_INTERVAL_MS, connect_deadline_options, grpc_message_limit, keepalive_options,
    max_chunk_bytes_within)

# The raw bytes are sent as this host holds them; every platform we run on is little-endian,
# and the proto promises little-endian, so refuse to run rather than send misordered bytes.
if sys.byteorder != "little":
    raise ImportError("kvtransfer sends raw little-endian tensor bytes; this host is big-endian")

_DTYPES_BY_NAME: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
}


def dtype_name(dtype: torch.dtype) -> str:
    for name, candidate in _DTYPES_BY_NAME.items():
        if candidate == dtype:
            return name
    raise ValueError(f"KV dtype {dtype} cannot be sent; supported: {', '.join(_DTYPES_BY_NAME)}")


def dtype_from_name(name: str) -> torch.dtype | None:
    """None for a name this side does not know."""
    return _DTYPES_BY_NAME.get(name)


def checksum(payload: bytes | memoryview) -> int:
    return zlib.crc32(payload)


def grpc_channel_options(chunk_bytes: int = MAX_CHUNK_BYTES) -> list[tuple[str, int]]:
    """Options for both the sending channel and the receiving server."""
    limit = grpc_message_limit(chunk_bytes)
    return [("grpc.max_send_message_length", limit), ("grpc.max_receive_message_length", limit)]


# A broken push is noticed within about a second, whatever broke:
# - the receiver's process or connection is gone: the socket is refused or reset at once;
# - the peer or the network hangs (no reset): the sender pings the receiver's transport every
#   PUSH_KEEPALIVE_MS while a push is open and drops the connection when a ping is not answered
#   within PUSH_KEEPALIVE_TIMEOUT_MS. Pings are answered by the transport, so a receiver that is
#   only waiting for staging room (no data read for seconds) is not mistaken for a dead one;
# - a connection that never completes its handshake is given up after PUSH_CONNECT_TIMEOUT_MS.
# Receiving servers must let peers ping that often (baton.transport.SERVER_MIN_PING_INTERVAL_MS),
# or they answer with GOAWAY "too_many_pings" and cut the push.
PUSH_KEEPALIVE_MS = 500
PUSH_KEEPALIVE_TIMEOUT_MS = 500
PUSH_CONNECT_TIMEOUT_MS = 1000
# The receiver's side of the same promise: once it waits for the next message of a push, the
# sender (which holds the whole KV in memory) has no reason to pause; a stream silent this long
# is cut off and its staging bytes freed, so a retry of the same request id can land.
CHUNK_IDLE_TIMEOUT_S = 1.0
# A streamed push (layout TOKEN_SPANS) pauses while its sender prefills the next chunk of the
# prompt: a pause is allowed this long (a sender that died resets the connection at once anyway).
STREAM_IDLE_TIMEOUT_S = 30.0
# ...and a stream that keeps sending, but slower than this once PUSH_RATE_GRACE_S have passed,
# is cut too: a sender holding the KV in memory streams it at memory or network speed, while a
# trickle would hold its staging room (and starve every other push) for as long as it liked.
MIN_PUSH_BYTES_PER_S = 4 << 20
PUSH_RATE_GRACE_S = 2.0
# A sender cut off by the network (no reset reaches the receiver) would hold a streamed push's
# staging room for STREAM_IDLE_TIMEOUT_S: the receiver pings its senders while pushes are open and
# drops the connection, with its pushes, when a ping goes unanswered.
RECEIVER_KEEPALIVE_MS = 1000
RECEIVER_KEEPALIVE_TIMEOUT_MS = 1000
# So a broken attempt is still held by its receiver at most this long after the break: a retry
# that finds it (ALREADY_EXISTS) waits this out.
STALE_ATTEMPT_HELD_S = max(CHUNK_IDLE_TIMEOUT_S, (RECEIVER_KEEPALIVE_MS + RECEIVER_KEEPALIVE_TIMEOUT_MS) / 1000)


def grpc_push_channel_options() -> list[tuple[str, int]]:
    """Liveness options for a channel that pushes KV (keepalive pings, connect timeout, quick
    reconnects to a restarted receiver); add them to the channel's message-size options."""
    return [
        *keepalive_options(PUSH_KEEPALIVE_MS, PUSH_KEEPALIVE_TIMEOUT_MS),
        *connect_deadline_options(PUSH_CONNECT_TIMEOUT_MS),
        *RECONNECT_OPTIONS,
    ]


def grpc_server_ping_options() -> list[tuple[str, int]]:
    """What a server receiving KV pushes needs: senders' keepalive pings are welcome, and it pings
    them in turn (RECEIVER_KEEPALIVE_MS), to drop a push whose sender went silent."""
    return [("grpc.http2.min_ping_interval_without_data_ms", SERVER_MIN_PING_INTERVAL_MS),
            *keepalive_options(RECEIVER_KEEPALIVE_MS, RECEIVER_KEEPALIVE_TIMEOUT_MS)]
