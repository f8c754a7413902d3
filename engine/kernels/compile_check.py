"""Compile every kernel for sm_90 without a GPU: `python -m baton.engine.kernels.compile_check [bf16 fp32 fp16]`.

The interpreter accepts programs the compiler rejects (types, loop-carried values, layouts),
and it never runs the native fp16/bf16 dot path. Compiling to a cubin with the ptxas that ships
in the triton wheel catches those errors on a CPU-only machine. Must run in a process where
TRITON_INTERPRET is unset, since the kernels must be decorated as compiled functions.
Exit status: 0 all compiled, 1 a kernel failed, 3 no CUDA backend in this triton install.
"""
from __future__ import annotations

import sys

import triton
from triton.compiler import ASTSource

from baton.engine.kernels import _common, fused, invariant, paged, prefill, tiled

SCALARS = {"qk_scale": "fp32", "eps": "fp32"}


def _signature(kernel, pointers: dict[str, str], constexprs: dict[str, object]) -> dict[str, str]:
    # every argument that is neither a pointer nor a constexpr is an int (strides, lengths)
    return {name: "constexpr" if name in constexprs else pointers.get(name, SCALARS.get(name, "i32"))
            for name in kernel.arg_names}


def _specs(dtype: str, upcast: bool):
    kv = {name: f"*{dtype}" for name in ("Q", "K", "V", "SK", "SV")}
    idx = {name: "*i32" for name in ("CuQ", "CuK", "Table", "Lengths")}
    mid = {"Out": "*fp32", "Lse": "*fp32"}
    for page_size in (16, 5):  # a power-of-two page, and one whose // and % are not shifts
        yield f"paged P={page_size}", paged._paged_decode_kernel, {**kv, **idx, **mid}, dict(
            GROUP=3, HEAD_DIM=64, BLOCK_G=16, BLOCK_D=64, BLOCK_N=paged.BLOCK_N, PAGE_SIZE=page_size,
            WRITE_LSE=True, UPCAST=upcast)
    # one split: the output, in q's dtype, written directly, no lse
    direct = {**kv, **idx, "Out": f"*{dtype}", "Lse": f"*{dtype}"}
    yield "paged one split", paged._paged_decode_kernel, direct, dict(
        GROUP=8, HEAD_DIM=128, BLOCK_G=16, BLOCK_D=128, BLOCK_N=paged.BLOCK_N, PAGE_SIZE=16, WRITE_LSE=False,
        UPCAST=upcast)
    # the query-tiled kernel batch invariance runs for decode and prefill: GQA 4 (Llama-3-8B) and 3 (SmolLM2)
    for group, page_size in ((4, 16), (3, 5)):
        yield f"tiled GQA {group} P={page_size}", tiled._tiled_kernel, {**kv, **idx, "Out": f"*{dtype}"}, dict(
            GROUP=group, HEAD_DIM=128, BLOCK_G=tiled.group_block(group), BLOCK_M=tiled.BLOCK_M, BLOCK_D=128,
            BLOCK_N=tiled.BLOCK_N, PAGE_SIZE=page_size, UPCAST=upcast)
    for shared in (False, True):  # with a BatchLLM group's shared prefix, and without
        yield "prefill" + " shared" * shared, prefill._prefill_kernel, {**kv, **idx, "Out": f"*{dtype}"}, dict(
            GROUP=8, HEAD_DIM=128, BLOCK_M=prefill.BLOCK_M, BLOCK_N=prefill.BLOCK_N, BLOCK_D=128, UPCAST=upcast,
            SHARED=shared)
    # the batch-invariant GEMM (with a bias, as Qwen2's QKV has) and RMSNorm
    gemm = {**{name: f"*{dtype}" for name in ("X", "W", "Bias", "Res", "Out")}, "XS": "*fp32", "WS": "*fp32"}
    decode = invariant.Tiles(invariant.DECODE_ROWS, 16, 64, warps=4, stages=4)  # the narrowest decode tile
    for bias, res, tiles in ((False, True, decode), (True, False, decode), (False, True, invariant.PREFILL_TILES)):
        yield (f"invariant linear {tiles.block_m}x{tiles.block_n}" + " bias" * bias + " residual" * res,
               invariant._linear_kernel, gemm,
               dict(HAS_BIAS=bias, HAS_RES=res, SCALED=False, UPCAST=upcast, IEEE=dtype == "fp32",
                    BLOCK_M=tiles.block_m, BLOCK_N=tiles.block_n, BLOCK_K=tiles.block_k, num_warps=tiles.warps))
    if dtype != "fp32":  # fp8 weights (engine.fp8): e4m3 codes on Hopper's fp8 tensor cores, scaled back
        codes = {**gemm, "X": "*fp8e4nv", "W": "*fp8e4nv"}
        for tiles in (decode, invariant.PREFILL_TILES):
            yield (f"fp8 linear {tiles.block_m}x{tiles.block_n}", invariant._linear_kernel, codes,
                   dict(HAS_BIAS=False, HAS_RES=True, SCALED=True, UPCAST=False, IEEE=False, BLOCK_M=tiles.block_m,
                        BLOCK_N=tiles.block_n, BLOCK_K=tiles.block_k, num_warps=tiles.warps))
        yield "fp8 rows", invariant._quantize_rows_kernel, {"X": f"*{dtype}", "Q": "*fp8e4nv", "S": "*fp32"}, dict(
            FP8_MAX=448.0, BLOCK=16384, num_warps=16)
    # the fused elementwise steps of a layer (rotary and the KV write; SiLU * up)
    fused_kv = {"QKV": f"*{dtype}", "Cos": f"*{dtype}", "Sin": f"*{dtype}", "KDst": f"*{dtype}", "VDst": f"*{dtype}",
                "Offsets": "*i64"}
    yield "rotary_kv", fused._rotary_kv_kernel, fused_kv, dict(HQ=32, HKV=8, HALF=64, BLOCK_H=64, BLOCK_HALF=64,
                                                               BLOCK_KV=8)
    yield "silu_mul", fused._silu_mul_kernel, {"X": f"*{dtype}", "Out": f"*{dtype}"}, dict(BLOCK=4096)
    yield "invariant rms_norm", invariant._rms_norm_kernel, {"X": f"*{dtype}", "W": f"*{dtype}",
                                                              "Out": f"*{dtype}"}, dict(BLOCK=1024)
    yield "merge", _common._merge_kernel, {"MidO": "*fp32", "MidLse": "*fp32", "Out": f"*{dtype}"}, dict(
        HEAD_DIM=64, BLOCK_S=8, BLOCK_D=64)


