"""The gRPC transport: a servicer that only translates to and from the Receiver, and a client.

Decode workers add `KVTransferServicer` to their own server with
`grpc_channel_options()` and `grpc_server_ping_options()` as server options; `KVTransferServer`
is a standalone server for tests, benchmarks and single-purpose processes. Prefill workers call
`push_kv_retrying` (or `push_kv`, one attempt) on a channel with `grpc_push_channel_options()`.

A broken push is reported within about a second (wire.py says how each kind of break is
noticed) and retried when the break was the connection's or the stream's, not the KV's.
"""
from __future__ import annotations

import contextlib
import itertools
import logging
import threading
import time
from concurrent import futures
from dataclasses import dataclass
from typing import Callable

import grpc

from baton.v1 import kvtransfer_pb2 as pb
from baton.v1 import kvtransfer_pb2_grpc as pb_grpc
from baton.engine.kv import KVShape, SequenceKV
from baton.kvtransfer.errors import KVPushFailed, KVTransferError
from baton.kvtransfer.nixl import LIBRARY, NixlWrites
from baton.kvtransfer.receiver import ReceiveResult, Receiver
from baton.kvtransfer.sender import SpanAborted, SpanSource, encode, encode_spans
from baton.kvtransfer.wire import (
    CHUNK_IDLE_TIMEOUT_S,
    DEFAULT_CHUNK_BYTES,
    STALE_ATTEMPT_HELD_S,
    STREAM_IDLE_TIMEOUT_S,
    grpc_channel_options,
    grpc_push_channel_options,
    grpc_server_ping_options,
)

log = logging.getLogger(__name__)


def result_to_proto(result: ReceiveResult) -> pb.PushReply:
    return pb.PushReply(
        request_id=result.request_id,
        bytes_received=result.nbytes,
        num_chunks=result.num_chunks,
        staging_wait_seconds=result.staging_wait_seconds,
        receive_seconds=result.receive_seconds,
    )


