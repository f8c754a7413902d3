"""Baton's CPU kernels for the decode step (kernels.c), built once per machine, called via ctypes:
the few-row GEMM over panel-packed weights, attention over paged KV, RMSNorm, rotary embedding, and
all of a decode step's layers in one call.

Built on first use with the machine's C compiler (`cc`, or $CC) for this very CPU
(-march=native) into Baton's cache directory, keyed by the source, the flags and the CPU, so
workers on one machine build it once. Where no compiler is found or the build fails,
`available()` is False, with one log line, and linear layers use oneDNN instead.
"""
from __future__ import annotations

import ctypes
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

from baton.paths import cache_root

log = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("kernels.c")
FLAGS = ("-O3", "-march=native", "-fopenmp", "-shared", "-fPIC")


@functools.cache
def max_rows() -> int:
    """The most rows the panel GEMM takes; past them MKL's blocked GEMM is faster. With AVX-512 (a
    panel row is one register) the panels stay ahead far into prefill sizes: measured on an EPYC
    (2026-11-26), one thread, SmolLM2's layer shapes, 104-112 GFLOP/s against MKL's 49-100 at
    16-1024 rows, 106 against 95 at 2048, 83 against 91 at 4096. Without it, MKL won past 16 rows."""
    return 2048 if "avx512f" in _cpu_flags() else 16


DISABLE_ENV = "BATON_CPU_KERNELS"  # '0' turns the kernels off (for A/B measurements)


def available() -> bool:
    return _library() is not None


PANEL = 16  # output features per panel: kernels.c's PANEL


def pack(weight: torch.Tensor) -> torch.Tensor:
    """[N, K] -> panels [ceil(N / PANEL), K, PANEL] of PANEL output features, k-major, zero-padded."""
    n, k = weight.shape
    panels = (n + PANEL - 1) // PANEL
    padded = torch.zeros(panels * PANEL, k, dtype=torch.float32)
    padded[:n] = weight
    return padded.view(panels, PANEL, k).transpose(1, 2).contiguous()


def small_gemm(x: torch.Tensor, packed: torch.Tensor, out_features: int) -> torch.Tensor:
    """x: [M, K] float32 -> x @ W^T: [M, out_features], with W packed by `pack`."""
    x = x.contiguous()
    rows, k = x.shape
    out = torch.empty(rows, out_features, dtype=torch.float32)
    if _library().baton_small_gemm(x.data_ptr(), packed.data_ptr(), out.data_ptr(), rows, k, out_features,
                                   torch.get_num_threads()):
        raise MemoryError("small_gemm could not allocate its transposed input")
    return out


