"""Query-tiled paged attention: one compiled kernel for decode and prefill (batch invariance).

A token's attention output must have the same bits whether a decode step computed it beside any
other rows, or a prefill did as one of a prompt's tokens (whole, chunked, or after a cached
prefix). This kernel is built for that:
- a program takes one sequence's KV head and a tile of BLOCK_M query rows: TILE_T consecutive
  tokens times the GQA group of query heads that read that KV head (padded to a power of two);
- it folds the sequence's KV into them in BLOCK_N-column blocks from column 0, through the
  sequence's page table, with one online softmax (`attend_pages`, the split-K decode kernel's loop)
  and a causal mask per row;
- a row's dots do not depend on the tile's other rows, and a block past a row's last column
  leaves its state exactly as it was (alpha = 1, p = 0);
- a decode step is the same launch with one query per sequence, so decode and prefill run the
  same binary (same constexprs, same instructions): their bits are equal by construction on a GPU,
  not by two kernels happening to round alike.

Prefill reads each key block once for TILE_T tokens on tensor cores (BLOCK_M x BLOCK_N tiles),
where running prefill through the one-query decode kernel read it once per token. Decode pays
with idle rows in its tile (GROUP of BLOCK_M rows hold queries); it stays bound by reading the
KV. A sequence is one split: splitting its KV by the batch's shape would change its rounding.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from baton.engine.kernels._common import LOG2E, block_d, check_launchable, check_paged, needs_upcast, store_result
from baton.engine.kernels.paged import attend_pages

BLOCK_M = 64  # query rows per program: >= 64 makes them one warpgroup's tensor-core tile on Hopper
BLOCK_N = 64  # KV columns per step, counted from column 0 in every phase


def group_block(group: int) -> int:
    """Rows a token's query heads take in a tile (the GQA group padded to a power of two)."""
    return triton.next_power_of_2(group)


