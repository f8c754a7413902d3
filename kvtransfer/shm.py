"""Same-host KV pushes through shared memory, with gRPC's checks and none of its copies.

The sender writes the KV into an anonymous memory file (memfd), seals it against any change and
passes its descriptor to the decode worker over a Unix socket; the receiver verifies the
header, the seals and the checksum, then stages the file's pages themselves, mapped privately
(a CUDA worker copies them into pinned memory instead). One copy in all, no KV byte crosses a
socket, nothing is named in a file system, and the kernel frees the memory when the last
descriptor and mapping go: a worker killed mid-transfer leaves no segment behind. (The pages are
charged to the sender's memory cgroup: containers that share a network namespace and have
memory limits should leave the prefill side room for the decode side's staged KV, or use
kv_transport: grpc.)

KV in CUDA memory goes over the same socket as a CUDA IPC handle instead of a memory file
(`device=True`; kvtransfer.cuda_ipc), with every check below.

The socket lives in the abstract namespace under the decode worker's gRPC port, so it is
reachable exactly where a prefill worker shares the decode worker's network namespace (`baton
up`, compose's host network, containers of one pod) and a push targets a local address; anywhere
else the sender is told `NoSharedMemoryPeer` at once and uses gRPC. The checks are gRPC's: the
cluster token, the push token the request's Decode call registered, model and shape, checksum,
the staging wait. Only processes of the receiver's own user (or root) may connect. A receiver
still waiting for staging room says so every HEARTBEAT_S; one silent for CHUNK_IDLE_TIMEOUT_S
(stopped, hung) is given up, as a gRPC push's keepalive would.
"""
from __future__ import annotations

import contextlib
import ctypes
import errno
import fcntl
import ipaddress
import itertools
import json
import logging
import mmap
import os
import socket
import struct
import threading
import time
import weakref
import zlib
from concurrent.futures import ThreadPoolExecutor

import torch

from baton.auth import TokenCheck
from baton.v1 import kvtransfer_pb2 as pb
from baton.engine.kv import SequenceKV
import baton.kvtransfer.cuda_ipc as cuda_ipc
from baton.kvtransfer.errors import KVBadStream, KVNoDeviceIPC, KVPushFailed, KVTransferError
from baton.kvtransfer.receiver import Receiver
from baton.kvtransfer.sender import _check_sendable, kv_header
from baton.kvtransfer.wire import CHUNK_IDLE_TIMEOUT_S, DEFAULT_CHUNK_BYTES, MAX_METADATA_BYTES

log = logging.getLogger(__name__)

MAGIC = b"BKV1"
DEVICE_MAGIC = b"BKD1"  # the KV is in CUDA memory: a description of its handle follows the token
_PREFIX = struct.Struct("<4sIH")  # magic, crc32 of the KV bytes, cluster-token length
_DESCRIPTION = struct.Struct("<I")  # a device push's description (JSON) length
MAX_REQUEST_BYTES = MAX_METADATA_BYTES + (64 << 10)  # header (metadata included) and token
HEARTBEAT_S = 0.25
CONNECT_TIMEOUT_S = 1.0
SEALS = fcntl.F_SEAL_SEAL | fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_WRITE
MAX_WAITING_PUSHES = 64  # pushes accepted beyond the handler threads are refused, not queued forever
SEAL_TRIES = 4  # the write seal asked for again while the kernel finds a page briefly in use
INLINE_CRC_BYTES = 8 << 20  # below this the sender checksums the KV before writing it, not beside


class NoSharedMemoryPeer(Exception):
    """Nothing listens for shared-memory pushes for that target here: push over gRPC instead."""


class NoDeviceIPC(Exception):
    """The decode worker cannot open this sender's CUDA memory (kvtransfer.cuda_ipc): push the
    bytes through a memory file instead. Nothing was reserved."""


def socket_name(port: int) -> bytes:
    """The abstract Unix socket a decode worker serving gRPC on `port` takes pushes on."""
    return b"\0baton-kv/%d" % port


def local_port(target: str) -> int | None:
    """The port of `target` (host:port) if its host is an address of this network namespace (one
    a socket could bind), else None. Names other than `localhost` are not resolved: no DNS on
    the push path."""
    host, sep, port = target.rpartition(":")
    if not sep or not port.isdigit():
        return None
    host = host.strip("[]")
    if host == "localhost":
        return int(port)
    try:
        address = ipaddress.ip_address(host)
    except ValueError:
        return None
    if address.is_loopback:
        return int(port)
    family = socket.AF_INET6 if address.version == 6 else socket.AF_INET
    with socket.socket(family, socket.SOCK_DGRAM) as probe:
        try:
            probe.bind((host, 0))
        except OSError:
            return None
    return int(port)


