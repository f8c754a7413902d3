"""relay: BATON Table 2 and Figs 5-7 — short chat queries whose answers vary a lot in length,
served by static batching, transformers' continuous batching, Baton local and the Baton cluster
at batch sizes 2..10. Speedups are completion times of the whole set, against static batching.
"""
from __future__ import annotations

import argparse
from typing import Any

from baton.bench import plots
from baton.bench.common import BenchOptions, Stopwatch, ratio, table
from baton.bench.engines import ENGINE_LABELS, ENGINES, EngineRun, EngineUnavailable, hf_greedy, runner_for
from baton.bench.workloads import Query, relay_queries

DESCRIPTION = "BATON Table 2 / Figs 5-7: 30 short chat queries at B=2..10; static vs continuous batching vs Baton"
PAPER_SPEEDUP_VS_STATIC = {2: 1.94, 4: 1.89, 6: 1.66, 8: 1.61, 10: 1.31}  # BATON Table 2
TARGET_LOCAL_VS_CONTINUOUS = 1.5
TARGET_CLUSTER_VS_LOCAL = 0.85
TARGET_KV_ALLOCATED_VS_USEFUL = 1.5  # issue 18: the batch KV allocated over what holds tokens
RELAY_ENGINES = ("static", "continuous", "local", "cluster")  # BATON's comparison; `engine` races the peers


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--batch-sizes", help="comma-separated (default 2,4,6,8,10; quick 4)")
    parser.add_argument("--engines", help=f"comma-separated, from {','.join(ENGINES)} (default "
                                          f"{','.join(RELAY_ENGINES)})")
    parser.add_argument("--queries", type=int, help="how many of the 30 queries (quick: 6)")
    parser.add_argument("--max-tokens", type=int, help="new tokens per query at most (default 200; quick 24)")


def run(opts: BenchOptions) -> dict[str, Any]:
    count = opts.extra.get("queries") or (6 if opts.quick else 30)
    max_tokens = opts.extra.get("max_tokens") or (24 if opts.quick else 200)
    sizes = parse_ints(opts.extra.get("batch_sizes"), [4] if opts.quick else [2, 4, 6, 8, 10])
    engines = parse_engines(opts.extra.get("engines"))
    opts.say(f"relay: {count} short chat queries, greedy, up to {max_tokens} new tokens, batch sizes "
             f"{', '.join(map(str, sizes))}")
    return race(opts, "relay", relay_queries(count, max_tokens), sizes, engines, PAPER_SPEEDUP_VS_STATIC)


def parse_ints(text: str | None, default: list[int]) -> list[int]:
    if not text:
        return default
    try:
        values = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise SystemExit(f"expected comma-separated integers, got {text!r}") from None
    if not values or min(values) < 1:
        raise SystemExit(f"batch sizes must be integers >= 1 (got {text!r})")
    return values


def parse_engines(text: str | None, default=RELAY_ENGINES) -> list[str]:
    if not text:
        return list(default)
    chosen = [e.strip() for e in text.split(",") if e.strip()]
    bad = [e for e in chosen if e not in ENGINES]
    if bad or not chosen:
        raise SystemExit(f"unknown engine(s) {', '.join(bad) or text!r}; choose from {', '.join(ENGINES)}")
    return chosen


# ------------------------------------------------------------------------------ the race


