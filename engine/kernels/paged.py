"""Split-K grouped-query decode attention over a PAGED KV pool (vLLM-style block table).

The decode KV pool is [layers, 2, num_pages, Hkv, P, D]; one layer's keys are the view
k_pages = pool[layer, 0]: [num_pages, Hkv, P, D]. Row r's token t lives in page
page_table[r, t // P] at slot t % P, so a row's KV needs no contiguous window and rows can
share, grow and free pages without copying (rows continuing one prefix list the same pages).
Page 0 is the null page: table entries past a row's pages hold 0 and are never read, since
row r only attends tokens [0, lengths[r]).

Grid: (row, kv_head, split), flash-decoding style. One program loads the queries of every head
that shares its KV head (a [BLOCK_G, D] block, the GQA group padded to a power of two >= 16
for tl.dot) so each KV token is read once per KV head, not once per query head. Columns
[0, lengths[r]) are cut into `num_splits` BLOCK_N-aligned chunks, so short rows simply leave
their late splits empty; each split stores a normalised partial output and its log-sum-exp,
which `merge_partials` (a second, tiny launch) combines. With one split the kernel writes the
output directly. Each column loads its page id from the table (a BLOCK_N block spans several
pages, and P need not be a power of two). page_table and lengths are read by the kernel from
device memory and the grid depends only on shapes, so a captured CUDA graph replays with new
tables and lengths.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from baton.engine.kernels._common import (LOG2E, attend_block, block_d, block_g, check_launchable, check_paged,
                                          default_splits, merge_partials, needs_upcast, store_result)

BLOCK_N = 64


@triton.jit
def attend_pages(acc, m_i, l_i, q, k_base, v_base, table, stride_tc, stride_kp, stride_kt, stride_vp, stride_vt,
                 lo, hi, offs_d, d_mask, qk_scale, pos, PAGE_SIZE: tl.constexpr, BLOCK_N: tl.constexpr,
                 CAUSAL: tl.constexpr, UPCAST: tl.constexpr):
    """`attend_range` over columns [lo, hi) of one sequence's paged KV (CAUSAL: query row r sees
    columns <= pos[r] only; else pos is unused).

    table points at the sequence's page-table entries; column c is at
    `base + table[c // P] * stride_page + (c % P) * stride_token`.
    """
    offs_n = tl.arange(0, BLOCK_N)
    if UPCAST:
        q = q.to(tl.float32)
    for col in range(lo, hi, BLOCK_N):
        cols = col + offs_n
        n_mask = cols < hi
        kv_mask = n_mask[:, None] & d_mask[None, :]
        # page: [BLOCK_N] page id of each column (repeats within a page hit the cache);
        # int64: page * stride_page overflows int32 on a pool of a few GiB
        page = tl.load(table + (cols // PAGE_SIZE) * stride_tc, mask=n_mask, other=0).to(tl.int64)
        slot = cols % PAGE_SIZE
        # k, v: [BLOCK_N, BLOCK_D]
        k = tl.load(k_base + (page * stride_kp + slot * stride_kt)[:, None] + offs_d[None, :], mask=kv_mask,
                    other=0.0)
        v = tl.load(v_base + (page * stride_vp + slot * stride_vt)[:, None] + offs_d[None, :], mask=kv_mask,
                    other=0.0)
        visible = n_mask[None, :]
        if CAUSAL:
            visible = visible & (cols[None, :] <= pos[:, None])
        acc, m_i, l_i = attend_block(acc, m_i, l_i, q, k, v, visible, qk_scale, UPCAST=UPCAST)
    return acc, m_i, l_i


# max_cols (max_pages * P) and the split count are runtime values: a longer table or another
# split count never recompiles
@triton.jit(do_not_specialize=["max_cols", "num_splits"])
def _paged_decode_kernel(Q, K, V, Table, Lengths, Out, Lse, max_cols, num_splits, qk_scale,
                         stride_qn, stride_qh, stride_kp, stride_kh, stride_kt, stride_vp, stride_vh, stride_vt,
                         stride_tr, stride_tc, stride_len, stride_on, stride_oh, stride_os, stride_ln, stride_lh,
                         GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_G: tl.constexpr,
                         BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr, PAGE_SIZE: tl.constexpr,
                         WRITE_LSE: tl.constexpr, UPCAST: tl.constexpr):
    """Split `split` of row `row`, KV head `kv_head`; writes partial slot `split` (or the output)."""
    row = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    offs_g = tl.arange(0, BLOCK_G)
    offs_d = tl.arange(0, BLOCK_D)
    g_mask = offs_g < GROUP
    d_mask = offs_d < HEAD_DIM
    heads = kv_head * GROUP + offs_g

    # the table bounds the row: a length past it (or below 0) must not read outside the table
    length = tl.minimum(tl.maximum(tl.load(Lengths + row * stride_len), 0), max_cols)
    chunk = tl.cdiv(tl.cdiv(length, num_splits), BLOCK_N) * BLOCK_N
    lo = split * chunk
    hi = tl.minimum(lo + chunk, length)

    # q: [BLOCK_G, BLOCK_D]
    q = tl.load(Q + row * stride_qn + heads[:, None] * stride_qh + offs_d[None, :],
                mask=g_mask[:, None] & d_mask[None, :], other=0.0)
    acc = tl.zeros([BLOCK_G, BLOCK_D], dtype=tl.float32)
    m_i = tl.full([BLOCK_G], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_G], dtype=tl.float32)
    acc, m_i, l_i = attend_pages(acc, m_i, l_i, q, K + kv_head * stride_kh, V + kv_head * stride_vh,
                                 Table + row.to(tl.int64) * stride_tr, stride_tc, stride_kp, stride_kt, stride_vp,
                                 stride_vt, lo, hi, offs_d, d_mask, qk_scale, 0, PAGE_SIZE=PAGE_SIZE, BLOCK_N=BLOCK_N,
                                 CAUSAL=False, UPCAST=UPCAST)
    out_offs = row * stride_on + heads * stride_oh + split * stride_os
    lse_offs = row * stride_ln + heads * stride_lh + split
    store_result(Out, Lse, out_offs, lse_offs, acc, m_i, l_i, g_mask, offs_d, d_mask, WRITE_LSE=WRITE_LSE)


def paged_decode_attention(q: torch.Tensor, k_pages: torch.Tensor, v_pages: torch.Tensor, page_table: torch.Tensor,
                           lengths: torch.Tensor, scale: float | None, *,
                           num_splits: int | None = None) -> torch.Tensor:
    """One decode step of attention for every row, KV read through a page table.

    q: [R, Hq, D]; k_pages, v_pages: [num_pages, Hkv, P, D], e.g. pool[layer, 0] / pool[layer, 1]
    of a [layers, 2, num_pages, Hkv, P, D] pool (any strides but stride(-1) == 1);
    page_table: int32 [R, max_pages], lengths: int32 [R], both on q's device and read by the
    kernel: row r attends tokens [0, min(lengths[r], max_pages * P)) (0: output zeros), token t
    at page page_table[r, t // P], slot t % P. Page ids are not bounds-checked on the device.
    scale: None means head_dim ** -0.5. num_splits: KV chunks per row (None: enough to fill the
    GPU, sized from max_pages * P). Returns [R, Hq, D] in q's dtype.
    """
    num_heads, num_kv_heads, page_size, head_dim = check_paged(q, k_pages, v_pages)
    rows = q.shape[0]
    if page_table.dim() != 2 or page_table.shape[0] != rows or page_table.dtype != torch.int32:
        raise ValueError(f"page_table must be int32 [{rows}, max_pages]; got {page_table.dtype} "
                         f"{tuple(page_table.shape)}")
    if lengths.shape != (rows,) or lengths.dtype != torch.int32:
        raise ValueError(f"lengths must be int32 [{rows}]; got {lengths.dtype} {tuple(lengths.shape)}")
    if page_table.device != q.device or lengths.device != q.device:
        raise ValueError(f"page_table and lengths must be on q's device {q.device}; got {page_table.device} "
                         f"and {lengths.device}")
    if num_splits is not None and num_splits < 1:
        raise ValueError(f"num_splits must be >= 1, got {num_splits}")
    interpreted = check_launchable(_paged_decode_kernel, q, k_pages, v_pages)
    max_cols = page_table.shape[1] * page_size
    if rows == 0 or max_cols == 0:  # no row or no page: every output is the empty attention, zeros
        return torch.zeros(rows, num_heads, head_dim, dtype=q.dtype, device=q.device)
    scale = head_dim ** -0.5 if scale is None else scale
    group = num_heads // num_kv_heads
    if num_splits is None:
        num_splits = default_splits(rows * num_kv_heads, max_cols, BLOCK_N, q.device)
    out = torch.empty(rows, num_heads, head_dim, dtype=q.dtype, device=q.device)
    if num_splits == 1:
        dest, lse = out.unsqueeze(2), out  # lse unused: WRITE_LSE=False
    else:
        # dest: [R, Hq, S, D] fp32 partial outputs; lse: [R, Hq, S] fp32
        dest = torch.empty(rows, num_heads, num_splits, head_dim, dtype=torch.float32, device=q.device)
        lse = torch.empty(rows, num_heads, num_splits, dtype=torch.float32, device=q.device)
    _paged_decode_kernel[(rows, num_kv_heads, num_splits)](
        q, k_pages, v_pages, page_table, lengths, dest, lse, max_cols, num_splits, scale * LOG2E,
        q.stride(0), q.stride(1), k_pages.stride(0), k_pages.stride(1), k_pages.stride(2),
        v_pages.stride(0), v_pages.stride(1), v_pages.stride(2), page_table.stride(0), page_table.stride(1),
        lengths.stride(0), dest.stride(0), dest.stride(1), dest.stride(2), lse.stride(0), lse.stride(1),
        GROUP=group, HEAD_DIM=head_dim, BLOCK_G=block_g(group), BLOCK_D=block_d(head_dim), BLOCK_N=BLOCK_N,
        PAGE_SIZE=page_size, WRITE_LSE=num_splits > 1, UPCAST=needs_upcast(interpreted, q, k_pages), num_warps=4)
    if num_splits > 1:
        merge_partials(dest, lse, out)
    return out

