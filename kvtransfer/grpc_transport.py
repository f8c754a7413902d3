"""The gRPC transport: a servicer that only translates to and from the Receiver, and a client.

Decode workers add `KVTransferServicer` to their own server (`add_kvtransfer_servicer`) with
`grpc_channel_options()` as server options; `KVTransferServer` is a standalone server for
tests, benchmarks and single-purpose processes. Prefill workers call `push_kv`.
"""
from __future__ import annotations

import logging
from concurrent import futures

import grpc

from baton.v1 import kvtransfer_pb2 as pb
from baton.v1 import kvtransfer_pb2_grpc as pb_grpc
from engine.kv import SequenceKV
from kvtransfer.errors import KVPushFailed, KVTransferError
from kvtransfer.receiver import ReceiveResult, Receiver
from kvtransfer.sender import encode
from kvtransfer.wire import DEFAULT_CHUNK_BYTES, grpc_channel_options

log = logging.getLogger(__name__)


def result_to_proto(result: ReceiveResult) -> pb.PushReply:
    return pb.PushReply(
        request_id=result.request_id,
        bytes_received=result.nbytes,
        num_chunks=result.num_chunks,
        staging_wait_seconds=result.staging_wait_seconds,
        receive_seconds=result.receive_seconds,
    )


class KVTransferServicer(pb_grpc.KVTransferServicer):
    def __init__(self, receiver: Receiver) -> None:
        self._receiver = receiver

    def Push(self, request_iterator, context: grpc.ServicerContext) -> pb.PushReply:
        try:
            result = self._receiver.receive(request_iterator, timeout_s=context.time_remaining())
        except KVTransferError as err:
            context.abort(grpc.StatusCode[err.code], str(err))
        except grpc.RpcError:
            # The request stream broke: the client cancelled, its deadline passed or the
            # connection dropped. The receiver already freed its reservation.
            context.abort(grpc.StatusCode.CANCELLED, "KV stream broken off by the sender")
        except Exception:
            log.exception("KV push failed unexpectedly")
            context.abort(grpc.StatusCode.INTERNAL, "KV receiver failed unexpectedly; see the decode worker log")
        return result_to_proto(result)


def add_kvtransfer_servicer(server: grpc.Server, receiver: Receiver) -> None:
    pb_grpc.add_KVTransferServicer_to_server(KVTransferServicer(receiver), server)


class KVTransferServer:
    """A gRPC server running only KVTransfer; `with KVTransferServer(r) as s: push_kv(s.target, ...)`."""

    def __init__(self, receiver: Receiver, host: str = "127.0.0.1", port: int = 0, max_workers: int = 8) -> None:
        options = grpc_channel_options(receiver.config.max_chunk_bytes)
        self._server = grpc.server(futures.ThreadPoolExecutor(max_workers=max_workers), options=options)
        add_kvtransfer_servicer(self._server, receiver)
        self.port = self._server.add_insecure_port(f"{host}:{port}")
        if self.port == 0:
            raise OSError(f"could not bind the KV transfer server to {host}:{port}")
        self.target = f"{host}:{self.port}"

    def start(self) -> "KVTransferServer":
        self._server.start()
        return self

    def stop(self, grace_s: float | None = 1.0) -> None:
        self._server.stop(grace_s).wait()

    def __enter__(self) -> "KVTransferServer":
        return self.start()

    def __exit__(self, *exc_info: object) -> None:
        self.stop()


def kvtransfer_channel(target: str) -> grpc.Channel:
    """A channel whose message limits fit any allowed chunk size; reuse it across pushes."""
    return grpc.insecure_channel(target, options=grpc_channel_options())


def push_kv(
    channel_or_target: grpc.Channel | str,
    request_id: str,
    fingerprint: str,
    kv: SequenceKV,
    metadata: bytes = b"",
    chunk_bytes: int = DEFAULT_CHUNK_BYTES,
    timeout_s: float | None = None,
) -> pb.PushReply:
    """Stream kv to a KVTransfer server; raises KVPushFailed with the status if it is refused.

    A target string opens (and closes) a channel for this push only; pass a channel from
    `kvtransfer_channel` to reuse the connection.
    """
    chunks = encode(request_id, fingerprint, kv, metadata, chunk_bytes)
    owned = isinstance(channel_or_target, str)
    channel = kvtransfer_channel(channel_or_target) if owned else channel_or_target
    try:
        return pb_grpc.KVTransferStub(channel).Push(chunks, timeout=timeout_s)
    except grpc.RpcError as err:
        raise KVPushFailed(err.code().name, err.details() or "") from None
    finally:
        if owned:
            channel.close()
