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


def register() -> None:
    from transformers import AttentionInterface

    AttentionInterface.register(ATTENTION_NAME, baton_attention)
