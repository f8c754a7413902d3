"""invariance (issue 32, CUDA): what batch invariance costs, and whether it holds, on a GPU.

One process, one model, two executors side by side: `LlamaRunner(batch_invariant=True)` (Baton's
fixed-order Triton GEMM and RMSNorm, one-split decode attention, prefill through the decode
kernel) and `batch_invariant=False` (cuBLAS, split-K decode, the flash-style prefill kernel).
Reports the decode step at 1-64 rows (CUDA graphs) and prefill at 128-2048 tokens for each, and
whether one row's logits keep their bits beside 15 rows of other lengths. The model: SmolLM2-135M's
shape with random weights (no tokenizer needed), in bf16 unless --dtype float16.

Needs a CUDA GPU; elsewhere it says so and records {"skipped": reason}: on CPU Baton's kernels are
invariant with no switch, measured by the `engine` and `served` suites.
"""
from __future__ import annotations

import time
from typing import Any

from baton.bench.common import BenchOptions

DECODE_ROWS = (1, 4, 8, 16, 64)
PREFILL_TOKENS = (128, 512, 2048)
WINDOW = 512  # each decode row's context


def run(opts: BenchOptions) -> dict[str, Any]:
    import torch

    if not torch.cuda.is_available():
        reason = "the invariance suite needs a CUDA GPU (on CPU Baton's kernels are always invariant); skipped"
        opts.say(reason)
        return {"skipped": reason, "plots": []}
    dtype = torch.float16 if opts.dtype == "float16" else torch.bfloat16
    loaded = _model(dtype)
    gen = torch.Generator().manual_seed(1)

    def prompt(n: int) -> list[int]:
        return torch.randint(100, 40000, (n,), generator=gen).tolist()

    rows_sizes = DECODE_ROWS[:2] if opts.quick else DECODE_ROWS
    prompt_sizes = PREFILL_TOKENS[:1] if opts.quick else PREFILL_TOKENS
    target = prompt(300)
    others = [prompt(n) for n in (5, 40, 700, 129, 64, 1000, 3, 250, 17, 600, 90, 33, 512, 8, 77)]
    modes: dict[str, dict] = {}
    for invariant in (False, True):
        from baton.engine.llama import LlamaRunner

        name = "invariant" if invariant else "not invariant"
        opts.progress(name)
        runner = LlamaRunner(loaded, "triton", cuda_graphs=True, batch_invariant=invariant)
        alone, _ = _decode(runner, loaded, [target], 0, 24)
        mixed, _ = _decode(runner, loaded, others[:7] + [target] + others[7:], 7, 24)
        whole = runner.prefill(target)
        chunked = runner.prefill(target, prefix=runner.prefill(target[:128]).kv)
        mode = {"row_bits_equal": bool(torch.equal(alone, mixed)),
                "row_tokens_equal": alone.argmax(-1).tolist() == mixed.argmax(-1).tolist(),
                "chunked_prefill_bits_equal": bool(torch.equal(whole.kv.data, chunked.kv.data)
                                                   and torch.equal(whole.logits, chunked.logits)),
                "decode_ms": {}, "prefill_ms": {}}
        for n in rows_sizes:
            mode["decode_ms"][n] = _decode_ms(runner, loaded, [prompt(WINDOW) for _ in range(n)])
        for n in prompt_sizes:
            p = prompt(n)
            mode["prefill_ms"][str(n)] = _timed(lambda: runner.prefill(p), 5)
        batch = [prompt(256) for _ in range(8)]
        mode["prefill_ms"]["8x256"] = _timed(lambda: runner.prefill_batch(batch), 5)
        modes[name] = mode
    off, on = modes["not invariant"], modes["invariant"]
    opts.say(f"batch invariance on {torch.cuda.get_device_name()}, SmolLM2-135M shape (random weights), "
             f"{str(dtype).removeprefix('torch.')}, CUDA graphs")
    opts.say(f"{'':>22} {'not invariant':>14} {'invariant':>10} {'cost':>8}")
    table = []
    for kind, sizes in (("decode_ms", rows_sizes), ("prefill_ms", [*map(str, prompt_sizes), "8x256"])):
        for n in sizes:
            a, b = off[kind][n], on[kind][n]
            label = f"decode, {n} rows" if kind == "decode_ms" else f"prefill, {n} tokens"
            table.append({"what": label, "off_ms": a, "on_ms": b, "cost": b / a - 1})
            opts.say(f"{label:>22} {a:11.2f} ms {b:7.2f} ms {100 * (b / a - 1):+7.1f}%")
    for name, mode in modes.items():
        opts.say(f"{name}: a row beside 15 others keeps its logits' bits: {mode['row_bits_equal']} (greedy tokens: "
                 f"{mode['row_tokens_equal']}); a chunked prefill gives a whole one's bits: "
                 f"{mode['chunked_prefill_bits_equal']}")
    return {"device": torch.cuda.get_device_name(), "dtype": str(dtype), "modes": modes, "table": table,
            "plots": []}


def _model(dtype):
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from baton.engine.model import _finish

    cfg = LlamaConfig(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                      num_attention_heads=9, num_key_value_heads=3, max_position_embeddings=8192,
                      rope_theta=100000.0, rms_norm_eps=1e-5, tie_word_embeddings=True,
                      architectures=["LlamaForCausalLM"], initializer_range=0.05)
    torch.manual_seed(0)
    return _finish(LlamaForCausalLM(cfg), None, "smollm2-135m-shape", dtype, "cuda")


def _decode(runner, loaded, prompts: list[list[int]], at: int, steps: int):
    """Greedy steps for every prompt; row `at`'s logits at each step [steps, vocab]."""
    import torch

    from baton.decode_worker.paged_rows import PagedRows

    rows = PagedRows(loaded.kv_shape, num_pages=4096, page_size=16, device="cuda")
    tokens = []
    for p in prompts:
        pre = runner.prefill(p)
        rows.add(pre.kv)
        tokens.append(int(pre.logits.argmax()))
    seen = []
    for _ in range(steps):
        logits = runner.decode(rows.kv, rows.step(), tokens)
        seen.append(logits[at].clone())
        tokens = logits.argmax(-1).tolist()
    return torch.stack(seen), tokens


def _decode_ms(runner, loaded, prompts: list[list[int]]) -> float:
    from baton.decode_worker.paged_rows import PagedRows

    rows = PagedRows(loaded.kv_shape, num_pages=8192, page_size=16, device="cuda")
    for p in prompts:
        rows.add(runner.prefill(p).kv)
    step, ids = rows.step(), [7] * len(prompts)
    return _timed(lambda: runner.decode(rows.kv, step, ids), 50)


def _timed(fn, reps: int) -> float:
    import torch

    fn()  # compiles, captures
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(reps):
        fn()
    torch.cuda.synchronize()
    return 1e3 * (time.perf_counter() - start) / reps
