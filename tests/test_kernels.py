"""Triton attention kernels against their torch references (engine/kernels).

Without CUDA the kernels run under the Triton interpreter: this module sets TRITON_INTERPRET=1
at import, before triton is imported, because triton reads it both when it is imported and
when each kernel is decorated (and again lazily while interpreting, so it stays set for the
rest of the pytest process). If something imported triton earlier without it, the kernels
cannot be interpreted in this process: the module then re-runs itself in a fresh subprocess
(`test_in_fresh_process`) and skips its in-process tests. With CUDA the compiled kernels run
on the GPU instead.

Tolerances, kernel vs the fp32 reference on the same (already rounded) inputs:
- fp32: atol = rtol = 1e-4 (ieee dots; only the summation order differs)
- fp16: atol = rtol = 2e-3; bf16: atol = rtol = 2e-2 (the output is rounded to the storage
  dtype; on a GPU the dots also run natively in that dtype with P rounded to it)
Cached padding, unused rows and columns outside the window are NaN in the kernels' inputs
(the references get finite copies): a kernel that reads anything it must ignore fails.
"""
from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

CUDA = torch.cuda.is_available()
DEVICE = "cuda" if CUDA else "cpu"
RERUN = not CUDA and "triton" in sys.modules and os.environ.get("TRITON_INTERPRET") != "1"
if not CUDA:
    os.environ["TRITON_INTERPRET"] = "1"

pytest.importorskip("triton")

from baton.engine.kernels import (decode_attention, decode_attention_ref, paged_decode_attention,  # noqa: E402
                            paged_decode_attention_ref, prefill_attention, prefill_attention_ref,
                            prefill_attention_varlen, prefill_attention_varlen_ref, prefix_shared_decode_attention,
                            prefix_shared_decode_attention_ref, triton_available)

in_process = pytest.mark.skipif(RERUN, reason="triton was imported before TRITON_INTERPRET=1; "
                                              "these run in test_in_fresh_process instead")
TOL = {torch.float32: 1e-4, torch.float16: 2e-3, torch.bfloat16: 2e-2}
NAN = float("nan")


def assert_matches(out: torch.Tensor, ref: torch.Tensor, dtype: torch.dtype) -> None:
    assert out.dtype == ref.dtype and out.shape == ref.shape
    torch.testing.assert_close(out.float(), ref.float(), atol=TOL[dtype], rtol=TOL[dtype])


def ragged_starts(n: int, length: int, gen: torch.Generator) -> torch.Tensor:
    """Row 0 uses the whole window, row 1 is empty, row 2 has one token, the rest random."""
    starts = torch.randint(0, length + 1, (n,), generator=gen)
    starts[: min(n, 3)] = torch.tensor([0, length, length - 1])[: min(n, 3)].clamp(min=0)
    return starts.to(torch.int32)


def baton_kv(n: int, kv_heads: int, length: int, head_dim: int, dtype: torch.dtype, starts: torch.Tensor,
             gen: torch.Generator, pad: int = 5):
    """(k, v, k_ref, v_ref): k, v are [n, Hkv, L, D] views into a BatchKV-like buffer
    [2, rows, Hkv, capacity, D] (non-contiguous in dims 0 and 2), NaN wherever attention must not
    look; k_ref, v_ref are finite contiguous copies."""
    buf = torch.full((2, n + 2, kv_heads, length + 2 * pad, head_dim), NAN, dtype=dtype)
    window = buf[:, :n, :, pad: pad + length]
    ref = torch.randn(window.shape, generator=gen).to(dtype)
    window.copy_(ref)
    for i, start in enumerate(starts.tolist()):
        window[:, i, :, :start] = NAN
    buf = buf.to(DEVICE)
    window = buf[:, :n, :, pad: pad + length]
    return window[0], window[1], ref[0].to(DEVICE), ref[1].to(DEVICE)


def make_q(n: int, heads: int, head_dim: int, dtype: torch.dtype, gen: torch.Generator) -> torch.Tensor:
    # like the engine's query[:, :, 0] of [n, H, Tq, D]: a non-contiguous view
    return torch.randn(n, heads, 2, head_dim, generator=gen).to(dtype).to(DEVICE)[:, :, 1]


