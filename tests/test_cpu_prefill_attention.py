"""Prefill attention on the CPU kernels (`prefill_attention`, tiled over query tokens): every
token's output is the very bits that decode attention gives that token over the same tokens, laid
out in pages, so a token's KV and logits do not depend on whether prefill or decode computed it,
nor on how a prompt was split into chunks; and it is attention, against float64."""
from __future__ import annotations

import pytest
import torch

from baton.engine.cpu import kernels as cpu_kernels

pytestmark = pytest.mark.skipif(not cpu_kernels.available(), reason="no C compiler for Baton's CPU kernels")

PAGE = 16


def case(batch: int, new: int, cached: int, dim: int, dtype: torch.dtype, seed: int = 0, heads: int = 9,
         kv_heads: int = 3):
    """query [B * T, Hq, D] float32; own keys, values [B, Hkv, T, D]; prefix [Hkv, C, D] or None."""
    g = torch.Generator().manual_seed(seed * 1000 + batch * 100 + new + cached + dim)
    query = torch.randn(batch * new, heads, dim, generator=g)
    keys, values = (torch.randn(2, batch, kv_heads, new, dim, generator=g) * 2).to(dtype)
    prefix_k, prefix_v = (torch.randn(2, kv_heads, cached, dim, generator=g) * 2).to(dtype)
    return query, keys, values, (prefix_k if cached else None), (prefix_v if cached else None)


