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
Whatever a kernel must ignore (the null page, free pages, page slots past a row's length,
columns outside a prefill's buffer) is NaN in its inputs: a kernel that reads it fails.
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

from baton.engine.kernels import (paged_decode_attention, paged_decode_attention_ref,  # noqa: E402
                                  prefill_attention, prefill_attention_ref, prefill_attention_varlen,
                                  prefill_attention_varlen_ref, triton_available)

in_process = pytest.mark.skipif(RERUN, reason="triton was imported before TRITON_INTERPRET=1; "
                                              "these run in test_in_fresh_process instead")
TOL = {torch.float32: 1e-4, torch.float16: 2e-3, torch.bfloat16: 2e-2}
NAN = float("nan")


def assert_matches(out: torch.Tensor, ref: torch.Tensor, dtype: torch.dtype) -> None:
    assert out.dtype == ref.dtype and out.shape == ref.shape
    torch.testing.assert_close(out.float(), ref.float(), atol=TOL[dtype], rtol=TOL[dtype])


def assert_exact(out: torch.Tensor, ref: torch.Tensor) -> None:
    """Bit for bit where the kernel rounds as torch does: fp32, and any dtype compiled on a GPU. The
    interpreter rounds fp32 to bf16/fp16 by truncation, not to nearest: there within an ulp."""
    if CUDA or out.dtype == torch.float32:
        assert torch.equal(out, ref)
    else:
        assert_matches(out, ref, out.dtype)


def make_q(n: int, heads: int, head_dim: int, dtype: torch.dtype, gen: torch.Generator) -> torch.Tensor:
    # like the engine's query[:, :, 0] of [n, H, Tq, D]: a non-contiguous view
    return torch.randn(n, heads, 2, head_dim, generator=gen).to(dtype).to(DEVICE)[:, :, 1]


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
    from baton.engine.kernels import tiled_attention

    for s in splits + ("tiled",):  # split-K, and the invariant path's query-tiled kernel (one split)
        out = tiled_attention(q, k, v, table, lens, None) if s == "tiled" else \
            paged_decode_attention(q, k, v, table, lens, None, num_splits=s)
        assert_matches(out, ref, torch.float32)
        for r, n in enumerate(lengths):
            if n == 0:
                assert torch.all(out[r] == 0), "a row of length 0 must give zeros"


@in_process
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_paged_decode_half_precision_kv(dtype):
    gen = torch.Generator().manual_seed(8)
    lengths = [40, 1, 16]
    k, v, table, _ = paged_kv(lengths, 16, 2, 64, dtype, gen)
    q = make_q(3, 6, 64, dtype, gen)
    lens = torch.tensor(lengths, dtype=torch.int32, device=DEVICE)
    out = paged_decode_attention(q, k, v, table, lens, 0.125, num_splits=2)
    assert_matches(out, paged_decode_attention_ref(q, k, v, table, lens, 0.125), dtype)


@in_process
@pytest.mark.parametrize("splits", [1, 3])
def test_paged_decode_rows_sharing_leading_pages(splits):
    """Rows continuing one prefix list the same leading pages, then their own: each row sees
    the shared pages as if they were its own copy, and nothing else."""
    gen = torch.Generator().manual_seed(14)
    page_size, shared = 16, 3  # 48 shared tokens
    lengths = [shared * page_size + own for own in (0, 1, 20, 47)]  # row 0: the prefix alone so far
    k, v, table, dense = paged_kv(lengths, page_size, 2, 64, torch.float32, gen)
    orphans = table[1:, :shared].flatten()
    table[1:, :shared] = table[0, :shared]  # rows 1-3 give up their own prefix pages for row 0's
    k[orphans.long()] = NAN  # and the pages they gave up must not be read
    v[orphans.long()] = NAN
    q = make_q(len(lengths), 6, 64, torch.float32, gen)
    lens = torch.tensor(lengths, dtype=torch.int32, device=DEVICE)
    out = paged_decode_attention(q, k, v, table, lens, None, num_splits=splits)
    prefix = dense[0][:, :, :shared * page_size]  # [2, Hkv, 48, D]
    for r, kv in enumerate(dense):
        kv = torch.cat([prefix, kv[:, :, shared * page_size:]], dim=2)  # row r's tokens as it sees them
        expect = F.scaled_dot_product_attention(q[r, :, None], kv[0].repeat_interleave(3, 0),
                                                kv[1].repeat_interleave(3, 0), scale=64 ** -0.5)[:, 0]
        torch.testing.assert_close(out[r], expect, atol=1e-4, rtol=1e-4)


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


def test_prefill_reference_agrees_with_sdpa():
    """The oracle itself, against torch SDPA with an explicit causal mask past the prefix."""
    gen = torch.Generator().manual_seed(5)
    qp, kp, vp = (torch.randn(shape, generator=gen) for shape in ((6, 6, 16), (2, 10, 16), (2, 10, 16)))
    ref = prefill_attention_ref(qp, kp, vp, 4, 0.3)
    mask = torch.ones(6, 10, dtype=torch.bool).tril(diagonal=4)
    expect = F.scaled_dot_product_attention(qp.transpose(0, 1), kp.repeat_interleave(3, 0),
                                            vp.repeat_interleave(3, 0), attn_mask=mask, scale=0.3)
    torch.testing.assert_close(ref, expect.transpose(0, 1), atol=1e-5, rtol=1e-5)


# -- batch invariance (engine.kernels.invariant and .tiled) ----------------------------------------

@in_process
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("bias", [False, True])
def test_invariant_linear_gives_a_row_the_same_bits_in_any_batch(dtype, bias):
    from baton.engine.kernels import invariant_linear

    gen = torch.Generator().manual_seed(5)
    weight = torch.randn(200, 150, generator=gen).to(dtype).to(DEVICE)  # N, K: neither a tile multiple
    b = torch.randn(200, generator=gen).to(dtype).to(DEVICE) if bias else None
    rows = torch.randn(70, 150, generator=gen).to(dtype).to(DEVICE)
    alone = torch.cat([invariant_linear(rows[i:i + 1], weight, b) for i in range(0, 70, 9)])
    expected = F.linear(rows.float(), weight.float(), None if b is None else b.float())
    assert_matches(invariant_linear(rows, weight, b), expected.to(dtype), dtype)
    # the same rows among other rows, at other positions and tile offsets: the same bits
    for count, at in ((2, 1), (16, 7), (70, 0), (67, 64)):
        others = torch.randn(count, 150, generator=gen).to(dtype).to(DEVICE)
        mixed = torch.cat([others[:at], rows[::9], others[at:]])
        out = invariant_linear(mixed, weight, b)
        assert torch.equal(out[at:at + alone.shape[0]], alone), (count, at)


@in_process
def test_invariant_linear_prefill_tiles_only_where_they_give_the_decode_tiles_bits(monkeypatch, caplog):
    """Above 64 rows the GEMM takes larger tiles once a check on this device shows they round each
    element as the decode tiles do; a device where they would not keeps the decode tiles for every
    row count (here simulated: a prefill launch that perturbs its output)."""
    from baton.engine.kernels import invariant

    gen = torch.Generator().manual_seed(9)
    weight = torch.randn(300, 130, generator=gen).to(DEVICE)
    rows = torch.randn(150, 130, generator=gen).to(DEVICE)
    monkeypatch.setattr(invariant, "_AGREE", {})
    out = invariant.linear(rows, weight)
    assert list(invariant._AGREE.values()) == [True]
    assert torch.equal(out[:5], invariant.linear(rows[:5], weight))  # decode tiles, the same bits

    launch = invariant._launch

    def rounding_otherwise(x, w, b, tiles, *args):
        out = launch(x, w, b, tiles, *args)
        return out + 1e-3 if tiles == invariant.PREFILL_TILES else out

    monkeypatch.setattr(invariant, "_AGREE", {})
    monkeypatch.setattr(invariant, "_launch", rounding_otherwise)
    with caplog.at_level("WARNING", logger=invariant.__name__):
        assert torch.equal(invariant.linear(rows, weight), out)
    assert list(invariant._AGREE.values()) == [False] and "uses the decode tiles" in caplog.text


@in_process
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_invariant_linear_adds_the_residual_as_torch_does(dtype):
    """residual + linear(x) in the GEMM's own launch: the same bits as adding it after."""
    from baton.engine.kernels import invariant_linear

    gen = torch.Generator().manual_seed(12)
    x = torch.randn(5, 96, generator=gen).to(dtype).to(DEVICE)
    weight = torch.randn(80, 96, generator=gen).to(dtype).to(DEVICE)
    residual = torch.randn(5, 80, generator=gen).to(dtype).to(DEVICE)
    assert_exact(invariant_linear(x, weight, residual=residual), residual + invariant_linear(x, weight))
    with pytest.raises(ValueError, match="residual must be"):
        invariant_linear(x, weight, residual=residual[:, :79])


@in_process
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rotary_kv_rotates_in_place_and_writes_keys_and_values_where_they_live(dtype):
    """The fused rotary and KV write against the torch ops the executor ran before (x * cos +
    roll(x, D/2) * signed_sin, each op rounded to the dtype), into a paged layer's page slots."""
    from baton.engine.kernels import rotary_kv

    gen = torch.Generator().manual_seed(13)
    n, hq, hkv, d = 5, 6, 2, 64
    qkv = torch.randn(n, (hq + 2 * hkv) * d, generator=gen).to(dtype).to(DEVICE)
    cos = torch.randn(n, d, generator=gen).to(dtype).to(DEVICE)
    signed_sin = torch.randn(n, d, generator=gen).to(dtype).to(DEVICE)
    heads = qkv.view(n, hq + 2 * hkv, d)
    qk = heads[:, :hq + hkv]
    expected = qk * cos[:, None] + qk.roll(d // 2, dims=-1) * signed_sin[:, None]
    values = heads[:, hq + hkv:].clone()
    pages = torch.full((2, 7, hkv, 4, d), NAN, dtype=dtype, device=DEVICE)  # [k/v, pages, Hkv, P, D]
    page = torch.tensor([3, 3, 6, 1, 5], device=DEVICE)
    slot = torch.tensor([0, 1, 3, 2, 0], device=DEVICE)
    offsets = page * pages.stride(1) + slot * pages.stride(3)
    rotary_kv(qkv, cos, signed_sin, hq, hkv, pages[0].transpose(1, 2), pages[1].transpose(1, 2), offsets)
    assert_exact(heads[:, :hq + hkv], expected)
    assert_exact(pages[0, page, :, slot], expected[:, hq:])
    assert torch.equal(pages[1, page, :, slot], values)
    assert int(pages[0].isnan().sum()) == (7 * 4 - n) * hkv * d  # nothing else written


@in_process
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_silu_mul_matches_torch(dtype):
    from baton.engine.kernels import silu_mul

    gen = torch.Generator().manual_seed(14)
    gate_up = (4 * torch.randn(3, 2 * 300, generator=gen)).to(dtype).to(DEVICE)
    gate, up = gate_up.chunk(2, dim=-1)
    assert_matches(silu_mul(gate_up), F.silu(gate) * up, dtype)


@in_process
@pytest.mark.parametrize("bias", [False, True])
def test_fp8_linear_gives_a_row_the_same_bits_in_any_batch(bias):
    """fp8 weights (engine.fp8) on the invariant GEMM: each row's activations quantized on their own
    scale, the e4m3 products summed in fp32 in a fixed order and scaled back; against the same
    arithmetic in torch, and the same bits for a row alone, beside others, above and below the 64
    rows where the tiles change."""
    from baton.engine import fp8
    from baton.engine.kernels import invariant, invariant_fp8_linear

    gen = torch.Generator().manual_seed(15)
    weight = fp8.quantize(torch.randn(200, 160, generator=gen).to(DEVICE))
    b = torch.randn(200, generator=gen).to(torch.bfloat16).to(DEVICE) if bias else None
    rows = (3 * torch.randn(70, 160, generator=gen)).to(torch.bfloat16).to(DEVICE)
    codes, scales = invariant.quantize_rows(rows)
    ref_codes, ref_scales = fp8.quantize_rows(rows)
    torch.testing.assert_close(scales, ref_scales)
    if CUDA:  # the codes torch rounds to (Triton's interpreter converts fp32 to e4m3 otherwise: not checked)
        assert torch.equal(codes, ref_codes)
    expected = (codes.float() * scales[:, None]) @ weight.dequantize().t() + (0 if b is None else b.float())
    out = invariant_fp8_linear(rows, weight, b)
    assert out.dtype == torch.bfloat16
    assert_matches(out, expected.to(torch.bfloat16), torch.bfloat16)
    alone = torch.cat([invariant_fp8_linear(rows[i:i + 1], weight, b) for i in range(0, 70, 9)])
    for count, at in ((2, 1), (16, 7), (67, 64)):
        others = torch.randn(count, 160, generator=gen).to(torch.bfloat16).to(DEVICE)
        mixed = torch.cat([others[:at], rows[::9], others[at:]])
        assert torch.equal(invariant_fp8_linear(mixed, weight, b)[at:at + alone.shape[0]], alone), (count, at)


@in_process
def test_invariant_linear_and_norm_refuse_bad_inputs():
    from baton.engine.kernels import invariant_linear, invariant_rms_norm

    x, w = torch.zeros(3, 8, device=DEVICE), torch.zeros(4, 8, device=DEVICE)
    with pytest.raises(ValueError, match="linear needs"):
        invariant_linear(x, torch.zeros(4, 9, device=DEVICE))
    with pytest.raises(ValueError, match="share a float dtype"):
        invariant_linear(x, w.to(torch.bfloat16))
    with pytest.raises(ValueError, match="bias"):
        invariant_linear(x, w, torch.zeros(5, device=DEVICE))
    with pytest.raises(ValueError, match="rms_norm needs"):
        invariant_rms_norm(x, torch.zeros(9, device=DEVICE), 1e-5)
    assert invariant_linear(x[:0], w).shape == (0, 4)


@in_process
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_invariant_rms_norm_matches_transformers_order_per_row(dtype):
    from baton.engine.kernels import invariant_rms_norm

    gen = torch.Generator().manual_seed(6)
    x = torch.randn(9, 576, generator=gen).to(dtype).to(DEVICE)
    weight = torch.randn(576, generator=gen).to(dtype).to(DEVICE)
    out = invariant_rms_norm(x, weight, 1e-5)
    expected = weight.float() * F.rms_norm(x.float(), (576,), None, 1e-5).to(dtype).float()
    assert_matches(out, expected.to(dtype), dtype)
    assert torch.equal(invariant_rms_norm(x[4:5], weight, 1e-5), out[4:5])


@in_process
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_tiled_prefill_sequences_of_any_length_in_one_launch(dtype):
    """Several sequences in one launch, each with its own new tokens (more and fewer than a tile)
    after its own cached columns, over shuffled pages of a size that is not a power of two: each
    query attends its columns up to its own position, as prefill_attention's reference says."""
    from baton.engine.kernels import tiled_attention

    gen = torch.Generator().manual_seed(21)
    kv_heads, group, head_dim, page_size = 2, 3, 64, 5
    new, cached = [1, 40, 17, 3], [0, 9, 70, 130]  # tiles hold 16 tokens at GQA 3 (padded to 4)
    lengths = [n + c for n, c in zip(new, cached)]
    k, v, table, dense = paged_kv(lengths, page_size, kv_heads, head_dim, dtype, gen)
    q = make_q(sum(new), kv_heads * group, head_dim, dtype, gen)
    cu = torch.tensor([0, *torch.tensor(new).cumsum(0).tolist()], dtype=torch.int32, device=DEVICE)
    out = tiled_attention(q, k, v, table, torch.tensor(lengths, dtype=torch.int32, device=DEVICE), None, cu,
                          max(new))
    for s, (n, c) in enumerate(zip(new, cached)):
        rows = slice(int(cu[s]), int(cu[s + 1]))
        ref = prefill_attention_ref(q[rows].float(), dense[s][0].float(), dense[s][1].float(), c, head_dim ** -0.5)
        assert_matches(out[rows], ref.to(dtype), dtype)


@in_process
def test_tiled_attention_refuses_bad_inputs():
    from baton.engine.kernels import tiled_attention

    q, k = torch.zeros(2, 4, 16, device=DEVICE), torch.zeros(3, 2, 8, 16, device=DEVICE)
    table, lens = torch.ones(2, 1, dtype=torch.int32, device=DEVICE), torch.ones(2, dtype=torch.int32, device=DEVICE)
    with pytest.raises(ValueError, match="one query per sequence"):
        tiled_attention(q[:1], k, k, table, lens, None)
    with pytest.raises(ValueError, match="cu_seqlens_q must be int32"):
        tiled_attention(q, k, k, table, lens, None, torch.tensor([0, 2], dtype=torch.int32, device=DEVICE), 2)
    with pytest.raises(ValueError, match="page_table must be int32"):
        tiled_attention(q, k, k, table.long(), lens, None)
    with pytest.raises(ValueError, match="not a multiple"):
        tiled_attention(torch.zeros(2, 3, 16, device=DEVICE), k, k, table, lens, None)
    assert tiled_attention(q[:0], k, k, table[:0], lens[:0], None).shape == (0, 4, 16)


@in_process
def test_prefill_over_pages_gives_each_token_its_decode_bits(dtype=torch.bfloat16):
    """A prompt's token attends exactly as a decode step at its position would, whether its prefix
    was computed in the same forward, passed as a cached prefix, or padded beside a longer prompt."""
    from baton.engine.kernels import prefill_over_pages, tiled_attention

    gen = torch.Generator().manual_seed(7)
    kv_heads, group, head_dim, length = 2, 3, 64, 70
    q = torch.randn(length, kv_heads * group, head_dim, generator=gen).to(dtype).to(DEVICE)
    k = torch.randn(1, kv_heads, length, head_dim, generator=gen).to(dtype).to(DEVICE)
    v = torch.randn(1, kv_heads, length, head_dim, generator=gen).to(dtype).to(DEVICE)
    # decode: each position as the next token of a row over 16-token pages
    k_pages, v_pages, table, _ = paged_kv([length], 16, kv_heads, head_dim, dtype, gen)
    for t in range(length):  # this test's keys and values into the row's shuffled pages
        page, slot = table[0, t // 16].long(), t % 16
        k_pages[page, :, slot], v_pages[page, :, slot] = k[0, :, t], v[0, :, t]
    positions = torch.arange(1, length + 1, dtype=torch.int32, device=DEVICE)  # one decode row per position
    decoded = tiled_attention(q, k_pages, v_pages, table[:1].expand(length, -1).contiguous(), positions, None)
    whole = prefill_over_pages(q, k, v)
    assert torch.equal(whole, decoded)
    for cut in (1, 64):  # a cached prefix of `cut` tokens, the rest computed now
        rest = prefill_over_pages(q[cut:], k[:, :, cut:], v[:, :, cut:], k[0, :, :cut], v[0, :, :cut])
        assert torch.equal(rest, decoded[cut:]), cut
    # beside a longer prompt (this one right-padded with noise it never sees)
    longer_k = torch.randn(1, kv_heads, length + 8, head_dim, generator=gen).to(dtype).to(DEVICE)
    pad = torch.randn(1, kv_heads, 8, head_dim, generator=gen).to(dtype).to(DEVICE)
    ks, vs = torch.cat([torch.cat([k, pad], 2), longer_k]), torch.cat([torch.cat([v, pad], 2), longer_k])
    qs = torch.cat([q, q[:8], q, q[:8]])
    both = prefill_over_pages(qs, ks, vs)
    assert torch.equal(both[:length], decoded)


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


@pytest.mark.skipif(CUDA, reason="with a GPU the benchmark really runs; see baton.bench.decode_attention")
def test_benchmark_says_it_needs_a_gpu(capsys):
    from baton.bench.decode_attention import run

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