# -- decode ---------------------------------------------------------------------------------

DECODE_CASES = [  # n, kv_heads, group, L, head_dim, num_splits
    (5, 2, 3, 150, 64, 1),     # SmolLM2-like GQA 3, no split (direct output)
    (4, 1, 8, 130, 128, 3),    # GQA 8, head_dim 128
    (6, 3, 1, 200, 64, 2),     # MHA
    (3, 2, 3, 67, 64, 5),      # more splits than blocks: empty splits merge away
    (2, 1, 4, 1, 32, None),    # one-column window, default split count
    (3, 2, 2, 70, 80, 2),      # head_dim not a power of two (padded and masked)
]


@in_process
@pytest.mark.parametrize("n,kv_heads,group,length,head_dim,splits", DECODE_CASES)
def test_decode_matches_reference_fp32(n, kv_heads, group, length, head_dim, splits):
    gen = torch.Generator().manual_seed(n * 1000 + length)
    starts = ragged_starts(n, length, gen)
    k, v, k_ref, v_ref = baton_kv(n, kv_heads, length, head_dim, torch.float32, starts, gen)
    q = make_q(n, kv_heads * group, head_dim, torch.float32, gen)
    scale = head_dim ** -0.5
    out = decode_attention(q, k, v, starts.to(DEVICE), scale, num_splits=splits)
    assert_matches(out, decode_attention_ref(q, k_ref, v_ref, starts, scale), torch.float32)
    if n > 1:
        assert torch.all(out[1] == 0), "an empty row (start == L) must give zeros"


@in_process
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("group,splits", [(3, 1), (8, 4)])
def test_decode_half_precision_kv(dtype, group, splits):
    gen = torch.Generator().manual_seed(7)
    n, kv_heads, length, head_dim = 4, 2, 140, 64
    starts = ragged_starts(n, length, gen)
    k, v, k_ref, v_ref = baton_kv(n, kv_heads, length, head_dim, dtype, starts, gen)
    q = make_q(n, kv_heads * group, head_dim, dtype, gen)
    out = decode_attention(q, k, v, starts, 0.125, num_splits=splits)
    assert_matches(out, decode_attention_ref(q, k_ref, v_ref, starts, 0.125), dtype)


@in_process
def test_decode_all_rows_empty_and_no_rows():
    gen = torch.Generator().manual_seed(3)
    starts = torch.full((3,), 40, dtype=torch.int32)
    k, v, _, _ = baton_kv(3, 2, 40, 64, torch.float32, starts, gen)
    q = make_q(3, 6, 64, torch.float32, gen)
    for splits in (1, 3):
        out = decode_attention(q, k, v, starts, 0.125, num_splits=splits)
        assert torch.equal(out, torch.zeros_like(out))
    empty = decode_attention(q[:0], k[:0], v[:0], starts[:0], 0.125)
    assert empty.shape == (0, 6, 64)


@in_process
def test_decode_split_count_does_not_change_result():
    gen = torch.Generator().manual_seed(11)
    starts = ragged_starts(4, 300, gen)
    k, v, _, _ = baton_kv(4, 1, 300, 64, torch.float32, starts, gen)
    q = make_q(4, 3, 64, torch.float32, gen)
    outs = [decode_attention(q, k, v, starts, 0.125, num_splits=s) for s in (1, 2, 7)]
    outs.append(decode_attention(q, k, v, starts, None))  # None: the usual head_dim ** -0.5
    for out in outs[1:]:
        torch.testing.assert_close(out, outs[0], atol=1e-5, rtol=1e-5)


