"""Batch-invariant GEMM and RMSNorm for CUDA (Triton): a row's result never depends on the others.

cuBLAS picks its algorithm (tile shape, split-K) by the number of rows, so the same row of a
bf16 activation comes out rounded differently in a decode step of 3 rows and one of 11: greedy
tokens then change with the load. These kernels fix everything a row's reduction depends on:
- `linear`: no split-K; each output summed over k from 0 in order by the same tensor-core
  instruction family (Hopper's wgmma m64nXk16, chained over k), fp32 accumulation. Its tiles
  are chosen without the rows in view, except for one switch: up to 64 rows (decode) one row
  tile of 64 and columns split finely enough to give every SM a program (a row's weights are
  read once, by many SMs at once, which is what bounds decode); above it (prefill) 128 x 128
  tiles. The two compute each element by the same chain of instructions; that the device rounds
  them alike is checked once per weight shape on the device (`_tiles_agree`), and where they do
  not, every row count uses the decode tiles;
- `rms_norm`: one program per row, the whole row in one block, fp32 sums;
so a row's bits depend only on its own inputs (vLLM's and SGLang's batch-invariant modes do the
same with persistent matmuls; this one is the plain tiled form).
"""
from __future__ import annotations

import functools
import logging
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from baton.engine.kernels._common import is_interpreted

log = logging.getLogger(__name__)
_FLOATS = (torch.float32, torch.float16, torch.bfloat16)


@dataclass(frozen=True)
class Tiles:
    block_m: int
    block_n: int
    block_k: int
    warps: int
    stages: int


DECODE_ROWS = 64  # up to this many rows, the decode tiles
PREFILL_TILES = Tiles(128, 128, 64, warps=8, stages=3)
_AGREE: dict[tuple, bool] = {}  # (device, dtype, N, K, bias) -> the prefill tiles give the decode tiles' bits


def decode_tiles(n: int, device: torch.device) -> Tiles:
    """64-row tiles with the widest column block that still gives every SM a program (decode
    reads each weight once: with fewer programs than SMs, part of the memory bandwidth idles)."""
    return _decode_tiles(n, str(device))


@functools.cache
def _decode_tiles(n: int, device: str) -> Tiles:  # every GEMM asks: once per width and device
    sms = torch.cuda.get_device_properties(device).multi_processor_count if device.startswith("cuda") else 4
    block_n = next((b for b in (128, 64, 32) if triton.cdiv(n, b) >= sms), 16)
    return Tiles(DECODE_ROWS, block_n, 64, warps=4, stages=4)


@triton.jit
def _linear_kernel(X, W, Bias, Res, Out, XS, WS, M, N, K, stride_xm, stride_wn, stride_rm, stride_om,
                   HAS_BIAS: tl.constexpr, HAS_RES: tl.constexpr, SCALED: tl.constexpr, UPCAST: tl.constexpr,
                   IEEE: tl.constexpr,
                   BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """Out[m, n] = sum_k X[m, k] * W[n, k] (x XS[m] * WS[n]) (+ Bias[n]) (+ Res[m, n]), k in BLOCK_K
    steps from 0. SCALED: X and W are fp8 codes, XS and WS each row's and each feature's scale."""
    offs_m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    m_mask = offs_m < M
    n_mask = offs_n < N
    x_rows = X + offs_m.to(tl.int64)[:, None] * stride_xm
    w_rows = W + offs_n.to(tl.int64)[:, None] * stride_wn
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k in range(0, K, BLOCK_K):
        cols = k + offs_k
        k_mask = cols < K
        # x: [BLOCK_M, BLOCK_K], w: [BLOCK_N, BLOCK_K]; masked elements are 0 and add nothing
        x = tl.load(x_rows + cols[None, :], mask=m_mask[:, None] & k_mask[None, :], other=0.0)
        w = tl.load(w_rows + cols[None, :], mask=n_mask[:, None] & k_mask[None, :], other=0.0)
        if UPCAST:  # the interpreter has no half-precision dot
            x = x.to(tl.float32)
            w = w.to(tl.float32)
        if IEEE:  # fp32 operands: true fp32 products, not TF32
            acc = tl.dot(x, tl.trans(w), acc, input_precision="ieee")
        else:
            acc = tl.dot(x, tl.trans(w), acc)
    if SCALED:  # fp8: the codes' products times the token's and the feature's scales
        acc = acc * tl.load(XS + offs_m, mask=m_mask, other=0.0)[:, None] \
            * tl.load(WS + offs_n, mask=n_mask, other=0.0)[None, :]
    if HAS_BIAS:
        acc += tl.load(Bias + offs_n, mask=n_mask, other=0.0).to(tl.float32)[None, :]
    out = Out + offs_m.to(tl.int64)[:, None] * stride_om + offs_n[None, :]
    mask = m_mask[:, None] & n_mask[None, :]
    y = acc.to(Out.dtype.element_ty)
    if HAS_RES:  # the residual added as `res + linear(x)` adds it: to the product rounded to the dtype
        res = tl.load(Res + offs_m.to(tl.int64)[:, None] * stride_rm + offs_n[None, :], mask=mask, other=0.0)
        y = (res.to(tl.float32) + y.to(tl.float32)).to(Out.dtype.element_ty)
    tl.store(out, y, mask=mask)


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
           residual: torch.Tensor | None = None) -> torch.Tensor:
    """x: [M, K] (stride 1 along K); weight: [N, K] contiguous; bias: [N] or None -> [M, N] in x's
    dtype, each row computed alone in a fixed order; residual: [M, N] (stride 1 along N) or None,
    added to the result in the same launch (`residual + linear(x)`, the same bits)."""
    if x.dim() != 2 or weight.dim() != 2 or x.shape[1] != weight.shape[1]:
        raise ValueError(f"linear needs x [M, K] and weight [N, K]; got {tuple(x.shape)} and {tuple(weight.shape)}")
    if x.dtype not in _FLOATS or weight.dtype != x.dtype:
        raise ValueError(f"x and weight must share a float dtype; got {x.dtype} and {weight.dtype}")
    if bias is not None and (bias.shape != (weight.shape[0],) or not bias.is_contiguous()):
        raise ValueError(f"bias must be contiguous [{weight.shape[0]}]; got {tuple(bias.shape)}")
    if x.stride(1) != 1 or not weight.is_contiguous():
        raise ValueError("x's rows and the weight must be contiguous along K")
    _check_residual(x, weight.shape[0], residual)
    interpreted = is_interpreted(_linear_kernel)
    if x.device.type != "cuda" and not interpreted:
        raise RuntimeError("the invariant GEMM needs CUDA tensors (or TRITON_INTERPRET=1 before the kernels import)")
    return _gemm(x, weight, bias, residual, x.dtype)


