"""isa: Baton's CPU kernels built for each instruction set this CPU runs, on one core.

The kernels are built at first use for the CPU at hand (-march=native). A machine without AVX-512
(most laptops, AMD before Zen 4, many cloud instance types) gets an AVX2 build, and ARM a NEON
one; this suite builds them here ($BATON_CPU_MARCH: native, x86-64-v3 = AVX2 with FMA, x86-64 =
SSE2; --quick leaves it out) and times each in its own process, one thread:

- the GEMM over panel-packed weights, fp32 and bf16, 1, 8 and 64 rows of SmolLM2's gate/up shape
  (576 -> 3,072), against MKL's fp32 GEMM held to the same instruction set
  (MKL_ENABLE_INSTRUCTIONS) on the same inputs;
- prefill attention over a 2,000-token prompt (9 query heads over 3, head dim 64, fp32 KV);
- decode attention, 8 rows over 1,024 tokens each in pages of 16;

and whether each build's outputs are the native build's bits (with FMA they must be: every lane
computes the same operations and every 16-lane sum adds in one order; SSE2 has no FMA).
"""
from __future__ import annotations

import hashlib
import json
import os
import platform
import subprocess
import sys
import time
from typing import Any

from baton.bench.common import BenchOptions, ratio, table
from baton.resources import cpus_usable

# (-march, what it is, the instruction set MKL is held to: None = its own choice)
BUILDS = (("native", "this CPU", None), ("x86-64-v3", "AVX2 + FMA", "AVX2"), ("x86-64", "SSE2", "SSE4_2"))
HIDDEN, INTERMEDIATE = 576, 1536  # SmolLM2-135M's gate/up projection: 576 -> 2 x 1536
ROWS = (1, 8, 64)