@in_process
@pytest.mark.parametrize("splits", [1, 3])
def test_decode_with_per_row_ends_equals_each_row_over_its_own_window(splits):
    """What a captured step does: attend over the whole buffer, each row stopping where `ends`
    says; the NaN columns past each end must never be read."""
    gen = torch.Generator().manual_seed(5)
    n, kv_heads, group, length, head_dim = 4, 2, 3, 120, 64
    ends = torch.tensor([120, 90, 1, 60], dtype=torch.int32)
    starts = torch.tensor([0, 30, 1, 10], dtype=torch.int32)  # row 2: start == end, empty
    k, v, k_ref, v_ref = baton_kv(n, kv_heads, length, head_dim, torch.float32, starts, gen)
    for i, end in enumerate(ends.tolist()):
        k[i, :, end:] = NAN
        v[i, :, end:] = NAN
    q = make_q(n, kv_heads * group, head_dim, torch.float32, gen)
    out = decode_attention(q, k, v, starts.to(DEVICE), 0.125, num_splits=splits, ends=ends.to(DEVICE))
    for i, end in enumerate(ends.tolist()):
        ref = decode_attention_ref(q[i:i + 1], k_ref[i:i + 1, :, :end], v_ref[i:i + 1, :, :end], starts[i:i + 1],
                                   0.125)
        assert_matches(out[i:i + 1], ref, torch.float32)
    assert torch.all(out[2] == 0)


@in_process
def test_decode_rejects_bad_shapes():
    q = torch.zeros(2, 5, 64, device=DEVICE)
    kv = torch.zeros(2, 2, 8, 64, device=DEVICE)
    starts = torch.zeros(2, dtype=torch.int32, device=DEVICE)
    with pytest.raises(ValueError, match="multiple"):
        decode_attention(q, kv, kv, starts, 0.125)
    with pytest.raises(ValueError, match="stride"):
        strided = torch.zeros(2, 2, 64, 8, device=DEVICE).transpose(2, 3)  # [2, 2, 8, 64], stride(-1) 8
        decode_attention(q[:, :4], strided, strided, starts, 0.125)


@in_process
def test_merge_weights_partials_by_lse_and_ignores_empty_ones():
    from baton.engine.kernels._common import merge_partials

    gen = torch.Generator().manual_seed(6)
    mid_o = torch.randn(2, 3, 4, 32, generator=gen)  # [n, H, slots, D]
    lse = torch.randn(2, 3, 4, generator=gen) * 3  # log2 units
    lse[0, :, 1] = float("-inf")
    mid_o[0, :, 1] = NAN  # an empty slot's output may be garbage: it must get weight 0
    lse[1, 2] = float("-inf")  # a head with no partial at all
    out = torch.empty(2, 3, 32, device=DEVICE)
    merge_partials(mid_o.to(DEVICE), lse.to(DEVICE), out)
    w = torch.softmax(lse * torch.log(torch.tensor(2.0)), dim=-1).nan_to_num(0.0)
    expect = (w[..., None] * mid_o.nan_to_num(0.0)).sum(2)
    torch.testing.assert_close(out.cpu(), expect, atol=1e-5, rtol=1e-5)
    assert torch.all(out[1, 2] == 0)


def test_references_agree_with_sdpa_per_row():
    """The oracle itself, against torch SDPA run row by row on just the valid columns."""
    gen = torch.Generator().manual_seed(5)
    n, kv_heads, group, length = 4, 2, 3, 33
    starts = ragged_starts(n, length, gen)
    k, v = torch.randn(2, n, kv_heads, length, 16, generator=gen)
    q = torch.randn(n, kv_heads * group, 16, generator=gen)
    ref = decode_attention_ref(q, k, v, starts, 0.3)
    for i, start in enumerate(starts.tolist()):
        if start == length:
            assert torch.all(ref[i] == 0)
            continue
        kk, vv = (t[i, :, start:].repeat_interleave(group, 0) for t in (k, v))
        expect = F.scaled_dot_product_attention(q[i, :, None], kk, vv, scale=0.3)[:, 0]
        torch.testing.assert_close(ref[i], expect, atol=1e-5, rtol=1e-5)
    qp, kp, vp = torch.randn(6, 6, 16), torch.randn(2, 10, 16), torch.randn(2, 10, 16)
    ref = prefill_attention_ref(qp, kp, vp, 4, 0.3)
    mask = torch.ones(6, 10, dtype=torch.bool).tril(diagonal=4)
    expect = F.scaled_dot_product_attention(qp.transpose(0, 1), kp.repeat_interleave(3, 0),
                                            vp.repeat_interleave(3, 0), attn_mask=mask, scale=0.3)
    torch.testing.assert_close(ref, expect.transpose(0, 1), atol=1e-5, rtol=1e-5)


