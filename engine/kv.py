"""One sequence's KV cache as it leaves prefill, crosses the wire and waits in staging."""
from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class KVShape:
    """What a receiver must agree on before accepting a sequence's KV."""

    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype

    def bytes_per_token(self) -> int:
        # Keys and values, every layer, every KV head.
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * self.dtype.itemsize


@dataclass
class SequenceKV:
    """Keys and values of one sequence, layer-major so the wire can stream it in order.

    data: [num_layers, 2 (key, value), num_kv_heads, num_tokens, head_dim]
    """

    data: torch.Tensor

    def __post_init__(self) -> None:
        if self.data.dim() != 5 or self.data.shape[1] != 2:
            raise ValueError(f"SequenceKV expects [layers, 2, kv_heads, tokens, head_dim], got {tuple(self.data.shape)}")

    @property
    def shape(self) -> KVShape:
        layers, _, heads, _, head_dim = self.data.shape
        return KVShape(layers, heads, head_dim, self.data.dtype)

    @property
    def num_tokens(self) -> int:
        return self.data.shape[3]

    @property
    def nbytes(self) -> int:
        return self.data.numel() * self.data.element_size()

    def keys(self, layer: int) -> torch.Tensor:
        return self.data[layer, 0]  # [kv_heads, tokens, head_dim]

    def values(self, layer: int) -> torch.Tensor:
        return self.data[layer, 1]

    def prefix(self, num_tokens: int) -> "SequenceKV":
        return SequenceKV(self.data[:, :, :, :num_tokens].contiguous())


def joined(prefix: SequenceKV | None, own: SequenceKV, start: int = 0) -> SequenceKV:
    """Tokens [start:] of `prefix` followed by `own`: a group's members reference their shared
    prefix and pay for its copy only where one is really needed. Past the prefix this is a view
    of `own` (whoever needs it contiguous, the wire, copies it anyway); else a new tensor."""
    cached = prefix.num_tokens if prefix is not None else 0
    if not 0 <= start <= cached + own.num_tokens:
        raise ValueError(f"start {start} is outside the {cached + own.num_tokens}-token KV")
    if start >= cached:
        return own if start == cached else SequenceKV(own.data[:, :, :, start - cached:])
    return SequenceKV(torch.cat([prefix.data[:, :, :, start:], own.data], dim=3))


@dataclass
class PrefillOutput:
    logits: torch.Tensor  # [vocab] float32: next-token logits after the prompt
    own: SequenceKV  # the KV of the prompt's tokens after `prefix` (all of them without one)
    computed_tokens: int  # prompt tokens run through the model (the rest came from the prefix)
    prefix: SequenceKV | None = None  # the cached prefix continued, referenced (one tensor for a whole group)

    @property
    def kv(self) -> SequenceKV:
        """The whole prompt's KV as one tensor: a copy where a prefix is referenced."""
        return joined(self.prefix, self.own)


def host_tensor(shape, dtype: torch.dtype, pinned: bool = False) -> torch.Tensor:
    """Host memory for KV on its way to or from a device: page-locked when `pinned` (a CUDA
    worker's), so the copy to the GPU can run asynchronously and at full bus speed."""
    return torch.empty(shape, dtype=dtype, pin_memory=pinned and torch.cuda.is_available())


def ready_event(data: torch.Tensor) -> "torch.cuda.Event | None":
    """Marks, on the calling thread's stream, the point where `data` (on a GPU) is complete; None
    for host memory. For `after`, on the thread that made it."""
    if not data.is_cuda:
        return None
    event = torch.cuda.Event()
    event.record(torch.cuda.current_stream(data.device))
    return event


@contextlib.contextmanager
def after(ready: "torch.cuda.Event | None", device: torch.device):
    """Another thread's GPU work on KV, on a stream of its own that starts once `ready` is
    reached: on the default stream it would wait behind all that the compute thread launched
    since (a prefill worker's next forward). Nothing changes for host memory (`ready` None)."""
    if ready is None:
        yield
        return
    stream = torch.cuda.Stream(device=device)
    stream.wait_event(ready)
    with torch.cuda.stream(stream):
        yield


def to_host(data: torch.Tensor) -> torch.Tensor:
    """data in host memory: itself if it is there, else a copy, pinned when it comes from CUDA."""
    if data.device.type == "cpu":
        return data
    out = host_tensor(data.shape, data.dtype, pinned=data.device.type == "cuda")
    out.copy_(data)
    return out