class _Unauthenticated(KVTransferError):
    code = "UNAUTHENTICATED"


# -- sender -------------------------------------------------------------------------------------

def push_kv_shm(port: int, request_id: str, fingerprint: str, kv: SequenceKV, metadata: bytes = b"",
                push_token: str = "", cluster_token: str | None = None, timeout_s: float | None = None,
                device: bool = False) -> pb.PushReply:
    """Push kv to the decode worker on this host serving gRPC on `port`. `device` (kv in CUDA
    memory): hand over a CUDA IPC handle to a device copy of it instead of a memory file
    (kvtransfer.cuda_ipc).

    Raises NoSharedMemoryPeer when no decode worker listens for it here (nothing was sent),
    NoDeviceIPC when it cannot open the handle, and KVPushFailed with gRPC's status names
    otherwise: UNAVAILABLE when the receiver went silent or the connection broke (the push may
    be retried, over gRPC too), the receiver's refusal codes as a gRPC push would get them."""
    _check_sendable(request_id, kv, metadata, DEFAULT_CHUNK_BYTES)
    header = kv_header(request_id, fingerprint, kv, metadata, DEFAULT_CHUNK_BYTES, push_token)
    token = (cluster_token or "").encode()
    deadline = None if timeout_s is None else time.monotonic() + timeout_s
    if device:
        return _push_device(port, request_id, kv, header, token, deadline)
    # The memory file first, then the connection: the receiver gives a connection a second for its
    # frame, and copying a long prompt's KV on a busy host can take longer (it closed, the send
    # broke, the copy was made again).
    try:
        fd, crc = _sealed_copy(kv, request_id)
    except OSError as exc:  # no memory or descriptors for the file here: gRPC needs neither
        raise KVPushFailed("UNAVAILABLE", f"no memory file for the shared-memory push of {request_id!r}: "
                           f"{exc}") from None
    try:  # the receiver takes its own descriptor: the memory goes when it is done with it
        return _exchange(port, request_id, _PREFIX.pack(MAGIC, crc, len(token)) + token + header.SerializeToString(),
                         [fd], deadline)
    finally:
        os.close(fd)


def _push_device(port: int, request_id: str, kv: SequenceKV, header: pb.KVHeader, token: bytes,
                 deadline: float | None) -> pb.PushReply:
    try:
        description, copy = cuda_ipc.export(kv.data)  # kept until the receiver answered
    except KVNoDeviceIPC as exc:
        raise NoDeviceIPC(str(exc)) from None
    blob = json.dumps(description).encode()
    frame = (_PREFIX.pack(DEVICE_MAGIC, 0, len(token)) + token + _DESCRIPTION.pack(len(blob)) + blob
             + header.SerializeToString())
    sent: list[bool] = []
    try:
        return _exchange(port, request_id, frame, [], deadline, sent)
    except (NoSharedMemoryPeer, NoDeviceIPC, KVPushFailed) as failure:
        # Never sent, or refused before the receiver opened the handle: its reference is ours to
        # give up. (A receiver gone silent may still hold it: torch frees the copy once it lets go.)
        if not sent or getattr(failure, "handle_opened", None) is False:
            cuda_ipc.release(description)
        raise
    finally:
        del copy
        cuda_ipc.collect()