def decode_attention(query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, table: torch.Tensor,
                     lengths: torch.Tensor, scale: float, lse: torch.Tensor | None = None) -> torch.Tensor:
    """query [R, Hq, D]; keys, values: one layer's pages [pages, Hkv, P, D] (views of the paged KV,
    each head's page contiguous); table int64 [R, width]: each row's pages; lengths int64 [R]: row r
    attends its tokens [0, lengths[r]) -> [R, Hq, D], float32. With `lse` (float32 [R, Hq],
    contiguous), each row and head's log-sum-exp of scaled scores is written there too."""
    rows, heads, dim = query.shape
    _, kv_heads, page_size, _ = keys.shape
    if keys.stride() != values.stride() or keys.stride(3) != 1 or keys.stride(2) != dim:
        raise ValueError("keys and values must be same-strided page views with contiguous tokens")
    if (table.dtype != torch.int64 or lengths.dtype != torch.int64 or not table.is_contiguous()
            or table.shape[0] != rows or lengths.numel() != rows):
        raise ValueError(f"decode_attention needs an int64 page table [{rows}, width] and int64 lengths [{rows}]")
    query = query.contiguous()
    out = torch.empty_like(query)
    scale = dim ** -0.5 if scale is None else scale
    if _library().baton_decode_attention(query.data_ptr(), keys.data_ptr(), values.data_ptr(), table.data_ptr(),
                                         table.shape[1], lengths.data_ptr(), out.data_ptr(),
                                         None if lse is None else lse.data_ptr(), rows, heads, kv_heads, dim,
                                         page_size, keys.stride(0), keys.stride(1), ctypes.c_float(scale),
                                         torch.get_num_threads()):
        raise MemoryError("decode_attention could not allocate its scores")
    return out


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x: [..., N] float32 -> RMSNorm(x) * weight, as transformers computes it in fp32."""
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
    model whose linear layers are panel-packed. Built once per runner from its layers' tensors."""

    def __init__(self, layers, *, hidden: int, heads: int, kv_heads: int, head_dim: int, intermediate: int,
                 eps: float, scale: float):
        self.hidden, self.heads, self.kv_heads, self.head_dim = hidden, heads, kv_heads, head_dim
        self.intermediate, self.eps, self.scale = intermediate, eps, scale
        self.num_layers = len(layers)
        tensors = []
        for layer in layers:
            row = (layer.input_norm, layer.qkv.packed, layer.qkv.bias, layer.o.packed, layer.post_norm,
                   layer.gate_up.packed, layer.down.packed)
            if any(t is not None and (t.dtype != torch.float32 or not t.is_contiguous()) for t in row):
                raise ValueError("the fused decode step needs contiguous float32 weights")
            if layer.o.bias is not None or layer.gate_up.bias is not None or layer.down.bias is not None:
                raise ValueError("the fused decode step has no bias for the O, gate/up and down projections")
            tensors.append(row)
        self._held = [t for row in tensors for t in row if t is not None]  # C reads their addresses
        self.addresses = torch.tensor([[0 if t is None else t.data_ptr() for t in row] for row in tensors],
                                      dtype=torch.int64)

    def __call__(self, h: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor, pages: torch.Tensor,
                 table: torch.Tensor, lengths: torch.Tensor) -> None:
        """h: [R, hidden] float32 contiguous, updated in place; cos, signed_sin: [R, head_dim];
        pages: the paged KV [layers, 2, pages, kv_heads, page_size, head_dim]; table int64 [R,
        width]: each row's pages; lengths int64 [R]: each row's tokens, this step's (written at
        lengths[r] - 1) included."""
        rows = h.shape[0]
        cos, signed_sin = cos.contiguous(), signed_sin.contiguous()
        if (h.dtype != torch.float32 or not h.is_contiguous() or h.shape[1] != self.hidden
                or pages.dtype != torch.float32 or not pages.is_contiguous() or pages.shape[0] != self.num_layers
                or pages.shape[3] != self.kv_heads or pages.shape[5] != self.head_dim
                or table.dtype != torch.int64 or not table.is_contiguous() or table.shape[0] != rows
                or lengths.dtype != torch.int64 or lengths.numel() != rows
                or cos.numel() != rows * self.head_dim or signed_sin.numel() != rows * self.head_dim):
            raise ValueError("decode_layers: tensors do not match the model or the page table")
        if _library().baton_decode_layers(
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
    pointer, size = ctypes.c_void_p, ctypes.c_int64
    lib.baton_small_gemm.argtypes = [pointer] * 3 + [size] * 3 + [ctypes.c_int]
    lib.baton_small_gemm.restype = ctypes.c_int
    lib.baton_decode_attention.argtypes = ([pointer] * 4 + [size] + [pointer] * 3 + [size] * 7
                                           + [ctypes.c_float, ctypes.c_int])
    lib.baton_decode_attention.restype = ctypes.c_int
    lib.baton_rms_norm.argtypes = [pointer] * 3 + [size] * 2 + [ctypes.c_float, ctypes.c_int]
    lib.baton_rms_norm.restype = None
    lib.baton_rotary.argtypes = [pointer] + [size] * 4 + [pointer] * 2 + [ctypes.c_int]
    lib.baton_rotary.restype = None
    lib.baton_decode_layers.argtypes = ([pointer, pointer] + [size] * 7 + [ctypes.c_float] * 2 + [pointer] * 3
                                        + [size] * 5 + [pointer, size, pointer, ctypes.c_int])
    lib.baton_decode_layers.restype = ctypes.c_int
    return lib


def _build(compiler: str) -> Path:

    digest = hashlib.sha256(SOURCE.read_bytes())
    digest.update(" ".join((compiler, *FLAGS, platform.machine(), _cpu_identity())).encode())
    target = cache_root() / "kernels" / f"cpu-kernels-{digest.hexdigest()[:16]}.so"
    if target.is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:  # built aside, renamed into place
        built = Path(tmp) / target.name
        subprocess.run([compiler, *FLAGS, str(SOURCE), "-o", str(built)], check=True, capture_output=True,
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
