"""prefix: BatchLLM's first industry case — how much prefill the batch planner saves.

1. Planner figures on a batch shaped like the paper's first workload (`synthetic_batch`): prefill
   tokens saved (BatchLLM Eq. 2) by the planner, by the optimum (every shared tree node computed
   once), and by an arrival-order LRU prefix cache holding as many tokens as the planner's KV
   budget. Paper: 54.9% planner, 44.2% LRU, 56% optimum.
2. The planner's tokens per prefill iteration ("valleys" plot), at its KV budget and a tight one.
3. Time on the model, on a small batch of the same shape: a LocalEngine run of the batch (no
   reuse); the prefill alone without reuse vs following the plan (each group's prefix once,
   then only the distinct tokens, with the executor); and, where the router serves
   GenerateBatch, the batch end to end through a local cluster with and without planning.
4. Issue 17's shapes end to end on one local cluster: BatchLLM's microbenchmark (prefix/distinct
   2000/200, 1000/1000 and 200/2000 tokens, scaled to this CPU as 400/40, 200/200, 40/400) at
   share degree 4 and 16, and a shuffled shared-document batch (12 documents x 7 questions
   behind a 30-token chat header): the saving the workers measured under `generate_batch` vs the
   multi-level optimum vs an LRU prefix cache of the worker's size, and the seconds of
   `generate_batch` vs `generate_many` (the same shape, fresh prompts each, so neither finds the
   other's prefixes cached).
"""
from __future__ import annotations

import argparse
from typing import Any

from baton.bench import plots
from baton.bench.common import BenchOptions, Stopwatch, ratio, table
from baton.router.batch_planner import plan_batch, shared_document_batch, simulate_lru_prefix_cache, synthetic_batch

PAPER = {"planner": 0.549, "lru": 0.442, "optimum": 0.56}
BLOCK_SIZE = 16


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--no-model", action="store_true", help="planner figures only; skip the timed runs")
    parser.add_argument("--no-cluster", action="store_true", help="skip the end-to-end run through a local cluster")


def _shapes(quick: bool) -> dict[str, Any]:
    if quick:
        return {"plan": dict(num_prefixes=10, prompts_per_prefix=7, prefix_len=256, distinct_len=64),
                "kv_budget": 2048, "iteration_tokens": 512,
                "timed": dict(num_prefixes=2, prompts_per_prefix=3, prefix_len=96, distinct_len=16), "max_tokens": 4}
    return {"plan": dict(num_prefixes=43, prompts_per_prefix=7, prefix_len=512, distinct_len=128),
            "kv_budget": 4096, "iteration_tokens": 1024,
            "timed": dict(num_prefixes=4, prompts_per_prefix=5, prefix_len=384, distinct_len=48), "max_tokens": 8}


def run(opts: BenchOptions) -> dict[str, Any]:
    shapes = _shapes(opts.quick)
    result: dict[str, Any] = {"shapes": shapes, "problems": {}}
    result["planner"] = planner_figures(opts, shapes)
    files = [plots.token_batch_timeline(
        opts.plot_path("prefix_valleys.png"), "BatchLLM planner: tokens per prefill iteration",
        {f"KV budget {b} tokens": sizes for b, sizes in result["planner"]["token_batch_sizes"].items()},
        shapes["iteration_tokens"])]
    if not opts.extra.get("no_model"):
        result["timed"] = timed_figures(opts, shapes, result["problems"])
        if not opts.extra.get("no_cluster"):
            result["shapes_end_to_end"] = shape_figures(opts, result["problems"])
    result["plots"] = [str(f) for f in files]
    return result


