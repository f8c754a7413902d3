"""Elementwise steps of a layer fused into single kernels (CUDA, Triton), for the invariant path.

A decode step of an 8B model reads 16 GB of weights in about 5 ms; every other kernel a layer
launches costs a few microseconds of the GPU's time even inside a CUDA graph, and there were
about twenty a layer. These fold the elementwise ones into one launch each:
- `rotary_kv`: rotary embedding of a token's query and key heads, in place in the QKV
  projection's output, and its keys and values written where the KV lives (a decode row's page
  slot, or a prefill's KV tensor), one program per token;
- `silu_mul`: SiLU(gate) * up, one program per row block.
Each computes what the torch ops it replaces compute, rounding to the storage dtype after every
operation as they do (a product, then a sum), and each row alone: prefill and decode run the
same kernels, so a token's bits never depend on the phase or on the rows beside it. (The
residual additions fold into the invariant GEMM's epilogue: `engine.kernels.invariant.linear`.)
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from baton.engine.kernels._common import is_interpreted


@triton.jit
def _rotary_kv_kernel(QKV, Cos, Sin, KDst, VDst, Offsets, stride_row, stride_cos, stride_sin, stride_kh, stride_vh,
                      HQ: tl.constexpr, HKV: tl.constexpr, HALF: tl.constexpr, BLOCK_H: tl.constexpr,
                      BLOCK_HALF: tl.constexpr, BLOCK_KV: tl.constexpr):
    """Token `row`: its q and k heads rotated in place; k and v copied to KDst/VDst + Offsets[row]."""
    row = tl.program_id(0).to(tl.int64)
    heads = tl.arange(0, BLOCK_H)
    d = tl.arange(0, BLOCK_HALF)
    mask = (heads < HQ + HKV)[:, None] & (d < HALF)[None, :]
    base = QKV + row * stride_row + heads[:, None] * (2 * HALF) + d[None, :]
    x1 = tl.load(base, mask=mask, other=0.0)  # first halves of the q and k heads
    x2 = tl.load(base + HALF, mask=mask, other=0.0)
    cos1 = tl.load(Cos + row * stride_cos + d, mask=d < HALF, other=0.0)[None, :]
    cos2 = tl.load(Cos + row * stride_cos + HALF + d, mask=d < HALF, other=0.0)[None, :]
    sin1 = tl.load(Sin + row * stride_sin + d, mask=d < HALF, other=0.0)[None, :]  # signed: -sin
    sin2 = tl.load(Sin + row * stride_sin + HALF + d, mask=d < HALF, other=0.0)[None, :]
    dtype = QKV.dtype.element_ty
    # x * cos + roll(x, D/2) * signed_sin, each product and the sum rounded as torch's ops round them
    out1 = ((x1.to(tl.float32) * cos1.to(tl.float32)).to(dtype).to(tl.float32)
            + (x2.to(tl.float32) * sin1.to(tl.float32)).to(dtype).to(tl.float32)).to(dtype)
    out2 = ((x2.to(tl.float32) * cos2.to(tl.float32)).to(dtype).to(tl.float32)
            + (x1.to(tl.float32) * sin2.to(tl.float32)).to(dtype).to(tl.float32)).to(dtype)
    tl.store(base, out1, mask=mask)
    tl.store(base + HALF, out2, mask=mask)
    # the keys (rotated) and values go where this token's KV lives
    offset = tl.load(Offsets + row)
    is_k = (heads >= HQ) & (heads < HQ + HKV)
    k_at = KDst + offset + (heads - HQ)[:, None] * stride_kh + d[None, :]
    k_mask = is_k[:, None] & (d < HALF)[None, :]
    tl.store(k_at, out1.to(KDst.dtype.element_ty), mask=k_mask)
    tl.store(k_at + HALF, out2.to(KDst.dtype.element_ty), mask=k_mask)
    kv_heads = tl.arange(0, BLOCK_KV)
    full = tl.arange(0, 2 * BLOCK_HALF)
    v_mask = (kv_heads < HKV)[:, None] & (full < 2 * HALF)[None, :]
    v = tl.load(QKV + row * stride_row + (HQ + HKV + kv_heads)[:, None] * (2 * HALF) + full[None, :], mask=v_mask,
                other=0.0)
    tl.store(VDst + offset + kv_heads[:, None] * stride_vh + full[None, :], v.to(VDst.dtype.element_ty), mask=v_mask)


def rotary_kv(qkv: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor, num_q_heads: int, num_kv_heads: int,
              k_dst: torch.Tensor, v_dst: torch.Tensor, offsets: torch.Tensor) -> None:
    """qkv: [N, (Hq + 2 Hkv) * D], a QKV projection's output, rows contiguous: its q and k heads
    are rotated in place (rotate-half convention: x * cos + roll(x, D/2) * signed_sin, the first
    half of signed_sin negated); cos, signed_sin: [N, D] (each row's position), rows contiguous.
    Token i's rotated keys and its values are written at k_dst / v_dst's element offset
    offsets[i] (int64 [N]), head h at + h * stride(-2), dimension j at + j (k_dst and v_dst: views
    whose last two dimensions are heads and head dims, e.g. pages[layer, 0]; both alike)."""
    n, width = qkv.shape
    head_dim = width // (num_q_heads + 2 * num_kv_heads)
    if width != head_dim * (num_q_heads + 2 * num_kv_heads) or head_dim % 2:
        raise ValueError(f"qkv's width {width} is not (Hq + 2 Hkv) x an even head_dim for {num_q_heads} query and "
                         f"{num_kv_heads} KV heads")
    if qkv.stride(1) != 1 or cos.shape != (n, head_dim) or signed_sin.shape != (n, head_dim) \
            or cos.stride(1) != 1 or signed_sin.stride(1) != 1:
        raise ValueError(f"rotary_kv needs qkv [N, W] and cos, signed_sin [N, {head_dim}] with contiguous rows; got "
                         f"{tuple(qkv.shape)}, {tuple(cos.shape)}, {tuple(signed_sin.shape)}")
    if offsets.shape != (n,) or offsets.dtype != torch.int64 or k_dst.stride(-1) != 1 or v_dst.stride(-1) != 1 \
            or k_dst.stride(-2) != v_dst.stride(-2):
        raise ValueError("offsets must be int64 [N] and k_dst, v_dst alike with contiguous head dims")
    if qkv.device.type != "cuda" and not is_interpreted(_rotary_kv_kernel):
        raise RuntimeError("rotary_kv needs CUDA tensors (or TRITON_INTERPRET=1 before the kernels import)")
    if n == 0:
        return
    half = head_dim // 2
    _rotary_kv_kernel[(n,)](qkv, cos, signed_sin, k_dst, v_dst, offsets, qkv.stride(0), cos.stride(0),
                            signed_sin.stride(0), k_dst.stride(-2), v_dst.stride(-2), HQ=num_q_heads,
                            HKV=num_kv_heads, HALF=half, BLOCK_H=triton.next_power_of_2(num_q_heads + num_kv_heads),
                            BLOCK_HALF=triton.next_power_of_2(half), BLOCK_KV=triton.next_power_of_2(num_kv_heads),
                            num_warps=4)


@triton.jit
def _silu_mul_kernel(X, Out, N, stride_x, stride_o, BLOCK: tl.constexpr):
    """Row `row`, columns of block `block`: SiLU(gate) * up, each rounded as torch rounds it."""
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < N
    gate = tl.load(X + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(X + row * stride_x + N + cols, mask=mask, other=0.0).to(tl.float32)
    dtype = Out.dtype.element_ty
    silu = (gate / (1.0 + tl.exp(-gate))).to(dtype).to(tl.float32)
    tl.store(Out + row * stride_o + cols, (silu * up).to(dtype), mask=mask)


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """gate_up: [N, 2 I] (gate, then up), rows contiguous -> SiLU(gate) * up [N, I] in its dtype."""
    if gate_up.dim() != 2 or gate_up.shape[1] % 2 or gate_up.stride(1) != 1:
        raise ValueError(f"silu_mul needs gate_up [N, 2 I] with contiguous rows; got {tuple(gate_up.shape)}")
    if gate_up.device.type != "cuda" and not is_interpreted(_silu_mul_kernel):
        raise RuntimeError("silu_mul needs CUDA tensors (or TRITON_INTERPRET=1 before the kernels import)")
    n, width = gate_up.shape
    out = torch.empty(n, width // 2, dtype=gate_up.dtype, device=gate_up.device)
    if n:
        block = min(4096, triton.next_power_of_2(width // 2))
        _silu_mul_kernel[(n, triton.cdiv(width // 2, block))](gate_up, out, width // 2, gate_up.stride(0),
                                                              out.stride(0), BLOCK=block, num_warps=4)
    return out