def fp8_linear(x: torch.Tensor, weight, bias: torch.Tensor | None = None,
               residual: torch.Tensor | None = None) -> torch.Tensor:
    """`linear` for an fp8 weight (`engine.fp8.Fp8Weight`: e4m3 codes [N, K], a scale per output
    feature): each row of x [M, K] quantized to e4m3 on its own largest magnitude (a kernel of its
    own), the codes multiplied on the tensor cores and summed in fp32 in the same fixed order,
    scaled back -> [M, N] in x's dtype, each row alone (batch-invariant)."""
    if x.dim() != 2 or x.shape[1] != weight.shape[1] or x.dtype not in _FLOATS:
        raise ValueError(f"fp8_linear needs float x [M, {weight.shape[1]}]; got {x.dtype} {tuple(x.shape)}")
    _check_residual(x, weight.shape[0], residual)
    codes, scales = quantize_rows(x)
    return _gemm(codes, weight.data, bias, residual, x.dtype, scales, weight.scale)


def _check_residual(x: torch.Tensor, n: int, residual: torch.Tensor | None) -> None:
    if residual is not None and (residual.shape != (x.shape[0], n) or residual.stride(1) != 1
                                 or residual.dtype != x.dtype):
        raise ValueError(f"residual must be [{x.shape[0]}, {n}] in {x.dtype} with contiguous rows; got "
                         f"{residual.dtype} {tuple(residual.shape)}")


def _gemm(x, weight, bias, residual, out_dtype, x_scale=None, w_scale=None) -> torch.Tensor:
    """The tiles for this weight and row count (module docstring), then the launch."""
    interpreted = is_interpreted(_linear_kernel)
    tiles = decode_tiles(weight.shape[0], x.device)
    if x.shape[0] > DECODE_ROWS and _tiles_agree(weight, bias, tiles, x_scale is not None, out_dtype):
        tiles = PREFILL_TILES
    return _launch(x, weight, bias, tiles, interpreted, residual, out_dtype, x_scale, w_scale)


def _launch(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, tiles: Tiles,
            interpreted: bool, residual: torch.Tensor | None = None, out_dtype: torch.dtype | None = None,
            x_scale: torch.Tensor | None = None, w_scale: torch.Tensor | None = None) -> torch.Tensor:
    (m, k), n = x.shape, weight.shape[0]
    out = torch.empty(m, n, dtype=out_dtype or x.dtype, device=x.device)
    if m == 0:
        return out
    grid = (triton.cdiv(m, tiles.block_m), triton.cdiv(n, tiles.block_n))
    res = residual if residual is not None else out  # not read without HAS_RES
    scaled = x_scale is not None
    _linear_kernel[grid](x, weight, bias if bias is not None else out, res, out, x_scale if scaled else out,
                         w_scale if scaled else out, m, n, k, x.stride(0), weight.stride(0), res.stride(0),
                         out.stride(0), HAS_BIAS=bias is not None, HAS_RES=residual is not None, SCALED=scaled,
                         UPCAST=interpreted, IEEE=x.dtype == torch.float32, BLOCK_M=tiles.block_m,
                         BLOCK_N=tiles.block_n, BLOCK_K=tiles.block_k, num_warps=tiles.warps,
                         num_stages=tiles.stages)
    return out


