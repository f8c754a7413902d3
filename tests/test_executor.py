"""Baton's own executor: token-exact against transformers generate per dtype and architecture,
its kernels against torch, its fallbacks, and the thread and core settings workers start with.
(Both executors through random arrivals, left growth and release: test_engine_exact.py.)"""
from __future__ import annotations

import copy
import dataclasses
import logging
import os
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

from baton.launch.local import LocalEngine
from baton.decode_worker.core import DecodeConfig
from baton.decode_worker.paged_rows import PagedRows
from baton.engine import attention, threads
from baton.engine.cpu import kernels as cpu_kernels
from baton.engine.executors import make_runner
from baton.engine.linear import Linear, best_layout, onednn_packs
from baton.engine.llama import LlamaRunner
from baton.engine.model import LoadedModel, _finish, default_tokenizer, resolve_dtype
from baton.engine.runner import TransformersRunner
from baton.sampling import SamplingParams


class Greedy:
    """transformers generate on an untouched copy of a model: the ground truth."""

    def __init__(self, model):
        self.model = copy.deepcopy(model).eval()
        self.model.set_attn_implementation("sdpa")

    def greedy(self, prompt_ids: list[int], max_new_tokens: int) -> list[int]:
        out = self.model.generate(torch.tensor([prompt_ids]), max_new_tokens=max_new_tokens, do_sample=False,
                                  pad_token_id=self.model.generation_config.pad_token_id)
        return out[0, len(prompt_ids):].tolist()


def tiny(architecture: str, dtype: torch.dtype = torch.float32, **overrides) -> LoadedModel:
    """A two-layer random model of the given family with the default tokenizer's vocabulary."""
    import transformers

    common = dict(vocab_size=49152, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
                  bos_token_id=1, eos_token_id=2, pad_token_id=2, initializer_range=0.2)
    common.update(overrides)
    config_cls, model_cls = {
        "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
        "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM),  # q/k/v biases, untied head
        "mistral": (transformers.MistralConfig, transformers.MistralForCausalLM),
    }[architecture]
    extra = {"tie_word_embeddings": architecture == "llama", "architectures": [model_cls.__name__]}
    if architecture == "mistral":
        extra["sliding_window"] = None
    torch.manual_seed(1)
    model = model_cls(config_cls(**common, **extra))
    if architecture == "qwen2":  # random biases, not the zeros they start as
        for layer in model.model.layers:
            for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                torch.nn.init.normal_(proj.bias, std=0.2)
    return _finish(model, default_tokenizer(), f"tiny-{architecture}", dtype, "cpu")


PROMPTS = [[1, 4093, 28, 253, 9, 331], list(range(200, 260)), [17, 42, 99], list(range(1000, 1130, 3))]


def engine_tokens(loaded: LoadedModel, executor: str, max_tokens: int, max_rows: int = 2) -> list[list[int]]:
    engine = LocalEngine(loaded, DecodeConfig(max_rows=max_rows), executor=executor)
    outs = engine.generate(PROMPTS, SamplingParams(max_tokens=max_tokens, ignore_eos=True))
    return [o.token_ids for o in outs]


@pytest.mark.parametrize("architecture", ["llama", "qwen2", "mistral"])
def test_baton_executor_matches_generate_per_architecture(architecture):
    loaded = tiny(architecture)
    reference = Greedy(loaded.model)
    got = engine_tokens(loaded, "baton", max_tokens=16)
    assert got == [reference.greedy(p, 16) for p in PROMPTS]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_computes_in_fp32_over_half_precision_weights(dtype):
    """With Baton's CPU kernels, bf16 and fp16 store weights and KV in that dtype and compute in
    fp32: greedy tokens equal fp32 generate over the same rounded weights (the KV's rounding aside,
    which the tiny model's peaked logits absorb). Without the kernels, bf16 runs oneDNN in bf16
    and equals generate run in bf16."""
    loaded = tiny("llama", dtype)
    runner = LlamaRunner(loaded)
    assert runner.dtype == dtype
    if runner.layout == "panels":
        assert runner.compute_dtype == torch.float32
        reference = Greedy(copy.deepcopy(loaded.model).float())
    elif dtype == torch.bfloat16:
        reference = Greedy(loaded.model)
    else:
        pytest.skip("fp16 without Baton's kernels has no contract beyond running")
    assert engine_tokens(loaded, "baton", max_tokens=12) == [reference.greedy(p, 12) for p in PROMPTS]


