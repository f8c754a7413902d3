"""BatchLLM-style decode: rows of a group share one prefix KV, read once per group.

Row i attends to its group's prefix columns [0, prefix_lens[g]) of prefix_k/prefix_v:
[G, Hkv, P_max, D], then to its own columns [starts[i], L) of k/v: [n, Hkv, L, D] (the BATON
layout). group_of_row[i] == -1 means the row has no shared prefix.

One attention launch over a 1-D grid holding two kinds of programs:
- prefix programs, one per (group, kv_head, row tile, prefix split): the queries of a tile of
  the group's rows, all heads of the KV head, packed densely into one [BLOCK_M, D] block
  (row-major over (row, head), so GQA 3 wastes no lanes), stream the group's prefix split once.
  Reading the prefix once per group, not once per row, is the point: its cost no longer
  grows with the number of rows sharing it.
- distinct programs, one per (row, kv_head, split): exactly the split-K decode program.
Every program stores a normalised partial and its log-sum-exp in its own slot of
[n, H, S_prefix + S_distinct]; the split-K merge kernel then combines prefix and distinct
parts with the same online-softmax math, so the result equals attention over the
concatenation. Rows of a group are listed through a CSR index built on the device.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from baton.engine.kernels._common import (LOG2E, attend_range, block_d, block_g, check_launchable, default_splits,
                                    merge_partials, needs_upcast, store_result)
from baton.engine.kernels.decode import BLOCK_N, decode_program

MAX_BLOCK_M = 64


@triton.jit
def _prefix_program(Q, PK, PV, PrefixLens, RowPtr, GroupRows, Out, Lse, qk_scale, group, kv_head, tile, split,
                    num_splits, stride_qn, stride_qh, stride_pkg, stride_pkh, stride_pkl, stride_pvg, stride_pvh,
                    stride_pvl, stride_on, stride_oh, stride_os, stride_ln, stride_lh,
                    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr,
                    BLOCK_N: tl.constexpr, UPCAST: tl.constexpr):
    ROWS_PER_TILE: tl.constexpr = BLOCK_M // GROUP
    offs_m = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    d_mask = offs_d < HEAD_DIM
    local_row = offs_m // GROUP
    heads = kv_head * GROUP + offs_m % GROUP
    row_begin = tl.load(RowPtr + group)
    row_end = tl.load(RowPtr + group + 1)
    first = row_begin + tile * ROWS_PER_TILE
    idx = first + local_row
    valid = (local_row < ROWS_PER_TILE) & (idx < row_end)
    rows = tl.load(GroupRows + idx, mask=valid, other=0)  # [BLOCK_M] batch row of each query

    prefix_len = tl.load(PrefixLens + group)
    chunk = tl.cdiv(tl.cdiv(prefix_len, num_splits), BLOCK_N) * BLOCK_N
    lo = split * chunk
    hi = tl.minimum(lo + chunk, prefix_len)
    hi = tl.where(first < row_end, hi, lo)  # a tile past the group's last row does nothing

    # q: [BLOCK_M, BLOCK_D], (row, head) pairs of this group's tile
    q = tl.load(Q + rows[:, None] * stride_qn + heads[:, None] * stride_qh + offs_d[None, :],
                mask=valid[:, None] & d_mask[None, :], other=0.0)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    k_base = PK + group.to(tl.int64) * stride_pkg + kv_head * stride_pkh
    v_base = PV + group.to(tl.int64) * stride_pvg + kv_head * stride_pvh
    acc, m_i, l_i = attend_range(acc, m_i, l_i, q, k_base, v_base, stride_pkl, stride_pvl, lo, hi, offs_m,
                                 offs_d, d_mask, qk_scale, BLOCK_N=BLOCK_N, CAUSAL=False, UPCAST=UPCAST)
    out_offs = rows * stride_on + heads * stride_oh + split * stride_os
    lse_offs = rows * stride_ln + heads * stride_lh + split
    store_result(Out, Lse, out_offs, lse_offs, acc, m_i, l_i, valid, offs_d, d_mask, WRITE_LSE=True)


@triton.jit(do_not_specialize=["L", "num_prefix_programs", "num_tiles", "prefix_splits", "splits"])
def _prefix_shared_kernel(Q, PK, PV, PrefixLens, RowPtr, GroupRows, K, V, Starts, Out, Lse, L,
                          num_prefix_programs, num_tiles, prefix_splits, splits, qk_scale,
                          stride_qn, stride_qh, stride_pkg, stride_pkh, stride_pkl, stride_pvg, stride_pvh,
                          stride_pvl, stride_kn, stride_kh, stride_kl, stride_vn, stride_vh, stride_vl,
                          stride_on, stride_oh, stride_os, stride_ln, stride_lh,
                          NUM_KV_HEADS: tl.constexpr, GROUP: tl.constexpr, HEAD_DIM: tl.constexpr,
                          BLOCK_M: tl.constexpr,
                          BLOCK_G: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr,
                          UPCAST: tl.constexpr):
    pid = tl.program_id(0)
    if pid < num_prefix_programs:
        # pid = ((group * Hkv + kv_head) * num_tiles + tile) * prefix_splits + split
        split = pid % prefix_splits
        rest = pid // prefix_splits
        tile = rest % num_tiles
        rest = rest // num_tiles
        _prefix_program(Q, PK, PV, PrefixLens, RowPtr, GroupRows, Out, Lse, qk_scale, rest // NUM_KV_HEADS,
                        rest % NUM_KV_HEADS, tile, split, prefix_splits, stride_qn, stride_qh, stride_pkg,
                        stride_pkh, stride_pkl, stride_pvg, stride_pvh, stride_pvl, stride_on, stride_oh, stride_os,
                        stride_ln, stride_lh,
                        GROUP, HEAD_DIM, BLOCK_M, BLOCK_D, BLOCK_N, UPCAST)
    else:
        # pid - num_prefix_programs = (row * Hkv + kv_head) * splits + split
        rest = pid - num_prefix_programs
        split = rest % splits
        rest = rest // splits
        decode_program(Q, K, V, Starts, Out, Lse, L, qk_scale, rest // NUM_KV_HEADS, rest % NUM_KV_HEADS, split,
                       prefix_splits + split, splits, stride_qn, stride_qh, stride_kn, stride_kh, stride_kl, stride_vn,
                       stride_vh, stride_vl, stride_on, stride_oh, stride_os, stride_ln, stride_lh,
                       GROUP, HEAD_DIM, BLOCK_G, BLOCK_D, BLOCK_N, True, UPCAST)


def _group_index(group_of_row: torch.Tensor, num_groups: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """CSR of rows by group: group g's rows are group_rows[row_ptr[g]:row_ptr[g+1]]; -1 rows excluded."""
    # A stable sort puts the -1 rows first; bin 0 of the shifted counts holds them.
    group_rows = torch.sort(group_of_row.long(), stable=True).indices.to(torch.int32)
    bins = group_of_row.long() + 1
    # scatter_add, not bincount: bincount sizes its output from the data (a host sync)
    counts = torch.zeros(num_groups + 1, dtype=torch.long, device=bins.device).scatter_add_(
        0, bins, torch.ones_like(bins))  # [G + 1]
    row_ptr = torch.cumsum(counts, 0).to(torch.int32)  # row_ptr[g] = end of bin g = start of group g
    return row_ptr, group_rows, counts[1:]


