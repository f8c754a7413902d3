"""Decode attention benchmark: achieved KV bandwidth of the Triton kernels vs peak and vs SDPA.

`python -m baton.bench_kernels [--quick] [--json PATH]`. Needs a CUDA GPU; elsewhere it says
so and returns {"skipped": ...}. Decode is memory bound, so the figure of merit is bandwidth:
bytes of K/V a row really needs ((L - start) columns, plus q and out) divided by kernel time,
against the device's peak. SDPA with a boolean mask is timed on the same BATON views: it
reads the whole padded window, which the Triton kernel skips, so both are rated on the same
useful bytes. The prefix-shared rows compare the BatchLLM kernel against plain decode over
the same rows with the prefix copied into every row.
"""
from __future__ import annotations

import argparse
import json
import math

import torch
import torch.nn.functional as F

# Peak DRAM bandwidth, GB/s, by a substring of torch.cuda.get_device_name(); first match wins.
KNOWN_PEAKS_GBPS = [
    ("H200", 4800.0), ("H100 PCIe", 2000.0), ("H100", 3350.0), ("GH200", 4000.0), ("B200", 8000.0),
    ("A100-SXM4-80GB", 2039.0), ("A100 80GB PCIe", 1935.0), ("A100", 1555.0), ("L40S", 864.0),
    ("L40", 864.0), ("L4", 300.0), ("A10G", 600.0), ("A10", 600.0), ("RTX 4090", 1008.0),
    ("RTX 3090", 936.0), ("V100", 900.0), ("T4", 320.0),
]

# (label, num_kv_heads, group, head_dim, rows, window columns)
DECODE_SHAPES = [
    ("smollm2 b16 L1k", 3, 3, 64, 16, 1024),
    ("smollm2 b64 L4k", 3, 3, 64, 64, 4096),
    ("llama8b b8 L8k", 8, 4, 128, 8, 8192),
    ("llama8b b32 L2k", 8, 4, 128, 32, 2048),
    ("llama8b b64 L4k", 8, 4, 128, 64, 4096),
]
QUICK_SHAPES = [0, 3]

# (label, num_kv_heads, group, head_dim, groups, rows per group, prefix columns, own columns)
SHARED_SHAPES = [
    ("llama8b 4x16 P2k", 8, 4, 128, 4, 16, 2048, 256),
    ("smollm2 2x32 P4k", 3, 3, 64, 2, 32, 4096, 512),
]


