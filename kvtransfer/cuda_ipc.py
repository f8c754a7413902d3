"""KV in CUDA memory handed to a decode worker on the same host by handle (CUDA IPC), not by bytes.

Without it a prefill worker on a GPU copies its KV to pageable host memory, checksums it on the
CPU and writes it into a memory file, and the decode worker copies that into pinned memory and
checksums it again: a few hundred MB/s for an 8B model's KV. Over the shared-memory socket
(kvtransfer.shm: same user, cluster token, push token, the same admission checks) the sender
passes a CUDA IPC handle to a private device copy of the KV and a digest computed on the device;
the decode worker opens the handle, checks the digest on the device, and copies the KV straight
into its pinned staging memory (one device-to-host copy at the bus's rate, no CPU checksum), then
closes the handle. The host pool stays where KV waits for a row, as for every other transport,
and the row's pages are filled from it asynchronously.

The decode worker copies before it answers rather than keeping the sender's memory: a prefill
worker that dies takes its allocations with it, and reading them then would fail the decode
worker, not just the request.

The handle names the sender's GPU by UUID, since processes number GPUs by what each sees. A
decode worker without CUDA, or that cannot see that GPU or open the handle, or whose /dev/shm
lacks torch's reference-count file for it (containers that do not share /dev/shm), refuses with
`KVNoDeviceIPC` before reserving anything, and the sender pushes through a memory file instead.

torch counts the receiver's references to the sender's copy in that file, and keeps the copy
until the count falls to zero: a receiver that never opened the handle (it refused, or the
push was never sent) says so, and the sender `release`s the count itself, or every such push
would keep a KV's worth of GPU memory on the sender for good.
"""
from __future__ import annotations

import base64
import binascii
import contextlib
import functools
import os
import re
from typing import Iterator

import torch

from baton.kvtransfer.errors import KVBadStream, KVNoDeviceIPC

ROW_WORDS = 1024  # the digest weighs words by row and by column of a [rows, ROW_WORDS] grid
MAX_DESCRIPTION_BYTES = 4096


def digest(data: torch.Tensor) -> list[int]:
    """A checksum of `data`'s bytes (a flat uint8 tensor), computed where they live: the sum of its
    32-bit words and two sums weighted by position (by row and by column of a [rows, 1024] grid),
    modulo 2**64. It catches what a handle to the wrong memory, an offset or a copy cut short
    would change; three reductions read the KV at the device's memory rate, and none of its
    bytes come to the host."""
    flat = data.reshape(-1)
    words = flat.view(torch.int32) if flat.numel() % 4 == 0 else flat.to(torch.int32)
    rows = words.numel() // ROW_WORDS
    grid, tail = words[:rows * ROW_WORDS].view(rows, ROW_WORDS), words[rows * ROW_WORDS:]
    position = functools.partial(torch.arange, 1, dtype=torch.int64, device=data.device)
    sums = torch.stack([
        words.sum(dtype=torch.int64),
        (grid.sum(dim=1, dtype=torch.int64) * position(rows + 1)).sum(),
        (grid.sum(dim=0, dtype=torch.int64) * position(ROW_WORDS + 1)).sum()
        + (tail.to(torch.int64) * position(tail.numel() + 1)).sum(),
    ])
    return [int(s) for s in sums.tolist()]


def exportable(data: torch.Tensor) -> bool:
    """Whether `data` is in CUDA memory, which another process can open by handle."""
    return data.is_cuda


def gpu_uuid(index: int) -> str:
    return str(torch.cuda.get_device_properties(index).uuid)


def export(kv: torch.Tensor) -> tuple[dict, torch.Tensor]:
    """A description of a private device copy of `kv` (a CUDA tensor) that another process opens
    with `opened`, and that copy: keep it until the receiver has answered. (torch's IPC
    reference counts keep the memory alive while the receiver still holds it, should the sender
    drop the copy first.)"""
    from torch.multiprocessing.reductions import reduce_tensor

    try:
        copy = kv.detach().clone(memory_format=torch.contiguous_format).view(torch.uint8).reshape(-1)
        _, args = reduce_tensor(copy)
    except RuntimeError as exc:  # no memory for the copy, or an allocator that cannot share it
        raise KVNoDeviceIPC(f"could not share this worker's CUDA memory: {exc}") from None
    (_, _, _, offset, _, _, device, handle, storage_bytes, storage_offset, _, ref_counter, ref_offset,
     event, event_sync) = args
    description = {
        "gpu": gpu_uuid(device), "handle": _b64(handle), "storage_bytes": storage_bytes,
        "storage_offset": storage_offset, "offset": offset, "ref_counter": _b64(ref_counter),
        "ref_offset": ref_offset, "event": _b64(event or b""), "event_sync": bool(event_sync),
        "digest": digest(copy),
    }
    return description, copy


