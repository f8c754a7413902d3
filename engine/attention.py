"""Attention for Baton's layouts, registered with transformers' attention interface.

Decode reads the paged KV (`engine.paged_kv`): Triton's paged kernel on CUDA, Baton's C kernel
on CPU (fp32 queries over KV stored in fp32, bf16 or fp16), else each row's pages gathered side
by side for SDPA. The model's own layers call `baton_attention` (the transformers runner); what
it must do comes in a context object passed through the forward call's keyword arguments: each
row's length for a decode step, the cached prefix length for a prefill.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from baton.engine.cpu import kernels as cpu_kernels

ATTENTION_NAME = "baton"
BACKENDS = ("auto", "torch", "triton")


@dataclass
class DecodeAttention:
    """One decode step's rows over paged KV (`engine.paged_kv`): row i attends its tokens
    [0, lengths[i]), token t in page table[i, t // page_size]. Built once per step, read by every layer."""

    table: torch.Tensor  # int64 [rows, width]: each row's pages, padded with the null page 0
    lengths: torch.Tensor  # int64 [rows]
    backend: str
    table32: torch.Tensor | None = None  # triton: the same as int32
    lengths32: torch.Tensor | None = None
    mask: torch.Tensor | None = None  # torch path: bool [rows, 1, 1, width x page_size]
    invariant: bool = False  # triton: the query-tiled kernel prefill shares (one split a row), not split-K
    cu_q: torch.Tensor | None = None  # invariant: int32 [rows + 1], one query a row, made once a step

    @classmethod
    def for_step(cls, table: torch.Tensor, lengths: torch.Tensor, page_size: int, backend: str,
                 invariant: bool = False) -> "DecodeAttention":
        ctx = cls(table, lengths, backend, invariant=invariant)
        if backend == "triton":
            ctx.table32, ctx.lengths32 = table.to(torch.int32), lengths.to(torch.int32)
            if invariant:
                ctx.cu_q = torch.arange(table.shape[0] + 1, dtype=torch.int32, device=table.device)
        else:  # every layer reads the same mask: built once, not per layer
            columns = torch.arange(table.shape[1] * page_size, device=table.device)
            ctx.mask = (columns[None, :] < lengths[:, None])[:, None, None, :]
        return ctx


@dataclass
class PrefillAttention:
    prefix_len: int  # cached prefix columns every new token sees in full
    backend: str


def resolve_backend(name: str, device: torch.device) -> str:
    """Triton on CUDA, the torch path on CPU; 'triton' on CPU runs the kernels in Triton's interpreter
    (TRITON_INTERPRET=1, set before triton is imported), which only tests use."""
    if name not in BACKENDS:
        raise ValueError(f"unknown attention backend {name!r}; choose one of {', '.join(BACKENDS)}")
    if name == "auto":
        return "triton" if device.type == "cuda" and _triton_ready() else "torch"
    if name == "triton" and not _triton_ready():
        raise ValueError("the triton attention backend needs CUDA (or TRITON_INTERPRET=1 set before start); "
                         "use 'torch' on this machine")
    return name


def _triton_ready() -> bool:
    from baton.engine.kernels import triton_available

    return triton_available()


def baton_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, baton=None, **_):
    # query: [B, Hq, Tq, D]; key, value: [B, Hkv, Tk, D] -> out [B, Tq, Hq, D]
    if isinstance(baton, DecodeAttention):  # the transformers runner hands each row's pages side by side
        out = F.scaled_dot_product_attention(query, key, value, attn_mask=baton.mask, scale=scaling, enable_gqa=True)
        out = out.transpose(1, 2)
    elif isinstance(baton, PrefillAttention):
        out = prefill(query, key, value, baton, scaling)
    else:
        raise RuntimeError("baton attention needs a DecodeAttention or PrefillAttention context")
    return out, None


def decode(query, pages, layer: int, ctx: DecodeAttention, scale):
    """One decode step's attention for one layer. query: [R, Hq, D]; pages: the paged KV
    [layers, 2, pages, kv_heads, page_size, head_dim] -> [R, Hq, D]."""
    keys, values = pages[layer, 0], pages[layer, 1]  # [pages, Hkv, P, D]
    if ctx.backend == "triton":
        from baton.engine.kernels import paged_decode_attention, tiled_attention

        if ctx.invariant:  # the kernel prefill runs too: a token's bits whichever phase computed it
            return tiled_attention(query, keys, values, ctx.table32, ctx.lengths32, scale, ctx.cu_q, 1)
        return paged_decode_attention(query, keys, values, ctx.table32, ctx.lengths32, scale)
    if query.dtype == torch.float32 and query.device.type == "cpu" and cpu_kernels.stores(keys.dtype):
        return cpu_kernels.decode_attention(query, keys, values, ctx.table, ctx.lengths, scale)
    keys, values = gathered(keys, ctx.table), gathered(values, ctx.table)
    out = F.scaled_dot_product_attention(query[:, :, None], keys, values, attn_mask=ctx.mask, scale=scale,
                                         enable_gqa=True)
    return out[:, :, 0]


