"""Triton building blocks shared by the attention kernels.

Conventions used by every kernel in this package:
- Softmax runs in the log2 domain: scores are multiplied by `scale * log2(e)` once and
  `exp2` replaces `exp`; a log-sum-exp stored by a kernel is in log2 units too.
- Partial results (split-K) are stored normalised: `o = sum(p * v) / sum(p)` plus
  `lse = m + log2(sum(p))`, so merging is a softmax over the lse values. An empty partial
  has `lse = -inf` and `o = 0` and gets weight 0 in the merge.
- Accumulation is always fp32. `UPCAST` casts K, V and Q to fp32 before `tl.dot`: needed
  under the interpreter (no bf16 dot there) and for fp32 KV; on a GPU with fp16/bf16 KV the
  dots run natively with fp32 accumulation, as FlashAttention does.
"""
from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

LOG2E = 1.4426950408889634


@triton.jit
def attend_block(acc, m_i, l_i, q, k, v, visible, qk_scale, UPCAST: tl.constexpr):
    """One step of the online softmax: fold the key/value block k, v: [BLOCK_N, BLOCK_D] into
    the running (acc [M, BLOCK_D], m_i [M], l_i [M], all fp32) of the queries q: [M, BLOCK_D]
    (already fp32 under UPCAST). visible: bool, broadcastable to [M, BLOCK_N]; the hidden
    columns' values must be finite (masked loads give 0), since p = 0 does not cancel a NaN.
    Each row needs a visible column in its first block (m_i == -inf there, and -inf - -inf
    would make the rescale NaN); the callers' loops guarantee it.
    """
    if UPCAST:
        k = k.to(tl.float32)
        v = v.to(tl.float32)
    # qk: [M, BLOCK_N] fp32; scale applied after the dot so q is never rounded pre-scaled
    qk = tl.dot(q.to(k.dtype), tl.trans(k), input_precision="ieee") * qk_scale
    qk = tl.where(visible, qk, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(qk, 1))
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(qk - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision="ieee")
    return acc, m_new, l_i


@triton.jit
def attend_range(acc, m_i, l_i, q, k_base, v_base, stride_kn, stride_vn, lo, hi, q_pos, offs_d, d_mask,
                 qk_scale, BLOCK_N: tl.constexpr, CAUSAL: tl.constexpr, UPCAST: tl.constexpr):
    """Online softmax of the query block `q` over key/value columns [lo, hi) of a dense run.

    q: [M, BLOCK_D] (native dtype); acc: [M, BLOCK_D] fp32; m_i, l_i: [M] fp32.
    k_base/v_base point at column 0 of one KV head; column c is at `base + c * stride`.
    CAUSAL: column c is visible to query row r only if c <= q_pos[r]. The first block must
    leave every row at least one visible column (true for causal prefill, whose loop starts at
    column 0, and for a shared prefix, seen in full), so m_i never stays -inf.
    """
    offs_n = tl.arange(0, BLOCK_N)
    if UPCAST:
        q = q.to(tl.float32)
    for col in range(lo, hi, BLOCK_N):
        cols = col + offs_n
        n_mask = cols < hi
        kv_mask = n_mask[:, None] & d_mask[None, :]
        # k, v: [BLOCK_N, BLOCK_D]
        k = tl.load(k_base + cols[:, None] * stride_kn + offs_d[None, :], mask=kv_mask, other=0.0)
        v = tl.load(v_base + cols[:, None] * stride_vn + offs_d[None, :], mask=kv_mask, other=0.0)
        visible = n_mask[None, :]
        if CAUSAL:
            visible = visible & (cols[None, :] <= q_pos[:, None])
        acc, m_i, l_i = attend_block(acc, m_i, l_i, q, k, v, visible, qk_scale, UPCAST=UPCAST)
    return acc, m_i, l_i


@triton.jit
def store_result(Out, Lse, out_offs, lse_offs, acc, m_i, l_i, mask, offs_d, d_mask, WRITE_LSE: tl.constexpr):
    """Normalise and store rows of `acc`; empty rows (l_i == 0) become zeros with lse -inf.

    out_offs, lse_offs: [M] element offsets of each row's output vector / lse slot.
    """
    nonempty = l_i > 0.0
    o = acc / tl.where(nonempty, l_i, 1.0)[:, None]
    tl.store(Out + out_offs[:, None] + offs_d[None, :], o.to(Out.dtype.element_ty),
             mask=mask[:, None] & d_mask[None, :])
    if WRITE_LSE:
        lse = tl.where(nonempty, m_i + tl.log2(tl.where(nonempty, l_i, 1.0)), float("-inf"))
        tl.store(Lse + lse_offs, lse, mask=mask)


