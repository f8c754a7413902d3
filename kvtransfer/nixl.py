"""KV pushes through NIXL, the transfer library of Dynamo, llm-d and vLLM's disaggregated serving.

    prefill worker (initiator)                     decode worker (target)
    OpenWrite(header)            -- gRPC -->       checks it as a Push's header, reserves staging
                                                   room, registers the tensor the KV lands in
                                 <-- where to write (agent metadata, region)
    NIXL WRITE of the KV bytes   -- UCX -->        straight into that tensor; a notification follows
    CloseWrite(crc32)            -- gRPC -->       waits for the notification, checks the checksum,
                                                   lands the KV (or frees the room)

The control calls ride the decode worker's gRPC port, so they carry its cluster token and every
check a Push makes (push token, model, shape, size, staging wait); only the bytes take UCX, which
picks the fastest path the two hosts share (TCP here; RDMA or NVLink on a GPU cluster). UCX over
TCP does not check bytes end to end, so the sender's CRC-32 is checked before the KV lands. A room
opened and not closed in time (the sender died, the network broke) is freed by the receiver.

NIXL's progress thread moves the bytes (UCX over TCP needs both sides to make progress). Its Python
wrapper starts it polling without pause, a core spent whether or not anything moves; Baton starts
it with a long pause instead, which costs no speed: the thread wakes on UCX's events. The `nixl`
package is optional (`pip install 'baton-serve[nixl]'`);
without it OpenWrite answers that this worker takes no NIXL writes and pushes go over gRPC.
"""
from __future__ import annotations

import contextlib
import importlib
import logging
import os
import threading
import time
import uuid
from dataclasses import dataclass

import torch

from baton.engine.kv import SequenceKV
from baton.kvtransfer.errors import KVBadStream, KVPoolFull, KVPushFailed, KVTruncated
from baton.kvtransfer.receiver import OpenKV, ReceiveResult, Receiver
from baton.kvtransfer.wire import CHUNK_IDLE_TIMEOUT_S, MIN_PUSH_BYTES_PER_S, PUSH_RATE_GRACE_S, checksum
from baton.v1 import kvtransfer_pb2 as pb

log = logging.getLogger(__name__)

LIBRARY = "nixl"
POLL_S = 0.001  # between two looks at a transfer's state or for its notification
PROGRESS_PAUSE_US = 100_000  # the progress thread's longest sleep between UCX events
MAX_OPEN_WRITES = 64  # rooms held open for writes at once on one decode worker


class NixlUnavailable(RuntimeError):
    """The nixl package is not installed here, or it has no UCX backend."""


def nixl_api():
    """NIXL's Python API module, whichever wheel provides it (nixl, nixl-cu12, nixl-cu13), or None."""
    for name in ("nixl._api", "nixl_cu12._api", "nixl_cu13._api"):
        try:
            return importlib.import_module(name)
        except ImportError:
            continue
    return None


def nixl_installed() -> bool:
    return nixl_api() is not None


class NixlAgent:
    """This process's NIXL agent on the UCX backend; thread-safe (one lock around the library,
    which is built here without its own locking)."""

    def __init__(self, role: str) -> None:
        api = nixl_api()
        if api is None:
            raise NixlUnavailable("the nixl package is not installed (pip install 'baton-serve[nixl]')")
        logging.getLogger("nixl").setLevel(logging.WARNING)  # it logs each agent and backend at INFO
        if not _rdma_devices():
            # UCX's InfiniBand modules have nothing to drive here, and the libnl they load
            # crashes the process as it exits (SIGSEGV in its destructor): do not load them.
            os.environ.setdefault("UCX_MODULES", "^ib")
        self.name = f"baton-{role}-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        try:
            with _paused_progress(api):
                self._agent = api.nixl_agent(self.name, api.nixl_agent_config(backends=["UCX"]))
        except Exception as exc:  # noqa: BLE001 - the bindings raise their own types
            raise NixlUnavailable(f"NIXL could not start its UCX backend: {exc}") from None
        if "UCX" not in self._agent.backends:
            raise NixlUnavailable("NIXL has no UCX backend here")
        self.lock = threading.Lock()
        self._peers: dict[str, bytes] = {}  # agent name -> the metadata last added for it

    def __getattr__(self, name: str):
        return getattr(self._agent, name)

    def add_peer(self, metadata: bytes) -> str:
        """Add (or refresh) a remote agent from its metadata; returns its name."""
        with self.lock:
            return self._agent.add_remote_agent(metadata).decode()


def _rdma_devices() -> list[str]:
    try:
        return os.listdir("/sys/class/infiniband")
    except OSError:
        return []


_CONFIG_LOCK = threading.Lock()