def _exchange(port: int, request_id: str, frame: bytes, fds: list[int], deadline: float | None,
              sent: list[bool] | None = None) -> pb.PushReply:
    """Send one push's frame (and descriptors) to the receiver for `port`; its reply. `sent` is
    told once the frame is out."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET | socket.SOCK_CLOEXEC) as sock:
        sock.settimeout(CONNECT_TIMEOUT_S)
        try:
            sock.connect(socket_name(port))
        except (ConnectionRefusedError, FileNotFoundError) as exc:
            raise NoSharedMemoryPeer(f"no decode worker takes shared-memory pushes for port {port} here") from exc
        except OSError as exc:  # its backlog is full, say: gRPC may still get through
            raise KVPushFailed("UNAVAILABLE", f"could not connect for the shared-memory push of {request_id!r}: "
                               f"{exc}") from None
        try:
            socket.send_fds(sock, [frame], fds)
        except OSError as exc:
            raise KVPushFailed("UNAVAILABLE", f"the shared-memory push of {request_id!r} broke: {exc}") from None
        if sent is not None:
            sent.append(True)
        return _await_reply(sock, request_id, deadline)


def _sealed_copy(kv: SequenceKV, request_id: str) -> tuple[int, int]:
    """A memory file holding kv's bytes, sealed so neither side can change it; (fd, crc32).

    write(2) fills the file (the kernel allocates its pages as it copies, with no page faults),
    while another thread checksums the same bytes (zlib lets go of the GIL); a short prompt's KV
    is checksummed first instead, where a thread would cost more than it saves."""
    raw = memoryview(kv.data.detach().to("cpu").contiguous().view(torch.uint8).reshape(-1).numpy())
    fd = os.memfd_create(f"baton-kv-{request_id[:64]}", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    crc: list[int] = []
    summing = None
    if len(raw) < INLINE_CRC_BYTES:
        crc.append(zlib.crc32(raw))
    else:
        summing = threading.Thread(target=lambda: crc.append(zlib.crc32(raw)), name="kv-shm-crc")
        summing.start()
    try:
        written = 0
        while written < len(raw):
            written += os.write(fd, raw[written:])
        _seal(fd)
    except BaseException:
        os.close(fd)
        raise
    finally:
        if summing is not None:
            summing.join()
    return fd, crc[0]


def _seal(fd: int, tries: int = SEAL_TRIES) -> None:
    """Seal fd against any change. The kernel refuses the write seal (EBUSY) while some page of
    the file still holds a passing extra reference, after waiting ~150 ms for it to go. Seen once
    on a busy 2-vCPU host with an 8,000-token prompt's KV (the push then went by gRPC, several
    times slower); the reference is gone by a later try."""
    for attempt in range(tries):
        try:
            fcntl.fcntl(fd, fcntl.F_ADD_SEALS, SEALS)
            return
        except OSError as exc:
            if exc.errno != errno.EBUSY or attempt == tries - 1:
                raise
            time.sleep(0.05)


_libc = ctypes.CDLL(None, use_errno=True)
_libc.mmap.restype = ctypes.c_void_p
_libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
_libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
_MAP_FAILED = ctypes.c_void_p(-1).value


def _map_private(fd: int, size: int):
    """A writable private mapping of fd as a buffer, unmapped when the last object using it goes.
    (Python's mmap would keep a duplicate of fd open as long as the mapping lives: one descriptor
    per staged KV.)"""
    address = _libc.mmap(None, size, mmap.PROT_READ | mmap.PROT_WRITE, mmap.MAP_PRIVATE, fd, 0)
    if address in (None, _MAP_FAILED):
        raise OSError(ctypes.get_errno(), f"mmap of a {size}-byte KV memory file failed")
    buffer = (ctypes.c_uint8 * size).from_address(address)
    weakref.finalize(buffer, _libc.munmap, address, size)
    return buffer


def _await_reply(sock: socket.socket, request_id: str, deadline: float | None) -> pb.PushReply:
    while True:
        wait = CHUNK_IDLE_TIMEOUT_S if deadline is None else min(CHUNK_IDLE_TIMEOUT_S, deadline - time.monotonic())
        if wait <= 0:
            raise KVPushFailed("DEADLINE_EXCEEDED", f"the shared-memory push of {request_id!r} ran out of time")
        sock.settimeout(wait)
        try:
            message = sock.recv(4096)
        except socket.timeout:
            if deadline is not None and time.monotonic() >= deadline:
                raise KVPushFailed("DEADLINE_EXCEEDED", f"the shared-memory push of {request_id!r} ran out of time") from None
            raise KVPushFailed("UNAVAILABLE", f"the decode worker went silent for {CHUNK_IDLE_TIMEOUT_S:.1f}s during "
                               f"the shared-memory push of {request_id!r}") from None
        except OSError as exc:
            raise KVPushFailed("UNAVAILABLE", f"the shared-memory push of {request_id!r} broke: {exc}") from None
        if not message:
            raise KVPushFailed("UNAVAILABLE", f"the decode worker closed the shared-memory push of {request_id!r}")
        try:
            reply = json.loads(message)
        except ValueError:
            raise KVPushFailed("UNAVAILABLE", f"the decode worker answered the shared-memory push of {request_id!r} "
                               "with something unreadable") from None
        if reply.get("waiting"):
            continue
        if "code" in reply:
            failure = NoDeviceIPC(reply.get("details", "")) if reply.get("no_device_ipc") else \
                KVPushFailed(reply["code"], reply.get("details", ""))
            failure.handle_opened = bool(reply.get("opened"))  # a device push's handle, by the receiver
            raise failure
        return pb.PushReply(request_id=request_id, bytes_received=reply["bytes"], num_chunks=1,
                            staging_wait_seconds=reply["staging_wait_s"], receive_seconds=reply["receive_s"])


# -- receiver -----------------------------------------------------------------------------------

class ShmKVServer:
    """Takes shared-memory pushes for the decode worker serving gRPC on `port` into `receiver`.

    `with ShmKVServer(receiver, port, token):` or start()/stop(). Refuses to start (OSError) if
    another process already takes that port's pushes."""

    def __init__(self, receiver: Receiver, port: int, cluster_token: str | None = None, max_workers: int = 8) -> None:
        self._receiver = receiver
        self._token = None if cluster_token is None else TokenCheck(cluster_token)
        self.port = port
        self._listener = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET | socket.SOCK_CLOEXEC)
        try:
            self._listener.bind(socket_name(port))
        except OSError:
            self._listener.close()
            raise
        self._listener.listen(128)
        self._handlers = ThreadPoolExecutor(max_workers, thread_name_prefix="kv-shm")
        self._waiting = threading.BoundedSemaphore(max_workers + MAX_WAITING_PUSHES)
        self._heartbeats = _Heartbeats()
        self._thread = threading.Thread(target=self._accept, name="kv-shm-accept", daemon=True)
        self._stopped = False

    def start(self) -> "ShmKVServer":
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stopped = True
        try:
            self._listener.shutdown(socket.SHUT_RDWR)  # wakes accept()
        except OSError:
            pass
        self._listener.close()
        self._thread.join(timeout=5)
        self._handlers.shutdown(wait=True, cancel_futures=True)
        self._heartbeats.stop()

    def __enter__(self) -> "ShmKVServer":
        return self.start()

    def __exit__(self, *exc_info: object) -> None:
        self.stop()

    def _accept(self) -> None:
        while not self._stopped:
            try:
                conn, _ = self._listener.accept()
            except OSError:
                if self._stopped:
                    return
                time.sleep(0.05)  # out of descriptors, say: do not spin
                continue
            if not self._waiting.acquire(blocking=False):
                _send(conn, {"code": "RESOURCE_EXHAUSTED", "details": "too many shared-memory pushes are waiting "
                                                                       "here; retry"})
                conn.close()
                continue
            self._handlers.submit(self._serve, conn)

    def _serve(self, conn: socket.socket) -> None:
        sending = threading.Lock()
        opened: list[bool] = []  # a device push's handle was opened here (the sender must not release it)
        try:
            with conn:
                try:
                    reply = self._receive(conn, sending, opened)
                except KVTransferError as err:
                    reply = {"code": err.code, "details": str(err), "no_device_ipc": isinstance(err, KVNoDeviceIPC)}
                except (socket.timeout, ConnectionError):
                    return  # the sender went away or never sent: nothing was reserved
                except Exception:
                    log.exception("shared-memory KV push failed unexpectedly")
                    reply = {"code": "INTERNAL", "details": "KV receiver failed unexpectedly; see the decode worker log"}
                reply["opened"] = bool(opened)  # the handle is closed by now: the error's frames went
                with sending:
                    _send(conn, reply)
        finally:
            self._waiting.release()

    def _receive(self, conn: socket.socket, sending: threading.Lock, opened: list[bool]) -> dict:
        self._check_peer(conn)
        conn.settimeout(CHUNK_IDLE_TIMEOUT_S)
        message, fds, flags, _ = socket.recv_fds(conn, MAX_REQUEST_BYTES, 1)
        try:
            if flags & (socket.MSG_TRUNC | socket.MSG_CTRUNC):
                raise KVBadStream(f"a shared-memory push is one frame of at most {MAX_REQUEST_BYTES} bytes")
            magic, crc, header, description = self._parse(message)
            if magic == DEVICE_MAGIC:
                if fds:
                    raise KVBadStream(f"KV for {header.request_id!r} in CUDA memory comes as a handle, not a file")
                with self._heartbeats.beating(conn, sending):
                    return _landed(self._receiver.receive_device(header, description,
                                                                 on_opened=lambda: opened.append(True)))
            if len(fds) != 1:
                raise KVBadStream("a shared-memory push carries one memory file")
            fd = fds[0]
            try:
                sealed = fcntl.fcntl(fd, fcntl.F_GET_SEALS) & SEALS == SEALS
            except OSError:  # a descriptor of something else (a file, a pipe, a socket)
                sealed = False
            if not sealed:
                raise KVBadStream(f"KV for {header.request_id!r}: send a memory file (memfd) sealed against writes")
            size = os.fstat(fd).st_size
            if size != header.total_bytes or size == 0:
                raise KVBadStream(f"KV for {header.request_id!r}: the memory file holds {size} bytes; the header "
                                  f"declares {header.total_bytes}")
            # The staged KV is these very pages (no copy): a private mapping, so a write to them
            # would copy the page for us alone; unmapped when the staged tensor goes.
            mapped = _map_private(fd, size)
            with self._heartbeats.beating(conn, sending):
                result = self._receiver.receive_whole(header, mapped, crc, adopt=True)
        finally:
            for fd in fds:
                os.close(fd)
        return _landed(result)

    def _check_peer(self, conn: socket.socket) -> None:
        creds = conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
        _, uid, _ = struct.unpack("3i", creds)
        if uid not in (0, os.getuid()):
            raise _Unauthenticated(f"shared-memory pushes are taken only from user {os.getuid()} (got {uid})")

    def _parse(self, message: bytes) -> tuple[bytes, int, pb.KVHeader, dict | None]:
        """(magic, crc32, header, a device push's handle description or None) of a checked frame."""
        if len(message) < _PREFIX.size:
            raise KVBadStream("a shared-memory push frame is too short")
        magic, crc, token_length = _PREFIX.unpack_from(message)
        if magic not in (MAGIC, DEVICE_MAGIC):
            raise KVBadStream("not a Baton shared-memory KV push")
        token = message[_PREFIX.size:_PREFIX.size + token_length]
        if self._token is not None and not self._token.matches(token):
            raise _Unauthenticated("the cluster credential is missing or not valid for this worker; check "
                                   "cluster.token")
        rest, description = message[_PREFIX.size + token_length:], None
        if magic == DEVICE_MAGIC:
            (length,) = _DESCRIPTION.unpack_from(rest) if len(rest) >= _DESCRIPTION.size else (-1,)
            if not 0 < length <= min(cuda_ipc.MAX_DESCRIPTION_BYTES, len(rest) - _DESCRIPTION.size):
                raise KVBadStream("a device KV push's handle description is missing or too long")
            try:
                description = json.loads(rest[_DESCRIPTION.size:_DESCRIPTION.size + length])
            except ValueError:
                raise KVBadStream("a device KV push's handle description is not JSON") from None
            rest = rest[_DESCRIPTION.size + length:]
        header = pb.KVHeader()
        try:
            header.ParseFromString(rest)
        except Exception:  # noqa: BLE001 - protobuf's DecodeError, whatever its module
            raise KVBadStream("the shared-memory push's header does not parse") from None
        return magic, crc, header, description


