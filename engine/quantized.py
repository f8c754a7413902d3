"""Weights that stay quantized in memory: GGUF's Q8_0, Q4_0, Q4_1 and Q4_K blocks, as a GGUF file
holds them (`model.quantization: gguf`) or made from float weights at load (`int8`: Q8_0 blocks).

A `BlockWeight` is a weight [N, K] as GGUF lays it out: each row K / 32 blocks of 32 weights, a
block an fp16 scale d (Q4_1: and an fp16 minimum m) and its 32 codes q:
    Q8_0: w = d q, q int8;   Q4_0: w = d (q - 8), q in 0..15;   Q4_1: w = d q + m, q in 0..15
(Q4 codes two to a byte: byte i holds q[i] low and q[i + 16] high). `panels()` repacks the same
bytes for Baton's CPU GEMM (engine/cpu/quantized.h), which reads them as they are.

Q4_K (GGUF's 256-weight super-blocks: an fp16 d and dmin, a 6-bit scale s and minimum n for each of
its eight 32-weight blocks, 4-bit codes) is held as eight Q4_1-like blocks with an fp32 d s and
-dmin n each: w = (d s) q - dmin n, the very values gguf-py computes (the products are exact in
fp32), 24 bytes a block where the file has 18 (`from_q4_k`). Policy-free: what a file or a setting
asks for is decided in engine.model.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from baton.engine.cpu.huge_pages import copy_into_huge_pages

QBLOCK = 32  # weights per block, along k
PANEL = 16  # output features per panel, as the C GEMM reads them
# format -> (the C kernels' code, the bytes of one block of 32 weights)
FORMATS = {"q8_0": (1, 34), "q4_0": (2, 18), "q4_1": (3, 20), "q4_k": (4, 24)}
# format -> its blocks' scale fields before the codes: (offset, bytes) each, fp16 or fp32
_FIELDS = {"q8_0": ((0, 2),), "q4_0": ((0, 2),), "q4_1": ((0, 2), (2, 2)), "q4_k": ((0, 4), (4, 4))}
Q4_K_WEIGHTS, Q4_K_BYTES = 256, 144  # a GGUF Q4_K super-block
FLOAT_FORMAT = 0  # the C kernels' code for panels in the model's float dtype


@dataclass
class BlockWeight:
    format: str
    data: torch.Tensor  # uint8 [N, K // 32 * block bytes], GGUF's row layout
    in_features: int
    # what its GEMM quantizes the inputs to per block of 32: 16 bits (model.quantized_inputs'
    # default) or 8 (llama.cpp's arithmetic)
    input_bits: int = 16

    def __post_init__(self):
        if self.format not in FORMATS:
            raise ValueError(f"unknown block format {self.format!r}; known: {', '.join(FORMATS)}")
        if self.in_features % QBLOCK:
            raise ValueError(f"a {self.format} weight needs rows of a multiple of {QBLOCK} values, not {self.in_features}")
        want = self.in_features // QBLOCK * FORMATS[self.format][1]
        if self.data.dtype != torch.uint8 or self.data.dim() != 2 or self.data.shape[1] != want:
            raise ValueError(f"{self.format} data must be uint8 [N, {want}], not {tuple(self.data.shape)} {self.data.dtype}")

    @property
    def out_features(self) -> int:
        return self.data.shape[0]

    @property
    def shape(self) -> tuple[int, int]:
        return (self.out_features, self.in_features)

    @property
    def nbytes(self) -> int:
        return self.data.nbytes

    @property
    def code(self) -> int:
        return FORMATS[self.format][0]

    def _blocks(self) -> torch.Tensor:
        return self.data.view(self.out_features, self.in_features // QBLOCK, FORMATS[self.format][1])

    def dequantize(self) -> torch.Tensor:
        """float32 [N, K], as gguf-py (and so transformers' GGUF loader) computes it."""
        return _values(self.format, self._blocks()).reshape(self.out_features, self.in_features)

    def rows(self, index: torch.Tensor) -> BlockWeight:
        """The rows `index` (a permutation, a selection) as a BlockWeight."""
        return BlockWeight(self.format, self.data[index].contiguous(), self.in_features, self.input_bits)

    def panels(self) -> torch.Tensor:
        """The same bytes as the C GEMM reads them (engine/cpu/quantized.h): uint8 [ceil(N / 16),
        K / 32, panel block bytes], a panel's blocks in k order, each block its 16 features'
        scales (Q4_1: then minimums), then its codes in groups of four consecutive bytes, a group's
        16 features side by side (Q8_0's codes stored as the unsigned q + 128). Features past N are
        zero (their outputs are 0). In 2 MB pages where the kernel gives them (engine/cpu/huge_pages.py)."""
        n, blocks, size = self._blocks().shape
        panels = (n + PANEL - 1) // PANEL
        padded = torch.zeros(panels * PANEL, blocks, size, dtype=torch.uint8)
        padded[:n] = self._blocks()
        per_feature = padded.view(panels, PANEL, blocks, size).transpose(1, 2)  # [P, B, 16, size]
        head = _head(self.format)
        scales = [per_feature[..., at:at + width].reshape(panels, blocks, width * PANEL)
                  for at, width in _FIELDS[self.format]]
        codes = per_feature[..., head:].reshape(panels, blocks, PANEL, -1, 4).transpose(2, 3)  # [P, B, group, 16, 4]
        if self.format == "q8_0":
            codes = codes ^ 0x80
        return copy_into_huge_pages(torch.cat([*scales, codes.reshape(panels, blocks, -1)], dim=-1))


def _head(format: str) -> int:
    """The bytes before a block's codes: its scale, and Q4_1's or Q4_K's minimum."""
    return sum(width for _, width in _FIELDS[format])


def panel_rows(format: str, packed: torch.Tensor, index: torch.Tensor, in_features: int) -> torch.Tensor:
    """Rows `index` of the weight packed by `panels()`, dequantized: float32 [len(index), K] (an
    embedding lookup from the tied LM head's panels, no second copy of the table)."""
    index = index.reshape(-1).to(torch.long)
    panel, lane = index // PANEL, index % PANEL
    blocks = in_features // QBLOCK
    picked = packed[panel]  # [n, B, panel block bytes]
    head, n = _head(format), index.numel()
    scales = [picked[..., at * PANEL:(at + width) * PANEL].contiguous().view(n, blocks, PANEL, width)
              for at, width in _FIELDS[format]]
    codes = picked[..., head * PANEL:].reshape(n, blocks, -1, PANEL, 4)  # [n, B, group, 16, 4]
    rows = torch.arange(n)
    gguf = [scale[rows, :, lane] for scale in scales]  # [n, B, 2 or 4] each
    own = codes[rows, :, :, lane].reshape(n, blocks, -1)  # [n, B, code bytes]
    gguf.append(own ^ 0x80 if format == "q8_0" else own)
    return _values(format, torch.cat(gguf, dim=-1)).reshape(n, in_features)


def _values(format: str, blocks: torch.Tensor) -> torch.Tensor:
    """Blocks uint8 [..., block bytes] -> float32 [..., 32] (gguf-py's arithmetic)."""
    def field(at: int, width: int) -> torch.Tensor:  # [..., 1] float32
        return blocks[..., at:at + width].contiguous().view(torch.float16 if width == 2 else torch.float32).float()

    scale, *minimum = _FIELDS[format]
    d = field(*scale)
    if format == "q8_0":
        return d * blocks[..., 2:].contiguous().view(torch.int8).float()
    packed = blocks[..., _head(format):]
    codes = torch.cat([packed & 15, packed >> 4], dim=-1)
    if format == "q4_0":
        return d * (codes.to(torch.int8) - 8).float()
    return d * codes.float() + field(*minimum[0])


def from_q4_k(data: torch.Tensor, in_features: int) -> BlockWeight:
    """GGUF Q4_K rows (uint8 [N, K / 256 * 144]) as "q4_k" blocks: per 32 weights an fp32 d s and
    -dmin n (exact), then the block's codes two to a byte as Q4_1 holds them."""
    if in_features % Q4_K_WEIGHTS:
        raise ValueError(f"a Q4_K weight needs rows of a multiple of {Q4_K_WEIGHTS} values, not {in_features}")
    n = data.shape[0]
    supers = data.reshape(n, in_features // Q4_K_WEIGHTS, Q4_K_BYTES)
    d = supers[..., 0:2].contiguous().view(torch.float16).float()  # [N, S, 1]
    dmin = supers[..., 2:4].contiguous().view(torch.float16).float()
    packed = supers[..., 4:16].to(torch.int32)  # the eight 6-bit scales and minimums, 12 bytes
    low, high, both = packed[..., 0:4], packed[..., 4:8], packed[..., 8:12]
    scales = torch.cat([low & 63, (both & 15) | ((low >> 2) & 48)], dim=-1)  # [N, S, 8]
    mins = torch.cat([high & 63, (both >> 4) | ((high >> 2) & 48)], dim=-1)
    # the codes: 32 bytes per two blocks, the first's codes in the low nibbles, the second's high
    qs = supers[..., 16:].reshape(n, -1, 4, 1, 32)
    codes = torch.cat([qs & 15, qs >> 4], dim=-2).reshape(n, -1, 32)  # [N, blocks, 32], in k order
    q4_1 = codes[..., :16] | (codes[..., 16:] << 4)  # byte i: q[i] low, q[i + 16] high
    block_d = (d * scales.float()).reshape(n, -1, 1)
    block_m = -(dmin * mins.float()).reshape(n, -1, 1)
    blocks = torch.cat([block_d.view(torch.uint8), block_m.view(torch.uint8), q4_1], dim=-1)
    return BlockWeight("q4_k", blocks.reshape(n, -1).contiguous(), in_features)


def quantize_q8_0(weight: torch.Tensor) -> BlockWeight:
    """Floats [N, K] -> Q8_0 blocks as llama.cpp quantizes them: d = max |w| / 127 per block (fp16),
    q = w / d rounded half away from zero."""
    n, k = weight.shape
    if k % QBLOCK:
        raise ValueError(f"Q8_0 needs rows of a multiple of {QBLOCK} values, not {k}")
    w = weight.detach().float().reshape(n, k // QBLOCK, QBLOCK)
    d = w.abs().amax(dim=-1, keepdim=True) / 127
    inverse = torch.where(d > 0, 1 / d, torch.zeros_like(d))
    scaled = w * inverse
    q = (scaled.sign() * (scaled.abs() + 0.5).floor()).clamp(-127, 127).to(torch.int8)
    data = torch.cat([d.to(torch.float16).view(torch.uint8), q.view(torch.uint8)], dim=-1)
    return BlockWeight("q8_0", data.reshape(n, -1).contiguous(), k)


def cat(parts: list[BlockWeight]) -> BlockWeight:
    """Rows of several weights of one input (a fused QKV or gate/up). Parts in different formats
    become Q8_0 of their values (a GGUF file may store V wider than Q and K)."""
    formats = {p.format for p in parts}
    if len({p.in_features for p in parts}) != 1:
        raise ValueError("fused weights must share their input width")
    if len(formats) > 1:
        parts = [p if p.format == "q8_0" else quantize_q8_0(p.dequantize()) for p in parts]
    return BlockWeight(parts[0].format, torch.cat([p.data for p in parts]), parts[0].in_features,
                       max(p.input_bits for p in parts))


def quantization_loss(weight: torch.Tensor, quantized: BlockWeight) -> tuple[float, float]:
    """What quantizing lost of one weight: ||w - Q(w)|| / ||w||, and the fraction of its nonzero
    values that became 0 (a block's outlier sets a step its other values fall below; the norm,
    the outlier's own, hardly shows it)."""
    w = weight.detach().float()
    values = quantized.dequantize()
    norm, nonzero = w.norm().item(), (w != 0).sum().item()
    error = 0.0 if norm == 0 else (w - values).norm().item() / norm
    zeroed = 0.0 if nonzero == 0 else ((values == 0) & (w != 0)).sum().item() / nonzero
    return error, zeroed
