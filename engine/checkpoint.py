"""A Llama-family checkpoint read straight from its files, as serving engines load one: the config
from config.json, each safetensors tensor read onto the device in the dtype served, and a
fingerprint from the files' headers and a sample of their bytes. No `transformers` model classes:
importing them costs a worker seconds at every start (they pull in torch's compiler and
distributed packages), and Baton's executor needs only the tensors.

What this reader cannot take exactly as `transformers` would (another architecture, a RoPE variant
without its formula here, weights in another format) says why, and the worker loads through
`transformers` instead (`engine.model.load_model`)."""
from __future__ import annotations

import hashlib
import json
import math
import struct
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace

import torch

ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM")
# transformers' defaults for the fields Baton reads, where config.json leaves them out
_DEFAULTS = dict(rms_norm_eps=1e-6, tie_word_embeddings=False, hidden_act="silu", mlp_bias=False,
                 attention_bias=False, sliding_window=None, use_sliding_window=False, head_dim=None)
_DEFAULT_THETA = 10_000.0
ROPE_TYPES = ("default", "linear", "llama3")  # the ones whose inverse frequencies are computed here
SAMPLES_PER_FILE, SAMPLE_BYTES = 16, 4096


def read_config(path: Path) -> SimpleNamespace:
    """config.json as attributes, with transformers' defaults for what Baton reads and it leaves out."""
    raw = json.loads((path / "config.json").read_text())
    cfg = SimpleNamespace(**{**_DEFAULTS, **raw})
    if cfg.head_dim is None:
        cfg.head_dim = cfg.hidden_size // cfg.num_attention_heads
    if getattr(cfg, "num_key_value_heads", None) is None:
        cfg.num_key_value_heads = cfg.num_attention_heads
    return cfg


def rope_parameters(cfg) -> dict:
    """RoPE's type, base and scaling from either config format: v5's `rope_parameters`, or the
    older `rope_theta` beside `rope_scaling`."""
    params = dict(getattr(cfg, "rope_parameters", None) or getattr(cfg, "rope_scaling", None) or {})
    params.setdefault("rope_type", params.get("type", "default"))
    params.setdefault("rope_theta", getattr(cfg, "rope_theta", None) or _DEFAULT_THETA)
    return params


def rope_computed_here(params: dict) -> bool:
    """Whether rotary_tables computes this RoPE (its type, on the whole head)."""
    return params["rope_type"] in ROPE_TYPES and params.get("partial_rotary_factor", 1.0) == 1.0


def rotary_tables(cfg, max_context: int, device: torch.device, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin: [max_context, head_dim], the same bits as transformers' rotary module gives (its
    formulas, its fp32 arithmetic, its cast last; the frequencies computed on the CPU, as it does)."""
    params = rope_parameters(cfg)
    kind, base = params["rope_type"], params["rope_theta"]
    if not rope_computed_here(params):
        raise ValueError(f"RoPE {kind!r} is not computed here")
    dim = cfg.head_dim
    inv_freq = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    if kind == "linear":
        inv_freq /= params["factor"]
    elif kind == "llama3":
        inv_freq = _llama3_frequencies(inv_freq, params, cfg)
    positions = torch.arange(max_context, device=device)
    freqs = positions[..., None].float() * inv_freq.to(device)
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos().to(dtype), emb.sin().to(dtype)


def _llama3_frequencies(inv_freq: torch.Tensor, params: dict, cfg) -> torch.Tensor:
    """Llama 3.1's wavelength-dependent scaling, as its reference computes it."""
    factor, low, high = params["factor"], params["low_freq_factor"], params["high_freq_factor"]
    old_context = params.get("original_max_position_embeddings", cfg.max_position_embeddings)
    low_wavelen, high_wavelen = old_context / low, old_context / high
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_context / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = ~(wavelen < high_wavelen) * ~(wavelen > low_wavelen)
    return torch.where(medium, smoothed, scaled)


def weight_files(path: Path) -> list[Path]:
    """The safetensors files of a directory, sharded (an index names them) or not."""
    index = path / "model.safetensors.index.json"
    if index.is_file():
        names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        return [path / name for name in names]
    return sorted(path.glob("*.safetensors"))