def run(opts: BenchOptions) -> dict[str, Any]:
    if platform.machine() not in ("x86_64", "AMD64"):
        reason = "builds for x86-64 instruction sets (on ARM the native build is the NEON one)"
        opts.say(f"isa: skipped: {reason}")
        return {"skipped": reason}
    # --quick leaves out SSE2 (servers have had AVX2 since 2013): its -O3 build alone takes 40 CPU-seconds
    wanted = [build for build in BUILDS if not (opts.quick and build[0] == "x86-64")]
    opts.say("isa: Baton's CPU kernels built for each instruction set, one thread, one process each")
    _build_side_by_side([march for march, _, _ in wanted])
    builds = {}
    for march, what, mkl in wanted:
        opts.progress(f"{march} ({what})")
        env = {**os.environ, "BATON_CPU_MARCH": march, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
        env.pop("MKL_ENABLE_INSTRUCTIONS", None)
        if mkl:
            env["MKL_ENABLE_INSTRUCTIONS"] = mkl
        done = subprocess.run([sys.executable, "-m", "baton.bench.cpu_isa", "--quick" if opts.quick else "--full"],
                              env=env, capture_output=True, text=True, timeout=1800)
        if done.returncode != 0:
            raise RuntimeError(f"the {march} build's measurement failed: {done.stderr.strip()[-2000:]}")
        builds[march] = {"what": what, "mkl_held_to": mkl, **json.loads(done.stdout.strip().splitlines()[-1])}
    native = builds["native"]
    for march, figures in builds.items():
        figures["bits_as_native"] = figures["bits"] == native["bits"]
    rows = []
    for march, f in builds.items():
        for name, ms in f["ms"].items():
            gflops = f["gflops"].get(name)
            rows.append([march, name, ms, gflops, ratio(native["ms"][name], ms), f["mkl_gflops"].get(name),
                         ratio(gflops, f["mkl_gflops"].get(name))])
    opts.say(table(["build", "kernel", "ms", "GFLOP/s", "x native", "MKL GFLOP/s", "x MKL"], rows, digits=3))
    opts.say("bits as the native build's: " + ", ".join(f"{m} {'yes' if f['bits_as_native'] else 'no'}"
                                                        for m, f in builds.items()))
    return {"builds": builds, "plots": []}


def _build_side_by_side(marches: list[str]) -> None:
    """Each build into the kernels' cache, a core each at a time (a build takes 10-30 s; built
    already, it is found there), so that the timings after, one at a time, only load them."""
    build = "from baton.engine.cpu import kernels; raise SystemExit(0 if kernels.available() else 1)"
    cores = cpus_usable().value
    for start in range(0, len(marches), cores):
        running = [subprocess.Popen([sys.executable, "-c", build], env={**os.environ, "BATON_CPU_MARCH": march},
                                    stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
                   for march in marches[start:start + cores]]
        for process in running:  # a failed build says so in its measurement below
            process.wait(timeout=600)


def measure(quick: bool) -> dict[str, Any]:
    """In a process whose kernels are built for $BATON_CPU_MARCH: times (best of a few) and the
    outputs' hash."""
    import torch
    import torch.nn.functional as F

    from baton.engine.cpu import kernels

    if not kernels.available():
        raise SystemExit("Baton's CPU kernels did not build for this instruction set")
    torch.manual_seed(0)
    repeats = 3 if quick else 20
    ms, gflops, mkl, bits = {}, {}, {}, hashlib.sha256()

    def best(fn, n=repeats) -> float:
        fn()
        times = []
        for _ in range(n):
            start = time.perf_counter()
            fn()
            times.append(time.perf_counter() - start)
        return min(times)

    weight = torch.randn(2 * INTERMEDIATE, HIDDEN) / HIDDEN ** 0.5
    for dtype, label in ((torch.float32, "fp32"), (torch.bfloat16, "bf16")):
        packed = kernels.pack(weight.to(dtype))
        for rows in ROWS:
            x = torch.randn(rows, HIDDEN)
            name = f"GEMM {label} {rows} row{'s' if rows > 1 else ''}"
            seconds = best(lambda: kernels.small_gemm(x, packed, 2 * INTERMEDIATE))
            flops = 2 * rows * HIDDEN * 2 * INTERMEDIATE
            ms[name], gflops[name] = seconds * 1e3, flops / seconds / 1e9
            bits.update(kernels.small_gemm(x, packed, 2 * INTERMEDIATE).numpy().tobytes())
            if dtype == torch.float32:
                mkl[name] = flops / best(lambda: F.linear(x, weight)) / 1e9

    tokens, heads, kv_heads, dim = (400 if quick else 2000), 9, 3, 64
    query = torch.randn(tokens, heads, dim)
    keys, values = torch.randn(2, 1, kv_heads, tokens, dim)
    name = f"prefill attention {tokens} tokens"
    seconds = best(lambda: kernels.prefill_attention(query, keys, values, None, None, 0.125), max(1, repeats // 4))
    ms[name], gflops[name] = seconds * 1e3, 4 * heads * dim * tokens * (tokens + 1) / 2 / seconds / 1e9
    bits.update(kernels.prefill_attention(query, keys, values, None, None, 0.125).numpy().tobytes())

    rows, length, page = 8, (256 if quick else 1024), 16
    pages_per_row = length // page
    pool = torch.randn(1 + rows * pages_per_row, kv_heads, page, dim)
    pool_v = torch.randn(1 + rows * pages_per_row, kv_heads, page, dim)
    table_ = (1 + torch.randperm(rows * pages_per_row)).view(rows, pages_per_row)
    lengths = torch.full((rows,), length, dtype=torch.int64)
    q = torch.randn(rows, heads, dim)
    name = f"decode attention {rows} x {length} tokens"
    seconds = best(lambda: kernels.decode_attention(q, pool, pool_v, table_, lengths, 0.125))
    ms[name], gflops[name] = seconds * 1e3, 4 * rows * heads * dim * length / seconds / 1e9
    bits.update(kernels.decode_attention(q, pool, pool_v, table_, lengths, 0.125).numpy().tobytes())
    return {"ms": ms, "gflops": gflops, "mkl_gflops": mkl, "bits": bits.hexdigest()[:16]}


if __name__ == "__main__":
    import torch

    torch.set_num_threads(1)
    print(json.dumps(measure(quick="--quick" in sys.argv)))
