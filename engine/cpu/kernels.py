"""Baton's CPU kernels (kernels.c, with kernels_typed.h once per storage type), built once per
machine, called via ctypes: the few-row GEMM over panel-packed weights, attention over paged KV
(and prefill attention computing each token as decode does), RMSNorm, rotary embedding,
SiLU-and-multiply, and all of a decode step's layers in one call.

Weights and KV are stored in the model's dtype (fp32, bf16, or fp16 where the compiler has
_Float16); activations and every sum are fp32. Each row is reduced on its own in a fixed order, so
a request's results do not depend on the rows beside it (batch invariance, kernels.c).

Built on first use with the machine's C compiler (`cc`, or $CC) for this very CPU
(-march=native; $BATON_CPU_MARCH names another instruction set, e.g. x86-64-v3 for AVX2, to
measure what a CPU without AVX-512 gets) into Baton's cache directory, keyed by the sources, the
flags and the CPU, so workers on one machine build it once. Where no compiler is found or the
build fails, `available()` is False, with one log line, and linear layers use oneDNN instead.
"""
from __future__ import annotations

import ctypes
import fcntl
import functools
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path

import torch

from baton.engine.cpu.huge_pages import copy_into_huge_pages
from baton.paths import cache_root

log = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("kernels.c")
SOURCES = (SOURCE, *(Path(__file__).with_name(name) for name in ("kernels_typed.h", "quantized.h")))  # kernels.c includes them
FLAGS = ("-O3", "-march=native", "-fopenmp", "-shared", "-fPIC")
MARCH_ENV = "BATON_CPU_MARCH"  # the -march the kernels are built for (default native)
SIXTEEN_BIT_INPUTS = 8  # added to a quantized format's code: its inputs go to 16-bit codes (quantized.h)


@functools.cache  # asked on every fp32 linear call: the built library cannot change in a process
def max_rows() -> int:
    """The most rows the panel GEMM takes for fp32 weights; past them MKL's blocked GEMM is faster
    (weights stored in bf16 or fp16 always take the panels: MKL has no fp32-by-bf16 GEMM). With AVX-512 (a
    panel row is one register) the panels stay ahead far into prefill sizes: measured on an EPYC
    (2026-11-26), one thread, SmolLM2's layer shapes, 104-112 GFLOP/s against MKL's 49-100 at
    16-1024 rows, 106 against 95 at 2048, 83 against 91 at 4096. An AVX2 build (two registers a
    panel row), against MKL held to AVX2 on a Xeon (2026-11-29): 99-101 GFLOP/s against 66-90 at
    16-32 rows, even at 64, MKL 8-15% ahead from 256. Asked of the build ($BATON_CPU_MARCH may
    build for less than this CPU has)."""
    lib = _library()
    return 2048 if lib is not None and lib.baton_vector_floats() == 16 else 64


def fast_quantized() -> bool:
    """Whether the built kernels' quantized GEMM has integer dot products: AVX512-VNNI, or AVX2's
    byte multiply-adds (Q4_1 at one row 2.3x the bf16 GEMM of an AVX2 build, 1.6-4x off VNNI; docs/
    quantization.md). Elsewhere (ARM, older x86) it takes a portable loop, 8-23x slower than AVX2's."""
    lib = _library()
    return lib is not None and lib.baton_quantized_dots() == 1


DISABLE_ENV = "BATON_CPU_KERNELS"  # '0' turns the kernels off (for A/B measurements)


def available() -> bool:
    return _library() is not None


# the storage types the kernels read, by their functions' suffix in kernels.c
SUFFIXES = {torch.float32: "f32", torch.bfloat16: "bf16", torch.float16: "f16"}


def stores(dtype: torch.dtype) -> bool:
    """Whether the kernels read weights and KV stored in `dtype` here (fp16 needs _Float16)."""
    lib = _library()
    return lib is not None and dtype in SUFFIXES and hasattr(lib, f"baton_small_gemm_{SUFFIXES[dtype]}")


def _typed(name: str, dtype: torch.dtype):
    if not stores(dtype):
        raise ValueError(f"Baton's CPU kernels do not read {dtype} here")
    return getattr(_library(), f"{name}_{SUFFIXES[dtype]}")


PANEL = 16  # output features per panel: kernels.c's PANEL


