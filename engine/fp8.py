"""fp8 weights (issue 50): float8 e4m3 with one fp32 scale per output feature, the layout vLLM's
`fp8` serves on Hopper GPUs (their tensor cores multiply e4m3 at twice bf16's rate, and a decode
step reads half the bytes).

A weight row w is stored as round(w / s) in e4m3 with s = max|w| / 448 (e4m3's largest value), so
each row keeps its own range. Activations are quantized the same way per token at run time
(dynamic scaling: a token's scale depends on that token alone, so batch invariance holds), and
the product of the two e4m3 matrices, summed in fp32, is scaled back by the token's and the
output feature's scales. Norms, the embedding table and the LM head stay in the model's dtype.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0
# e4m3 keeps 3 bits of mantissa: about 2.5% of a Gaussian weight's norm is lost to rounding; a
# weight that loses more holds outliers its rows' ranges cannot carry, and is refused
MAX_ERROR = 0.05


@dataclass
class Fp8Weight:
    data: torch.Tensor  # float8_e4m3fn [N, K]
    scale: torch.Tensor  # float32 [N]: row n is data[n] * scale[n]

    def __post_init__(self):
        if self.data.dtype != FP8 or self.data.dim() != 2:
            raise ValueError(f"fp8 weight data must be float8_e4m3fn [N, K], not {self.data.dtype} "
                             f"{tuple(self.data.shape)}")
        if self.scale.shape != (self.data.shape[0],) or self.scale.dtype != torch.float32:
            raise ValueError(f"fp8 weight scales must be float32 [{self.data.shape[0]}], not {self.scale.dtype} "
                             f"{tuple(self.scale.shape)}")

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(self.data.shape)

    @property
    def nbytes(self) -> int:
        return self.data.nbytes + self.scale.nbytes

    @property
    def device(self) -> torch.device:
        return self.data.device

    def rows(self, index: torch.Tensor) -> "Fp8Weight":
        return Fp8Weight(self.data[index.to(self.data.device)].contiguous(), self.scale[index.to(self.data.device)])

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return (self.data.float() * self.scale[:, None]).to(dtype)


def quantize(weight: torch.Tensor) -> Fp8Weight:
    """A float weight [N, K] -> e4m3 rows, each scaled to its own largest magnitude (as activations are)."""
    return Fp8Weight(*quantize_rows(weight.detach()))


def quantization_error(weight: torch.Tensor, q: Fp8Weight) -> float:
    """The weight's relative error (Frobenius norm) once stored in fp8."""
    w = weight.detach().float()
    return float((q.dequantize() - w).norm() / w.norm().clamp(min=1e-30))


def cat(weights: list[Fp8Weight]) -> Fp8Weight:
    """Several projections of one input as one weight (fused QKV, gate/up): rows keep their scales."""
    return Fp8Weight(torch.cat([w.data for w in weights]), torch.cat([w.scale for w in weights]))


def quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Activations [M, K] -> (e4m3 [M, K], fp32 scales [M]), each row scaled to its own largest magnitude."""
    x = x.float()
    scale = (x.abs().amax(dim=1) / FP8_MAX).clamp(min=1e-12)
    return (x / scale[:, None]).clamp(-FP8_MAX, FP8_MAX).to(FP8), scale


def linear(x: torch.Tensor, weight: Fp8Weight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [M, K] @ weight^T through torch._scaled_mm (cuBLASLt's fp8 GEMM on a GPU; it also runs,
    slowly, on CPU), each row's activations quantized on the fly -> [M, N] in x's dtype. Not
    batch-invariant on a GPU (cuBLASLt picks its algorithm by the row count): the invariant path is
    `engine.kernels.invariant.fp8_linear`."""
    xq, xs = quantize_rows(x)
    out = torch._scaled_mm(xq, weight.data.t(), scale_a=xs[:, None], scale_b=weight.scale[None, :],
                           out_dtype=x.dtype)
    return out if bias is None else out + bias


def from_checkpoint(tensors: dict[str, torch.Tensor], dtype: torch.dtype, keep: bool) -> dict:
    """An fp8 checkpoint's tensors in vLLM's layout: projection 'x.weight' in e4m3 beside
    'x.weight_scale' (one per tensor, or one per output feature) -> Fp8Weight (keep) or floats in
    dtype. 'x.input_scale' (static activation scales) is dropped: activations are scaled per token."""
    out = {}
    for name, tensor in tensors.items():
        if name.endswith(("_scale", "_scale_inv")):
            continue
        if tensor.dtype != FP8:
            out[name] = tensor
            continue
        scale = tensors.get(name + "_scale")
        if scale is None or scale.numel() not in (1, tensor.shape[0]):
            raise ValueError(f"{name} is stored in fp8 without a scale per tensor or per output feature "
                             f"({name}_scale)")
        scale = scale.float().reshape(-1).expand(tensor.shape[0]).contiguous()
        weight = Fp8Weight(tensor.contiguous(), scale)
        out[name] = weight if keep else weight.dequantize(dtype)
    return out
