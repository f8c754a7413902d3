"""Decode attention benchmark: KV bandwidth of the paged Triton kernel vs peak and vs SDPA.

`python -m baton.bench.decode_attention [--quick] [--page-size P] [--json PATH]` (or `baton bench
kernels`). Needs a CUDA GPU; elsewhere it says so and returns {"skipped": ...}. Decode is
memory bound, so the figure of merit is bandwidth: bytes of K/V a row really holds (its
`lengths[r]` tokens, plus q and out) divided by kernel time, against the device's peak. Rows
of ragged lengths sit in a paged pool ([2, pages, Hkv, P, D], one layer of the decode worker's;
P is decode.page_size's default unless --page-size says), their pages scattered as after
churn; `paged_decode_attention` reads them through the page table. SDPA with a boolean mask
runs on the same tokens gathered beforehand into [rows, Hkv, width x P, D] (it reads the
padding up to the longest row, which the kernel skips, so both are rated on the same useful
bytes); "gather+sdpa" is the engine's torch path, which gathers on every call. The shared rows
time the same kernel on rows that share their leading pages (a prefix held once per group, as
`decode.share_min_tokens` does) against the same rows each holding its own copy.
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

# (label, num_kv_heads, group, head_dim, rows, longest row's tokens)
DECODE_SHAPES = [
    ("smollm2 b16 L1k", 3, 3, 64, 16, 1024),
    ("smollm2 b64 L4k", 3, 3, 64, 64, 4096),
    ("llama8b b8 L8k", 8, 4, 128, 8, 8192),
    ("llama8b b32 L2k", 8, 4, 128, 32, 2048),
    ("llama8b b64 L4k", 8, 4, 128, 64, 4096),
]
QUICK_SHAPES = [0, 3]

# (label, num_kv_heads, group, head_dim, groups, rows per group, prefix tokens, own tokens at most)
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


def ragged_lengths(rows: int, longest: int, gen: torch.Generator) -> list[int]:
    """Rows that entered at different times: lengths spread over [L/4, L], row 0 the longest."""
    lengths = longest - torch.randint(0, 3 * longest // 4 + 1, (rows,), generator=gen)
    lengths[0] = longest
    return lengths.tolist()


def page_table(tables: list[list[int]], num_pages: int, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows' pages given as logical ids 1..num_pages-1 (0: the null page), placed at shuffled
    physical ids as in a pool after churn. Returns (int32 [R, width] table padded with 0,
    where: [num_pages], the physical id of each logical page)."""
    where = torch.cat([torch.zeros(1, dtype=torch.long), torch.randperm(num_pages - 1, generator=gen) + 1])
    table = torch.zeros(len(tables), max(map(len, tables)), dtype=torch.long)
    for r, pages in enumerate(tables):
        table[r, :len(pages)] = where[torch.tensor(pages, dtype=torch.long)]
    return table.to(torch.int32), where


