"""Split-K (flash-decoding) grouped-query decode attention over the BATON batch KV layout.

Grid: (row, kv_head, split). One program loads the queries of every head that shares its KV
head (a [BLOCK_G, D] block, the GQA group padded to a power of two >= 16 for tl.dot) so each
KV column is read once per KV head, not once per query head. Row i's valid columns
[starts[i], L) are cut into `num_splits` BLOCK_N-aligned chunks counted from starts[i], so the
left padding costs no work and short rows simply leave their late splits empty. Each split
stores a normalised partial output and its log-sum-exp; `merge_partials` (a second, tiny
launch) combines them. With one split the first kernel writes the final output directly.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from baton.engine.kernels._common import (LOG2E, attend_range, block_d, block_g, check_launchable, default_splits,
                                    merge_partials, needs_upcast, store_result)

BLOCK_N = 64


@triton.jit
def decode_program(Q, K, V, Starts, Out, Lse, L, qk_scale, row, kv_head, split, slot, num_splits,
                   stride_qn, stride_qh, stride_kn, stride_kh, stride_kl, stride_vn, stride_vh, stride_vl,
                   stride_on, stride_oh, stride_os, stride_ln, stride_lh,
                   GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_D: tl.constexpr,
                   BLOCK_N: tl.constexpr, WRITE_LSE: tl.constexpr, UPCAST: tl.constexpr):
    """Split `split` of row `row`, KV head `kv_head`; writes partial slot `slot` (or the output)."""
    offs_g = tl.arange(0, BLOCK_G)
    offs_d = tl.arange(0, BLOCK_D)
    g_mask = offs_g < GROUP
    d_mask = offs_d < HEAD_DIM
    heads = kv_head * GROUP + offs_g

    start = tl.maximum(tl.load(Starts + row), 0)  # a negative start must not read before the window
    chunk = tl.cdiv(tl.cdiv(L - start, num_splits), BLOCK_N) * BLOCK_N
    lo = start + split * chunk
    hi = tl.minimum(lo + chunk, L)

    # q: [BLOCK_G, BLOCK_D]
    q = tl.load(Q + row * stride_qn + heads[:, None] * stride_qh + offs_d[None, :],
                mask=g_mask[:, None] & d_mask[None, :], other=0.0)
    acc = tl.zeros([BLOCK_G, BLOCK_D], dtype=tl.float32)
    m_i = tl.full([BLOCK_G], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_G], dtype=tl.float32)
    k_base = K + row.to(tl.int64) * stride_kn + kv_head * stride_kh
    v_base = V + row.to(tl.int64) * stride_vn + kv_head * stride_vh
    acc, m_i, l_i = attend_range(acc, m_i, l_i, q, k_base, v_base, stride_kl, stride_vl, lo, hi, offs_g,
                                 offs_d, d_mask, qk_scale, BLOCK_N=BLOCK_N, CAUSAL=False, UPCAST=UPCAST)
    out_offs = row * stride_on + heads * stride_oh + slot * stride_os
    lse_offs = row * stride_ln + heads * stride_lh + slot
    store_result(Out, Lse, out_offs, lse_offs, acc, m_i, l_i, g_mask, offs_d, d_mask, WRITE_LSE=WRITE_LSE)


# L and the split count change from step to step: runtime values, so they never trigger a recompile
@triton.jit(do_not_specialize=["L", "num_splits"])
def _decode_split_kernel(Q, K, V, Starts, Ends, Out, Lse, L, num_splits, qk_scale,
                         stride_qn, stride_qh, stride_kn, stride_kh, stride_kl, stride_vn, stride_vh, stride_vl,
                         stride_on, stride_oh, stride_os, stride_ln, stride_lh,
                         GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_G: tl.constexpr,
                         BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr, WRITE_LSE: tl.constexpr,
                         UPCAST: tl.constexpr, ROW_ENDS: tl.constexpr):
    split = tl.program_id(2)
    if ROW_ENDS:  # each row's window ends where Ends says (a captured step reads it from memory)
        L = tl.minimum(tl.load(Ends + tl.program_id(0)), L)
    decode_program(Q, K, V, Starts, Out, Lse, L, qk_scale, tl.program_id(0), tl.program_id(1), split, split,
                   num_splits, stride_qn, stride_qh, stride_kn, stride_kh, stride_kl, stride_vn, stride_vh,
                   stride_vl, stride_on, stride_oh, stride_os, stride_ln, stride_lh,
                   GROUP, HEAD_DIM, BLOCK_G, BLOCK_D, BLOCK_N, WRITE_LSE, UPCAST)


def decode_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, starts: torch.Tensor,
                     scale: float | None, *, num_splits: int | None = None,
                     ends: torch.Tensor | None = None) -> torch.Tensor:
    """One decode step of attention for every row of a BATON batch.

    q: [n, num_heads, D]; k, v: [n, num_kv_heads, L, D] (any strides but stride(-1) == 1);
    starts: int [n], row i attends to columns [starts[i], L) (starts[i] >= L: output zeros);
    ends: int32 [n] on q's device, if given, ends row i's columns at min(ends[i], L) instead (read
    by the kernel, so a captured CUDA graph replays with new values).
    scale: None means head_dim ** -0.5. num_splits: KV chunks per row (None: enough to fill the GPU).
    Returns [n, num_heads, D] in q's dtype.
    """
    n, num_heads, head_dim = q.shape
    _, num_kv_heads, length, _ = k.shape
    if k.shape != v.shape or k.shape[0] != n or k.shape[3] != head_dim:
        raise ValueError(f"shape mismatch: q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}")
    if num_heads % num_kv_heads:
        raise ValueError(f"num_heads {num_heads} is not a multiple of num_kv_heads {num_kv_heads}")
    if starts.shape != (n,):
        raise ValueError(f"starts must have shape ({n},), got {tuple(starts.shape)}")
    if ends is not None and (ends.shape != (n,) or ends.dtype != torch.int32 or ends.device != q.device):
        raise ValueError(f"ends must be int32 [{n}] on {q.device}")
    interpreted = check_launchable(_decode_split_kernel, q, k, v)
    out = torch.empty(n, num_heads, head_dim, dtype=q.dtype, device=q.device)
    if n == 0:
        return out
    starts = starts.to(device=q.device, dtype=torch.int32)
    scale = head_dim ** -0.5 if scale is None else scale
    group = num_heads // num_kv_heads
    if num_splits is None:
        num_splits = default_splits(n * num_kv_heads, length, BLOCK_N, q.device)
    if num_splits < 1:
        raise ValueError(f"num_splits must be >= 1, got {num_splits}")
    if num_splits == 1:
        dest, lse = out.unsqueeze(2), out  # lse unused: WRITE_LSE=False
    else:
        # dest: [n, H, S, D] fp32 partial outputs; lse: [n, H, S] fp32
        dest = torch.empty(n, num_heads, num_splits, head_dim, dtype=torch.float32, device=q.device)
        lse = torch.empty(n, num_heads, num_splits, dtype=torch.float32, device=q.device)
    _decode_split_kernel[(n, num_kv_heads, num_splits)](
        q, k, v, starts, starts if ends is None else ends, dest, lse, length, num_splits, scale * LOG2E,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), k.stride(2), v.stride(0), v.stride(1), v.stride(2),
        dest.stride(0), dest.stride(1), dest.stride(2), lse.stride(0), lse.stride(1),
        GROUP=group, HEAD_DIM=head_dim, BLOCK_G=block_g(group),
        BLOCK_D=block_d(head_dim), BLOCK_N=BLOCK_N, WRITE_LSE=num_splits > 1,
        UPCAST=needs_upcast(interpreted, q, k), ROW_ENDS=ends is not None, num_warps=4)
    if num_splits > 1:
        merge_partials(dest, lse, out)
    return out