def _tiles_agree(weight: torch.Tensor, bias: torch.Tensor | None, decode: Tiles, scaled: bool,
                 out_dtype: torch.dtype) -> bool:
    """Whether the prefill tiles give every element the decode tiles' bits for this weight's
    shape on this device: checked once, on random rows (rounding that differs shows on most of
    them). Not during a CUDA graph capture (it synchronises): the decode tiles serve until then."""
    key = (str(weight.device), weight.dtype, *weight.shape, bias is not None, scaled)
    if key not in _AGREE:
        if weight.device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            return False
        gen = torch.Generator(device=weight.device).manual_seed(0)
        x = torch.randn(2 * PREFILL_TILES.block_m, weight.shape[1], generator=gen, device=weight.device)
        x, x_scale, w_scale = x.to(weight.dtype), None, None
        if scaled:
            x_scale = torch.rand(x.shape[0], device=x.device) + 0.5
            w_scale = torch.rand(weight.shape[0], device=x.device) + 0.5
        interpreted = is_interpreted(_linear_kernel)
        agree = torch.equal(_launch(x, weight, bias, decode, interpreted, None, out_dtype, x_scale, w_scale),
                            _launch(x, weight, bias, PREFILL_TILES, interpreted, None, out_dtype, x_scale, w_scale))
        if not agree:
            log.warning("the invariant GEMM's prefill tiles round a [%d, %d] %s weight differently from its "
                        "decode tiles on %s: prefill uses the decode tiles for it (slower, still invariant)",
                        weight.shape[0], weight.shape[1], str(weight.dtype).removeprefix("torch."), weight.device)
        _AGREE[key] = agree
    return _AGREE[key]


@triton.jit
def _quantize_rows_kernel(X, Q, S, K, stride_x, stride_q, FP8_MAX: tl.constexpr, BLOCK: tl.constexpr):
    """Row `row` of X to fp8 codes scaled to its largest magnitude, and its scale."""
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    mask = offs < K
    x = tl.load(X + row * stride_x + offs, mask=mask, other=0.0).to(tl.float32)
    scale = tl.maximum(tl.max(tl.abs(x), 0) / FP8_MAX, 1e-12)
    tl.store(S + row, scale)
    codes = tl.minimum(tl.maximum(x / scale, -FP8_MAX), FP8_MAX)
    tl.store(Q + row * stride_q + offs, codes.to(Q.dtype.element_ty), mask=mask)


def quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] -> (e4m3 codes [M, K], fp32 scales [M]): engine.fp8.quantize_rows, one program a row."""
    from baton.engine.fp8 import FP8, FP8_MAX

    if x.device.type != "cuda" and not is_interpreted(_quantize_rows_kernel):
        raise RuntimeError("fp8 rows need CUDA tensors (or TRITON_INTERPRET=1 before the kernels import)")
    m, k = x.shape
    codes = torch.empty(m, k, dtype=FP8, device=x.device)
    scales = torch.empty(m, dtype=torch.float32, device=x.device)
    if m:
        block = triton.next_power_of_2(k)
        _quantize_rows_kernel[(m,)](x, codes, scales, k, x.stride(0), codes.stride(0), FP8_MAX=FP8_MAX, BLOCK=block,
                                    num_warps=min(16, max(1, block // 512)))
    return codes, scales


@triton.jit
def _rms_norm_kernel(X, W, Out, N, eps, stride_x, stride_o, BLOCK: tl.constexpr):
    """One row: transformers' order, normalised in fp32, rounded to the dtype, then times the weight."""
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    mask = offs < N
    x = tl.load(X + row * stride_x + offs, mask=mask, other=0.0).to(tl.float32)
    rstd = 1.0 / tl.sqrt(tl.sum(x * x, 0) / N + eps)
    y = (x * rstd).to(Out.dtype.element_ty).to(tl.float32)
    w = tl.load(W + offs, mask=mask, other=0.0).to(tl.float32)
    tl.store(Out + row * stride_o + offs, (w * y).to(Out.dtype.element_ty), mask=mask)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x: [R, H] (stride 1 along H); weight: [H] -> [R, H] in x's dtype, one program per row."""
    if x.dim() != 2 or weight.shape != (x.shape[1],) or x.stride(1) != 1 or not weight.is_contiguous():
        raise ValueError(f"rms_norm needs x [R, H] and a contiguous weight [H]; got {tuple(x.shape)}, "
                         f"{tuple(weight.shape)}")
    if x.device.type != "cuda" and not is_interpreted(_rms_norm_kernel):
        raise RuntimeError("the invariant RMSNorm needs CUDA tensors (or TRITON_INTERPRET=1 before the kernels import)")
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    if x.shape[0]:
        block = triton.next_power_of_2(x.shape[1])
        _rms_norm_kernel[(x.shape[0],)](x, weight, out, x.shape[1], eps, x.stride(0), out.stride(0), BLOCK=block,
                                        num_warps=min(16, max(1, block // 256)))
    return out