@contextlib.contextmanager
def opened(description: dict, nbytes: int) -> Iterator[tuple[torch.Tensor, list[int]]]:
    """The sender's KV (`nbytes`, a flat uint8 tensor in its CUDA memory) from `export`'s
    description, and the digest the sender computed of it, on a stream of its own as the current
    one: the decode loop's steps on the default stream neither wait for this push's reads and
    copies nor hold them up. KVNoDeviceIPC where this process cannot open it, KVBadStream if the
    description is malformed. The caller's last reference closes the handle."""
    fields = _checked(description, nbytes)
    if not torch.cuda.is_available():
        raise KVNoDeviceIPC("this decode worker has no CUDA device to open the KV's handle on")
    if not os.path.exists("/dev/shm" + fields["ref_counter"].decode()):  # else torch counts nothing, silently
        raise KVNoDeviceIPC("the sender's CUDA IPC reference-count file is not in this worker's /dev/shm (share "
                            "/dev/shm between the workers' containers to pass KV by handle)")
    index = next((i for i in range(torch.cuda.device_count()) if gpu_uuid(i) == fields["gpu"]), None)
    if index is None:
        raise KVNoDeviceIPC(f"GPU {fields['gpu']} holding the KV is not visible to this decode worker")
    from torch.multiprocessing.reductions import rebuild_cuda_tensor

    stream = torch.cuda.Stream(device=index)  # torch's pool: streams that do not sync with the default one
    with torch.cuda.stream(stream):  # the sender's event is waited for on it, too
        try:
            data = rebuild_cuda_tensor(
                torch.Tensor, (nbytes,), (1,), fields["offset"], torch.UntypedStorage, torch.uint8, index,
                fields["handle"], fields["storage_bytes"], fields["storage_offset"], False, fields["ref_counter"],
                fields["ref_offset"], fields["event"], fields["event_sync"])
        except (RuntimeError, TypeError) as exc:  # another container's GPU, IPC not permitted: bytes still travel
            raise KVNoDeviceIPC(f"could not open the sender's CUDA memory here: {exc}") from None
        try:
            yield data, fields["digest"]
        finally:
            stream.synchronize()


def _checked(description, nbytes: int) -> dict:
    if not isinstance(description, dict):
        raise KVBadStream("a device KV push's description must be an object")
    try:
        fields = {"gpu": str(description["gpu"])}
        for key in ("handle", "ref_counter", "event"):
            fields[key] = base64.b64decode(description[key], validate=True)
        for key in ("storage_bytes", "storage_offset", "offset", "ref_offset"):
            value = description[key]
            if type(value) is not int or value < 0:
                raise ValueError(f"{key} must be an integer >= 0")
            fields[key] = value
        fields["event_sync"] = bool(description["event_sync"])
        fields["digest"] = [int(x) for x in description["digest"]]
    except (KeyError, TypeError, ValueError, binascii.Error) as exc:
        raise KVBadStream(f"a device KV push's description is malformed: {exc}") from None
    if not fields["handle"] or fields["offset"] + nbytes > fields["storage_bytes"]:
        raise KVBadStream(f"a device KV push's handle covers {fields['storage_bytes']} bytes; its KV needs "
                          f"{nbytes} from offset {fields['offset']}")
    if not re.fullmatch(rb"/[\w.-]+", fields["ref_counter"]) or b".." in fields["ref_counter"]:
        raise KVBadStream("a device KV push's reference-count file must be a plain shared-memory name")
    if len(fields["digest"]) != 3:
        raise KVBadStream("a device KV push's digest must hold three sums")
    return fields


def release(description: dict) -> None:
    """Give up the receiver's reference that `export` counted for a handle the receiver never
    opened, so the sender's copy is freed when the sender drops it."""
    torch.UntypedStorage._release_ipc_counter_cuda(base64.b64decode(description["ref_counter"]),
                                                   description["ref_offset"])


def collect() -> None:
    """Free the copies whose receivers have let go since the sender dropped them (torch's limbo)."""
    if torch.cuda.is_initialized():
        torch.cuda.ipc_collect()


def _b64(raw: bytes) -> str:
    return base64.b64encode(raw).decode()