def own_pages(lengths: list[int], first: int, page_size: int) -> tuple[list[list[int]], int]:
    """Consecutive logical pages from `first` for rows of these lengths -> (tables, next free id)."""
    tables = []
    for n in lengths:
        need = -(-n // page_size)
        tables.append(list(range(first, first + need)))
        first += need
    return tables, first


def decode_inputs(kv_heads, group, head_dim, rows, longest, page_size, dtype, device, gen, device_gen):
    """q [R, Hq, D]; pool [2, pages, Hkv, P, D]; table int32 [R, width]; lengths int32 [R]."""
    lengths = ragged_lengths(rows, longest, gen)
    tables, num_pages = own_pages(lengths, 1, page_size)
    table, _ = page_table(tables, num_pages, gen)
    pool = torch.randn(2, num_pages, kv_heads, page_size, head_dim, device=device, dtype=dtype, generator=device_gen)
    q = torch.randn(rows, kv_heads * group, head_dim, device=device, dtype=dtype, generator=device_gen)
    return q, pool, table.to(device), torch.tensor(lengths, dtype=torch.int32, device=device)


def useful_bytes(q: torch.Tensor, pool: torch.Tensor, lengths: torch.Tensor) -> int:
    tokens = int(lengths.long().sum())
    per_token = pool.shape[2] * pool.shape[4] * pool.element_size()  # one token's K or V, all KV heads
    return 2 * tokens * per_token + 2 * q.numel() * q.element_size()


def length_mask(table: torch.Tensor, lengths: torch.Tensor, page_size: int) -> torch.Tensor:
    columns = torch.arange(table.shape[1] * page_size, device=table.device)
    return (columns[None, :] < lengths.long()[:, None])[:, None, None, :]  # [R, 1, 1, width x P]


def gathered(pages: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
    # as engine/attention.py's: [pages, Hkv, P, D] -> each row's pages side by side, [R, Hkv, width x P, D]
    rows, width = table.shape
    return pages[table.reshape(-1)].view(rows, width, *pages.shape[1:]).transpose(1, 2).flatten(2, 3)


def sdpa_decode(q, keys, values, mask, scale):
    # keys, values: [R, Hkv, width x P, D], every row's pages side by side; mask hides the padding
    return F.scaled_dot_product_attention(q[:, :, None], keys, values, attn_mask=mask, scale=scale,
                                          enable_gqa=True)[:, :, 0]


def bench_decode(shape, page_size, peak, dtype, device, time_ms) -> dict:
    from baton.engine.kernels import paged_decode_attention

    label, kv_heads, group, head_dim, rows, longest = shape
    gen, device_gen = torch.Generator().manual_seed(0), torch.Generator(device=device).manual_seed(0)
    q, pool, table, lengths = decode_inputs(kv_heads, group, head_dim, rows, longest, page_size, dtype, device, gen,
                                            device_gen)
    k_pages, v_pages = pool[0], pool[1]
    scale = head_dim ** -0.5
    nbytes = useful_bytes(q, pool, lengths)
    table64, mask = table.long(), length_mask(table, lengths, page_size)
    keys, values = gathered(k_pages, table64), gathered(v_pages, table64)

    def paged(splits=None):
        return paged_decode_attention(q, k_pages, v_pages, table, lengths, scale, num_splits=splits)

    def torch_path():  # what the engine's torch backend runs per layer: gather, then SDPA
        return sdpa_decode(q, gathered(k_pages, table64), gathered(v_pages, table64), mask, scale)

    err = (paged().float() - sdpa_decode(q, keys, values, mask, scale).float()).abs().max().item()
    triton_ms = time_ms(paged)
    split1_ms = time_ms(lambda: paged(1))
    sdpa_ms = time_ms(lambda: sdpa_decode(q, keys, values, mask, scale))
    torch_path_ms = time_ms(torch_path)
    gbps = nbytes / triton_ms / 1e6
    return {"shape": label, "rows": rows, "max_len": longest, "page_size": page_size, "useful_mb": nbytes / 1e6,
            "triton_ms": triton_ms, "triton_gbps": gbps, "pct_peak": 100 * gbps / peak, "split1_ms": split1_ms,
            "sdpa_ms": sdpa_ms, "sdpa_gbps": nbytes / sdpa_ms / 1e6, "speedup_vs_sdpa": sdpa_ms / triton_ms,
            "gather_sdpa_ms": torch_path_ms, "max_abs_err": err}


def bench_shared(shape, page_size, dtype, device, time_ms) -> dict:
    from baton.engine.kernels import paged_decode_attention

    label, kv_heads, group, head_dim, groups, per_group, prefix_len, own = shape
    if prefix_len % page_size:
        raise ValueError(f"{label}: only full pages are shared; prefix {prefix_len} is not a multiple of {page_size}")
    rows, prefix_pages = groups * per_group, prefix_len // page_size
    gen, device_gen = torch.Generator().manual_seed(1), torch.Generator(device=device).manual_seed(1)
    own_lengths = ragged_lengths(rows, own, gen)
    # shared: logical pages 1.. hold each group's prefix once, then every row's own pages
    prefixes = [list(range(1 + g * prefix_pages, 1 + (g + 1) * prefix_pages)) for g in range(groups)]
    mine, num_shared = own_pages(own_lengths, 1 + groups * prefix_pages, page_size)
    shared_tables = [prefixes[r // per_group] + mine[r] for r in range(rows)]
    shared_table, shared_where = page_table(shared_tables, num_shared, gen)
    shared_pool = torch.randn(2, num_shared, kv_heads, page_size, head_dim, device=device, dtype=dtype,
                              generator=device_gen)
    # private: the same rows, each with its own copy of its group's prefix pages
    source, private_tables = [0], []  # source[j]: the shared logical page private page j copies
    for pages in shared_tables:
        private_tables.append(list(range(len(source), len(source) + len(pages))))
        source += pages
    private_table, private_where = page_table(private_tables, len(source), gen)
    private_pool = torch.empty(2, len(source), *shared_pool.shape[2:], device=device, dtype=dtype)
    private_pool[:, private_where.to(device)] = shared_pool[:, shared_where[torch.tensor(source)].to(device)]
    q = torch.randn(rows, kv_heads * group, head_dim, device=device, dtype=dtype, generator=device_gen)
    lengths = torch.tensor([prefix_len + n for n in own_lengths], dtype=torch.int32, device=device)
    shared_table, private_table = shared_table.to(device), private_table.to(device)
    scale = head_dim ** -0.5

    def shared():
        return paged_decode_attention(q, shared_pool[0], shared_pool[1], shared_table, lengths, scale)

    def private():
        return paged_decode_attention(q, private_pool[0], private_pool[1], private_table, lengths, scale)

    err = (shared().float() - private().float()).abs().max().item()
    shared_ms, private_ms = time_ms(shared), time_ms(private)
    page_mb = shared_pool[:, 0].numel() * shared_pool.element_size() / 1e6  # one page, K and V
    return {"shape": label, "rows": rows, "prefix": prefix_len, "shared_ms": shared_ms, "private_ms": private_ms,
            "speedup": private_ms / shared_ms, "shared_kv_mb": (num_shared - 1) * page_mb,
            "private_kv_mb": (len(source) - 1) * page_mb, "max_abs_err": err}


def default_page_size() -> int:
    from baton.decode_worker.core import DecodeConfig

    return DecodeConfig().page_size


def run(quick: bool = False, page_size: int | None = None) -> dict:
    """page_size: tokens a KV page holds (None: the decode worker's default, decode.page_size)."""
    if not torch.cuda.is_available():
        reason = "the decode attention benchmark needs a CUDA GPU (paged decode attention bandwidth); none found, skipped"
        print(reason)
        return {"skipped": reason}
    import triton.testing

    device = torch.device("cuda")
    page_size = page_size or default_page_size()
    peak, source = device_peak_gbps(device)
    dtype = torch.bfloat16
    warmup, rep = (10, 30) if quick else (25, 100)

    def time_ms(fn) -> float:
        return triton.testing.do_bench(fn, warmup=warmup, rep=rep)

    shapes = [DECODE_SHAPES[i] for i in QUICK_SHAPES] if quick else DECODE_SHAPES
    decode_rows = [bench_decode(s, page_size, peak, dtype, device, time_ms) for s in shapes]
    shared_rows = [] if quick else [bench_shared(s, page_size, dtype, device, time_ms) for s in SHARED_SHAPES]
    name = torch.cuda.get_device_name(device)
    print(f"\npaged decode attention, bf16, page {page_size}, {name}: peak {peak:.0f} GB/s ({source})")
    print(f"{'shape':<18}{'MB':>8}{'triton ms':>11}{'GB/s':>8}{'%peak':>7}{'1-split ms':>12}"
          f"{'sdpa ms':>9}{'x sdpa':>8}{'gather+sdpa':>13}{'max err':>9}")
    for r in decode_rows:
        print(f"{r['shape']:<18}{r['useful_mb']:>8.1f}{r['triton_ms']:>11.4f}{r['triton_gbps']:>8.0f}"
              f"{r['pct_peak']:>7.1f}{r['split1_ms']:>12.4f}{r['sdpa_ms']:>9.4f}{r['speedup_vs_sdpa']:>8.2f}"
              f"{r['gather_sdpa_ms']:>13.4f}{r['max_abs_err']:>9.1e}")
    if shared_rows:
        print("\nrows sharing their leading pages (a prefix held once per group) vs each row its own copy")
        print(f"{'shape':<18}{'rows':>6}{'prefix':>8}{'KV MB':>8}{'own KV MB':>11}{'shared ms':>11}{'own ms':>9}"
              f"{'x own':>7}{'max err':>9}")
        for r in shared_rows:
            print(f"{r['shape']:<18}{r['rows']:>6}{r['prefix']:>8}{r['shared_kv_mb']:>8.0f}{r['private_kv_mb']:>11.0f}"
                  f"{r['shared_ms']:>11.4f}{r['private_ms']:>9.4f}{r['speedup']:>7.2f}{r['max_abs_err']:>9.1e}")
    geo = math.exp(sum(math.log(r["speedup_vs_sdpa"]) for r in decode_rows) / len(decode_rows))
    print(f"\ngeomean speedup vs SDPA: {geo:.2f}x")
    return {"device": name, "peak_gbps": peak, "peak_source": source, "dtype": "bf16", "page_size": page_size,
            "decode": decode_rows, "shared_pages": shared_rows, "geomean_speedup_vs_sdpa": geo}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="two shapes, fewer repetitions, no shared rows")
    parser.add_argument("--page-size", type=int, metavar="P", help="tokens a KV page holds (default: decode.page_size)")
    parser.add_argument("--json", metavar="PATH", help="also write the results as JSON")
    args = parser.parse_args(argv)
    result = run(args.quick, args.page_size)
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(result, fh, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
