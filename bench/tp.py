"""tp (issue 48): tensor parallelism inside a worker, TP=1 against TP=2 on the same cores.

Each configuration runs in a process of its own, bound to the same cores:

- TP=1 on every core (one process, a torch thread per core): what a worker does today;
- TP=2, one rank per core over gloo (engine.tensor_parallel);
- TP=1 on one core, for scale.

Measured on a Llama-3.2-1B-shaped model with random bf16 weights (hidden 2048, 16 layers, 32
query and 8 KV heads, MLP 8192; the default tokenizer's 49,152-token vocabulary: 1.07 B
parameters, written once under the cache directory), large enough that a decode step reads
2 GB of weights, and on the default model (SmolLM2-135M), small enough that the ranks' gathers
(four a layer) outweigh the split. Figures: a prompt's prefill, the decode step at 1 and 4 rows
(best of --repeats rounds), and whether TP=2's logits are TP=1's bits.
"""
from __future__ import annotations

import argparse
import json
import multiprocessing
import time
from pathlib import Path
from typing import Any

from baton.bench.common import BenchOptions, ratio, table

DESCRIPTION = "issue 48: TP=1 vs TP=2 (gloo) on the same cores: prefill, decode step at 1 and 4 rows, same bits"
# Llama-3.2-1B's shape with the default tokenizer's vocabulary
LLAMA_1B = dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
                num_key_value_heads=8, head_dim=64, vocab_size=49152, max_position_embeddings=4096,
                rms_norm_eps=1e-5, rope_theta=500000.0, tie_word_embeddings=True, bos_token_id=1, eos_token_id=2,
                architectures=["LlamaForCausalLM"], model_type="llama", torch_dtype="bfloat16", hidden_act="silu")
STEP_ROWS = (1, 4)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--models", help="comma-separated: llama-1b (random weights, written once), default, "
                                         "tiny-random, or model directories (default llama-1b,default; quick tiny-random)")
    parser.add_argument("--prompt-tokens", type=int, help="the prefilled prompt's tokens (default 512; quick 32)")
    parser.add_argument("--steps", type=int, help="decode steps timed per round (default 8; quick 3)")
    parser.add_argument("--repeats", type=int, help="rounds, the best kept (default 3; quick 1)")


def random_llama_1b() -> Path:
    """The Llama-3.2-1B-shaped model with random bf16 weights (std 0.02), beside the default
    tokenizer: written once (about 2.1 GB)."""
    import shutil

    import torch
    from safetensors.torch import save_file

    from baton.engine.model_files import default_model_dir
    from baton.paths import cache_root

    target = cache_root() / "models" / "random-llama-1b-v1"
    if (target / "model.safetensors").is_file():
        return target
    staging = target.with_name(target.name + ".partial")
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir(parents=True)
    source = default_model_dir()
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "generation_config.json"):
        if (source / name).is_file():
            shutil.copy(source / name, staging / name)
    (staging / "config.json").write_text(json.dumps(LLAMA_1B, indent=1))
    c, generator = LLAMA_1B, torch.Generator().manual_seed(0)
    q, kv = c["num_attention_heads"] * c["head_dim"], c["num_key_value_heads"] * c["head_dim"]

    def weight(rows: int, cols: int) -> torch.Tensor:
        return (torch.randn(rows, cols, generator=generator) * 0.02).to(torch.bfloat16)

    hidden, inter = c["hidden_size"], c["intermediate_size"]
    tensors = {"model.embed_tokens.weight": weight(c["vocab_size"], hidden),
               "model.norm.weight": torch.ones(hidden, dtype=torch.bfloat16)}
    for i in range(c["num_hidden_layers"]):
        p = f"model.layers.{i}."
        tensors.update({
            p + "self_attn.q_proj.weight": weight(q, hidden), p + "self_attn.k_proj.weight": weight(kv, hidden),
            p + "self_attn.v_proj.weight": weight(kv, hidden), p + "self_attn.o_proj.weight": weight(hidden, q),
            p + "mlp.gate_proj.weight": weight(inter, hidden), p + "mlp.up_proj.weight": weight(inter, hidden),
            p + "mlp.down_proj.weight": weight(hidden, inter),
            p + "input_layernorm.weight": torch.ones(hidden, dtype=torch.bfloat16),
            p + "post_attention_layernorm.weight": torch.ones(hidden, dtype=torch.bfloat16)})
    save_file(tensors, staging / "model.safetensors", metadata={"format": "pt"})
    staging.rename(target)
    return target