# -- paged decode ---------------------------------------------------------------------------

def paged_kv(lengths: list[int], page_size: int, kv_heads: int, head_dim: int, dtype: torch.dtype,
             gen: torch.Generator, spare: int = 3):
    """(k_pages, v_pages, page_table, dense) for rows of the given lengths.

    k_pages, v_pages: [num_pages, Hkv, P, D], layer 1 of a [2, 2, num_pages, Hkv, P, D] pool stored
    page-major ([layers, num_pages, 2, ...] transposed), so the page stride is not Hkv * P * D.
    Each row's pages sit at shuffled ids >= 1; NaN in the null page 0, in spare pages and in the
    slots past each row's length, wherever attention must not look. page_table: int32
    [R, max pages + 1], 0 past each row's pages. dense: per row, its keys and values [2, Hkv, len, D].
    """
    need = [-(-n // page_size) for n in lengths]
    num_pages = 1 + sum(need) + spare
    ids = (torch.randperm(num_pages - 1, generator=gen) + 1).tolist()
    storage = torch.full((2, num_pages, 2, kv_heads, page_size, head_dim), NAN, dtype=dtype)
    table = torch.zeros(len(lengths), max(need, default=0) + 1, dtype=torch.int32)
    dense = []
    for r, n in enumerate(lengths):
        kv = torch.randn(2, kv_heads, n, head_dim, generator=gen).to(dtype)
        dense.append(kv.to(DEVICE))
        for j in range(need[r]):
            table[r, j] = page = ids.pop()
            part = kv[:, :, j * page_size: (j + 1) * page_size]
            storage[1, page, :, :, :part.shape[2]] = part
    pool = storage.to(DEVICE).transpose(1, 2)  # [layers, 2, num_pages, Hkv, P, D]
    return pool[1, 0], pool[1, 1], table.to(DEVICE), dense


PAGED_CASES = [  # page size, kv_heads, group, head_dim, row lengths, split counts
    (16, 2, 3, 64, [0, 1, 16, 45, 130], (1, 3)),  # GQA 3: empty, one token, exactly a page, across pages
    (32, 1, 1, 32, [33, 0, 64, 200], (1, 2)),     # MHA, page 32
    (5, 1, 4, 64, [5, 1, 23, 71, 0], (1, 4)),     # page size not a power of two: blocks span 13 pages
    (16, 1, 8, 80, [150, 17], (None,)),           # GQA 8, head_dim not a power of two, default splits
]


@in_process
@pytest.mark.parametrize("page_size,kv_heads,group,head_dim,lengths,splits", PAGED_CASES)
def test_paged_decode_matches_reference_fp32(page_size, kv_heads, group, head_dim, lengths, splits):
    gen = torch.Generator().manual_seed(page_size * 100 + len(lengths))
    k, v, table, _ = paged_kv(lengths, page_size, kv_heads, head_dim, torch.float32, gen)
    q = make_q(len(lengths), kv_heads * group, head_dim, torch.float32, gen)
    lens = torch.tensor(lengths, dtype=torch.int32, device=DEVICE)
    ref = paged_decode_attention_ref(q, k, v, table, lens, None)
    for s in splits:
        out = paged_decode_attention(q, k, v, table, lens, None, num_splits=s)
        assert_matches(out, ref, torch.float32)
        for r, n in enumerate(lengths):
            if n == 0:
                assert torch.all(out[r] == 0), "a row of length 0 must give zeros"


@in_process
def test_paged_decode_bf16_kv():
    gen = torch.Generator().manual_seed(8)
    lengths = [40, 1, 16]
    k, v, table, _ = paged_kv(lengths, 16, 2, 64, torch.bfloat16, gen)
    q = make_q(3, 6, 64, torch.bfloat16, gen)
    lens = torch.tensor(lengths, dtype=torch.int32, device=DEVICE)
    out = paged_decode_attention(q, k, v, table, lens, 0.125, num_splits=2)
    assert_matches(out, paged_decode_attention_ref(q, k, v, table, lens, 0.125), torch.bfloat16)


@in_process
def test_paged_decode_no_rows_and_all_rows_empty():
    gen = torch.Generator().manual_seed(4)
    k, v, table, _ = paged_kv([20, 7], 16, 2, 64, torch.float32, gen)
    q = make_q(2, 4, 64, torch.float32, gen)
    zeros = torch.zeros(2, dtype=torch.int32, device=DEVICE)
    for splits in (1, 3):
        out = paged_decode_attention(q, k, v, table, zeros, 0.125, num_splits=splits)
        assert torch.equal(out, torch.zeros_like(out))
    empty = paged_decode_attention(q[:0], k, v, table[:0], zeros[:0], 0.125)
    assert empty.shape == (0, 4, 64)


@pytest.mark.skipif(not CUDA, reason="CUDA graphs need a GPU")
def test_paged_decode_graph_replays_with_new_table_and_lengths():
    """What a captured decode step does: the same launch replayed after the page table and the
    lengths changed in place (rows grew into new pages, pages were reassigned)."""
    gen = torch.Generator().manual_seed(12)
    k, v, table, _ = paged_kv([70, 30, 33, 5], 16, 2, 64, torch.float32, gen)
    q = make_q(4, 6, 64, torch.float32, gen)
    lens = torch.tensor([10, 30, 1, 0], dtype=torch.int32, device=DEVICE)

    def run():
        return paged_decode_attention(q, k, v, table, lens, 0.125, num_splits=2)

    run()  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = run()
    table.copy_(table[[1, 0, 2, 3]])  # rows 0 and 1 swap their pages (row 0 now has 30 tokens, row 1 70)
    lens.copy_(torch.tensor([25, 70, 33, 5], dtype=torch.int32))  # rows 2 and 3 grow across pages
    graph.replay()
    assert_matches(out, paged_decode_attention_ref(q, k, v, table, lens, 0.125), torch.float32)


@in_process
def test_paged_decode_rejects_bad_inputs():
    q = torch.zeros(2, 6, 64, device=DEVICE)
    pages = torch.zeros(4, 2, 16, 64, device=DEVICE)
    table = torch.ones(2, 3, dtype=torch.int32, device=DEVICE)
    lens = torch.ones(2, dtype=torch.int32, device=DEVICE)
    with pytest.raises(ValueError, match="multiple"):
        paged_decode_attention(q[:, :5], pages, pages, table, lens, None)
    with pytest.raises(ValueError, match="shape mismatch"):
        paged_decode_attention(q, pages, pages[:, :, :8], table, lens, None)
    with pytest.raises(ValueError, match="page_table must be int32"):
        paged_decode_attention(q, pages, pages, table.long(), lens, None)
    with pytest.raises(ValueError, match="page_table must be int32"):
        paged_decode_attention(q, pages, pages, table[:1], lens, None)
    with pytest.raises(ValueError, match="lengths must be int32"):
        paged_decode_attention(q, pages, pages, table, lens[:1], None)
    with pytest.raises(ValueError, match="float32/float16/bfloat16"):
        paged_decode_attention(q, pages, pages.half(), table, lens, None)
    with pytest.raises(ValueError, match="num_splits"):
        paged_decode_attention(q, pages, pages, table, lens, None, num_splits=0)
    with pytest.raises(ValueError, match="stride"):
        strided = torch.zeros(4, 2, 64, 16, device=DEVICE).transpose(2, 3)  # [4, 2, 16, 64], stride(-1) 16
        paged_decode_attention(q, strided, strided, table, lens, None)


def test_paged_reference_agrees_with_sdpa_per_row():
    """The oracle itself, against torch SDPA over each row's own keys, never paged."""
    gen = torch.Generator().manual_seed(13)
    lengths, group = [0, 1, 7, 14, 30], 3
    k, v, table, dense = paged_kv(lengths, 7, 2, 16, torch.float32, gen)
    q = torch.randn(len(lengths), 6, 16, generator=gen).to(DEVICE)
    lens = torch.tensor(lengths, dtype=torch.int32, device=DEVICE)
    ref = paged_decode_attention_ref(q, k, v, table, lens, 0.3)
    assert torch.all(ref[0] == 0)
    for i, (kk, vv) in enumerate(dense[1:], 1):
        expect = F.scaled_dot_product_attention(q[i, :, None], kk.repeat_interleave(group, 0),
                                                vv.repeat_interleave(group, 0), scale=0.3)[:, 0]
        torch.testing.assert_close(ref[i], expect, atol=1e-5, rtol=1e-5)
    # None: the usual head_dim ** -0.5
    torch.testing.assert_close(paged_decode_attention_ref(q, k, v, table, lens, None),
                               paged_decode_attention_ref(q, k, v, table, lens, 0.25))


# -- prefill --------------------------------------------------------------------------------

PREFILL_CASES = [  # prefix_len, new tokens, kv_heads, group, head_dim
    (0, 45, 2, 3, 64),    # plain causal prefill, T not a multiple of the block
    (37, 20, 1, 8, 128),  # prefix reuse: new tokens over a cached prefix
    (70, 1, 3, 1, 64),    # one new token (a chunk of one)
    (0, 1, 1, 3, 64),
]


@in_process
@pytest.mark.parametrize("prefix_len,num_new,kv_heads,group,head_dim", PREFILL_CASES)
def test_prefill_matches_reference(prefix_len, num_new, kv_heads, group, head_dim):
    gen = torch.Generator().manual_seed(prefix_len * 100 + num_new)
    total = prefix_len + num_new
    # k, v: [Hkv, total, D] as views of a token-major [tokens + 4, Hkv, D] buffer, NaN outside
    buf = torch.full((2, total + 4, kv_heads, head_dim), NAN)
    buf[:, 2: 2 + total] = torch.randn(2, total, kv_heads, head_dim, generator=gen)
    k, v = buf.to(DEVICE)[:, 2: 2 + total].transpose(1, 2)
    q = torch.randn(num_new, kv_heads * group, head_dim, generator=gen).to(DEVICE)
    out = prefill_attention(q, k, v, prefix_len, head_dim ** -0.5)
    assert_matches(out, prefill_attention_ref(q, k, v, prefix_len, head_dim ** -0.5), torch.float32)


@in_process
def test_prefill_bf16_and_empty_chunk():
    gen = torch.Generator().manual_seed(1)
    q = torch.randn(33, 6, 64, generator=gen).to(torch.bfloat16).to(DEVICE)
    k, v = torch.randn(2, 2, 50, 64, generator=gen).to(torch.bfloat16).to(DEVICE)
    assert_matches(prefill_attention(q, k, v, 17, 0.125), prefill_attention_ref(q, k, v, 17, 0.125),
                   torch.bfloat16)
    assert prefill_attention(q[:0], k[:, :17], v[:, :17], 17, 0.125).shape == (0, 6, 64)
    with pytest.raises(ValueError, match="prefix_len"):
        prefill_attention(q, k, v, 16, 0.125)


@in_process
def test_prefill_varlen_batch():
    gen = torch.Generator().manual_seed(2)
    lens = [(10, 40), (0, 5), (33, 33), (1, 70), (17, 17)]  # (new tokens, total columns)
    cu_q = torch.tensor([0] + [a for a, _ in lens]).cumsum(0).to(torch.int32)
    cu_k = torch.tensor([0] + [b for _, b in lens]).cumsum(0).to(torch.int32)
    q = torch.randn(int(cu_q[-1]), 6, 64, generator=gen).to(DEVICE)
    k, v = torch.randn(2, 2, int(cu_k[-1]), 64, generator=gen).to(DEVICE)
    out = prefill_attention_varlen(q, k, v, cu_q.to(DEVICE), cu_k.to(DEVICE), 0.125, max(a for a, _ in lens))
    assert_matches(out, prefill_attention_varlen_ref(q, k, v, cu_q, cu_k, 0.125), torch.float32)


@in_process
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_prefill_varlen_over_a_shared_prefix(dtype):
    """A BatchLLM group's member prompts, each with its own new tokens (one also over cached
    columns of its own), all continuing one prefix passed once: the same as each copying it."""
    gen = torch.Generator().manual_seed(3)
    lens = [(10, 10), (1, 1), (33, 33), (7, 20)]  # (new tokens, own columns)
    cu_q = torch.tensor([0] + [a for a, _ in lens]).cumsum(0).to(torch.int32)
    cu_k = torch.tensor([0] + [b for _, b in lens]).cumsum(0).to(torch.int32)
    q = torch.randn(int(cu_q[-1]), 6, 64, generator=gen).to(dtype).to(DEVICE)
    k, v = torch.randn(2, 2, int(cu_k[-1]), 64, generator=gen).to(dtype).to(DEVICE)
    shared_k, shared_v = torch.randn(2, 2, 45, 64, generator=gen).to(dtype).to(DEVICE)
    out = prefill_attention_varlen(q, k, v, cu_q.to(DEVICE), cu_k.to(DEVICE), 0.125, 33, shared_k, shared_v)
    assert_matches(out, prefill_attention_varlen_ref(q, k, v, cu_q, cu_k, 0.125, shared_k, shared_v), dtype)
    with pytest.raises(ValueError, match="shared"):
        prefill_attention_varlen(q, k, v, cu_q.to(DEVICE), cu_k.to(DEVICE), 0.125, 33, shared_k, None)


# -- prefix-shared decode -------------------------------------------------------------------

def shared_prefix(groups: int, kv_heads: int, max_len: int, head_dim: int, dtype, lens: list[int], gen):
    """prefix_k, prefix_v: [G, Hkv, P_max, D], NaN past each group's length (and their refs)."""
    ref = torch.randn(2, groups, kv_heads, max_len, head_dim, generator=gen).to(dtype)
    poisoned = ref.clone()
    for g, plen in enumerate(lens):
        poisoned[:, g, :, plen:] = NAN
    poisoned, ref = poisoned.to(DEVICE), ref.to(DEVICE)
    return poisoned[0], poisoned[1], ref[0], ref[1]


SHARED_CASES = [  # group_of_row, prefix_lens, kv_heads, group, L, head_dim, splits, prefix splits
    ([2, 0, 2, -1, 2, 0], [140, 0, 77], 2, 3, 90, 64, 1, 1),  # -1 row, empty prefix, GQA 3
    ([0, 1, 0, 1, 0, 0], [65, 140], 1, 1, 70, 128, 2, 3),    # MHA, head_dim 128
    ([0] * 10 + [1, 1], [100, 30], 1, 8, 40, 64, 3, 2),      # 10 rows x GQA 8: two row tiles
    ([-1, -1, -1], [50], 2, 2, 60, 64, 2, 2),                # nobody uses the prefix
    ([0] * 23, [70], 1, 3, 20, 64, 1, 1),                     # 23 rows x GQA 3: 21 (row, head) rows a tile
]


@in_process
@pytest.mark.parametrize("rows,lens,kv_heads,group,length,head_dim,splits,prefix_splits", SHARED_CASES)
def test_prefix_shared_matches_reference(rows, lens, kv_heads, group, length, head_dim, splits, prefix_splits):
    gen = torch.Generator().manual_seed(len(rows) * 10 + length)
    n = len(rows)
    starts = ragged_starts(n, length, gen)
    k, v, k_ref, v_ref = baton_kv(n, kv_heads, length, head_dim, torch.float32, starts, gen)
    pk, pv, pk_ref, pv_ref = shared_prefix(len(lens), kv_heads, 140, head_dim, torch.float32, lens, gen)
    q = make_q(n, kv_heads * group, head_dim, torch.float32, gen)
    group_of_row = torch.tensor(rows, dtype=torch.int32, device=DEVICE)
    prefix_lens = torch.tensor(lens, dtype=torch.int32, device=DEVICE)
    out = prefix_shared_decode_attention(q, pk, pv, k, v, starts, group_of_row, prefix_lens, 0.125,
                                         num_splits=splits, num_prefix_splits=prefix_splits)
    ref = prefix_shared_decode_attention_ref(q, pk_ref, pv_ref, k_ref, v_ref, starts, group_of_row, prefix_lens,
                                             0.125)
    assert_matches(out, ref, torch.float32)


@in_process
def test_prefix_shared_without_prefix_equals_decode():
    gen = torch.Generator().manual_seed(4)
    n, length = 5, 120
    starts = ragged_starts(n, length, gen)
    k, v, _, _ = baton_kv(n, 3, length, 64, torch.float32, starts, gen)
    pk, pv, _, _ = shared_prefix(2, 3, 32, 64, torch.float32, [32, 0], gen)
    q = make_q(n, 9, 64, torch.float32, gen)
    # group 1 exists but has length 0; rows in it and rows with -1 both see only their own KV
    rows = torch.tensor([1, -1, 1, 1, -1], dtype=torch.int32)
    out = prefix_shared_decode_attention(q, pk, pv, k, v, starts, rows, torch.tensor([32, 0]), 0.125,
                                         max_group_rows=3)
    torch.testing.assert_close(out, decode_attention(q, k, v, starts, 0.125, num_splits=2), atol=1e-5, rtol=1e-5)


@in_process
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_prefix_shared_half_precision(dtype):
    gen = torch.Generator().manual_seed(9)
    rows, lens, n, length = [0, 1, 0, 0], [90, 20], 4, 50
    starts = ragged_starts(n, length, gen)
    k, v, k_ref, v_ref = baton_kv(n, 3, length, 64, dtype, starts, gen)
    pk, pv, pk_ref, pv_ref = shared_prefix(2, 3, 96, 64, dtype, lens, gen)
    q = make_q(n, 9, 64, dtype, gen)
    group_of_row, prefix_lens = torch.tensor(rows, device=DEVICE), torch.tensor(lens, device=DEVICE)
    out = prefix_shared_decode_attention(q, pk, pv, k, v, starts, group_of_row, prefix_lens, 0.125,
                                         num_splits=2, num_prefix_splits=2)
    ref = prefix_shared_decode_attention_ref(q, pk_ref, pv_ref, k_ref, v_ref, starts, group_of_row, prefix_lens,
                                             0.125)
    assert_matches(out, ref, dtype)


# -- environment ----------------------------------------------------------------------------

def test_triton_available_follows_interpreter_flag(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert triton_available()
    monkeypatch.delenv("TRITON_INTERPRET")
    assert triton_available() == CUDA


@pytest.mark.skipif(CUDA, reason="on a GPU the kernels run compiled in the tests above")
def test_kernels_compile_for_sm90_bf16():
    """The native bf16 dot path never runs in the interpreter; compile it for sm_90 at least."""
    env = {key: val for key, val in os.environ.items() if key != "TRITON_INTERPRET"}
    proc = subprocess.run([sys.executable, "-m", "baton.engine.kernels.compile_check", "bf16"], env=env,
                          capture_output=True, text=True, timeout=300, cwd=_repo_root())
    if proc.returncode == 3:
        pytest.skip("this triton install has no CUDA backend")
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]


@pytest.mark.skipif(CUDA, reason="with a GPU the benchmark really runs; see baton.bench_kernels")
def test_benchmark_says_it_needs_a_gpu(capsys):
    from baton.bench_kernels import run

    result = run(quick=True)
    assert "skipped" in result and "GPU" in result["skipped"]
    assert "needs a CUDA GPU" in capsys.readouterr().out


@pytest.mark.skipif(not RERUN, reason="kernels already run in this process")
def test_in_fresh_process():
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", __file__], env=env,
                          capture_output=True, text=True, timeout=600, cwd=_repo_root())
    assert proc.returncode == 0, proc.stdout[-6000:]


def _repo_root() -> str:
    return os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