@pytest.mark.skipif(not cpu_kernels.available(), reason="no C compiler for Baton's CPU kernels")
@pytest.mark.parametrize("architecture,overrides", [
    ("llama", {}),
    ("qwen2", {}),  # q/k/v biases
    ("llama", {"hidden_size": 128, "num_attention_heads": 2, "num_key_value_heads": 1, "intermediate_size": 200}),
    ("llama", {"head_dim": 64, "intermediate_size": 96}),  # heads x head_dim (256) wider than hidden and MLP
])  # head_dim 16, then 64 (the register kernel) with a SiLU width that leaves a tail past 16 lanes
def test_the_one_call_decode_step_equals_the_layer_by_layer_step(architecture, overrides):
    runner = LlamaRunner(tiny(architecture, **overrides))
    assert runner.decode_layers is not None

    def steps(one_call: bool):
        saved, runner.decode_layers = runner.decode_layers, runner.decode_layers if one_call else None
        rows = PagedRows(runner.loaded.kv_shape, page_size=8)
        for prompt in PROMPTS:  # different lengths: rows end at different slots of their last pages
            rows.add(runner.prefill(prompt).kv)
        tokens, logits = [3, 5, 7, 11], []
        for _ in range(6):
            logits.append(runner.decode(rows.kv, rows.step(), tokens))
            tokens = logits[-1].argmax(-1).tolist()
        runner.decode_layers = saved
        return torch.stack(logits), torch.cat([rows.read(r).data for r in range(4)], dim=3)

    (logits, kv), (reference_logits, reference_kv) = steps(True), steps(False)
    torch.testing.assert_close(logits, reference_logits, rtol=1e-5, atol=1e-5)  # SiLU's exp rounds differently
    torch.testing.assert_close(kv, reference_kv, rtol=1e-5, atol=1e-5)
    assert torch.equal(logits.argmax(-1), reference_logits.argmax(-1))


def test_the_step_a_cuda_graph_captures_equals_the_eager_step_with_a_padding_row(tiny_model):
    """engine.cuda_graphs replays `_captured_step` on a GPU (test_cuda.py); its maths runs here on
    CPU: inputs read from one tensor, page tables padded to the widest a row can need, a fourth
    row padding a 3-row batch (writing and reading the null page only)."""
    from baton.engine.cuda_graphs import step_arguments, step_inputs

    runner = LlamaRunner(tiny_model, "torch")
    eager, captured = PagedRows(tiny_model.kv_shape), PagedRows(tiny_model.kv_shape)
    for prompt in PROMPTS[:3]:
        kv = runner.prefill(prompt).kv
        eager.add(kv)
        captured.add(kv)
    tokens, width = [3, 5, 7], 40
    for _ in range(4):
        expected = runner.decode(eager.kv, eager.step(), tokens)
        inputs = torch.tensor(step_inputs(captured.step(), tokens, rows=4, width=width))
        got = runner._captured_step(captured.kv.pages, *step_arguments(inputs, 4, width))
        assert got.shape == (4, expected.shape[1]) and torch.isfinite(got).all()
        torch.testing.assert_close(got[:3], expected, rtol=1e-4, atol=1e-4)
        tokens = expected.argmax(-1).tolist()
    for row in range(3):
        torch.testing.assert_close(captured.read(row).data, eager.read(row).data, rtol=1e-5, atol=1e-5)


