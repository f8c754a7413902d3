"""Quantized weights (engine.quantized, engine/cpu/quantized.h): the GEMM over Q8_0, Q4_0, Q4_1 and
Q4_K blocks (inputs in 16-bit or 8-bit codes) against the same arithmetic in float64 and row by row;
Q4_K's values those of gguf-py, read from a GGUF file without becoming Q8_0; the default model's
GGUF read with its blocks kept and its values those transformers' loader reads; int8 made at load
and refused where 8 bits lose too much; the fused decode step equal to the layer-by-layer one;
the fingerprint that keeps quantized KV away from a float worker. Batch invariance over Q8_0
weights runs in test_batch_invariance.py."""
from __future__ import annotations

import pytest
import torch

from baton.config import ModelSettings
from baton.decode_worker.core import DecodeConfig
from baton.engine import quantized
from baton.engine.cpu import kernels as cpu_kernels
from baton.engine.executors import make_runner
from baton.engine.model import ModelLoadError, default_tokenizer, load_model, tiny_random_model
from baton.engine.quantized import BlockWeight, panel_rows, quantize_q8_0
from baton.launch.local import LocalEngine
from baton.sampling import SamplingParams

pytestmark = pytest.mark.skipif(not cpu_kernels.available(), reason="Baton's CPU kernels did not build here")
GREEDY = SamplingParams(max_tokens=16, ignore_eos=True)


