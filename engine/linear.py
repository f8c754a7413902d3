"""A linear layer with its weight stored the way this device's GEMM reads it fastest.

Small-batch decode reads every weight once per step, so the weight layout decides the step
time. On CPU a decode step's few rows go to Baton's own kernel over weights packed in k-major
panels in the model's dtype (`engine.cpu.kernels`: fp32, bf16 or fp16 weights, fp32 activations
and sums), and so do prompts' rows; fp32 weights hand forwards of more than `max_rows` rows (2048
with AVX-512, else 64) to `F.linear` (MKL) over the plain weight. Without a C compiler, oneDNN's
prepacked layout serves the few rows instead. Both read weights faster than `F.linear` does at
1-16 rows (docs/bench.md, `baton bench engine`). On CUDA in bf16/fp16 with batch invariance,
the plain weight through Baton's fixed-order Triton GEMM (`engine.kernels.invariant`; cuBLAS
rounds a row differently with the row count). Elsewhere the plain weight and `F.linear`.
Quantized weights (engine.quantized) run on Baton's CPU kernels only, in their own blocks; fp8
weights (engine.fp8) on the invariant Triton GEMM ('triton') or torch._scaled_mm ('plain').
"""
from __future__ import annotations

import functools
import logging

import torch
import torch.nn.functional as F

from baton.engine import fp8
from baton.engine.cpu import kernels as cpu_kernels
from baton.engine.quantized import FLOAT_FORMAT, BlockWeight

log = logging.getLogger(__name__)

HALF = (torch.bfloat16, torch.float16)

# oneDNN chooses its blocked layout for an expected row count; decode batches are a few rows.
ONEDNN_PACK_ROWS = 8


class Linear:
    def __init__(self, weight: torch.Tensor | BlockWeight | fp8.Fp8Weight, bias: torch.Tensor | None = None, *,
                 layout: str = "plain"):
        # weight: [out_features, in_features], floats or quantized blocks (engine.quantized)
        self.out_features, self.in_features = weight.shape
        self.weight = weight
        self.bias = bias
        self.layout = layout
        self.packed = None
        self.code = FLOAT_FORMAT  # the C kernels' weight format: quantized panels where not 0
        self.fp8 = weight if isinstance(weight, fp8.Fp8Weight) else None
        if self.fp8 is not None:
            if layout not in ("triton", "plain"):
                raise ValueError(f"fp8 weights run on the 'triton' or 'plain' layout, not {layout!r}")
            self.weight = None
        elif isinstance(weight, BlockWeight):
            if layout != "panels":
                raise ValueError(f"{weight.format} weights run on Baton's CPU kernels only, not the {layout!r} layout")
            self.weight, self.code, self.format, self.input_bits = None, weight.code, weight.format, weight.input_bits
            self.packed = weight.panels()
        elif layout == "panels":
            self.packed = cpu_kernels.pack(weight)
            if weight.dtype != torch.float32:  # read through the panels at any row count: a plain copy is only memory
                self.weight = None
        elif layout == "onednn":
            self.packed = torch.ops.mkldnn._reorder_linear_weight(weight.detach().contiguous(), ONEDNN_PACK_ROWS)
        elif layout == "triton":
            self.weight = weight.contiguous()
        elif layout != "plain":
            raise ValueError(f"unknown weight layout {layout!r}")

    def __call__(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
        # x: [..., in_features] -> [..., out_features]; residual (the triton layout only): added in the GEMM
        if residual is not None and self.layout != "triton":
            raise ValueError(f"a residual added in the GEMM needs the triton layout, not {self.layout!r}")
        flat = x.reshape(-1, self.in_features)
        if self.fp8 is not None:
            if self.layout == "triton":
                from baton.engine.kernels import invariant_fp8_linear

                out = invariant_fp8_linear(flat if flat.stride(-1) == 1 else flat.contiguous(), self.fp8, self.bias,
                                           None if residual is None else residual.reshape(-1, self.out_features))
            else:
                out = fp8.linear(flat, self.fp8, self.bias)
            return out.view(*x.shape[:-1], self.out_features)
        if self.code:
            out = cpu_kernels.quant_gemm(flat.float(), self.packed, self.code, self.in_features, self.out_features,
                                         self.input_bits)
            if self.bias is not None:
                out += self.bias
            return out.view(*x.shape[:-1], self.out_features)
        # fp32 weights hand many rows to MKL; bf16/fp16 ones have no other fp32-activation GEMM
        if self.layout == "panels" and (self.packed.dtype != torch.float32
                                        or flat.shape[0] <= cpu_kernels.max_rows()):
            out = cpu_kernels.small_gemm(flat.float(), self.packed, self.out_features)
            if self.bias is not None:
                out += self.bias
        elif self.layout == "onednn":
            out = torch.ops.mkldnn._linear_pointwise(flat, self.packed, self.bias, "none", [], "")
        elif self.layout == "triton":
            from baton.engine.kernels import invariant_linear

            out = invariant_linear(flat if flat.stride(-1) == 1 else flat.contiguous(), self.weight, self.bias,
                                   None if residual is None else residual.reshape(-1, self.out_features))
        else:
            out = F.linear(flat, self.weight, self.bias)
        return out.view(*x.shape[:-1], self.out_features)


def best_layout(device: torch.device, dtype: torch.dtype, batch_invariant: bool = True) -> str:
    """'panels' (Baton's kernel, CPU, fp32 activations over fp32, bf16 or fp16 weights), 'onednn'
    (prepacked, where oneDNN packs this dtype here: fp32, or bf16 with AVX-512 or AVX-NE-CONVERT),
    'triton' (CUDA, bf16/fp16, batch-invariant), else 'plain'."""
    if device.type != "cpu":
        return "triton" if batch_invariant and device.type == "cuda" and dtype in HALF else "plain"
    if cpu_kernels.stores(dtype):
        return "panels"
    return "onednn" if onednn_packs(dtype) else "plain"


@functools.cache
def onednn_packs(dtype: torch.dtype) -> bool:
    """Probed once per dtype: every runner's layout choice and `dtype: auto` ask."""
    if not torch.backends.mkldnn.is_available():
        return False
    try:
        probe = torch.ops.mkldnn._reorder_linear_weight(torch.zeros(8, 8, dtype=dtype), 1)
        torch.ops.mkldnn._linear_pointwise(torch.zeros(1, 8, dtype=dtype), probe, None, "none", [], "")
        return True
    except (RuntimeError, AttributeError) as exc:
        log.info("oneDNN cannot prepack %s weights here (%s)", dtype, str(exc).splitlines()[0])
        return False