def pack(weight: torch.Tensor) -> torch.Tensor:
    """[N, K] -> panels [ceil(N / PANEL), K, PANEL] of PANEL output features, k-major, zero-padded,
    in the weight's own dtype, in 2 MB pages where the kernel gives them (huge_pages.py)."""
    n, k = weight.shape
    panels = (n + PANEL - 1) // PANEL
    padded = torch.zeros(panels * PANEL, k, dtype=weight.dtype)
    padded[:n] = weight
    return copy_into_huge_pages(padded.view(panels, PANEL, k).transpose(1, 2))


def small_gemm(x: torch.Tensor, packed: torch.Tensor, out_features: int) -> torch.Tensor:
    """x: [M, K] float32 -> x @ W^T: [M, out_features] float32, with W packed by `pack` (any stored dtype)."""
    if x.dtype != torch.float32:
        raise ValueError(f"small_gemm takes float32 activations, not {x.dtype}")
    x = x.contiguous()
    rows, k = x.shape
    out = torch.empty(rows, out_features, dtype=torch.float32)
    if _typed("baton_small_gemm", packed.dtype)(x.data_ptr(), packed.data_ptr(), out.data_ptr(), rows, k, out_features,
                                   torch.get_num_threads()):
        raise MemoryError("small_gemm could not allocate its transposed input")
    return out


def quant_gemm(x: torch.Tensor, packed: torch.Tensor, code: int, in_features: int, out_features: int,
               input_bits: int = 16) -> torch.Tensor:
    """x: [M, K] float32 -> x @ W^T: [M, out_features] float32, with W quantized panels
    (`engine.quantized.BlockWeight.panels`, format `code`), x quantized per block of 32 to 8-bit
    or 16-bit codes (engine/cpu/quantized.h)."""
    if x.dtype != torch.float32 or x.shape[-1] != in_features:
        raise ValueError(f"quant_gemm takes float32 activations of width {in_features}, not {x.dtype} {tuple(x.shape)}")
    if input_bits not in (8, 16):
        raise ValueError(f"quant_gemm quantizes its inputs to 8 or 16 bits, not {input_bits}")
    lib = _library()
    if lib is None or not hasattr(lib, "baton_quant_gemm"):
        raise ValueError("Baton's CPU kernels are not built here: quantized weights need them")
    x = x.contiguous()
    out = torch.empty(x.shape[0], out_features, dtype=torch.float32)
    failed = lib.baton_quant_gemm(code, input_bits == 16, x.data_ptr(), packed.data_ptr(), out.data_ptr(), x.shape[0],
                                  in_features, out_features, torch.get_num_threads())
    if failed == -2:
        raise ValueError(f"quant_gemm: format {code} or width {in_features} is not one the kernel reads")
    if failed:
        raise MemoryError("quant_gemm could not allocate its scratch")
    return out


def decode_attention(query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, table: torch.Tensor,
                     lengths: torch.Tensor, scale: float, lse: torch.Tensor | None = None) -> torch.Tensor:
    """query [R, Hq, D] float32; keys, values: one layer's pages [pages, Hkv, P, D] in the stored
    dtype (views of the paged KV, each head's page contiguous); table int64 [R, width]: each row's
    pages; lengths int64 [R]: row r attends its tokens [0, lengths[r]) -> [R, Hq, D], float32.
    With `lse` (float32 [R, Hq], contiguous), each row and head's log-sum-exp of scaled scores is
    written there too."""
    rows, heads, dim = query.shape
    _, kv_heads, page_size, _ = keys.shape
    if keys.stride() != values.stride() or keys.stride(3) != 1 or keys.stride(2) != dim:
        raise ValueError("keys and values must be same-strided page views with contiguous tokens")
    if query.dtype != torch.float32 or values.dtype != keys.dtype:
        raise ValueError(f"decode_attention takes a float32 query and keys and values alike; got "
                         f"{query.dtype}, {keys.dtype}, {values.dtype}")
    if (table.dtype != torch.int64 or lengths.dtype != torch.int64 or not table.is_contiguous()
            or table.shape[0] != rows or lengths.numel() != rows):
        raise ValueError(f"decode_attention needs an int64 page table [{rows}, width] and int64 lengths [{rows}]")
    query = query.contiguous()
    out = torch.empty_like(query)
    scale = dim ** -0.5 if scale is None else scale
    attend = _typed("baton_decode_attention", keys.dtype)
    if attend(query.data_ptr(), keys.data_ptr(), values.data_ptr(), table.data_ptr(), table.shape[1],
              lengths.data_ptr(), out.data_ptr(), None if lse is None else lse.data_ptr(), rows, heads, kv_heads, dim,
              page_size, keys.stride(0), keys.stride(1), ctypes.c_float(scale), torch.get_num_threads()):
        raise MemoryError("decode_attention could not allocate its scores")
    return out