def unreadable_reason(path: Path) -> str | None:
    """Why this reader cannot load the directory as transformers would (None: it can)."""
    cfg = read_config(path)
    arch = (getattr(cfg, "architectures", None) or ["?"])[0]
    if arch not in ARCHITECTURES:
        return f"architecture {arch}"
    if getattr(cfg, "quantization_config", None) and not stored_fp8(cfg):
        return "quantized weights"
    params = rope_parameters(cfg)
    if not rope_computed_here(params):
        return f"RoPE {params['rope_type']!r}"
    if not weight_files(path):
        return "no safetensors files"
    return None


def stored_fp8(cfg) -> bool:
    """Whether the checkpoint holds vLLM's fp8 layout, which this reader takes: e4m3 projection
    weights, each with a scale per tensor or per output feature (quant_method 'fp8' without
    weight_block_size; block-wise scales are not read here)."""
    q = getattr(cfg, "quantization_config", None)
    if not q:
        return False
    q = q if isinstance(q, dict) else q.to_dict()
    return q.get("quant_method") == "fp8" and not q.get("weight_block_size")


def read_weights(path: Path, dtype: torch.dtype, device: torch.device,
                 progress: Callable[[int], None] = lambda nbytes: None,
                 rows: Callable[[str], tuple[int, int] | None] | None = None) -> dict[str, torch.Tensor]:
    """Every tensor by its checkpoint name, read file by file straight onto `device` and cast
    there: on a GPU no full copy of the weights passes through host memory. progress(n) is told
    the bytes of each tensor read (out of weight_bytes(path), about). rows(name): the [start,
    stop) rows of that tensor to read (None: all), for a tensor-parallel rank (`engine.shard`)."""
    from safetensors import safe_open

    target = "cpu" if device.type == "cpu" else str(device)
    tensors = {}
    for file in weight_files(path):
        with safe_open(file, framework="pt", device=target) as f:
            for name in f.keys():
                span = rows(name) if rows is not None else None
                if span is not None and len(f.get_slice(name).get_shape()) == 0:
                    span = None  # a scale per tensor: every rank's
                tensor = f.get_tensor(name) if span is None else f.get_slice(name)[span[0]:span[1]]
                progress(tensor.nbytes)
                # fp8 codes and their scales as stored (engine.fp8.from_checkpoint); the rest in dtype
                keep = tensor.dtype == torch.float8_e4m3fn or name.endswith(("_scale", "_scale_inv"))
                tensors[name] = tensor if keep else tensor.to(dtype)
    return tensors


def weight_bytes(path: Path) -> int:
    """The bytes of the checkpoint's weight files (their headers a rounding error)."""
    return sum(file.stat().st_size for file in weight_files(path))


def fingerprint(path: Path) -> str:
    """Identifies a checkpoint's weights without reading them all: config.json, each file's
    header (every tensor's name, dtype, shape and offsets), its size and SAMPLES_PER_FILE windows
    of its bytes. Copies of the same files agree on any host; other weights differ in their
    header or in the sampled bytes (of random or trained weights alike)."""
    digest = hashlib.blake2b(digest_size=12)
    digest.update((path / "config.json").read_bytes())
    for file in weight_files(path):
        size = file.stat().st_size
        with open(file, "rb") as f:
            (header_len,) = struct.unpack("<Q", f.read(8))
            digest.update(f.read(header_len))
            digest.update(size.to_bytes(8, "little"))
            _sample(f, 8 + header_len, size - 8 - header_len, digest)
    return digest.hexdigest()


def file_fingerprint(file: Path) -> str:
    """One weights file (a GGUF) identified as `fingerprint` identifies a directory: its size and
    SAMPLES_PER_FILE windows of its bytes, its header among them."""
    digest = hashlib.blake2b(digest_size=12)
    size = file.stat().st_size
    digest.update(size.to_bytes(8, "little"))
    with open(file, "rb") as f:
        _sample(f, 0, size, digest)
    return digest.hexdigest()


def _sample(f, start: int, length: int, digest) -> None:
    """SAMPLES_PER_FILE windows of SAMPLE_BYTES, evenly spread over [start, start + length), into digest."""
    for i in range(SAMPLES_PER_FILE):
        f.seek(start + length * i // SAMPLES_PER_FILE)
        digest.update(f.read(SAMPLE_BYTES))