@triton.jit(do_not_specialize=["num_slots"])
def _merge_kernel(MidO, MidLse, Out, num_slots, stride_mn, stride_mh, stride_ms, stride_ln, stride_lh,
                  stride_on, stride_oh, HEAD_DIM: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr):
    """One program per (row, head): softmax-weighted sum of the num_slots partials."""
    row = tl.program_id(0)
    head = tl.program_id(1)
    offs_s = tl.arange(0, BLOCK_S)
    offs_d = tl.arange(0, BLOCK_D)
    s_mask = offs_s < num_slots
    d_mask = offs_d < HEAD_DIM
    # lse: [BLOCK_S]; o: [BLOCK_S, BLOCK_D]
    lse = tl.load(MidLse + row * stride_ln + head * stride_lh + offs_s, mask=s_mask, other=float("-inf"))
    o = tl.load(MidO + row * stride_mn + head * stride_mh + offs_s[:, None] * stride_ms + offs_d[None, :],
                mask=s_mask[:, None] & d_mask[None, :], other=0.0)
    m = tl.max(lse, 0)
    m = tl.where(m == float("-inf"), 0.0, m)  # every partial empty: weights all exp2(-inf) = 0
    w = tl.exp2(lse - m)
    denom = tl.sum(w, 0)
    # where, not w * o: a slot of weight 0 must add nothing, whatever it holds (even NaN)
    o = tl.where(w[:, None] > 0.0, o, 0.0)
    res = tl.sum(w[:, None] * o, 0) / tl.where(denom > 0.0, denom, 1.0)
    tl.store(Out + row * stride_on + head * stride_oh + offs_d, res.to(Out.dtype.element_ty), mask=d_mask)


def merge_partials(mid_o: torch.Tensor, mid_lse: torch.Tensor, out: torch.Tensor) -> None:
    """mid_o: [n, H, S, D] fp32; mid_lse: [n, H, S] fp32 (log2); out: [n, H, D] (written)."""
    n, heads, slots, head_dim = mid_o.shape
    _merge_kernel[(n, heads)](
        mid_o, mid_lse, out, slots, mid_o.stride(0), mid_o.stride(1), mid_o.stride(2), mid_lse.stride(0),
        mid_lse.stride(1), out.stride(0), out.stride(1), HEAD_DIM=head_dim,
        BLOCK_S=triton.next_power_of_2(slots), BLOCK_D=block_d(head_dim), num_warps=4)


def block_d(head_dim: int) -> int:
    # tl.dot needs every dimension >= 16; odd head dims are padded and masked
    return max(16, triton.next_power_of_2(head_dim))


def block_g(group: int) -> int:
    # The query-head block of one KV head; padded rows are zero queries, masked at the store.
    return max(16, triton.next_power_of_2(group))


def is_interpreted(kernel) -> bool:
    from triton.runtime.interpreter import InterpretedFunction

    return isinstance(kernel, InterpretedFunction)


def check_launchable(kernel, *tensors: torch.Tensor) -> bool:
    """Validate devices and report whether the kernel runs interpreted (then dots upcast)."""
    device = tensors[0].device
    for t in tensors:
        if t.device != device:
            raise ValueError(f"all attention inputs must be on one device; got {device} and {t.device}")
        if t.stride(-1) != 1:
            raise ValueError(f"head_dim must be the contiguous (stride 1) dimension; got strides {t.stride()}")
    interpreted = is_interpreted(kernel)
    if device.type != "cuda" and not interpreted:
        raise RuntimeError(
            "Triton kernels need CUDA tensors, or TRITON_INTERPRET=1 set in the environment before "
            "baton.engine.kernels' kernel modules are first imported; use baton.engine.kernels.reference on CPU")
    return interpreted


_FLOATS = (torch.float32, torch.float16, torch.bfloat16)


def check_paged(q: torch.Tensor, k_pages: torch.Tensor, v_pages: torch.Tensor) -> tuple[int, int, int, int]:
    """Validate queries [N, Hq, D] over a paged KV layer ([num_pages, Hkv, P, D] keys and values
    alike) -> (Hq, Hkv, P, D)."""
    if q.dim() != 3 or k_pages.dim() != 4:
        raise ValueError(f"q must be [N, Hq, D] and k_pages [num_pages, Hkv, P, D]; got q {tuple(q.shape)}, "
                         f"k_pages {tuple(k_pages.shape)}")
    _, num_heads, head_dim = q.shape
    _, num_kv_heads, page_size, _ = k_pages.shape
    if k_pages.shape != v_pages.shape or k_pages.shape[3] != head_dim:
        raise ValueError(f"shape mismatch: q {tuple(q.shape)}, k_pages {tuple(k_pages.shape)}, "
                         f"v_pages {tuple(v_pages.shape)}")
    if num_kv_heads == 0 or num_heads % num_kv_heads:
        raise ValueError(f"num_heads {num_heads} is not a multiple of num_kv_heads {num_kv_heads}")
    if page_size < 1:
        raise ValueError(f"page size (k_pages.shape[2]) must be >= 1, got {page_size}")
    if q.dtype not in _FLOATS or k_pages.dtype not in _FLOATS or v_pages.dtype != k_pages.dtype:
        raise ValueError(f"q, k_pages, v_pages must be float32/float16/bfloat16 with k and v alike; got "
                         f"{q.dtype}, {k_pages.dtype}, {v_pages.dtype}")
    return num_heads, num_kv_heads, page_size, head_dim


def needs_upcast(interpreted: bool, q: torch.Tensor, k: torch.Tensor) -> bool:
    return interpreted or k.dtype == torch.float32 or q.dtype != k.dtype


def default_splits(programs: int, columns: int, block_n: int, device: torch.device) -> int:
    """Enough KV splits to give every SM about two programs, never below ~2 blocks a split."""
    if device.type == "cuda":
        sms = torch.cuda.get_device_properties(device).multi_processor_count
    else:
        sms = 4  # interpreter: a token amount of splitting keeps the merge path exercised
    want = math.ceil(2 * sms / max(programs, 1))
    return max(1, min(want, math.ceil(columns / (2 * block_n)), 64))