def planner_figures(opts: BenchOptions, shapes: dict[str, Any]) -> dict[str, Any]:
    prompts = synthetic_batch(**shapes["plan"], seed=0)
    budget, per_iteration = shapes["kv_budget"], shapes["iteration_tokens"]
    clock = Stopwatch()
    plan = plan_batch(prompts, kv_token_budget=budget, max_tokens_per_iteration=per_iteration)
    plan_s = clock()
    clock = Stopwatch()
    lru = simulate_lru_prefix_cache(prompts, block_size=BLOCK_SIZE, capacity_blocks=budget // BLOCK_SIZE)
    lru_s = clock()
    total = plan.total_prompt_tokens
    tight_budget = max(g.prefix_len + g.max_distinct_len for g in plan.groups)
    tight = plan_batch(prompts, kv_token_budget=tight_budget, max_tokens_per_iteration=per_iteration)
    shared = [g for g in plan.groups if g.prefix_len]
    opts.say(f"prefix: {len(prompts)} prompts, {total} prompt tokens, {len(shared)} prefix-sharing groups "
             f"(mean {sum(g.size for g in shared) / max(1, len(shared)):.1f} prompts, mean prefix "
             f"{sum(g.prefix_len for g in shared) / max(1, len(shared)):.0f} tokens); KV budget {budget} tokens")
    rows = [
        ["BatchLLM planner", plan.computed_tokens, 100 * plan.saving_ratio, 100 * PAPER["planner"], 1e3 * plan_s],
        [f"LRU prefix cache ({budget // BLOCK_SIZE} x {BLOCK_SIZE}-token blocks)", total - lru.saved_tokens,
         100 * lru.saving_ratio, 100 * PAPER["lru"], 1e3 * lru_s],
        ["optimum (every tree node once)", total - round(plan.optimum_saving_ratio * total),
         100 * plan.optimum_saving_ratio, 100 * PAPER["optimum"], None],
        ["no reuse", total, 0.0, None, None],
    ]
    opts.say(table(["method", "prefill tokens", "saved %", "paper %", "ms"], rows, digits=1))
    opts.say(f"planner/optimum {plan.saving_ratio / plan.optimum_saving_ratio:.3f}; planner saves "
             f"{100 * (plan.saving_ratio - lru.saving_ratio):.1f} points more than LRU "
             f"(paper: {100 * (PAPER['planner'] - PAPER['lru']):.1f})")
    sizes = plan.token_batch_sizes
    opts.say(f"token batching: {len(plan.iterations)} iterations at budget {budget} (mean "
             f"{sum(sizes) / len(sizes):.0f} tokens of {per_iteration}); {len(tight.iterations)} at the tightest "
             f"budget {tight_budget}")
    return {"prompts": len(prompts), "total_prompt_tokens": total, "planner_computed": plan.computed_tokens,
            "planner_saving": plan.saving_ratio, "optimum_saving": plan.optimum_saving_ratio,
            "lru_saving": lru.saving_ratio, "lru_evicted_blocks": lru.evicted_blocks, "plan_s": plan_s,
            "lru_s": lru_s, "paper": PAPER, "groups": len(plan.groups),
            "token_batch_sizes": {str(budget): sizes, str(tight_budget): tight.token_batch_sizes},
            "peak_kv_tokens": plan.peak_kv_tokens}


def timed_figures(opts: BenchOptions, shapes: dict[str, Any], problems: dict[str, str]) -> dict[str, Any]:
    import torch

    from baton.launch.local import LocalEngine
    from baton.decode_worker.core import DecodeConfig
    from baton.engine.model import load_model
    from baton.engine.executors import make_runner
    from baton.sampling import SamplingParams

    loaded = load_model(opts.model, dtype=opts.dtype)
    prompts = synthetic_batch(**shapes["timed"], seed=1, vocab=loaded.config.vocab_size)
    max_tokens = shapes["max_tokens"]
    plan = plan_batch(prompts, kv_token_budget=1 << 20, max_tokens_per_iteration=1 << 20)
    total = plan.total_prompt_tokens
    opts.say(f"\ntimed on {loaded.name}: {len(prompts)} prompts, {total} prompt tokens, plan computes "
             f"{plan.computed_tokens} ({100 * plan.saving_ratio:.1f}% saved)")

    engine = LocalEngine(loaded, DecodeConfig(max_rows=8))
    engine.generate([prompts[0][:8]], SamplingParams(max_tokens=2))  # warm-up
    clock = Stopwatch()
    engine.generate(prompts, SamplingParams(max_tokens=max_tokens))
    local_s = clock()

    runner = make_runner(loaded)
    clock = Stopwatch()
    plain_first = [int(torch.argmax(runner.prefill(p).logits)) for p in prompts]
    plain_s = clock()
    clock = Stopwatch()
    reuse_first: dict[int, int] = {}
    for group in plan.groups:
        prefix_kv = runner.prefill(group.prefix_tokens(prompts)).kv if group.prefix_len else None
        for request_id in group.request_ids:
            if group.prefix_len >= len(prompts[request_id]):  # nothing distinct: its logits are the prefix's
                out = runner.prefill(prompts[request_id])
            else:
                out = runner.prefill(prompts[request_id], prefix=prefix_kv)
            reuse_first[request_id] = int(torch.argmax(out.logits))
    reuse_s = clock()
    agree = sum(plain_first[i] == reuse_first[i] for i in range(len(prompts)))
    rows = [["LocalEngine, whole batch, no reuse", local_s, None],
            ["prefill only, no reuse", plain_s, None],
            ["prefill only, planner's prefix reuse", reuse_s, ratio(plain_s, reuse_s)]]
    out: dict[str, Any] = {"prompts": len(prompts), "prompt_tokens": total, "computed_tokens": plan.computed_tokens,
                           "max_tokens": max_tokens, "local_engine_s": local_s, "prefill_plain_s": plain_s,
                           "prefill_reuse_s": reuse_s, "first_tokens_agree": agree}
    if not opts.extra.get("no_cluster"):
        out["cluster"] = cluster_figures(opts, prompts, max_tokens, problems)
        c = out["cluster"]
        if "without_planning_s" in c:
            rows.append(["cluster, generate_many (prefix cache only)", c["without_planning_s"], None])
        if "with_planning_s" in c:
            rows.append(["cluster, generate_batch (BatchLLM plan)", c["with_planning_s"],
                         ratio(c.get("without_planning_s"), c["with_planning_s"])])
    opts.say(table(["run", "seconds", "speedup"], rows))
    opts.say(f"first tokens equal with and without reuse: {agree}/{len(prompts)}")
    wired = "cluster" in out and "with_planning_s" in out["cluster"]
    if not wired:
        opts.say("end-to-end prefix reuse (`baton batch` / Router.GenerateBatch) is not wired yet: "
                 f"{out.get('cluster', {}).get('not_wired', 'cluster run skipped')}; the reuse figure above is the "
                 "planner's prefill executed in-process, decode excluded")
    return out


def cluster_figures(opts: BenchOptions, prompts: list[list[int]], max_tokens: int,
                    problems: dict[str, str]) -> dict[str, Any]:
    from baton.launch.up import LocalCluster
    from baton.client import BatonClient, BatonError

    requests = [{"token_ids": p, "max_tokens": max_tokens, "temperature": 0} for p in prompts]
    out: dict[str, Any] = {}
    try:
        with LocalCluster(prefill=1, decode=1, model=opts.model, max_rows=8, extra_env=opts.worker_env()) as cluster:
            with BatonClient(cluster.router_address, timeout=3600) as client:
                client.generate(token_ids=[1, 2, 3], max_tokens=2)  # warm-up
                clock = Stopwatch()
                client.generate_many(requests, max_concurrency=len(requests))
                out["without_planning_s"] = clock()
            # A fresh cluster, so no prefix is cached from the run above.
        if not hasattr(BatonClient, "generate_batch"):
            out["not_wired"] = "the client has no generate_batch"
            return out
        with LocalCluster(prefill=1, decode=1, model=opts.model, max_rows=8, extra_env=opts.worker_env()) as cluster:
            with BatonClient(cluster.router_address, timeout=3600) as client:
                client.generate(token_ids=[1, 2, 3], max_tokens=2)
                clock = Stopwatch()
                try:
                    outcome = client.generate_batch(requests)
                except BatonError as exc:
                    out["not_wired"] = f"GenerateBatch answered {exc.code}: {exc.message}"
                    return out
                out["with_planning_s"] = clock()
                out["summary"] = dict(outcome.summary)
                failed = sum(isinstance(r, BatonError) for r in outcome.results)
                if failed:
                    problems["cluster_batch"] = f"failed: {failed} of {len(requests)} batch requests failed"
    except Exception as exc:  # noqa: BLE001 - a broken cluster must not hide the planner figures
        problems["cluster"] = f"failed: {type(exc).__name__}: {exc}"
        out["not_wired"] = f"the cluster run failed ({type(exc).__name__}: {exc})"
    return out


MICRO_SHAPES = ((400, 40), (200, 200), (40, 400))  # BatchLLM's 2000/200, 1000/1000, 200/2000, scaled by 1/5
MICRO_DEGREES = (4, 16)
MICRO_PROMPTS = 32  # per shape: 8 groups of 4 or 2 groups of 16
PREFIX_CACHE_TOKENS = 8192  # the prefill worker's prefix cache in this run, and the LRU baseline's size


def micro_batch(prefix_len: int, distinct_len: int, degree: int, prompts: int, seed: int, vocab: int) -> list[list[int]]:
    """`prompts // degree` groups of `degree` prompts: a shared prefix, then a distinct part; shuffled."""
    import random

    rng = random.Random(seed)
    batch = []
    for _ in range(prompts // degree):
        prefix = rng.choices(range(vocab), k=prefix_len)
        batch.extend(prefix + rng.choices(range(vocab), k=distinct_len) for _ in range(degree))
    rng.shuffle(batch)
    return batch


def shape_figures(opts: BenchOptions, problems: dict[str, str]) -> dict[str, Any]:
    from baton.client import BatonClient
    from baton.engine.model import load_tokenizer_view
    from baton.launch.up import LocalCluster

    vocab = load_tokenizer_view(opts.model).vocab_size
    max_tokens = 4 if opts.quick else 16
    cases = [(f"{p}/{d} x{k}", lambda seed, p=p, d=d, k=k: micro_batch(p, d, k, 8 if opts.quick else MICRO_PROMPTS,
                                                                        seed, vocab))
             for p, d in (MICRO_SHAPES[:1] if opts.quick else MICRO_SHAPES)
             for k in ((4,) if opts.quick else MICRO_DEGREES)]
    cases.append(("shared documents 12x7", lambda seed: shared_document_batch(
        3 if opts.quick else 12, 7, header_len=30, document_len=60 if opts.quick else 200, question_len=12, seed=seed,
        vocab=vocab)))
    rows, results = [], []
    try:
        with LocalCluster(prefill=1, decode=1, model=opts.model, max_rows=8, extra_env=opts.worker_env(),
                          prefill_args=("--prefix-cache-bytes", str(PREFIX_CACHE_TOKENS * _kv_bytes(opts)))) as cluster:
            with BatonClient(cluster.router_address, timeout=3600) as client:
                client.generate(token_ids=[1, 2, 3], max_tokens=2)  # warm-up
                for index, (name, make) in enumerate(cases):
                    opts.progress(f"prefix: {name}")
                    many_prompts, batch_prompts = make(100 + 2 * index), make(101 + 2 * index)
                    clock = Stopwatch()
                    client.generate_many([{"token_ids": p, "max_tokens": max_tokens, "ignore_eos": True}
                                          for p in many_prompts], max_concurrency=len(many_prompts))
                    many_s = clock()
                    clock = Stopwatch()
                    outcome = client.generate_batch([{"token_ids": p, "max_tokens": max_tokens, "ignore_eos": True}
                                                     for p in batch_prompts])
                    batch_s = clock()
                    summary = dict(outcome.summary)
                    if summary.get("failed"):
                        problems[f"prefix {name}"] = f"failed: {summary['failed']} batch requests failed"
                    lru = simulate_lru_prefix_cache(batch_prompts, block_size=BLOCK_SIZE,
                                                    capacity_blocks=PREFIX_CACHE_TOKENS // BLOCK_SIZE)
                    total = sum(map(len, batch_prompts))
                    row = {"shape": name, "prompts": len(batch_prompts), "prompt_tokens": total,
                           "optimum_saving": summary["optimum_saving_ratio"],
                           "measured_saving": summary["actual_saving_ratio"], "lru_saving": lru.saved_tokens / total,
                           "generate_many_s": many_s, "generate_batch_s": batch_s}
                    results.append(row)
                    rows.append([name, len(batch_prompts), total, 100 * row["optimum_saving"],
                                 100 * row["measured_saving"], row["measured_saving"] / row["optimum_saving"],
                                 100 * row["lru_saving"], many_s, batch_s, ratio(many_s, batch_s)])
    except Exception as exc:  # noqa: BLE001 - a broken cluster must not hide the other figures
        problems["shapes"] = f"failed: {type(exc).__name__}: {exc}"
    opts.say(f"\nissue 17 shapes end to end ({opts.model}, one prefill and one decode worker, prefix cache "
             f"{PREFIX_CACHE_TOKENS} tokens, max_tokens {max_tokens}, ignore_eos):")
    opts.say(table(["shape (prefix/distinct x degree)", "prompts", "prompt tokens", "optimum %", "measured %",
                    "of optimum", "LRU %", "generate_many s", "generate_batch s", "batch speedup"], rows, digits=3))
    return {"max_tokens": max_tokens, "prefix_cache_tokens": PREFIX_CACHE_TOKENS, "results": results}


def _kv_bytes(opts: BenchOptions) -> int:
    """KV bytes per token of the model (fp32/bf16 as asked), without loading its weights."""
    from baton.engine.model import load_tokenizer_view

    cfg = load_tokenizer_view(opts.model).config
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    itemsize = 4 if opts.dtype == "float32" else 2
    return 2 * cfg.num_hidden_layers * cfg.num_key_value_heads * head_dim * itemsize
