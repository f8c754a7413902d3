"""engine.checkpoint: a Llama-family checkpoint read straight from its files (what workers do) gives
Baton's executor the same bits as the model transformers loads, and a fingerprint from the files."""
from __future__ import annotations

import json
import shutil
import subprocess
import sys
import textwrap

import pytest
import torch

from baton.config import ModelSettings
from baton.engine import checkpoint
from baton.engine.executors import load_runner, make_runner
from baton.engine.llama import LlamaRunner
from baton.engine.model import default_tokenizer, load_model, tiny_model_dir, tiny_random_model
from baton.engine.runner import TransformersRunner


def test_a_checkpoint_read_without_transformers_serves_the_same_bits(tiny_model):
    read = load_model("tiny-random", dtype="float32", module=False)
    assert read.model is None and read.fingerprint == tiny_model.fingerprint
    assert read.kv_shape == tiny_model.kv_shape and read.eos_token_ids == tiny_model.eos_token_ids
    assert set(read.tensors) == set(tiny_model.tensors) - {"lm_head.weight"}  # tied: saved once
    for name, tensor in read.tensors.items():
        assert torch.equal(tensor, tiny_model.tensors[name]), name
    fast, reference = make_runner(read), LlamaRunner(tiny_model)
    assert torch.equal(fast.cos, reference.cos) and torch.equal(fast.sin, reference.sin)
    prompt = list(range(7, 90))
    a, b = fast.prefill(prompt), reference.prefill(prompt)
    assert torch.equal(a.logits, b.logits) and torch.equal(a.kv.data, b.kv.data)


def test_a_sharded_checkpoint_reads_every_shard(tmp_path, tiny_model):
    tiny_random_model(0).save_pretrained(tmp_path, max_shard_size="2MB")
    assert (tmp_path / "model.safetensors.index.json").is_file() and len(checkpoint.weight_files(tmp_path)) == 2
    read = []
    tensors = checkpoint.read_weights(tmp_path, torch.bfloat16, torch.device("cpu"), read.append)
    assert set(tensors) == set(tiny_model.tensors) - {"lm_head.weight"}
    # progress is told every tensor's bytes: all of the files but their headers
    assert len(read) == len(tensors) and 0.99 < sum(read) / checkpoint.weight_bytes(tmp_path) <= 1
    for name, tensor in tensors.items():
        assert tensor.dtype == torch.bfloat16 and torch.equal(tensor, tiny_model.tensors[name].to(torch.bfloat16))


ROPES = {
    "default": {"rope_parameters": {"rope_type": "default", "rope_theta": 500000.0}},
    "linear": {"rope_parameters": {"rope_type": "linear", "rope_theta": 10000.0, "factor": 4.0}},
    "llama3": {"rope_parameters": {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
                                   "high_freq_factor": 4.0, "original_max_position_embeddings": 64}},
    "llama3, the older rope_scaling": {"rope_theta": 500000.0, "rope_scaling": {
        "type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 64}},
    "no theta given": {},
}


@pytest.mark.parametrize("rope", ROPES, ids=list(ROPES))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_rotary_tables_are_transformers_own(tmp_path, rope, dtype):
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    raw = dict(architectures=["LlamaForCausalLM"], hidden_size=256, num_attention_heads=2, num_hidden_layers=1,
               intermediate_size=64, vocab_size=128, max_position_embeddings=512, **ROPES[rope])
    (tmp_path / "config.json").write_text(json.dumps(raw))
    theirs = LlamaRotaryEmbedding(LlamaConfig.from_pretrained(tmp_path))
    cos, sin = theirs(torch.zeros(1, dtype=dtype), torch.arange(512)[None])
    ours = checkpoint.rotary_tables(checkpoint.read_config(tmp_path), 512, torch.device("cpu"), dtype)
    assert torch.equal(ours[0], cos[0]) and torch.equal(ours[1], sin[0])


def test_the_fingerprint_follows_the_weights_not_the_copy(tmp_path):
    original = tiny_model_dir(0)
    copy = tmp_path / "copy"
    shutil.copytree(original, copy)
    assert checkpoint.fingerprint(copy) == checkpoint.fingerprint(original)
    assert checkpoint.fingerprint(tiny_model_dir(1)) != checkpoint.fingerprint(original)
    # a weight changed where the sample reads
    file = checkpoint.weight_files(copy)[0]
    data = bytearray(file.read_bytes())
    header = 8 + int.from_bytes(data[:8], "little")
    at = header + (len(data) - header) * 5 // checkpoint.SAMPLES_PER_FILE
    data[at] ^= 0xFF
    file.write_bytes(bytes(data))
    assert checkpoint.fingerprint(copy) != checkpoint.fingerprint(original)


def test_what_the_reader_cannot_take_loads_through_transformers(tmp_path, caplog):
    shutil.copytree(tiny_model_dir(0), tmp_path / "yarn")
    config = json.loads((tmp_path / "yarn" / "config.json").read_text())
    config["rope_parameters"] = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 2.0,
                                 "original_max_position_embeddings": 1024}
    (tmp_path / "yarn" / "config.json").write_text(json.dumps(config))
    default_tokenizer().save_pretrained(tmp_path / "yarn")
    assert checkpoint.unreadable_reason(tmp_path / "yarn") == "RoPE 'yarn'"
    loaded = load_model(str(tmp_path / "yarn"), dtype="float32", module=False)
    assert loaded.model is not None  # read through transformers, whose module computes YaRN's tables
    assert isinstance(make_runner(loaded), LlamaRunner)
    assert checkpoint.unreadable_reason(tiny_model_dir(0)) is None


def test_workers_read_the_files_for_baton_and_load_the_module_for_the_reference():
    baton = load_runner(ModelSettings(name="tiny-random", dtype="float32"))
    assert isinstance(baton, LlamaRunner) and baton.loaded.model is None
    reference = load_runner(ModelSettings(name="tiny-random", dtype="float32", executor="transformers"))
    assert isinstance(reference, TransformersRunner) and reference.loaded.fingerprint == baton.loaded.fingerprint
    with pytest.raises(ValueError, match="transformers executor needs it"):
        make_runner(baton.loaded, "transformers")


def test_a_worker_starts_without_transformers_model_classes():
    """They cost a worker seconds at every start (they import torch's compiler and distributed packages)."""
    script = textwrap.dedent("""
        import sys
        from baton.config import ModelSettings
        from baton.engine.executors import load_runner
        from baton.decode_worker import service
        from baton.prefill_worker import service
        load_runner(ModelSettings(name="tiny-random", dtype="float32")).prefill([5, 6, 7])
        heavy = [m for m in ("transformers.modeling_utils", "torch._dynamo", "torch.distributed.tensor") if m in sys.modules]
        print(heavy)
    """)
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"
