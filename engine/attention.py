"""Attention over the BATON layout, registered with transformers' attention interface.

The model's own layers call `baton_attention`; what it must do comes in a context object
passed through the forward call's keyword arguments: per-row start columns for a decode step,
the cached prefix length for a prefill.
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
    starts: torch.Tensor  # int32 [rows]: first valid window column per row
    backend: str
    mask: torch.Tensor | None = None  # torch backend: bool [rows, 1, 1, window], built once per step
    starts64: torch.Tensor | None = None  # torch backend on CPU: int64 starts for Baton's C kernel
    group_of_row: torch.Tensor | None = None  # triton backend with shared prefixes: built once per step

    @classmethod
    def for_window(cls, starts: torch.Tensor, window: int, backend: str) -> "DecodeAttention":
        mask = starts64 = None
        if backend == "torch":  # every layer reads the same mask: build it once, not per layer
            columns = torch.arange(window, device=starts.device)
            mask = (columns[None, :] >= starts[:, None])[:, None, None, :]
            if starts.device.type == "cpu":
                starts64 = starts.to(torch.int64)
        return cls(starts, backend, mask, starts64)


@dataclass
class SharedPrefix:
    """Rows of a decode step that continue one shared prefix (`engine.batch_kv`): their queries
    attend to its KV once, together, and the result merges into each row's own part."""

    rows: torch.Tensor  # int64 [m]: batch rows continuing the prefix
    kv: torch.Tensor  # [layers, 2, kv_heads, prefix tokens, head_dim]


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
    if isinstance(baton, DecodeAttention):
        out = decode(query, key, value, baton, scaling)
    elif isinstance(baton, PrefillAttention):
        out = prefill(query, key, value, baton, scaling)
    else:
        raise RuntimeError("baton attention needs a DecodeAttention or PrefillAttention context")
    return out, None


def decode(query, key, value, ctx: DecodeAttention, scale):
    # query: [B, Hq, 1, D]; key, value: [B, Hkv, window, D] -> [B, 1, Hq, D]
    if ctx.backend == "triton":
        from baton.engine.kernels import decode_attention

        out = decode_attention(query[:, :, 0], key, value, ctx.starts, scale)  # [B, Hq, D]
        return out.unsqueeze(1)
    if ctx.starts64 is not None and query.dtype == torch.float32 and cpu_kernels.available():
        # Baton's C kernel skips each row's padding columns instead of masking them
        return cpu_kernels.decode_attention(query[:, :, 0], key, value, ctx.starts64, scale).unsqueeze(1)
    # ctx.mask: [B, 1, 1, window], built by for_window for the batch's whole window (the keys here)
    out = F.scaled_dot_product_attention(query, key, value, attn_mask=ctx.mask, scale=scale, enable_gqa=True)
    return out.transpose(1, 2)


def decode_ranges(query, key, value, starts, ends, backend: str, scale):
    """Decode attention where row i attends columns [starts[i], ends[i]) of key and value, both
    given as device tensors, so a captured CUDA graph replays it with each step's values.
    query: [B, Hq, D]; key, value: [B, Hkv, columns, D]; starts, ends: int32 [B] -> [B, Hq, D]"""
    if backend == "triton":
        from baton.engine.kernels import decode_attention

        return decode_attention(query, key, value, starts, scale, ends=ends)
    columns = torch.arange(key.shape[2], device=key.device)
    mask = ((columns >= starts[:, None]) & (columns < ends[:, None]))[:, None, None, :]
    out = F.scaled_dot_product_attention(query[:, :, None], key, value, attn_mask=mask, scale=scale, enable_gqa=True)
    return out[:, :, 0]


def decode_shared(query, key, value, ctx: DecodeAttention, scale, prefixes: list[SharedPrefix], layer: int):
    """Decode attention where some rows continue a shared prefix held once: each row's own window
    part, then each prefix's part for all of its rows in one matmul, merged by log-sum-exp (the
    same maths as one softmax over prefix and window together).
    query: [B, Hq, 1, D]; key, value: [B, Hkv, window, D] -> [B, 1, Hq, D]"""
    if ctx.backend == "triton":
        return _decode_shared_triton(query, key, value, ctx, scale, prefixes, layer)
    out, lse = _window_with_lse(query[:, :, 0], key, value, ctx, scale)  # [B, Hq, D], [B, Hq]
    for prefix in prefixes:
        rows = prefix.rows
        shared_out, shared_lse = prefix_attention(query[rows, :, 0], prefix.kv[layer, 0], prefix.kv[layer, 1], scale)
        out[rows] = merge(out[rows], lse[rows], shared_out, shared_lse)
    return out.to(query.dtype).unsqueeze(1)