def race(opts: BenchOptions, suite: str, queries: list[Query], sizes: list[int], engines: list[str],
         paper: dict[int, float] | None) -> dict[str, Any]:
    """Run every engine at every batch size on the same prompts; tables, plots and the JSON body."""
    from baton.engine.model import load_model

    hf = load_model(opts.model, dtype=opts.dtype)
    hf.model.set_attn_implementation("sdpa")  # transformers' engines run the stock model
    # LocalEngine's executors re-point the model's weights and swap in their own attention
    baton = load_model(opts.model, dtype=opts.dtype) if any(e.startswith("local") for e in engines) else None
    prompts = [hf.encode_chat(q.chat()) for q in queries]
    caps = [q.max_tokens for q in queries]
    opts.say(f"prompt tokens: {min(map(len, prompts))}..{max(map(len, prompts))}; "
             f"torch threads per process: {opts.threads or 'default'}")

    opts.progress(f"{suite}: reference (transformers generate, one prompt at a time)")
    clock = Stopwatch()
    reference = [hf_greedy(hf, p, c) for p, c in zip(prompts, caps)]
    reference_s = clock()
    lengths = [len(r) for r in reference]
    opts.say(f"reference output lengths: min {min(lengths)}, max {max(lengths)}, mean "
             f"{sum(lengths) / len(lengths):.1f} tokens; one-at-a-time generate took {reference_s:.1f} s")

    runs: dict[tuple[str, int], EngineRun] = {}
    problems: dict[str, str] = {}
    for b in sizes:
        for engine in engines:
            if engine in problems and problems[engine].startswith("unavailable"):
                continue
            opts.progress(f"{suite}: B={b} {ENGINE_LABELS[engine]}")
            try:
                result = runner_for(engine, opts, hf, baton)(prompts, caps, b)
            except EngineUnavailable as exc:
                problems[engine] = f"unavailable: {exc}"
                continue
            except Exception as exc:  # noqa: BLE001 - one engine failing must not hide the others' figures
                problems[f"{engine}@B={b}"] = f"failed: {type(exc).__name__}: {exc}"
                opts.say(f"!! {ENGINE_LABELS[engine]} at B={b} failed: {type(exc).__name__}: {exc}")
                continue
            runs[(engine, b)] = result
            opts.progress(f"{suite}: B={b} {engine}: {result.wall_s:.1f} s, {result.tokens_per_s:.1f} tok/s")

    exact = exactness(hf, prompts, reference, runs)
    bounds = {b: ideal_speedup(lengths, b) for b in sizes}
    rows, summary = _tables(opts, runs, sizes, engines, paper, exact, bounds)
    _print_exactness(opts, exact, engines)
    kv_memory = _kv_memory(runs, sizes)
    if kv_memory:
        opts.say(f"Baton local batch KV, mean over decode steps (goal allocated/useful <= "
                 f"{TARGET_KV_ALLOCATED_VS_USEFUL}): " + ", ".join(
                     f"B={b} allocated/useful {m['allocated_over_useful']:.2f} window/useful "
                     f"{m['window_over_useful']:.2f}" for b, m in kv_memory.items()))
    for name, why in problems.items():
        opts.say(f"{name}: {why}")
    files = _plots(opts, suite, runs, sizes, engines, paper, bounds)
    return {
        "queries": [{"kind": q.kind, "prompt": q.messages[-1][1][:200], "prompt_tokens": len(p), "max_tokens": c,
                     "reference_tokens": len(r)} for q, p, c, r in zip(queries, prompts, caps, reference)],
        "reference_sequential_s": reference_s,
        "runs": [r.summary() for r in runs.values()],
        "kv_samples_local": {str(b): runs[("local", b)].kv_samples for b in sizes if ("local", b) in runs},
        "kv_memory_local": {str(b): m for b, m in kv_memory.items()},
        "cluster_stage_means_s": _stage_means(runs),
        "table": rows,
        "summary": summary,
        "paper_speedup_vs_static": paper,
        "exactness": exact,
        "problems": problems,
        "plots": files,
    }


def _kv_memory(runs, sizes) -> dict[int, dict[str, float]]:
    """Per batch size, the local engine's batch KV over its decode steps: allocated and padded
    window bytes over the bytes that hold tokens."""
    out = {}
    for b in sizes:
        samples = runs[("local", b)].kv_samples if ("local", b) in runs else []
        useful = sum(s["useful"] for s in samples)
        if useful:
            out[b] = {"allocated_over_useful": sum(s["allocated"] for s in samples) / useful,
                      "window_over_useful": sum(s["window"] for s in samples) / useful}
    return out


def ideal_speedup(lengths: list[int], batch_size: int) -> float:
    """What the output lengths alone allow over static batching, if every decode step cost the same.

    Static batching takes, per consecutive batch, as many steps as its longest answer; an ideal
    re-batcher keeps B rows busy, handing each free row the next query at no cost (greedy list
    scheduling in arrival order). The ratio of the two step counts bounds what any re-batching
    engine can gain on this query set from scheduling alone."""
    import heapq

    static = sum(max(lengths[i: i + batch_size]) for i in range(0, len(lengths), batch_size))
    rows = [0] * min(batch_size, len(lengths))
    for n in lengths:
        heapq.heappush(rows, heapq.heappop(rows) + n)
    return static / max(rows)


