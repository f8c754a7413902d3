"""Plain torch references for the Triton kernels: fp32 masked softmax, obviously correct.

They take and return exactly what the kernels do and run on any device; tests compare the
kernels against them. No triton import here, so they work where triton is absent.
"""
from __future__ import annotations

import torch


def _attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, visible: torch.Tensor, scale: float) -> torch.Tensor:
    """q: [..., H, Tq, D]; k, v: [..., Hkv, Tk, D]; visible: bool broadcastable to [..., H, Tq, Tk].

    Rows that see no column get zeros (not NaN).
    """
    group = q.shape[-3] // k.shape[-3]
    k = k.float().repeat_interleave(group, dim=-3)
    v = v.float().repeat_interleave(group, dim=-3)
    scores = (q.float() @ k.transpose(-1, -2)) * scale
    scores = scores.masked_fill(~visible, float("-inf"))
    probs = torch.softmax(scores, dim=-1).nan_to_num(0.0)  # all -inf rows -> NaN -> 0
    return probs @ v


def paged_decode_attention_ref(q: torch.Tensor, k_pages: torch.Tensor, v_pages: torch.Tensor,
                               page_table: torch.Tensor, lengths: torch.Tensor, scale: float | None) -> torch.Tensor:
    """q: [R, H, D]; k_pages, v_pages: [num_pages, Hkv, P, D]; page_table: int [R, max_pages];
    row r sees tokens [0, min(lengths[r], max_pages * P)), token t at page page_table[r, t // P],
    slot t % P -> [R, H, D]."""
    rows, _, head_dim = q.shape
    _, kv_heads, page_size, _ = k_pages.shape
    scale = head_dim ** -0.5 if scale is None else scale
    lengths = lengths.to(q.device).long().clamp(0, page_table.shape[1] * page_size)
    used = -(-int(lengths.max()) // page_size) if rows else 0  # only the pages the longest row uses
    pages = page_table[:, :used].to(k_pages.device).long()  # [R, used]
    visible = torch.arange(used * page_size, device=q.device)[None, :] < lengths[:, None]  # [R, used * P]

    def gather(pool: torch.Tensor) -> torch.Tensor:
        # [R, used, Hkv, P, D] -> [R, Hkv, used * P, D]; columns past a row's length (the null
        # page, stale slots) are zeroed so whatever they hold cannot leak in as NaN * 0
        kv = pool[pages].transpose(1, 2).reshape(rows, kv_heads, used * page_size, head_dim).float()
        return kv.masked_fill(~visible[:, None, :, None], 0.0)

    out = _attend(q[:, :, None, :], gather(k_pages), gather(v_pages), visible[:, None, None, :], scale)
    return out[:, :, 0].to(q.dtype)


def prefill_attention_ref(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, prefix_len: int,
                          scale: float) -> torch.Tensor:
    """q: [T, H, D]; k, v: [Hkv, prefix_len + T, D]; token j sees columns [0, prefix_len + j]."""
    num_new = q.shape[0]
    rows = torch.arange(num_new, device=k.device)[:, None] + prefix_len
    visible = torch.arange(k.shape[1], device=k.device)[None, :] <= rows  # [T, Tk]
    out = _attend(q.transpose(0, 1), k, v, visible, scale)  # [H, T, D]
    return out.transpose(0, 1).to(q.dtype)


def prefill_attention_varlen_ref(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens_q: torch.Tensor,
                                 cu_seqlens_k: torch.Tensor, scale: float, shared_k: torch.Tensor | None = None,
                                 shared_v: torch.Tensor | None = None) -> torch.Tensor:
    """Packed batch: sequence s owns q rows cu_q[s]:cu_q[s+1] and k/v columns cu_k[s]:cu_k[s+1],
    after the shared prefix shared_k/shared_v [Hkv, P, D] if given (copied here, as the kernel does not)."""
    out = torch.empty_like(q)
    cu_q, cu_k = cu_seqlens_q.tolist(), cu_seqlens_k.tolist()
    for s in range(len(cu_q) - 1):
        q0, q1, k0, k1 = cu_q[s], cu_q[s + 1], cu_k[s], cu_k[s + 1]
        keys, values = k[:, k0:k1], v[:, k0:k1]
        if shared_k is not None:
            keys, values = torch.cat([shared_k, keys], dim=1), torch.cat([shared_v, values], dim=1)
        prefix_len = keys.shape[1] - (q1 - q0)
        out[q0:q1] = prefill_attention_ref(q[q0:q1], keys, values, prefix_len, scale)
    return out