def tile_tokens(group: int) -> int:
    """Query tokens per program."""
    return max(1, BLOCK_M // group_block(group))


@triton.jit(do_not_specialize=["max_cols"])
def _tiled_kernel(Q, K, V, Table, CuQ, Lengths, Out, max_cols, qk_scale,
                  stride_qt, stride_qh, stride_kp, stride_kh, stride_kt, stride_vp, stride_vh, stride_vt,
                  stride_tr, stride_tc, stride_ot, stride_oh,
                  GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_M: tl.constexpr,
                  BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr, PAGE_SIZE: tl.constexpr, UPCAST: tl.constexpr):
    """Tile `tile` of sequence `seq`'s queries, KV head `kv_head`: row i of the tile is token
    tile * TILE_T + i // BLOCK_G of the sequence's queries, query head kv_head * GROUP + i % BLOCK_G."""
    tile = tl.program_id(0)
    seq = tl.program_id(1)
    kv_head = tl.program_id(2)
    TILE_T: tl.constexpr = BLOCK_M // BLOCK_G
    q_begin = tl.load(CuQ + seq)
    num_q = tl.load(CuQ + seq + 1) - q_begin
    # the table bounds the sequence: a length past it (or below 0) must not read outside the table
    length = tl.minimum(tl.maximum(tl.load(Lengths + seq), 0), max_cols)

    offs_m = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    token = tile * TILE_T + offs_m // BLOCK_G
    head = kv_head * GROUP + offs_m % BLOCK_G
    m_mask = (token < num_q) & (offs_m % BLOCK_G < GROUP)
    d_mask = offs_d < HEAD_DIM
    # the queries are the sequence's last num_q tokens: row i sees columns [0, pos[i]]
    pos = length - num_q + token
    last_token = tl.minimum((tile + 1) * TILE_T, num_q)
    hi = tl.where(tile * TILE_T < num_q, tl.maximum(length - num_q + last_token, 0), 0)

    q_rows = (q_begin + token).to(tl.int64) * stride_qt + head * stride_qh
    q = tl.load(Q + q_rows[:, None] + offs_d[None, :], mask=m_mask[:, None] & d_mask[None, :], other=0.0)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc, m_i, l_i = attend_pages(acc, m_i, l_i, q, K + kv_head * stride_kh, V + kv_head * stride_vh,
                                 Table + seq.to(tl.int64) * stride_tr, stride_tc, stride_kp, stride_kt, stride_vp,
                                 stride_vt, 0, hi, offs_d, d_mask, qk_scale, pos, PAGE_SIZE=PAGE_SIZE,
                                 BLOCK_N=BLOCK_N, CAUSAL=True, UPCAST=UPCAST)
    out_offs = (q_begin + token).to(tl.int64) * stride_ot + head * stride_oh
    store_result(Out, Out, out_offs, out_offs, acc, m_i, l_i, m_mask, offs_d, d_mask, WRITE_LSE=False)


def tiled_attention(q: torch.Tensor, k_pages: torch.Tensor, v_pages: torch.Tensor, page_table: torch.Tensor,
                    lengths: torch.Tensor, scale: float | None, cu_seqlens_q: torch.Tensor | None = None,
                    max_seqlen_q: int = 1) -> torch.Tensor:
    """Causal attention of each sequence's newest tokens over its paged KV.

    q: [total_q, Hq, D]; sequence s's queries are rows cu_seqlens_q[s]:cu_seqlens_q[s + 1] of q
    (None: one query per sequence, a decode step), its last n_s tokens: query j sits at position
    lengths[s] - n_s + j and sees columns [0, that position]. k_pages, v_pages: [num_pages, Hkv, P, D]
    (any strides but stride(-1) == 1); page_table: int32 [S, max_pages]; lengths: int32 [S], each
    >= n_s (0 for a decode row: zeros), read on the device with the offsets, so a captured CUDA
    graph replays with new ones; max_seqlen_q: the largest n_s (sizes the grid). scale: None means
    head_dim ** -0.5. Returns [total_q, Hq, D] in q's dtype."""
    num_heads, num_kv_heads, page_size, head_dim = check_paged(q, k_pages, v_pages)
    total_q = q.shape[0]
    sequences = lengths.shape[0] if lengths.dim() == 1 else -1
    if lengths.dtype != torch.int32 or sequences < 0:
        raise ValueError(f"lengths must be int32 [S]; got {lengths.dtype} {tuple(lengths.shape)}")
    if page_table.dim() != 2 or page_table.shape[0] != sequences or page_table.dtype != torch.int32:
        raise ValueError(f"page_table must be int32 [{sequences}, max_pages]; got {page_table.dtype} "
                         f"{tuple(page_table.shape)}")
    if cu_seqlens_q is None:
        if total_q != sequences:
            raise ValueError(f"a decode step needs one query per sequence: {total_q} queries, {sequences} lengths")
        cu_seqlens_q = torch.arange(sequences + 1, dtype=torch.int32, device=q.device)
        max_seqlen_q = 1
    elif cu_seqlens_q.shape != (sequences + 1,) or cu_seqlens_q.dtype != torch.int32:
        raise ValueError(f"cu_seqlens_q must be int32 [{sequences + 1}]; got {cu_seqlens_q.dtype} "
                         f"{tuple(cu_seqlens_q.shape)}")
    for name, t in (("page_table", page_table), ("lengths", lengths), ("cu_seqlens_q", cu_seqlens_q)):
        if t.device != q.device:
            raise ValueError(f"{name} must be on q's device {q.device}; got {t.device}")
    interpreted = check_launchable(_tiled_kernel, q, k_pages, v_pages)
    out = torch.empty(total_q, num_heads, head_dim, dtype=q.dtype, device=q.device)
    max_cols = page_table.shape[1] * page_size
    if total_q == 0:
        return out
    if max_cols == 0:  # no page: every query's attention is empty, zeros
        return out.zero_()
    group = num_heads // num_kv_heads
    grid = (triton.cdiv(max(max_seqlen_q, 1), tile_tokens(group)), sequences, num_kv_heads)
    _tiled_kernel[grid](
        q, k_pages, v_pages, page_table, cu_seqlens_q, lengths, out, max_cols,
        (head_dim ** -0.5 if scale is None else scale) * LOG2E,
        q.stride(0), q.stride(1), k_pages.stride(0), k_pages.stride(1), k_pages.stride(2),
        v_pages.stride(0), v_pages.stride(1), v_pages.stride(2), page_table.stride(0), page_table.stride(1),
        out.stride(0), out.stride(1),
        GROUP=group, HEAD_DIM=head_dim, BLOCK_G=group_block(group), BLOCK_M=max(BLOCK_M, group_block(group)),
        BLOCK_D=block_d(head_dim), BLOCK_N=BLOCK_N, PAGE_SIZE=page_size,
        UPCAST=needs_upcast(interpreted, q, k_pages), num_warps=4)
    return out


def prefill_over_pages(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, prefix_k: torch.Tensor | None = None,
                       prefix_v: torch.Tensor | None = None, scale: float | None = None,
                       page_size: int = BLOCK_N) -> torch.Tensor:
    """Causal prefill attention with decode's bits: each prompt is one sequence of `tiled_attention`
    over its own pages (its cached prefix, then its new tokens), so a token's output is what a
    decode step at its position computes, whether its prefix was cached, chunked or computed in
    this forward (the kernel reads columns in BLOCK_N blocks from column 0 whatever the pages:
    `page_size` changes addresses only).

    q: [B * T, Hq, D], prompt-major; k, v: [B, Hkv, T, D], each prompt's new tokens (a shorter
    prompt's padding after its own tokens is never seen by them); prefix_k, prefix_v: [Hkv, C, D],
    a prefix every prompt continues, or None. Returns [B * T, Hq, D] in q's dtype."""
    if k.dim() != 4 or k.shape != v.shape or q.dim() != 3 or q.shape[0] != k.shape[0] * k.shape[2]:
        raise ValueError(f"prefill_over_pages needs q [B * T, Hq, D] and k, v [B, Hkv, T, D]; got q "
                         f"{tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}")
    if (prefix_k is None) != (prefix_v is None):
        raise ValueError("a cached prefix needs both prefix_k and prefix_v")
    b, kv_heads, t, head_dim = k.shape
    cached = 0 if prefix_k is None else prefix_k.shape[1]
    if prefix_k is not None and (prefix_k.shape != prefix_v.shape or prefix_k.shape[0] != kv_heads
                                 or prefix_k.shape[2] != head_dim):
        raise ValueError(f"prefix shape mismatch: k {tuple(k.shape)}, prefix_k {tuple(prefix_k.shape)}, "
                         f"prefix_v {tuple(prefix_v.shape)}")
    if q.shape[0] == 0:
        return q.new_empty(q.shape)
    per_prompt = triton.cdiv(cached + t, page_size)

    def pages(own: torch.Tensor, prefix: torch.Tensor | None) -> torch.Tensor:
        # token-major, so page p of prompt i is page i * per_prompt + p of one pool; slots past a
        # prompt's tokens stay unwritten and are never read (every sequence's length ends before them)
        buf = own.new_empty(b, per_prompt * page_size, kv_heads, head_dim)
        if cached:
            buf[:, :cached] = prefix.transpose(0, 1)
        buf[:, cached:cached + t] = own.transpose(1, 2)
        return buf.view(b * per_prompt, page_size, kv_heads, head_dim).transpose(1, 2)

    device = q.device
    table = torch.arange(b * per_prompt, dtype=torch.int32, device=device).view(b, per_prompt)
    lengths = torch.full((b,), cached + t, dtype=torch.int32, device=device)
    cu_q = torch.arange(0, (b + 1) * t, t, dtype=torch.int32, device=device)
    return tiled_attention(q, pages(k, prefix_k), pages(v, prefix_v), table, lengths, scale, cu_q, t)