def test_executors_agree_on_prefill_kv_and_logits_with_a_cached_prefix(tiny_model):
    fast, ref = LlamaRunner(tiny_model), TransformersRunner(copy.copy(tiny_model))
    prefix = fast.prefill(list(range(300, 340))).kv
    prompts = [list(range(300, 340)) + [5, 6, 7], list(range(300, 340)) + list(range(900, 930))]
    for a, b in zip(fast.prefill_batch(prompts, prefix), ref.prefill_batch(prompts, prefix)):
        assert a.computed_tokens == b.computed_tokens
        torch.testing.assert_close(a.kv.data, b.kv.data, rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(a.logits, b.logits, rtol=1e-4, atol=1e-4)
        assert int(a.logits.argmax()) == int(b.logits.argmax())


def test_an_unsupported_model_falls_back_to_transformers_with_one_log_line(tiny_model, caplog):
    module = copy.deepcopy(tiny_model.model)
    module.config.hidden_act = "gelu"
    odd = dataclasses.replace(tiny_model, model=module, config=module.config)
    with caplog.at_level(logging.WARNING, logger="baton.engine.executors"):
        runner = make_runner(odd)
    assert isinstance(runner, TransformersRunner)
    assert [r.message for r in caplog.records if "cannot run" in r.message and "gelu" in r.message]
    with pytest.raises(ValueError, match="use --executor transformers"):
        make_runner(odd, "baton")
    with pytest.raises(ValueError, match="unknown executor"):
        make_runner(tiny_model, "fast")
    assert isinstance(make_runner(tiny_model), LlamaRunner)


def test_a_triton_kernel_that_cannot_run_falls_back_to_torch_with_a_warning(tiny_model, caplog, monkeypatch):
    from baton.engine import kernels

    def cannot_build(*args, **kwargs):
        raise RuntimeError("0 active drivers ([]). There should only be one.")  # what Triton says without a GPU

    runner = LlamaRunner(tiny_model, "torch")
    runner.decode_layers = None  # the layer-by-layer step, where the attention backend is chosen
    first = runner.prefill([5, 6, 7, 8])
    rows = PagedRows(tiny_model.kv_shape)
    rows.add(first.kv)
    step = rows.step()
    expected = runner.decode(rows.kv, step, [9])
    runner.backend = "triton"
    monkeypatch.setattr(kernels, "paged_decode_attention", cannot_build, raising=False)
    with caplog.at_level(logging.WARNING, logger="baton.engine.llama"):
        got = runner.decode(rows.kv, step, [9])
    assert runner.backend == "torch" and any("falling back" in r.message for r in caplog.records)
    torch.testing.assert_close(got, expected)


@pytest.mark.skipif(not cpu_kernels.available(), reason="no C compiler for Baton's CPU kernels")
def test_processes_starting_together_build_the_cpu_kernels_once(tmp_path):
    """A prefill and a decode worker started at once both want the kernels: one compiles, the other
    waits for it and loads the same file. The compiler here is a stand-in that logs each call and
    hands over the library already built (a real build takes 10-40 CPU-seconds)."""
    built = cpu_kernels._library()._name  # the library this process loaded: nothing is compiled here
    compiler = tmp_path / "cc"
    compiler.write_text(f'#!/bin/sh\necho "$$" >> {tmp_path}/calls\nsleep 1\n'
                        f'while [ "$#" -gt 1 ]; do [ "$1" = -o ] && cp {built} "$2"; shift; done\n')
    compiler.chmod(0o755)
    # Each probe imports the kernels' module, says so, and builds once told to: both build at once.
    probe = ("import sys; from baton.engine.cpu import kernels; print('ready', flush=True); sys.stdin.read(); "
             "print(kernels._library() is not None, kernels._build(sys.argv[1]))")
    env = {**os.environ, "BATON_CACHE_DIR": str(tmp_path / "cache"), "CC": str(compiler)}
    starting = [subprocess.Popen([sys.executable, "-c", probe, str(compiler)], env=env, stdin=subprocess.PIPE,
                                 stdout=subprocess.PIPE, text=True) for _ in range(2)]
    assert [process.stdout.readline() for process in starting] == ["ready\n"] * 2
    for process in starting:
        process.stdin.close()
    answers = {process.stdout.read() for process in starting}
    assert [process.wait(timeout=120) for process in starting] == [0, 0]
    assert len(answers) == 1 and answers.pop().startswith("True "), "each process loaded the same library"
    assert len((tmp_path / "calls").read_text().split()) == 1, "the kernels were compiled more than once"


@pytest.mark.skipif(not cpu_kernels.available(), reason="no C compiler for Baton's small-row GEMM")
@pytest.mark.parametrize("rows", [1, 3, 8, 9, 16, 100])  # 100: a prefill's rows, where AVX-512 takes panels
def test_small_row_gemm_equals_f_linear(rows):
    torch.manual_seed(rows)
    weight, bias = torch.randn(1001, 577) * 0.05, torch.randn(1001)  # N and K not multiples of the panel width (16)
    x = torch.randn(rows, 577)
    got = Linear(weight, bias, layout="panels")(x)
    torch.testing.assert_close(got, F.linear(x, weight, bias), rtol=1e-5, atol=1e-4)
    # rows past the panels' limit go to F.linear over the same weight
    many = torch.randn(cpu_kernels.max_rows() + 1, 577)
    torch.testing.assert_close(Linear(weight, bias, layout="panels")(many), F.linear(many, weight, bias),
                               rtol=1e-5, atol=1e-4)


@pytest.mark.skipif(not cpu_kernels.stores(torch.bfloat16), reason="no C compiler for Baton's bf16 panels")
def test_half_precision_panels_hold_no_plain_copy_of_the_weight():
    weight = (torch.randn(40, 64) * 0.05).to(torch.bfloat16)
    linear = Linear(weight, layout="panels")
    assert linear.weight is None  # every row count reads the panels: the plain copy was only memory
    for rows in (1, cpu_kernels.max_rows() + 1):
        x = torch.randn(rows, 64)
        torch.testing.assert_close(linear(x), F.linear(x, weight.float()), rtol=1e-5, atol=1e-4)
    assert Linear(weight.float(), layout="panels").weight is not None  # fp32: many rows go to MKL over it


def paged(keys: torch.Tensor, values: torch.Tensor, lengths: list[int], page_size: int):
    """Rows' keys and values [rows, Hkv, T, D] scattered into shuffled pages of one layer of a paged
    KV: (k_pages, v_pages [pages, Hkv, P, D], table int64 [rows, width]); page 0 and every slot
    past a row's length hold NaN, which attention must never read."""
    rows, kv_heads, _, dim = keys.shape
    width = max(-(-n // page_size) for n in lengths) + 1  # one spare column of null pages
    pool = torch.full((2, 1 + rows * width, kv_heads, page_size, dim), float("nan"))
    order = torch.randperm(rows * width, generator=torch.Generator().manual_seed(1)) + 1
    table = torch.zeros(rows, width, dtype=torch.int64)
    for r, n in enumerate(lengths):
        for i in range(-(-n // page_size)):
            page, count = int(order[r * width + i]), min(page_size, n - i * page_size)
            table[r, i] = page
            pool[0, page, :, :count] = keys[r, :, i * page_size:i * page_size + count]
            pool[1, page, :, :count] = values[r, :, i * page_size:i * page_size + count]
    return pool[0], pool[1], table


@pytest.mark.skipif(not cpu_kernels.available(), reason="no C compiler for Baton's CPU kernels")
@pytest.mark.parametrize("page_size", [16, 7])
def test_cpu_decode_attention_over_pages_equals_sdpa_over_each_rows_tokens(page_size):
    torch.manual_seed(page_size)
    rows, heads, kv_heads, dim, longest = 4, 9, 3, 64, 300
    keys, values = torch.randn(rows, kv_heads, longest, dim), torch.randn(rows, kv_heads, longest, dim)
    query = torch.randn(rows, heads, dim)
    lengths = [300, 250, 1, 16]  # ragged rows, one of a single token, one of exactly a page (at 16)
    k_pages, v_pages, table = paged(keys, values, lengths, page_size)
    got = cpu_kernels.decode_attention(query, k_pages, v_pages, table, torch.tensor(lengths), 0.125)
    for r, n in enumerate(lengths):
        expected = F.scaled_dot_product_attention(query[r:r + 1, :, None], keys[r:r + 1, :, :n], values[r:r + 1, :, :n],
                                                  scale=0.125, enable_gqa=True)[0, :, 0]
        torch.testing.assert_close(got[r], expected, rtol=1e-5, atol=1e-5)


@pytest.mark.skipif(not cpu_kernels.available(), reason="no C compiler for Baton's CPU kernels")
@pytest.mark.parametrize("heads,kv_heads,dim", [(9, 3, 64), (8, 1, 128), (10, 2, 80), (6, 6, 64), (16, 2, 64)])
def test_cpu_decode_attention_and_its_lse_for_every_head_layout(heads, kv_heads, dim):
    """head_dim 64 and 128 run in registers (groups of up to 4 query heads at a time), any other
    head_dim in plain loops; each gives SDPA's result and the log-sum-exp of the scaled scores."""
    torch.manual_seed(heads * dim)
    rows, longest = 3, 203  # not a multiple of 16: the softmax's last lanes, a part-filled last page
    keys, values = torch.randn(rows, kv_heads, longest, dim) * 2, torch.randn(rows, kv_heads, longest, dim) * 2
    query = torch.randn(rows, heads, dim)
    lengths = [203, 166, 0]  # the last row has nothing to attend to
    k_pages, v_pages, table = paged(keys, values, [max(n, 1) for n in lengths], 16)
    lse = torch.empty(rows, heads)
    got = cpu_kernels.decode_attention(query, k_pages, v_pages, table, torch.tensor(lengths), dim ** -0.5, lse=lse)
    group = heads // kv_heads
    for r, n in enumerate(lengths):
        k = keys[r, :, :n].repeat_interleave(group, dim=0)  # [H, n, D]
        v = values[r, :, :n].repeat_interleave(group, dim=0)
        if n == 0:
            assert torch.all(got[r] == 0) and torch.all(lse[r] == float("-inf"))
            continue
        scores = torch.einsum("hd,hnd->hn", query[r], k) * dim ** -0.5
        torch.testing.assert_close(got[r], torch.einsum("hn,hnd->hd", scores.softmax(-1), v), rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(lse[r], scores.logsumexp(-1), rtol=1e-5, atol=1e-5)


@pytest.mark.skipif(not cpu_kernels.available(), reason="no C compiler for Baton's CPU kernels")
@pytest.mark.parametrize("rows,width", [(4, 576), (1, 100), (70, 64)])  # a tail past 16 lanes; rows in threads
def test_cpu_rms_norm_equals_torch(rows, width):
    torch.manual_seed(rows)
    x, weight = torch.randn(rows, width) * 3, torch.randn(width)
    got = cpu_kernels.rms_norm(x, weight, 1e-5)
    torch.testing.assert_close(got, F.rms_norm(x, (width,), weight, 1e-5), rtol=1e-5, atol=1e-5)


@pytest.mark.skipif(not cpu_kernels.available(), reason="no C compiler for Baton's CPU kernels")
@pytest.mark.parametrize("tokens", [3, 70])  # 70: rows in threads
def test_cpu_rotary_rotates_query_and_key_heads_in_place_and_leaves_values(tokens):
    torch.manual_seed(tokens)
    heads, kv_heads, dim = 9, 3, 64
    qkv = torch.randn(tokens, heads + 2 * kv_heads, dim)
    angles = torch.rand(tokens, dim // 2) * 6
    cos, sin = torch.cat([angles.cos()] * 2, -1), torch.cat([angles.sin()] * 2, -1)  # [N, D], as HF builds them
    rotate_half = lambda x: torch.cat([-x[..., dim // 2:], x[..., :dim // 2]], -1)
    expected = qkv[:, :heads + kv_heads] * cos[:, None] + rotate_half(qkv[:, :heads + kv_heads]) * sin[:, None]
    values = qkv[:, heads + kv_heads:].clone()
    signed_sin = sin.clone()
    signed_sin[:, :dim // 2].neg_()
    cpu_kernels.rotary(qkv, heads + kv_heads, cos, signed_sin)
    torch.testing.assert_close(qkv[:, :heads + kv_heads], expected, rtol=1e-5, atol=1e-5)
    assert torch.equal(qkv[:, heads + kv_heads:], values)


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
def test_prefill_over_a_shared_prefix_equals_masked_sdpa_over_copies_of_it(dtype, tol):
    """A group's prompts attend to one prefix tensor and their own tokens, merged by LSE: the same
    as each prompt holding a copy of the prefix (what the engine did before)."""
    torch.manual_seed(1)
    prompts, heads, kv_heads, dim, new, cached = 3, 9, 3, 64, 17, 40
    query = torch.randn(prompts, new, heads, dim).to(dtype).transpose(1, 2)  # [B, Hq, T, D], as the engine's
    keys, values = torch.randn(2, prompts, kv_heads, new, dim).to(dtype)
    prefix_k, prefix_v = torch.randn(2, kv_heads, cached, dim).to(dtype)
    whole_k = torch.cat([prefix_k[None].expand(prompts, -1, -1, -1), keys], dim=2)
    whole_v = torch.cat([prefix_v[None].expand(prompts, -1, -1, -1), values], dim=2)
    mask = torch.arange(cached + new)[None, :] <= torch.arange(new)[:, None] + cached
    expected = F.scaled_dot_product_attention(query.float(), whole_k.float(), whole_v.float(), attn_mask=mask,
                                              scale=0.125, enable_gqa=True).transpose(1, 2)
    got = attention.prefill_continued(query, keys, values, prefix_k, prefix_v, "torch", 0.125)
    assert got.dtype == dtype and got.shape == (prompts, new, heads, dim)
    torch.testing.assert_close(got.float(), expected, rtol=tol, atol=tol)


def test_layouts_and_auto_dtype_follow_what_this_cpu_can_do():
    cpu = torch.device("cpu")
    assert best_layout(torch.device("cuda"), torch.float32) == "plain"
    assert best_layout(cpu, torch.float32) == ("panels" if cpu_kernels.available() else "onednn")
    # bf16 where Baton's kernels read bf16 weights (built here, AVX2 included) or oneDNN packs them
    fast = cpu_kernels.stores(torch.bfloat16) or onednn_packs(torch.bfloat16)
    assert resolve_dtype("auto", cpu) == (torch.bfloat16 if fast else torch.float32)
    weight, x = torch.randn(64, 32), torch.randn(3, 32)
    torch.testing.assert_close(Linear(weight, layout="onednn")(x), F.linear(x, weight), rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="unknown weight layout"):
        Linear(weight, layout="fancy")


def test_core_lists_parse_and_split():
    assert threads.parse_cores("0-3,6") == [0, 1, 2, 3, 6]
    for bad in ("", "a", "3-1", "-2"):
        with pytest.raises(ValueError):
            threads.parse_cores(bad)
    assert threads.split_cores(2, [0, 1, 2, 3, 4]) == ["0,1,2", "3,4"]
    assert threads.split_cores(3, [0, 1]) == ["", "", ""]  # fewer cores than workers: they share


def test_baton_up_gives_each_worker_its_cores_or_one_thread(monkeypatch):
    from baton.launch.up import LocalCluster

    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    cores = threads.usable_cores()
    pair = LocalCluster(prefill=1, decode=1, share_cores=True).worker_args
    many = LocalCluster(prefill=len(cores), decode=1, share_cores=True).worker_args
    if len(cores) >= 2:
        assert [args[0] for args in pair] == ["--cpu-cores"] * 2 and pair[0][1] != pair[1][1]
    assert many == [("--threads", "1")] * (len(cores) + 1)
    assert LocalCluster(prefill=1, decode=1).worker_args == [(), ()]  # tests and benchmarks: no binding


def test_a_worker_binds_to_its_cores_and_runs_one_thread_per_core():
    code = ("import os, torch; from baton.engine import threads; n = threads.configure(0, '0'); "
            "print(n, torch.get_num_threads(), sorted(os.sched_getaffinity(0)))")
    env = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, env=env)
    assert out.stdout.split() == ["1", "1", "[0]"]
    with pytest.raises(ValueError, match="do not exist"):
        threads.configure(1, f"{os.cpu_count() + 5}")


def test_cuda_graphs_are_on_by_default_and_can_be_turned_off(monkeypatch, tiny_model):
    from baton.cli import build_parser, load_role_settings

    monkeypatch.delenv("BATON_MODEL_CUDA_GRAPHS", raising=False)
    assert load_role_settings(build_parser().parse_args(["decode"])).model.cuda_graphs is True
    assert load_role_settings(build_parser().parse_args(["decode", "--no-cuda-graphs"])).model.cuda_graphs is False
    monkeypatch.setenv("BATON_MODEL_CUDA_GRAPHS", "false")
    assert load_role_settings(build_parser().parse_args(["prefill"])).model.cuda_graphs is False
    assert build_parser().parse_args(["generate", "--no-cuda-graphs", "hi"]).cuda_graphs is False
    assert LlamaRunner(tiny_model).graphs is None, "no graphs on a CPU"


@pytest.mark.parametrize("page_size", [1, 4, 16])
def test_paged_kv_writes_and_reads_any_span_of_a_rows_pages(page_size):
    """Runs of tokens starting and ending inside pages, across pages in any order, go in and come
    back as they were, and write nothing outside their slots (a page's run at a time on the host)."""
    from baton.engine.kv import KVShape, SequenceKV
    from baton.engine.paged_kv import PagedKV

    shape = KVShape(num_layers=3, num_kv_heads=2, head_dim=8, dtype=torch.float32)
    num_pages = 90 // page_size + 8
    kv = PagedKV(shape, num_pages=num_pages, page_size=page_size)
    table = (torch.randperm(num_pages - 1, generator=torch.Generator().manual_seed(page_size))[:-(-90 // page_size)]
             + 1).tolist()  # shuffled, never the null page 0
    data = torch.randn(3, 2, 2, 90, 8)
    for lo, hi in ((0, 5), (5, 23), (23, 23), (23, 90)):  # the prompt, then pieces, as admissions write them
        kv.write(table, SequenceKV(data[:, :, :, lo:hi]), start=lo)
    assert torch.equal(kv.read(table, 90).data, data)
    for lo, hi in ((3, 7), (0, 1), (17, 90), (40, 40)):
        assert torch.equal(kv.read(table, hi, start=lo).data, data[:, :, :, lo:hi])
    untouched = [p for p in range(num_pages) if p not in table]
    assert not kv.pages[:, :, untouched].any()  # the null page and others' pages stay zero
    with pytest.raises(ValueError, match="do not fit"):
        kv.write(table, SequenceKV(data[:, :, :, :10]), start=len(table) * page_size - 5)


def test_fused_projections_and_a_workers_hand_over_leave_one_copy_of_each_weight():
    """The q, k, v and gate, up projections Baton's executor fuses become views of the fused weight
    (not a second copy: an 8B model's are 9 GB); a worker's model then lets go of its weights, so
    the runner's (fused, or packed for the CPU kernels) are the only ones left."""
    from baton.config import ModelSettings
    from baton.engine.executors import load_runner
    from baton.engine.model import load_model

    loaded = load_model("tiny-random", dtype="float32", module=False)
    runner = make_runner(loaded)
    for fused, names in ((runner.layers[1].qkv, [f"self_attn.{p}_proj" for p in "qkv"]),
                         (runner.layers[1].gate_up, ["mlp.gate_proj", "mlp.up_proj"])):
        for name in names:
            part = loaded.tensors[f"model.layers.1.{name}.weight"]
            assert part.untyped_storage().data_ptr() == fused.weight.untyped_storage().data_ptr(), name
    prompt = [5, 6, 7, 8, 9]
    held = loaded.weight_bytes
    worker = load_runner(ModelSettings(name="tiny-random", dtype="float32"))
    assert worker.loaded.tensors == {} and worker.loaded.weight_bytes == held
    assert worker.loaded.dtype == torch.float32 and worker.loaded.device.type == "cpu"
    assert torch.equal(worker.prefill(prompt).logits, runner.prefill(prompt).logits)
    with pytest.raises(ValueError, match="handed over to a runner already"):
        make_runner(worker.loaded)
