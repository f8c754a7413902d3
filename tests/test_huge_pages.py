"""Packed weights in 2 MB pages (engine/cpu/huge_pages.py): the same values, aligned, and the
mapping advised for transparent huge pages where Linux has them."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from baton.engine.cpu import kernels as cpu_kernels
from baton.engine.cpu.huge_pages import HUGE_PAGE, copy_into_huge_pages
from baton.engine.quantized import quantize_q8_0

THP = Path("/sys/kernel/mm/transparent_hugepage/enabled")


def _thp_on() -> bool:
    return sys.platform.startswith("linux") and THP.exists() and "[never]" not in THP.read_text()


def _vm_flags(address: int) -> set[str]:
    """The flags of this process's mapping that holds `address` (/proc/self/smaps)."""
    inside = False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split()[0]
        if "-" in head and ":" not in head:
            start, end = (int(part, 16) for part in head.split("-"))
            inside = start <= address < end
        elif inside and line.startswith("VmFlags:"):
            return set(line.split()[1:])
    raise AssertionError(f"no mapping holds {address:#x}")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.uint8])
def test_a_large_tensor_is_copied_whole_to_a_2_mb_boundary(dtype):
    source = torch.arange(3 * HUGE_PAGE // 4 + 17, dtype=torch.float32).to(dtype).view(-1, 1)
    source = source.expand(-1, 3).t()  # not contiguous: copied as its values, not its strides
    copy = copy_into_huge_pages(source)
    assert copy.shape == source.shape and copy.dtype == dtype and copy.is_contiguous()
    assert torch.equal(copy, source)
    assert copy.data_ptr() % HUGE_PAGE == 0
    copy[0, 0] = 1  # its own memory, writable
    assert source[0, 0] == 0


@pytest.mark.skipif(not _thp_on(), reason="this kernel has no transparent huge pages")
def test_the_copy_is_advised_for_huge_pages():
    copy = copy_into_huge_pages(torch.ones(2 * HUGE_PAGE // 4))
    assert "hg" in _vm_flags(copy.data_ptr())  # MADV_HUGEPAGE


def test_a_small_tensor_stays_an_ordinary_one():
    source = torch.randn(64, 3).t()
    copy = copy_into_huge_pages(source)
    assert copy.is_contiguous() and torch.equal(copy, source)
    if _thp_on():
        assert "hg" not in _vm_flags(copy.data_ptr())


def test_only_host_tensors():
    with pytest.raises(ValueError, match="CPU tensors"):
        copy_into_huge_pages(torch.empty(4, device="meta"))


def test_packed_weights_live_in_huge_pages_and_compute_as_before():
    weight = torch.randn(1000, 576)
    packed = cpu_kernels.pack(weight)
    assert packed.data_ptr() % HUGE_PAGE == 0
    assert torch.equal(packed.transpose(1, 2).reshape(-1, 576)[:1000], weight)  # panels of 16 features, k-major
    blocks = quantize_q8_0(torch.randn(2048, 1024)).panels()
    assert blocks.data_ptr() % HUGE_PAGE == 0 and blocks.is_contiguous()
    if cpu_kernels.available():
        x = torch.randn(5, 576)
        assert torch.allclose(cpu_kernels.small_gemm(x, packed, 1000), x @ weight.t(), rtol=1e-4, atol=1e-4)