@contextlib.contextmanager
def _paused_progress(api):
    """While an agent is made: its config keeps PROGRESS_PAUSE_US as the progress thread's pause
    (the wrapper sets 0, a busy loop, and offers no way to change it)."""
    base = api.nixlBind.nixlAgentConfig

    class PausedConfig(base):
        def __setattr__(self, name: str, value) -> None:
            super().__setattr__(name, PROGRESS_PAUSE_US if name == "pthrDelay" else value)

    with _CONFIG_LOCK:
        api.nixlBind.nixlAgentConfig = PausedConfig
        try:
            yield
        finally:
            api.nixlBind.nixlAgentConfig = base


# -- receiver (decode worker) -------------------------------------------------------------------

@dataclass
class _Room:
    opened: OpenKV
    registration: object
    deadline: float


class NixlWrites:
    """The rooms one decode worker holds open for NIXL writes into its receiver's staging pool.

    Created lazily on the first OpenWrite (a worker nobody writes to starts no agent); `close()`
    frees every open room and stops the progress thread."""

    def __init__(self, receiver: Receiver, idle_timeout_s: float = CHUNK_IDLE_TIMEOUT_S) -> None:
        self._receiver = receiver
        self._idle_timeout_s = idle_timeout_s
        self._agent: NixlAgent | None = None
        self._unavailable: str | None = None
        self._rooms: dict[str, _Room] = {}
        self._arrived: set[str] = set()  # transfer ids whose write's notification came
        self._cond = threading.Condition()
        self._thread: threading.Thread | None = None
        self._closed = False

    def start(self) -> None:
        """Start the agent now, on a thread of its own, so the first write does not wait for it."""
        threading.Thread(target=self._ensure_agent, name="kv-nixl-start", daemon=True).start()

    def available(self) -> str | None:
        """None if this worker takes NIXL writes, else why not."""
        self._ensure_agent()
        return self._unavailable

    def open(self, header: pb.KVHeader, timeout_s: float | None = None) -> pb.WriteTarget:
        """Reserve the room for one sequence's KV and say where to write it. Raises the receiver's
        refusals (KVTransferError) and NixlUnavailable."""
        agent = self._ensure_agent()
        if agent is None:
            raise NixlUnavailable(self._unavailable)
        with self._cond:
            if len(self._rooms) >= MAX_OPEN_WRITES:
                raise KVPoolFull(f"{MAX_OPEN_WRITES} NIXL writes are already open here; retry")
        opened = self._receiver.open_whole(header, timeout_s)
        try:
            with agent.lock:
                registration = agent.register_memory(opened.data.view(torch.uint8).reshape(-1))
                try:
                    descriptors = agent.get_serialized_descs(registration.trim())
                    metadata = agent.get_partial_agent_metadata(registration, True, ["UCX"])
                except BaseException:
                    agent.deregister_memory(registration)
                    raise
        except BaseException:
            self._receiver.abort_opened(opened)
            raise
        transfer_id = uuid.uuid4().hex
        # As long as a Push's bytes may take at this receiver's minimum rate, and then the idle timeout.
        allowed = PUSH_RATE_GRACE_S + header.total_bytes / MIN_PUSH_BYTES_PER_S + self._idle_timeout_s
        with self._cond:
            self._rooms[transfer_id] = _Room(opened, registration, time.monotonic() + allowed)
            self._cond.notify_all()
        return pb.WriteTarget(transfer_id=transfer_id, agent=agent.name, agent_metadata=metadata,
                              descriptors=descriptors)

    def close(self, request: pb.WriteClose) -> ReceiveResult | None:
        """The sender says its write of `transfer_id` is done (or abandoned): land the KV if the
        library delivered it whole and its checksum matches. None for an abandoned write."""
        with self._cond:
            room = self._rooms.get(request.transfer_id)
            if room is None:
                raise KVTruncated(f"no NIXL write {request.transfer_id!r} is open here (closed, or given up "
                                  "after its time ran out); push again")
        if not request.abandon:  # the notification follows the bytes: wait for it, briefly
            deadline = time.monotonic() + self._idle_timeout_s
            while not self._arrived_now(request.transfer_id) and time.monotonic() < deadline:
                time.sleep(POLL_S)
        with self._cond:
            if request.transfer_id not in self._rooms:  # given up meanwhile
                raise KVTruncated(f"no NIXL write {request.transfer_id!r} is open here any more; push again")
            arrived = request.transfer_id in self._arrived
            self._take(request.transfer_id)
        if request.abandon:
            self._receiver.abort_opened(room.opened)
            return None
        if not arrived:
            self._receiver.abort_opened(room.opened)
            raise KVTruncated(f"the NIXL write of {room.opened.header.request_id!r} was closed before its bytes "
                              "arrived; push again")
        return self._receiver.land_opened(room.opened, request.crc32)

    def stop(self) -> None:
        with self._cond:
            self._closed = True
            for transfer_id in list(self._rooms):
                self._receiver.abort_opened(self._take(transfer_id).opened)
            self._cond.notify_all()
        if self._thread is not None:
            self._thread.join(timeout=5)

    def _arrived_now(self, transfer_id: str) -> bool:
        """Collect the notifications that came; whether `transfer_id`'s is among them."""
        with self._agent.lock:
            notifications = self._agent.get_new_notifs()
        with self._cond:
            for messages in notifications.values():
                for message in messages:
                    name = message.decode(errors="replace")
                    if name in self._rooms:
                        self._arrived.add(name)
            return transfer_id in self._arrived

    def _take(self, transfer_id: str) -> _Room:
        """Forget a room (with the lock held) and stop the library writing into it."""
        room = self._rooms.pop(transfer_id)
        self._arrived.discard(transfer_id)
        with self._agent.lock:
            self._agent.deregister_memory(room.registration)
        return room

    def _ensure_agent(self) -> NixlAgent | None:
        with self._cond:
            if self._agent is None and self._unavailable is None:
                try:
                    self._agent = NixlAgent("decode")
                except NixlUnavailable as exc:
                    self._unavailable = str(exc)
                    return None
                self._thread = threading.Thread(target=self._expire, name="kv-nixl-rooms", daemon=True)
                self._thread.start()
            return self._agent

    def _expire(self) -> None:
        """Free rooms whose time ran out (their sender died or its network broke)."""
        with self._cond:
            while not self._closed:
                now = time.monotonic()
                for transfer_id in [t for t, room in self._rooms.items() if room.deadline < now]:
                    room = self._take(transfer_id)
                    self._receiver.abort_opened(room.opened)
                    log.warning("NIXL write of %r not closed in time; its room was freed",
                                room.opened.header.request_id)
                soonest = min((room.deadline for room in self._rooms.values()), default=None)
                self._cond.wait(None if soonest is None else max(0.0, soonest - now) + 0.01)