class _Watchdog:
    """One thread that runs a callback when its deadline passes, unless disarmed first."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._armed: dict[int, tuple[float, Callable[[], None]]] = {}
        self._keys = itertools.count()
        self._thread: threading.Thread | None = None

    def arm(self, delay_s: float, fire: Callable[[], None]) -> int:
        with self._cond:
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="kv-idle-watchdog", daemon=True)
                self._thread.start()
            key = next(self._keys)
            self._armed[key] = (time.monotonic() + delay_s, fire)
            self._cond.notify()
            return key

    def disarm(self, key: int) -> None:
        with self._cond:
            self._armed.pop(key, None)

    def _run(self) -> None:
        while True:
            with self._cond:
                now = time.monotonic()
                due = [key for key, (deadline, _) in self._armed.items() if deadline <= now]
                fired = [self._armed.pop(key)[1] for key in due]
                if not fired:
                    wait = min((d for d, _ in self._armed.values()), default=now + 60.0) - now
                    self._cond.wait(wait)
                    continue
            for fire in fired:
                try:
                    fire()
                except Exception:  # noqa: BLE001 - a watchdog must outlive one bad callback
                    log.exception("KV idle watchdog callback failed")


_WATCHDOG = _Watchdog()


class _IdleGuard:
    """The request stream of one push, cut off (the call cancelled) when the receiver has waited
    `idle_s` for the next message: a sender that holds its KV in memory never pauses that long,
    so the sender or the network is gone; its staging bytes must not wait for TCP to notice."""

    def __init__(self, requests, idle_s: float | None, context) -> None:
        self._requests = iter(requests)
        self.idle_s = idle_s
        self._context = context
        self._first = True
        self.stalled = False

    def __iter__(self) -> "_IdleGuard":
        return self

    def __next__(self):
        if self.idle_s is None:
            return next(self._requests)
        key = _WATCHDOG.arm(self.idle_s, self._stall)
        try:
            message = next(self._requests)
        finally:
            _WATCHDOG.disarm(key)
        if self._first:  # a streamed push pauses while its sender computes: allowed longer
            self._first = False
            if message.WhichOneof("kind") == "header" and message.header.layout == pb.KV_LAYOUT_TOKEN_SPANS:
                self.idle_s = max(self.idle_s, STREAM_IDLE_TIMEOUT_S)
        return message

    def _stall(self) -> None:
        self.stalled = True
        self._context.cancel()


class KVTransferServicer(pb_grpc.KVTransferServicer):
    """Push for gRPC's own stream; OpenWrite and CloseWrite for writes through a transfer library
    (`writes`, kvtransfer.nixl; None: this worker takes none)."""

    def __init__(self, receiver: Receiver, idle_timeout_s: float | None = CHUNK_IDLE_TIMEOUT_S,
                 writes: NixlWrites | None = None) -> None:
        self._receiver = receiver
        self._idle_timeout_s = idle_timeout_s
        self._writes = writes

    def OpenWrite(self, request: pb.WriteOpen, context: grpc.ServicerContext) -> pb.WriteTarget:
        if request.library != LIBRARY or self._writes is None or self._writes.available() is not None:
            why = (self._writes.available() if self._writes is not None and request.library == LIBRARY
                   else "it is not enabled")
            context.abort(grpc.StatusCode.FAILED_PRECONDITION,
                          f"library: this decode worker takes no {request.library!r} writes ({why}); use Push")
        with _refusals(context, "KV write"):
            return self._writes.open(request.header, timeout_s=context.time_remaining())

    def CloseWrite(self, request: pb.WriteClose, context: grpc.ServicerContext) -> pb.PushReply:
        if self._writes is None:
            context.abort(grpc.StatusCode.FAILED_PRECONDITION, "this decode worker takes no library writes")
        with _refusals(context, "KV write"):
            result = self._writes.close(request)
        return pb.PushReply() if result is None else result_to_proto(result)

    def Push(self, request_iterator, context: grpc.ServicerContext) -> pb.PushReply:
        stream = _IdleGuard(request_iterator, self._idle_timeout_s, context)
        try:
            result = self._receiver.receive(stream, timeout_s=context.time_remaining())
        except (KVTransferError, grpc.RpcError) as err:
            if stream.stalled:
                # The receiver freed the reservation; the sender sees its own broken connection.
                log.warning("KV stream went silent for %.1fs; cut off", stream.idle_s)
                context.abort(grpc.StatusCode.ABORTED, f"no KV data arrived for {stream.idle_s:.1f}s; "
                              "the stream was cut off (retry the push)")
            if isinstance(err, KVTransferError):
                context.abort(grpc.StatusCode[err.code], str(err))
            # The request stream broke: the client cancelled, its deadline passed or the
            # connection dropped. The receiver already freed its reservation.
            context.abort(grpc.StatusCode.CANCELLED, "KV stream broken off by the sender")
        except Exception:
            log.exception("KV push failed unexpectedly")
            context.abort(grpc.StatusCode.INTERNAL, "KV receiver failed unexpectedly; see the decode worker log")
        return result_to_proto(result)


@contextlib.contextmanager
def _refusals(context: grpc.ServicerContext, what: str):
    """A KVTransferError becomes its status; anything else is logged and INTERNAL."""
    try:
        yield
    except KVTransferError as err:
        context.abort(grpc.StatusCode[err.code], str(err))
    except Exception:
        log.exception("%s failed unexpectedly", what)
        context.abort(grpc.StatusCode.INTERNAL, f"{what} failed unexpectedly; see the decode worker log")


class KVTransferServer:
    """A gRPC server running only KVTransfer; `with KVTransferServer(r) as s: push_kv(s.target, ...)`."""

    def __init__(self, receiver: Receiver, host: str = "127.0.0.1", port: int = 0, max_workers: int = 8,
                 writes: NixlWrites | None = None) -> None:
        options = grpc_channel_options(receiver.config.max_chunk_bytes) + grpc_server_ping_options()
        self._server = grpc.server(futures.ThreadPoolExecutor(max_workers=max_workers), options=options)
        self._writes = writes
        pb_grpc.add_KVTransferServicer_to_server(KVTransferServicer(receiver, writes=writes), self._server)
        self.port = self._server.add_insecure_port(f"{host}:{port}")
        if self.port == 0:
            raise OSError(f"could not bind the KV transfer server to {host}:{port}")
        self.target = f"{host}:{self.port}"

    def start(self) -> "KVTransferServer":
        self._server.start()
        return self

    def stop(self, grace_s: float | None = 1.0) -> None:
        self._server.stop(grace_s).wait()
        if self._writes is not None:
            self._writes.stop()

    def __enter__(self) -> "KVTransferServer":
        return self.start()

    def __exit__(self, *exc_info: object) -> None:
        self.stop()


def kvtransfer_channel(target: str) -> grpc.Channel:
    """A channel whose message limits fit any allowed chunk size, with the push liveness options;
    reuse it across pushes."""
    return grpc.insecure_channel(target, options=grpc_channel_options() + grpc_push_channel_options())


def push_kv(
    channel_or_target: grpc.Channel | str,
    request_id: str,
    fingerprint: str,
    kv: SequenceKV,
    metadata: bytes = b"",
    chunk_bytes: int = DEFAULT_CHUNK_BYTES,
    timeout_s: float | None = None,
    push_token: str = "",
) -> pb.PushReply:
    """Stream kv to a KVTransfer server; raises KVPushFailed with the status if it is refused.

    A target string opens (and closes) a channel for this push only; pass a channel from
    `kvtransfer_channel` to reuse the connection.
    """
    chunks = encode(request_id, fingerprint, kv, metadata, chunk_bytes, push_token)
    owned = isinstance(channel_or_target, str)
    channel = kvtransfer_channel(channel_or_target) if owned else channel_or_target
    try:
        return pb_grpc.KVTransferStub(channel).Push(chunks, timeout=timeout_s)
    except grpc.RpcError as err:
        raise KVPushFailed(err.code().name, err.details() or "") from None
    finally:
        if owned:
            channel.close()


def push_kv_stream(channel: grpc.Channel, request_id: str, fingerprint: str, shape: KVShape, source: SpanSource,
                   chunk_bytes: int = DEFAULT_CHUNK_BYTES, timeout_s: float | None = None,
                   push_token: str = "") -> pb.PushReply:
    """Stream a prompt's KV while it is prefilled (one attempt: a broken stream is not replayed
    here; the caller pushes the whole KV instead). Raises KVPushFailed."""
    spans = encode_spans(request_id, fingerprint, shape, source, chunk_bytes, push_token)
    aborted: list[str] = []

    def chunks():
        try:
            yield from spans
        except SpanAborted as why:  # cancel the call (an exception here would be logged as gRPC's)
            aborted.append(str(why))
            call.cancel()

    call = pb_grpc.KVTransferStub(channel).Push.future(chunks(), timeout=timeout_s)
    try:
        return call.result()
    except grpc.FutureCancelledError:
        raise KVPushFailed("CANCELLED", f"the streamed push of {request_id!r} was broken off: "
                                        f"{aborted[0] if aborted else 'cancelled'}") from None
    except grpc.RpcError as err:
        raise KVPushFailed(err.code().name, err.details() or "") from None


# The stream or its connection broke (peer gone, reset, cut off, truncated): the KV itself was
# fine, so sending it again may land. Refusals of the KV (INVALID_ARGUMENT, RESOURCE_EXHAUSTED,
# FAILED_PRECONDITION, CANCELLED) and a spent deadline are final.
RETRYABLE_PUSH_CODES = frozenset({"UNAVAILABLE", "ABORTED"})


@dataclass(frozen=True)
class PushRetry:
    attempts: int = 3  # the first push and up to two retries
    backoff_s: float = 0.2  # before the first retry; tripled before each next one

    def __post_init__(self) -> None:
        if self.attempts < 1 or self.backoff_s < 0:
            raise ValueError(f"PushRetry needs attempts >= 1 and backoff_s >= 0, got {self}")


@dataclass(frozen=True)
class PushOutcome:
    reply: pb.PushReply
    attempts: int
    failures: tuple[KVPushFailed, ...]  # of the attempts before the one that landed


# How long after the receiver's idle cut-off a retry of a stale (still held) attempt waits.
STALE_ATTEMPT_MARGIN_S = 0.2


def push_kv_retrying(
    channel_or_target: grpc.Channel | str | Callable[[], grpc.Channel],
    request_id: str,
    fingerprint: str,
    kv: SequenceKV,
    metadata: bytes = b"",
    chunk_bytes: int = DEFAULT_CHUNK_BYTES,
    timeout_s: float | None = None,
    retry: PushRetry = PushRetry(),
    should_stop: Callable[[], bool] = lambda: False,
    on_retry: Callable[[int, KVPushFailed], None] | None = None,
    push_token: str = "",
) -> PushOutcome:
    """push_kv, retried while the failure is the connection's or the stream's (RETRYABLE_PUSH_CODES).

    timeout_s bounds the whole push, retries included. A push that finds the request id
    ALREADY_EXISTS is retried too: the receiver still holds a broken attempt, ours or that of a
    worker that died mid-push and whose prompt we were given again, and drops it within
    STALE_ATTEMPT_HELD_S. should_stop() (e.g. the request was cancelled) ends the retries;
    on_retry(attempt, failure) is told before each retry. A callable is asked for the channel before
    each attempt: its owner may replace a channel that could not connect (gRPC fails calls on it at
    once until its reconnect backoff ends) before the retry. Raises the last KVPushFailed.
    """
    owned = isinstance(channel_or_target, str)
    channel = kvtransfer_channel(channel_or_target) if owned else channel_or_target
    channel_for_attempt = channel if callable(channel) else lambda: channel
    deadline = None if timeout_s is None else time.monotonic() + timeout_s
    failures: list[KVPushFailed] = []
    attempt = tries = 0  # tries: attempts that count against retry.attempts
    first_failed_at = 0.0
    try:
        while True:
            attempt += 1
            tries += 1
            remaining = None if deadline is None else deadline - time.monotonic()
            if remaining is not None and remaining <= 0:
                raise KVPushFailed("DEADLINE_EXCEEDED", f"the KV push of {request_id!r} ran out of time after "
                                   f"{attempt - 1} attempts") from (failures[-1] if failures else None)
            try:
                reply = push_kv(channel_for_attempt(), request_id, fingerprint, kv, metadata, chunk_bytes, remaining,
                                push_token)
                return PushOutcome(reply, attempt, tuple(failures))
            except KVPushFailed as failure:
                failures.append(failure)
                now = time.monotonic()
                first_failed_at = first_failed_at or now
                retryable = failure.code in RETRYABLE_PUSH_CODES
                pause = retry.backoff_s * 3 ** (tries - 1)
                if failure.code == "ALREADY_EXISTS":
                    # A broken attempt is still held there: the receiver drops a whole push's
                    # CHUNK_IDLE_TIMEOUT_S after the break, any at the latest STALE_ATTEMPT_HELD_S
                    # after it. Wait that out, asking again every backoff; it costs no try.
                    ready_at = first_failed_at + CHUNK_IDLE_TIMEOUT_S + STALE_ATTEMPT_MARGIN_S
                    dropped_by = first_failed_at + STALE_ATTEMPT_HELD_S + STALE_ATTEMPT_MARGIN_S
                    retryable = now < dropped_by + CHUNK_IDLE_TIMEOUT_S
                    pause, tries = max(retry.backoff_s, ready_at - now), tries - 1
                out_of_time = deadline is not None and now + pause >= deadline
                if not retryable or tries >= retry.attempts or out_of_time or should_stop():
                    if len(failures) > 1:
                        raise KVPushFailed(failure.code, f"{failure.details} (attempt {attempt} of the push; "
                                           f"first failure: {failures[0]})") from None
                    raise
                if on_retry is not None:
                    on_retry(attempt, failure)
                time.sleep(pause)
    finally:
        if owned:
            channel.close()