def exactness(hf, prompts, reference, runs: dict[tuple[str, int], EngineRun]) -> dict[str, Any]:
    """Which engines reproduce one-prompt transformers generate token for token, and where not, why."""
    per_engine: dict[str, dict[str, int]] = {}
    divergences = []
    for (engine, b), result in runs.items():
        stats = per_engine.setdefault(engine, {"compared": 0, "mismatched": 0})
        for i, (ref, got) in enumerate(zip(reference, (c.token_ids for c in result.completions))):
            stats["compared"] += 1
            if ref != got:
                stats["mismatched"] += 1
                divergences.append({"engine": engine, "batch_size": b, "query": i,
                                    **divergence(hf, prompts[i], ref, got)})
    total = sum(s["mismatched"] for s in per_engine.values())
    return {"identical": total == 0, "mismatches": total, "per_engine": per_engine, "divergences": divergences}


def divergence(hf, prompt: list[int], expected: list[int], got: list[int]) -> dict[str, Any]:
    """First differing position, and the reference model's logit gap there between the two tokens.

    A gap near zero means a near-tie: a last-bit difference from another kernel shape (a padded
    or batched matmul) flips the argmax, not a bug in what the engine attends to."""
    import torch

    k = next((i for i, (a, b) in enumerate(zip(expected, got)) if a != b), min(len(expected), len(got)))
    info: dict[str, Any] = {"position": k, "expected_len": len(expected), "got_len": len(got),
                            "expected_token": expected[k] if k < len(expected) else None,
                            "got_token": got[k] if k < len(got) else None}
    if info["expected_token"] is not None and info["got_token"] is not None:
        with torch.no_grad():
            logits = hf.model(torch.tensor([prompt + expected[:k]])).logits[0, -1].float()
        top2 = torch.topk(logits, 2).values
        info["logit_gap"] = float(logits[info["expected_token"]] - logits[info["got_token"]])
        info["top2_margin"] = float(top2[0] - top2[1])
    return info


def _tables(opts, runs, sizes, engines, paper, exact, bounds) -> tuple[list[dict], list[dict]]:
    rows: list[dict[str, Any]] = []
    mism = {}
    for d in exact["divergences"]:
        mism[(d["engine"], d["batch_size"])] = mism.get((d["engine"], d["batch_size"]), 0) + 1
    for b in sizes:
        static = runs.get(("static", b))
        for engine in engines:
            r = runs.get((engine, b))
            if r is None:
                continue
            steps = r.config.get("decode_steps")
            rows.append({"batch_size": b, "engine": engine, "wall_s": r.wall_s, "cpu_s": r.cpu_s,
                         "output_tokens": r.output_tokens,
                         "tokens_per_s": r.tokens_per_s, "decode_steps": steps,
                         "ms_per_step": 1e3 * r.wall_s / steps if steps else None,
                         "speedup_vs_static": ratio(static.wall_s, r.wall_s) if static else None,
                         "cpu_speedup_vs_static": ratio(static.cpu_s, r.cpu_s) if static else None,
                         "paper_vs_static": paper.get(b) if paper and engine == "local" else None,
                         "mismatches_vs_reference": mism.get((engine, b), 0)})
    opts.say()
    opts.say(table(["B", "engine", "time s", "cpu s", "tokens", "tok/s", "steps", "ms/step", "x static",
                    "cpu x static", "paper", "mismatch"],
                   [[r["batch_size"], ENGINE_LABELS[r["engine"]], r["wall_s"], r["cpu_s"], r["output_tokens"],
                     r["tokens_per_s"], r["decode_steps"], r["ms_per_step"], r["speedup_vs_static"],
                     r["cpu_speedup_vs_static"], r["paper_vs_static"], r["mismatches_vs_reference"]] for r in rows]))
    opts.say("time s: wall clock of the whole set; cpu s: CPU seconds of the engine's processes (the cluster's "
             "three together, which overlap in time); steps: forward passes where the engine exposes them; "
             "ms/step = time / steps, prefill included")
    summary = []
    for b in sizes:
        get = lambda e: runs[(e, b)].wall_s if (e, b) in runs else None  # noqa: E731
        cpu = lambda e: runs[(e, b)].cpu_s if (e, b) in runs else None  # noqa: E731
        summary.append({"batch_size": b, "local_vs_static": ratio(get("static"), get("local")),
                        "local_vs_static_cpu": ratio(cpu("static"), cpu("local")),
                        "local_vs_continuous_cpu": ratio(cpu("continuous"), cpu("local")),
                        "paper_vs_static": (paper or {}).get(b), "ideal_vs_static": bounds[b],
                        "continuous_vs_static": ratio(get("static"), get("continuous")),
                        "local_vs_continuous": ratio(get("continuous"), get("local")),
                        "cluster_vs_static": ratio(get("static"), get("cluster")),
                        "cluster_vs_local": ratio(get("local"), get("cluster"))})
    opts.say()
    opts.say("ratios of completion time (higher is better for the first engine named); 'ideal' is the step-count "
             "bound the reference output lengths allow over static batching at equal step cost")
    if paper:
        opts.say(f"targets: paper Table 2 (local/static), local/cont >= {TARGET_LOCAL_VS_CONTINUOUS}, "
                 f"cluster/local >= {TARGET_CLUSTER_VS_LOCAL}")
    opts.say(table(["B", "local/static", "(cpu)", "paper", "ideal", "cont/static", "local/cont", "(cpu)",
                    "cluster/static", "cluster/local"],
                   [[s["batch_size"], s["local_vs_static"], s["local_vs_static_cpu"], s["paper_vs_static"],
                     s["ideal_vs_static"], s["continuous_vs_static"], s["local_vs_continuous"],
                     s["local_vs_continuous_cpu"], s["cluster_vs_static"], s["cluster_vs_local"]] for s in summary]))
    return rows, summary


