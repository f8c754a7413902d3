"""fp8 weights (engine.fp8, issue 50): e4m3 codes with a scale per output feature, made at load
(`--quantization fp8`). Their speed is a GPU's (Hopper's fp8 tensor cores); here, what they compute:
the weights' rounding, the GEMM against its arithmetic in torch, a model that loads and answers
close to its floats, fp8 checkpoints as stored. The invariant path's bit tests with fp8 weights run
in Triton's interpreter in test_triton_backend.py, its GEMM in test_kernels.py."""
from __future__ import annotations

import json

import pytest
import torch

from baton.engine import fp8
from baton.engine.model import ModelLoadError, load_model


def test_weights_keep_each_rows_range():
    gen = torch.Generator().manual_seed(1)
    weight = torch.randn(64, 96, generator=gen) * torch.logspace(-3, 1, 64)[:, None]  # rows of very different ranges
    q = fp8.quantize(weight)
    assert q.data.dtype == torch.float8_e4m3fn and q.shape == (64, 96) and q.nbytes == 64 * 96 + 64 * 4
    assert fp8.quantization_error(weight, q) < 0.04  # e4m3's 3 mantissa bits, whatever a row's scale
    per_row = (q.dequantize() - weight).norm(dim=1) / weight.norm(dim=1)
    assert per_row.max() < 0.06
    part = q.rows(torch.tensor([5, 2]))
    assert torch.equal(part.data.float(), q.data[[5, 2]].float()) and torch.equal(part.scale, q.scale[[5, 2]])
    both = fp8.cat([q, part])
    assert both.shape == (66, 96) and torch.equal(both.scale[64:], part.scale)
    with pytest.raises(ValueError, match="float8_e4m3fn"):
        fp8.Fp8Weight(weight, q.scale)


def test_the_scaled_gemm_computes_its_codes_products():
    """torch._scaled_mm (the non-invariant path; here on the CPU) against the codes' products in fp32."""
    gen = torch.Generator().manual_seed(2)
    weight = fp8.quantize(torch.randn(48, 80, generator=gen))
    x = torch.randn(5, 80, generator=gen).to(torch.bfloat16)
    codes, scales = fp8.quantize_rows(x)
    expected = (codes.float() * scales[:, None]) @ weight.dequantize().t()
    out = fp8.linear(x, weight)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.float(), expected, atol=2e-2, rtol=2e-2)


def test_a_model_loads_in_fp8_and_answers_close_to_its_floats():
    floats = load_model("default", dtype="float32", module=False)
    quantized = load_model("default", dtype="float32", module=False, quantization="fp8")
    assert quantized.fingerprint.quantization == "fp8" and str(quantized.fingerprint) != str(floats.fingerprint)
    projections = [k for k in quantized.tensors if k.endswith("proj.weight")]
    assert projections and all(isinstance(quantized.tensors[k], fp8.Fp8Weight) for k in projections)
    assert isinstance(quantized.tensors["model.embed_tokens.weight"], torch.Tensor)
    assert quantized.weight_bytes < 0.65 * floats.weight_bytes
    from baton.engine.llama import LlamaRunner

    exact, q = LlamaRunner(floats), LlamaRunner(quantized)
    assert q.layout == "plain"  # on CPU: torch._scaled_mm
    prompt = floats.encode_chat([{"role": "user", "content": "What is the capital of France?"}])
    a, b = exact.prompt_logits(prompt).log_softmax(-1), q.prompt_logits(prompt).log_softmax(-1)
    kl = (a.exp() * (a - b)).sum(-1)
    print(f"\nfp8 against float32 over {len(prompt)} positions: KL mean {kl.mean():.4f}, "
          f"argmax agreement {(a.argmax(-1) == b.argmax(-1)).float().mean():.2f}")
    assert kl.mean() < 0.5 and (a.argmax(-1) == b.argmax(-1)).float().mean() > 0.6


def test_fp8_needs_baton_s_executor():
    with pytest.raises(ModelLoadError, match="Baton's executor"):
        load_model("tiny-random", quantization="fp8")  # module=True: transformers' forward


def fp8_checkpoint(tmp_path, per_tensor: bool = True):
    """tiny-random saved in vLLM's fp8 layout: e4m3 projections, a scale per tensor (or per output
    feature), static input scales beside them, quantization_config naming it."""
    import shutil

    from safetensors.torch import load_file, save_file

    from baton.engine.model import tiny_model_dir
    from baton.engine.model_files import default_model_dir

    source, target = tiny_model_dir(), tmp_path / "tiny-fp8"
    target.mkdir()
    tensors = {}
    for name, tensor in load_file(source / "model.safetensors").items():
        if name.endswith("proj.weight"):
            w = tensor.float()
            scale = (w.abs().amax() if per_tensor else w.abs().amax(dim=1)) / fp8.FP8_MAX
            tensors[name] = (w / (scale if per_tensor else scale[:, None])).to(fp8.FP8)
            tensors[name + "_scale"], tensors[name.replace(".weight", ".input_scale")] = scale, torch.tensor(1.0)
        else:
            tensors[name] = tensor
    save_file(tensors, target / "model.safetensors")
    config = json.loads((source / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "fp8", "activation_scheme": "dynamic"}
    (target / "config.json").write_text(json.dumps(config))
    for file in default_model_dir().glob("tokenizer*"):
        shutil.copy(file, target)
    return target, tensors


@pytest.mark.parametrize("per_tensor", [True, False])
def test_an_fp8_checkpoint_keeps_its_codes_or_is_served_as_floats(tmp_path, per_tensor):
    path, stored = fp8_checkpoint(tmp_path, per_tensor)
    kept = load_model(str(path), dtype="float32", module=False, quantization="fp8")
    weight = kept.tensors["model.layers.0.self_attn.q_proj.weight"]
    assert isinstance(weight, fp8.Fp8Weight) and kept.fingerprint.quantization == "fp8"
    assert torch.equal(weight.data.float(), stored["model.layers.0.self_attn.q_proj.weight"].float())
    assert not any(k.endswith("_scale") for k in kept.tensors)
    floats = load_model(str(path), dtype="float32", module=False)  # quantization none: dequantized
    assert torch.equal(floats.tensors["model.layers.0.self_attn.q_proj.weight"], weight.dequantize())
    from baton.engine.llama import LlamaRunner

    ids = list(range(100, 120))
    a, b = LlamaRunner(floats).prefill(ids).logits, LlamaRunner(kept).prefill(ids).logits
    # the same weights: what differs is the fp8 rounding of each token's activations
    assert (a - b).norm() < 0.3 * a.norm()  # tiny-random's wide weights make it loose; the default model: test above


def test_block_scaled_fp8_checkpoints_are_not_read_as_per_feature_ones(tmp_path):
    from baton.engine import checkpoint

    path, _ = fp8_checkpoint(tmp_path)
    config = json.loads((path / "config.json").read_text())
    config["quantization_config"]["weight_block_size"] = [128, 128]
    (path / "config.json").write_text(json.dumps(config))
    assert checkpoint.unreadable_reason(path) == "quantized weights"