def prefix_shared_decode_attention(q: torch.Tensor, prefix_k: torch.Tensor, prefix_v: torch.Tensor,
                                   k: torch.Tensor, v: torch.Tensor, starts: torch.Tensor,
                                   group_of_row: torch.Tensor, prefix_lens: torch.Tensor, scale: float | None, *,
                                   num_splits: int | None = None, num_prefix_splits: int | None = None,
                                   max_group_rows: int | None = None) -> torch.Tensor:
    """q: [n, H, D]; prefix_k, prefix_v: [G, Hkv, P_max, D]; k, v: [n, Hkv, L, D];
    starts: int [n]; group_of_row: int [n] in [-1, G); prefix_lens: int [G] (<= P_max).
    max_group_rows: the most rows any group has (never less: rows past it are skipped); pass it
    to avoid a device-to-host sync. prefix_lens and group indices are not checked on the device.
    scale: None means head_dim ** -0.5. Returns [n, H, D] in q's dtype."""
    n, num_heads, head_dim = q.shape
    num_groups, num_kv_heads, prefix_cols, _ = prefix_k.shape
    length = k.shape[2]
    if k.shape != v.shape or prefix_k.shape != prefix_v.shape or k.shape[:2] != (n, num_kv_heads):
        raise ValueError(f"shape mismatch: q {tuple(q.shape)}, prefix_k {tuple(prefix_k.shape)}, k {tuple(k.shape)}")
    if num_heads % num_kv_heads or k.shape[3] != head_dim or prefix_k.shape[3] != head_dim:
        raise ValueError(f"heads/head_dim mismatch: q {tuple(q.shape)}, k {tuple(k.shape)}")
    if starts.shape != (n,) or group_of_row.shape != (n,) or prefix_lens.shape != (num_groups,):
        raise ValueError("starts and group_of_row must be [n], prefix_lens [num_groups]")
    interpreted = check_launchable(_prefix_shared_kernel, q, prefix_k, prefix_v, k, v)
    out = torch.empty(n, num_heads, head_dim, dtype=q.dtype, device=q.device)
    if n == 0:
        return out
    device = q.device
    scale = head_dim ** -0.5 if scale is None else scale
    group = num_heads // num_kv_heads
    row_ptr, group_rows, counts = _group_index(group_of_row.to(device), num_groups)
    if max_group_rows is None:
        max_group_rows = int(counts.max()) if num_groups else 0
    block_m = min(MAX_BLOCK_M, max(16, triton.next_power_of_2(max(max_group_rows, 1) * group)))
    block_m = max(block_m, triton.next_power_of_2(group))
    num_tiles = triton.cdiv(max_group_rows, block_m // group)
    prefix_programs = num_groups * num_kv_heads * num_tiles
    if num_prefix_splits is None:
        num_prefix_splits = default_splits(prefix_programs, prefix_cols, BLOCK_N, device)
    if num_splits is None:
        num_splits = default_splits(n * num_kv_heads + prefix_programs, length, BLOCK_N, device)
    if num_splits < 1 or num_prefix_splits < 1:
        raise ValueError(f"split counts must be >= 1, got {num_splits} and {num_prefix_splits}")
    prefix_programs *= num_prefix_splits
    slots = num_prefix_splits + num_splits
    # mid_o: [n, H, slots, D] fp32; mid_lse: [n, H, slots], -inf for slots a -1 row never gets
    mid_o = torch.empty(n, num_heads, slots, head_dim, dtype=torch.float32, device=device)
    mid_lse = torch.full((n, num_heads, slots), float("-inf"), dtype=torch.float32, device=device)
    grid = (prefix_programs + n * num_kv_heads * num_splits,)
    _prefix_shared_kernel[grid](
        q, prefix_k, prefix_v, prefix_lens.to(device=device, dtype=torch.int32), row_ptr, group_rows, k, v,
        starts.to(device=device, dtype=torch.int32), mid_o, mid_lse, length, prefix_programs, max(num_tiles, 1),
        num_prefix_splits, num_splits, scale * LOG2E,
        q.stride(0), q.stride(1), prefix_k.stride(0), prefix_k.stride(1), prefix_k.stride(2),
        prefix_v.stride(0), prefix_v.stride(1), prefix_v.stride(2), k.stride(0), k.stride(1), k.stride(2),
        v.stride(0), v.stride(1), v.stride(2), mid_o.stride(0), mid_o.stride(1), mid_o.stride(2),
        mid_lse.stride(0), mid_lse.stride(1),
        NUM_KV_HEADS=num_kv_heads, GROUP=group, HEAD_DIM=head_dim, BLOCK_M=block_m, BLOCK_G=block_g(group),
        BLOCK_D=block_d(head_dim), BLOCK_N=BLOCK_N, UPCAST=needs_upcast(interpreted, q, k), num_warps=4)
    merge_partials(mid_o, mid_lse, out)
    return out