def device_peak_gbps(device: torch.device) -> tuple[float, str]:
    """The device's DRAM bandwidth: from the table, else measured with a 1 GiB copy."""
    name = torch.cuda.get_device_name(device)
    for key, peak in KNOWN_PEAKS_GBPS:
        if key in name:
            return peak, f"table ({key})"
    import triton.testing

    src = torch.empty(1 << 30, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    ms = triton.testing.do_bench(lambda: dst.copy_(src), warmup=5, rep=50)
    return 2 * src.numel() / ms / 1e6, "measured (1 GiB copy)"


def ragged_starts(rows: int, length: int, gen: torch.Generator) -> torch.Tensor:
    """BATON-like: rows entered at different times, so valid lengths spread over [L/4, L]."""
    starts = torch.randint(0, 3 * length // 4 + 1, (rows,), generator=gen)
    starts[0] = 0  # the longest row defines the window
    return starts.to(torch.int32)


def decode_inputs(kv_heads, group, head_dim, rows, length, dtype, device, gen):
    # k, v: [rows, Hkv, L, D] views into a buffer with headroom, as BatchKV holds them
    buf = torch.randn(2, rows, kv_heads, length + 64, head_dim, generator=gen).to(device=device, dtype=dtype)
    k, v = buf[0, :, :, 32: 32 + length], buf[1, :, :, 32: 32 + length]
    q = torch.randn(rows, kv_heads * group, head_dim, generator=gen).to(device=device, dtype=dtype)
    return q, k, v, ragged_starts(rows, length, gen).to(device)


def useful_bytes(q: torch.Tensor, k: torch.Tensor, starts: torch.Tensor) -> int:
    columns = int((k.shape[2] - starts.long()).sum())
    return 2 * columns * k.shape[1] * k.shape[3] * k.element_size() + 2 * q.numel() * q.element_size()


def sdpa_decode(q, k, v, starts, scale):
    # the torch path: [n, H, 1, D] against the whole padded window with a boolean mask
    columns = torch.arange(k.shape[2], device=k.device)
    mask = (columns[None, :] >= starts[:, None])[:, None, None, :]
    return F.scaled_dot_product_attention(q[:, :, None], k, v, attn_mask=mask, scale=scale, enable_gqa=True)[:, :, 0]


def bench_decode(shape, peak, dtype, device, time_ms) -> dict:
    from baton.engine.kernels import decode_attention

    label, kv_heads, group, head_dim, rows, length = shape
    gen = torch.Generator().manual_seed(0)
    q, k, v, starts = decode_inputs(kv_heads, group, head_dim, rows, length, dtype, device, gen)
    scale = head_dim ** -0.5
    nbytes = useful_bytes(q, k, starts)
    out = decode_attention(q, k, v, starts, scale)
    err = (out.float() - sdpa_decode(q, k, v, starts, scale).float()).abs().max().item()
    triton_ms = time_ms(lambda: decode_attention(q, k, v, starts, scale))
    split1_ms = time_ms(lambda: decode_attention(q, k, v, starts, scale, num_splits=1))
    sdpa_ms = time_ms(lambda: sdpa_decode(q, k, v, starts, scale))
    gbps = nbytes / triton_ms / 1e6
    return {"shape": label, "rows": rows, "window": length, "useful_mb": nbytes / 1e6, "triton_ms": triton_ms,
            "triton_gbps": gbps, "pct_peak": 100 * gbps / peak, "split1_ms": split1_ms, "sdpa_ms": sdpa_ms,
            "sdpa_gbps": nbytes / sdpa_ms / 1e6, "speedup_vs_sdpa": sdpa_ms / triton_ms, "max_abs_err": err}


def bench_shared(shape, dtype, device, time_ms) -> dict:
    from baton.engine.kernels import decode_attention, prefix_shared_decode_attention

    label, kv_heads, group, head_dim, groups, per_group, prefix_len, own = shape
    rows = groups * per_group
    gen = torch.Generator().manual_seed(1)
    q, k, v, starts = decode_inputs(kv_heads, group, head_dim, rows, own, dtype, device, gen)
    pk, pv = torch.randn(2, groups, kv_heads, prefix_len, head_dim, generator=gen).to(device=device, dtype=dtype)
    group_of_row = torch.arange(rows, device=device, dtype=torch.int32) // per_group
    prefix_lens = torch.full((groups,), prefix_len, device=device, dtype=torch.int32)
    # The same attention in the plain BATON layout: each row's prefix copy sits end-aligned just
    # before its own tokens, so row i's window is [padding | prefix | own tokens] from starts[i].
    plain_k = torch.empty(rows, kv_heads, prefix_len + own, head_dim, device=device, dtype=dtype)
    plain_v = torch.empty_like(plain_k)
    for i, (g, s) in enumerate(zip(group_of_row.tolist(), starts.tolist())):
        for dst, pre, mine in ((plain_k, pk, k), (plain_v, pv, v)):
            dst[i] = torch.cat([mine[i, :, :s], pre[g], mine[i, :, s:]], dim=1)
    scale = head_dim ** -0.5

    def shared():
        return prefix_shared_decode_attention(q, pk, pv, k, v, starts, group_of_row, prefix_lens, scale,
                                              max_group_rows=per_group)

    def plain():
        return decode_attention(q, plain_k, plain_v, starts, scale)

    err = (shared().float() - plain().float()).abs().max().item()
    shared_ms, plain_ms = time_ms(shared), time_ms(plain)
    return {"shape": label, "rows": rows, "prefix": prefix_len, "shared_ms": shared_ms, "plain_ms": plain_ms,
            "speedup": plain_ms / shared_ms, "max_abs_err": err}


def run(quick: bool = False) -> dict:
    if not torch.cuda.is_available():
        reason = "bench_kernels needs a CUDA GPU (decode attention bandwidth); none found, skipped"
        print(reason)
        return {"skipped": reason}
    import triton.testing

    device = torch.device("cuda")
    peak, source = device_peak_gbps(device)
    dtype = torch.bfloat16
    warmup, rep = (10, 30) if quick else (25, 100)

    def time_ms(fn) -> float:
        return triton.testing.do_bench(fn, warmup=warmup, rep=rep)

    shapes = [DECODE_SHAPES[i] for i in QUICK_SHAPES] if quick else DECODE_SHAPES
    decode_rows = [bench_decode(s, peak, dtype, device, time_ms) for s in shapes]
    shared_rows = [] if quick else [bench_shared(s, dtype, device, time_ms) for s in SHARED_SHAPES]
    name = torch.cuda.get_device_name(device)
    print(f"\ndecode attention, bf16, {name}: peak {peak:.0f} GB/s ({source})")
    print(f"{'shape':<18}{'MB':>8}{'triton ms':>11}{'GB/s':>8}{'%peak':>7}{'1-split ms':>12}"
          f"{'sdpa ms':>9}{'x sdpa':>8}{'max err':>9}")
    for r in decode_rows:
        print(f"{r['shape']:<18}{r['useful_mb']:>8.1f}{r['triton_ms']:>11.4f}{r['triton_gbps']:>8.0f}"
              f"{r['pct_peak']:>7.1f}{r['split1_ms']:>12.4f}{r['sdpa_ms']:>9.4f}{r['speedup_vs_sdpa']:>8.2f}"
              f"{r['max_abs_err']:>9.1e}")
    if shared_rows:
        print(f"\nprefix-shared decode vs plain decode with the prefix copied into every row")
        print(f"{'shape':<18}{'rows':>6}{'prefix':>8}{'shared ms':>11}{'plain ms':>10}{'x plain':>9}{'max err':>9}")
        for r in shared_rows:
            print(f"{r['shape']:<18}{r['rows']:>6}{r['prefix']:>8}{r['shared_ms']:>11.4f}{r['plain_ms']:>10.4f}"
                  f"{r['speedup']:>9.2f}{r['max_abs_err']:>9.1e}")
    geo = math.exp(sum(math.log(r["speedup_vs_sdpa"]) for r in decode_rows) / len(decode_rows))
    print(f"\ngeomean speedup vs SDPA: {geo:.2f}x")
    return {"device": name, "peak_gbps": peak, "peak_source": source, "dtype": "bf16", "decode": decode_rows,
            "prefix_shared": shared_rows, "geomean_speedup_vs_sdpa": geo}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="two shapes, fewer repetitions")
    parser.add_argument("--json", metavar="PATH", help="also write the results as JSON")
    args = parser.parse_args(argv)
    result = run(args.quick)
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(result, fh, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
