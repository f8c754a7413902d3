"""A Llama-family GGUF file's weights by their Hugging Face names, quantized ones kept as their
blocks (`model.quantization: gguf`): Q8_0, Q4_0 and Q4_1 exactly as stored, Q4_K as its 32-weight
blocks (engine.quantized.from_q4_k); another quantized type (Q6_K, Q5_K, ...) dequantized and made
Q8_0, said once in the log; float tensors in the dtype
served. Queries' and keys' rows are put back in Hugging Face's order (llama.cpp's converter
interleaves each head's halves for its rotary), as transformers' GGUF loader does."""
from __future__ import annotations

import logging
import re
from pathlib import Path

import numpy as np
import torch

from baton.engine.quantized import FORMATS, BlockWeight, from_q4_k, quantize_q8_0

log = logging.getLogger(__name__)

_GLOBAL = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
_LAYER = {"attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
          "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
          "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
          "ffn_down": "mlp.down_proj"}
_SKIPPED = {"rope_freqs"}  # Llama 3's RoPE factors: computed from the config (engine.checkpoint)


def hf_name(name: str) -> str | None:
    """'blk.3.attn_q.weight' -> 'model.layers.3.self_attn.q_proj.weight' (None: not a weight Baton reads)."""
    stem, _, kind = name.rpartition(".")
    match = re.fullmatch(r"blk\.(\d+)\.(\w+)", stem)
    if match and match.group(2) in _LAYER:
        return f"model.layers.{match.group(1)}.{_LAYER[match.group(2)]}.{kind}"
    if stem in _GLOBAL:
        return f"{_GLOBAL[stem]}.{kind}"
    if stem in _SKIPPED:
        return None
    raise ValueError(f"the GGUF tensor {name!r} is not one of a Llama-family model's")


def _hf_rows(rows: int, heads: int) -> torch.Tensor:
    """The GGUF row of each Hugging Face row of a query or key projection (transformers' reverse permute)."""
    half = rows // heads // 2
    return torch.arange(rows).reshape(heads, half, 2).transpose(1, 2).reshape(rows)


def read_gguf(path: Path, cfg, dtype: torch.dtype, progress=lambda nbytes: None) -> dict[str, torch.Tensor | BlockWeight]:
    import gguf

    reader = gguf.GGUFReader(path)
    field = reader.get_field("general.architecture")
    architecture = field.contents() if field is not None else "?"
    if architecture != "llama":
        raise ValueError(f"{path.name} holds a {architecture!r} model; quantization 'gguf' reads Llama GGUF files "
                         "(for another model, quantize its safetensors at load with 'int8')")
    requantized, weights = [], {}
    for tensor in reader.tensors:
        name = hf_name(tensor.name)
        if name is None:
            continue
        kind = tensor.tensor_type.name.lower()
        raw = np.asarray(tensor.data)
        progress(raw.nbytes)
        if kind in FORMATS:
            rows, width = torch.from_numpy(raw.copy()).reshape(raw.shape[0], -1), int(tensor.shape[0])
            weight = from_q4_k(rows, width) if kind == "q4_k" else BlockWeight(kind, rows, width)
        elif kind in ("f32", "f16", "bf16"):
            values = torch.from_numpy(raw.copy())
            if kind == "bf16":
                values = values.view(torch.bfloat16)
            weight = values.to(dtype)
        else:  # a type without a kernel here: its values, as 8-bit blocks
            values = torch.from_numpy(gguf.quants.dequantize(raw, tensor.tensor_type).copy()).float()
            weight = quantize_q8_0(values.reshape(values.shape[0], -1)) if values.dim() == 2 else values.to(dtype)
            requantized.append(f"{tensor.name} ({kind})")
        if name.endswith(("q_proj.weight", "k_proj.weight")):
            heads = cfg.num_attention_heads if ".q_proj" in name else cfg.num_key_value_heads
            order = _hf_rows(weight.shape[0], heads)
            weight = weight.rows(order) if isinstance(weight, BlockWeight) else weight[order].contiguous()
        weights[name] = weight
    if requantized:
        log.warning("%s: %d tensors in types without a kernel here run as Q8_0 of their values: %s", path.name,
                    len(requantized), ", ".join(requantized[:4]) + (" ..." if len(requantized) > 4 else ""))
    return weights