def compile_kernels(arch: int = 90, dtypes: tuple[str, ...] = ("bf16", "fp32")) -> list[str]:
    """Compile each kernel for sm_<arch>; returns the failures as 'name dtype: error' lines."""
    from triton.backends.compiler import GPUTarget

    target = GPUTarget("cuda", arch, 32)
    failures = []
    for dtype in dtypes:
        # fp16/bf16 KV runs native dots on a GPU; fp32 KV upcasts (a no-op) and uses ieee dots
        for name, kernel, pointers, constexprs in _specs(dtype, upcast=dtype == "fp32"):
            warps = constexprs.pop("num_warps", 4)  # a launch option, not an argument
            src = ASTSource(fn=kernel, signature=_signature(kernel, pointers, constexprs),
                            constexprs={(kernel.arg_names.index(k),): v for k, v in constexprs.items()})
            try:
                compiled = triton.compile(src, target=target, options={"num_warps": warps})
                if "cubin" not in compiled.asm:
                    failures.append(f"{name} {dtype}: no cubin produced")
            except Exception as exc:  # report every kernel, not just the first failure
                failures.append(f"{name} {dtype}: {type(exc).__name__}: {str(exc)[:2000]}")
    return failures


def main(argv: list[str] | None = None) -> int:
    """Arguments: the pointer dtypes to check (default: bf16 fp32)."""
    dtypes = tuple(argv if argv is not None else sys.argv[1:]) or ("bf16", "fp32")
    if "nvidia" not in triton.backends.backends:
        print("this triton install has no CUDA backend; nothing to check")
        return 3
    failures = compile_kernels(dtypes=dtypes)
    for line in failures:
        print("FAILED", line)
    print("all kernels compiled for sm_90" if not failures else f"{len(failures)} kernel(s) failed")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
