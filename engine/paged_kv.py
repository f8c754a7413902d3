"""The decode batch's KV memory: fixed-size pages in one tensor, allocated once.

    pages: [layers, 2 (keys, values), num_pages, kv_heads, page_size, head_dim]

Which page holds which token is decided elsewhere (`decode_worker.kv_pages.PagePool`); a decode
step gets, per row, its page table and its length (`DecodeStep`) and writes the row's new token
at position length - 1. Within a page each KV head's tokens are one contiguous run of
page_size x head_dim values, so attention streams a head's keys page by page.

Nothing is ever moved: a row that joins is written into its pages, a row that leaves gives them
back, and the step reads only what rows hold. Being allocated once, the tensor's address never
changes: a captured CUDA graph stays valid for the worker's life.
"""
from __future__ import annotations

import math
import mmap
from dataclasses import dataclass

import torch

from baton.resources import Amount, memory_available

from baton.engine.kv import KVShape, SequenceKV, to_host

CPU_KV_SHARE = 0.25  # of the host's available memory, for a CPU decode worker's default KV budget
# of the device memory free once the model is loaded: allocated at once, so some is left for a
# prefill worker that may share the device (kv_budget_bytes takes more)
CUDA_KV_SHARE = 0.5


def default_kv_budget(device: torch.device | str) -> Amount:
    """The batch KV budget when none is configured: a share of what the device has free now (on
    CPU, within the container's memory limit), and how it was chosen."""
    device = torch.device(device)
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return Amount(int(CUDA_KV_SHARE * free), f"{CUDA_KV_SHARE:g} of the {free} bytes free on {device}")
    available = memory_available()
    return Amount(int(CPU_KV_SHARE * available.value), f"{CPU_KV_SHARE:g} of {available.value} bytes: {available.source}")


@dataclass
class DecodeStep:
    """One decode step's rows: row i feeds one token at position lengths[i] - 1, which it writes
    into page tables[i][(lengths[i] - 1) // page_size], and attends tokens [0, lengths[i])."""

    tables: list[list[int]]
    lengths: list[int]

    def __post_init__(self):
        if len(self.tables) != len(self.lengths):
            raise ValueError(f"{len(self.tables)} page tables for {len(self.lengths)} rows")

    @property
    def num_rows(self) -> int:
        return len(self.lengths)

    def table_tensor(self, width: int | None = None, dtype=torch.int64, device="cpu") -> torch.Tensor:
        """[rows, width] page ids, padded with the null page 0."""
        width = max(map(len, self.tables), default=1) if width is None else width
        out = torch.zeros(len(self.tables), max(width, 1), dtype=dtype)
        for row, table in enumerate(self.tables):
            out[row, :len(table)] = torch.tensor(table, dtype=dtype)
        return out.to(device)


def pages_within(shape: KVShape, budget_bytes: int, page_size: int) -> int:
    """How many pages of `page_size` tokens of KV `shape` `budget_bytes` buys (at least 2: the null
    page and one more)."""
    num_pages = budget_bytes // (page_size * shape.bytes_per_token())
    if num_pages < 2:
        raise ValueError(f"a KV budget of {budget_bytes} bytes buys {num_pages} page(s) of {page_size} tokens "
                         f"({page_size * shape.bytes_per_token()} bytes each); at least 2 are needed")
    return num_pages