def prefill_attention(query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
                      prefix_keys: torch.Tensor | None, prefix_values: torch.Tensor | None,
                      scale: float) -> torch.Tensor:
    """Causal attention of B prompts' new tokens, each token computed exactly as a decode step
    computes it (the same operations over the same tokens in the same order; tiles of consecutive
    tokens share each read of the keys and values). query: [B * T, Hq, D]
    float32 (rows may be strided, heads contiguous); keys, values: [B, Hkv, T, D] the prompts' own
    tokens; prefix_keys, prefix_values: [Hkv, C, D], a cached prefix every prompt continues (or
    None; heads may be strided, tokens contiguous) -> [B * T, Hq, D] float32."""
    b, kv_heads, t, dim = keys.shape
    rows, heads, _ = query.shape
    if (query.dtype != torch.float32 or rows != b * t or query.stride(2) != 1 or query.stride(1) != dim
            or keys.stride() != values.stride() or keys.stride(3) != 1 or keys.stride(2) != dim
            or values.dtype != keys.dtype):
        raise ValueError("prefill_attention: query [B * T, Hq, D] float32 and same-strided keys and values "
                         "[B, Hkv, T, D] with contiguous tokens")
    cached, prefix_stride = 0, 0
    if prefix_keys is not None and prefix_keys.shape[1]:
        # a view of a longer buffer (a chunked prompt's KV so far) is read in place: each head's
        # tokens must be contiguous rows, the heads may be any stride apart
        if prefix_keys.stride(2) != 1 or prefix_keys.stride(1) != dim or prefix_values.stride() != prefix_keys.stride():
            prefix_keys, prefix_values = prefix_keys.contiguous(), prefix_values.contiguous()
        if prefix_keys.dtype != keys.dtype or prefix_keys.shape != prefix_values.shape \
                or prefix_keys.shape[0] != kv_heads or prefix_keys.shape[2] != dim:
            raise ValueError("prefill_attention: the prefix must be [Hkv, C, D] in the keys' dtype")
        cached, prefix_stride = prefix_keys.shape[1], prefix_keys.stride(0)
    out = torch.empty(rows, heads, dim, dtype=torch.float32)
    if _typed("baton_prefill_attention", keys.dtype)(
            query.data_ptr(), query.stride(0), b, t, keys.data_ptr(), values.data_ptr(), keys.stride(0),
            keys.stride(1), prefix_keys.data_ptr() if cached else None, prefix_values.data_ptr() if cached else None,
            cached, prefix_stride, out.data_ptr(), heads, kv_heads, dim, ctypes.c_float(scale),
            torch.get_num_threads()):
        raise MemoryError("prefill_attention could not allocate its scores")
    return out


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """gate_up: [R, 2 * I] float32 (gate, then up) -> silu(gate) * up: [R, I], as decode computes it."""
    gate_up = gate_up.contiguous()
    rows, width = gate_up.shape
    out = torch.empty(rows, width // 2, dtype=torch.float32)
    _library().baton_silu_mul(gate_up.data_ptr(), out.data_ptr(), rows, width // 2, torch.get_num_threads())
    return out


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x: [..., N] float32 -> RMSNorm(x) * weight (float32), as transformers computes it in fp32."""
    if x.dtype != torch.float32 or weight.dtype != torch.float32:
        raise ValueError("rms_norm takes float32 activations and weights")
    x = x.contiguous()
    out = torch.empty_like(x)
    n = x.shape[-1]
    _library().baton_rms_norm(x.data_ptr(), weight.data_ptr(), out.data_ptr(), x.numel() // n, n,
                              ctypes.c_float(eps), torch.get_num_threads())
    return out


def rotary(x: torch.Tensor, heads: int, cos: torch.Tensor, signed_sin: torch.Tensor) -> None:
    """In place on the first `heads` heads of x [N, H, D] (rows contiguous): x = x * cos +
    roll(x, D/2) * signed_sin, with cos and signed_sin holding [N, D] contiguously."""
    n, _, d = x.shape
    cos, signed_sin = cos.contiguous(), signed_sin.contiguous()  # held here while C reads them
    if x.stride(2) != 1 or x.stride(1) != d or cos.numel() != n * d or signed_sin.numel() != n * d:
        raise ValueError(f"rotary needs contiguous heads and [{n}, {d}] tables")
    _library().baton_rotary(x.data_ptr(), n, heads, d, x.stride(0), cos.data_ptr(), signed_sin.data_ptr(),
                            torch.get_num_threads())


class DecodeLayers:
    """Every decoder layer of a decode step in one C call (`baton_decode_layers`), for a Llama-family
    model whose linear layers are panel-packed in `dtype` or quantized (engine.quantized), its KV
    in `dtype` (norms and biases float32). Built once per runner from its layers' tensors."""

    def __init__(self, layers, *, dtype: torch.dtype, hidden: int, heads: int, kv_heads: int, head_dim: int,
                 intermediate: int, eps: float, scale: float):
        self.hidden, self.heads, self.kv_heads, self.head_dim = hidden, heads, kv_heads, head_dim
        self.intermediate, self.eps, self.scale = intermediate, eps, scale
        self.num_layers = len(layers)
        self.dtype = dtype
        self._step = _typed("baton_decode_layers", dtype)
        tensors = []
        for layer in layers:
            row = (layer.input_norm, layer.qkv.packed, layer.qkv.bias, layer.o.packed, layer.post_norm,
                   layer.gate_up.packed, layer.down.packed)
            linears = (layer.qkv, layer.o, layer.gate_up, layer.down)
            want = [torch.float32, dtype, torch.float32, dtype, torch.float32, dtype, dtype]
            for at, linear in zip((1, 3, 5, 6), linears):
                if linear.code:  # quantized panels are bytes
                    want[at] = torch.uint8
            if any(t is not None and (t.dtype != d or not t.is_contiguous()) for t, d in zip(row, want)):
                raise ValueError(f"the fused decode step needs contiguous {dtype} or quantized packed weights and "
                                 "float32 norms and biases")
            if layer.o.bias is not None or layer.gate_up.bias is not None or layer.down.bias is not None:
                raise ValueError("the fused decode step has no bias for the O, gate/up and down projections")
            tensors.append((row, [linear.code + (SIXTEEN_BIT_INPUTS if linear.code and linear.input_bits == 16 else 0)
                                  for linear in linears]))
        self._held = [t for row, _ in tensors for t in row if t is not None]  # C reads their addresses
        self.addresses = torch.tensor([[0 if t is None else t.data_ptr() for t in row] + codes
                                       for row, codes in tensors], dtype=torch.int64)

    def __call__(self, h: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor, pages: torch.Tensor,
                 table: torch.Tensor, lengths: torch.Tensor) -> None:
        """h: [R, hidden] float32 contiguous, updated in place; cos, signed_sin: [R, head_dim];
        pages: the paged KV [layers, 2, pages, kv_heads, page_size, head_dim]; table int64 [R,
        width]: each row's pages; lengths int64 [R]: each row's tokens, this step's (written at
        lengths[r] - 1) included."""
        rows = h.shape[0]
        cos, signed_sin = cos.contiguous(), signed_sin.contiguous()
        if (h.dtype != torch.float32 or not h.is_contiguous() or h.shape[1] != self.hidden
                or pages.dtype != self.dtype or not pages.is_contiguous() or pages.shape[0] != self.num_layers
                or pages.shape[3] != self.kv_heads or pages.shape[5] != self.head_dim
                or table.dtype != torch.int64 or not table.is_contiguous() or table.shape[0] != rows
                or lengths.dtype != torch.int64 or lengths.numel() != rows
                or cos.numel() != rows * self.head_dim or signed_sin.numel() != rows * self.head_dim):
            raise ValueError("decode_layers: tensors do not match the model or the page table")
        if self._step(
                h.data_ptr(), self.addresses.data_ptr(), self.num_layers, rows, self.hidden, self.heads,
                self.kv_heads, self.head_dim, self.intermediate, ctypes.c_float(self.eps),
                ctypes.c_float(self.scale), cos.data_ptr(), signed_sin.data_ptr(), pages.data_ptr(),
                pages.stride(0), pages.stride(1), pages.stride(2), pages.stride(3), pages.shape[4],
                table.data_ptr(), table.shape[1], lengths.data_ptr(), torch.get_num_threads()):
            raise MemoryError("decode_layers could not allocate its scratch")


@functools.cache
def _library() -> ctypes.CDLL | None:
    if os.environ.get(DISABLE_ENV, "1") == "0":
        return None
    if platform.system() != "Linux" or platform.machine() not in ("x86_64", "aarch64"):
        return None
    compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if not compiler:
        log.info("no C compiler found: decode uses oneDNN and SDPA instead of Baton's CPU kernels")
        return None
    try:
        path = _build(compiler)
        lib = ctypes.CDLL(str(path))
    except (OSError, subprocess.CalledProcessError) as exc:
        log.warning("building Baton's CPU kernels failed (%s); decode uses oneDNN and SDPA instead",
                    str(exc).splitlines()[0] if str(exc) else type(exc).__name__)
        return None
    pointer, size, threads = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
    lib.baton_rms_norm.argtypes = [pointer] * 3 + [size] * 2 + [ctypes.c_float, threads]
    lib.baton_rms_norm.restype = None
    lib.baton_rotary.argtypes = [pointer] + [size] * 4 + [pointer] * 2 + [threads]
    lib.baton_rotary.restype = None
    lib.baton_silu_mul.argtypes = [pointer] * 2 + [size] * 2 + [threads]
    lib.baton_silu_mul.restype = None
    lib.baton_quant_gemm.argtypes = [size] * 2 + [pointer] * 3 + [size] * 3 + [threads]
    lib.baton_quant_gemm.restype = ctypes.c_int
    for suffix in SUFFIXES.values():
        if not hasattr(lib, f"baton_small_gemm_{suffix}"):
            continue  # fp16 where the compiler has no _Float16
        typed = {
            "baton_small_gemm": [pointer] * 3 + [size] * 3 + [threads],
            "baton_decode_attention": [pointer] * 4 + [size] + [pointer] * 3 + [size] * 7 + [ctypes.c_float, threads],
            "baton_prefill_attention": ([pointer, size, size, size, pointer, pointer, size, size, pointer, pointer]
                                        + [size] * 2 + [pointer] + [size] * 3 + [ctypes.c_float, threads]),
            "baton_decode_layers": ([pointer, pointer] + [size] * 7 + [ctypes.c_float] * 2 + [pointer] * 3
                                    + [size] * 5 + [pointer, size, pointer, threads]),
        }
        for name, argtypes in typed.items():
            function = getattr(lib, f"{name}_{suffix}")
            function.argtypes, function.restype = argtypes, ctypes.c_int
    return lib


def _build(compiler: str) -> Path:

    march = os.environ.get(MARCH_ENV) or "native"
    flags = tuple(f"-march={march}" if flag == "-march=native" else flag for flag in FLAGS)
    digest = hashlib.sha256(b"".join(path.read_bytes() for path in SOURCES))
    digest.update(" ".join((compiler, *flags, platform.machine(), _cpu_identity())).encode())
    target = cache_root() / "kernels" / f"cpu-kernels-{digest.hexdigest()[:16]}.so"
    if target.is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    # Processes starting together (a prefill and a decode worker, test workers) wait for one build
    # rather than each compiling the same library (10-40 CPU-seconds).
    with open(target.with_name(target.name + ".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if target.is_file():
            return target
        with tempfile.TemporaryDirectory(dir=target.parent) as tmp:  # built aside, renamed into place
            built = Path(tmp) / target.name
            subprocess.run([compiler, *flags, str(SOURCE), "-o", str(built)], check=True, capture_output=True,
                           text=True, timeout=120)
            os.replace(built, target)
    log.info("built Baton's CPU kernels at %s", target)
    return target


def _cpu_flags() -> set[str]:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return set()
    return {flag for line in text.splitlines() if line.startswith(("flags", "Features"))
            for flag in line.partition(":")[2].split()}


def _cpu_identity() -> str:
    """-march=native code runs only on CPUs like this one: key the build by model and flags."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return platform.processor()
    lines = [line for line in text.splitlines() if line.startswith(("model name", "flags", "Features"))]
    return hashlib.sha256("\n".join(sorted(set(lines))).encode()).hexdigest()
