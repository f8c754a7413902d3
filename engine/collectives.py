"""The ranks of one tensor-parallel worker talking: torch.distributed (gloo on CPU, NCCL on CUDA).

Parts are gathered as raw bytes, so a gather moves bits and never rounds (and gloo need not know
bf16); parts of different widths (a model whose heads do not split evenly) are padded to the
widest and trimmed after.
"""
from __future__ import annotations

import datetime
import socket

import torch
import torch.distributed as dist

# A rank blocked in a collective whose peer died is freed by the peer's closed socket; this is the
# bound for a peer that hangs instead (the worker's supervisor ends the worker sooner).
TIMEOUT = datetime.timedelta(minutes=10)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Group:
    """This process's place among `size` ranks that rendezvous at 127.0.0.1:`port` (rank 0 hosts
    the store)."""

    def __init__(self, rank: int, size: int, port: int, device: torch.device):
        self.rank, self.size, self.device = rank, size, device
        backend = "nccl" if device.type == "cuda" else "gloo"
        dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=size,
                                timeout=TIMEOUT)
        self.group = dist.group.WORLD

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
        raw = x.view(torch.uint8) if x.dim() else x  # the last axis in bytes
        parts = [torch.empty_like(raw) for _ in range(self.size)]
        dist.all_gather(parts, raw, group=self.group)
        return torch.cat([p.view(x.dtype).narrow(dim, 0, w) for p, w in zip(parts, widths)], dim)

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """The sum over ranks, in place (exact where all but one rank add zeros: the embedding)."""
        if self.size > 1:
            dist.all_reduce(x, group=self.group)
        return x

    def broadcast(self, obj=None):
        """Rank 0's `obj` on every rank (pickled: an op and its arguments, tensors included)."""
        box = [obj]
        dist.broadcast_object_list(box, src=0, group=self.group)
        return box[0]

    def close(self) -> None:
        if dist.is_initialized():
            dist.destroy_process_group()
