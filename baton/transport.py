"""gRPC settings every Baton channel and server shares. The bottom floor: imports nothing of Baton's."""
from __future__ import annotations

import re

# KV chunks are a few MB; prompts and token streams are small. Bounded either way.
MAX_MESSAGE_BYTES = 16 << 20
GRPC_OPTIONS = [
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
    ("grpc.so_reuseport", 0),
]
# Servers let peers ping this often (gRPC's default cuts a peer off after two pings within 5
# minutes): KV pushes ping their receiver every 500 ms while open (kvtransfer.wire), the router
# its workers as often, to notice a hung peer within about a second.
SERVER_MIN_PING_INTERVAL_MS = 250
SERVER_OPTIONS = [*GRPC_OPTIONS, ("grpc.http2.min_ping_interval_without_data_ms", SERVER_MIN_PING_INTERVAL_MS)]
# A channel's peers are the cluster's own processes, and one that restarts comes back at its
# address (a container restart keeps its pod IP). gRPC fails every call on a channel that was
# refused, at once, until its reconnect backoff runs out: up to 120 s by default, so bounded to a
# second here. And it shares one connection, backoff included, among a process's channels to the
# same address, so a channel opened to a peer that has just come back would inherit another
# channel's refusal: each channel keeps its own.
RECONNECT_OPTIONS = [
    ("grpc.initial_reconnect_backoff_ms", 200),
    ("grpc.max_reconnect_backoff_ms", 1000),
    ("grpc.use_local_subchannel_pool", 1),
]
CHANNEL_OPTIONS = [*GRPC_OPTIONS, *RECONNECT_OPTIONS]


def connect_deadline_options(ms: int) -> list[tuple[str, int]]:
    """Give up a connection that has not completed its handshake within `ms` (a peer black-holed by
    the network, or a port held by something that never answers), not gRPC's 20 s minimum. gRPC
    takes its connect deadline from the minimum reconnect backoff."""
    return [("grpc.min_reconnect_backoff_ms", ms)]


def merge_options(*groups) -> list[tuple[str, object]]:
    """Channel or server options from `groups` in order, a later group's value winning for the same
    option (gRPC would keep both and honour one of them)."""
    merged: dict[str, object] = {}
    for group in groups:
        merged.update(group)
    return list(merged.items())


def keepalive_options(ping_every_ms: int, timeout_ms: int) -> list[tuple[str, int]]:
    """Channel options that ping the peer every `ping_every_ms` while calls are open and drop the
    connection when a ping is not answered within `timeout_ms`: a hung peer (stopped process, cut
    network) sends no reset, so nothing else would end the calls it holds before their deadlines."""
    return [
        ("grpc.keepalive_time_ms", ping_every_ms),
        ("grpc.keepalive_timeout_ms", timeout_ms),
        # Also for a flow-control (BDP) ping already in flight, which holds back the keepalive
        # ping and waits a minute by default.
        ("grpc.http2.ping_timeout_ms", timeout_ms),
        ("grpc.http2.max_pings_without_data", 0),  # a stream may carry no data for a while
        ("grpc.keepalive_permit_without_calls", 0),  # only while calls are open
    ]


# The KV wire format's sizes (kvtransfer.wire): a receiver refuses larger chunks, so one KVChunk
# message never exceeds MAX_CHUNK_BYTES plus framing.
DEFAULT_CHUNK_BYTES = 2 * 1024 * 1024
MAX_CHUNK_BYTES = 16 * 1024 * 1024
MAX_METADATA_BYTES = 64 * 1024
# Header fields, protobuf framing and metadata on top of the largest payload.
_MESSAGE_OVERHEAD_BYTES = MAX_METADATA_BYTES + 64 * 1024


def grpc_message_limit(chunk_bytes: int = MAX_CHUNK_BYTES) -> int:
    """gRPC max message length that fits one KVChunk carrying chunk_bytes of payload."""
    return chunk_bytes + _MESSAGE_OVERHEAD_BYTES


def max_chunk_bytes_within(message_limit: int) -> int:
    """The largest chunk_bytes whose KVChunk messages fit a gRPC message limit (and the wire's)."""
    return min(MAX_CHUNK_BYTES, message_limit - _MESSAGE_OVERHEAD_BYTES)


_HOST_PORT = re.compile(r"(\[[0-9A-Fa-f:.]+\]|[A-Za-z0-9.-]+):(\d{1,5})")


def check_address(address: str, what: str) -> str:
    """`address` when it is a plain host:port (no scheme, path or options), else ValueError."""
    match = _HOST_PORT.fullmatch(address)
    if match is None or not 0 < int(match.group(2)) < 65536:
        raise ValueError(f"{what} must be host:port (got {address[:100]!r})")
    return address