class _Heartbeats:
    """One thread that tells every sender whose push has waited HEARTBEAT_S or more (mostly: for
    staging room) that the receiver is alive: a push that lands at once costs no thread."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._beating: dict[int, tuple[socket.socket, threading.Lock, float]] = {}  # key -> conn, lock, since
        self._keys = itertools.count()
        self._stopped = False
        self._thread: threading.Thread | None = None

    @contextlib.contextmanager
    def beating(self, conn: socket.socket, sending: threading.Lock):
        with self._cond:
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="kv-shm-heartbeat", daemon=True)
                self._thread.start()
            key = next(self._keys)
            self._beating[key] = (conn, sending, time.monotonic())
            self._cond.notify()
        try:
            yield
        finally:
            with self._cond:
                del self._beating[key]

    def stop(self) -> None:
        with self._cond:
            self._stopped = True
            self._cond.notify()
        if self._thread is not None:
            self._thread.join(timeout=5)

    def _run(self) -> None:
        while True:
            with self._cond:
                if self._stopped:
                    return
                if not self._beating:
                    self._cond.wait()
                    continue
                self._cond.wait(HEARTBEAT_S)
                now = time.monotonic()
                due = [(conn, sending) for conn, sending, since in self._beating.values() if now - since >= HEARTBEAT_S]
            for conn, sending in due:  # a push that ended meanwhile may get a beat after its reply: ignored
                if sending.acquire(blocking=False):
                    try:
                        _send(conn, {"waiting": True})
                    finally:
                        sending.release()


def _landed(result) -> dict:
    """The reply to a push whose KV landed (a Receiver's ReceiveResult)."""
    return {"bytes": result.nbytes, "staging_wait_s": result.staging_wait_seconds, "receive_s": result.receive_seconds}


def _send(conn: socket.socket, reply: dict) -> None:
    try:
        conn.settimeout(CHUNK_IDLE_TIMEOUT_S)
        conn.send(json.dumps(reply).encode())
    except OSError as exc:
        if exc.errno not in (errno.EPIPE, errno.ECONNRESET, None):
            log.debug("could not answer a shared-memory push: %s", exc)