def decoded(query, keys, values, prefix_k, prefix_v, scale) -> torch.Tensor:
    """Each query row alone through decode_attention over its tokens (the prefix, then its prompt's
    own up to itself) in shuffled pages whose unused slots hold NaN."""
    batch, kv_heads, new, dim = keys.shape
    out = torch.empty_like(query)
    for b in range(batch):
        whole_k, whole_v = keys[b], values[b]
        if prefix_k is not None:
            whole_k, whole_v = torch.cat([prefix_k, whole_k], 1), torch.cat([prefix_v, whole_v], 1)
        n = whole_k.shape[1]
        pages = -(-n // PAGE)
        pool = torch.full((2, pages + 1, kv_heads, PAGE, dim), float("nan"), dtype=keys.dtype)
        table = (torch.randperm(pages, generator=torch.Generator().manual_seed(b)) + 1)[None]  # page 0: never read
        for i in range(pages):
            count = min(PAGE, n - i * PAGE)
            pool[0, table[0, i], :, :count] = whole_k[:, i * PAGE:i * PAGE + count]
            pool[1, table[0, i], :, :count] = whole_v[:, i * PAGE:i * PAGE + count]
        for t in range(new):
            row = b * new + t
            out[row] = cpu_kernels.decode_attention(query[row:row + 1], pool[0], pool[1], table,
                                                    torch.tensor([n - new + t + 1]), scale)[0]
    return out


def reference(query, keys, values, prefix_k, prefix_v, scale) -> torch.Tensor:
    """Causal attention in float64 over the stored (rounded) keys and values."""
    batch, kv_heads, new, dim = keys.shape
    group = query.shape[1] // kv_heads
    out = torch.empty(query.shape, dtype=torch.float64)
    for b in range(batch):
        k, v = keys[b].double(), values[b].double()
        if prefix_k is not None:
            k, v = torch.cat([prefix_k.double(), k], 1), torch.cat([prefix_v.double(), v], 1)
        n = k.shape[1]
        q = query[b * new:(b + 1) * new].double().transpose(0, 1)  # [Hq, T, D]
        scores = q @ k.repeat_interleave(group, 0).transpose(1, 2) * scale  # [Hq, T, n]
        visible = torch.arange(n)[None, :] <= torch.arange(new)[:, None] + (n - new)
        scores = scores.masked_fill(~visible, float("-inf"))
        out[b * new:(b + 1) * new] = (scores.softmax(-1) @ v.repeat_interleave(group, 0)).transpose(0, 1)
    return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("dim", [64, 128, 48])  # 48: the kernel for any head_dim
@pytest.mark.parametrize("cached", [0, 37])
def test_each_prefill_token_is_the_bits_decode_gives_it(dtype, dim, cached):
    for batch in (1, 2):
        for new in (1, 5, 16, 33, 100):  # within a tile, one tile, and tiles with a part-filled last one
            inputs = case(batch, new, cached, dim, dtype)
            scale = dim ** -0.5
            got = cpu_kernels.prefill_attention(*inputs, scale)
            expected = decoded(*inputs, scale)
            for row in range(batch * new):
                assert torch.equal(got[row], expected[row]), (batch, new, row)
            torch.testing.assert_close(got.double(), reference(*inputs, scale), rtol=2e-5, atol=2e-5)


@pytest.mark.parametrize("heads,kv_heads", [(6, 6), (16, 2), (10, 2)])  # groups of 1, 8 and 5
@pytest.mark.parametrize("dim", [64, 128])
def test_every_head_layout(heads, kv_heads, dim):
    inputs = case(2, 40, 21, dim, torch.float32, seed=3, heads=heads, kv_heads=kv_heads)
    got = cpu_kernels.prefill_attention(*inputs, 0.1)
    assert torch.equal(got, decoded(*inputs, 0.1))
    torch.testing.assert_close(got.double(), reference(*inputs, 0.1), rtol=2e-5, atol=2e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_query_read_in_place_from_the_fused_qkv_projection(dtype):
    batch, new, dim = 2, 45, 64
    query, keys, values, prefix_k, prefix_v = case(batch, new, 20, dim, dtype, seed=1)
    qkv = torch.randn(batch * new, (9 + 2 * 3) * dim)
    qkv[:, :9 * dim] = query.view(batch * new, -1)
    strided = qkv[:, :9 * dim].view(batch * new, 9, dim)
    assert not strided.is_contiguous()
    got = cpu_kernels.prefill_attention(strided, keys, values, prefix_k, prefix_v, 0.125)
    assert torch.equal(got, cpu_kernels.prefill_attention(query, keys, values, prefix_k, prefix_v, 0.125))


@pytest.mark.parametrize("dim", [64, 128])
def test_a_prompt_in_chunks_gives_the_bits_of_the_whole_and_threads_change_nothing(dim):
    query, keys, values, _, _ = case(1, 150, 0, dim, torch.bfloat16, seed=2)
    whole = cpu_kernels.prefill_attention(query, keys, values, None, None, 0.1)
    at = 0
    for end in (40, 41, 150):  # chunks that start mid-block and mid-tile
        chunk = cpu_kernels.prefill_attention(query[at:end], keys[:, :, at:end], values[:, :, at:end],
                                              keys[0, :, :at], values[0, :, :at], 0.1)
        assert torch.equal(chunk, whole[at:end])
        at = end
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        assert torch.equal(cpu_kernels.prefill_attention(query, keys, values, None, None, 0.1), whole)
    finally:
        torch.set_num_threads(threads)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_prefix_read_in_place_from_a_longer_buffer(dtype):
    """A chunked prompt's KV so far is a view of one buffer sized for the whole prompt: its heads
    lie further apart than a contiguous prefix's, and it is read where it lies, to the same bits."""
    query, keys, values, prefix_k, prefix_v = case(1, 33, 50, 64, dtype, seed=4)
    buffer = torch.zeros(2, 3, 200, 64, dtype=dtype)
    buffer[0, :, :50], buffer[1, :, :50] = prefix_k, prefix_v
    view_k, view_v = buffer[0, :, :50], buffer[1, :, :50]
    assert not view_k.is_contiguous()
    got = cpu_kernels.prefill_attention(query, keys, values, view_k, view_v, 0.125)
    assert torch.equal(got, cpu_kernels.prefill_attention(query, keys, values, prefix_k, prefix_v, 0.125))


EQUAL_BITS_C = r"""
/* Prefill of 70 tokens (a partial last tile) against decode of each token alone over one page of
 * them, fp32 and bf16, head_dim 64 and 128, 6 query heads over 2: rows whose bits differ. */
static void equal_bits(void) {
  const int64_t T = 70, Hq = 6, Hkv = 2;
  int bad = 0;
  for (int64_t D = 64; D <= 128; D += 64) {
    float *q = malloc(4 * T * Hq * D), *k = malloc(4 * Hkv * T * D), *v = malloc(4 * Hkv * T * D);
    float *out = malloc(4 * T * Hq * D), *one = malloc(4 * Hq * D);
    uint16_t *kb = malloc(2 * Hkv * T * D), *vb = malloc(2 * Hkv * T * D);
    srand(3);
    for (int64_t i = 0; i < T * Hq * D; i++) q[i] = rand() / (float)RAND_MAX - 0.5f;
    for (int64_t i = 0; i < Hkv * T * D; i++) {
      k[i] = 2 * (rand() / (float)RAND_MAX - 0.5f), v[i] = rand() / (float)RAND_MAX - 0.5f;
      kb[i] = store1_bf16(k[i]), vb[i] = store1_bf16(v[i]);
    }
    int64_t table[1] = {0};
    baton_prefill_attention_f32(q, Hq * D, 1, T, k, v, Hkv * T * D, T * D, 0, 0, 0, 0, out, Hq, Hkv, D, 0.125f, 1);
    for (int64_t t = 0, n = 1; t < T; ++t, ++n) {
      baton_decode_attention_f32(q + t * Hq * D, k, v, table, 1, &n, one, 0, 1, Hq, Hkv, D, T, Hkv * T * D, T * D,
                                 0.125f, 1);
      bad += memcmp(one, out + t * Hq * D, 4 * Hq * D) != 0;
    }
    baton_prefill_attention_bf16(q, Hq * D, 1, T, kb, vb, Hkv * T * D, T * D, 0, 0, 0, 0, out, Hq, Hkv, D, 0.125f, 1);
    for (int64_t t = 0, n = 1; t < T; ++t, ++n) {
      baton_decode_attention_bf16(q + t * Hq * D, kb, vb, table, 1, &n, one, 0, 1, Hq, Hkv, D, T, Hkv * T * D,
                                  T * D, 0.125f, 1);
      bad += memcmp(one, out + t * Hq * D, 4 * Hq * D) != 0;
    }
  }
  printf("%d\n%d %d\n", bad, baton_vector_floats(), baton_quantized_dots());
}
"""


AVX512 = {"avx512f", "fma"} <= cpu_kernels._cpu_flags()  # this CPU runs the native AVX-512 build
ARM = "armv8-a"  # 64-bit ARM with NEON (Graviton, Ampere, Apple silicon under Linux)
ARM_DOTS = "armv8.2-a+dotprod"  # and byte dot products (Graviton 2 onwards, Ampere Altra): quantized weights' sdot


@pytest.mark.parametrize("march,built_for", [("x86-64-v3", "8 1"), ("x86-64", "4 0"), (ARM, "4 0"),
                                             (ARM_DOTS, "4 1")])
def test_prefill_gives_decodes_bits_on_cpus_without_avx512(march, built_for, builds):
    """The machines CI runs on have AVX-512; these builds take the kernels' other paths, where the
    compiler, not an intrinsic, would choose which product a multiply-add fuses. Each build also
    says what it computes with (floats a vector; quantized dot products by instruction or not), which
    kernels.py asks rather than the CPU: AVX2 with FMA; SSE2 without it; NEON, with and without
    byte dot products."""
    bad, floats_and_dots = builds(march)[0].splitlines()
    assert bad == "0"
    assert floats_and_dots == built_for


SAME_BITS_C = r"""
/* A hash of the bits of each kernel's output on fixed inputs (sizes not multiples of 16 included). */
static uint64_t hash(const float *x, int64_t n) {
  uint64_t h = 1469598103934665603ull;
  for (int64_t i = 0; i < n; ++i) {
    uint32_t u;
    memcpy(&u, x + i, 4);
    h = (h ^ u) * 1099511628211ull;
  }
  return h;
}
static float *filled(int64_t n, float scale) {
  float *x = malloc(4 * n);
  for (int64_t i = 0; i < n; ++i) x[i] = scale * (rand() / (float)RAND_MAX - 0.5f);
  return x;
}
static void same_bits(void) {
  srand(7);
  const int64_t M = 11, K = 200, N = 72, T = 45, Hq = 6, Hkv = 2;
  float *x = filled(M * K, 2), *w = filled(K * 80, 1), *out = malloc(4 * M * 2 * K);
  uint16_t *wb = malloc(2 * K * 80);
  for (int64_t i = 0; i < K * 80; ++i) wb[i] = store1_bf16(w[i]);
  baton_small_gemm_f32(x, w, out, M, K, N, 1);
  printf("gemm f32 %llx\n", (unsigned long long)hash(out, M * N));
  baton_small_gemm_bf16(x, wb, out, M, K, N, 1);
  printf("gemm bf16 %llx\n", (unsigned long long)hash(out, M * N));
  baton_rms_norm(x, w, out, M, K, 1e-5f, 1);
  printf("rms_norm %llx\n", (unsigned long long)hash(out, M * K));
  baton_silu_mul(x, out, M, K / 2 - 3, 1);
  printf("silu_mul %llx\n", (unsigned long long)hash(out, M * (K / 2 - 3)));
  for (int64_t D = 48; D <= 128; D += D == 48 ? 16 : 64) {
    float *q = filled(T * Hq * D, 1), *k = filled(Hkv * T * D, 4), *v = filled(Hkv * T * D, 1);
    float *o = malloc(4 * T * Hq * D);
    int64_t table[1] = {0}, n = T;
    baton_prefill_attention_f32(q, Hq * D, 1, T, k, v, Hkv * T * D, T * D, 0, 0, 0, 0, o, Hq, Hkv, D, 0.125f, 1);
    printf("prefill attention %ld %llx\n", D, (unsigned long long)hash(o, T * Hq * D));
    baton_decode_attention_f32(q, k, v, table, 1, &n, o, 0, 1, Hq, Hkv, D, T, Hkv * T * D, T * D, 0.125f, 1);
    printf("decode attention %ld %llx\n", D, (unsigned long long)hash(o, Hq * D));
  }
  for (int64_t F = FORMAT_Q8_0; F <= FORMAT_Q4_K; ++F) { /* quantized panels: valid scales, random codes */
    const int64_t QK = 256, QN = 40, blocks = QK / 32, bytes = quant_block_bytes(F), head = quant_head_bytes(F);
    uint8_t *panels = malloc(3 * blocks * bytes);
    for (int64_t b = 0; b < 3 * blocks; ++b) {
      uint8_t *block = panels + b * bytes;
      for (int j = 0; j < head / 4; ++j) { /* Q4_K: fp32 scales and minimums; else fp16 (two a word) */
        const float f = (rand() / (float)RAND_MAX - 0.3f) * 0.01f;
        if (F == FORMAT_Q4_K) memcpy(block + 4 * j, &f, 4);
        else { const uint16_t h[2] = {0x2000 + rand() % 0x1000, 0x2000 + rand() % 0x1000 + 0x8000 * (rand() % 2)}; memcpy(block + 4 * j, h, 4); }
      }
      for (int64_t i = head; i < bytes; ++i) block[i] = rand() & 255;
    }
    for (int precise = 0; precise <= 1; ++precise) {
      baton_quant_gemm(F, precise, x, panels, out, 5, QK, QN, 1);
      printf("quant %ld %d %llx\n", F, precise, (unsigned long long)hash(out, 5 * QN));
    }
  }
}
"""


@pytest.mark.parametrize("march", ["x86-64-v3", "x86-64-v4", ARM, ARM_DOTS])  # AVX2; AVX-512 without VNNI; NEON
def test_an_avx2_or_arm_build_computes_the_bits_of_an_avx512_build(march, builds):
    """The kernels hold a 16-lane vector as the CPU's own vectors (one with AVX-512, two with AVX2,
    four with NEON) and add its lanes in one order, so a token's bits do not depend on which CPU of
    a cluster computed it: KV prefilled on one node and decoded on another is what that one would
    compute. Quantized weights' integer sums are exact on every path (VNNI, AVX2's byte
    multiply-adds, ARM's sdot, a plain loop), so theirs too."""
    if not AVX512:
        pytest.skip("compares with this CPU's AVX-512 build")
    native = builds("native")[1]
    assert len(native.splitlines()) == 18
    assert builds(march)[1] == native


BUILDS = ("native", "x86-64-v4", "x86-64-v3", "x86-64", ARM, ARM_DOTS)


class Unbuildable(Exception):
    """No compiler (or emulator) here for that instruction set."""


def run_built(march: str, directory) -> tuple[str, str]:
    """EQUAL_BITS_C's and SAME_BITS_C's outputs from one program (including kernels.c) built for
    `march`. x86-64 targets build on an x86-64 machine; ARM ones with a cross compiler, run under
    qemu (`make test` installs both where apt-get can)."""
    import platform
    import shutil
    import subprocess
    from pathlib import Path

    run = []
    arm = march.startswith("armv")
    if arm and platform.machine() != "aarch64":
        compiler, qemu = shutil.which("aarch64-linux-gnu-gcc"), shutil.which("qemu-aarch64")
        if compiler is None or qemu is None:
            raise Unbuildable("an ARM build needs aarch64-linux-gnu-gcc and qemu-aarch64 "
                              "(apt-get install gcc-aarch64-linux-gnu qemu-user)")
        run = [qemu, "-L", "/usr/aarch64-linux-gnu"]
    else:
        compiler = shutil.which("cc") or shutil.which("gcc")
        if compiler is None or platform.machine() != ("aarch64" if arm else "x86_64"):
            raise Unbuildable(f"a C compiler for {march} builds these")
    source = directory / f"{march}.c"
    source.write_text('#include "kernels.c"\n#include <stdio.h>\n' + EQUAL_BITS_C + SAME_BITS_C +
                      'int main(void) { equal_bits(); printf("--\\n"); same_bits(); return 0; }\n')
    binary = directory / march
    # As kernels.py builds them (-O3), but SSE2 at -O1: without FMA the compiler has no multiply-add
    # to fuse, so every -O level computes the same bits (checked: the same outputs at -O1, -O2 and
    # -O3), and at -O3 that build alone took 40 of the fixture's 90 CPU-seconds.
    level = "-O1" if march == "x86-64" else "-O3"
    subprocess.run([compiler, level, f"-march={march}", "-fopenmp", "-w", f"-I{Path(cpu_kernels.__file__).parent}",
                    str(source), "-o", str(binary), "-lm"], check=True)
    output = subprocess.run([*run, str(binary)], check=True, capture_output=True, text=True, timeout=300).stdout
    equal, same = output.split("--\n")
    return equal.strip(), same.strip()


@pytest.fixture(scope="module")
def builds(tmp_path_factory):
    """builds(march) -> (EQUAL_BITS_C's output, SAME_BITS_C's) of that build. Each instruction set
    is compiled once, a build per core at a time (a build of kernels.c takes 10-20 s)."""
    import os
    from concurrent.futures import ThreadPoolExecutor

    directory = tmp_path_factory.mktemp("isa")
    # the native and AVX-512 builds are compared only on a CPU that runs AVX-512 (the test skips elsewhere)
    wanted = [march for march in BUILDS if AVX512 or march not in ("native", "x86-64-v4")]
    with ThreadPoolExecutor(max_workers=max(1, min(len(wanted), len(os.sched_getaffinity(0))))) as pool:
        futures = {march: pool.submit(run_built, march, directory) for march in wanted}

    def built(march: str) -> tuple[str, str]:
        if march not in futures:
            pytest.skip(f"the {march} build is compared only on a CPU with AVX-512")
        try:
            return futures[march].result()
        except Unbuildable as reason:
            pytest.skip(str(reason))

    return built
