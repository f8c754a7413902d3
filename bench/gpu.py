"""gpu (issue 46): the shapes users deploy, set against the device's own rates, in both modes.

Llama-3-8B and Llama-3.2-1B built from their configs with random weights on the device (nothing
downloaded: the bytes and FLOPs of the real models). Measured in one run:
- the floors: the copy rate (a device-to-device copy, bytes read and written over its time) and
  the matmul rate (a bf16 8192^3 torch.mm);
- decode steps of Baton's executor (CUDA graphs) at 1-256 rows of 512-16k token contexts: ms and
  the share of the floor reached, (weights read + the rows' KV) / copy rate; combinations whose
  KV would not fit the device are left out and named;
- prefill of one prompt at 512-16k tokens and of 8 x 512: ms and FLOPs / matmul rate, beside
  transformers' own forward of the same weights (SDPA);
- prefill attention alone at 2k-16k tokens: Baton's query-tiled kernel (the invariant mode's),
  Baton's flash-style Triton kernel, and torch SDPA (flash), in TFLOP/s.
Both modes: batch_invariant on (Baton's fixed-order Triton GEMM and RMSNorm, the tiled attention)
and off (cuBLAS, split-K decode, torch's flash prefill); then both again with fp8 weights
(issue 50: e4m3 with a scale per output feature) at 1-64 rows of 512 tokens and 2k-8k prompts. Without CUDA the suite measures the same
things on this CPU with a small model in fp32 (one mode: Baton's CPU kernels are invariant), a
check of the suite itself, not a GPU figure.
"""
from __future__ import annotations

import dataclasses
import time
from typing import Any

from baton.bench.common import BenchOptions

SHAPES = {  # the architectures' own configs (head_dim: hidden / heads unless given)
    "8b": dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
               num_key_value_heads=8, vocab_size=128256, tie_word_embeddings=False, rope_theta=500000.0),
    "1b": dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
               num_key_value_heads=8, head_dim=64, vocab_size=128256, tie_word_embeddings=True, rope_theta=500000.0),
    "small": dict(hidden_size=256, intermediate_size=768, num_hidden_layers=4, num_attention_heads=8,
                  num_key_value_heads=2, vocab_size=8192, tie_word_embeddings=True, rope_theta=10000.0),
}
DECODE_ROWS = (1, 8, 32, 64, 128, 256)
CONTEXTS = (512, 2048, 8192, 16384)
PREFILL_TOKENS = (512, 2048, 8192, 16384)
ATTENTION_TOKENS = (2048, 8192, 16384)
KV_SHARE = 0.6  # of the memory free after the weights: the most the decode rows' KV may take


def add_arguments(parser) -> None:
    parser.add_argument("--shapes", default=None,
                        help="comma-separated shapes among 8b, 1b, small (default: 8b,1b on CUDA; small on CPU)")


def run(opts: BenchOptions) -> dict[str, Any]:
    import torch

    cuda = torch.cuda.is_available()
    device = torch.device("cuda" if cuda else "cpu")
    dtype = torch.bfloat16 if cuda else torch.float32
    shapes = (opts.extra.get("shapes") or ("8b,1b" if cuda else "small")).split(",")
    for shape in shapes:
        if shape not in SHAPES:
            raise SystemExit(f"unknown shape {shape!r}; choose among {', '.join(SHAPES)}")
    name = torch.cuda.get_device_name() if cuda else "CPU (a check of the suite: no GPU here)"
    opts.progress("the device's rates")
    rates = {"copy_bytes_per_s": copy_rate(device, quick=opts.quick),
             "matmul_flop_per_s": matmul_rate(device, dtype, quick=opts.quick)}
    opts.say(f"gpu suite on {name}, {str(dtype).removeprefix('torch.')}: copy {rates['copy_bytes_per_s'] / 1e9:,.0f} "
             f"GB/s, matmul {rates['matmul_flop_per_s'] / 1e12:,.1f} TFLOP/s (measured now)")
    results = {"device": name, "dtype": str(dtype), "rates": rates, "shapes": {}, "plots": []}
    for shape in shapes:
        results["shapes"][shape] = run_shape(opts, shape, device, dtype, rates)
    results["attention"] = attention_table(opts, device, dtype, rates)
    return results


# -- the device's rates ---------------------------------------------------------------------

