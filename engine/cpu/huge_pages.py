"""Weights the CPU kernels stream, held in 2 MB pages where the kernel gives them.

A forward streams every weight once, 4 KB page after 4 KB page: a 135M-parameter fp32 model is
104,000 pages, more than a core's TLB holds, so each page costs a walk of the page tables, and in
a virtual machine a two-level one. Behind a long prompt's attention, whose keys and values have
pushed those tables out of cache, the linear layers ran 12-18% slower (a C harness on SmolLM2's
shapes, a 256-token chunk after 7,744 cached tokens: 118-139 GFLOP/s with 4 KB pages, 147-163
with 2 MB ones, as fast as at position 0; docs/bench.md). Linux backs a region with transparent
huge pages when asked by `madvise` (its default mode here, `[madvise]`), so the packed weights are
copied into an anonymous mapping so advised before anything touches it. Where the kernel has no
transparent huge pages, or the tensor is smaller than one, it is an ordinary tensor: the same
bytes, only the pages differ.
"""
from __future__ import annotations

import mmap
import sys

import torch

HUGE_PAGE = 2 << 20  # x86-64's and (4 KB granule) ARM64's transparent huge page


def copy_into_huge_pages(tensor: torch.Tensor) -> torch.Tensor:
    """A contiguous copy of `tensor` (on the CPU) in memory advised for 2 MB pages."""
    if tensor.device.type != "cpu":
        raise ValueError(f"huge pages hold CPU tensors, not {tensor.device.type} ones")
    nbytes = tensor.numel() * tensor.element_size()
    if nbytes < HUGE_PAGE or not sys.platform.startswith("linux") or not hasattr(mmap, "MADV_HUGEPAGE"):
        return tensor.contiguous()
    # one page more than asked, so that the tensor can start on a 2 MB boundary: the kernel backs
    # only whole, aligned 2 MB ranges with a huge page
    region = mmap.mmap(-1, nbytes + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    raw = torch.frombuffer(region, dtype=torch.uint8)  # keeps `region` alive as long as its views
    start = -raw.data_ptr() % HUGE_PAGE
    try:
        region.madvise(mmap.MADV_HUGEPAGE, start, nbytes - nbytes % HUGE_PAGE)
    except OSError:  # transparent huge pages compiled out or refused: 4 KB pages it is
        pass
    out = raw[start:start + nbytes].view(tensor.dtype).view(tensor.shape)
    out.copy_(tensor)
    return out