class PagedKV:
    def __init__(self, shape: KVShape, num_pages: int, page_size: int, device: torch.device | str = "cpu"):
        if page_size < 1 or num_pages < 2:
            raise ValueError(f"paged KV needs page_size >= 1 and num_pages >= 2 (got {page_size}, {num_pages})")
        self.shape = shape
        self.page_size = page_size
        self.num_pages = num_pages
        self.device = torch.device(device)
        dims = (shape.num_layers, 2, num_pages, shape.num_kv_heads, page_size, shape.head_dim)
        # Zeroed, not empty: the null page and a page's unwritten slots are read (and masked), and
        # 0 * NaN would poison a row. On the host, anonymous memory the kernel zeroes as it is first
        # touched: a worker's resident memory follows the pages used, not the budget.
        if self.device.type == "cpu":
            count = math.prod(dims)
            self._memory = mmap.mmap(-1, max(1, count * shape.dtype.itemsize))
            self.pages = torch.frombuffer(self._memory, dtype=shape.dtype, count=count).view(dims)
        else:
            self.pages = torch.zeros(dims, dtype=shape.dtype, device=self.device)

    @classmethod
    def within(cls, shape: KVShape, budget_bytes: int, page_size: int, device: torch.device | str = "cpu") -> "PagedKV":
        """As many pages as `budget_bytes` buys (the null page among them)."""
        return cls(shape, pages_within(shape, budget_bytes, page_size), page_size, device)

    @property
    def page_bytes(self) -> int:
        return self.page_size * self.shape.bytes_per_token()

    def _check(self, table: list[int], start: int, count: int) -> None:
        if start < 0 or start + count > len(table) * self.page_size:
            raise ValueError(f"tokens [{start}, {start + count}) do not fit {len(table)} pages of {self.page_size}")

    def _slots(self, table: list[int], start: int, count: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Page ids and in-page slots of tokens [start, start + count)."""
        self._check(table, start, count)
        positions = torch.arange(start, start + count)
        pages = torch.tensor(table, dtype=torch.int64)[positions // self.page_size]
        return pages.to(self.device), (positions % self.page_size).to(self.device)

    def _spans(self, table: list[int], start: int, count: int):
        """(page id, first slot, tokens' offset from `start`, how many) of each page tokens
        [start, start + count) of the row lie in, in order."""
        self._check(table, start, count)
        at, size = start, self.page_size
        while at < start + count:
            slot = at % size
            take = min(size - slot, start + count - at)
            yield table[at // size], slot, at - start, take
            at += take

    def write(self, table: list[int], kv: SequenceKV, start: int = 0) -> None:
        """Put `kv`'s tokens at positions [start, start + tokens) of the row whose pages are `table`:
        on the host a page's run of them at a time (through advanced indexing, token by token, an
        8,000-token fp32 prompt's KV took 0.19 s against 0.13 s)."""
        if kv.shape != self.shape:
            raise ValueError(f"KV shape {kv.shape} does not match the batch {self.shape}")
        data = kv.data.to(self.device, non_blocking=True)
        if self.device.type != "cpu":  # one gather kernel, not a launch per page
            pages, slots = self._slots(table, start, kv.num_tokens)
            # [:, :, pages, :, slots] puts the token axis first: [tokens, layers, 2, kv_heads, head_dim]
            self.pages[:, :, pages, :, slots] = data.permute(3, 0, 1, 2, 4)
            return
        for page, slot, at, take in self._spans(table, start, kv.num_tokens):
            self.pages[:, :, page, :, slot:slot + take] = data[:, :, :, at:at + take]

    def read(self, table: list[int], num_tokens: int, start: int = 0) -> SequenceKV:
        """A host copy of tokens [start, num_tokens) of the row whose pages are `table`: on the host
        a page's run of them at a time (gathered token by token, 8,000 tokens of fp32 KV took 1.0 s
        against 0.35 s)."""
        if self.device.type != "cpu":  # one gather kernel, not a launch per page
            pages, slots = self._slots(table, start, num_tokens - start)
            return SequenceKV(to_host(self.pages[:, :, pages, :, slots].permute(1, 2, 3, 0, 4).contiguous()))
        shape = self.shape
        out = torch.empty(shape.num_layers, 2, shape.num_kv_heads, max(0, num_tokens - start), shape.head_dim,
                          dtype=self.pages.dtype, device=self.device)
        for page, slot, at, take in self._spans(table, start, num_tokens - start):
            out[:, :, :, at:at + take] = self.pages[:, :, page, :, slot:slot + take]
        return SequenceKV(to_host(out))