# -- sender (prefill worker, or a draining decode worker) ---------------------------------------

class NixlSender:
    """Writes KV into rooms decode workers opened; one per process, thread-safe."""

    def __init__(self) -> None:
        self._agent: NixlAgent | None = None
        self._lock = threading.Lock()

    def write(self, kv: SequenceKV, target: pb.WriteTarget, deadline: float) -> int:
        """Write kv's bytes where `target` says; returns their CRC-32. Raises KVPushFailed
        (UNAVAILABLE: the library could not reach the receiver or the write failed)."""
        agent = self._ensure_agent()
        # Host memory, as the KV is staged on the decode worker: a GPU prefill worker's KV is copied
        # out first, as for the other transports (its checksum is taken on the host).
        raw = kv.data.detach().to("cpu").contiguous().view(torch.uint8).reshape(-1)
        try:
            peer = agent.add_peer(target.agent_metadata)
            if peer != target.agent:
                raise KVBadStream(f"the receiver's metadata names agent {peer!r}, not {target.agent!r}")
            with agent.lock:
                registration = agent.register_memory(raw)
            try:
                with agent.lock:
                    remote = agent.deserialize_descs(target.descriptors)
                    handle = agent.initialize_xfer("WRITE", registration.trim(), remote, peer,
                                                   target.transfer_id.encode())
                    state = agent.transfer(handle)
                try:
                    crc = checksum(memoryview(raw.numpy()))  # while the progress thread sends
                    while state not in ("DONE", "ERR"):
                        if time.monotonic() > deadline:
                            raise KVPushFailed("DEADLINE_EXCEEDED", "the NIXL write ran out of time")
                        time.sleep(POLL_S)
                        with agent.lock:
                            state = agent.check_xfer_state(handle)
                finally:
                    with agent.lock:
                        agent.release_xfer_handle(handle)
            finally:
                with agent.lock:
                    agent.deregister_memory(registration)
        except KVPushFailed:
            raise
        except Exception as exc:  # noqa: BLE001 - the bindings raise their own types
            raise KVPushFailed("UNAVAILABLE", f"the NIXL write failed: {exc}") from None
        if state != "DONE":
            raise KVPushFailed("UNAVAILABLE", "the NIXL write failed (the library reported an error)")
        return crc

    def start(self) -> None:
        """Start the agent now, on a thread of its own, so the first write does not wait for it."""
        threading.Thread(target=self._ensure_agent, name="kv-nixl-start", daemon=True).start()

    def _ensure_agent(self) -> NixlAgent:
        with self._lock:
            if self._agent is None:
                self._agent = NixlAgent("push")
            return self._agent