def copy_rate(device, quick: bool) -> float:
    """Bytes read and written per second by the best of several copies."""
    import torch

    n = (256 if quick else 2048) << 20
    src = torch.ones(n // 4, dtype=torch.float32, device=device)
    dst = torch.empty_like(src)
    return 2 * n / min(timed(lambda: dst.copy_(src), device, reps=1) for _ in range(5))


def matmul_rate(device, dtype, quick: bool) -> float:
    import torch

    n = 1024 if quick or device.type != "cuda" else 8192
    a, b = (torch.randn(n, n, dtype=dtype, device=device) for _ in range(2))
    return 2 * n ** 3 / min(timed(lambda: a @ b, device, reps=3) for _ in range(3))


def timed(fn, device, reps: int) -> float:
    """Seconds per call, after one untimed call (compiles, captures)."""
    import torch

    fn()
    if device.type == "cuda":
        torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(reps):
        fn()
    if device.type == "cuda":
        torch.cuda.synchronize()
    return (time.perf_counter() - start) / reps


# -- one shape ------------------------------------------------------------------------------

def build(shape: str, dtype, device, max_context: int):
    """(LoadedModel, transformers module) of the shape with random weights, made on the device."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from baton.engine.model import LoadedModel, ModelFingerprint

    cfg = LlamaConfig(**SHAPES[shape], max_position_embeddings=max_context, rms_norm_eps=1e-5,
                      architectures=["LlamaForCausalLM"], initializer_range=0.02)
    torch.manual_seed(0)
    before = torch.get_default_dtype()
    torch.set_default_dtype(dtype)  # made in its dtype on the device: an 8B model in seconds
    try:
        with torch.device(device):
            model = LlamaForCausalLM(cfg)
    finally:
        torch.set_default_dtype(before)
    model.eval().requires_grad_(False)
    model.set_attn_implementation("sdpa")
    tensors = dict(model.named_parameters(remove_duplicate=False))
    fingerprint = ModelFingerprint("LlamaForCausalLM", f"random-{shape}", str(dtype).removeprefix("torch."))
    return LoadedModel(model, None, fingerprint, f"{shape}-shape", cfg, tensors), model


def run_shape(opts: BenchOptions, shape: str, device, dtype, rates: dict) -> dict:
    import torch

    cuda = device.type == "cuda"
    few = 1 if opts.quick and not cuda else 2  # --quick on a CPU: the smallest of each, a smoke test
    contexts = CONTEXTS[:few] if opts.quick or not cuda else CONTEXTS
    prefills = PREFILL_TOKENS[:few] if opts.quick or not cuda else PREFILL_TOKENS
    rows = DECODE_ROWS[:few + 1] if opts.quick or not cuda else DECODE_ROWS
    opts.progress(f"{shape}: building it on {device}")
    loaded, module = build(shape, dtype, device, max(contexts + prefills) + 64)
    cfg = loaded.config
    kv_token = loaded.kv_shape.bytes_per_token()
    read_bytes = weights_read(loaded)
    free = torch.cuda.mem_get_info()[0] if cuda else 8 << 30
    kv_budget = int(KV_SHARE * free)
    opts.say(f"\n{shape}: {cfg.num_hidden_layers} layers, hidden {cfg.hidden_size}, {cfg.num_attention_heads}/"
             f"{cfg.num_key_value_heads} heads of {loaded.kv_shape.head_dim}, vocab {cfg.vocab_size}: weights "
             f"{loaded.weight_bytes / 1e9:.2f} GB, KV {kv_token / 1024:.0f} KiB a token")
    # (label, weights, invariant, whether every shape or the fp8 subset: 1-64 rows of 512, 2k-8k prompts)
    modes = [("invariant", loaded, True, True), ("not invariant", loaded, False, True)] if cuda else \
        [("cpu", loaded, True, True)]
    if cuda and not opts.quick:  # issue 50: the same shape with fp8 weights
        from baton.engine import fp8

        fp8_loaded = dataclasses.replace(loaded, quantization="fp8", tensors={
            k: fp8.quantize(t) if k.endswith("proj.weight") else t for k, t in loaded.tensors.items()})
        modes += [("fp8 invariant", fp8_loaded, True, False), ("fp8 not invariant", fp8_loaded, False, False)]
    decode, prefill, failed = [], [], {}
    for mode, weights, invariant, every in modes:
        try:  # one device call runs them all: a mode that fails is reported, the others still run
            measure_mode(opts, shape, mode, weights, invariant, every, rows, contexts, prefills, kv_budget, rates,
                         device, decode, prefill)
        except Exception as exc:  # noqa: BLE001
            failed[mode] = f"{type(exc).__name__}: {str(exc)[:500]}"
            opts.say(f"{shape} {mode}: FAILED {failed[mode]}")
            if cuda:
                torch.cuda.empty_cache()
    for tokens in [*prefills, "8x512"]:  # transformers' forward of the same weights, the last position's logits
        ids = torch.arange(1, 513, device=device).repeat(8, 1) if tokens == "8x512" else \
            torch.arange(1, tokens + 1, device=device)[None]
        with torch.no_grad():
            seconds = timed(lambda: module.lm_head(module.model(ids, use_cache=False).last_hidden_state[:, -1]), device,
                            reps=3)
        prefill.append({"mode": "transformers", "tokens": str(tokens), "ms": 1e3 * seconds})
    report(opts, shape, decode, prefill)
    if failed:
        opts.say(f"{shape}: modes that failed: {failed}")
    del loaded, module
    if cuda:
        torch.cuda.empty_cache()
    return {"decode": decode, "prefill": prefill, "failed": failed, "decode_read_bytes": read_bytes,
            "kv_token_bytes": kv_token}


def measure_mode(opts: BenchOptions, shape: str, mode: str, weights, invariant: bool, every: bool, rows, contexts,
                 prefills, kv_budget: int, rates: dict, device, decode: list, prefill: list) -> None:
    """One mode's decode steps and prefills, appended to decode and prefill."""
    from baton.engine.llama import LlamaRunner

    cfg = weights.config
    kv_token = weights.kv_shape.bytes_per_token()
    linear_params = sum(t.shape[0] * t.shape[1] for n, t in weights.tensors.items() if n.endswith("proj.weight"))
    runner = LlamaRunner(weights, cuda_graphs=device.type == "cuda", batch_invariant=invariant)
    if device.type == "cuda":  # the weights held once (fused projections are views): about 1.0x
        import torch

        opts.say(f"{shape} {mode}: {torch.cuda.memory_allocated(device) / 1e9:.2f} GB allocated beside the runner, "
                 f"{torch.cuda.memory_allocated(device) / weights.weight_bytes:.2f}x its weights' bytes")
    for n in rows:
        for context in contexts:
            if n > 1 and context > contexts[0] and n not in (1, 64):  # long contexts at 1 and 64 rows
                continue
            if not every and (n > 64 or context > contexts[0]):
                continue
            kv_bytes = n * context * kv_token
            if kv_bytes > kv_budget:
                decode.append({"mode": mode, "rows": n, "context": context, "skipped": "KV over the budget"})
                continue
            opts.progress(f"{shape} {mode}: decode, {n} rows of {context}")
            seconds = decode_step(runner, weights, n, context, device)
            floor = (weights_read(weights) + kv_bytes) / rates["copy_bytes_per_s"]
            decode.append({"mode": mode, "rows": n, "context": context, "ms": 1e3 * seconds,
                           "floor_ms": 1e3 * floor, "of_floor": floor / seconds})
    for tokens in [*prefills, "8x512"]:
        if not every and tokens not in (2048, 8192):
            continue
        opts.progress(f"{shape} {mode}: prefill {tokens}")
        prompts = [list(range(1, 513))] * 8 if tokens == "8x512" else [list(range(1, tokens + 1))]
        seconds = timed(lambda: runner.prefill_batch(prompts), device, reps=3)
        flops = prefill_flops(cfg, linear_params, [len(p) for p in prompts], weights.kv_shape.head_dim)
        prefill.append({"mode": mode, "tokens": str(tokens), "ms": 1e3 * seconds,
                        "of_matmul_rate": flops / seconds / rates["matmul_flop_per_s"]})
    del runner


def weights_read(loaded) -> int:
    """The bytes a decode step reads: every weight but the embedding table (a row per token),
    unless the table is the LM head too."""
    embed = loaded.tensors["model.embed_tokens.weight"]
    return loaded.weight_bytes - (0 if loaded.config.tie_word_embeddings else embed.nbytes)


def decode_step(runner, loaded, rows: int, context: int, device) -> float:
    """Seconds per decode step of `rows` rows each holding `context` tokens of (random) KV."""
    import torch

    from baton.decode_worker.paged_rows import PagedRows
    from baton.engine.kv import SequenceKV

    page_size = 16
    shape = loaded.kv_shape
    pool = PagedRows(shape, num_pages=rows * (context // page_size + 2) + 1, page_size=page_size, device=device)
    kv = SequenceKV(torch.randn(shape.num_layers, 2, shape.num_kv_heads, context, shape.head_dim,
                                device=device).to(loaded.dtype))
    for _ in range(rows):
        pool.add(kv)
    del kv
    step, ids = pool.step(), [7] * rows
    seconds = timed(lambda: runner.decode(pool.kv, step, ids), device, reps=20)
    del pool
    return seconds


def prefill_flops(cfg, linear_params: int, prompts: list[int], head_dim: int) -> float:
    """Matmul FLOPs of a prefill: every linear layer on every token, the LM head on each prompt's
    last token, causal attention (QK and PV over the columns each token sees)."""
    tokens = sum(prompts)
    attention = sum(4 * (t * (t + 1) // 2) * head_dim * cfg.num_attention_heads for t in prompts)
    return 2 * linear_params * tokens + 2 * cfg.vocab_size * cfg.hidden_size * len(prompts) + \
        attention * cfg.num_hidden_layers


def report(opts: BenchOptions, shape: str, decode: list[dict], prefill: list[dict]) -> None:
    opts.say(f"{'decode step':>28} {'ms':>9} {'floor ms':>9} {'of floor':>9}")
    for d in decode:
        label = f"{d['mode']}, {d['rows']} x {d['context']}"
        if "skipped" in d:
            opts.say(f"{label:>28} {d['skipped']}")
        else:
            opts.say(f"{label:>28} {d['ms']:9.2f} {d['floor_ms']:9.2f} {100 * d['of_floor']:8.0f}%")
    opts.say(f"{'prefill':>28} {'ms':>9} {'of matmul rate':>15}")
    for p in prefill:
        share = f"{100 * p['of_matmul_rate']:14.0f}%" if "of_matmul_rate" in p else ""
        opts.say(f"{p['mode'] + ', ' + p['tokens']:>28} {p['ms']:9.1f} {share}")


# -- prefill attention alone ----------------------------------------------------------------

def attention_table(opts: BenchOptions, device, dtype, rates: dict) -> list[dict]:
    """One layer's prefill attention of the 8B shape (32 query heads, 8 KV heads of 128) at
    several lengths: TFLOP/s of each implementation on the same inputs."""
    import torch
    import torch.nn.functional as F

    cuda = device.type == "cuda"
    heads, kv_heads, head_dim = (32, 8, 128) if cuda else (8, 2, 64)
    lengths = ATTENTION_TOKENS[:1] if opts.quick or not cuda else ATTENTION_TOKENS
    lengths = lengths if cuda else (256,)
    implementations = {"torch SDPA": lambda q, k, v: F.scaled_dot_product_attention(
        q.transpose(0, 1)[None], k[None], v[None], is_causal=True, enable_gqa=True)}
    if cuda:
        from baton.engine.kernels import prefill_attention, prefill_over_pages

        implementations["Baton tiled (invariant)"] = lambda q, k, v: prefill_over_pages(q, k[None], v[None])
        implementations["Baton flash-style Triton"] = lambda q, k, v: prefill_attention(q, k, v, 0, None)
    else:
        from baton.engine.cpu import kernels as cpu_kernels

        implementations["Baton C (decode's kernel)"] = lambda q, k, v: cpu_kernels.prefill_attention(
            q, k[None], v[None], None, None, head_dim ** -0.5)
    rows = []
    opts.say(f"\nprefill attention, {heads}/{kv_heads} heads of {head_dim}, causal")
    for t in lengths:
        gen = torch.Generator(device=device).manual_seed(t)
        q = torch.randn(t, heads, head_dim, generator=gen, device=device).to(dtype)
        k, v = (torch.randn(kv_heads, t, head_dim, generator=gen, device=device).to(dtype) for _ in range(2))
        flops = 4 * (t * (t + 1) // 2) * head_dim * heads
        for label, fn in implementations.items():
            opts.progress(f"attention {t}: {label}")
            seconds = timed(lambda: fn(q, k, v), device, reps=3)
            rows.append({"tokens": t, "implementation": label, "ms": 1e3 * seconds, "tflop_per_s": flops / seconds / 1e12,
                         "of_matmul_rate": flops / seconds / rates["matmul_flop_per_s"]})
            opts.say(f"{t:>7} {label:>28} {1e3 * seconds:9.2f} ms {flops / seconds / 1e12:8.1f} TFLOP/s")
    return rows
