"""Attention kernels for Baton's KV layouts, with torch references.

- `paged_decode_attention`: split-K grouped-query decode over a paged KV pool, each row's
  tokens found through its page table (read on the device, so captured graphs replay). Rows
  continuing one prefix share its pages: a shared page is just in several page tables.
- `prefill_attention` / `prefill_attention_varlen`: causal attention of new tokens over a
  cached prefix plus themselves (chunked prefill, prefix reuse), optionally after a prefix that
  a batch group's prompts all continue, passed once.
- `tiled_attention`: causal attention of each sequence's newest tokens over its paged KV, a
  program per tile of query tokens; decode (one query a sequence) and prefill
  (`prefill_over_pages`, a prompt's tokens) run the same compiled kernel, so a token's bits do
  not depend on which computed it. With `invariant_linear` / `invariant_rms_norm` (fixed-order
  GEMM and norm), on CUDA in bf16/fp16 these make a request's tokens independent of its batch
  (`engine.llama`), with `rotary_kv` and `silu_mul`, a layer's elementwise steps fused.
- `reference`: the same contracts in plain torch (CPU path and test oracle).

The Triton modules are imported lazily, on first use of a kernel name, because
`triton.jit` decides at decoration time whether a kernel is interpreted: importing this
package (for `triton_available` or the references) must not fix that choice before a test
sets TRITON_INTERPRET=1.
"""
from __future__ import annotations

import importlib
import os

from baton.engine.kernels.reference import (paged_decode_attention_ref, prefill_attention_ref,
                                            prefill_attention_varlen_ref)

_LAZY = {
    "paged_decode_attention": ("baton.engine.kernels.paged", "paged_decode_attention"),
    "prefill_attention": ("baton.engine.kernels.prefill", "prefill_attention"),
    "prefill_attention_varlen": ("baton.engine.kernels.prefill", "prefill_attention_varlen"),
    "tiled_attention": ("baton.engine.kernels.tiled", "tiled_attention"),
    "prefill_over_pages": ("baton.engine.kernels.tiled", "prefill_over_pages"),
    "invariant_linear": ("baton.engine.kernels.invariant", "linear"),
    "invariant_rms_norm": ("baton.engine.kernels.invariant", "rms_norm"),
    "invariant_fp8_linear": ("baton.engine.kernels.invariant", "fp8_linear"),
    "rotary_kv": ("baton.engine.kernels.fused", "rotary_kv"),
    "silu_mul": ("baton.engine.kernels.fused", "silu_mul"),
}

__all__ = [*_LAZY, "triton_available", "paged_decode_attention_ref", "prefill_attention_ref",
           "prefill_attention_varlen_ref"]


def triton_available() -> bool:
    """True when the Triton kernels can run here: triton imports and CUDA is present, or the
    interpreter is requested with TRITON_INTERPRET=1."""
    try:
        import triton  # noqa: F401
    except Exception:  # a broken install is as good as none for backend selection
        return False
    if os.environ.get("TRITON_INTERPRET", "").lower() in ("1", "true", "on", "yes"):
        return True
    import torch

    return torch.cuda.is_available()


def __getattr__(name: str):
    if name not in _LAZY:
        raise AttributeError(f"module 'baton.engine.kernels' has no attribute {name!r}")
    module, attribute = _LAZY[name]
    return getattr(importlib.import_module(module), attribute)