def random_q4_k(n: int, k: int, seed: int = 0) -> torch.Tensor:
    """GGUF Q4_K rows, uint8 [n, k / 256 * 144]: codes, 6-bit scales and minimums anywhere in their
    range, d and dmin of a trained model's size."""
    g = torch.Generator().manual_seed(seed)
    supers = torch.randint(0, 256, (n, k // 256, 144), dtype=torch.uint8, generator=g)
    supers[..., 0:2] = (torch.rand(n, k // 256, 1, generator=g) * 2e-3 + 1e-4).half().view(torch.uint8)
    supers[..., 2:4] = (torch.rand(n, k // 256, 1, generator=g) * 2e-3 + 1e-4).half().view(torch.uint8)
    return supers.reshape(n, -1)


def random_blocks(fmt: str, n: int, k: int, seed: int = 0) -> BlockWeight:
    """Codes anywhere in their range, scales (and minimums) of a trained model's size."""
    g = torch.Generator().manual_seed(seed)
    if fmt == "q8_0":
        return quantize_q8_0(torch.randn(n, k, generator=g) * 0.02)
    if fmt == "q4_k":
        return quantized.from_q4_k(random_q4_k(n, k, seed), k)
    size = quantized.FORMATS[fmt][1]
    data = torch.randint(0, 256, (n, k // 32, size), dtype=torch.uint8, generator=g)
    data[..., 0:2] = (torch.rand(n, k // 32, 1, generator=g) * 0.01 + 1e-3).half().view(torch.uint8)
    if fmt == "q4_1":
        data[..., 2:4] = (-torch.rand(n, k // 32, 1, generator=g) * 0.05).half().view(torch.uint8)
    return BlockWeight(fmt, data.reshape(n, -1), k)


def blockwise_product(x: torch.Tensor, weight: BlockWeight, bits: int) -> torch.Tensor:
    """x @ W^T as quantized.h computes it, in float64: x quantized per block of 32 to codes of
    `bits` bits (8: round(x / dx), llama.cpp's; 16: round(256 x / dx); dx = max |x| / 127, rounded
    to nearest even), integer dots, times d and the codes' scale per block (Q4_1: + m sum x)."""
    rows, k = x.shape
    blocks = weight.data.view(weight.out_features, k // 32, -1)
    xb = x.view(rows, k // 32, 32)
    dx = xb.abs().amax(-1) / 127
    steps = 256 if bits == 16 else 1
    xq = torch.round(xb * torch.where(dx > 0, steps / dx, torch.zeros_like(dx))[..., None]).double()
    dx = dx / steps
    wide = weight.format == "q4_k"  # fp32 scales and minimums
    d = blocks[..., 0:4 if wide else 2].contiguous().view(torch.float32 if wide else torch.float16).double()[..., 0]
    if weight.format == "q8_0":
        q = blocks[..., 2:].contiguous().view(torch.int8).double()
    else:
        codes = blocks[..., {"q4_0": 2, "q4_1": 4, "q4_k": 8}[weight.format]:]
        q = torch.cat([codes & 15, codes >> 4], dim=-1).double() - (8 if weight.format == "q4_0" else 0)
    out = (torch.einsum("rbk,nbk->rnb", xq, q) * d[None] * dx.double()[:, None]).sum(-1)
    if weight.format in ("q4_1", "q4_k"):
        m = (blocks[..., 4:8].contiguous().view(torch.float32) if wide
             else blocks[..., 2:4].contiguous().view(torch.float16)).double()[..., 0]
        out += (m[None] * xb.double().sum(-1)[:, None]).sum(-1)
    return out


@pytest.mark.parametrize("bits", [16, 8])
@pytest.mark.parametrize("fmt,n,k", [(fmt, n, k) for fmt in ("q8_0", "q4_0", "q4_1")
                                     for n, k in ((37, 64), (960, 576), (49, 1536))]
                         + [("q4_k", 37, 256), ("q4_k", 49, 1536)])  # Q4_K: rows of whole super-blocks
def test_the_gemm_computes_the_blockwise_product_row_by_row(fmt, n, k, bits):
    weight = random_blocks(fmt, n, k)
    packed = weight.panels()
    dense = weight.dequantize().double()
    for rows in (1, 3, 8, 11):
        x = torch.randn(rows, k)
        x[:, 3] *= 30  # an outlier channel: its blocks' other inputs get coarse 8-bit codes
        out = cpu_kernels.quant_gemm(x, packed, weight.code, k, n, bits).double()
        reference = blockwise_product(x, weight, bits)
        assert (out - reference).abs().max() <= 1e-5 * reference.abs().max()
        floats = x.double() @ dense.T  # what quantized inputs cost against float arithmetic
        error = (out - floats).norm() / floats.norm()
        assert error < (2e-4 if bits == 16 else 0.05)
        for r in range(rows):  # a row's bits do not depend on the rows beside it
            assert torch.equal(cpu_kernels.quant_gemm(x[r:r + 1], packed, weight.code, k, n, bits)[0].double(), out[r])
    ids = torch.tensor([0, n - 1, n // 2, 5 % n])
    assert torch.equal(panel_rows(fmt, packed, ids, k), weight.dequantize()[ids])  # the tied embedding's lookup


def test_q4_k_blocks_hold_the_values_gguf_reads_and_a_gguf_file_keeps_them(tmp_path):
    """A Q4_K tensor read from a GGUF file becomes Q4_K blocks (not Q8_0), their values equal to
    gguf-py's dequantization bit for bit, the projection's rows in Hugging Face's order."""
    import gguf

    from baton.engine.gguf_weights import read_gguf

    raw = random_q4_k(64, 512, seed=3)
    down = random_q4_k(32, 256, seed=4)
    assert torch.equal(quantized.from_q4_k(raw, 512).dequantize(),
                       torch.from_numpy(gguf.quants.dequantize(raw.numpy(), gguf.GGMLQuantizationType.Q4_K)))
    path = tmp_path / "q4k.gguf"
    writer = gguf.GGUFWriter(str(path), "llama")
    for name, rows in (("blk.0.attn_q.weight", raw), ("blk.0.ffn_down.weight", down)):
        writer.add_tensor(name, rows.numpy(), raw_dtype=gguf.GGMLQuantizationType.Q4_K)  # shape: from its bytes
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()

    class Config:
        num_attention_heads, num_key_value_heads = 4, 4

    weights = read_gguf(path, Config(), torch.float32)
    q, ffn = weights["model.layers.0.self_attn.q_proj.weight"], weights["model.layers.0.mlp.down_proj.weight"]
    assert isinstance(q, BlockWeight) and q.format == "q4_k" and isinstance(ffn, BlockWeight) and ffn.format == "q4_k"
    assert torch.equal(ffn.dequantize(), quantized.from_q4_k(down, 256).dequantize())
    hf_rows = torch.arange(64).reshape(4, 8, 2).transpose(1, 2).reshape(64)  # llama.cpp's rotary interleave undone
    assert torch.equal(q.dequantize(), quantized.from_q4_k(raw, 512).dequantize()[hf_rows])
    with pytest.raises(ValueError, match="multiple of 256"):
        quantized.from_q4_k(random_q4_k(4, 256), 128)


def test_blocks_refuse_what_they_cannot_hold():
    with pytest.raises(ValueError, match="multiple of 32"):
        quantize_q8_0(torch.randn(4, 40))
    with pytest.raises(ValueError, match="unknown block format"):
        BlockWeight("q5_k", torch.zeros(1, 34, dtype=torch.uint8), 32)
    with pytest.raises(ValueError, match=r"uint8 \[N, 34\]"):
        BlockWeight("q8_0", torch.zeros(1, 30, dtype=torch.uint8), 32)
    packed = random_blocks("q8_0", 16, 64).panels()
    with pytest.raises(ValueError, match="width 64"):
        cpu_kernels.quant_gemm(torch.randn(2, 32), packed, 1, 64, 16)
    with pytest.raises(ValueError, match="8 or 16 bits"):
        cpu_kernels.quant_gemm(torch.randn(2, 64), packed, 1, 64, 16, 4)


def test_q8_0_loses_half_a_percent_of_a_gaussian_weight():
    weight = torch.randn(256, 512)
    blocks = quantize_q8_0(weight)
    assert blocks.nbytes == 256 * 512 // 32 * 34  # GGUF's own size: 8.5 bits a weight
    error, zeroed = quantized.quantization_loss(weight, blocks)
    assert 0.002 < error < 0.008 and zeroed < 0.01
    assert quantized.quantization_loss(torch.zeros(32, 32), quantize_q8_0(torch.zeros(32, 32))) == (0.0, 0.0)


def test_the_default_models_gguf_is_served_from_its_blocks():
    """gguf: every projection stays in the file's Q4_1 blocks (the tied embedding its Q8_0), and
    their values are the ones transformers' GGUF loader dequantized into the float checkpoint
    (queries' and keys' rows back in Hugging Face's order)."""
    from safetensors import safe_open

    from baton.engine.model import default_model_dir

    loaded = load_model("default", dtype="bfloat16", module=False, quantization="gguf")
    assert loaded.quantization == "gguf" and loaded.dtype == torch.bfloat16
    assert str(loaded.fingerprint).split("/")[1] == "bfloat16+gguf"
    embed = loaded.tensors["model.embed_tokens.weight"]
    assert isinstance(embed, BlockWeight) and embed.format == "q8_0"
    with safe_open(next(default_model_dir().glob("*.safetensors")), framework="pt") as floats:
        for name in ("model.layers.0.self_attn.q_proj.weight", "model.layers.7.self_attn.k_proj.weight",
                     "model.layers.29.mlp.down_proj.weight", "model.layers.3.self_attn.v_proj.weight"):
            blocks = loaded.tensors[name]
            assert isinstance(blocks, BlockWeight) and blocks.format == "q4_1"
            assert torch.equal(blocks.dequantize(), floats.get_tensor(name).float()), name
        assert torch.equal(embed.rows(torch.arange(0, 49152, 997)).dequantize(),
                           floats.get_tensor("model.embed_tokens.weight")[::997].float())
    held = sum(t.nbytes for t in loaded.tensors.values())
    assert held < 110e6  # the file's 98 MB, not the floats' 270 MB


def test_loading_warns_where_the_cpu_has_no_integer_dot_products(monkeypatch, caplog):
    """Without AVX512-VNNI, AVX2 or ARM's dotprod the quantized GEMM takes its portable loop, slower
    than floats: said once at load, with what to use instead (it still loads and serves). Which
    builds have the dot products: test_cpu_prefill_attention's builds for other instruction sets."""
    monkeypatch.setattr(cpu_kernels, "fast_quantized", lambda: False)
    with caplog.at_level("WARNING", logger="baton.engine.model"):
        loaded = load_model("default", dtype="bfloat16", module=False, quantization="gguf")
    assert loaded.quantization == "gguf"
    said = [r.getMessage() for r in caplog.records]
    assert [m for m in said if "no byte dot products" in m and "'none'" in m], said


def test_a_quantized_runner_steps_in_one_call_and_answers_as_its_floats():
    """The default model from its GGUF: the fused decode step (one C call) gives the bits of the
    layer-by-layer step; with 16-bit inputs its next-token distributions are those of the same
    values held as floats (KL under 1e-4 nats), with 8-bit ones (llama.cpp's) within 0.1."""
    prompts = None
    floats = make_runner(load_model("default", dtype="float32", module=False))
    for bits, bound in ((16, 1e-4), (8, 0.1)):
        loaded = load_model("default", dtype="float32", module=False, quantization="gguf", quantized_inputs=bits)
        prompts = prompts or [loaded.encode_chat([{"role": "user", "content": q}])
                              for q in ("What is the capital of France?", "Name three colours.")]
        fused = LocalEngine(loaded, DecodeConfig(max_rows=2)).generate(prompts, GREEDY)
        engine = LocalEngine(loaded, DecodeConfig(max_rows=2))
        assert engine.runner.decode_layers is not None
        engine.runner.decode_layers = None  # layer by layer from Python, the same kernels
        assert [o.token_ids for o in engine.generate(prompts, GREEDY)] == [o.token_ids for o in fused]
        for prompt in prompts:
            want = floats.prefill(prompt).logits.double().log_softmax(-1)
            got = engine.runner.prefill(prompt).logits.double().log_softmax(-1)
            assert (want.exp() * (want - got)).sum() < bound, bits


def q4_k_of(weight: torch.Tensor) -> torch.Tensor:
    """Floats [N, K] -> GGUF Q4_K rows, quantized plainly (llama.cpp searches its scales; this
    takes each block's range): per 32 weights a 6-bit scale and minimum under the super-block's
    fp16 d and dmin, codes round((w + dmin n) / (d s))."""
    n, k = weight.shape
    w = weight.double().reshape(n, k // 256, 8, 32)
    low = w.amin(-1).clamp(max=0)
    step = ((w.amax(-1) - low) / 15).clamp(min=1e-12)
    d = (step.amax(-1, keepdim=True) / 63).half()
    dmin = ((-low).amax(-1, keepdim=True).clamp(min=1e-12) / 63).half()
    scales = (step / d.double()).round().clamp(1, 63).to(torch.int32)
    mins = (-low / dmin.double()).round().clamp(0, 63).to(torch.int32)
    codes = ((w + (dmin.double() * mins)[..., None]) / (d.double() * scales)[..., None]).round().clamp(0, 15)
    codes = codes.to(torch.uint8).reshape(n, k // 256, 4, 2, 32)
    qs = (codes[..., 0, :] | (codes[..., 1, :] << 4)).reshape(n, k // 256, 128)
    packed = torch.cat([(scales[..., :4] & 63) | ((scales[..., 4:] >> 4) << 6),
                        (mins[..., :4] & 63) | ((mins[..., 4:] >> 4) << 6),
                        (scales[..., 4:] & 15) | ((mins[..., 4:] & 15) << 4)], dim=-1).to(torch.uint8)
    return torch.cat([d.view(torch.uint8), dmin.view(torch.uint8), packed, qs], dim=-1).reshape(n, -1)


def test_q4_k_weights_step_in_one_call_and_answer_as_their_floats():
    """The default model from its GGUF with every down projection made Q4_K (the one width of this
    model that holds whole 256-weight super-blocks): the fused decode step gives the bits of the
    layer-by-layer one, and the next-token distributions are those of the same values as floats."""
    loaded = load_model("default", dtype="float32", module=False, quantization="gguf")
    floats = load_model("default", dtype="float32", module=False)
    for name, weight in list(loaded.tensors.items()):
        if name.endswith("down_proj.weight"):
            blocks = quantized.from_q4_k(q4_k_of(weight.dequantize()), weight.in_features)
            loaded.tensors[name], floats.tensors[name] = blocks, blocks.dequantize()
    engine = LocalEngine(loaded, DecodeConfig(max_rows=2))
    assert {layer.down.format for layer in engine.runner.layers} == {"q4_k"}
    prompts = [loaded.encode_chat([{"role": "user", "content": q}])
               for q in ("What is the capital of France?", "Name three colours.")]
    fused = engine.generate(prompts, GREEDY)
    engine.runner.decode_layers = None  # layer by layer from Python, the same kernels
    assert [o.token_ids for o in engine.generate(prompts, GREEDY)] == [o.token_ids for o in fused]
    reference = make_runner(floats)
    for prompt in prompts:
        want = reference.prefill(prompt).logits.double().log_softmax(-1)
        got = engine.runner.prefill(prompt).logits.double().log_softmax(-1)
        assert (want.exp() * (want - got)).sum() < 1e-4


def test_int8_is_made_at_load_and_refused_where_8_bits_lose_too_much(tmp_path):
    loaded = load_model("tiny-random", dtype="bfloat16", module=False, quantization="int8")
    assert loaded.quantization == "int8" and str(loaded.fingerprint).split("/")[1] == "bfloat16+int8"
    weights = [t for t in loaded.tensors.values() if isinstance(t, BlockWeight)]
    assert weights and all(w.format == "q8_0" for w in weights)
    assert LocalEngine(loaded, DecodeConfig(max_rows=2)).generate([[5, 6, 7]], GREEDY)[0].token_ids
    model = tiny_random_model(0)
    with torch.no_grad():  # one weight whose blocks each hold a huge value: the rest rounds to 0
        model.model.layers[1].mlp.down_proj.weight[:, ::32] = 1e4
    model.save_pretrained(tmp_path)
    default_tokenizer().save_pretrained(tmp_path)  # a directory model brings its tokenizer
    with pytest.raises(ModelLoadError, match=r"would lose .* of model.layers.1.mlp.down_proj.weight and round 9"):
        load_model(str(tmp_path), dtype="float32", module=False, quantization="int8")


def test_quantization_is_checked_before_anything_loads():
    with pytest.raises(ModelLoadError, match="unknown quantization"):
        load_model("tiny-random", quantization="fp4")
    with pytest.raises(ModelLoadError, match="Baton's executor only"):
        load_model("tiny-random", quantization="int8", module=True)
    with pytest.raises(ModelLoadError, match="from its GGUF file"):
        load_model("tiny-random", quantization="gguf", module=False)
    with pytest.raises(ValueError, match="model.quantization must be one of none, gguf, int8"):
        ModelSettings(quantization="q4").validate()
    with pytest.raises(ValueError, match="quantized_inputs must be 8 or 16"):
        ModelSettings(quantized_inputs=4).validate()
    with pytest.raises(ModelLoadError, match="8 or 16 bits"):
        load_model("tiny-random", quantization="int8", module=False, quantized_inputs=12)
    with pytest.raises(ValueError, match="cannot serve it"):
        ModelSettings(quantization="int8", executor="transformers").validate()


def test_kv_of_quantized_weights_is_another_models():
    """A prefill worker on quantized weights computes other KV than one on the same model's floats:
    their fingerprints differ, so the receiver refuses the push (kvtransfer.receiver)."""
    floats = load_model("tiny-random", dtype="bfloat16", module=False)
    blocks = load_model("tiny-random", dtype="bfloat16", module=False, quantization="int8")
    coarse = load_model("tiny-random", dtype="bfloat16", module=False, quantization="int8", quantized_inputs=8)
    assert len({str(floats.fingerprint), str(blocks.fingerprint), str(coarse.fingerprint)}) == 3
    assert floats.fingerprint.weights_hash == blocks.fingerprint.weights_hash
    runner = make_runner(blocks)
    assert runner.layers[0].qkv.code == quantized.FORMATS["q8_0"][0]


@pytest.mark.parametrize("quantization", ["none", "int8"])
def test_prompt_logits_score_every_position_as_prefill_scores_the_last(quantization):
    """bench quant's perplexity: the logits after each token of a text, the last one prefill's own."""
    runner = make_runner(load_model("tiny-random", dtype="float32", module=False, quantization=quantization))
    text = [5, 17, 300, 42, 9, 1000]
    every = runner.prompt_logits(text)
    assert every.shape == (len(text), runner.loaded.config.vocab_size)
    assert torch.equal(every[-1], runner.prefill(text).logits)
    assert torch.equal(every[2], runner.prefill(text[:3]).logits)
    with pytest.raises(ValueError, match="at least one token"):
        runner.prompt_logits([])