def _measure(spec: dict, results) -> None:
    """In a process of its own: load the runner `spec` asks for, time it, put the figures in results."""
    try:
        from baton.config import ModelSettings
        from baton.decode_worker.paged_rows import PagedRows
        from baton.engine.executors import load_runner

        runner = load_runner(ModelSettings(name=spec["model"], dtype=spec["dtype"], threads=spec["threads"],
                                           cpu_cores=spec["cores"], tensor_parallel_size=spec["tp"]))
        prompt = [(7 * i + 11) % 30000 + 100 for i in range(spec["prompt_tokens"])]
        runner.prefill(prompt[:8])  # first touches: kernels, threads, the ranks' sockets
        best_prefill = float("inf")
        for _ in range(max(1, spec["repeats"] - 1)):
            started = time.perf_counter()
            first = runner.prefill(prompt)
            best_prefill = min(best_prefill, time.perf_counter() - started)
        figures = {"prefill_s": best_prefill, "logits": first.logits[:64].tolist()}
        shape = runner.loaded.kv_shape
        for rows in STEP_ROWS:
            pages = 2 + rows * ((spec["prompt_tokens"] + (spec["steps"] + 2) * spec["repeats"]) // 8 + 2)
            batch = PagedRows(shape, num_pages=pages, page_size=8)
            if hasattr(runner, "paged_kv"):
                batch.kv = runner.paged_kv(shape, pages * 8 * shape.bytes_per_token(), 8)
            for _ in range(rows):
                batch.add(first.kv)
            tokens = [int(first.logits.argmax())] * rows
            runner.decode(batch.kv, batch.step(), tokens)  # warm
            best = float("inf")
            for _ in range(spec["repeats"]):
                started = time.perf_counter()
                for _ in range(spec["steps"]):
                    logits = runner.decode(batch.kv, batch.step(), tokens)
                    tokens = logits.argmax(-1).tolist()
                best = min(best, (time.perf_counter() - started) / spec["steps"])
            figures[f"step_ms_{rows}"] = 1000 * best
        figures["weight_bytes"] = runner.loaded.weight_bytes
        if hasattr(runner, "close"):
            runner.close()
        results.put(figures)
    except BaseException as exc:  # noqa: BLE001 - reported by the parent
        results.put({"error": f"{type(exc).__name__}: {exc}"})


def measure(spec: dict) -> dict[str, Any]:
    context = multiprocessing.get_context("spawn")
    results = context.Queue()
    process = context.Process(target=_measure, args=(spec, results))
    process.start()
    figures = results.get()
    process.join()
    if "error" in figures:
        raise SystemExit(f"tp: {spec['label']} on {spec['model']} failed: {figures['error']}")
    return figures


def run(opts: BenchOptions) -> dict[str, Any]:
    from baton.engine import threads

    names = (opts.extra.get("models") or ("tiny-random" if opts.quick else "llama-1b,default")).split(",")
    prompt_tokens = opts.extra.get("prompt_tokens") or (32 if opts.quick else 512)
    steps = opts.extra.get("steps") or (3 if opts.quick else 8)
    repeats = opts.extra.get("repeats") or (1 if opts.quick else 3)
    cores = threads.usable_cores()[:2]
    if len(cores) < 2:
        raise SystemExit("tp compares one process on two cores with two ranks on one core each: this machine has one")
    both, one = ",".join(map(str, cores)), str(cores[-1])
    dtype = "bfloat16" if opts.dtype == "float32" and not opts.quick else opts.dtype
    configs = [("TP=1, 2 cores", 1, 2, both), ("TP=2, 1 core/rank", 2, 0, both), ("TP=1, 1 core", 1, 1, one)]
    opts.say(f"tp: {', '.join(names)} in {dtype}, a {prompt_tokens}-token prompt, decode steps at rows "
             f"{'/'.join(map(str, STEP_ROWS))}, best of {repeats}; cores {both}")
    results, rows_out = [], []
    for name in names:
        model = str(random_llama_1b()) if name == "llama-1b" else name
        measured = {}
        for label, tp, thread_count, core_list in configs:
            opts.progress(f"{name}: {label}")
            measured[label] = measure(dict(label=label, model=model, dtype=dtype, tp=tp, threads=thread_count,
                                           cores=core_list, prompt_tokens=prompt_tokens, steps=steps,
                                           repeats=repeats))
        base, split = measured["TP=1, 2 cores"], measured["TP=2, 1 core/rank"]
        same = base["logits"] == split["logits"]
        for label, figures in measured.items():
            rows_out.append([name, label, figures["prefill_s"], figures["step_ms_1"], figures["step_ms_4"],
                             ratio(base["step_ms_1"], figures["step_ms_1"]), ratio(base["prefill_s"], figures["prefill_s"])])
        results.append({"model": name, "dtype": dtype, "same_bits": same,
                        "runs": {k: {f: v for f, v in m.items() if f != "logits"} for k, m in measured.items()}})
    opts.say(table(["model", "run", "prefill s", "step ms @1", "step ms @4", "step vs TP=1/2c", "prefill vs TP=1/2c"],
                   rows_out, digits=3))
    for r in results:
        opts.say(f"{r['model']}: TP=2's logits {'are' if r['same_bits'] else 'are NOT'} TP=1's bits")
    return {"models": results, "prompt_tokens": prompt_tokens, "steps": steps, "repeats": repeats,
            "cores": both}