def gathered(pages: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
    """One layer's keys or values [pages, Hkv, P, D] -> each row's pages side by side, a copy:
    [rows, Hkv, width x P, D] (the torch path; columns past a row's length are to be masked)."""
    rows, width = table.shape
    out = pages[table.reshape(-1)]  # [rows * width, Hkv, P, D]
    return out.view(rows, width, *pages.shape[1:]).transpose(1, 2).flatten(2, 3)


def merge(out_a, lse_a, out_b, lse_b):
    """Two attention results over disjoint key sets -> the result over their union (online softmax)."""
    top = torch.maximum(lse_a, lse_b)
    weight_a, weight_b = torch.exp(lse_a - top)[..., None], torch.exp(lse_b - top)[..., None]
    return (out_a * weight_a + out_b * weight_b) / (weight_a + weight_b)


def prefill(query, key, value, ctx: PrefillAttention, scale):
    # query: [B, Hq, Tq, D]; key, value: [B, Hkv, prefix + Tq, D] -> [B, Tq, Hq, D]
    if ctx.backend == "triton" and query.device.type != "cuda":  # Triton's interpreter: tests run the kernel
        from baton.engine.kernels import prefill_attention

        # the kernel takes one sequence: q [Tq, Hq, D], k/v [Hkv, Tk, D]
        return torch.stack([prefill_attention(query[b].transpose(0, 1), key[b], value[b], ctx.prefix_len, scale)
                            for b in range(query.shape[0])])
    # On CUDA torch's flash attention: 4.6x Baton's Triton prefill kernel on an H100 (issue 46)
    if ctx.prefix_len == 0:
        out = F.scaled_dot_product_attention(query, key, value, is_causal=True, scale=scale, enable_gqa=True)
    elif query.device.type == "cuda":  # the mask aligned to the bottom right, without building it
        from torch.nn.attention.bias import causal_lower_right  # imports torch's compiler: not at start

        group = query.shape[1] // key.shape[1]
        mask = causal_lower_right(query.shape[2], key.shape[2])
        out = F.scaled_dot_product_attention(query, key.repeat_interleave(group, 1), value.repeat_interleave(group, 1),
                                             attn_mask=mask, scale=scale)
    else:
        tq, tk = query.shape[2], key.shape[2]
        rows = torch.arange(tq, device=key.device)[:, None] + ctx.prefix_len
        mask = torch.arange(tk, device=key.device)[None, :] <= rows  # [Tq, Tk]
        out = F.scaled_dot_product_attention(query, key, value, attn_mask=mask, scale=scale, enable_gqa=True)
    return out.transpose(1, 2)


def prefill_continued(query, key, value, prefix_k, prefix_v, backend: str, scale):
    """Prefill attention of prompts that all continue one prefix held once (a BatchLLM group):
    every new token sees the whole prefix and, causally, its own prompt's new tokens. Nothing is
    copied per prompt: the prefix part runs once for every query of the batch, then merges with
    each prompt's own part by log-sum-exp (on Triton, one kernel does both in one online softmax).
    query: [B, Hq, T, D]; key, value: [B, Hkv, T, D]; prefix_k, prefix_v: [Hkv, P, D] -> [B, T, Hq, D]"""
    b, hq, t, d = query.shape
    hkv = key.shape[1]
    if backend == "triton":
        from baton.engine.kernels import prefill_attention_varlen

        # the varlen layout: q [B * T, Hq, D], k/v [Hkv, B * T, D], one sequence per prompt
        cu = torch.arange(0, (b + 1) * t, t, dtype=torch.int32, device=query.device)
        out = prefill_attention_varlen(query.transpose(1, 2).reshape(b * t, hq, d),
                                       key.transpose(0, 1).reshape(hkv, b * t, d),
                                       value.transpose(0, 1).reshape(hkv, b * t, d), cu, cu, scale, t,
                                       shared_k=prefix_k, shared_v=prefix_v)
        return out.view(b, t, hq, d)
    group = hq // hkv
    # own part: causal over the prompt's new tokens (their KV is small next to the prefix: expanded per head)
    own_k = key[:, :, None].expand(b, hkv, group, t, d).reshape(b, hq, t, d)
    own_v = value[:, :, None].expand(b, hkv, group, t, d).reshape(b, hq, t, d)
    own, own_lse = _attention_with_lse(query, own_k, own_v, causal=True, scale=scale)  # [B, Hq, T, D], [B, Hq, T]
    # prefix part: per KV head, every query of the batch as one matrix against the prefix
    q = query.reshape(b, hkv, group * t, d).transpose(0, 1).reshape(1, hkv, b * group * t, d)
    shared, shared_lse = _attention_with_lse(q, prefix_k[None], prefix_v[None], causal=False, scale=scale)
    shared = shared[0].view(hkv, b, group * t, d).transpose(0, 1).reshape(b, hq, t, d)
    shared_lse = shared_lse[0].view(hkv, b, group * t).transpose(0, 1).reshape(b, hq, t)
    out = merge(own.float(), own_lse, shared.float(), shared_lse)
    return out.to(query.dtype).transpose(1, 2)


def _attention_with_lse(query, key, value, causal: bool, scale):
    """Attention and its log-sum-exp (natural log, float32): query [N, H, Tq, D]; key, value
    [N, H, Tk, D] -> [N, H, Tq, D], [N, H, Tq]. `causal` aligns the mask to the top left (Tq == Tk)."""
    if query.device.type == "cpu":  # torch's flash kernel for CPU tiles the scores and returns the LSE
        return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(query, key, value, 0.0, causal, scale=scale)
    scores = torch.matmul(query.float(), key.float().transpose(-1, -2)) * scale
    if causal:
        tq, tk = scores.shape[-2:]
        scores = scores.masked_fill(torch.ones(tq, tk, dtype=torch.bool, device=scores.device).triu(1), float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)
    return torch.matmul(torch.exp(scores - lse[..., None]), value.float()), lse


def register() -> None:
    from transformers import AttentionInterface

    AttentionInterface.register(ATTENTION_NAME, baton_attention)
