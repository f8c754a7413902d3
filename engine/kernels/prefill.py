"""Causal prefill attention of new tokens over a cached prefix plus themselves (varlen batch).

Packed layout, as in flash-attn's varlen API: sequence s owns query rows
`cu_seqlens_q[s]:cu_seqlens_q[s+1]` of q: [total_q, H, D] and key/value columns
`cu_seqlens_k[s]:cu_seqlens_k[s+1]` of k, v: [Hkv, total_k, D]. Its cached prefix is the first
`prefix_len = len_k - len_q` columns; new token j sees columns [0, prefix_len + j] (causal
mask aligned to the bottom-right), so prefix reuse and chunked prefill are the same call.

A batch of prompts continuing one shared prefix (a BatchLLM group) passes it once as
`shared_k`/`shared_v`: every query sees all of it before its own sequence's columns, in the same
online softmax, so no prompt needs its own copy of the prefix.

Grid: (query block, sequence, query head). Prefill is compute bound, so one head per program
keeps the tile large; the GQA siblings read the same K/V tiles shortly after, from L2.
The loop stops at the block's last visible column, so work above the diagonal is skipped.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from baton.engine.kernels._common import LOG2E, attend_range, block_d, check_launchable, needs_upcast, store_result

BLOCK_M = 32
BLOCK_N = 32


@triton.jit
def _prefill_kernel(Q, K, V, SK, SV, Out, CuQ, CuK, shared_len, qk_scale,
                    stride_qt, stride_qh, stride_kh, stride_kt, stride_vh, stride_vt, stride_skh, stride_skt,
                    stride_svh, stride_svt, stride_ot, stride_oh,
                    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                    BLOCK_D: tl.constexpr, UPCAST: tl.constexpr, SHARED: tl.constexpr):
    m_block = tl.program_id(0)
    seq = tl.program_id(1)
    head = tl.program_id(2)
    q_begin = tl.load(CuQ + seq)
    num_q = tl.load(CuQ + seq + 1) - q_begin
    k_begin = tl.load(CuK + seq)
    num_k = tl.load(CuK + seq + 1) - k_begin
    prefix_len = num_k - num_q

    offs_m = m_block * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    m_mask = offs_m < num_q
    d_mask = offs_d < HEAD_DIM
    # q: [BLOCK_M, BLOCK_D]
    q_rows = (q_begin + offs_m).to(tl.int64) * stride_qt + head * stride_qh
    q = tl.load(Q + q_rows[:, None] + offs_d[None, :], mask=m_mask[:, None] & d_mask[None, :], other=0.0)
    q_pos = prefix_len + offs_m  # last column each query row may see
    # Blocks past this sequence's queries get an empty loop; their stores are all masked.
    hi = tl.where(m_block * BLOCK_M < num_q, tl.minimum(num_k, prefix_len + (m_block + 1) * BLOCK_M), 0)

    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    kv_head = head // GROUP
    if SHARED:  # the group's prefix, seen in full by every query (a block past the queries skips it)
        shared_hi = tl.where(m_block * BLOCK_M < num_q, shared_len, 0)
        acc, m_i, l_i = attend_range(acc, m_i, l_i, q, SK + kv_head * stride_skh, SV + kv_head * stride_svh,
                                     stride_skt, stride_svt, 0, shared_hi, q_pos, offs_d, d_mask, qk_scale,
                                     BLOCK_N=BLOCK_N, CAUSAL=False, UPCAST=UPCAST)
    k_base = K + kv_head * stride_kh + k_begin.to(tl.int64) * stride_kt
    v_base = V + kv_head * stride_vh + k_begin.to(tl.int64) * stride_vt
    acc, m_i, l_i = attend_range(acc, m_i, l_i, q, k_base, v_base, stride_kt, stride_vt, 0, hi, q_pos,
                                 offs_d, d_mask, qk_scale, BLOCK_N=BLOCK_N, CAUSAL=True, UPCAST=UPCAST)
    out_offs = (q_begin + offs_m).to(tl.int64) * stride_ot + head * stride_oh
    store_result(Out, Out, out_offs, out_offs, acc, m_i, l_i, m_mask, offs_d, d_mask, WRITE_LSE=False)


def prefill_attention_varlen(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens_q: torch.Tensor,
                             cu_seqlens_k: torch.Tensor, scale: float | None, max_seqlen_q: int,
                             shared_k: torch.Tensor | None = None, shared_v: torch.Tensor | None = None) -> torch.Tensor:
    """q: [total_q, H, D]; k, v: [Hkv, total_k, D]; cu_seqlens_*: int [num_seqs + 1], each
    sequence needing len_k >= len_q (not checked on the device: that would cost a sync).
    shared_k, shared_v: [Hkv, P, D], a prefix every sequence continues, held once.
    scale: None means head_dim ** -0.5. Returns [total_q, H, D] in q's dtype."""
    total_q, num_heads, head_dim = q.shape
    num_kv_heads = k.shape[0]
    if k.shape != v.shape or k.shape[2] != head_dim:
        raise ValueError(f"shape mismatch: q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}")
    if (shared_k is None) != (shared_v is None):
        raise ValueError("a shared prefix needs both shared_k and shared_v")
    shared = shared_k is not None
    if shared and (shared_k.shape != shared_v.shape or shared_k.shape[0] != num_kv_heads
                   or shared_k.shape[2] != head_dim):
        raise ValueError(f"shared prefix shape mismatch: k {tuple(k.shape)}, shared_k {tuple(shared_k.shape)}, "
                         f"shared_v {tuple(shared_v.shape)}")
    if num_heads % num_kv_heads:
        raise ValueError(f"num_heads {num_heads} is not a multiple of num_kv_heads {num_kv_heads}")
    if cu_seqlens_q.shape != cu_seqlens_k.shape or cu_seqlens_q.dim() != 1:
        raise ValueError("cu_seqlens_q and cu_seqlens_k must both be [num_seqs + 1]")
    interpreted = check_launchable(_prefill_kernel, q, k, v, *((shared_k, shared_v) if shared else ()))
    sk, sv = (shared_k, shared_v) if shared else (k, v)  # not read without SHARED
    out = torch.empty_like(q, memory_format=torch.contiguous_format)
    num_seqs = cu_seqlens_q.shape[0] - 1
    if total_q == 0 or num_seqs == 0 or max_seqlen_q == 0:
        return out
    scale = head_dim ** -0.5 if scale is None else scale
    cu_q = cu_seqlens_q.to(device=q.device, dtype=torch.int32)
    cu_k = cu_seqlens_k.to(device=q.device, dtype=torch.int32)
    grid = (triton.cdiv(max_seqlen_q, BLOCK_M), num_seqs, num_heads)
    _prefill_kernel[grid](
        q, k, v, sk, sv, out, cu_q, cu_k, sk.shape[1] if shared else 0, scale * LOG2E,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1), sk.stride(0), sk.stride(1),
        sv.stride(0), sv.stride(1), out.stride(0), out.stride(1),
        GROUP=num_heads // num_kv_heads, HEAD_DIM=head_dim, BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N,
        BLOCK_D=block_d(head_dim), UPCAST=needs_upcast(interpreted, q, k), SHARED=shared, num_warps=4)
    return out


def prefill_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, prefix_len: int,
                      scale: float | None) -> torch.Tensor:
    """One sequence: q: [T_new, H, D]; k, v: [Hkv, prefix_len + T_new, D] -> [T_new, H, D].

    New token j attends to the cached prefix in full and causally to new tokens 0..j."""
    num_new, num_k = q.shape[0], k.shape[1]
    if prefix_len < 0 or num_k != prefix_len + num_new:
        raise ValueError(f"k holds {num_k} columns; expected prefix_len {prefix_len} + T_new {num_new}")
    cu_q = torch.tensor([0, num_new], dtype=torch.int32, device=q.device)
    cu_k = torch.tensor([0, num_k], dtype=torch.int32, device=q.device)
    return prefill_attention_varlen(q, k, v, cu_q, cu_k, scale, num_new)