def _decode_shared_triton(query, key, value, ctx: DecodeAttention, scale, prefixes: list[SharedPrefix], layer: int):
    """The fused prefix-shared kernel: every prefix's rows and every row's window in one launch.
    One prefix is passed as a view; several are padded to the longest into one tensor per layer."""
    from baton.engine.kernels import prefix_shared_decode_attention

    if ctx.group_of_row is None:
        ctx.group_of_row = torch.full((query.shape[0],), -1, dtype=torch.int32, device=query.device)
        for index, prefix in enumerate(prefixes):
            ctx.group_of_row[prefix.rows] = index
    lengths = [prefix.kv.shape[3] for prefix in prefixes]
    if len(prefixes) == 1:
        prefix_k, prefix_v = prefixes[0].kv[layer, 0][None], prefixes[0].kv[layer, 1][None]
    else:
        top = max(lengths)
        prefix_k, prefix_v = (torch.stack([F.pad(p.kv[layer, kind], (0, 0, 0, top - n)) for p, n in zip(prefixes, lengths)])
                              for kind in (0, 1))
    out = prefix_shared_decode_attention(
        query[:, :, 0], prefix_k, prefix_v, key, value, ctx.starts, ctx.group_of_row,
        torch.tensor(lengths, dtype=torch.int32, device=query.device), scale,
        max_group_rows=max(prefix.rows.numel() for prefix in prefixes))
    return out.unsqueeze(1)


def prefix_attention(query, key, value, scale):
    """Queries of several rows against one sequence's KV, no mask: query [m, Hq, D]; key, value
    [Hkv, P, D] -> out [m, Hq, D] and log-sum-exp [m, Hq], float32. The rows' queries of one KV
    head form one matrix, so the prefix is read once for all of them."""
    m, hq, d = query.shape
    hkv = key.shape[0]
    q = query.float().view(m, hkv, hq // hkv, d).transpose(0, 1).reshape(hkv, -1, d)  # [Hkv, m * group, D]
    scores = torch.bmm(q, key.float().transpose(1, 2)) * scale  # [Hkv, m * group, P]
    lse = torch.logsumexp(scores, dim=-1)
    out = torch.bmm(torch.exp(scores - lse[..., None]), value.float())  # [Hkv, m * group, D]
    return (out.view(hkv, m, hq // hkv, d).transpose(0, 1).reshape(m, hq, d),
            lse.view(hkv, m, hq // hkv).transpose(0, 1).reshape(m, hq))


def merge(out_a, lse_a, out_b, lse_b):
    """Two attention results over disjoint key sets -> the result over their union (online softmax)."""
    top = torch.maximum(lse_a, lse_b)
    weight_a, weight_b = torch.exp(lse_a - top)[..., None], torch.exp(lse_b - top)[..., None]
    return (out_a * weight_a + out_b * weight_b) / (weight_a + weight_b)


def _window_with_lse(query, key, value, ctx: DecodeAttention, scale):
    """The own-window part of decode attention with its log-sum-exp: query [B, Hq, D]; key, value
    [B, Hkv, window, D] -> out [B, Hq, D], lse [B, Hq], float32."""
    rows, hq, d = query.shape
    if ctx.starts64 is not None and query.dtype == torch.float32 and cpu_kernels.available():
        lse = torch.empty(rows, hq, dtype=torch.float32)
        return cpu_kernels.decode_attention(query, key, value, ctx.starts64, scale, lse=lse), lse
    hkv = key.shape[1]
    q = query.float().view(rows, hkv, hq // hkv, d)
    scores = torch.matmul(q, key.float().transpose(-1, -2)) * scale  # [B, Hkv, group, window]
    scores = scores.masked_fill(~ctx.mask, float("-inf"))  # ctx.mask: [B, 1, 1, window], the torch backend's
    lse = torch.logsumexp(scores, dim=-1)
    out = torch.matmul(torch.exp(scores - lse[..., None]), value.float())
    return out.view(rows, hq, d), lse.view(rows, hq)


def prefill(query, key, value, ctx: PrefillAttention, scale):
    # query: [B, Hq, Tq, D]; key, value: [B, Hkv, prefix + Tq, D] -> [B, Tq, Hq, D]
    if ctx.backend == "triton":
        from baton.engine.kernels import prefill_attention

        # the kernel takes one sequence: q [Tq, Hq, D], k/v [Hkv, Tk, D]
        return torch.stack([prefill_attention(query[b].transpose(0, 1), key[b], value[b], ctx.prefix_len, scale)
                            for b in range(query.shape[0])])
    if ctx.prefix_len == 0:
        out = F.scaled_dot_product_attention(query, key, value, is_causal=True, scale=scale, enable_gqa=True)
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
