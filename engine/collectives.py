"""The ranks of one tensor-parallel worker talking: torch.distributed (gloo on CPU, NCCL on CUDA),
and on CPU shared memory for what fits in it.

Parts are gathered as raw bytes, so a gather moves bits and never rounds (and gloo need not know
bf16); parts of different widths (a model whose heads do not split evenly) are padded to the
widest and trimmed after. A sum over ranks is a gather summed in rank order: the same bits on
every rank, at every degree.

The ranks of a worker share its host (one pod), and gloo's sockets cost about a millisecond a
collective here, more than a small model's whole layer: on CPU each rank has slots in one shared
memory segment (`ShmLink`) and a collective is a copy in and a copy out.
"""
from __future__ import annotations

import datetime
import logging
import mmap
import os
import pickle
import tempfile
import time

import numpy as np
import torch
import torch.distributed as dist

log = logging.getLogger(__name__)

# A rank blocked in a collective whose peer died is freed by the peer's closed socket; this is the
# bound for a peer that hangs instead (the worker's supervisor ends the worker sooner).
TIMEOUT = datetime.timedelta(minutes=10)


SHM_SLOT_BYTES = 16 << 20  # a rank's part of a gather held in shared memory; larger parts go through gloo
# A wait yields its core for SPIN_S, then looks every NAP_S, and every SLEEP_S once idle for IDLE_S:
# ranks between two layers meet within microseconds, and an idle rank must not burn its core.
SPIN_S, NAP_S, IDLE_S, SLEEP_S = 0.002, 0.0002, 1.0, 0.002


def _pause(started: float, limit: float | None = None) -> None:
    waited = time.monotonic() - started
    if limit is not None and waited > limit:
        raise RuntimeError(f"a rank did not reach a collective within {limit:.0f} s")
    if waited < SPIN_S:
        os.sched_yield()  # lets this process's other threads run; sleep(0) would cost a timer's slack
    else:
        time.sleep(NAP_S if waited < IDLE_S else SLEEP_S)


def host_store(size: int) -> dist.TCPStore:
    """Rank 0's rendezvous store for `size` ranks, listening from now on at a port the kernel chose
    (`.port`, for the other ranks: join_store). A port found free and bound only later may be taken
    in between; and a rank of a group that never formed, still knocking at its old port, would then
    reach whatever holds it, such as a new group's gloo socket, and hang that group."""
    return dist.TCPStore("127.0.0.1", 0, size, is_master=True, timeout=TIMEOUT, wait_for_workers=False)


def join_store(port: int, size: int) -> dist.TCPStore:
    """The other ranks' way to rank 0's store (host_store) at 127.0.0.1:`port`."""
    return dist.TCPStore("127.0.0.1", port, size, is_master=False, timeout=TIMEOUT)


class Group:
    """This process's place among `size` ranks that rendezvous at rank 0's `store`."""

    def __init__(self, rank: int, size: int, store: dist.TCPStore, device: torch.device,
                 shm_bytes: int = SHM_SLOT_BYTES):
        self.rank, self.size, self.device, self.store = rank, size, device, store
        backend = "nccl" if device.type == "cuda" else "gloo"
        dist.init_process_group(backend, store=store, rank=rank, world_size=size, timeout=TIMEOUT)
        self.group = dist.group.WORLD
        self.shm = ShmLink.join(self, shm_bytes) if device.type == "cpu" and size > 1 and shm_bytes else None

    def all_gather(self, x: torch.Tensor, dim: int, widths: list[int]) -> torch.Tensor:
        """Every rank's x, rank r's `widths[r]` wide along `dim`, joined along `dim` in rank order."""
        if self.size == 1:
            return x
        dim = dim % x.dim()
        widest = max(widths)
        if x.shape[dim] < widest:
            pad = list(x.shape)
            pad[dim] = widest - x.shape[dim]
            x = torch.cat([x, x.new_zeros(pad)], dim)
        x = x.contiguous()
        raw = x.view(torch.uint8)  # the last axis in bytes
        if self.shm is not None and raw.numel() <= self.shm.slot_bytes:  # the same choice on every rank
            return self.shm.all_gather(raw, dim, widths).view(x.dtype)
        parts = [torch.empty_like(raw) for _ in range(self.size)]
        dist.all_gather(parts, raw, group=self.group)
        return torch.cat([p.view(x.dtype).narrow(dim, 0, w) for p, w in zip(parts, widths)], dim)

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """The sum over ranks, added in rank order (so every rank holds the same bits)."""
        if self.size == 1:
            return x
        parts = self.all_gather(x.unsqueeze(0), 0, [1] * self.size)
        total = parts[0].clone()
        for part in parts[1:]:
            total += part
        return total  # parts is a copy: nothing here views shared memory

    def broadcast(self, obj=None):
        """Rank 0's `obj` on every rank (pickled: an op and its arguments, tensors included)."""
        if self.shm is not None:
            return self.shm.broadcast(obj)
        box = [obj]
        dist.broadcast_object_list(box, src=0, group=self.group)
        return box[0]

    def close(self) -> None:
        if self.shm is not None:
            self.shm.close()
        if dist.is_initialized():
            dist.destroy_process_group()