def _print_exactness(opts, exact, engines) -> None:
    opts.say()
    opts.say(f"identical greedy tokens: {'yes' if exact['identical'] else 'no'} ({exact['mismatches']} mismatches "
             "against one-prompt transformers generate)")
    for engine in engines:
        stats = exact["per_engine"].get(engine)
        if stats:
            verdict = "matches" if stats["mismatched"] == 0 else f"differs on {stats['mismatched']}"
            opts.say(f"  {ENGINE_LABELS[engine]:<24} {verdict} of {stats['compared']} query runs")
    for d in exact["divergences"][:12]:
        gap = f"logit gap {d['logit_gap']:.4f} (top-2 margin {d['top2_margin']:.4f})" if "logit_gap" in d else \
            f"lengths {d['expected_len']} vs {d['got_len']}"
        opts.say(f"  {d['engine']} B={d['batch_size']} query {d['query']}: first differs at token {d['position']}: "
                 f"{gap}")
    if len(exact["divergences"]) > 12:
        opts.say(f"  ... {len(exact['divergences']) - 12} more in the JSON")


def _stage_means(runs) -> dict[str, dict[str, float]]:
    out = {}
    for (engine, b), r in runs.items():
        if engine != "cluster":
            continue
        keys = sorted({k for c in r.completions for k in c.stages})
        out[str(b)] = {k: sum(c.stages.get(k, 0.0) for c in r.completions) / len(r.completions) for k in keys}
    return out


def _plots(opts, suite, runs, sizes, engines, paper, bounds) -> list[str]:
    files = []
    per_batch = {b: {e: ([c.finished_s for c in runs[(e, b)].completions],
                         [len(c.token_ids) for c in runs[(e, b)].completions])
                     for e in engines if (e, b) in runs} for b in sizes}
    per_batch = {b: v for b, v in per_batch.items() if v}
    if per_batch:
        files.append(plots.completion_timelines(opts.plot_path(f"{suite}_timeline.png"),
                                                f"{suite}: completed queries and their output tokens over time",
                                                per_batch))
    kv = {b: runs[("local", b)].kv_samples for b in sizes if ("local", b) in runs and runs[("local", b)].kv_samples}
    if kv:
        files.append(plots.kv_bytes(opts.plot_path(f"{suite}_kv_bytes.png"),
                                    f"{suite}: Baton local batch KV (allocated vs window vs useful)", kv))
    series = {e: [ratio(runs[("static", b)].wall_s, runs[(e, b)].wall_s)
                  if ("static", b) in runs and (e, b) in runs else None for b in sizes]
              for e in engines if e != "static"}
    if any(v is not None for vs in series.values() for v in vs):
        files.append(plots.speedups(opts.plot_path(f"{suite}_speedup.png"),
                                    f"{suite}: speedup over static batching", sizes, series, paper,
                                    [bounds[b] for b in sizes]))
    return [str(f) for f in files]