class ShmLink:
    """Collectives through one shared memory segment of the ranks of a worker (one host).

    Each rank has a counter and two slots; collective number n writes into slot n % 2, raises the
    counter to n and waits for every rank's counter to reach n. A rank writes into slot n % 2
    again only at n + 2, once every rank has reached n + 1, which each did after reading n: two
    slots are enough. x86 keeps stores in order, so a counter seen raised means its slot is
    written."""

    HEADER = 64  # bytes per rank: the counter, then the broadcast's length

    def __init__(self, memory: mmap.mmap, rank: int, size: int, slot_bytes: int, group):
        self.memory, self.rank, self.size, self.slot_bytes, self.group = memory, rank, size, slot_bytes, group
        # numpy views, not torch ones: a look at a counter costs a microsecond less than a torch op,
        # and a decode step makes four collectives a layer
        header = np.frombuffer(memory, dtype=np.int64, count=size * self.HEADER // 8).reshape(size, -1)
        self.counters, self.lengths = header[:, 0], header[:, 1]
        self.slots = np.frombuffer(memory, dtype=np.uint8, offset=size * self.HEADER).reshape(size, 2, slot_bytes)
        self.sequence = 0

    @classmethod
    def join(cls, group: "Group", slot_bytes: int) -> "ShmLink | None":
        """Rank 0 makes the segment and names it over gloo; all map it, then it is unlinked (a
        crash leaves nothing behind in /dev/shm)."""
        size = group.size
        total = size * cls.HEADER + size * 2 * slot_bytes
        path = None
        if group.rank == 0:
            directory = "/dev/shm" if os.path.isdir("/dev/shm") else None
            fd, path = tempfile.mkstemp(prefix="baton-tp-", dir=directory)
            try:  # the pages claimed now: a /dev/shm too small fails here, not as SIGBUS mid-step
                os.posix_fallocate(fd, 0, total)
            except OSError as exc:
                log.warning("no room for %d bytes of shared memory in %s (%s): the ranks meet through gloo only",
                            total, directory or tempfile.gettempdir(), exc)
                os.unlink(path)
                path = None
            finally:
                os.close(fd)
        box = [path]
        dist.broadcast_object_list(box, src=0, group=group.group)
        if box[0] is None:
            return None
        with open(box[0], "r+b") as f:
            memory = mmap.mmap(f.fileno(), total)
        dist.barrier(group=group.group)
        if group.rank == 0:
            os.unlink(path)
        return cls(memory, group.rank, size, slot_bytes, group.group)

    def _publish(self) -> int:
        self.sequence += 1
        return self.sequence

    def _wait_all(self, sequence: int) -> None:
        counters, started = self.counters, time.monotonic()
        while counters.min() < sequence:  # ranks meet here mid-call: one that never comes has stalled
            _pause(started, TIMEOUT.total_seconds())

    def _wait(self, rank: int, sequence: int) -> None:
        counters, started = self.counters, time.monotonic()
        while counters[rank] < sequence:  # rank 0's next call: as long as the worker is idle
            _pause(started)

    def all_gather(self, raw: torch.Tensor, dim: int, widths: list[int]) -> torch.Tensor:
        """raw: uint8 (the last axis in bytes), the same shape on every rank, at most slot_bytes ->
        every rank's first widths[r] along `dim` (in elements of the last axis if it is `dim`),
        joined in rank order: a new tensor. numpy throughout: a torch op costs microseconds more,
        and a decode step makes four of these a layer."""
        sequence = self._publish()
        slot, n = sequence % 2, raw.numel()
        mine = raw.numpy()
        self.slots[self.rank, slot, :n] = mine.reshape(-1)
        self.counters[self.rank] = sequence
        self._wait_all(sequence)
        scale = raw.shape[-1] // max(widths) if dim == raw.dim() - 1 else 1  # bytes per element of the last axis
        parts = []
        for r, width in enumerate(widths):
            part = self.slots[r, slot, :n].reshape(mine.shape)
            cut = [slice(None)] * part.ndim
            cut[dim] = slice(0, width * scale)
            parts.append(part[tuple(cut)])
        return torch.from_numpy(np.concatenate(parts, axis=dim))

    def broadcast(self, obj):
        """Rank 0's obj, pickled into its slot, or through gloo where it does not fit (the length
        beside its counter tells the others which)."""
        sequence = self._publish()
        slot = sequence % 2
        if self.rank == 0:
            data = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
            fits = len(data) <= self.slot_bytes
            if fits:
                self.slots[0, slot, :len(data)] = np.frombuffer(data, dtype=np.uint8)
            self.lengths[0] = len(data) if fits else -1
            self.counters[0] = sequence
            self._wait_all(sequence)  # the others have read the length; the slot stays theirs until n + 2
            if not fits:
                dist.broadcast_object_list([obj], src=0, group=self.group)
            return obj
        self._wait(0, sequence)
        length = int(self.lengths[0])
        obj = pickle.loads(self.slots[0, slot, :length].tobytes()) if length >= 0 else None
        self.counters[self.rank] = sequence
        if length < 0:
            box = [None]
            dist.broadcast_object_list(box, src=0, group=self.group)
            obj = box[0]
        return obj

    def close(self) -> None:
        self.counters = self.lengths = self.slots = None
        try:
            self.memory.close()
        except BufferError:  # a view still held somewhere: the mapping goes with the process
            pass
